"""Read the big CUDA libraries a worker is about to use into the OS page cache, from a background thread of the
pool's parent, while the workers spawn and import.

Why: on a freshly started H100 machine the first engine's KV sizing and graph capture took 4.7 + 5.0 s against
1.7 + 3.3 s in every later process (docs/benchmarks.md, run 11), with no kernel compiled. CUDA loads cuBLAS's and
cuDNN's kernels lazily, on first use, out of libraries of hundreds of MB; on a cold disk each first use waits for
page faults one after another. One sequential read of those files ahead of the worker makes them page-cache hits.
It only reads (no GPU, no import of CUDA code), and any error just ends it. VOXCPM_WARM_LIBRARIES=0 turns it off.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENABLED = os.environ.get("VOXCPM_WARM_LIBRARIES", "1") != "0"
# In the order a worker first needs them: torch's CUDA code (import), cuBLAS (the first GEMM), cuDNN (the VAE's
# convolutions at KV sizing), Triton's compiler (a kernel missing from the cache).
PATTERNS = ("torch/lib/libtorch_cuda.so", "torch/lib/libc10_cuda.so", "nvidia/*/lib/libcublasLt.so*",
            "nvidia/*/lib/libcublas.so*", "nvidia/cudnn/lib/libcudnn_engines_precompiled.so*",
            "nvidia/cudnn/lib/libcudnn_heuristic.so*", "nvidia/cudnn/lib/libcudnn_ops.so*",
            "nvidia/cudnn/lib/libcudnn_cnn.so*", "nvidia/cudnn/lib/libcudnn_graph.so*",
            "nvidia/cudnn/lib/libcudnn_engines_runtime_compiled.so*", "triton/_C/libtriton.so")
CHUNK = 8 << 20


def library_files() -> list[Path]:
    """The files of PATTERNS that exist under the installed packages' roots (each file once)."""
    roots = []
    for package in ("torch", "nvidia", "triton"):
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            root = Path(location).parent
            if root not in roots:
                roots.append(root)
    files: list[Path] = []
    for pattern in PATTERNS:
        for root in roots:
            for path in sorted(root.glob(pattern)):
                real = path.resolve()
                if real.is_file() and real not in files:
                    files.append(real)
    return files


def read_files(files: list[Path]) -> tuple[int, float]:
    """Read the files through once; (bytes read, seconds)."""
    t0, total = time.perf_counter(), 0
    buf = bytearray(CHUNK)
    for path in files:
        try:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
        except OSError as e:
            log.debug("warm libraries: %s: %s", path, e)
    return total, time.perf_counter() - t0


def start() -> dict[str, float | int | bool]:
    """Start the background read; returns its stats, filled in when it ends ({} when off or nothing to read):
    files, megabytes, seconds, done."""
    stats: dict[str, float | int | bool] = {}
    if not ENABLED:
        return stats
    try:
        files = library_files()
    except Exception as e:  # an odd installation only costs the optimisation
        log.debug("warm libraries off: %s", e)
        return stats
    if not files:
        return stats
    stats.update(files=len(files), done=False)

    def run() -> None:
        total, seconds = read_files(files)
        stats.update(megabytes=round(total / 1e6), seconds=round(seconds, 2), done=True)
        log.info("read %d CUDA libraries (%.0f MB) into the page cache in %.1f s", len(files), total / 1e6, seconds)

    threading.Thread(target=run, name="voxcpm-warm-libraries", daemon=True).start()
    return stats
