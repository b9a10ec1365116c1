"""Arrivals onto running streams: R streams running, then a burst of B requests arrives at once; how the running
streams' chunks are spaced while the burst is admitted, and how fast the burst starts.

    python tools/bench.py arrival-burst --model CKPT --running 128 --burst 128 --out burst.json
    python tools/bench.py arrival-burst --model CKPT --running 64 --pool-kwargs '{"running_prefill_tokens": 2048}'

Per round: R requests start together; --settle seconds after the last of them has its first chunk, B requests are
submitted at once. The burst window runs from that submit to the last burst request's first chunk. For the running
streams, over the gaps between consecutive chunks that overlap the window: the largest gap and how many exceeded the
chunk's real-time length (its audio seconds: a listener holding only that chunk would hear silence), with the largest
gap of the second before the burst beside it; and their underruns (a listener from each stream's first chunk). For
the burst: TTFB (from its submit) and its underruns. Each request's text is numbered at its start by round and
request (no prefix-cache hits, this round's or an earlier one's) unless --same-text. Throughput: the audio of every
stream from the burst's submit to the round's end, per second. One warm-up round, then --iters counted rounds per row.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from tools.benchmarks import harness as bl

COLUMNS = [("running_max_gap_s", "gapmax", "7.3f"), ("steady_max_gap_s", "steady", "7.3f"),
           ("chunk_s", "chunk", "6.3f"), ("running_gaps_over_chunk", "over", "5d"),
           ("running_streams_with_underrun", "run-und", "7d"), ("burst_admit_s", "admit", "6.3f")]


async def _follow(target: bl.Target, req: bl.Req, t0: float, rec: dict[str, list[float]]) -> None:
    """Stream one request, appending its chunks' arrival times (on the round's clock) and audio seconds as they
    come, so the round can watch the running streams start."""
    async for at, seconds in target.stream(req):
        rec["arrivals"].append(at - t0)
        rec["durations"].append(seconds)


def _window_gaps(rec: dict[str, list[float]], start: float, end: float) -> list[tuple[float, float]]:
    """(gap, audio seconds of the chunk before it) for each pair of consecutive chunks whose gap overlaps
    [start, end]."""
    a, d = rec["arrivals"], rec["durations"]
    return [(a[i] - a[i - 1], d[i - 1]) for i in range(1, len(a)) if a[i] > start and a[i - 1] < end]


def _text(a: argparse.Namespace, round_index: int, i: int) -> str:
    """Request i's text in a round: unless --same-text, numbered at its start by round and request, so that no
    prompt comes from the prefix cache (freed blocks keep their contents until reused: an earlier round's prompts
    would be found there); a burst of different texts costs its whole prefill, the same text is prefilled once."""
    return a.text if a.same_text else f"Round {round_index}, number {i}. {a.text}"


async def one_round(target: bl.Target, a: argparse.Namespace, round_index: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    running = [{"arrivals": [], "durations": []} for _ in range(a.running)]
    tasks = [asyncio.create_task(_follow(target, bl.Req(_text(a, round_index, i), a.patches, seed=i), t0, rec))
             for i, rec in enumerate(running)]
    deadline = time.perf_counter() + a.start_timeout
    while not all(rec["arrivals"] for rec in running):
        if time.perf_counter() > deadline or any(t.done() and t.exception() for t in tasks):
            for t in tasks:
                t.cancel()
            raise RuntimeError("the running streams did not all start")
        await asyncio.sleep(0.002)
    await asyncio.sleep(a.settle)
    burst_at = time.perf_counter() - t0
    arrivals = [{"arrivals": [], "durations": []} for _ in range(a.burst)]
    tasks += [asyncio.create_task(_follow(
        target, bl.Req(_text(a, round_index, 10_000 + i), a.burst_patches, seed=10_000 + i), t0, rec))
        for i, rec in enumerate(arrivals)]
    outs = await asyncio.gather(*tasks, return_exceptions=True)
    end = time.perf_counter() - t0
    errors = bl.errors_of(outs)
    done = [rec for rec in arrivals if rec["arrivals"]]
    window_end = max((rec["arrivals"][0] for rec in done), default=burst_at)
    gaps = [g for rec in running for g in _window_gaps(rec, burst_at, window_end)]
    steady = [g for rec in running for g, _ in _window_gaps(rec, burst_at - 1.0, burst_at)]
    run_recs = [bl.request_record(r["arrivals"], r["durations"]) for r in running if r["arrivals"]]
    burst_recs = [bl.request_record(r["arrivals"], r["durations"], burst_at) for r in done]
    every = [r for r in (*running, *done) if r["arrivals"]]
    return {"gaps": gaps, "steady": steady, "run": run_recs, "burst": burst_recs, "errors": errors,
            "admit_s": window_end - burst_at, "throughput": bl.audio_in_window(every, burst_at, end) / (end - burst_at),
            "mem": await asyncio.to_thread(bl.gpu_mem_used_mib, target.gpu)}


async def rounds(target: bl.Target, a: argparse.Namespace, bar: Any) -> dict[str, Any]:
    counted = []
    for it in range(a.iters + 1):
        bar.set_postfix_str(f"running={a.running} burst={a.burst} round={'warm-up' if it == 0 else it}")
        r = await one_round(target, a, it)
        bar.update()
        if it:
            counted.append(r)
    gaps = [g for r in counted for g in r["gaps"]]
    run_recs = [x for r in counted for x in r["run"]]
    burst = bl.request_stats([x for r in counted for x in r["burst"]], [e for r in counted for e in r["errors"]])
    return {
        "label": f"running={a.running} burst={a.burst}", "concurrency": a.running + a.burst, **burst,
        "throughput_audio_s_per_s": bl.mean([r["throughput"] for r in counted]),
        "gpu_mem_used_mib_max": max((r["mem"] for r in counted if r["mem"] is not None), default=None),
        "running_max_gap_s": max((g for g, _ in gaps), default=None),
        "running_gap_p99_s": bl.percentile([g for g, _ in gaps], 99),
        "steady_max_gap_s": max((g for r in counted for g in r["steady"]), default=None),
        "chunk_s": max((d for _, d in gaps), default=None),
        "running_gaps_over_chunk": sum(1 for g, d in gaps if g > d + bl.GAP_TOLERANCE_S),
        "running_gaps_in_window": len(gaps),
        "running_streams": len(run_recs),
        "running_streams_with_underrun": sum(1 for x in run_recs if x["gaps"] > 0),
        "burst_admit_s": max(r["admit_s"] for r in counted),
        "burst_admit_s_each": [r["admit_s"] for r in counted],
        "max_gap_s_each": [max((g for g, _ in r["gaps"]), default=None) for r in counted],
    }


def main(argv: list[str]) -> dict[str, Any]:
    ap = bl.parser(__doc__, "arrival-burst", conc=None, patches=100, iters=2)
    ap.add_argument("--running", type=int, default=128, help="streams running before the burst")
    ap.add_argument("--burst", type=int, default=128, help="requests arriving at once")
    ap.add_argument("--burst-patches", type=int, default=40, help="patches per burst request")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds from the last running stream's first chunk to the burst")
    ap.add_argument("--same-text", action="store_true",
                    help="every request the same text (after the first, prompts come from the prefix cache)")
    ap.add_argument("--start-timeout", type=float, default=120.0, help="seconds the running streams may take to start")
    a = ap.parse_args(argv)
    a = bl.finish_args(ap, a, a.running + a.burst, argv, "arrival-burst")

    async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
        run.add(await rounds(target, a, bar))

    params = {"running": a.running, "burst": a.burst, "burst_patches": a.burst_patches, "settle_s": a.settle,
              "same_text": a.same_text,
              "iters": a.iters}
    return bl.run_tool("arrival_burst", a, params, body, total=a.iters + 1, extra_columns=COLUMNS, unit="round")
