"""The real `voxcpm-serve` (`python -m service.main`) as a subprocess: its supervisor, one engine worker on the
CPU (the tiny never-stopping checkpoint) and two API processes on one SO_REUSEPORT port, over real HTTP.

Which API process answered a response is found exactly: the response's connection is still open (keep-alive),
so the API process holding the server end of it (psutil) is the one that served it. Every deadline here is a
generous guard against hangs, never a timing assertion.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import signal
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.service_harness import SAMPLES_PER_PATCH, TLS, small_window_socket, wav_bytes
from tests.supervised import GUARD_S, REQUEST_TIMEOUT, Service, metric

API_PROCESSES = 2
STUCK_TIMEOUT_S = 10
PCM_PATCH_BYTES = SAMPLES_PER_PATCH * 2  # s16le
SHORT = {"target_text": "Hello.", "max_generate_length": 2, "seed": 1, "response_format": "pcm"}
# 71 tokens: the engine caps it at 6 x 71 + 10 = 436 patches (prompt + patches fit max_model_len 512), about
# 7 s of streaming on the CPU: long enough to be cut off mid-way.
LONG_TEXT = "Streaming long enough to be cut off midway, as it should be! " * 2
LONG_PATCHES = 436
LONG = {"target_text": LONG_TEXT, "response_format": "pcm"}  # max_generate_length unset: max_model_len


@pytest.fixture(scope="module")
def service(checkpoint_factory, tmp_path_factory) -> Iterator[Service]:
    # a worker silent for 10 s is killed (120 by default): far beyond a tiny CPU worker's longest turn of its loop
    svc = Service(checkpoint_factory("tiny-voxcpm2", stop="never"), tmp_path_factory.mktemp("supervisor"),
                  API_PROCESSES, engine_env={"VOXCPM_LOG_LEVEL": "DEBUG"},  # the worker's timeline in the log
                  worker_stuck_timeout_s=str(STUCK_TIMEOUT_S))
    try:
        svc.wait_all_ready()
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def hifi_id(service: Service) -> str:
    clip = base64.b64encode(wav_bytes(0.8, seed=1)).decode()
    r, _ = service.ask("POST", "/add_hifi", json={"wav_base64": clip, "prompt_text": "A test clip."})
    assert r.status_code == 200, r.text
    return r.json()["hifi_id"]


def request_id_client(response: httpx.Response) -> str:
    """X-Request-Id is "<engine client name>-<counter>"; each API process has its own engine client."""
    name, _, n = response.headers["X-Request-Id"].rpartition("-")
    assert name and n.isdigit(), response.headers["X-Request-Id"]
    return name


def short_request(service: Service, hifi_id: str) -> tuple[httpx.Response, int | None]:
    r, pid = service.ask("POST", "/generate_blocking", json={**SHORT, "hifi_id": hifi_id})
    assert r.status_code == 200, r.text
    assert r.headers["X-Finish-Reason"] == "length"  # the checkpoint never stops: 2 patches, the cap
    assert len(r.content) == 2 * PCM_PATCH_BYTES
    return r, pid


def test_processes_and_ready(service: Service):
    assert service.root.name() == "voxcpm-serve"
    names = []
    for p in service.children():
        with contextlib.suppress(psutil.Error):
            names.append(p.name())
    voxcpm = sorted(n for n in names if n.startswith("voxcpm-"))
    assert voxcpm == ["voxcpm-api0", "voxcpm-api1", "voxcpm-worker0"], names
    # the supervisor's own children, each listening on the one port (SO_REUSEPORT)
    direct = {p.pid for p in service.root.children()}
    for p in service.named("voxcpm-"):
        assert p.pid in direct, (p, p.ppid())
    for p in service.named("voxcpm-api"):
        listening = [c for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        assert [c.laddr.port for c in listening] == [service.port], (p.name(), listening)
    assert not [c for c in service.named("voxcpm-worker0")[0].net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN]  # the worker serves its Unix socket only

    r, _ = service.ask("GET", "/ready")
    assert r.status_code == 200 and r.json() == {"status": "ready"}
    r, _ = service.ask("GET", "/info")
    info = r.json()
    assert info["api_processes"] == API_PROCESSES
    assert info["ready"] is True and info["model"]["sample_rate"] == 48000
    assert info["model"]["model_path"] and info["model"]["random_weights"] is False


def test_requests_spread_over_api_processes_and_share_voices(service: Service, hifi_id: str):
    api = {p.pid for p in service.named("voxcpm-api")}
    assert len(api) == API_PROCESSES
    before, _ = service.scrape()
    ok_before = metric(before, "voxcpm_http_requests_total", route="/generate_blocking", status="200")
    first_before = metric(before, "voxcpm_encoder_wait_seconds_count", chunk="first")

    clients: dict[str, set[int | None]] = {}  # engine client name -> API processes whose responses carried it
    audio = None
    n = 0
    while n < 16 or (len(clients) < 2 and n < 64):  # SO_REUSEPORT's hashing is random: more tries if needed
        r, pid = short_request(service, hifi_id)  # the voice was registered through either API process
        n += 1
        audio = audio or r.content
        assert r.content == audio, f"request {n}: the same seed gave different audio"
        clients.setdefault(request_id_client(r), set()).add(pid)
    assert len(clients) >= 2, f"{n} requests on new connections all reached one API process: {clients}"
    # each API process has one engine client name, and the two served with different ones
    assert all(len(pids) == 1 and None not in pids for pids in clients.values()), clients
    assert set().union(*clients.values()) == api, (clients, api)

    # metrics: any API process answers with the sum over both (exact: no request lost or counted twice)
    want = ok_before + n
    scraped_by: set[int] = set()

    def both_report_the_sum() -> bool:
        samples, pid = service.scrape()
        got = metric(samples, "voxcpm_http_requests_total", route="/generate_blocking", status="200")
        assert got <= want, f"{got} /generate_blocking 200s counted for {n} requests"
        if got == want and pid is not None:  # (a counter is bumped just after its response's last byte)
            scraped_by.add(pid)
        return scraped_by == api

    service.wait(both_report_the_sum, f"/metrics never showed {want} /generate_blocking 200s from each API process")
    samples, _ = service.scrape()
    assert metric(samples, "voxcpm_generations_finished_total", route="/generate_blocking", reason="length") == n
    assert metric(samples, "voxcpm_audio_generated_seconds_total", route="/generate_blocking") == pytest.approx(
        n * 2 * SAMPLES_PER_PATCH / 48000)
    # each response's first chunk went through its API process's encoder pool once, counted in the sum
    assert metric(samples, "voxcpm_encoder_wait_seconds_count", chunk="first") == first_before + n

    # the voice store is shared: both API processes list the voice
    listed_by: set[int] = set()

    def both_list_it() -> bool:
        r, pid = service.ask("GET", "/hifi")
        assert r.status_code == 200, r.text
        assert hifi_id in [v["id"] for v in r.json()["voices"]], r.json()
        listed_by.add(pid)
        return listed_by >= api

    service.wait(both_list_it, "GET /hifi never reached both API processes")


def test_streaming_disconnect_frees_the_engine(service: Service):
    def running() -> float:
        return metric(service.scrape()[0], "voxcpm_running_sequences")

    service.wait(lambda: running() == 0, "the engine is busy before the test")
    before, _ = service.scrape()
    aborted_before = metric(before, "voxcpm_generations_finished_total", route="/generate", reason="aborted")
    steps_before = metric(before, "voxcpm_engine_steps", worker="0")
    with httpx.Client(verify=TLS, base_url=service.url, timeout=REQUEST_TIMEOUT) as client, \
            client.stream("POST", "/generate", json=LONG) as r:
        assert r.status_code == 200, r.read()
        chunks = r.iter_raw()  # keep a reference: a discarded httpx iterator closes the connection itself
        assert len(next(chunks)) > 0
        service.wait(lambda: running() == 1, "the stream is not among the running sequences")
    # leaving the block closed the connection mid-stream: the API process aborts the engine request
    service.wait(lambda: running() == 0, "the engine still runs the stream after its client left")
    after, _ = service.scrape()
    assert metric(after, "voxcpm_queue_depth") == 0
    assert metric(after, "voxcpm_kv_cache_usage_ratio", worker="0") == 0  # its KV blocks are free again
    assert metric(after, "voxcpm_engine_steps", worker="0") - steps_before < LONG_PATCHES  # cut off, not finished
    service.wait(lambda: metric(service.scrape()[0], "voxcpm_generations_finished_total", route="/generate",
                                reason="aborted") == aborted_before + 1, "the abort was not counted")

    r, _ = service.ask("POST", "/generate", json=SHORT)
    assert r.status_code == 200 and len(r.content) == 2 * PCM_PATCH_BYTES, r.content[:200]


def test_worker_killed_then_recovers(service: Service, hifi_id: str):
    reference, _ = short_request(service, hifi_id)
    [worker] = service.named("voxcpm-worker0")
    old_pid = worker.pid
    received = 0
    ended_by: Exception | None = None
    with httpx.Client(verify=TLS, base_url=service.url, timeout=httpx.Timeout(GUARD_S)) as client, \
            client.stream("POST", "/generate", json=LONG) as r:
        assert r.status_code == 200, r.read()
        chunks = r.iter_raw()
        received += len(next(chunks))
        worker.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        try:
            for data in chunks:
                received += len(data)
                assert time.monotonic() - killed < GUARD_S, "the stream went on after its worker was killed"
        except httpx.HTTPError as e:  # the response was cut: no chunked-encoding end
            ended_by = e
    assert not isinstance(ended_by, httpx.TimeoutException), f"the stream hung after the kill: {ended_by!r}"
    assert received < LONG_PATCHES * PCM_PATCH_BYTES, f"{received} bytes: the whole stream, despite the kill"
    cut_after = time.monotonic() - killed
    assert cut_after < GUARD_S
    print(f"worker killed: the HTTP stream was cut {cut_after * 1000:.0f} ms later")

    service.wait(lambda: service.ask("GET", "/ready")[0].status_code == 503, "/ready stayed 200 after the kill",
                 pause=0.0)
    r, _ = service.ask("GET", "/health")
    assert r.status_code == 200  # the API processes themselves are fine
    service.wait_all_ready()
    [worker] = service.named("voxcpm-worker0")
    assert worker.pid != old_pid
    assert worker.ppid() == service.root.pid
    assert "worker 0 died (exit code -9): restarting it" in service.log()

    again, _ = short_request(service, hifi_id)
    assert again.content == reference.content  # the same voice and seed on the new worker: the same audio
    # every API process refreshes its readiness gauge on its own (about once a second): the sum turns 1 again
    service.wait(lambda: (m := service.scrape()[0]) and metric(m, "voxcpm_workers_up") == 1
                 and metric(m, "voxcpm_ready") == 1, "voxcpm_ready never turned 1 again")


def test_a_stuck_worker_is_killed_and_restarted(service: Service, hifi_id: str):
    """A worker whose loop stops (SIGSTOP: a GPU call that never returns) answers no ping: after
    NANOVLLM_WORKER_STUCK_TIMEOUT_S the supervisor kills it and starts another (it was only reported not ready,
    for good), which serves the same audio."""
    reference, _ = short_request(service, hifi_id)
    [worker] = service.named("voxcpm-worker0")
    worker.suspend()
    service.wait(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE,
                 "the stuck worker was never killed", limit_s=STUCK_TIMEOUT_S + GUARD_S)
    assert f"worker 0 (cpu) answered no ping for {STUCK_TIMEOUT_S:.0f} s" in service.log()
    service.wait_all_ready()
    [again] = service.named("voxcpm-worker0")
    assert again.pid != worker.pid
    assert short_request(service, hifi_id)[0].content == reference.content


def test_logs_hold_no_audio_latents_or_keys(service: Service, hifi_id: str):
    """Requests carrying a key, a clip, latents, and bad versions of each (errors get logged): none of it reaches
    the log."""
    clip = base64.b64encode(wav_bytes(0.8, seed=7)).decode()
    secret = "sk-do-not-log-0123456789"
    latents = base64.b64encode(bytes(range(256)) * 4).decode()
    headers = {"Authorization": f"Bearer {secret}", "X-API-Key": secret}
    for body in ({**SHORT, "prompt_wav_base64": clip, "prompt_text": "A clip."},
                 {**SHORT, "ref_audio_wav_base64": clip[:-400] + "A" * 400},  # corrupt audio: a worker error
                 {**SHORT, "prompt_latents_base64": latents, "prompt_text": "Latents."}):
        service.ask("POST", "/generate", json=body, headers=headers)
    log = service.log()
    for needle in (secret, clip[100:160], clip[-460:-400], latents[:60]):
        assert needle not in log, f"the log holds request data: {needle[:20]}..."


def test_a_bursts_arrivals_and_admission_rounds_from_the_workers_debug_log(service: Service):
    """`tools/profiler.py timeline` reads what the worker and the API processes log at DEBUG: a burst of three requests
    at an idle worker is found with its three arrivals, each one's hand-off and write in its API process, and the
    rounds that admitted them add up to three."""
    from concurrent.futures import ThreadPoolExecutor

    from tools.profiling.timeline import timeline

    before = len(timeline(service.log().splitlines()))
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: service.ask("POST", "/generate_blocking", json=SHORT)[0], range(3)))
    assert [r.status_code for r in answers] == [200] * 3
    bursts = timeline(service.log().splitlines())[before:]
    assert sum(b["requests"] for b in bursts) == 3  # one burst, or more if the three came apart
    assert all(sum(r["seqs"] for r in b["rounds"]) == b["requests"] for b in bursts)
    assert all(0 <= b["half_ms"] <= b["spread_ms"] and b["first_step_ms"] is not None for b in bursts)
    # the API processes' engine clients log at the workers' level too: each request's hand-off and write are found
    assert all(b["api"]["requests"] == b["requests"] and b["api"]["sender_max_ms"] >= 0 for b in bursts)


class SmallWindowConnection(http.client.HTTPConnection):
    """A client whose socket takes 4 KiB at a time: audio it has not read waits in the server."""

    def connect(self) -> None:
        self.sock = small_window_socket(self.port, GUARD_S)


def test_sigterm_stops_everything(service: Service):
    """Last: it stops the module's service. An in-flight stream is let finish, read after the engine made it all
    too; then everything exits."""
    children = service.children()
    assert len(service.named("voxcpm-")) == API_PROCESSES + 1
    patches = 400  # ~6 MB: more than the sockets' buffers hold, so the unread rest waits in the API process
    connection = SmallWindowConnection("127.0.0.1", service.port)
    try:
        connection.request("POST", "/generate", json.dumps({**LONG, "max_generate_length": patches}),
                            {"Content-Type": "application/json"})
        r = connection.getresponse()
        assert r.status == 200, r.read()
        received = len(r.read(PCM_PATCH_BYTES))
        service.proc.send_signal(signal.SIGTERM)
        # draining: every API process turns not-ready and refuses new work at once, while this stream goes on
        service.wait(lambda: service.ask("GET", "/ready")[0].status_code == 503, "/ready stayed 200 after SIGTERM",
                     pause=0.0)

        def refused() -> httpx.Response | None:
            r, _ = service.ask("POST", "/generate", json={**LONG, "max_generate_length": 2})
            return r if r.status_code == 503 else None

        r503 = service.wait(refused, "new requests were still served after SIGTERM", pause=0.0)
        assert "shutting down" in r503.json()["detail"] and r503.headers.get("retry-after")
        # the engine done with the stream, most of its response not yet read: the drain waits for the response (it
        # stopped the API processes, whose listener then closed, once the engine was done)
        service.wait(lambda: metric(service.scrape()[0], "voxcpm_running_sequences") == 0,
                     "the engine never finished the stream")
        time.sleep(1.0)
        assert service.ask("GET", "/ready")[0].status_code == 503  # still draining, still listening
        received += len(r.read())
    finally:
        connection.close()
    assert received == patches * PCM_PATCH_BYTES  # the API process let its in-flight response finish
    assert service.exit_code() == 0, service.log_tail()
    _, alive = psutil.wait_procs(children, timeout=GUARD_S)
    assert not alive, f"left running after the supervisor exited: {alive}{service.log_tail()}"
    assert "stopping: API processes first" in service.log()
    with pytest.raises(httpx.TransportError):
        httpx.get(service.url + "/health", timeout=5, verify=TLS)
