"""Engine errors -> HTTP status: the caller's mistake is a 4xx, server trouble a 5xx (503 + Retry-After
when another try, after a worker restart, may succeed)."""

from __future__ import annotations

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from engine import OverloadedError, PoolError, PoolStoppedError, PromptNotFoundError, RequestError, WorkerDiedError
from service.voice_store import VoiceTooLargeError

RETRY_AFTER_S = "5"


def status_of(err: Exception) -> int:
    if isinstance(err, PromptNotFoundError):
        return 404
    if isinstance(err, RequestError):
        return 400
    if isinstance(err, VoiceTooLargeError):
        return 413
    if isinstance(err, WorkerDiedError | PoolStoppedError | OverloadedError):
        return 503
    return 500  # EngineError and anything unmapped


def http_error(err: Exception, field: str | None = None) -> HTTPException:
    """An HTTPException for an engine error, the message prefixed with the request field it concerns."""
    status = status_of(err)
    detail = f"{field}: {err}" if field else str(err)
    headers = {"Retry-After": RETRY_AFTER_S} if status == 503 else None
    return HTTPException(status, detail, headers=headers)


def unavailable(detail: str) -> HTTPException:
    return HTTPException(503, detail, headers={"Retry-After": RETRY_AFTER_S})


async def pool_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Anything a route did not map itself."""
    err = http_error(exc)
    return JSONResponse({"detail": err.detail}, status_code=err.status_code, headers=err.headers)


HANDLED = (PoolError, VoiceTooLargeError)


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 shape, minus the echoed input (it can be megabytes of base64): each error names the
    field (loc) and the rule it broke (msg)."""
    assert isinstance(exc, RequestValidationError)
    detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "").removeprefix("Value error, "),
               "type": e.get("type", "")} for e in exc.errors()]
    return JSONResponse({"detail": detail}, status_code=422)
