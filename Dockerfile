# voxcpm-serve image. Dependencies come from the committed uv.lock (PyPI torch 2.11 CUDA build, runs on
# CPU too). The HTTP entry point (voxcpm-serve) arrives with the service issue; until then the image
# runs the engine's parity test suite.
FROM python:3.12-slim

ENV UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 PYTHONUNBUFFERED=1
RUN pip install --no-cache-dir uv
WORKDIR /app
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-install-project
COPY engine ./engine
COPY service ./service
COPY tools ./tools
COPY tests ./tests
RUN uv sync --frozen
CMD ["uv", "run", "--frozen", "pytest", "-q"]
