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
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.errors import PoolError, WorkerDiedError
from engine.serving import protocol as p
from engine.serving.reports import WorkerInfo

if TYPE_CHECKING:
    from engine.engine_config import EngineConfig
    from engine.options import EngineOptions
    from engine.startup.kernel_cache import Precompiler

log = logging.getLogger(__name__)


def _run_worker(control: Any, options: p.WorkerOptions) -> None:
    """The spawned process's entry point (it imports the engine, and torch, only there)."""
    from engine.serving.worker_startup import worker_main

    worker_main(control, options)


class WorkerProcess:
    """One spawned worker: its process, its control pipe, how its start-up ended."""

    def __init__(self, index: int, options: p.WorkerOptions,
                 on_exit: Callable[[WorkerProcess], None] | None = None) -> None:
        self.index, self.options = index, options
        self.address: str = options.address
        self.device: str = options.device
        ctx = mp.get_context("spawn")
        self.control, child = ctx.Pipe()
        self.process = ctx.Process(target=_run_worker, name=f"voxcpm-worker-{index}", args=(child, options),
                                   daemon=True)
        self.process.start()
        child.close()  # our copy: the pipe must close when the child exits
        self.started: concurrent.futures.Future[WorkerInfo] = concurrent.futures.Future()
        # When the Ping its loop has not answered yet was sent (None: none is; one at a time, since a stuck worker's
        # pipe would fill and then block its owner), and whether it is asked any more (from Started until it ends).
        self.pinged_at: float | None = None
        self.pingable = False
        self.exited = threading.Event()
        self._on_exit = on_exit
        threading.Thread(target=self._watch, name=f"voxcpm-watch-{index}", daemon=True).start()

    def _watch(self) -> None:
        """The only thread that reaps the process (two threads waiting on one child race each other)."""
        while True:
            try:
                msg = self.control.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, p.Pong):
                self.pinged_at = None
            elif isinstance(msg, p.Started):
                self.pingable = True
                self.started.set_result(msg.info)
            elif isinstance(msg, p.Fatal):
                self.started.set_exception(PoolError(f"worker {self.index} ({self.device}) failed to start: "
                                                     f"{msg.message}"))
        self.process.join()  # the control pipe closes when the process ends
        if not self.started.done():
            self.started.set_exception(WorkerDiedError(f"worker {self.index} ({self.device}) exited during start-up "
                                                       f"(code {self.process.exitcode})"))
        self.exited.set()
        if self._on_exit is not None:
            self._on_exit(self)

    @property
    def alive(self) -> bool:
        """Not yet reaped (a process killed a moment ago still counts until its watcher has seen it end)."""
        return not self.exited.is_set()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode if self.exited.is_set() else None

    @property
    def failed_to_start(self) -> BaseException | None:
        return self.started.exception() if self.started.done() else None

    def ping(self) -> float:
        """Ask the started worker's loop for a Pong (unless one is asked for already); the seconds its oldest
        unanswered Ping has waited (0 when none waits, before it started or once it ended)."""
        if not self.pingable or not self.alive:
            return 0.0
        sent = self.pinged_at  # read once: the watcher thread clears it when the Pong comes, maybe at once
        if sent is None:
            sent = self.pinged_at = time.monotonic()
            with contextlib.suppress(OSError, ValueError):
                self.control.send(p.Ping())
        return time.monotonic() - sent

    def kill(self) -> None:
        """Terminate the process abruptly (tests and chaos drills)."""
        if not self.exited.is_set():
            self.process.kill()

    def request_stop(self) -> None:
        """Ask the worker to finish: it tells its clients Goodbye and exits."""
        with contextlib.suppress(OSError, ValueError):
            self.control.send(p.Stop())

    def join(self, timeout: float) -> None:
        """Wait for the process to end (request_stop first), killing it after `timeout`."""
        if not self.exited.wait(timeout):
            log.warning("worker %d did not stop within %.0f s: killing it", self.index, timeout)
            self.kill()
            self.exited.wait(10)
        with contextlib.suppress(OSError):
            self.control.close()


def reserve_cpus(workers: int, per_worker: int, keep: int = 2) -> tuple[list[list[int]], list[int]] | None:
    """Split this process's cores: `per_worker` of them for each engine worker (the last ones) and the rest for
    everything else, so that no other thread of the service runs on a worker's cores (its host loop drives the
    GPU: a step waiting for a core is a step every stream waits for). None when that would leave fewer than
    `keep` cores for the rest, or nothing is to be reserved."""
    cores = sorted(os.sched_getaffinity(0))
    reserved = workers * per_worker
    if not per_worker or len(cores) - reserved < keep:
        return None
    rest, own = cores[:len(cores) - reserved], cores[len(cores) - reserved:]
    return [own[i * per_worker:(i + 1) * per_worker] for i in range(workers)], rest


def socket_address(directory: str, index: int) -> str:
    return os.path.join(directory, f"worker-{index}.sock")


def worker_log_level(options: EngineOptions) -> int:
    """The options' log level (VOXCPM_LOG_LEVEL, e.g. DEBUG) for the workers, else the parent's root level."""
    name = options.log_level
    level = logging.getLevelName(name) if name else logging.getLogger().level
    return level if isinstance(level, int) else logging.INFO


class WorkerSet:
    """The worker processes of one engine (a library pool's, or the service supervisor's): spawned on sockets in
    a private directory, authenticated with a fresh key, restarted on the same addresses."""

    def __init__(self, model_path: str, devices: list[str], config: EngineConfig, *, warmup: bool = False,
                 on_exit: Any = None, cpus: list[list[int]] | None = None) -> None:
        self.model_path, self.devices, self.config, self.warmup = model_path, devices, config, warmup
        self.cpus = cpus  # per worker, the cores reserved for it (None: not pinned)
        self.directory = tempfile.mkdtemp(prefix="voxcpm-workers-")  # mode 0700: only this user reaches the sockets
        self.authkey = os.urandom(32)
        self._on_exit = on_exit
        self.processes = [self._spawn(i) for i in range(len(devices))]
        self.precompiler = self._precompile_early()

    @property
    def addresses(self) -> list[str]:
        return [socket_address(self.directory, i) for i in range(len(self.devices))]

    @property
    def precompile_thread(self) -> threading.Thread | None:
        """The thread that waits for the early precompile's compiling children; None when nothing compiles."""
        return self.precompiler.background if self.precompiler is not None else None

    def _precompile_early(self) -> Precompiler | None:
        """Start compiling the kernel manifest here, while the workers import and load (seconds before an engine
        starts); a worker's engine waits for it before its first kernel (or compiles itself what is
        left, if it gets there first). No device: this process never initialises CUDA (the architecture comes
        from nvidia-smi)."""
        if not any(d.startswith("cuda") for d in self.devices):
            return None
        from engine.startup import kernel_cache

        return kernel_cache.Precompiler(self.model_path, self.config.dtype, None, background=True,
                                        variant=kernel_cache.manifest_variant(self.config))

    def _spawn(self, index: int) -> WorkerProcess:
        options = p.WorkerOptions(model_path=self.model_path, device=self.devices[index], engine=self.config,
                                address=socket_address(self.directory, index), authkey=self.authkey,
                                warmup=self.warmup, log_level=worker_log_level(self.config.options),
                                name=f"voxcpm-worker{index}",
                                spawned_at=time.time(), cpus=self.cpus[index] if self.cpus else None)
        return WorkerProcess(index, options, self._on_exit)

    def restart(self, index: int) -> None:
        """Replace worker `index` (ended) by a new process on the same address."""
        self.processes[index].join(1)
        self.processes[index] = self._spawn(index)

    def restart_dead(self, lost: list[int] | tuple[int, ...] = ()) -> list[int]:
        """Replace every worker process that has ended, and those in `lost` (their clients lost them: a killed
        process may not be reaped yet; one still running after a few seconds is killed); their indices."""
        for i in lost:
            self.processes[i].join(5)
        dead = [i for i, w in enumerate(self.processes) if not w.alive]
        for i in dead:
            self.restart(i)
        return dead

    def kill_stuck(self, after_s: float) -> list[int]:
        """Ping every started worker and kill those that answered nothing for `after_s` (a GPU call that never
        returns: the loop that would read a Stop is stuck too); their owner restarts them as any that died. Their
        indices."""
        stuck = [w for w in self.processes if w.ping() > after_s]
        for w in stuck:
            log.error("worker %d (%s) answered no ping for %.0f s (a GPU call that never returns?): killing it",
                      w.index, w.device, after_s)
            w.pingable = False  # asked nothing more: it is ending
            w.kill()
        return [w.index for w in stuck]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the early precompile's children if they still compile (a stop during start-up), then every worker
        (they say Goodbye to their clients first), then remove the socket directory."""
        if self.precompiler is not None:
            self.precompiler.close()
        for w in self.processes:
            w.request_stop()
        for w in self.processes:
            w.join(timeout)
        shutil.rmtree(self.directory, ignore_errors=True)
