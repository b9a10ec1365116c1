"""A real voxcpm-serve over real HTTP for the service tests: uvicorn in a thread on a free port, the
real engine pool (a spawned worker) on a tiny random checkpoint, on the CPU."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from engine.serving.reports import WorkerStats
from service.app import create_app, server_options
from service.engine_setup import WorkerEndpoint
from service.settings import Settings
from tools.soak import wav_bytes  # noqa: F401 (the tests' clip maker)

# One TLS context for every test client: httpx makes one per client otherwise, reading the CA bundle (~50 ms of CPU),
# and the tests make thousands (a client a test, a readiness poll every 50 ms while a server starts).
TLS = ssl.create_default_context()

SAMPLES_PER_PATCH = 7680  # tiny-voxcpm2: 4 latent frames x 1920 samples at 48 kHz
SAMPLE_RATE = 48000


def small_window_socket(port: int, timeout: float = 60) -> socket.socket:
    """A client connection to 127.0.0.1:`port` that takes 4 KiB at a time: audio it has not read waits in the server."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(timeout)  # a hang guard
    sock.connect(("127.0.0.1", port))
    return sock


def send_post(sock: socket.socket, path: str, body: str) -> None:
    """An HTTP/1.1 POST of a JSON `body`, written on `sock` (its answer is the caller's to read, or not)."""
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())


def free_port() -> int:
    """A free loopback port. Under pytest-xdist only one in this worker's share (port // 2 modulo the workers: the
    kernel hands out one parity first), so that no two workers take the same port between finding and binding it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port // 2 % workers == share:
            return port
    raise RuntimeError(f"no free port in worker {share}'s share of {workers} after 1000 tries")


# Euler steps a patch in the service tests: they test the service, and the parity tests the solver at the default 10;
# with 4 a tiny model's CPU step costs about half (CI's two cores run ~30 modules' servers).
SERVICE_TEST_TIMESTEPS = 4


def service_settings(checkpoint: Path, cache_dir: Path, **overrides: Any) -> Settings:
    values = dict(model_path=str(checkpoint), cache_dir=cache_dir, serverpool_max_num_seqs=4,
                  serverpool_max_model_len=512, serverpool_max_num_batched_tokens=2048, queue_coalesce_ms=5,
                  serverpool_inference_timesteps=SERVICE_TEST_TIMESTEPS)
    values.update(overrides)
    return Settings(**values)


class LiveServer:
    def __init__(self, settings: Settings, endpoint: WorkerEndpoint | None = None) -> None:
        """The app owning its workers (endpoint None) or, like an API process of the supervisor's, connected to
        workers started elsewhere."""
        self.settings = settings
        self.app = create_app(settings, endpoint)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                **server_options(settings))
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, name="voxcpm-serve-test", daemon=True)

    def _run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve()

        asyncio.run(serve())

    def start(self, ready: bool = True) -> LiveServer:
        self.thread.start()
        self.wait(lambda: self.server.started, "uvicorn did not start")
        if ready:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Until GET /ready answers 200: the service's readiness read in this process until it holds, then over HTTP
        (a request every 50 ms while the worker starts cost the server and this client ~1 s of CPU a start)."""
        self.wait(lambda: getattr(self.app.state, "service", None) is not None and self.state.ready,
                  "service never became ready")
        self.wait(lambda: httpx.get(self.url + "/ready", verify=TLS).status_code == 200, "service never became ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    @property
    def state(self):
        return self.app.state.service

    def call(self, coro: Coroutine) -> Any:
        """Run a coroutine on the server's loop (where the pool lives)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def pool_stats(self) -> WorkerStats:
        return self.call(self.state.pool.stats())[0]

    @staticmethod
    def wait(predicate, message: str, limit_s: float = 120) -> None:
        """Poll until predicate() holds (a generous deadline against hangs, not a timing assertion)."""
        deadline = time.monotonic() + limit_s
        while True:
            try:
                if predicate():
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, message
            time.sleep(0.05)


@contextmanager
def live_server(checkpoint_factory, cache_dir: Path, **overrides: Any) -> Iterator[LiveServer]:
    """A started LiveServer on the never-stopping tiny checkpoint, stopped on exit (for module fixtures)."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    s = LiveServer(service_settings(ckpt, cache_dir, **overrides)).start()
    try:
        yield s
    finally:
        s.stop()
