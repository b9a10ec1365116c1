"""The real `voxcpm-serve` (`python -m service.main`) as a subprocess: its supervisor, one engine worker on the
CPU (the tiny never-stopping checkpoint) and two API processes on one SO_REUSEPORT port, over real HTTP.

Which API process answered a response is found exactly: the response's connection is still open (keep-alive),
so the API process holding the server end of it (psutil) is the one that served it. Every deadline here is a
generous guard against hangs, never a timing assertion.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service_harness import SAMPLES_PER_PATCH, free_port, wav_bytes

ROOT = Path(__file__).resolve().parent.parent
API_PROCESSES = 2
START_GUARD_S = 120  # the service up and every API process ready
STOP_GUARD_S = 60  # SIGTERM to exit
GUARD_S = 30  # anything else that should happen soon
REQUEST_TIMEOUT = httpx.Timeout(60.0)
PCM_PATCH_BYTES = SAMPLES_PER_PATCH * 2  # s16le
SHORT = {"target_text": "Hello.", "max_generate_length": 2, "seed": 1, "response_format": "pcm"}
# 71 tokens: the engine caps it at 6 x 71 + 10 = 436 patches (prompt + patches fit max_model_len 512), about
# 7 s of streaming on the CPU: long enough to be cut off mid-way.
LONG_TEXT = "Streaming long enough to be cut off midway, as it should be! " * 2
LONG_PATCHES = 436
LONG = {"target_text": LONG_TEXT, "response_format": "pcm"}  # max_generate_length unset: max_model_len
T = TypeVar("T")


class Service:
    """The `voxcpm-serve` process tree, its log, and requests that know which API process answered them."""

    def __init__(self, checkpoint: Path, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "service.log"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("NANOVLLM_") and k != "PROMETHEUS_MULTIPROC_DIR"}
        env.update(NANOVLLM_MODEL_PATH=str(checkpoint), NANOVLLM_CACHE_DIR=str(tmp / "cache"),
                   NANOVLLM_HOST="127.0.0.1", NANOVLLM_PORT=str(self.port),
                   NANOVLLM_API_PROCESSES=str(API_PROCESSES), NANOVLLM_SERVERPOOL_MAX_NUM_SEQS="4",
                   NANOVLLM_SERVERPOOL_MAX_MODEL_LEN="512", NANOVLLM_SERVERPOOL_MAX_NUM_BATCHED_TOKENS="2048")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "service.main"], cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.root = psutil.Process(self.proc.pid)
        self.seen: dict[int, psutil.Process] = {}  # every process ever found under the supervisor

    # --- the process tree ---------------------------------------------------------------------------
    def children(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            out = self.root.children(recursive=True)
            self.seen.update((p.pid, p) for p in out if p.pid not in self.seen)
            return out
        return []

    def named(self, prefix: str) -> list[psutil.Process]:
        out = []
        for p in self.children():
            with contextlib.suppress(psutil.Error):
                if p.name().startswith(prefix) and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n--- service log (tail) ---\n" + "\n".join(self.log().splitlines()[-lines:])

    def wait(self, predicate: Callable[[], T], message: str, limit_s: float = GUARD_S, pause: float = 0.05) -> T:
        """Poll until predicate() is truthy (a deadline against hangs, not a timing assertion); the supervisor
        must stay up meanwhile."""
        deadline = time.monotonic() + limit_s
        while True:
            with contextlib.suppress(httpx.TransportError):
                if result := predicate():
                    return result
            assert self.proc.poll() is None, f"the service exited (code {self.proc.returncode}){self.log_tail()}"
            assert time.monotonic() < deadline, f"{message} (after {limit_s:.0f} s){self.log_tail()}"
            time.sleep(pause)

    # --- requests -----------------------------------------------------------------------------------
    def served_by(self, response: httpx.Response) -> int | None:
        """The API process holding the server end of this response's connection (still open)."""
        client_addr = tuple(response.extensions["network_stream"].get_extra_info("client_addr")[:2])
        for proc in self.named("voxcpm-api"):
            with contextlib.suppress(psutil.Error):
                for conn in proc.net_connections(kind="tcp"):
                    if conn.raddr and conn.laddr.port == self.port and tuple(conn.raddr) == client_addr:
                        return proc.pid
        return None

    def ask(self, method: str, path: str, **kwargs: Any) -> tuple[httpx.Response, int | None]:
        """One request on a new connection (so SO_REUSEPORT picks an API process afresh): the response and
        the pid of the API process that answered it."""
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT) as client:
            r = client.request(method, path, **kwargs)
            return r, self.served_by(r)

    def wait_all_ready(self, limit_s: float = START_GUARD_S) -> None:
        """Until GET /ready was 200 from every API process (each one connects to the workers on its own)."""
        answered: set[int] = set()

        def every_api_process_ready() -> bool:
            r, pid = self.ask("GET", "/ready")
            if r.status_code == 200 and pid is not None:
                answered.add(pid)
            api = {p.pid for p in self.named("voxcpm-api")}
            return len(api) == API_PROCESSES and api <= answered

        self.wait(every_api_process_ready, "not every API process became ready", limit_s)

    def scrape(self) -> tuple[dict[tuple[str, tuple], float], int | None]:
        """GET /metrics on a new connection: {(sample name, sorted labels): value}, and who answered."""
        r, pid = self.ask("GET", "/metrics")
        assert r.status_code == 200, r.text
        samples = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples, pid

    # --- stopping -----------------------------------------------------------------------------------
    def kill_tree(self) -> None:
        for p in [*self.children(), self.root]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait; a service that does not stop is killed (whole tree) and fails the test run."""
        self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GUARD_S)
            except subprocess.TimeoutExpired:
                self.kill_tree()
                pytest.fail(f"voxcpm-serve did not exit within {STOP_GUARD_S} s of SIGTERM{self.log_tail()}")
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=GUARD_S)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        assert not alive, f"processes left behind by voxcpm-serve: {alive}{self.log_tail()}"


def metric(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there are none)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


@pytest.fixture(scope="module")
def service(checkpoint_factory, tmp_path_factory) -> Iterator[Service]:
    svc = Service(checkpoint_factory("tiny-voxcpm2", stop="never"), tmp_path_factory.mktemp("supervisor"))
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
    with httpx.Client(base_url=service.url, timeout=REQUEST_TIMEOUT) as client, \
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
    with httpx.Client(base_url=service.url, timeout=httpx.Timeout(GUARD_S)) as client, \
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
    assert time.monotonic() - killed < GUARD_S

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


def test_sigterm_stops_everything(service: Service):
    """Last: it stops the module's service. An in-flight stream is let finish; then everything exits."""
    children = service.children()
    assert len(service.named("voxcpm-")) == API_PROCESSES + 1
    patches = 100  # about 2 s of streaming, most of it after the SIGTERM
    with httpx.Client(base_url=service.url, timeout=REQUEST_TIMEOUT) as client, \
            client.stream("POST", "/generate", json={**LONG, "max_generate_length": patches}) as r:
        assert r.status_code == 200, r.read()
        chunks = r.iter_raw()
        received = len(next(chunks))
        service.proc.send_signal(signal.SIGTERM)
        # draining: every API process turns not-ready and refuses new work at once, while this stream goes on
        service.wait(lambda: service.ask("GET", "/ready")[0].status_code == 503, "/ready stayed 200 after SIGTERM",
                     pause=0.0)

        def refused() -> httpx.Response | None:
            r, _ = service.ask("POST", "/generate", json={**LONG, "max_generate_length": 2})
            return r if r.status_code == 503 else None

        r503 = service.wait(refused, "new requests were still served after SIGTERM", pause=0.0)
        assert "shutting down" in r503.json()["detail"] and r503.headers.get("retry-after")
        received += sum(len(data) for data in chunks)
    assert received == patches * PCM_PATCH_BYTES  # the API process let its in-flight response finish
    try:
        code = service.proc.wait(STOP_GUARD_S)
    except subprocess.TimeoutExpired:
        service.kill_tree()
        pytest.fail(f"voxcpm-serve did not exit within {STOP_GUARD_S} s of SIGTERM{service.log_tail()}")
    assert code == 0, service.log_tail()
    _, alive = psutil.wait_procs(children, timeout=GUARD_S)
    assert not alive, f"left running after the supervisor exited: {alive}{service.log_tail()}"
    assert "stopping: API processes first" in service.log()
    with pytest.raises(httpx.TransportError):
        httpx.get(service.url + "/health", timeout=5)
