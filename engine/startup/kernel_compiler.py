"""The kernel-compiling child process of the start-up precompile (`engine.startup.kernel_cache.CompilerProcesses`).

Kept apart from `engine.startup.kernel_cache` and free of torch: fifteen of these start at once while the workers import
and load, and torch's import (~2 s alone, more with fifteen at once) was most of a child's start. The kernel
modules import torch on first use only (`engine.lazy_torch`), which compiling a record never makes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

COMPILER_NICENESS = 10


def source_and_options(record: dict[str, Any], arch: int) -> tuple[Any, Any, Any]:
    """(ASTSource, target, options) that `triton.compile` turns into the same cache entry as the JIT's compile of
    this record (the reconstruction of `JITFunction.preload`)."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    module, name = record["name"].rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name)
    constexprs = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
                  tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
                  for k, v in zip(record["constant_keys"], record["constant_vals"], strict=True)}
    attrs = {tuple(k): v for k, v in zip(record["attrs_keys"], record["attrs_vals"], strict=True)}
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in record["signature"].items()}
    target = GPUTarget("cuda", arch, 32)
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in record["options"].items()}
    options = make_backend(target).parse_options(options)
    return ASTSource(fn, signature, constexprs, attrs), target, options


def compile_record(record: dict[str, Any], arch: int) -> tuple[float, bool]:
    """Compile one record into the kernel cache (no GPU needed), and its launcher where this machine can build it:
    (seconds taken, launcher built)."""
    import triton
    t0 = time.perf_counter()
    src, target, options = source_and_options(record, arch)
    kernel = triton.compile(src, target=target, options=options.__dict__)
    try:
        # The launch stub of a signature is a C module of its own, built with the C compiler and linked against
        # libcuda on first use, cached beside the kernels (one build per signature: ~0.3 s each, serial otherwise).
        from triton.backends.nvidia.driver import CudaLauncher
        CudaLauncher(src, kernel.metadata)
        launcher = True
    except Exception:  # no libcuda or no C compiler here: the engine builds it on first use, as before
        launcher = False
    return time.perf_counter() - t0, launcher


def build_driver_utils() -> bool:
    """Build Triton's CUDA driver module (a C module like the launchers, built once per cache on first use) into the
    kernel cache: whether this machine could."""
    try:
        from triton.backends.nvidia.driver import CudaUtils
        CudaUtils()
        return True
    except Exception:  # no libcuda or no C compiler here: the engine builds it on first use, as before
        return False


def _claim(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:  # another child has it
        return False


def compiler_main() -> None:
    """A child of `CompilerProcesses` (argv: arch, the work folder with records.json): claims records until none is
    left; one JSON line out per record it claimed. The first child to claim it also builds the driver module."""
    arch, workdir = int(sys.argv[1]), Path(sys.argv[2])
    # Behind the worker it races: on an empty cache the worker's imports are the start-up's critical path, and the
    # compiles have slack (docs/benchmarks.md, cold start).
    os.nice(COMPILER_NICENESS)
    # The C modules built here are loaded only to be cached, and never call the driver: binding its symbols lazily
    # lets them load against the symbol-less libcuda stub of a machine without a GPU (engine/startup/prebuilt.py).
    sys.setdlopenflags(os.RTLD_LAZY)
    if _claim(workdir / "driver.claim"):
        print(json.dumps({"driver_utils": build_driver_utils()}), flush=True)
    for i, record in enumerate(json.loads((workdir / "records.json").read_text(encoding="utf-8"))):
        if not _claim(workdir / f"{i}.claim"):
            continue
        try:
            seconds, launcher = compile_record(record, arch)
            print(json.dumps({"ok": True, "name": record.get("name"), "s": round(seconds, 3), "launcher": launcher}),
                  flush=True)
        except Exception as e:  # one bad record costs only itself
            print(json.dumps({"ok": False, "name": record.get("name"), "error": f"{type(e).__name__}: {e}"[:500]}),
                  flush=True)
