"""Admission control over real HTTP (issue 25): beyond what the workers run plus their queue, a generation request
is refused at once with 503 + Retry-After (counted in a metric), before any audio; a request that waits for a seat
past the queue timeout gets 503 too; the admitted ones complete and nothing is left in flight."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.service_harness import LiveServer, live_server

BURST = 40  # ten times what the workers hold (running + queued)
LONG = "A long enough sentence for a stream of about a hundred patches. " * 2


def _overloads(server: LiveServer) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("voxcpm_requests_overloaded_total{"))


def test_excess_requests_are_503_at_once_and_the_admitted_complete(checkpoint_factory, tmp_path):
    with live_server(checkpoint_factory, tmp_path, serverpool_max_num_seqs=2, max_queued_requests=2,
                     queue_coalesce_ms=0) as server:

        async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None, int, float]:
            t0 = time.monotonic()
            async with client.stream("POST", "/generate", json={"target_text": LONG, "max_generate_length": 40,
                                                                 "response_format": "pcm", "seed": i}) as r:
                answered = time.monotonic() - t0
                data = b"".join([c async for c in r.aiter_raw()])
                return r.status_code, r.headers.get("retry-after"), len(data), answered

        async def burst() -> list[tuple[int, str | None, int, float]]:
            limits = httpx.Limits(max_connections=BURST)
            async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
                return await asyncio.gather(*(one(client, i) for i in range(BURST)))

        results = asyncio.run(asyncio.wait_for(burst(), 300))  # a hang guard
        ok = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 503]
        # 2 running + 2 waiting per worker: ten times that many at once, the rest refused
        assert len(ok) == 4 and len(refused) == BURST - 4, [r[:3] for r in results]
        assert all(retry is not None for _, retry, _, _ in refused)
        assert all(n == 40 * 7680 * 2 for _, _, n, _ in ok)  # the admitted ones complete
        assert _overloads(server) == BURST - 4
        print(f"overload: {len(refused)} refused, slowest 503 after {max(r[3] for r in refused) * 1000:.0f} ms")
        LiveServer.wait(lambda: (s := server.pool_stats())["running"] == s["waiting"] == 0
                        and s["free_blocks"] == s["total_blocks"], "requests left in flight")


def test_a_request_waiting_past_the_queue_timeout_is_503(checkpoint_factory, tmp_path):
    with live_server(checkpoint_factory, tmp_path, serverpool_max_num_seqs=1, queue_timeout_s=0.5,
                     queue_coalesce_ms=0) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        body = {"target_text": LONG, "max_generate_length": 300, "response_format": "pcm", "seed": 1}
        with client.stream("POST", "/generate", json=body) as first:  # holds the only seat for seconds
            assert first.status_code == 200
            chunks = first.iter_raw()
            next(chunks)
            r = client.post("/generate", json={**body, "seed": 2})
            assert r.status_code == 503 and "queue timeout" in r.json()["detail"], r.text
            assert r.headers.get("retry-after")
        assert _overloads(server) == 1
