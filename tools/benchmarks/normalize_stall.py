"""What `normalize: true` costs an API process's event loop: its longest stall while texts are normalised.

    python tools/bench.py normalize-stall --texts 8 --out normalize.json

wetext's matcher holds the GIL, so normalising on a thread stalls the event loop (and the encoder threads) of the
process it runs in. For each text kind (prose; text dense with amounts), --texts segments of --chars characters are
normalised one after another, as a long text's segments are, once on a thread (`asyncio.to_thread`) and once in the
service's normalisation process (`service.normalize_process`), while a task on the loop sleeps 1 ms in a loop: the
longest and the p99 gap between its wake-ups, and the wall time. Both ways load the grammars before timing.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from service.normalize import load, normalize
from service.normalize_process import NormalizeProcess
from tools.benchmarks.harness import command_line, subcommand_parser, write_json

KINDS = {
    "prose": "Dr. Smith paid $3.14 for tea, e.g. at noon on Friday, 2025-09-28. The weather was fine and we walked. ",
    "amounts": "$3.50 ",
}


async def stalls(run: Callable[[str], Awaitable[str]], texts: list[str]) -> dict[str, float]:
    """The loop's wake-up gaps (ms) while `texts` are normalised one after another by `run`."""
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(1000 * (now - last))
            last = now

    tick = asyncio.create_task(ticker())
    start = time.perf_counter()
    for text in texts:
        await run(text)
    wall = time.perf_counter() - start
    done = True
    await tick
    gaps.sort()
    return {"max_gap_ms": round(gaps[-1], 2), "p99_gap_ms": round(gaps[math.ceil(0.99 * len(gaps)) - 1], 2),
            "median_gap_ms": round(statistics.median(gaps), 2), "wall_s": round(wall, 3)}


async def measure(texts: dict[str, list[str]]) -> dict[str, Any]:
    load()
    process = NormalizeProcess()
    try:
        await process(normalize, "1")  # the child spawned and its grammars loaded before timing
        out: dict[str, Any] = {}
        for kind, batch in texts.items():
            out[kind] = {"thread": await stalls(lambda t: asyncio.to_thread(normalize, t), batch),
                         "process": await stalls(lambda t: process(normalize, t), batch)}
            print(kind, out[kind], flush=True)
        return out
    finally:
        process.close()


def main(argv: list[str]) -> dict[str, Any]:
    ap = subcommand_parser("normalize-stall", __doc__)
    ap.add_argument("--texts", type=int, default=8, help="segments of each kind")
    ap.add_argument("--chars", type=int, default=250, help="characters a segment (the default segment length)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    texts = {kind: [(f"{i}. " + unit * (a.chars // len(unit) + 1))[:a.chars] for i in range(a.texts)]
             for kind, unit in KINDS.items()}
    doc: dict[str, Any] = {"tool": "bench_normalize_stall", "command": " ".join(command_line("normalize-stall", argv)),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "cpus": len(os.sched_getaffinity(0)), "texts": a.texts, "chars": a.chars}
    doc.update(asyncio.run(measure(texts)))
    write_json(a.out, doc)
    return doc
