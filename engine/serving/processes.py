"""Spawning and watching engine worker processes: the library pool's side and the service supervisor's.

Each worker is spawned (CUDA cannot be forked) with a control pipe, which reports how its start-up ended and
carries Stop; the pipe closing means the process ended. Clients reach the worker through its Unix socket
(`address`), in a private directory of the owner's, authenticated with the owner's key.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from typing import Any

from engine.errors import PoolError, WorkerDiedError
from engine.serving import protocol as p

log = logging.getLogger(__name__)


def _run_worker(control: Any, options: Any) -> None:
    """The spawned process's entry point (it imports the engine, and torch, only there)."""
    from engine.serving.worker import worker_main

    worker_main(control, options)


class WorkerProcess:
    """One spawned worker: its process, its control pipe, how its start-up ended."""

    def __init__(self, index: int, options: Any, on_exit: Callable[[WorkerProcess], None] | None = None) -> None:
        self.index, self.options = index, options
        self.address: str = options.address
        self.device: str = options.device
        ctx = mp.get_context("spawn")
        self.control, child = ctx.Pipe()
        self.process = ctx.Process(target=_run_worker, name=f"voxcpm-worker-{index}", args=(child, options),
                                   daemon=True)
        self.process.start()
        child.close()  # our copy: the pipe must close when the child exits
        self.started: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self.exited = threading.Event()
        self._on_exit = on_exit
        threading.Thread(target=self._watch, name=f"voxcpm-watch-{index}", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                msg = self.control.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, p.Started):
                self.started.set_result(msg.info)
            elif isinstance(msg, p.Fatal):
                self.started.set_exception(PoolError(f"worker {self.index} ({self.device}) failed to start: "
                                                     f"{msg.message}"))
        self.process.join(timeout=10)
        if not self.started.done():
            self.started.set_exception(WorkerDiedError(f"worker {self.index} ({self.device}) exited during start-up "
                                                       f"(code {self.process.exitcode})"))
        self.exited.set()
        if self._on_exit is not None:
            self._on_exit(self)

    @property
    def alive(self) -> bool:
        return not self.exited.is_set() and self.process.is_alive()

    @property
    def failed_to_start(self) -> BaseException | None:
        return self.started.exception() if self.started.done() else None

    def kill(self) -> None:
        """Terminate the process abruptly (tests and chaos drills)."""
        self.process.kill()

    def request_stop(self) -> None:
        """Ask the worker to finish: it tells its clients Goodbye and exits."""
        with contextlib.suppress(OSError, ValueError):
            self.control.send(p.Stop())

    def join(self, timeout: float) -> None:
        """Wait for the process to end (request_stop first), killing it after `timeout`."""
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("worker %d did not stop within %.0f s: killing it", self.index, timeout)
            self.process.kill()
            self.process.join(5)
        self.exited.wait(10)
        with contextlib.suppress(OSError):
            self.control.close()


def socket_address(directory: str, index: int) -> str:
    return os.path.join(directory, f"worker-{index}.sock")
