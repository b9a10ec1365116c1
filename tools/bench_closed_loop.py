"""Closed-loop users: N users, each sending its next streamed request as soon as the previous one ends,
for --warmup + --duration seconds; one row per user count.

    python tools/bench_closed_loop.py --model CKPT --conc 8,32,64 --duration 60 --out closed.json
    python tools/bench_closed_loop.py --target http --url URL --conc 16 --duration 120 --voice hifi

Counted: the requests started inside the measured window (those still running at its end finish first).
Throughput = audio seconds that arrived inside the window / its length; achieved rps = requests started in
the window / its length. Also sampled: requests in flight and the engine's queue (pool snapshot or the
service's voxcpm_queue_depth gauge), GPU memory every 2 s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

EXTRA = [("started", "started", "7d"), ("achieved_rps", "req/s", "7.2f"), ("in_flight_mean", "inflight", "8.1f"),
         ("queue_depth_max", "queue", "5d"), ("drain_s", "drain", "6.1f")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = bl.parser(__doc__, conc="8", patches=100, iters=None, duration=60.0)
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds before the measured window")
    ap.add_argument("--voice", choices=bl.VOICE_KINDS, default="zeroshot")
    a = ap.parse_args(argv)
    return bl.finish_args(ap, a, max(a.conc), argv, __file__)


async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
    voice = await target.voice(a.voice, bl.synthetic_clip_wav(a.clip_seconds))
    for users in a.conc:
        bar.set_postfix_str(f"users={users}")
        run.add(await bl.closed_loop(target, users, a.duration, a.warmup, lambda i: bl.Req(a.text, a.patches, voice),
                                     bar))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    params = {"users": a.conc, "duration_s": a.duration, "warmup_s": a.warmup, "voice": a.voice}
    return bl.run_tool("closed_loop", a, params, body, total=None, extra_columns=EXTRA, unit="req")


if __name__ == "__main__":
    main()
