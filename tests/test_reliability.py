"""Reliability of the real `voxcpm-serve` (supervisor, CPU worker, two API processes) over real HTTP:

- soak: 1,000 requests at concurrency 16 over every route, voice form and format, ~30% of them dropped by the
  client at a random point (tools/soak.py): nothing hangs, nothing fails, and afterwards every KV block and decode
  slot is free again and the processes' memory stays bounded;
- a worker that stops answering turns the service not ready, and /metrics still answers;
- SIGTERM during 16 live streams: each one finishes, new requests get 503, the service exits 0;
- a worker that keeps dying while it starts ends the service with a non-zero exit code, and so does an API process
  that keeps dying at its start.

Deadlines are hang guards, never timing assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.service_harness import SAMPLES_PER_PATCH, TLS
from tests.supervised import GUARD_S, REQUEST_TIMEOUT, STOP_GUARD_S, Service, metric
from tools.soak import soak

SLOTS = 16  # max_num_seqs, and the soak's concurrency
SOAK_REQUESTS = 1000
WARMUP_REQUESTS = 64  # before the memory baseline: caches, pools and allocator arenas reach their working size
RSS_GROWTH_GUARD_MB = 200  # far above what a leak-free soak adds; a per-request leak of audio would pass it


@pytest.fixture(scope="module")
def service(checkpoint_factory, tmp_path_factory) -> Iterator[Service]:
    svc = Service(checkpoint_factory("tiny-voxcpm2", stop="never"), tmp_path_factory.mktemp("reliability"),
                  api_processes=2, serverpool_max_num_seqs=str(SLOTS), max_queued_requests=str(SLOTS))
    try:
        svc.wait_all_ready()
        yield svc
    finally:
        svc.stop()


def service_rss_mb(service: Service) -> float:
    total = 0
    for p in [service.root, *service.children()]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total / 2**20


def wait_idle(service: Service) -> dict[tuple[str, tuple], float]:
    def idle() -> dict | None:
        m, _ = service.scrape()
        busy = metric(m, "voxcpm_running_sequences") + metric(m, "voxcpm_queue_depth")
        return m if busy == 0 and metric(m, "voxcpm_http_requests_in_flight") <= 1 else None  # 1: this scrape

    return service.wait(idle, "the engine never went idle after the soak")


def test_soak_leaks_nothing(service: Service):
    asyncio.run(soak(service.url, WARMUP_REQUESTS, SLOTS, disconnect=0.3, seed=1))
    wait_idle(service)
    rss_before = service_rss_mb(service)

    result = asyncio.run(soak(service.url, SOAK_REQUESTS, SLOTS, disconnect=0.3, seed=2))
    samples = wait_idle(service)
    rss_growth = service_rss_mb(service) - rss_before
    print(f"soak: {result.outcomes} in {result.wall_s} s over {result.by_route}; service RSS "
          f"{rss_before:.0f} MB -> +{rss_growth:.1f} MB")

    o = result.outcomes
    assert o.get("completed", 0) + o.get("disconnected", 0) == SOAK_REQUESTS, (o, result.problems)
    assert 0.2 * SOAK_REQUESTS < o.get("disconnected", 0) < 0.4 * SOAK_REQUESTS, o
    assert len(result.by_route) == 4, result.by_route  # /generate, both blocking routes, /v1/audio/speech
    # nothing leaked: every KV block and decode slot is free once the engine is idle
    assert metric(samples, "voxcpm_kv_blocks_free") == metric(samples, "voxcpm_kv_blocks_total") > 0
    assert metric(samples, "voxcpm_sequence_slots_free") == SLOTS
    assert rss_growth < RSS_GROWTH_GUARD_MB, f"service memory grew {rss_growth:.0f} MB over the soak"
    # the service still serves exactly
    r, _ = service.ask("POST", "/generate", json={"target_text": "After.", "max_generate_length": 2,
                                                  "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) == 2 * 2 * SAMPLES_PER_PATCH


def test_a_stuck_worker_turns_the_service_not_ready_and_its_metrics_still_answer(service: Service):
    """A worker that stops answering (SIGSTOP: a GPU call that never returns): /ready turns 503 naming it within
    the stats timeout, so the pod leaves the rotation (it stayed 200 while every generation hung), and /metrics
    answers, reporting not ready (it hung: scrapes timed out, so no alert could fire); once the worker resumes, ready
    again."""
    (worker,) = service.named("voxcpm-worker")
    worker.suspend()
    try:
        r, _ = service.ask("GET", "/ready")
        assert r.status_code == 503 and "answered nothing for 5 s" in r.json()["detail"], r.text
        samples, _ = service.scrape()
        assert metric(samples, "voxcpm_ready") == 0
    finally:
        worker.resume()
    service.wait(lambda: all(service.ask("GET", "/ready")[0].status_code == 200 for _ in range(4)),
                 "not ready again after the worker resumed")


def test_sigterm_during_16_live_streams(service: Service):
    """Last for this module's service: 16 streams in flight when SIGTERM comes all finish whole; meanwhile /ready
    and new requests are 503; then the service exits 0."""
    patches = 60
    body = {"target_text": "Sixteen streams finishing during the shutdown.", "max_generate_length": patches,
            "response_format": "pcm"}
    started = threading.Barrier(SLOTS + 1)
    received: list[int] = [0] * SLOTS
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            with httpx.Client(verify=TLS, base_url=service.url, timeout=REQUEST_TIMEOUT) as client, \
                    client.stream("POST", "/generate", json={**body, "seed": i}) as r:
                assert r.status_code == 200, r.read()
                chunks = r.iter_raw()
                received[i] = len(next(chunks))
                started.wait(GUARD_S)
                received[i] += sum(len(c) for c in chunks)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            with contextlib.suppress(threading.BrokenBarrierError):
                started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(SLOTS)]
    for t in threads:
        t.start()
    started.wait(GUARD_S)  # every stream has its first audio
    service.proc.send_signal(signal.SIGTERM)
    service.wait(lambda: service.ask("GET", "/ready")[0].status_code == 503, "/ready stayed 200 after SIGTERM",
                 pause=0.0)
    r, _ = service.ask("POST", "/generate", json={**body, "max_generate_length": 2})
    assert r.status_code == 503 and r.headers.get("retry-after"), r.text
    for t in threads:
        t.join(STOP_GUARD_S)
    assert not errors, errors
    assert received == [patches * SAMPLES_PER_PATCH * 2] * SLOTS  # all 16 finished whole
    assert service.exit_code() == 0, service.log_tail()
    # what the drain waited for, as the log says it (a /ready check may have been open beside the streams)
    assert re.search(rf"draining: ({SLOTS}|{SLOTS + 1}) open response\(s\) and session\(s\)", service.log()), \
        service.log_tail()


def kill_each_as_it_runs(svc: Service, prefix: str) -> set[int]:
    """SIGKILL every process of the service named `prefix`, each replacement as soon as it appears, until the service
    exits (a hang guard ends it after 4 x GUARD_S); the pids killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + 4 * GUARD_S
    while svc.proc.poll() is None and time.monotonic() < deadline:
        for process in svc.named(prefix):
            if process.pid not in killed:
                with contextlib.suppress(psutil.Error):
                    process.kill()
                killed.add(process.pid)
        time.sleep(0.01)
    return killed


def test_a_worker_dying_while_starting_ends_the_service(checkpoint_factory, tmp_path):
    """Kill the worker, then each replacement before it is ready: the third failed start stops the service with
    exit code 1 (the orchestrator restarts or reschedules the pod) instead of restarting forever."""
    svc = Service(checkpoint_factory("tiny-voxcpm2", stop="never"), tmp_path, api_processes=1)
    try:
        svc.wait_all_ready()
        killed = kill_each_as_it_runs(svc, "voxcpm-worker")
        assert svc.exit_code(GUARD_S) == 1, svc.log_tail()
        assert len(killed) == 4  # the ready worker, then three replacements while they started
        assert "died while starting 3 times in a row" in svc.log()
    finally:
        svc.stop()


def test_an_api_process_dying_at_its_start_ends_the_service(checkpoint_factory, tmp_path):
    """Kill the API process, then each replacement as soon as it runs: after a pause that grows between the
    restarts, the third exit in a row soon after its start stops the service with exit code 1 (it restarted them
    forever, twice a second: a start that cannot work spun the supervisor)."""
    svc = Service(checkpoint_factory("tiny-voxcpm2", stop="never"), tmp_path, api_processes=1)
    try:
        svc.wait_all_ready()
        killed = kill_each_as_it_runs(svc, "voxcpm-api")
        assert svc.exit_code(GUARD_S) == 1, svc.log_tail()
        assert len(killed) == 3  # the first and two replacements
        log = svc.log()
        assert "starting it again in 1 s" in log and "starting it again in 2 s" in log
        assert "API process 0 exited 3 times in a row within 30 s of its start" in log
    finally:
        svc.stop()
