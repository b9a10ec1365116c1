"""Bursts of concurrent streaming requests against a running voxcpm-serve, larger than its workers run and queue:
how fast the excess is refused (503 + Retry-After), seen by the client and by the service (the /generate duration
histogram from /metrics, which also holds the admitted requests: compare it before and after), and whether the
admitted ones complete.

    uv run python tools/bench.py overload --url http://127.0.0.1:8000 --bursts 40,160,320 --patches 40 --out o.json
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tools.benchmarks.harness import subcommand_parser

TEXT = "A long enough sentence for a stream of audio. " * 2


async def burst(url: str, n: int, patches: int) -> list[tuple[int, float, int, bool]]:
    """(status, seconds to the response head, body bytes, Retry-After present) of n requests sent at once."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def one(i: int) -> tuple[int, float, int, bool]:
            t0 = time.monotonic()
            body = {"target_text": TEXT, "max_generate_length": patches, "response_format": "pcm", "seed": i}
            async with client.stream("POST", "/generate", json=body) as r:
                head = time.monotonic() - t0
                size = sum([len(c) async for c in r.aiter_raw()])
                return r.status_code, head, size, "retry-after" in r.headers

        return await asyncio.gather(*(one(i) for i in range(n)))


def generate_buckets(url: str) -> dict[float, float]:
    """The service's /generate duration histogram: {upper bound (s): requests at most that long}."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "voxcpm_http_request_duration_seconds_bucket" and s.labels.get("route") == "/generate":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return dict(sorted(out.items()))


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[max(0, int(q * len(values)) - 1)]


def main(argv: list[str]) -> None:
    ap = subcommand_parser("overload", __doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--bursts", default="40,160,320", help="concurrent requests per burst")
    ap.add_argument("--patches", type=int, default=40, help="max_generate_length of each request")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for n in (int(b) for b in args.bursts.split(",")):
        before = generate_buckets(args.url)
        results = asyncio.run(burst(args.url, n, args.patches))
        after = generate_buckets(args.url)
        refused = [head for status, head, _, retry in results if status == 503 and retry]
        admitted = [size for status, _, size, _ in results if status == 200]
        row = {"burst": n, "admitted": len(admitted), "refused": len(refused),
               "other": len(results) - len(admitted) - len(refused),
               "admitted_complete": all(size > 0 for size in admitted),
               "refused_ms_p50": round(1000 * statistics.median(refused), 1) if refused else None,
               "refused_ms_p95": round(1000 * percentile(refused, 0.95), 1) if refused else None,
               "refused_ms_max": round(1000 * max(refused), 1) if refused else None,
               "service_duration_buckets": {str(le): after[le] - before.get(le, 0.0) for le in after}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"url": args.url, "patches": args.patches, "rows": rows}, indent=2) + "\n")
