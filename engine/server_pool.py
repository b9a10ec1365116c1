"""The server pool: one worker process per device, requests routed to the least-loaded one.

`VoxCPM.from_pretrained(...)` returns an `AsyncVoxCPMServerPool` when called inside a running event
loop and a `SyncVoxCPMServerPool` (the same pool driven from a private loop thread) otherwise.

Each worker has a reader thread that hands its messages to the event loop and a sender thread, so
the loop never blocks on a pipe. When a worker dies its pipe closes: every request waiting on it is
woken with `WorkerDiedError` at once, the pool reports itself unhealthy, and `restart()` brings it
back (registered prompts are replayed to the new worker).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import multiprocessing as mp
import os
import queue
import threading
from collections.abc import AsyncIterator, Coroutine
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from engine import kernel_cache
from engine.checkpoint import CheckpointError, resolve_model_path
from engine.errors import PoolError, PoolStoppedError, PromptNotFoundError, RequestError, WorkerDiedError, error_from
from engine.llm_engine import EngineConfig
from engine.worker import worker_main

log = logging.getLogger(__name__)
T = TypeVar("T")
_END = object()


def _worker_log_level() -> int:
    """VOXCPM_LOG_LEVEL (e.g. DEBUG) for the workers, else the parent's root level."""
    name = os.environ.get("VOXCPM_LOG_LEVEL", "").upper()
    level = logging.getLevelName(name) if name else logging.getLogger().level
    return level if isinstance(level, int) else logging.INFO


class _WorkerHandle:
    """The parent's side of one worker process."""

    def __init__(self, index: int, device: str, model_path: str, config: dict[str, Any],
                 loop: asyncio.AbstractEventLoop, on_message: Any, on_exit: Any) -> None:
        self.index, self.device = index, device
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, name=f"voxcpm-worker-{index}",
                                   args=(child, model_path, device, config, _worker_log_level()), daemon=True)
        self.process.start()
        child.close()  # our copy: the pipe must close when the child exits
        self.ready: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.alive = True
        self.load = 0  # in-flight generations
        self.snapshot: dict[str, int] = {}  # the worker's last reported running/waiting/free_blocks
        self.pending: dict[str, asyncio.Queue[Any] | asyncio.Future[Any]] = {}
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loop = loop
        self._on_message, self._on_exit = on_message, on_exit
        threading.Thread(target=self._read, name=f"voxcpm-reader-{index}", daemon=True).start()
        threading.Thread(target=self._write, name=f"voxcpm-sender-{index}", daemon=True).start()

    @property
    def is_ready(self) -> bool:
        """Loaded: its start-up succeeded (it may have died since; see `alive`)."""
        return self.ready.done() and not self.ready.exception()

    def send(self, msg: tuple) -> None:
        if not self.alive:
            raise WorkerDiedError(f"worker {self.index} ({self.device}) is not running")
        self._outbox.put(msg)

    def _write(self) -> None:
        while (msg := self._outbox.get()) is not _END:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                return  # the reader sees the death

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._loop.call_soon_threadsafe(self._on_message, self, msg)
            except RuntimeError:  # loop closed
                break
        self._outbox.put(_END)  # the sender thread ends too
        self.process.join(timeout=5)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._on_exit, self)


class AsyncVoxCPMServerPool:
    def __init__(self, model: str, devices: list[str], config: EngineConfig) -> None:
        self.model_path = str(resolve_model_path(model))
        self.devices = devices
        self.config = config
        self._loop = asyncio.get_running_loop()
        self._prompts: dict[str, tuple[bytes, str]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._precompile_early(devices)
        self._workers = [self._spawn(i, d) for i, d in enumerate(devices)]

    def _precompile_early(self, devices: list[str]) -> None:
        """Start compiling the kernel manifest here, while the workers spawn and import (~6 s before an engine
        starts on an H100 machine); a worker's engine waits for it before its first kernel. No device: this
        process never initialises CUDA (the architecture comes from nvidia-smi)."""
        if any(d.startswith("cuda") for d in devices):
            kernel_cache.Precompiler(self.model_path, self.config.dtype, None, background=True)

    def _spawn(self, index: int, device: str) -> _WorkerHandle:
        return _WorkerHandle(index, device, self.model_path, asdict(self.config), self._loop, self._on_message,
                             self._on_exit)

    # --- messages from workers (event loop thread) --------------------------------------------
    def _on_message(self, w: _WorkerHandle, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            if not w.ready.done():
                w.ready.set_result(msg[1])
        elif kind == "fatal":
            if not w.ready.done():
                w.ready.set_exception(PoolError(f"worker {w.index} ({w.device}) failed to start: {msg[1]}"))
        elif kind == "events":
            w.snapshot = msg[2]
            for rid, audio, finished, err_kind, err_msg in msg[1]:
                target = w.pending.get(rid)
                if isinstance(target, asyncio.Queue):
                    target.put_nowait(error_from(err_kind, err_msg) if err_kind else (audio, finished))
        elif kind == "reply":
            _, rid, value, err_kind, err_msg = msg
            target = w.pending.pop(rid, None)
            if isinstance(target, asyncio.Future) and not target.done():
                if err_kind:
                    target.set_exception(error_from(err_kind, err_msg))
                else:
                    target.set_result(value)

    def _on_exit(self, w: _WorkerHandle) -> None:
        w.alive = False
        code = w.process.exitcode
        if not self._stopped:
            log.error("worker %d (%s) exited with code %s", w.index, w.device, code)
        err_cls = PoolStoppedError if self._stopped else WorkerDiedError
        err = err_cls(f"worker {w.index} ({w.device}) exited (code {code})")
        if not w.ready.done():
            w.ready.set_exception(err)
            w.ready.exception()  # mark retrieved: nobody may be waiting
        for target in w.pending.values():
            if isinstance(target, asyncio.Queue):
                target.put_nowait(err)
            elif not target.done():
                target.set_exception(err)
        w.pending.clear()

    # --- state --------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """Every worker is running (ready or still loading) and the pool is not stopped."""
        return not self._stopped and all(w.alive for w in self._workers)

    @property
    def ready(self) -> bool:
        return self.healthy and all(w.is_ready for w in self._workers)

    def snapshot(self) -> list[dict[str, int]]:
        """Per worker, without a round trip: in-flight requests (as routed here) and the last load the
        worker reported (running, waiting, free_blocks, total_blocks; sent with its step events)."""
        return [{"in_flight": w.load, "alive": int(w.alive), **w.snapshot} for w in self._workers]

    async def wait_for_ready(self, timeout: float | None = None) -> None:
        """Until every worker has loaded the model (raises the first start-up failure)."""
        await asyncio.wait_for(asyncio.gather(*(asyncio.shield(w.ready) for w in self._workers)), timeout)

    async def _pick(self) -> _WorkerHandle:
        if self._stopped:
            raise PoolStoppedError("the pool is stopped")
        live = [w for w in self._workers if w.alive]
        if not live:
            raise WorkerDiedError("no worker is running; restart the pool")
        ready = [w for w in live if w.is_ready]
        if ready:
            return min(ready, key=lambda w: w.load)
        loading = [w for w in live if not w.ready.done()]
        if not loading:  # every live worker failed to start
            raise live[0].ready.exception()  # type: ignore[misc]
        await asyncio.wait([asyncio.shield(w.ready) for w in loading], return_when=asyncio.FIRST_COMPLETED)
        return await self._pick()

    async def _call(self, w: _WorkerHandle, op: str, *args: Any) -> Any:
        rid = f"r{next(self._ids)}"
        fut: asyncio.Future[Any] = self._loop.create_future()
        w.pending[rid] = fut
        try:
            w.send((op, rid, *args))
            return await fut
        finally:
            w.pending.pop(rid, None)

    # --- API ----------------------------------------------------------------------------------
    async def get_model_info(self) -> dict[str, Any]:
        w = await self._pick()
        info = dict(w.ready.result())
        info["devices"] = list(self.devices)
        return info

    async def stats(self) -> list[dict[str, Any] | None]:
        """Per worker: running/waiting sequences, free KV blocks, preemptions... (None for a dead one)."""
        out: list[dict[str, Any] | None] = []
        for w in self._workers:
            ok = w.alive and w.is_ready
            out.append(await self._call(w, "stats") if ok else None)
        return out

    async def encode_latents(self, wav: bytes, wav_format: str = "wav", padding: str = "left") -> bytes:
        """An audio file's bytes -> float32 latents bytes shaped (frames, feat_dim), frames a multiple of the
        patch size. padding="left" suits a continuation prompt, "right" a reference clip."""
        if padding not in ("left", "right"):
            raise RequestError("padding must be 'left' or 'right'")
        if not isinstance(wav, bytes | bytearray) or not wav:
            raise RequestError("wav must be non-empty bytes")
        return await self._call(await self._pick(), "encode_latents", bytes(wav), wav_format, padding)

    async def add_prompt(self, wav: bytes | None = None, wav_format: str = "wav", prompt_text: str = "", *,
                         latents: bytes | np.ndarray | None = None) -> str:
        """Register a voice prompt (audio or latents + its transcript) on every worker; returns its id,
        derived from the content, so the same prompt registered twice has one id."""
        if not prompt_text.strip():
            raise RequestError("prompt_text must not be empty")
        if (wav is None) == (latents is None):
            raise RequestError("give exactly one of wav or latents")
        if wav is not None:
            raw = await self.encode_latents(wav, wav_format)
        else:
            # Checked here: the prompt is replayed to every (restarted) worker, it must be usable there.
            feat_dim = int((await self._pick()).ready.result()["feat_dim"])
            if isinstance(latents, np.ndarray):
                if latents.ndim != 2 or latents.shape[1] != feat_dim or not latents.shape[0]:
                    raise RequestError(f"latents must be shaped (frames, {feat_dim}), got {latents.shape}")
                raw = np.ascontiguousarray(latents, dtype=np.float32).tobytes()
            elif isinstance(latents, bytes | bytearray | memoryview):
                raw = bytes(latents)
                if not raw or len(raw) % (4 * feat_dim):
                    raise RequestError(f"latents: float32 bytes must be a positive multiple of 4 * feat_dim = "
                                       f"{4 * feat_dim} bytes, got {len(raw)}")
            else:
                raise RequestError(f"latents must be float32 bytes or a numpy array, got {type(latents).__name__}")
        prompt_id = hashlib.blake2b(raw + prompt_text.encode(), digest_size=12).hexdigest()
        self._prompts[prompt_id] = (raw, prompt_text)
        for w in self._workers:
            if w.alive:
                w.send(("add_prompt", prompt_id, raw, prompt_text))
        return prompt_id

    async def remove_prompt(self, prompt_id: str) -> None:
        if self._prompts.pop(prompt_id, None) is None:
            raise PromptNotFoundError(f"prompt_id {prompt_id!r} is not registered")
        for w in self._workers:
            if w.alive:
                w.send(("remove_prompt", prompt_id))

    def list_prompts(self) -> list[str]:
        return list(self._prompts)

    async def generate(self, target_text: str, prompt_latents: bytes | np.ndarray | torch.Tensor | None = None,
                       prompt_text: str = "", prompt_id: str | None = None,
                       ref_audio_latents: bytes | np.ndarray | torch.Tensor | None = None,
                       max_generate_length: int = 2000, temperature: float = 1.0, cfg_value: float = 2.0,
                       min_len: int = 2, seed: int | None = None) -> AsyncIterator[np.ndarray]:
        """Stream float32 audio chunks (one per patch) at `get_model_info()["sample_rate"]`.
        Leaving the loop early (break, cancellation) aborts the request and frees its KV blocks."""
        if prompt_id is not None and prompt_id not in self._prompts:
            raise PromptNotFoundError(f"prompt_id {prompt_id!r} is not registered")
        w = await self._pick()
        rid = f"g{next(self._ids)}"
        events: asyncio.Queue[Any] = asyncio.Queue()
        request = dict(target_text=target_text, prompt_latents=_plain(prompt_latents), prompt_text=prompt_text,
                       prompt_id=prompt_id, ref_audio_latents=_plain(ref_audio_latents),
                       max_generate_length=max_generate_length, temperature=temperature, cfg_value=cfg_value,
                       min_len=min_len, seed=seed)
        w.pending[rid] = events
        w.load += 1
        finished = False
        try:
            w.send(("generate", rid, request))
            while not finished:
                item = await events.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                audio, finished = item
                yield audio
        finally:
            w.load -= 1
            w.pending.pop(rid, None)
            if not finished and w.alive:
                w.send(("abort", rid))

    async def restart(self, timeout: float | None = None) -> None:
        """Replace dead workers, replay registered prompts to them and wait until they are ready."""
        if self._stopped:
            raise PoolStoppedError("the pool is stopped")
        for i, w in enumerate(self._workers):
            if not w.alive:
                new = self._spawn(i, w.device)
                for prompt_id, (raw, text) in self._prompts.items():
                    new.send(("add_prompt", prompt_id, raw, text))
                self._workers[i] = new
        await self.wait_for_ready(timeout)

    def kill_worker(self, index: int) -> None:
        """Terminate one worker process abruptly (tests and chaos drills)."""
        self._workers[index].process.kill()

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop every worker (gracefully, then by force); in-flight requests get PoolStoppedError."""
        if self._stopped:
            return
        self._stopped = True
        for w in self._workers:
            if w.alive:
                w.send(("stop",))
        for w in self._workers:
            await asyncio.to_thread(w.process.join, timeout)
            if w.process.is_alive():
                w.process.kill()
                await asyncio.to_thread(w.process.join, 5)
        # Wake every caller now: the reader threads' exit notices may arrive after the loop is gone
        # (the sync pool closes its loop right after this returns). A second notice finds nothing.
        for w in self._workers:
            self._on_exit(w)


def _plain(value: Any) -> Any:
    """Latents travel to the worker as numpy (tensors may live on a device)."""
    return value.detach().float().cpu().numpy() if isinstance(value, torch.Tensor) else value


class SyncVoxCPMServerPool:
    """The async pool behind blocking calls, driven from a private event loop thread."""

    def __init__(self, model: str, devices: list[str], config: EngineConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="voxcpm-pool-loop", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._closed = False  # the loop is stopping or gone: nothing more may be submitted to it

        async def make() -> AsyncVoxCPMServerPool:
            return AsyncVoxCPMServerPool(model, devices, config)

        self.pool = self._run(make())

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._closed:  # a coroutine handed to a stopped loop would never finish: its caller would hang
                coro.close()
                raise PoolStoppedError("the pool is stopped")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self._submit(coro).result(timeout)

    @property
    def healthy(self) -> bool:
        return self.pool.healthy

    @property
    def ready(self) -> bool:
        return self.pool.ready

    def wait_for_ready(self, timeout: float | None = None) -> None:
        self._run(self.pool.wait_for_ready(timeout))

    def get_model_info(self) -> dict[str, Any]:
        return self._run(self.pool.get_model_info())

    def stats(self) -> list[dict[str, Any] | None]:
        return self._run(self.pool.stats())

    def snapshot(self) -> list[dict[str, int]]:
        return self.pool.snapshot()

    def encode_latents(self, wav: bytes, wav_format: str = "wav", padding: str = "left") -> bytes:
        return self._run(self.pool.encode_latents(wav, wav_format, padding))

    def add_prompt(self, wav: bytes | None = None, wav_format: str = "wav", prompt_text: str = "", *,
                   latents: bytes | np.ndarray | None = None) -> str:
        return self._run(self.pool.add_prompt(wav, wav_format, prompt_text, latents=latents))

    def remove_prompt(self, prompt_id: str) -> None:
        self._run(self.pool.remove_prompt(prompt_id))

    def generate(self, target_text: str, **kwargs: Any) -> _SyncStream:
        """Blocking iterator of float32 chunks; closing it (break + close(), also from another thread
        while one waits in next()) aborts the request."""
        return _SyncStream(self, self.pool.generate(target_text, **kwargs))

    def kill_worker(self, index: int) -> None:
        self.pool.kill_worker(index)

    def restart(self, timeout: float | None = None) -> None:
        self._run(self.pool.restart(timeout))

    def stop(self) -> None:
        with self._lock:
            if self._closed:
                return
        self._run(self.pool.stop())
        with self._lock:
            self._closed = True
        # Let the calls already submitted (other threads' next() on a generate, now failed with
        # PoolStoppedError) finish before the loop stops, or their threads would wait forever.
        asyncio.run_coroutine_threadsafe(_settle(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()


async def _settle(timeout: float = 5.0) -> None:
    """Wait for the loop's other tasks, then cancel what is left (their callers get CancelledError)."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    if tasks:
        _, left = await asyncio.wait(tasks, timeout=timeout)
        for t in left:
            t.cancel()
        if left:
            await asyncio.wait(left, timeout=timeout)


class _SyncStream:
    """The sync pool's generate iterator. Unlike a generator, it may be closed from another thread while
    one is blocked in next(): the pending step is cancelled (the request is aborted) and next() ends."""

    def __init__(self, pool: SyncVoxCPMServerPool, agen: AsyncIterator[np.ndarray]) -> None:
        self._pool, self._agen = pool, agen
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[np.ndarray] | None = None
        self._task: asyncio.Task[Any] | None = None  # the loop-side task of the pending next()
        self._closed = False

    def __iter__(self) -> _SyncStream:
        return self

    def __next__(self) -> np.ndarray:
        with self._lock:
            if self._closed:
                raise StopIteration
            if self._pending is not None:
                raise RuntimeError("this generate iterator is already being advanced by another thread")
            try:
                fut = self._pending = self._pool._submit(self._step())
            except BaseException:
                self._closed = True
                raise
        try:
            return fut.result()
        except StopAsyncIteration:
            self._closed = True
            raise StopIteration from None
        except concurrent.futures.CancelledError:
            if self._closed:  # close() from another thread
                raise StopIteration from None
            raise
        except BaseException:
            self._closed = True  # the async generator has ended with this error
            raise
        finally:
            with self._lock:
                self._pending = None

    async def _step(self) -> np.ndarray:
        self._task = asyncio.current_task()
        return await self._agen.__anext__()

    async def _aclose(self) -> None:
        # A next() in flight is cancelled and waited for first (aclose() on a running async generator
        # raises); its cancellation runs generate's cleanup, which aborts the request.
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        await self._agen.aclose()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Abort the request (no-op once it has ended)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(PoolStoppedError):
            fut = self._pool._submit(self._aclose())
            if threading.current_thread() is not self._pool._thread:  # never wait on the loop from itself
                fut.result()

    def __enter__(self) -> _SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            with contextlib.suppress(PoolStoppedError):
                self._pool._submit(self._aclose())


def _device_names(devices: list[int | str] | None) -> list[str]:
    if devices is None:
        n = torch.cuda.device_count()
        return [f"cuda:{i}" for i in range(n)] if n else ["cpu"]
    if not devices:
        raise ValueError("devices must not be empty")
    names = []
    for d in devices:
        name = f"cuda:{d}" if isinstance(d, int) else str(d)
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {d!r} requested but CUDA is not available")
        names.append(name)
    return names


class VoxCPM:
    @staticmethod
    def from_pretrained(model: str, devices: list[int | str] | None = None, max_num_seqs: int = 16,
                        max_model_len: int = 4096, max_num_batched_tokens: int = 8192,
                        gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                        inference_timesteps: int = 10, block_size: int = 16,
                        attention_backend: str | None = None, num_kv_blocks: int | None = None,
                        dtype: str | torch.dtype | None = None, pipeline_decode: bool | None = None
                        ) -> AsyncVoxCPMServerPool | SyncVoxCPMServerPool:
        """Start one worker per device (default: every visible GPU, else the CPU). `model` is a checkpoint
        directory or a hub repo id. Returns at once; `wait_for_ready()` waits for the model to load.
        pipeline_decode: see EngineConfig (default: on for CUDA devices)."""
        from engine.config import parse_dtype

        config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                              gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                              attention_backend=attention_backend, inference_timesteps=inference_timesteps,
                              num_kv_blocks=num_kv_blocks, pipeline_decode=pipeline_decode,
                              dtype=parse_dtype(dtype) if isinstance(dtype, str) else dtype)
        config.validate()
        names = _device_names(devices)
        model = str(resolve_model_path(model))  # download once here, not in every worker
        if not (Path(model) / "config.json").is_file():
            raise CheckpointError(f"{model} has no config.json: not a VoxCPM checkpoint directory")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return SyncVoxCPMServerPool(model, names, config)
        return AsyncVoxCPMServerPool(model, names, config)
