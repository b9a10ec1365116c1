"""The server pool (the library API): one worker process per device and this process's client of them.

`VoxCPM.from_pretrained(...)` returns an `AsyncVoxCPMServerPool` when called inside a running event loop and a
`SyncVoxCPMServerPool` (the same pool driven from a private loop thread) otherwise. Requests go to the
least-loaded worker; a worker that dies fails its callers at once (`WorkerDiedError`), the pool reports itself
unhealthy and `restart()` brings it back with the prompts registered here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import inspect
import logging
import subprocess
import threading
from collections.abc import Coroutine, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from engine.engine_config import ENGINE_FIELDS, EngineConfig
from engine.errors import PoolError, PoolStoppedError, PromptNotFoundError, RequestError, WorkerDiedError
from engine.options import cuda_visible_devices
from engine.serving import protocol as p
from engine.serving.client import EngineClient, GenerationStream, Transform
from engine.serving.processes import WorkerProcess, WorkerSet
from engine.serving.reports import WorkerInfo, WorkerStats
from engine.serving.routing import LoadTable
from engine.serving.transforms import TransformThreads
from engine.vocabulary import AdapterInfo, FinishReason, SamplingParams

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncVoxCPMServerPool:
    """Spawns its workers (`workers`), or with `connect()` uses workers another process owns (the service's API
    processes: the supervisor starts and restarts the workers)."""

    def __init__(self, model: str, devices: list[str], config: EngineConfig, *, warmup: bool = False,
                 encoder_threads: int = 4, queue_bound: int | None = None,
                 loras: MutableMapping[str, str] | None = None,
                 transform_threads: type[TransformThreads] | None = None) -> None:
        self.model_path = checked_model_path(model)
        self.devices = devices
        self._stopped = False
        self.workers: WorkerSet | None = WorkerSet(self.model_path, devices, config, warmup=warmup)
        self.client = EngineClient(self.workers.addresses, self.workers.authkey, encoder_threads,
                                   queue_bound=queue_bound, loras=loras, transform_threads=transform_threads)

    @classmethod
    def connect(cls, model_path: str, addresses: list[str], authkey: bytes, encoder_threads: int = 4,
                load: LoadTable | None = None, queue_bound: int | None = None,
                loras: MutableMapping[str, str] | None = None,
                transform_threads: type[TransformThreads] | None = None) -> AsyncVoxCPMServerPool:
        """A pool of workers started elsewhere (reached at `addresses`, authenticated with `authkey`); `load`: the
        in-flight table shared with the other processes that route to them; `loras`: the runtime adapters every
        (re)connected worker is given (`EngineClient`), which `register_lora` and `unregister_lora` keep;
        `transform_threads`: the class of the threads that run the streams' transforms (default first come first)."""
        pool = cls.__new__(cls)
        pool.model_path, pool.devices, pool._stopped, pool.workers = model_path, [], False, None
        pool.client = EngineClient(addresses, authkey, encoder_threads, load, queue_bound, loras, transform_threads)
        return pool

    @property
    def processes(self) -> list[WorkerProcess]:
        return self.workers.processes if self.workers is not None else []

    # --- state --------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """Every worker is running (ready or still loading) and the pool is not stopped."""
        return not self._stopped and all(w.alive for w in self.processes) and self.client.healthy

    @property
    def ready(self) -> bool:
        return self.healthy and self.client.ready

    def snapshot(self) -> list[dict[str, int]]:
        """Per worker, without a round trip: in-flight requests (as routed here) and the load the worker last
        reported with its events (running, waiting, free_blocks, total_blocks)."""
        alive = [w.alive for w in self.processes] or [True] * len(self.client.links)
        return [{**s, "alive": int(s["alive"] and up)} for s, up in zip(self.client.snapshot(), alive, strict=True)]

    async def wait_for_ready(self, timeout: float | None = None) -> None:
        """Until every worker has loaded the model (raises the first start-up failure)."""
        async def ready() -> None:
            while not self.client.ready:
                for w in self.processes:
                    if w.failed_to_start is not None:
                        raise w.failed_to_start
                if self._stopped:
                    raise PoolStoppedError("the pool is stopped")
                with contextlib.suppress(asyncio.TimeoutError):
                    await self.client.wait_for_ready(0.2)

        await asyncio.wait_for(ready(), timeout)

    def _check(self) -> None:
        if self._stopped:
            raise PoolStoppedError("the pool is stopped")
        if not self.client.ready:
            failed = [w.failed_to_start for w in self.processes if w.failed_to_start is not None]
            if failed and len(failed) == len(self.processes):
                raise failed[0]

    # --- API ----------------------------------------------------------------------------------
    async def model_info(self) -> WorkerInfo:
        """The model facts and start-up of the first ready worker (waits for the pool to be ready)."""
        self._check()
        if not self.client.ready:
            await self.wait_for_ready()
        info = self.client.info
        if info is None:  # a worker went down between ready and here
            raise WorkerDiedError("no worker is ready")
        return info

    @property
    def worker_devices(self) -> list[str]:
        """The workers' devices (those of workers started elsewhere as they reported them)."""
        return list(self.devices) or [link.info.device if link.info else "?" for link in self.client.links]

    async def get_model_info(self) -> dict[str, Any]:
        """`model_info()` as one flat mapping with the workers' devices (nano-vllm-voxcpm's shape)."""
        return {**(await self.model_info()).as_dict(), "devices": self.worker_devices}

    async def stats(self) -> list[WorkerStats | None]:
        """Per worker: running/waiting sequences, free KV blocks, preemptions... (None for a dead one)."""
        return await self.client.stats()

    async def encode_latents(self, wav: bytes, wav_format: str = "wav", padding: str = "left") -> bytes:
        """An audio file's bytes -> float32 latents bytes shaped (frames, feat_dim), frames a multiple of the
        patch size. padding="left" suits a continuation prompt, "right" a reference clip."""
        if padding not in ("left", "right"):
            raise RequestError("padding: must be 'left' or 'right'")
        if not isinstance(wav, bytes | bytearray) or not wav:
            raise RequestError("wav: must be non-empty bytes")
        self._check()
        latents = await self.client.encode_latents(bytes(wav), wav_format, padding)
        return latents.tobytes()

    async def add_prompt(self, wav: bytes | None = None, wav_format: str = "wav", prompt_text: str = "", *,
                         latents: bytes | np.ndarray | None = None) -> str:
        """Register a voice prompt (audio or latents + its transcript) on every worker; returns its id,
        derived from the content, so the same prompt registered twice has one id."""
        if not prompt_text.strip():
            raise RequestError("prompt_text: must not be empty")
        if (wav is None) == (latents is None):
            raise RequestError("wav: give exactly one of wav or latents")
        if wav is not None:
            raw = await self.encode_latents(wav, wav_format)
        else:
            # Checked here: the prompt is replayed to every (restarted) worker, it must be usable there.
            feat_dim = (await self.model_info()).feat_dim
            if isinstance(latents, np.ndarray):
                if latents.ndim != 2 or latents.shape[1] != feat_dim or not latents.shape[0]:
                    raise RequestError(f"latents: must be shaped (frames, {feat_dim}), got {latents.shape}")
                raw = np.ascontiguousarray(latents, dtype=np.float32).tobytes()
            elif isinstance(latents, bytes | bytearray | memoryview):
                raw = bytes(latents)
                if not raw or len(raw) % (4 * feat_dim):
                    raise RequestError(f"latents: float32 bytes must be a positive multiple of 4 * feat_dim = "
                                       f"{4 * feat_dim} bytes, got {len(raw)}")
            else:
                raise RequestError(f"latents: must be float32 bytes or a numpy array, got {type(latents).__name__}")
        prompt_id = hashlib.blake2b(raw + prompt_text.encode(), digest_size=12).hexdigest()
        feat_dim = (await self.model_info()).feat_dim
        self.client.add_prompt(prompt_id, np.frombuffer(raw, np.float32).reshape(-1, feat_dim), prompt_text)
        return prompt_id

    async def remove_prompt(self, prompt_id: str) -> None:
        if not self.client.remove_prompt(prompt_id):
            raise PromptNotFoundError(f"prompt_id {prompt_id!r} is not registered")

    def list_prompts(self) -> list[str]:
        return list(self.client.prompts)

    async def register_lora(self, name: str, path: str) -> AdapterInfo:
        """Register a LoRA adapter (official format: its directory or weights file, a path on this machine) on every
        worker, for requests that name it (`lora_name`); restarted workers get it again. Needs max_loras > 0."""
        self._check()
        if not self.client.ready:
            await self.wait_for_ready()
        return await self.client.register_lora(name, str(path))

    async def unregister_lora(self, name: str) -> None:
        """Unregister adapter `name`; the requests using it finish with it."""
        self._check()
        await self.client.unregister_lora(name)

    async def list_loras(self) -> list[AdapterInfo]:
        """The registered adapters: name, source, rank, layers, whether resident (and in which slot), requests."""
        self._check()
        return await self.client.list_loras()

    def generate(self, target_text: str, prompt_latents: bytes | np.ndarray | torch.Tensor | None = None,
                 prompt_text: str = "", prompt_id: str | None = None,
                 ref_audio_latents: bytes | np.ndarray | torch.Tensor | None = None,
                 max_generate_length: int = 2000, temperature: float = 1.0, cfg_value: float = 2.0,
                 min_len: int = 2, seed: int | None = None, transform: Transform | None = None,
                 lora_name: str | None = None) -> GenerationStream:
        """Stream float32 audio chunks (one per patch) at `get_model_info()["sample_rate"]` (or, with `transform`,
        what it makes of each (chunk, is_last), run on an encoder thread). Leaving the loop early (break,
        cancellation, aclose) aborts the request and frees its KV blocks; `finish_reason` says why it ended."""
        params = SamplingParams(max_generate_length=max_generate_length, temperature=temperature,
                                  cfg_value=cfg_value, min_len=min_len, seed=seed)
        return self.submit(p.SynthesisRequest(target_text, prompt_text or "", _plain(prompt_latents), prompt_id,
                                              _plain(ref_audio_latents), params, lora_name), transform)

    def submit(self, request: p.SynthesisRequest, transform: Transform | None = None) -> GenerationStream:
        """`generate` for a request built already."""
        self._check()
        return self.client.generate(request, transform)

    async def restart(self, timeout: float | None = None) -> None:
        """Replace dead workers (the prompts registered here are sent to them again) and wait until ready."""
        if self._stopped:
            raise PoolStoppedError("the pool is stopped")
        if self.workers is None:
            raise PoolError("this pool's workers belong to another process, which restarts them")
        lost = [link.index for link in self.client.links if link.down]
        await asyncio.to_thread(self.workers.restart_dead, lost)
        await self.wait_for_ready(timeout)

    def kill_worker(self, index: int) -> None:
        """Terminate one worker process abruptly (tests and chaos drills)."""
        self.processes[index].kill()

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop every worker (gracefully, then by force; only this pool's own); in-flight requests get
        PoolStoppedError."""
        if self._stopped:
            return
        self._stopped = True
        if self.workers is not None:
            await asyncio.to_thread(self.workers.stop, timeout)
        await self.client.close()


def _plain(value: Any) -> Any:
    """Latents travel to the worker as numpy (a torch tensor may live on a device)."""
    return value.detach().float().cpu().numpy() if type(value).__module__.startswith("torch") else value


class SyncVoxCPMServerPool:
    """The async pool behind blocking calls, driven from a private event loop thread."""

    def __init__(self, model: str, devices: list[str], config: EngineConfig, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="voxcpm-pool-loop", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._closed = False  # the loop is stopping or gone: nothing more may be submitted to it

        async def make() -> AsyncVoxCPMServerPool:
            return AsyncVoxCPMServerPool(model, devices, config, **kwargs)

        self.pool = self._run(make())

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._closed:  # a coroutine handed to a stopped loop would never finish: its caller would hang
                coro.close()
                raise PoolStoppedError("the pool is stopped")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self._submit(coro).result(timeout)

    def __getattr__(self, name: str) -> Any:
        """The async pool's attribute `name`; its coroutine methods become blocking ones run on the pool's loop (a
        property, or a plain method like `snapshot`, is read or called from the caller's thread)."""
        if name.startswith("_") or name == "pool":
            raise AttributeError(name)
        attr = getattr(self.pool, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        @functools.wraps(attr)
        def blocking(*args: Any, **kwargs: Any) -> Any:
            return self._run(attr(*args, **kwargs))

        return blocking

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | {n for n in dir(self.pool) if not n.startswith("_")})

    def generate(self, target_text: str, **kwargs: Any) -> SyncStream:
        """Blocking iterator of float32 chunks; closing it (break + close(), also from another thread
        while one waits in next()) aborts the request."""
        async def make() -> GenerationStream:
            return self.pool.generate(target_text, **kwargs)

        return SyncStream(self, self._run(make()))

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


class SyncStream:
    """The sync pool's generate iterator. Unlike a generator, it may be closed from another thread while
    one is blocked in next(): the pending step is cancelled (the request is aborted) and next() ends."""

    def __init__(self, pool: SyncVoxCPMServerPool, stream: GenerationStream) -> None:
        self._pool, self._stream = pool, stream
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[np.ndarray] | None = None
        self._task: asyncio.Task[Any] | None = None  # the loop-side task of the pending next()
        self._closed = False

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._stream.finish_reason

    def __iter__(self) -> SyncStream:
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
            self._closed = True  # the stream has ended with this error
            raise
        finally:
            with self._lock:
                self._pending = None

    async def _step(self) -> np.ndarray:
        self._task = asyncio.current_task()
        return await self._stream.__anext__()

    async def _aclose(self) -> None:
        # A next() in flight is cancelled and waited for first; then the stream is closed (the request aborted).
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        self._stream.close()

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

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            self._stream.close()


def device_names(devices: list[int | str] | None) -> list[str]:
    """The worker devices: those given (GPU indices or device names), or every visible GPU, else the CPU."""
    if devices is None:
        n = visible_gpu_count()
        return [f"cuda:{i}" for i in range(n)] if n else ["cpu"]
    if not devices:
        raise ValueError("devices must not be empty")
    names = [f"cuda:{d}" if isinstance(d, int) else str(d) for d in devices]
    if any(name.startswith("cuda") for name in names) and not visible_gpu_count():
        raise ValueError(f"devices {devices!r} requested but CUDA is not available")
    return names


def visible_gpu_count() -> int:
    """GPUs this process may use, counted without importing torch where nvidia-smi answers (the service starts its
    workers before it would have imported torch); CUDA_VISIBLE_DEVICES narrows them as it does for CUDA."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is None or out.returncode:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    visible = cuda_visible_devices()
    if visible is not None:
        n = min(n, len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")]))
    return n


# The pool's own keywords of `VoxCPM.from_pretrained`, beside EngineConfig's fields.
POOL_KEYWORDS = frozenset({"warmup", "encoder_threads", "queue_bound", "loras", "transform_threads"})


class VoxCPM:
    @staticmethod
    def from_pretrained(model: str, devices: list[int | str] | None = None,
                        **options: Any) -> AsyncVoxCPMServerPool | SyncVoxCPMServerPool:
        """Start one worker per device (default: every visible GPU, else the CPU). `model` is a checkpoint
        directory or a hub repo id. Returns at once; `wait_for_ready()` waits for the model to load.

        Keywords: every field of `engine.EngineConfig` (max_num_seqs, max_model_len, inference_timesteps,
        coalesce_ms, lora_path, max_loras, ...: defaults, bounds and docs there), and the pool's own: warmup (a few
        generations in each worker before it reports ready; default False), encoder_threads (threads that run the
        generate calls' transforms; default 4), queue_bound (requests a worker may hold beyond max_num_seqs before
        generate raises OverloadedError; default None, no bound), loras (where the registered runtime adapters are
        kept, name -> path, each (re)started worker given them all; default a dict of this pool's),
        transform_threads (the class running the transforms; default first come first served). An unknown keyword
        is a TypeError, a bad value a ValueError naming it."""
        unknown = set(options) - ENGINE_FIELDS - POOL_KEYWORDS
        if unknown:
            raise TypeError(f"from_pretrained() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        config = engine_config(**{k: v for k, v in options.items() if k in ENGINE_FIELDS})
        kwargs = {k: v for k, v in options.items() if k in POOL_KEYWORDS}
        names = device_names(devices)
        model = checked_model_path(model)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return SyncVoxCPMServerPool(model, names, config, **kwargs)
        return AsyncVoxCPMServerPool(model, names, config, **kwargs)


def engine_config(**fields: Any) -> EngineConfig:
    """An EngineConfig, validated (a bad value is a ValueError naming it); a dtype name stays a name (no torch)."""
    config = EngineConfig(**fields)
    config.validate()
    return config


def checked_model_path(model: str) -> str:
    """A checkpoint directory (a hub id downloaded once here, not in every worker) that has a config.json."""
    from engine.errors import CheckpointError
    from engine.io.model_path import resolve_model_path

    path = str(resolve_model_path(model))
    if not (Path(path) / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: not a VoxCPM checkpoint directory")
    return path
