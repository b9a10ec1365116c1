"""Prompt family hot path: many requests reusing one cached continuation prompt (the prefix cache can serve
their shared prefill blocks) against the same load with a different prompt per request.

    python tools/bench_prompt_family.py --model CKPT --conc 8,32 --out family.json
    python tools/bench_prompt_family.py --target http --url URL --conc 8

Modes (rows, at each concurrency; one warm-up burst each):
- shared-same: one prompt, the same text -> the whole prefill but its last token can come from the cache;
- shared-varied: one prompt, a different sentence per request ("Line i: ..." in front) -> only the prompt
  transcript's blocks are shared (the layout is text(prompt transcript + target) then the prompt's audio);
- distinct: a different synthetic clip per request (registered before its burst, never reused) -> no sharing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

MODES = ("shared-same", "shared-varied", "distinct")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = bl.parser(__doc__, conc="8", patches=40, iters=2)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    a = ap.parse_args(argv)
    a.modes = bl.parse_choices(ap, "--modes", a.modes, MODES)
    return bl.finish_args(ap, a, max(a.conc), argv, __file__)


async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
    shared = await target.voice("prompt", bl.synthetic_clip_wav(a.clip_seconds))
    next_seed = 1  # clip seeds of the distinct mode: each used once in the whole run
    for c in a.conc:
        for m in a.modes:
            prepared: dict[int, list[bl.Req]] = {}
            for it in range(a.iters + 1):  # registered ahead, outside the timed bursts
                if m == "distinct":
                    voices = [await target.voice("prompt", clip) for clip in bl.clips(c, a.clip_seconds, next_seed)]
                    next_seed += c
                    prepared[it] = [bl.Req(a.text, a.patches, v) for v in voices]
                elif m == "shared-varied":
                    prepared[it] = [bl.Req(f"Line {it * c + i}: {a.text}", a.patches, shared) for i in range(c)]
                else:
                    prepared[it] = [bl.Req(a.text, a.patches, shared) for _ in range(c)]
            row = await bl.bursts(target, lambda it, n, p=prepared: p[it], c, a.iters, bar, label=f"{m} c={c}")
            row["mode"] = m
            run.add(row)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    params = {"modes": a.modes, "iters": a.iters, "conc": a.conc}
    return bl.run_tool("prompt_family", a, params, body, total=len(a.conc) * len(a.modes) * (a.iters + 1))


if __name__ == "__main__":
    main()
