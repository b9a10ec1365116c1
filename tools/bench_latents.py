"""Latent concurrency: bursts of c simultaneous requests that each carry the voice prompt inline as latents
(`prompt_latents` + `prompt_text`; over HTTP `prompt_latents_base64` from /encode_latents), nothing cached.

    python tools/bench_latents.py --model CKPT --conc 1,8,32,64 --out latents.json
    python tools/bench_latents.py --target http --url http://127.0.0.1:8000 --conc 1,8,32 --out latents_http.json

Per concurrency: one warm-up burst, then --iters counted bursts (the protocol of tools/bench_stream.py).
--voice zeroshot runs the same bursts without a prompt, as the baseline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = bl.parser(__doc__, conc="1,8,32,64", patches=100, iters=2)
    ap.add_argument("--voice", choices=["latents", "zeroshot"], default="latents",
                    help="latents: the synthetic clip as inline prompt latents; zeroshot: no prompt")
    a = ap.parse_args(argv)
    return bl.finish_args(ap, a, max(a.conc), argv, __file__)


async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
    voice = await target.voice(a.voice, bl.synthetic_clip_wav(a.clip_seconds))
    for c in a.conc:
        row = await bl.bursts(target, lambda it, n: [bl.Req(a.text, a.patches, voice) for _ in range(n)], c,
                              a.iters, bar, label=f"{a.voice} c={c}")
        run.add(row)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    params = {"voice": a.voice, "iters": a.iters, "conc": a.conc}
    return bl.run_tool("latents", a, params, body, total=len(a.conc) * (a.iters + 1))


if __name__ == "__main__":
    main()
