"""FastAPI dependencies for the shared state."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from service.errors import unavailable
from service.state import ServiceState


def get_state(request: Request) -> ServiceState:
    return request.app.state.service


def get_loaded_state(request: Request) -> ServiceState:
    """For routes that need the model: 503 + Retry-After while it loads (or a worker restarts)."""
    state = get_state(request)
    if state.draining:
        raise unavailable("the service is shutting down")
    if not state.loaded:
        raise unavailable(state.failure or "the model is still loading")
    if not state.pool.healthy:
        raise unavailable("a worker died and is being restarted")
    return state


State = Annotated[ServiceState, Depends(get_state)]
LoadedState = Annotated[ServiceState, Depends(get_loaded_state)]


def mark_audio(request: Request) -> None:
    """Tell the metrics middleware this response carries audio (its first byte is the TTFB)."""
    request.state.audio_route = True


def require_api_key(request: Request) -> None:
    """With API keys configured: `Authorization: Bearer <key>` (or `X-API-Key`) must hold one of them, compared in
    constant time against every key (which key matched, or how much of one, does not show in the timing)."""
    keys = get_state(request).api_keys
    if not keys:
        return
    auth = request.headers.get("authorization", "")
    given = (auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")).strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(key, given)
    if not matched:
        raise HTTPException(401, "authorization: a valid API key is required (Authorization: Bearer <key>)",
                            headers={"WWW-Authenticate": "Bearer"})


def require_metrics_key(request: Request) -> None:
    """/metrics: open unless NANOVLLM_PROTECT_METRICS."""
    if get_state(request).settings.protect_metrics:
        require_api_key(request)
