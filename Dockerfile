# voxcpm-serve image. Dependencies come from the committed uv.lock (PyPI torch 2.11 CUDA build; runs on
# CPU too). Without NANOVLLM_MODEL_PATH it serves an embedded random-weight demo checkpoint: mount real
# weights and set NANOVLLM_MODEL_PATH (see README "Configuration").
FROM python:3.12-slim

ENV UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 PYTHONUNBUFFERED=1 NANOVLLM_CACHE_DIR=/var/cache/voxcpm-serve
# Triton builds a small C launcher per kernel signature at run time (on a GPU): it needs a C compiler and libc
# headers, which the slim image lacks ("Failed to find C compiler"). The builds are cached in the kernel cache.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir uv==0.13.8
WORKDIR /app
COPY pyproject.toml uv.lock README.md ./
# Runtime dependencies only: the dev group (test oracle, openai client, ...) stays out of the image.
RUN uv sync --frozen --no-dev --no-install-project
COPY engine ./engine
COPY service ./service
# Then the GPU kernels the shipped manifests name, compiled now (no GPU needed: the C modules are linked against a
# stub of the driver): a pod starting on an empty cache volume copies them into its kernel cache and compiles none.
RUN uv sync --frozen --no-dev && .venv/bin/python -m engine.startup.prebuild --out /app/kernels
ENV NANOVLLM_PREBUILT_KERNELS_DIR=/app/kernels PATH=/app/.venv/bin:$PATH
# Not root: the service needs to write only its cache volume (voices, compiled kernels, the demo checkpoint).
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin voxcpm \
    && mkdir -p /var/cache/voxcpm-serve && chown 10001:10001 /var/cache/voxcpm-serve
USER 10001
EXPOSE 8000
# Liveness: /health; readiness (model loaded and warm): /ready — see deployment/k8s/deployment.yaml. Smoke test of
# a built image (loads the model, generates one patch, exits 0 or says why not): docker run IMAGE voxcpm-serve check
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["/app/.venv/bin/voxcpm-serve"]
