"""The real `voxcpm-serve` (`python -m service.main`) as a subprocess for the tests: its supervisor, engine
worker(s) on the CPU and API processes on one SO_REUSEPORT port, over real HTTP.

Which API process answered a response is found exactly: the response's connection is still open (keep-alive),
so the API process holding the server end of it (psutil) is the one that served it. Every deadline here is a
generous guard against hangs, never a timing assertion.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service_harness import SERVICE_TEST_TIMESTEPS, TLS, free_port

ROOT = Path(__file__).resolve().parent.parent
START_GUARD_S = 120  # the service up and every API process ready
STOP_GUARD_S = 60  # SIGTERM to exit
GUARD_S = 30  # anything else that should happen soon
REQUEST_TIMEOUT = httpx.Timeout(60.0)
T = TypeVar("T")


class Service:
    """The `voxcpm-serve` process tree, its log, and requests that know which API process answered them."""

    def __init__(self, checkpoint: Path, tmp: Path, api_processes: int = 2, engine_env: dict[str, str] | None = None,
                 **settings: str) -> None:
        """`settings`: more NANOVLLM_* variables, named without the prefix (max_queued_requests="16");
        `engine_env`: VOXCPM_* engine options (VOXCPM_LOG_LEVEL="DEBUG")."""
        self.api_processes = api_processes
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "service.log"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("NANOVLLM_") and k != "PROMETHEUS_MULTIPROC_DIR"}
        env.update(NANOVLLM_MODEL_PATH=str(checkpoint), NANOVLLM_CACHE_DIR=str(tmp / "cache"),
                   NANOVLLM_HOST="127.0.0.1", NANOVLLM_PORT=str(self.port),
                   NANOVLLM_API_PROCESSES=str(api_processes), NANOVLLM_SERVERPOOL_MAX_NUM_SEQS="4",
                   NANOVLLM_SERVERPOOL_MAX_MODEL_LEN="512", NANOVLLM_SERVERPOOL_MAX_NUM_BATCHED_TOKENS="2048",
                   NANOVLLM_SERVERPOOL_INFERENCE_TIMESTEPS=str(SERVICE_TEST_TIMESTEPS))
        env.update({f"NANOVLLM_{k.upper()}": v for k, v in settings.items()}, **(engine_env or {}))
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
        with httpx.Client(verify=TLS, base_url=self.url, timeout=REQUEST_TIMEOUT) as client:
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
            return len(api) == self.api_processes and api <= answered

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

    def exit_code(self, limit_s: float = STOP_GUARD_S) -> int:
        """The supervisor's exit code once it has exited; one that does not within `limit_s` is killed (whole tree)
        and fails the test."""
        try:
            return self.proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            pytest.fail(f"voxcpm-serve did not exit within {limit_s:.0f} s{self.log_tail()}")

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


