"""FastAPI dependencies for the shared state and the API key (with the middleware that checks the key first)."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from service.errors import error_payload, unavailable
from service.state import ServiceState


def get_state(request: Request) -> ServiceState:
    return request.app.state.service


def unavailable_reason(state: ServiceState) -> str | None:
    """Why the service cannot generate now (None: it can)."""
    if state.draining:
        return "the service is shutting down"
    if not state.loaded:
        return state.failure or "the model is still loading"
    if not state.pool.healthy:
        return "a worker died and is being restarted"
    return None


def get_loaded_state(request: Request) -> ServiceState:
    """For routes that need the model: 503 + Retry-After while it loads (or a worker restarts)."""
    state = get_state(request)
    reason = unavailable_reason(state)
    if reason is not None:
        raise unavailable(reason)
    return state


State = Annotated[ServiceState, Depends(get_state)]
LoadedState = Annotated[ServiceState, Depends(get_loaded_state)]


def mark_audio(request: Request) -> None:
    """Tell the metrics middleware this response streams audio (its first byte is the TTFB; a response sent whole has
    none: its latency is the request's duration)."""
    request.state.audio_route = True


def key_matches(keys: list[bytes], given: str) -> bool:
    """Whether `given` is one of `keys`, compared in constant time against every key (which key matched, or how much
    of one, does not show in the timing)."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(key, given.strip().encode())
    return matched


MISSING_KEY = "authorization: a valid API key is required (Authorization: Bearer <key>)"


def key_of(headers: Mapping[str, str]) -> str:
    """The key a request carries: `Authorization: Bearer <key>`, else `X-API-Key`."""
    auth = headers.get("authorization", "")
    return auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")


def require_api_key(request: Request) -> None:
    """With API keys configured: `Authorization: Bearer <key>` (or `X-API-Key`) must hold one of them."""
    keys = get_state(request).api_keys
    if keys and not key_matches(keys, key_of(request.headers)):
        raise HTTPException(401, MISSING_KEY, headers={"WWW-Authenticate": "Bearer"})


def require_admin_key(request: Request) -> None:
    """With admin keys configured (NANOVLLM_ADMIN_API_KEYS), the request's key must be one of them: 403 otherwise
    (401 without a valid key, from `require_api_key` before)."""
    keys = get_state(request).admin_keys
    if keys and not key_matches(keys, key_of(request.headers)):
        raise HTTPException(403, "authorization: registering or removing adapters needs an admin key "
                                 "(NANOVLLM_ADMIN_API_KEYS)")


class KeyFirstMiddleware:
    """With API keys set, a request that sends a body (POST, PUT, PATCH: every such route is keyed) without a valid
    key is a 401 before the body is read: FastAPI reads and validates a body before a route's dependencies run, so an
    anonymous client could make the service parse megabytes and answer with the schema's errors. `require_api_key`
    stays the rule of every keyed route; this applies it earlier where a body would come first."""

    BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

    def __init__(self, app: Any, keys: list[bytes]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and self.keys and scope["method"] in self.BODY_METHODS
                and not key_matches(self.keys, key_of(Headers(scope=scope)))):
            refusal = JSONResponse(error_payload(scope.get("path", ""), 401, MISSING_KEY), status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def require_metrics_key(request: Request) -> None:
    """/metrics: open unless NANOVLLM_PROTECT_METRICS."""
    if get_state(request).settings.protect_metrics:
        require_api_key(request)
