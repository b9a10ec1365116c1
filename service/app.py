"""create_app(settings, endpoint): the FastAPI application.

Two ways to run it:
- `endpoint` given (what `voxcpm-serve` does): one of several API processes started by the supervisor
  (`service/supervisor.py`); its pool connects to the engine workers the supervisor runs, and its voice store is
  the database every API process shares.
- no endpoint (tests, embedding the service in another program): the app's lifespan starts its own worker
  processes and restarts one that dies.
Either way /health answers while the model loads and /ready says when to send traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from engine import AsyncVoxCPMServerPool, VoxCPM
from service import errors, lifecycle
from service.metrics import Metrics, MetricsMiddleware
from service.routers import generation, openai, ops, voices
from service.settings import Settings
from service.state import ServiceState
from service.voice_store import SqliteVoiceStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerEndpoint:
    """What an API process of the supervisor's is given: the workers to connect to, and what it shares with the
    other API processes."""

    addresses: list[str]
    authkey: bytes
    model_path: str
    demo: bool
    voice_db: Path
    multiprocess_metrics: bool


def model_fingerprint(model_path: str) -> str:
    """Cached latents belong to one model: the store lives under a directory named after it."""
    config = Path(model_path, "config.json").read_bytes()
    return hashlib.blake2b(str(Path(model_path).resolve()).encode() + config, digest_size=8).hexdigest()


def voice_db_path(settings: Settings, model_path: str, scratch: Path) -> Path:
    """The voice database: under the cache dir (kept across restarts), or in `scratch` (gone at shutdown)."""
    if settings.voice_store == "memory":
        return scratch / "voices.db"
    return settings.cache_path / "voices" / model_fingerprint(model_path) / "voices.db"


def model_checkpoint(settings: Settings) -> tuple[str, bool]:
    """The checkpoint to serve and whether it is the embedded random-weight demo (made on first use)."""
    if settings.model_path is not None:
        return settings.model_path, False
    from service.demo import demo_checkpoint

    return str(demo_checkpoint(settings.cache_path)), True


def engine_arguments(settings: Settings, demo: bool) -> dict:
    """`VoxCPM.from_pretrained` keywords from the settings (the supervisor builds its workers from the same)."""
    # Compiled Triton kernels persist in the cache dir: a restart on the same volume skips recompiling them. So does
    # the CUDA driver's JIT cache (a few PTX-only library kernels compiled at the first KV sizing: H100, KV sizing
    # 3.3-3.7 s on an empty one, 2.1 s on a filled one). Set before the workers are spawned (they inherit it).
    os.environ.setdefault("TRITON_CACHE_DIR", str(settings.cache_path / "kernels" / "triton"))
    os.environ.setdefault("CUDA_CACHE_PATH", str(settings.cache_path / "kernels" / "cuda"))
    devices = settings.device_list()
    if demo and devices is None:
        devices = ["cpu"]  # the demo checkpoint is tiny: no GPU needed
    return dict(devices=devices, max_num_seqs=settings.serverpool_max_num_seqs,
                max_model_len=settings.serverpool_max_model_len,
                max_num_batched_tokens=settings.serverpool_max_num_batched_tokens,
                gpu_memory_utilization=settings.serverpool_gpu_memory_utilization,
                enforce_eager=settings.serverpool_enforce_eager,
                inference_timesteps=settings.serverpool_inference_timesteps,
                coalesce_ms=settings.queue_coalesce_ms, warmup=settings.warmup)


def create_app(settings: Settings | None = None, endpoint: WorkerEndpoint | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics(multiprocess_mode=endpoint is not None and endpoint.multiprocess_metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with tempfile.TemporaryDirectory(prefix="voxcpm-serve-") as scratch:
            if endpoint is None:
                model_path, demo = await asyncio.to_thread(model_checkpoint, settings)
                pool = VoxCPM.from_pretrained(model_path, encoder_threads=settings.encoder_threads,
                                              **engine_arguments(settings, demo))
                assert isinstance(pool, AsyncVoxCPMServerPool)
                model_path = pool.model_path  # a hub id resolved to its local directory
                voice_db = voice_db_path(settings, model_path, Path(scratch))
            else:
                model_path, demo, voice_db = endpoint.model_path, endpoint.demo, endpoint.voice_db
                pool = AsyncVoxCPMServerPool.connect(model_path, endpoint.addresses, endpoint.authkey,
                                                     settings.encoder_threads)
            store = SqliteVoiceStore(voice_db, settings.voice_cache_max_entries, settings.voice_cache_max_bytes)
            state = ServiceState(settings=settings, pool=pool, store=store, metrics=metrics, model_path=model_path,
                                 model_id=Path(model_path).name, demo=demo, owns_workers=endpoint is None)
            app.state.service = state
            task = asyncio.create_task(lifecycle.bring_up(state), name="voxcpm-bring-up")
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await pool.stop()
                store.close()
                log.info("engine pool %s", "stopped" if endpoint is None else "disconnected")

    app = FastAPI(title="voxcpm-serve", version="0.1.0", lifespan=lifespan,
                  description="VoxCPM text-to-speech: streaming MP3, voice caches, OpenAI-compatible speech.")
    for router in (generation.router, voices.router, openai.router, ops.router):
        app.include_router(router)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    for exc in errors.HANDLED:
        app.add_exception_handler(exc, errors.pool_error_handler)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
