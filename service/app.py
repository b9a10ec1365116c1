"""create_app(settings): the FastAPI application. Its lifespan owns the engine pool: it starts the
workers, brings them up in the background (/health answers meanwhile, /ready says when to send
traffic) and stops them on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from engine import VoxCPM
from service import errors, lifecycle
from service.coalesce import Coalescer
from service.demo import demo_checkpoint
from service.metrics import Metrics, MetricsMiddleware
from service.routers import generation, openai, ops, voices
from service.settings import Settings
from service.state import ServiceState
from service.voice_store import DiskVoiceStore, MemoryVoiceStore, VoiceStore

log = logging.getLogger(__name__)


def model_fingerprint(model_path: str) -> str:
    """Cached latents belong to one model: the store lives under a directory named after it."""
    config = Path(model_path, "config.json").read_bytes()
    return hashlib.blake2b(str(Path(model_path).resolve()).encode() + config, digest_size=8).hexdigest()


def make_store(settings: Settings, model_path: str) -> VoiceStore:
    if settings.voice_store == "memory":
        return MemoryVoiceStore(settings.voice_cache_max_entries, settings.voice_cache_max_bytes)
    directory = settings.cache_path / "voices" / model_fingerprint(model_path)
    return DiskVoiceStore(directory, settings.voice_cache_max_entries, settings.voice_cache_max_bytes)


def start_pool(settings: Settings, model_path: str, demo: bool):
    # Compiled Triton kernels persist in the cache dir: a restart on the same volume skips recompiling them. So does
    # the CUDA driver's JIT cache (a few PTX-only library kernels compiled at the first KV sizing: H100, KV sizing
    # 3.3-3.7 s on an empty one, 2.1 s on a filled one). Set before the workers are spawned (they inherit it).
    os.environ.setdefault("TRITON_CACHE_DIR", str(settings.cache_path / "kernels" / "triton"))
    os.environ.setdefault("CUDA_CACHE_PATH", str(settings.cache_path / "kernels" / "cuda"))
    devices = settings.device_list()
    if demo and devices is None:
        devices = ["cpu"]  # the demo checkpoint is tiny: no GPU needed
    return VoxCPM.from_pretrained(
        model=model_path, devices=devices, max_num_seqs=settings.serverpool_max_num_seqs,
        max_model_len=settings.serverpool_max_model_len,
        max_num_batched_tokens=settings.serverpool_max_num_batched_tokens,
        gpu_memory_utilization=settings.serverpool_gpu_memory_utilization,
        enforce_eager=settings.serverpool_enforce_eager,
        inference_timesteps=settings.serverpool_inference_timesteps)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        demo = settings.model_path is None
        model_path = str(await asyncio.to_thread(demo_checkpoint, settings.cache_path)) if demo else \
            settings.model_path
        pool = start_pool(settings, model_path, demo)
        model_path = pool.model_path  # a hub id resolved to its local directory
        state = ServiceState(settings=settings, pool=pool, store=make_store(settings, model_path),
                             coalescer=Coalescer(settings.queue_coalesce_ms), metrics=metrics,
                             model_path=model_path, model_id=Path(model_path).name, demo=demo)
        app.state.service = state
        task = asyncio.create_task(lifecycle.bring_up(state), name="voxcpm-bring-up")
        try:
            yield
        finally:
            state.warm = False
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await pool.stop()
            log.info("engine pool stopped")

    app = FastAPI(title="voxcpm-serve", version="0.1.0", lifespan=lifespan,
                  description="VoxCPM text-to-speech: streaming MP3, voice caches, OpenAI-compatible speech.")
    for router in (generation.router, voices.router, openai.router, ops.router):
        app.include_router(router)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    for exc in errors.HANDLED:
        app.add_exception_handler(exc, errors.pool_error_handler)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
