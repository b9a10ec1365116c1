"""Compile the GPU kernels of the shipped kernel manifests into a Triton kernel cache, on a machine with or without a
GPU (engine/startup/prebuilt.py): what the Dockerfile runs, so that a pod seeded from it compiles nothing.

    python -m engine.startup.prebuild --out /app/kernels        # then NANOVLLM_PREBUILT_KERNELS_DIR=/app/kernels

Exits 1 when anything a start-up needs did not build (a record, a launcher, the driver module, or no manifest of this
Triton release line at all). Imports no torch, as engine/startup/prebuilt.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the kernel cache to fill (created if missing)")
    ap.add_argument("--workers", type=int, default=16, help="most compiler processes at once (one per core but one)")
    ap.add_argument("--cc", default=shutil.which("gcc") or shutil.which("clang") or "cc",
                    help="the C compiler for the launchers (default: gcc, else clang)")
    ap.add_argument("--link-stub", action="store_true",
                    help="link against a libcuda stub even where a driver is installed (as an image build does)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(args.out.resolve())  # this process's cache lookups and its compilers'

    from engine.startup import prebuilt

    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="voxcpm-libcuda-stub-") as stub:
        linked = "the installed driver"
        if args.link_stub or not prebuilt.driver_found():
            added = prebuilt.link_stub(Path(stub), args.cc)
            added["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (added["LD_LIBRARY_PATH"],
                                                                   env.get("LD_LIBRARY_PATH")) if p)
            env.update(added)
            linked = "a libcuda stub"
        built = prebuilt.prebuild(env, args.workers)
    print(json.dumps({"linked_against": linked, **built}))
    return 0 if prebuilt.complete(built) else 1


if __name__ == "__main__":
    sys.exit(main())
