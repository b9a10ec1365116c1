"""Kernels compiled when the image is built, so that a pod on an empty cache volume compiles none.

`python -m engine.startup.prebuild --out DIR` (engine/startup/prebuild.py; the Dockerfile runs it) compiles, on a
machine with no GPU, every record of the shipped kernel manifests for each architecture they were recorded on, each
signature's launcher and Triton's CUDA driver module, into a Triton kernel cache at DIR (`prebuild`). A service started
with `NANOVLLM_PREBUILT_KERNELS_DIR=DIR` copies what its own kernel cache lacks from there before its workers start
(`seed`): the start-up's precompile then finds every record cached and starts no compiler, and its workers build no C
module. Without a driver the C modules are linked against a symbol-less libcuda.so.1 made here (`link_stub`, what the
CUDA toolkit's link stubs are for): they name the library, and the real driver supplies its symbols where they run.

Imports no torch (the supervisor seeds the cache before it spawns the workers).
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.startup.kernel_cache import compiler_count, missing_records, shipped_records
from engine.startup.kernel_compiler import CompilerProcesses

log = logging.getLogger(__name__)

LIBCUDA = "libcuda.so.1"


def driver_found() -> bool:
    """Whether Triton would find a CUDA driver library to link its C modules against."""
    from triton.backends.nvidia.driver import libcuda_dirs
    try:
        return bool(libcuda_dirs())
    except Exception:  # Triton asserts when ldconfig knows no libcuda.so.1
        return False


def link_stub(directory: Path, cc: str) -> dict[str, str]:
    """A libcuda.so.1 that defines nothing, and a wrapper of the C compiler `cc` that records it as needed even so
    (toolchains that link "as needed" drop a library that supplies no symbol at link time), made in `directory`: the
    variables that have Triton link its C modules against them (LD_LIBRARY_PATH: to put before the caller's own)."""
    source = directory / "libcuda_stub.c"
    source.write_text("/* no symbols: the real driver supplies them where the linked module runs */\n")
    built = subprocess.run([cc, "-shared", "-fPIC", f"-Wl,-soname,{LIBCUDA}", "-o", str(directory / LIBCUDA),
                            str(source)], capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"{cc} could not build the libcuda stub: {built.stderr[-2000:]}")
    wrapper = directory / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(cc)} -Wl,--no-as-needed "$@"\n')
    wrapper.chmod(0o755)
    return {"CC": str(wrapper), "TRITON_LIBCUDA_PATH": str(directory), "LD_LIBRARY_PATH": str(directory)}


def prebuild(env: dict[str, str], workers: int) -> dict[str, dict[str, Any]]:
    """Compile every shipped record missing from the kernel cache, in compiler processes of environment `env` (its
    TRITON_CACHE_DIR names the cache, as this process's must), at most `workers` at once: what was compiled, by
    architecture."""
    stats: dict[str, dict[str, Any]] = {}
    for arch, records in shipped_records().items():
        t0 = time.perf_counter()
        missing, unusable = missing_records(records, arch)
        result: dict[str, Any] = {"records": len(records), "missing": len(missing), "unusable": unusable}
        if missing:
            count = max(1, min(workers, compiler_count(len(missing))))
            result.update(CompilerProcesses(missing, arch, count, env).collect())
        result["seconds"] = round(time.perf_counter() - t0, 1)
        stats[f"sm_{arch}"] = result
    return stats


def complete(stats: dict[str, dict[str, Any]]) -> bool:
    """Whether a prebuild (`prebuild`'s stats) left nothing for a start-up to compile: some records, every one compiled
    with its launcher, and the driver module (an incomplete image would compile them at every pod's start)."""
    def arch_complete(v: dict[str, Any]) -> bool:
        if not v["records"] or v["unusable"]:
            return False
        return not v["missing"] or (not v["precompile_failed"] and v["launchers_ready"] == v["precompiled"]
                                    and v["driver_utils_ready"])

    return bool(stats) and all(arch_complete(v) for v in stats.values())


def seed(prebuilt: Path, cache: Path) -> int:
    """Copy into the kernel cache `cache` each entry of `prebuilt` it lacks (an entry is one Triton cache key's folder,
    moved into place whole, so that a reader never sees half of one): the number copied. Triton's group files name
    their members by absolute path: the copies name the copied members."""
    if not prebuilt.is_dir():
        log.warning("no prebuilt kernels at %s: the kernel cache is not seeded", prebuilt)
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    copied = 0
    for entry in prebuilt.iterdir():
        target = cache / entry.name
        if not entry.is_dir() or (target.exists() and any(target.iterdir())):  # a lookup leaves an empty folder
            continue
        partial = Path(tempfile.mkdtemp(prefix=f".{entry.name}.seeding-", dir=cache))
        try:
            shutil.copytree(entry, partial, dirs_exist_ok=True)
            for group in partial.glob("__grp__*"):
                members = json.loads(group.read_text(encoding="utf-8"))
                members["child_paths"] = {k: str(target / Path(v).name) for k, v in members["child_paths"].items()}
                group.write_text(json.dumps(members), encoding="utf-8")
            if target.exists():
                target.rmdir()
            partial.rename(target)
            copied += 1
        except OSError as e:  # another process seeded it meanwhile, or no room: that entry compiles at first use
            log.warning("kernel cache entry %s not seeded: %s", entry.name, e)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return copied
