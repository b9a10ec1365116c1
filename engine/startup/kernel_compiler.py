"""The kernel-compiling child process of the start-up precompile and the parent's handle on a set of them
(`CompilerProcesses`).

Kept apart from `engine.startup.kernel_cache` and free of torch: fifteen of these start at once while the workers import
and load, and torch's import (~2 s alone, more with fifteen at once) was most of a child's start. The kernel
modules import torch on first use only (`engine.lazy_torch`), which compiling a record never makes.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

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


class CompilerProcesses:
    """Child processes compiling records into the kernel cache. Each child claims the next record nobody has taken
    (an exclusive create of a file named by its index), so long and short compiles spread evenly. Subprocesses rather
    than multiprocessing: the engine runs in a daemonic process, which may not start multiprocessing children; and
    none of them may touch the parent's CUDA state."""

    def __init__(self, records: list[dict[str, Any]], arch: int, workers: int,
                 env: dict[str, str] | None = None) -> None:
        """env: the children's environment (default: this process's)."""
        self.records = len(records)
        self.workdir = Path(tempfile.mkdtemp(prefix="voxcpm-precompile-"))
        (self.workdir / "records.json").write_text(json.dumps(records), encoding="utf-8")
        root = str(Path(__file__).resolve().parent.parent)  # where `engine` is importable from
        command = [sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); "
                   "from engine.startup.kernel_compiler import compiler_main; compiler_main()", str(arch),
                   str(self.workdir)]
        self.procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                      for _ in range(max(1, min(workers, len(records))))]

    def collect(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait for every child (a child still running after `timeout_s` in all is killed): records compiled and
        failed (a record a child claimed but never reported, crashed or killed, counts as failed), launchers
        ready, and the slowest record's seconds."""
        deadline = time.monotonic() + timeout_s
        results = []
        for proc in self.procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            for line in out.splitlines():
                try:
                    results.append(json.loads(line))
                except json.JSONDecodeError:  # anything else a compiler printed
                    continue
            if proc.returncode != 0:
                log.warning("kernel compiler process exited with %s: %s", proc.returncode, err[-2000:])
        self.close()
        records = [r for r in results if isinstance(r, dict) and "ok" in r]
        ok = [r for r in records if r["ok"]]
        for r in records:
            if not r["ok"]:
                log.info("precompiling %s failed (the JIT will compile it): %s", r.get("name"), r.get("error"))
        return {"precompiled": len(ok), "precompile_failed": self.records - len(ok),
                "launchers_ready": sum(bool(r.get("launcher")) for r in ok),
                "driver_utils_ready": any(isinstance(r, dict) and r.get("driver_utils") for r in results),
                "slowest_record_s": max((r.get("s", 0.0) for r in ok), default=0.0)}

    def kill(self) -> None:
        """Kill the children still running (safe beside a thread in `collect`, which then returns)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def close(self) -> None:
        """Kill what still runs and remove the work folder (also when the engine gives up on start-up)."""
        running = [proc for proc in self.procs if proc.poll() is None]
        self.kill()
        for proc in running:
            proc.communicate()
        shutil.rmtree(self.workdir, ignore_errors=True)
