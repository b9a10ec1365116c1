"""Does a seeded request give the same audio alone, again (its prompt then in the prefix cache) and inside a burst?

For each mode (default kernels, and VOXCPM_BATCH_INVARIANT=1) one pool on the checkpoint: the probe request alone,
then again, then with BURST - 1 other requests submitted beside it; the largest difference from the first run, in the
waveform and in LSB of 16-bit audio, and whether the bytes are equal.

    python tools/check_determinism.py --model /tmp/full --out determinism.json [--modes default,exact]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import VoxCPM  # noqa: E402

PROBE = "The same request, sent again and again: its audio should not move."
OTHERS = "Another voice in the batch, number {i}, speaking its own words."


async def _collect(pool, text: str, seed: int, patches: int) -> np.ndarray:
    return np.concatenate([c async for c in pool.generate(text, seed=seed, max_generate_length=patches)])


async def _measure(model: str, burst: int, patches: int, seed: int) -> dict:
    pool = VoxCPM.from_pretrained(model, max_num_seqs=max(16, burst), max_model_len=1024)
    try:
        await pool.wait_for_ready()
        t0 = time.perf_counter()
        first = await _collect(pool, PROBE, seed, patches)
        again = await _collect(pool, PROBE, seed, patches)
        together = await asyncio.gather(_collect(pool, PROBE, seed, patches),
                                        *(_collect(pool, OTHERS.format(i=i), 100 + i, patches)
                                          for i in range(burst - 1)))
        out = {"seconds": round(time.perf_counter() - t0, 2), "samples": len(first)}
        for name, audio in (("again", again), ("in_burst", together[0])):
            same_length = len(audio) == len(first)
            diff = float(np.abs(audio - first).max()) if same_length else float("inf")
            out[name] = {"equal_bytes": same_length and audio.tobytes() == first.tobytes(), "max_abs_diff": diff,
                         "max_lsb_16bit": round(diff * 32767, 1)}
        return out
    finally:
        await pool.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--modes", default="default,exact", help="default (the kernels chosen by the batch), exact "
                    "(VOXCPM_BATCH_INVARIANT=1)")
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--patches", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    doc = {"command": " ".join(sys.argv), "date": dt.date.today().isoformat(), "results": {}}
    for mode in args.modes.split(","):
        # The pool's EngineConfig reads the VOXCPM_* variables when it is made, in this process.
        os.environ["VOXCPM_BATCH_INVARIANT"] = "1" if mode == "exact" else ""
        doc["results"][mode] = asyncio.run(_measure(args.model, args.burst, args.patches, args.seed))
        print(mode, json.dumps(doc["results"][mode]), flush=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
