"""AsyncVoxCPMServerPool (the library API): one worker process per device and this process's client of them.

Requests go to the least-loaded worker; a worker that dies fails its callers at once (`WorkerDiedError`), the pool
reports itself unhealthy and `restart()` brings it back with the prompts registered here. `VoxCPM.from_pretrained`
(`engine.serving.voxcpm`) makes one, or its blocking twin (`engine.serving.sync_pool`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.engine_config import EngineConfig
from engine.errors import PoolError, PoolStoppedError, PromptNotFoundError, RequestError, WorkerDiedError
from engine.io.tokenizer import TextTokenizer
from engine.serving import protocol as p
from engine.serving.client import EngineClient
from engine.serving.processes import WorkerProcess, WorkerSet
from engine.serving.reports import WorkerInfo, WorkerStats
from engine.serving.routing import LoadTable
from engine.serving.stream import GenerationStream, Transform
from engine.serving.transforms import TransformThreads
from engine.vocabulary import AdapterInfo, SamplingParams

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class AsyncVoxCPMServerPool:
    """Spawns its workers (`workers`), or with `connect()` uses workers another process owns (the service's API
    processes: the supervisor starts and restarts the workers)."""

    def __init__(self, model: str, devices: list[str], config: EngineConfig, *, warmup: bool = False,
                 encoder_threads: int = 4, queue_bound: int | None = None,
                 loras: MutableMapping[str, str] | None = None,
                 transform_threads: type[TransformThreads] | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:
        self.model_path = checked_model_path(model)
        self.devices = devices
        self._stopped = False
        self.workers: WorkerSet | None = WorkerSet(self.model_path, devices, config, warmup=warmup)
        try:  # loaded while the workers start; a checkpoint without a usable tokenizer (any failure) leaves nothing
            tokenizer = tokenizer or TextTokenizer.from_dir(self.model_path)
            self.client = EngineClient(self.workers.addresses, self.workers.authkey, encoder_threads,
                                       queue_bound=queue_bound, loras=loras, transform_threads=transform_threads)
        except BaseException:
            self.workers.stop()
            raise
        self.client.tokenizer = tokenizer

    @classmethod
    def connect(cls, model_path: str, addresses: list[str], authkey: bytes, encoder_threads: int = 4,
                load: LoadTable | None = None, queue_bound: int | None = None,
                loras: MutableMapping[str, str] | None = None,
                transform_threads: type[TransformThreads] | None = None,
                tokenizer: TextTokenizer | None = None) -> AsyncVoxCPMServerPool:
        """A pool of workers started elsewhere (reached at `addresses`, authenticated with `authkey`); `load`: the
        in-flight table shared with the other processes that route to them; `loras`: the runtime adapters every
        (re)connected worker is given (`EngineClient`), which `register_lora` and `unregister_lora` keep;
        `transform_threads`: the class of the threads that run the streams' transforms (default first come first);
        `tokenizer`: the checkpoint's, already loaded (default: loaded here)."""
        pool = cls.__new__(cls)
        pool.model_path, pool.devices, pool._stopped, pool.workers = model_path, [], False, None
        pool.client = EngineClient(addresses, authkey, encoder_threads, load, queue_bound, loras, transform_threads)
        pool.client.tokenizer = tokenizer or TextTokenizer.from_dir(model_path)
        return pool

    async def __aenter__(self) -> AsyncVoxCPMServerPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

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
        """Healthy, every worker loaded, and none stuck (waiting on a stuck one would never end: `wait_for_ready`
        waits for the load alone)."""
        return self.healthy and self.client.ready and not self.client.stuck

    def snapshot(self) -> list[dict[str, int]]:
        """Per worker, without a round trip: in-flight requests (as routed here) and the load the worker last
        reported with its events (running, waiting, free_blocks, total_blocks)."""
        alive = [w.alive for w in self.processes] or [True] * len(self.client.links)
        return [{**s, "alive": int(s["alive"] and up)} for s, up in zip(self.client.snapshot(), alive, strict=True)]

    async def wait_for_ready(self, timeout: float | None = None) -> None:
        """Until every worker has loaded the model (raises the first start-up failure; WorkerDiedError for a worker of
        this pool that exited: nothing restarts it but `restart()`, so waiting would never end)."""
        async def ready() -> None:
            while not self.client.ready:
                for w in self.processes:
                    if w.failed_to_start is not None:
                        raise w.failed_to_start
                    if not w.alive:
                        raise WorkerDiedError(f"worker {w.index} ({w.device}) exited; pool.restart() starts it again")
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
        if not isinstance(prompt_text, str) or not prompt_text.strip():
            raise RequestError("prompt_text: must be a non-empty string (the transcript)")
        if (wav is None) == (latents is None):
            raise RequestError("wav: give exactly one of wav or latents")
        info = await self.model_info()
        feat_dim = info.feat_dim
        if wav is not None:
            raw = await self.encode_latents(wav, wav_format)
        else:
            # Checked here: the prompt is replayed to every (restarted) worker, it must be usable there.
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
        frames = np.frombuffer(raw, np.float32).reshape(-1, feat_dim)
        if len(frames) % info.patch_size:  # as a generation would refuse them (they were registered, then unusable)
            raise RequestError(f"latents: {len(frames)} frames; must be a multiple of patch_size={info.patch_size}")
        if not np.isfinite(frames).all():
            raise RequestError("latents: contains NaN or infinity")
        prompt_id = hashlib.blake2b(raw + prompt_text.encode(), digest_size=12).hexdigest()
        self.client.add_prompt(prompt_id, frames, prompt_text)
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
        if not isinstance(name, str):
            raise RequestError(f"lora_name: must be a string, got {type(name).__name__}")
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
        what it makes of each (chunk, is_last), run on an encoder thread). Closing the stream (aclose, the end of its
        `async with` block, cancellation) aborts the request and frees its KV blocks (a `break` alone does not);
        `finish_reason` says why it ended."""
        params = SamplingParams(max_generate_length=max_generate_length, temperature=temperature,
                                  cfg_value=cfg_value, min_len=min_len, seed=seed)
        return self.submit(p.SynthesisRequest(target_text, prompt_text or "", _plain(prompt_latents), prompt_id,
                                              _plain(ref_audio_latents), params, lora_name), transform)

    def submit(self, request: p.SynthesisRequest, transform: Transform | None = None) -> GenerationStream:
        """`generate` for a request built already (`request.continuation`: the later part of one admitted)."""
        self._check()
        for name, value, kind in (("target_text", request.target_text, str), ("prompt_text", request.prompt_text, str),
                                  ("lora_name", request.lora_name, str | None), ("prompt_id", request.prompt_id,
                                                                                 str | None)):
            if not isinstance(value, kind):  # the worker failed it as an engine error, naming nothing
                raise RequestError(f"{name}: must be a string, got {type(value).__name__}")
        if transform is not None and not callable(transform):
            raise RequestError(f"transform: must be callable (chunk, is_last) -> item, got {type(transform).__name__}")
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


def checked_model_path(model: str) -> str:
    """A checkpoint directory (a hub id downloaded once here, not in every worker) that has a config.json."""
    from engine.errors import CheckpointError
    from engine.io.model_path import resolve_model_path

    path = str(resolve_model_path(model))
    if not (Path(path) / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: not a VoxCPM checkpoint directory")
    return path
