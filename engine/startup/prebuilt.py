"""Kernels compiled when the image is built, so that a pod on an empty cache volume compiles none.

`python -m engine.startup.prebuilt --out DIR` compiles, on a machine with no GPU, every record of the shipped kernel
manifests for each architecture they were recorded on, each signature's launcher and Triton's CUDA driver module,
into a Triton kernel cache at DIR (the Dockerfile does this). A service started with `NANOVLLM_PREBUILT_KERNELS_DIR=DIR`
copies what its own kernel cache lacks from there before its workers start (`seed`): the start-up's precompile
then finds every record cached and starts no compiler, and its workers build no C module. Without a driver the C
modules are linked against a symbol-less libcuda.so.1 made here (what the CUDA toolkit's link stubs are for): they
name the library, and the real driver supplies its symbols where they run.

Imports no torch (the supervisor seeds the cache before it spawns the workers).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LIBCUDA = "libcuda.so.1"


def driver_found() -> bool:
    """Whether Triton would find a CUDA driver library to link its C modules against."""
    from triton.backends.nvidia.driver import libcuda_dirs
    try:
        return bool(libcuda_dirs())
    except Exception:  # Triton asserts when ldconfig knows no libcuda.so.1
        return False


def link_stub(directory: Path) -> dict[str, str]:
    """A libcuda.so.1 that defines nothing, and a C compiler that records it as needed even so (toolchains that link
    "as needed" drop a library that supplies no symbol at link time), in `directory`: the environment that has Triton
    link its C modules against them."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or "cc"
    source = directory / "libcuda_stub.c"
    source.write_text("/* no symbols: the real driver supplies them where the linked module runs */\n")
    subprocess.run([cc, "-shared", "-fPIC", f"-Wl,-soname,{LIBCUDA}", "-o", str(directory / LIBCUDA), str(source)],
                   check=True, capture_output=True)
    wrapper = directory / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(cc)} -Wl,--no-as-needed "$@"\n')
    wrapper.chmod(0o755)
    return {"CC": str(wrapper), "TRITON_LIBCUDA_PATH": str(directory),  # where Triton links against it
            "LD_LIBRARY_PATH": os.pathsep.join(p for p in (str(directory), os.environ.get("LD_LIBRARY_PATH")) if p)}


def prebuild(out: Path, workers: int) -> dict[str, Any]:
    """Compile every shipped record missing from the kernel cache `out` (this process's TRITON_CACHE_DIR must name it,
    as `main` arranges) in `workers` child processes per architecture: what was compiled, by architecture."""
    from engine.startup.kernel_cache import CompilerProcesses, is_cached, shipped_records

    env = dict(os.environ)
    stats: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="voxcpm-libcuda-stub-") as stub:
        if not driver_found():
            env.update(link_stub(Path(stub)))
            stats["linked_against"] = "a libcuda stub"
        for arch, records in shipped_records().items():
            t0 = time.perf_counter()
            missing, unusable = [], 0
            for record in records:
                try:
                    if not is_cached(record, arch):
                        missing.append(record)
                except Exception as e:  # a record that no longer fits its kernel
                    log.warning("kernel manifest record for %s unusable: %s", record.get("name"), e)
                    unusable += 1
            result: dict[str, Any] = {"records": len(records), "missing": len(missing), "unusable": unusable}
            if missing:
                result.update(CompilerProcesses(missing, arch, max(1, min(workers, len(missing))), env).collect())
            result["seconds"] = round(time.perf_counter() - t0, 1)
            stats[f"sm_{arch}"] = result
    return stats


def seed(prebuilt: Path, cache: Path) -> int:
    """Copy into the kernel cache `cache` each entry of `prebuilt` it lacks (an entry is one Triton cache key's folder,
    moved into place whole, so that a reader never sees half of one): the number copied."""
    if not prebuilt.is_dir():
        log.warning("no prebuilt kernels at %s: the kernel cache is not seeded", prebuilt)
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    copied = 0
    for entry in prebuilt.iterdir():
        target = cache / entry.name
        if not entry.is_dir() or target.exists():
            continue
        partial = cache / f".{entry.name}.seeding-{os.getpid()}"
        shutil.copytree(entry, partial)
        try:
            partial.rename(target)
            copied += 1
        except OSError:  # another process seeded it meanwhile
            shutil.rmtree(partial, ignore_errors=True)
    return copied


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.startup.prebuilt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the kernel cache to fill (created if missing)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="compiler processes (default: one per core but one)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(args.out.resolve())  # this process's cache lookups and its children's
    stats = prebuild(args.out, args.workers)
    print(json.dumps(stats))
    # an image whose kernels or C modules did not all build would compile them at every pod's start: fail the build
    incomplete = [arch for arch, v in stats.items() if isinstance(v, dict) and (v["unusable"] or v["missing"] and (
        v["precompile_failed"] or v["launchers_ready"] < v["precompiled"] or not v["driver_utils_ready"]))]
    return 1 if incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
