"""Open-loop arrival rate: requests arrive as a Poisson process at --rate per second for --duration
seconds, each streamed however loaded the target is (no client-side limit); one row per rate.

    python tools/bench_open_loop.py --model CKPT --rate 1,2,4 --duration 60 --out open.json
    python tools/bench_open_loop.py --target http --url URL --rate 0.5,1 --duration 120

TTFB counts from the scheduled arrival, so it includes queueing. Reported besides the usual metrics:
offered and achieved arrival rates, completion rate, the drain time after the last arrival window,
requests in flight, the engine's queue depth (pool snapshot or the service's voxcpm_queue_depth gauge) and
an estimate of the queueing wait (TTFB minus the TTFB of one request alone, measured first).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

EXTRA = [("offered_rps", "offer/s", "7.2f"), ("achieved_rps", "arr/s", "7.2f"), ("completed_rps", "done/s", "7.2f"),
         ("queue_wait_est_p95", "qwait95", "7.3f"), ("in_flight_max", "inflight", "8d"),
         ("queue_depth_max", "queue", "5d"), ("drain_s", "drain", "6.1f")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = bl.parser(__doc__, conc=None, patches=100, iters=None, duration=60.0)
    ap.add_argument("--rate", type=bl.positive_floats, default=bl.positive_floats("1"),
                    help="comma-separated arrival rates, requests per second (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    ap.add_argument("--voice", choices=bl.VOICE_KINDS, default="zeroshot")
    a = ap.parse_args(argv)
    # max_num_seqs: room for what is in flight at the highest rate (Little's law with RTF 1 as the bound)
    seqs = min(max(8, round(2 * max(a.rate) * a.patches * 0.16)), 128)
    return bl.finish_args(ap, a, seqs, argv, __file__)


async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
    voice = await target.voice(a.voice, bl.synthetic_clip_wav(a.clip_seconds))

    def make(i: int) -> bl.Req:
        return bl.Req(a.text, a.patches, voice)

    # the idle TTFB (and the warm-up): a few requests alone, the best of them
    idle = []
    for _ in range(2):
        t0 = time.perf_counter()
        idle.append((await bl.timed_stream(target, make(-1), t0))["ttfb"])
    for rate in a.rate:
        bar.set_postfix_str(f"rate={rate:g}/s")
        run.add(await bl.open_loop(target, rate, a.duration, make, a.seed, idle_ttfb=min(idle), bar=bar))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    params = {"rates": a.rate, "duration_s": a.duration, "seed": a.seed, "voice": a.voice}
    return bl.run_tool("open_loop", a, params, body, total=None, extra_columns=EXTRA, unit="req")


if __name__ == "__main__":
    main()
