#!/usr/bin/env bash
# Download into .whl/ the wheels a GPU host without network needs beyond its image (Python 3.12, x86-64, a CUDA
# image with torch), for
#  (a) voxcpm-serve's engine (soundfile, soxr and what they need) and
#  (b) nano-vllm-voxcpm==2.0.5 with its runtime needs (pydantic, librosa, ...),
# following Requires-Dist recursively and skipping what the image already has. flash-attn is skipped:
# ../shared/bench/flash_attn_shim replaces it and is copied to .whl/flash_attn_shim so it travels with .whl/.
# On the GPU host: see tools/gpu_host/bench.sh (it installs these to /tmp/site).
#
#   bash tools/gpu_host/fetch_wheels.sh            # fresh .whl/ (old wheels removed first)
#   KEEP=1 bash tools/gpu_host/fetch_wheels.sh     # keep what is there, add what is missing
#   EXTRA="pkg==1.2" bash tools/gpu_host/fetch_wheels.sh   # more roots (space-separated requirements)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"   # any local Python with pip; it only downloads, never installs
SHIM_SRC="${SHIM_SRC:-$ROOT/../shared/bench/flash_attn_shim}"
DEST=.whl

# .whl/ must never be committed: ignore it in this checkout only.
EXCLUDE="$(git rev-parse --git-path info/exclude)"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >>"$EXCLUDE"

if [[ "${KEEP:-0}" != 1 ]]; then
    rm -rf "$DEST"   # one version of each package, or the --no-deps install on the GPU host stops
fi
mkdir -p "$DEST"

# Roots. (a): what engine/ imports beyond the image (engine/io/audio.py: soundfile, soxr), and what the service
# needs (fastapi, uvicorn with uvloop and httptools, pydantic-settings, lameenc), at the versions of uv.lock;
# py-spy for profiling the service. (b): the benchmark peer. Extra roots from $EXTRA.
locked() {  # NAME==VERSION as uv.lock pins it
    local v
    v=$(grep -A1 "^name = \"$1\"$" uv.lock | sed -n 's/^version = "\(.*\)"/\1/p' | head -1)
    echo "$1${v:+==$v}"
}
SERVICE=""
for n in fastapi starlette pydantic pydantic-core pydantic-settings uvicorn uvloop httptools lameenc redis websockets \
        wetext inflect python-stretch sentencex; do
    SERVICE+="$(locked $n) "
done
ROOTS="soundfile soxr $SERVICE py-spy nano-vllm-voxcpm==2.0.5 ${EXTRA:-}"

"$PYTHON" - "$DEST" $ROOTS <<'PY'
import re
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.markers import Marker  # noqa: F401
    from pip._vendor.packaging.requirements import Requirement

dest = Path(sys.argv[1])
roots = sys.argv[2:]

# pip download for the GPU host's platform (CPython 3.12, manylinux x86-64), whatever this machine's Python is.
PIP = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
       "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
       "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform",
       "manylinux1_x86_64", "-q", "-d", str(dest)]
# Marker environment of the GPU host (python3 there is CPython 3.12.3 on Linux x86-64), no extras.
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
# Installed in the GPU host's image, as its package list read on 2026-11-17.
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
yarl zipp""".split())
# Never fetched: flash-attn has no wheel for the image (the shim stands in); torchcodec is declared by
# nano-vllm-voxcpm but never imported by it, and would need FFmpeg libraries the image lacks.
SKIP = {"flash-attn", "torchcodec"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_meta(path: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    name = version = ""
    deps = []
    for line in text.splitlines():
        if not line.strip():
            break  # headers end at the first blank line
        key, _, val = line.partition(":")
        if key == "Name":
            name = val.strip()
        elif key == "Version":
            version = val.strip()
        elif key == "Requires-Dist":
            deps.append(val.strip())
    return norm(name), version, deps


def have() -> dict[str, tuple[str, Path]]:
    return {n: (v, p) for p in dest.glob("*.whl") for n, v, _ in [wheel_meta(p)]}


queue = [Requirement(r) for r in roots]
seen: set[str] = set()
why: dict[str, str] = {norm(r.name): "root" for r in queue}
from_image: set[str] = set()  # requirements left to the image, printed so versions can be checked there
while queue:
    req = queue.pop(0)
    name = norm(req.name)
    if name in seen:
        continue
    seen.add(name)
    got = have()
    if name not in got:
        spec = f"{req.name}{req.specifier}"
        print(f"fetch {spec:40s} ({why.get(name, '?')})", flush=True)
        res = subprocess.run(PIP + [spec], stderr=subprocess.PIPE, text=True)
        # This machine's pip config names local indexes that may be absent; keep only real messages.
        for line in res.stderr.splitlines():
            if "is ignored: it is neither a file nor a directory" not in line:
                print(line, file=sys.stderr)
        if res.returncode:
            sys.exit(f"pip download {spec} failed")
        got = have()
    version, path = got[name]
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        print(f"WARNING: {name} {version} in .whl does not satisfy {req}", flush=True)
    for dep in wheel_meta(path)[2]:
        d = Requirement(dep)
        if d.marker is not None and not d.marker.evaluate(ENV):
            continue  # an extra, or another platform / Python
        dn = norm(d.name)
        if dn in IMAGE or dn in SKIP:
            if dn in IMAGE:
                from_image.add(f"{dn}{d.specifier}")
            continue
        why.setdefault(dn, f"needed by {name}")
        queue.append(d)

print("\nleft to the image (tools/gpu_host/bench.sh checks the versions there):", " ".join(sorted(from_image)))
print("\nwheels in .whl/:")
for n, (v, p) in sorted(have().items()):
    print(f"  {p.stat().st_size / 2**20:7.2f} MiB  {n}=={v}  ({why.get(n, 'kept')})")
PY

if [[ -d "$SHIM_SRC/flash_attn" ]]; then
    rm -rf "$DEST/flash_attn_shim"
    mkdir -p "$DEST/flash_attn_shim"
    cp -r "$SHIM_SRC/flash_attn" "$DEST/flash_attn_shim/"
    find "$DEST/flash_attn_shim" -name __pycache__ -prune -exec rm -rf {} +
    echo "copied flash_attn shim -> $DEST/flash_attn_shim (PYTHONPATH entry for nano-vllm-voxcpm)"
else
    echo "WARNING: no flash_attn shim at $SHIM_SRC: nano-vllm-voxcpm will not import on the GPU host" >&2
fi

bytes=$(du -sb "$DEST" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "total .whl/: $mib MiB ($bytes bytes; copied to the GPU host with the tree, 64 MiB in all at most)"
if (( bytes > 50 * 1048576 )); then
    echo "WARNING: over 50 MiB; the working tree plus .whl/ may pass the 64 MiB a copy to the GPU host may hold" >&2
fi
