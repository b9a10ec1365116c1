"""What the client's tokenization costs the host: one request's text, and a burst's, on this machine.

    python tools/bench.py tokenize --model CKPT --burst 128 --out tokenize.json

Before it sends a request to a worker, an API process (or a library pool) tokenizes its text (`text_ids_many` of
engine/serving/stream.py): one text inline on its event loop, a burst's texts in one call into the tokenizer's backend
on a thread. Both are timed as they happen, after an idle pause (caches cold, the backend's threads asleep): the
median over --rounds of one request and of --burst distinct requests (the benchmark's text, numbered), and the burst's
two parts: normalising its texts, and encoding them (the backend's call and the ids out of its encodings).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine.io.tokenizer import TextTokenizer, normalize_text, text_tokens_many
from tools.benchmarks.harness import TEXT, command_line, subcommand_parser, write_json


def idle_then_us(fn: Callable[[], object], rounds: int, pause_s: float) -> float:
    """Median microseconds of fn, each call after `pause_s` idle (the first two calls not counted)."""
    times = []
    for _ in range(rounds + 2):
        time.sleep(pause_s)
        t = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t))
    return statistics.median(times[2:])


def main(argv: list[str]) -> dict[str, Any]:
    ap = subcommand_parser("tokenize", __doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory (only its tokenizer is read)")
    ap.add_argument("--burst", type=int, default=128, help="requests in the burst")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--pause-ms", type=float, default=50.0, help="idle time before each timed call")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    tokenizer = TextTokenizer.from_dir(a.model)
    requests = [(f"Request {i}. {TEXT}", "", False) for i in range(a.burst)]
    texts = [normalize_text(text) for text, _, _ in requests]
    timed = {
        "one_request_us": lambda: text_tokens_many(tokenizer, requests[:1]),
        "burst_us": lambda: text_tokens_many(tokenizer, requests),
        "burst_normalise_us": lambda: [normalize_text(text) for text, _, _ in requests],
        "burst_encode_us": lambda: tokenizer.encode_many(texts),
    }
    doc: dict[str, Any] = {"tool": "bench_tokenize", "command": " ".join(command_line("tokenize", argv)),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": a.model,
                           "cpus": len(os.sched_getaffinity(0)),
                           "burst": a.burst, "rounds": a.rounds, "pause_ms": a.pause_ms, "text_chars": len(TEXT),
                           "tokens_per_request": len(text_tokens_many(tokenizer, requests[:1])[0][0])}
    for name, fn in timed.items():
        doc[name] = round(idle_then_us(fn, a.rounds, a.pause_ms / 1000), 1)
        print(f"{name}: {doc[name]:.1f}", flush=True)
    write_json(a.out, doc)
    return doc
