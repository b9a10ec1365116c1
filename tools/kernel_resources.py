"""Registers, spills and shared memory of the shipped kernel manifests' records, compiled here for a GPU architecture
without a GPU (Triton's compiler, then `cuobjdump -res-usage` from Triton's bundled CUDA tools): a kernel change's
register pressure, and whether it spills, checked before device time is spent on it.

    python tools/kernel_resources.py                                  # every shipped record, sm_90
    python tools/kernel_resources.py --only dense_attention,dwconv --out resources.json

A row per record: the kernel, its constexprs by name, warps, registers a thread, stack bytes a thread (spills and
locals: 0 is what a hot kernel wants), shared memory bytes, and how many of its programs one SM holds by registers.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.startup import kernel_cache  # noqa: E402
from engine.startup.kernel_compiler import source_and_options  # noqa: E402

REGISTERS_PER_SM = 65536  # sm_80 to sm_90

RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resources(record: dict[str, Any], arch: int) -> dict[str, Any]:
    """One record compiled for `arch`: its resource use as the cubin states it."""
    import triton
    from triton import knobs

    src, target, options = source_and_options(record, arch)
    kernel = triton.compile(src, target=target, options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    found = RES_USAGE.search(usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {record['name']}:\n{usage}")
    regs, stack, static_shared, local = (int(v) for v in found.groups())
    warps = options.num_warps
    names = src.fn.arg_names
    return {"kernel": record["name"].rsplit(".", 1)[1],
            "constexprs": {names[k[0]]: v for k, v in zip(record["constant_keys"], record["constant_vals"],
                                                           strict=True)},
            "num_warps": warps, "registers": regs, "stack_bytes": stack, "local_bytes": local,
            "shared_bytes": static_shared + kernel.metadata.shared,
            "programs_per_sm_by_registers": REGISTERS_PER_SM // max(1, regs * 32 * warps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 of the shipped manifests to compile")
    ap.add_argument("--only", help="comma-separated parts of kernel names (default: every record)")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    records = kernel_cache.shipped_records().get(a.arch, [])
    if a.only:
        parts = a.only.split(",")
        records = [r for r in records if any(p in r["name"] for p in parts)]
    if not records:
        print(f"no shipped record for sm_{a.arch}" + (f" matching {a.only}" if a.only else ""), file=sys.stderr)
        return 1
    rows = []
    for record in records:
        row = resources(record, a.arch)
        rows.append(row)
        print(f"{row['kernel']:<28} warps {row['num_warps']}  regs {row['registers']:>3}  stack {row['stack_bytes']:>5}"
              f"  shared {row['shared_bytes']:>6}  per SM {row['programs_per_sm_by_registers']}  "
              f"{json.dumps(row['constexprs'])}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"arch": a.arch, "rows": rows}, indent=1))
    spilling = [r for r in rows if r["stack_bytes"]]
    print(f"{len(rows)} records, {len(spilling)} with stack bytes (spills or locals)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
