"""FastAPI dependencies for the shared state."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

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
