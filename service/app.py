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
import logging
import tempfile
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import AsyncVoxCPMServerPool, VoxCPM
from engine.io.tokenizer import TextTokenizer
from engine.serving.collector import freeze_startup_heap
from engine.serving.devices import device_names
from engine.serving.pool import checked_model_path
from engine.serving.routing import LoadTable
from service import errors, lifecycle
from service.deps import KeyFirstMiddleware, require_api_key
from service.encoder_pool import EncoderPool
from service.engine_setup import (
    DRAIN_SIGNAL,
    WorkerEndpoint,
    adapter_path,
    engine_arguments,
    model_checkpoint,
    prepare_kernel_cache,
    voice_db_path,
)
from service.limits import BodyLimitMiddleware
from service.lora_registry import LoRARegistrations
from service.metrics import Metrics, MetricsMiddleware
from service.redis_store import RedisVoiceStore, open_voice_store, watch_store
from service.routers import generation, loras, openai, ops, playground, speech_stream, voices
from service.settings import Settings
from service.shared_adapters import SharedAdapters
from service.state import ServiceState
from service.synthesis import CUT_OFFS

log = logging.getLogger(__name__)


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's settings for the app: a WebSocket frame over twice NANOVLLM_WS_MAX_MESSAGE_BYTES is refused as it
    comes (1009), not read whole first (uvicorn's own limit, 16 MiB, let sessions hold that much each before the
    session's refusal); one just over it still gets the session's refusal naming the setting."""
    return {"ws_max_size": 2 * settings.ws_max_message_bytes, "timeout_graceful_shutdown": 10}


def create_app(settings: Settings | None = None, endpoint: WorkerEndpoint | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics(multiprocess_mode=endpoint is not None and endpoint.multiprocess_metrics)
    api_keys = [k.encode() for k in settings.api_key_list()]  # read once (the keys file too)
    admin_keys = [k.encode() for k in settings.admin_key_list()]
    logging.getLogger("uvicorn.error").addFilter(CUT_OFFS)  # a stream cut off on purpose is our warning, not its error

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with tempfile.TemporaryDirectory(prefix="voxcpm-serve-") as scratch:
            if endpoint is None:
                model_path, demo = await asyncio.to_thread(model_checkpoint, settings)
                model_path = await asyncio.to_thread(checked_model_path, model_path)  # a hub id: its local directory
            else:
                model_path = endpoint.model_path
            # Requests are tokenized here, beside the other API processes, not one after another in the engine worker
            # that a burst's requests all wait for; loaded before any worker starts, so that a checkpoint without a
            # usable tokenizer leaves nothing running.
            tokenizer = await asyncio.to_thread(TextTokenizer.from_dir, model_path)
            if endpoint is None:
                lora_path = await asyncio.to_thread(adapter_path, settings)
                voice_db = voice_db_path(settings, model_path, Path(scratch))
                registrations = LoRARegistrations(voice_db.with_name("loras.db"))
                prepare_kernel_cache(settings)  # before the workers start, which read it
                arguments = engine_arguments(settings, demo, lora_path)
                threads = settings.encoder_thread_count(1, len(device_names(arguments["devices"])))
                pool = VoxCPM.from_pretrained(model_path, encoder_threads=threads, queue_bound=settings.queue_bound,
                                              loras=registrations, transform_threads=EncoderPool, tokenizer=tokenizer,
                                              **arguments)
                assert isinstance(pool, AsyncVoxCPMServerPool)
            else:
                demo, voice_db = endpoint.demo, endpoint.voice_db
                load = (LoadTable(len(endpoint.addresses), endpoint.load_table, endpoint.row)
                        if endpoint.load_table else None)
                registrations = LoRARegistrations(voice_db.with_name("loras.db"))
                pool = AsyncVoxCPMServerPool.connect(model_path, endpoint.addresses, endpoint.authkey,
                                                     endpoint.encoder_threads, load, settings.queue_bound,
                                                     registrations, EncoderPool, tokenizer)
            pool.client.encoders.observer = metrics.observe_encoding
            store = open_voice_store(settings, voice_db, model_path)
            state = ServiceState(settings=settings, pool=pool, store=store, metrics=metrics, model_path=model_path,
                                 model_id=Path(model_path).name, demo=demo, owns_workers=endpoint is None,
                                 reports_startup=endpoint is None or endpoint.row == 0,
                                 api_keys=api_keys, admin_keys=admin_keys, lora_registrations=registrations,
                                 shared_adapters=SharedAdapters(store) if isinstance(store, RedisVoiceStore) else None)
            app.state.service = state
            if endpoint is not None and threading.current_thread() is threading.main_thread():
                # the supervisor's first word of a shutdown: stop taking work, finish the rest (an app served from
                # another thread, as in tests, is not one of its API processes)
                asyncio.get_running_loop().add_signal_handler(DRAIN_SIGNAL, lifecycle.drain, state)
                # its imports, app and tokenizer stay for the process's life: out of the garbage collector, whose full
                # pass over them would stall every stream of this process (engine.serving.collector)
                freeze_startup_heap()
            task = asyncio.create_task(lifecycle.bring_up(state), name="voxcpm-bring-up")
            watch = asyncio.create_task(watch_store(store, metrics.voice_store_up), name="voxcpm-voice-store")
            try:
                yield
            finally:
                for t in (task, watch):
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
                await pool.stop()
                state.normalizer.close()
                await store.aclose()
                registrations.close()
                log.info("engine pool %s", "stopped" if endpoint is None else "disconnected")

    app = FastAPI(title="voxcpm-serve", version="0.1.0", lifespan=lifespan,
                  description="VoxCPM text-to-speech: streaming MP3, voice caches, OpenAI-compatible speech.")
    keyed = [Depends(require_api_key)]
    for router in (generation.router, voices.router, loras.router, openai.router):
        app.include_router(router, dependencies=keyed)
    app.include_router(speech_stream.router)  # a WebSocket: checks the key itself (headers or a subprotocol)
    app.include_router(ops.router)  # /health, /ready, /metrics open; /info keyed (per route)
    if settings.playground:
        app.include_router(playground.router)  # open: a static page whose API calls carry the user's key
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_exception_handler)
    for exc in errors.HANDLED:
        app.add_exception_handler(exc, errors.pool_error_handler)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(KeyFirstMiddleware, keys=api_keys)  # a keyed route's 401 before its body is read
    if settings.cors_origins:  # around the body limit: a browser reads its 413 too
        origins = [o.strip() for o in settings.cors_origins.split(",") if o.strip()]
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Audio-Sample-Rate", "X-Audio-Channels", "X-Audio-Encoding",
                                           "X-Request-Id", "X-Finish-Reason", "X-Segment-Timings", "Retry-After"])
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: a refused body is a counted 413
    if endpoint is not None and endpoint.responses_table is not None:  # a shutdown's drain waits for them
        app.add_middleware(lifecycle.OpenResponses, table=LoadTable(1, endpoint.responses_table, endpoint.row))
    return app
