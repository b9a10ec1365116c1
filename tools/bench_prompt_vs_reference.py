"""Prompt vs reference hot path: the same text in each conditioning mode, the voice cached beforehand
(prompt = continuation prompt by id; reference = reference clip; hifi = both from one clip), one request at
a time (c=1) and in bursts of c.

    python tools/bench_prompt_vs_reference.py --model CKPT --conc 1,8 --out pvr.json
    python tools/bench_prompt_vs_reference.py --target http --url URL --modes zeroshot,prompt,reference,hifi

Over HTTP the ids come from /add_prompt, /add_reference and /add_hifi; in process the pool caches the
prompt (add_prompt) and the reference latents travel with each request (the pool has no reference cache).
Rows interleave the modes at each concurrency, each with its own warm-up burst.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = bl.parser(__doc__, conc="1,8", patches=40, iters=2)
    ap.add_argument("--modes", default="prompt,reference,hifi",
                    help=f"comma-separated conditioning modes, of {', '.join(bl.VOICE_KINDS)}")
    a = ap.parse_args(argv)
    a.modes = bl.parse_choices(ap, "--modes", a.modes, bl.VOICE_KINDS)
    return bl.finish_args(ap, a, max(a.conc), argv, __file__)


async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
    clip = bl.synthetic_clip_wav(a.clip_seconds)
    voices = {m: await target.voice(m, clip) for m in a.modes}
    for c in a.conc:
        for m in a.modes:
            row = await bl.bursts(target, lambda it, n, m=m: [bl.Req(a.text, a.patches, voices[m]) for _ in range(n)],
                                  c, a.iters, bar, label=f"{m} c={c}")
            row["mode"] = m
            run.add(row)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    params = {"modes": a.modes, "iters": a.iters, "conc": a.conc}
    return bl.run_tool("prompt_vs_reference", a, params, body, total=len(a.conc) * len(a.modes) * (a.iters + 1))


if __name__ == "__main__":
    main()
