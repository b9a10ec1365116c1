"""Write a random-weight checkpoint in the official VoxCPM layout.

    uv run python tools/make_random_checkpoint.py --preset tiny-voxcpm2 --out /tmp/tiny-v2
    uv run python tools/make_random_checkpoint.py --preset full-voxcpm2 --never-stop --out /data/full-v2

Presets: tiny-voxcpm2, tiny-voxcpm1.5, tiny-voxcpm0.5b (a few MB, seconds on CPU), full-voxcpm2
(the released VoxCPM2 config: 2.3 B parameters, ~4.6 GB in bf16) and full-voxcpm0.5b (VoxCPM-0.5B's). The official
`voxcpm` package loads the result with no missing or unexpected keys.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.io.random_checkpoint import PRESETS, make_random_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=PRESETS, default="tiny-voxcpm2")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    stop = ap.add_mutually_exclusive_group()
    stop.add_argument("--never-stop", action="store_true", help="stop head never fires: fixed-length generation")
    stop.add_argument("--always-stop", action="store_true", help="stop head fires as soon as min_len allows")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], help="override config.json dtype")
    ap.add_argument("--vae-format", choices=["pth", "safetensors"], default="pth")
    a = ap.parse_args()
    t0 = time.perf_counter()
    out = make_random_checkpoint(
        a.out, a.preset, seed=a.seed, stop="never" if a.never_stop else "always" if a.always_stop else "random",
        vae_format=a.vae_format, progress=True, config_overrides={"dtype": a.dtype} if a.dtype else None)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(json.dumps({"out": str(out), "preset": a.preset, "seed": a.seed, "bytes": size,
                      "seconds": round(time.perf_counter() - t0, 2)}))


if __name__ == "__main__":
    main()
