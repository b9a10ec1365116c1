"""The worker process's start-up (`worker_main`, what `engine.serving.processes` spawns): its CPU share and torch's
threads, the socket it listens on first, the engine's load and warm-up, and a Stop that interrupts them; then the
`Worker` (`engine.serving.worker`) serves until it is stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np
import torch

from engine.io.audio import encode_latents
from engine.llm_engine import LLMEngine
from engine.serving import protocol as p
from engine.serving.collector import freeze_startup_heap
from engine.serving.protocol import WorkerOptions, name_process
from engine.serving.reports import describe
from engine.serving.worker import Acceptor, DeviceLostError, Worker
from engine.startup import kernel_cache
from engine.vocabulary import SamplingParams

log = logging.getLogger(__name__)


def warm_up(engine: LLMEngine) -> dict[str, float]:
    """Zero-shot, then a synthetic clip in both roles (HiFi) where the model takes a reference (VoxCPM2): the
    first requests allocate and compile what later ones reuse, before the worker reports ready. Seconds per part."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    mark = kernel_cache.RECORDER.mark()
    params = SamplingParams(max_generate_length=2, seed=0)
    engine.generate("Warm-up.", params)
    times["warmup_zeroshot_s"] = time.perf_counter() - t0
    m = engine.model
    sr = m.vae.sample_rate
    t = np.arange(sr) / sr
    tone = (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    t1 = time.perf_counter()
    prompt = encode_latents(m.vae, tone, sr, m.config.patch_size, "left")
    ref = encode_latents(m.vae, tone, sr, m.config.patch_size, "right") if m.config.architecture == "voxcpm2" else None
    t2 = time.perf_counter()
    times["warmup_encode_s"] = t2 - t1
    engine.generate("Warm-up.", params, prompt_text="A tone.", prompt_latents=prompt, ref_latents=ref)
    times["warmup_hifi_s"] = time.perf_counter() - t2
    times["warmup_s"] = time.perf_counter() - t0
    engine.kernel_compiles_since(mark, "warm-up")  # a stale manifest shows here (its variants compile in the warm-up)
    return times


class StoppedWhileStarting(BaseException):
    """The owner asked the worker to stop (or went away) before it was ready."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise StoppedWhileStarting


def watch_control_while_starting(control: Connection, ready: threading.Event) -> None:
    """Start-up takes seconds (load, kernels, graphs, warm-up) and the main loop reads the control pipe only after it:
    a Stop (or the owner gone) meanwhile interrupts the start-up in the main thread (SIGUSR1 -> StoppedWhileStarting),
    so the owner's stop does not wait for it, nor kill the worker after its timeout."""
    while not ready.is_set():
        try:
            if not control.poll(0.01):  # the start-up's end waits for this poll (joined before the main loop)
                continue
            msg = control.recv()
        except (EOFError, OSError):
            msg = p.Stop()
        if isinstance(msg, p.Stop):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)  # interrupts a blocking call too
            return


def worker_main(control: Connection, options: WorkerOptions) -> None:
    """Process entry point (spawned). Listens first, so clients connect while the model loads."""
    name_process(options.name)
    if options.cpus:
        os.sched_setaffinity(0, options.cpus)  # threads started from here on (torch's, the senders) inherit it
    elif not options.device.startswith("cuda"):
        # A CPU engine on cores it shares with the HTTP processes yields to them: probes, refusals (503) and the
        # encoding of what it made stay prompt while it computes (docs/benchmarks.md, "Overload on the CPU demo").
        os.nice(5)
    imported_s = time.time() - options.spawned_at if options.spawned_at else None  # spawn, Python, torch, engine
    logging.basicConfig(level=max(options.log_level, logging.INFO),  # DEBUG only for our loggers, not torch's
                        format=f"%(asctime)s worker[{options.device}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("engine").setLevel(options.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its owner stops it (Ctrl-C reaches the whole process group)
    gpu = options.device.startswith("cuda")
    # A GPU worker's few host tensor ops gain nothing from a thread pool that spins beside the loop. A CPU worker on
    # cores it shares leaves one to the rest: every op waits at its thread pool's barrier for the slowest thread, so
    # with a thread on each core, one core busy elsewhere (an API process, a neighbour) slows every op to that
    # thread's share of it. On cores reserved for it (options.cpus) it takes them all.
    threads = options.torch_threads or (1 if gpu else len(os.sched_getaffinity(0)) - (0 if options.cpus else 1))
    torch.set_num_threads(max(1, threads))
    listener = None
    ready = threading.Event()
    watcher = threading.Thread(target=watch_control_while_starting, args=(control, ready), name="worker-start-stop",
                               daemon=True)
    try:
        signal.signal(signal.SIGUSR1, _raise_stopped)
        watcher.start()
        with contextlib.suppress(FileNotFoundError):  # a socket file left by a worker that died on this address
            os.unlink(options.address)
        listener = Listener(options.address, family="AF_UNIX", authkey=options.authkey)
        acceptor = Acceptor(listener)
        if gpu:
            torch.cuda.set_device(torch.device(options.device))
        engine = LLMEngine(options.model_path, options.engine, options.device)
        info = describe(engine)
        if options.warmup:
            info.startup = dataclasses.replace(info.startup, **warm_up(engine))
        frozen = freeze_startup_heap()  # a full collection of it would stop every stream (engine.serving.collector)
        log.debug("%d objects of the start-up frozen out of the garbage collector", frozen)
        if imported_s is not None:
            info.startup.process_import_s = imported_s
            info.startup.spawn_to_ready_s = time.time() - options.spawned_at
        worker = Worker(engine, control, info, acceptor)  # its collector count starts after the freeze's own pass
        ready.set()
        watcher.join()  # from here on the main loop reads the control pipe; a Stop the watcher took raises here
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    except StoppedWhileStarting:
        log.info("stopped during start-up")
        if listener is not None:
            listener.close()
        return
    except BaseException as e:  # report why instead of dying silently
        log.error("worker failed to start:\n%s", traceback.format_exc())
        with contextlib.suppress(OSError):
            control.send(p.Fatal(f"{type(e).__name__}: {e}"))
        if listener is not None:
            listener.close()
        return
    control.send(p.Started(info))
    log.info("worker ready on %s, serving clients at %s", options.device, options.address)
    try:
        with contextlib.suppress(EOFError, OSError):
            worker.run()
    except DeviceLostError:
        log.critical("worker exiting, its device is lost:\n%s", traceback.format_exc())
        listener.close()
        worker.close(goodbye=None)
        raise SystemExit(75) from None  # clients fail their callers at once; the owner restarts the worker
    listener.close()
    worker.close()
