"""`voxcpm-serve`'s main process: one engine worker per device and several API processes in front of them.

Why several: one process's event loop cannot carry every stream of a GPU (delivering 100+ streams' chunks,
encoding MP3, writing HTTP) without falling behind the engine. Each API process is a whole FastAPI app under
uvicorn, listening on the same port (SO_REUSEPORT: the kernel spreads connections over them), connected to
every worker; it encodes the audio of its own streams on its encoder threads. They share the voice database
and write their metrics where any of them can sum them up.

The supervisor starts the workers and the API processes, restarts either when it dies (one that keeps dying
soon after its start stops the service, which its orchestrator then sees), and on SIGTERM or SIGINT stops the API
processes (uvicorn lets in-flight responses finish) and then the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.serving.routing import LoadTable
from service import engine_setup
from service.settings import Settings

if TYPE_CHECKING:
    from engine.serving.processes import WorkerSet

log = logging.getLogger(__name__)
CHECK_EVERY_S = 0.5
RESTART_BACKOFF_S = (1.0, 30.0)  # first and longest pause before restarting a worker that died again
MAX_DEATHS = 5  # a worker dying more often than this in ten minutes stops the service (the orchestrator sees it)
MAX_START_FAILURES = 3  # restarts in a row that died before loading: the device or the host is broken, stop
API_QUICK_EXIT_S = 30.0  # an API process that exits this soon after its start did not come up
MAX_API_QUICK_EXITS = 3  # that many in a row: its start cannot work here (a setting, the port, the host), stop
API_HOLD_MAX_S = 60.0  # longest the API processes wait for the kernel precompile (/health answers only after them)


def listening_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket on host:port with SO_REUSEPORT, so that every API process binds its own and the kernel
    balances connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
        sock.set_inheritable(True)
    return sock


def api_process_main(settings: Settings, endpoint: engine_setup.WorkerEndpoint, index: int) -> None:
    """One API process (spawned): the app under uvicorn on its own SO_REUSEPORT socket."""
    import uvicorn

    from engine.serving.protocol import name_process
    from service.app import create_app, server_options

    name_process(f"voxcpm-api{index}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s api[{index}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("engine").setLevel(endpoint.engine_log_level)  # DEBUG: when each request goes to its worker
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    sock = listening_socket(settings.host, settings.port)
    # The supervisor drains first (DRAIN_SIGNAL, then waits for what is in flight): uvicorn's own wait is a backstop.
    config = uvicorn.Config(create_app(settings, endpoint), log_level="info", **server_options(settings))
    uvicorn.Server(config).run(sockets=[sock])


def _exit_with_parent(parent: int) -> None:
    """A supervisor killed outright cannot stop its API processes: each stops itself (gracefully) instead."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.t0 = time.monotonic()
        self.settings = settings
        self.stopping = asyncio.Event()
        self.ctx = mp.get_context("spawn")
        self.api: list[mp.process.BaseProcess] = []

    async def run(self) -> int:
        """Serve until a signal asks to stop (0) or the service cannot run (1)."""
        from engine.serving.devices import device_names
        from engine.serving.pool import checked_model_path
        from engine.serving.processes import WorkerSet, reserve_cpus, worker_log_level
        from engine.serving.protocol import name_process
        from engine.serving.voxcpm import engine_config

        name_process("voxcpm-serve")
        s = self.settings
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        try:
            port_guard = listening_socket(s.host, s.port, listen=False)  # fail fast if the port is taken
        except OSError as e:
            log.error("cannot listen on %s:%d: %s", s.host, s.port, e)
            return 1
        runtime = Path(tempfile.mkdtemp(prefix="voxcpm-serve-"))
        metrics_dir = runtime / "metrics"
        metrics_dir.mkdir()
        # prometheus_client reads this when an API process imports it: each process writes its values there.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        workers = None
        try:
            try:
                model_path, demo = await asyncio.to_thread(engine_setup.model_checkpoint, s)
                model_path = await asyncio.to_thread(checked_model_path, model_path)
            except ValueError as e:  # CheckpointError: not a checkpoint, not downloadable
                log.error("cannot serve %s: %s", s.model_path, e)
                return 1
            try:
                lora_path = await asyncio.to_thread(engine_setup.adapter_path, s)
            except ValueError as e:  # not fetchable, or not the adapter the digest names
                log.error("cannot load the LoRA adapter: %s", e)
                return 1
            engine_setup.prepare_kernel_cache(s)  # before the precompile and the workers, which read it
            arguments = engine_setup.engine_arguments(s, demo, lora_path)
            try:
                devices, warmup = device_names(arguments.pop("devices")), arguments.pop("warmup")
            except ValueError as e:  # GPUs asked for that this host does not have: a configuration error
                log.error("NANOVLLM_SERVERPOOL_DEVICES: %s", e)
                return 2
            split = reserve_cpus(len(devices), s.worker_cpus)
            log.info("spawning the workers %.1f s after start (%s)", time.monotonic() - self.t0,
                     f"cores {split[0]} reserved for them, {split[1]} for the rest" if split else "no cores reserved")
            workers = WorkerSet(model_path, devices, engine_config(**arguments), warmup=warmup,
                                cpus=split[0] if split else None)
            if split:
                os.sched_setaffinity(0, split[1])  # what this process starts from now on runs on the other cores
            count = s.api_process_count(len(os.sched_getaffinity(0)))
            LoadTable.create(runtime / "load", count + 1, len(devices))  # + a row the supervisor reads through
            LoadTable.create(runtime / "responses", count + 1, 1)
            endpoint = engine_setup.WorkerEndpoint(workers.addresses, workers.authkey, model_path, demo,
                                                   engine_setup.voice_db_path(s, model_path, runtime),
                                                   multiprocess_metrics=True,
                                                   load_table=runtime / "load",
                                                   responses_table=runtime / "responses",
                                                   encoder_threads=s.encoder_thread_count(count, len(devices)),
                                                   engine_log_level=worker_log_level(workers.config.options))
            if not await self._after_precompile(workers):
                return 0
            self.api = [self._spawn_api(endpoint, i) for i in range(count)]
            log.info("%d engine worker(s) on %s, %d API process(es) with %d encoder threads each on %s:%d (%.1f s "
                     "after start)", len(devices), ", ".join(devices), len(self.api), endpoint.encoder_threads, s.host,
                     s.port, time.monotonic() - self.t0)
            return await self._watch(workers, endpoint)
        finally:
            await self._shutdown(workers, runtime / "responses")
            port_guard.close()
            shutil.rmtree(runtime, ignore_errors=True)

    async def _after_precompile(self, workers: WorkerSet) -> bool:
        """Hold the API processes back while the kernel precompile (an empty kernel cache) compiles: fourteen imports
        beside its compile processes slowed the workers' own start more than an API process takes to start after it
        (docs/benchmarks.md, cold start). A worker cannot be ready before the precompile ends (its engine waits for
        it), so only a worker's failed start, a stop or API_HOLD_MAX_S end the wait earlier. False: asked to stop."""
        held = time.monotonic()
        while workers.precompile_thread is not None and not self.stopping.is_set():
            if not workers.precompile_thread.is_alive():
                reason = "kernel precompile done"
            elif any(w.started.done() for w in workers.processes):
                reason = "a worker's start-up ended"
            elif time.monotonic() - held > API_HOLD_MAX_S:
                reason = f"kernel precompile still running after {API_HOLD_MAX_S:.0f} s"
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 0.05)
                continue
            log.info("%s: API processes start (%.1f s after start, %.1f s held back)", reason,
                     time.monotonic() - self.t0, time.monotonic() - held)
            break
        return not self.stopping.is_set()

    def _spawn_api(self, endpoint: engine_setup.WorkerEndpoint, index: int) -> mp.process.BaseProcess:
        endpoint = dataclasses.replace(endpoint, row=index)
        proc = self.ctx.Process(target=api_process_main, args=(self.settings, endpoint, index),
                                name=f"voxcpm-api-{index}", daemon=False)
        proc.start()
        return proc

    async def _watch(self, workers: WorkerSet, endpoint: engine_setup.WorkerEndpoint) -> int:
        from prometheus_client import multiprocess

        deaths: dict[int, list[float]] = {}  # per worker, when it died (the last ten minutes)
        start_failures: dict[int, int] = {}  # per worker, restarts in a row that died before they were ready
        restart_at: dict[int, float] = {}
        api_started = [time.monotonic()] * len(self.api)  # per API process, when it started
        quick_exits: dict[int, int] = {}  # per API process, exits in a row soon after its start
        api_restart_at: dict[int, float] = {}
        while not self.stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), CHECK_EVERY_S)
            if self.stopping.is_set():
                break
            if self.settings.worker_stuck_timeout_s:
                workers.kill_stuck(self.settings.worker_stuck_timeout_s)  # then found dead below, soon
            now = time.monotonic()
            for w in workers.processes:
                if w.alive or w.index in restart_at:
                    continue
                if not deaths.get(w.index) and w.failed_to_start is not None:
                    log.error("%s; stopping the service", w.failed_to_start)  # the configuration cannot work
                    return 1
                deaths[w.index] = [t for t in deaths.get(w.index, []) if now - t < 600] + [now]
                start_failures[w.index] = start_failures.get(w.index, 0) + 1 if w.failed_to_start else 0
                if start_failures[w.index] >= MAX_START_FAILURES:
                    log.error("worker %d died while starting %d times in a row (%s); stopping the service", w.index,
                              start_failures[w.index], w.failed_to_start)
                    return 1
                if not self.settings.restart_dead_workers or len(deaths[w.index]) > MAX_DEATHS:
                    log.error("worker %d died (exit code %s) %d time(s) in ten minutes; stopping the service",
                              w.index, w.exitcode, len(deaths[w.index]))
                    return 1
                pause = min(RESTART_BACKOFF_S[1], RESTART_BACKOFF_S[0] * 2 ** (len(deaths[w.index]) - 1))
                restart_at[w.index] = now + pause
                log.error("worker %d died (exit code %s): restarting it in %.0f s", w.index, w.exitcode, pause)
            for index, when in list(restart_at.items()):
                if now >= when:
                    del restart_at[index]
                    workers.restart(index)
            for i, proc in enumerate(self.api):
                if proc.is_alive() or i in api_restart_at:
                    continue
                multiprocess.mark_process_dead(proc.pid)
                if endpoint.load_table is not None:
                    LoadTable.clear_row(endpoint.load_table, i, len(endpoint.addresses))
                if endpoint.responses_table is not None:
                    LoadTable.clear_row(endpoint.responses_table, i, 1)
                quick = now - api_started[i] < API_QUICK_EXIT_S
                quick_exits[i] = quick_exits.get(i, 0) + 1 if quick else 0
                if quick_exits[i] >= MAX_API_QUICK_EXITS:
                    log.error("API process %d exited %d times in a row within %.0f s of its start (code %s); stopping "
                              "the service", i, quick_exits[i], API_QUICK_EXIT_S, proc.exitcode)
                    return 1
                pause = min(RESTART_BACKOFF_S[1], RESTART_BACKOFF_S[0] * 2 ** (quick_exits[i] - 1)) if quick else 0.0
                api_restart_at[i] = now + pause
                log.error("API process %d exited (code %s): starting it again in %.0f s", i, proc.exitcode, pause)
            for i, when in list(api_restart_at.items()):
                if now >= when:
                    del api_restart_at[i]
                    self.api[i], api_started[i] = self._spawn_api(endpoint, i), now
        log.info("stopping: API processes first (in-flight responses finish), then the workers")
        return 0

    async def _shutdown(self, workers: WorkerSet | None, responses_table: Path | None = None) -> None:
        """Drain the API processes (not ready, new requests 503) until no response or WebSocket session is open or
        the grace period ends, then stop them (uvicorn closes the connections), then the workers."""
        live = [proc for proc in self.api if proc.is_alive()]
        for proc in live:
            os.kill(proc.pid, engine_setup.DRAIN_SIGNAL)
        if live and responses_table is not None and responses_table.exists():
            table = LoadTable(1, responses_table, row=len(self.api))  # a spare row: read-only here
            deadline = time.monotonic() + self.settings.shutdown_grace_s
            log.info("draining: %d open response(s) and session(s) over the API processes, up to %.0f s",
                     int(table.loads().sum()), self.settings.shutdown_grace_s)
            while table.loads().sum() > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            left = int(table.loads().sum())
            table.close()
            if left:
                log.warning("%d response(s) still in flight after the %.0f s grace period: stopping anyway", left,
                            self.settings.shutdown_grace_s)
        for proc in live:
            os.kill(proc.pid, signal.SIGTERM)
        for proc in live:
            await asyncio.to_thread(proc.join, 15)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        if workers is not None:
            await asyncio.to_thread(workers.stop)
