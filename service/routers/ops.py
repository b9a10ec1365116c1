"""Operations: /health (liveness), /ready (readiness), /info, /metrics."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine import PoolError
from engine.serving.client import STATS_TIMEOUT_S
from engine.vocabulary import AdapterInfo
from service.deps import State, require_api_key, require_metrics_key
from service.state import ServiceState
from service.voice_store import VoiceStoreUnavailable

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health(state: State) -> JSONResponse:
    """Liveness: the process serves. 503 only when start-up failed for good (restart the process)."""
    if state.failure:
        return JSONResponse({"status": "failed", "detail": state.failure}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(state: State) -> JSONResponse:
    """Readiness: 200 once every worker has loaded and warmed up the model and this process is connected to it, and
    while each answers a stats call in time (a stuck worker serves nothing: its pod must leave the rotation)."""
    if state.ready:
        with contextlib.suppress(PoolError):  # a worker gone meanwhile: the reasons below say so
            await state.pool.stats()
    if state.ready:
        return JSONResponse({"status": "ready"})
    if state.draining:
        reason = "shutting down"
    elif state.failure:
        reason = state.failure
    elif not state.loaded:
        reason = "loading the model"
    elif not state.pool.healthy:
        reason = "a worker died; restarting it"
    elif state.pool.client.stuck:
        reason = f"worker(s) {state.pool.client.stuck} answered nothing for {STATS_TIMEOUT_S:g} s (stuck?)"
    else:
        reason = "waiting for a restarted worker to warm up"
    return JSONResponse({"status": "not ready", "detail": reason}, status_code=503, headers={"Retry-After": "5"})


async def _adapters(state: ServiceState) -> list[AdapterInfo] | None:
    """The runtime adapters the workers hold (None while no worker answers)."""
    try:
        return await state.runtime_adapters()
    except PoolError:
        return None


async def _usage(state: ServiceState) -> dict:
    """The store's counts, or none while it is unreachable (/info and /metrics still answer)."""
    try:
        return await state.store.usage()
    except VoiceStoreUnavailable:
        return {}


def _location(state: ServiceState) -> str:
    """Where the voices are: the Redis URL without credentials, or the SQLite store's kind."""
    return getattr(state.store, "where", state.settings.voice_store)


@router.get("/info", dependencies=[Depends(require_api_key)])
async def info(state: State) -> dict:
    """Model metadata (sample rates, latent shape, limits), MP3 settings, voice cache usage."""
    s = state.settings
    facts = state.info.as_dict() if state.info is not None else {}
    model = {**facts, "devices": state.pool.worker_devices, "model_path": state.model_path, "model_id": state.model_id,
             "random_weights": state.demo}
    return {
        "model": model,
        "lora": {"enabled": bool(s.lora_uri), "uri": s.lora_uri, "id": s.lora_id,
                 "sha256": s.lora_sha256, "merged": s.lora_merge,
                 "merged_layers": state.info.lora_merged_layers if state.info else 0,
                 "runtime": {"max_loras": s.max_loras, "max_lora_rank": s.max_lora_rank,
                             "merged_steps": state.info.lora_merged_steps if state.info else False,
                             "adapters": await _adapters(state)}},
        "mp3": {"bitrate_kbps": s.mp3_bitrate_kbps, "quality": s.mp3_quality},
        "queue_coalesce_ms": s.queue_coalesce_ms,
        "api_processes": s.api_process_count(),
        "voice_cache": {**await _usage(state), "max_entries": s.voice_cache_max_entries,
                        "max_bytes": s.voice_cache_max_bytes, "backend": "redis" if s.redis_url else s.voice_store,
                        "up": state.store.up, "location": _location(state)},
        "ready": state.ready,
    }


@router.get("/metrics", dependencies=[Depends(require_metrics_key)])
async def metrics(state: State) -> Response:
    """Prometheus text format. Engine gauges are read from the workers at scrape time."""
    m = state.metrics
    if state.loaded:
        try:
            m.observe_pool(await state.pool.stats(), state.pool.snapshot())
        except PoolError:  # a worker died during the scrape: the rest of the metrics still matter
            m.workers_up.set(0)
    usage = await _usage(state)
    if usage:
        m.observe_cache(usage)
    m.voice_store_up.set(1 if state.store.up else 0)
    m.ready.set(1 if state.ready else 0)
    return Response(m.exposition(), media_type=CONTENT_TYPE_LATEST)
