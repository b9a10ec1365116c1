"""Engine errors -> HTTP status: the caller's mistake is a 4xx, server trouble a 5xx (503 + Retry-After
when another try, after a worker restart, may succeed). Bodies are FastAPI's `{"detail": ...}`, except under /v1/
where they take OpenAI's shape `{"error": {"message", "type", "param", "code"}}` (what OpenAI clients parse)."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import errors as engine_errors
from service.voice_store import VoiceStoreUnavailable, VoiceTooLargeError

RETRY_AFTER_S = "5"


def status_of(err: Exception) -> int:
    if isinstance(err, engine_errors.PromptNotFoundError | engine_errors.LoRANotFoundError):
        return 404
    if isinstance(err, engine_errors.RequestError):
        return 400
    if isinstance(err, VoiceTooLargeError):
        return 413
    if isinstance(err, engine_errors.WorkerDiedError | engine_errors.PoolStoppedError | engine_errors.OverloadedError
                  | VoiceStoreUnavailable):
        return 503
    return 500  # EngineError and anything unmapped


def http_error(err: Exception, field: str | None = None, terms: Mapping[str, str] | None = None) -> HTTPException:
    """An HTTPException for an engine error, the message prefixed with the request field it concerns, or its leading
    engine field put in the route's `terms` (`in_route_terms`)."""
    status = status_of(err)
    detail = f"{field}: {err}" if field else in_route_terms(str(err), terms or {})
    headers = {"Retry-After": RETRY_AFTER_S} if status == 503 else None
    return HTTPException(status, detail, headers=headers)


def unavailable(detail: str) -> HTTPException:
    return HTTPException(503, detail, headers={"Retry-After": RETRY_AFTER_S})


OPENAI_PREFIX = "/v1/"
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error", 503: "service_unavailable"}
OPENAI_CODES = {401: "invalid_api_key", 404: "not_found", 413: "request_too_large", 503: "overloaded"}


# The engine names a request's reference audio by its latents (`ref_latents`, `ref_audio_latents`) or, refusing it on a
# model without reference conditioning (VoxCPM1.x), as `ref_audio`: each is the route's field of the reference.
ENGINE_REF_FIELDS = ("ref_latents", "ref_audio_latents", "ref_audio")
# The engine's request fields a message may start with (`prompt_parts` names the longest part of an over-long
# prompt), in the words of the routes whose fields differ: OpenAI's speech route and the live session take the text as
# `input` / `input.text`, every voice as one `voice` and an adapter as `model`; a native request's voice fields are
# its own (`Conditioning`).
OPENAI_TERMS = {"target_text": "input", "prompt_text": "voice", "prompt_latents": "voice", "lora_name": "model",
                **dict.fromkeys(ENGINE_REF_FIELDS, "voice")}
LIVE_TERMS = {**OPENAI_TERMS, "target_text": "input.text"}  # (its config's voice errors say "voice: ..." too)


def in_route_terms(message: str, terms: Mapping[str, str]) -> str:
    """An engine message starts with the engine's name of the request field it concerns: a route that names that
    field otherwise (`terms`: engine field -> the route's) gets its own name."""
    head, sep, rest = message.partition(":")
    return f"{terms[head]}:{rest}" if sep and head in terms else message


def _param_of(message: str) -> str | None:
    """Our messages start with the field they concern ("voice: unknown voice ..."): OpenAI's `param`."""
    head, sep, _ = message.partition(":")
    return head if sep and head.replace("_", "").replace(".", "").isalnum() else None


def error_payload(path: str, status: int, detail: object) -> dict:
    """The error body for a route: `detail` (a message, or FastAPI's list of {loc, msg, type}) as FastAPI sends it,
    or in OpenAI's shape under /v1/."""
    if not path.startswith(OPENAI_PREFIX):
        return {"detail": detail}
    if isinstance(detail, list):  # validation errors: one message naming each field (the body as a whole: "body")
        # a rule between fields names its field in its message ("response_format: ..."); another of the whole body
        # is the body's
        fields = ["body" if e.get("type") == "json_invalid" else
                  ".".join(str(p) for p in e["loc"] if p != "body") or ("" if _param_of(e["msg"]) else "body")
                  for e in detail]
        message = "; ".join(f"{f}: {e['msg']}" if f else e["msg"] for f, e in zip(fields, detail, strict=True))
        param = (fields[0] or _param_of(detail[0]["msg"])) if detail else None
    else:
        message = in_route_terms(str(detail), OPENAI_TERMS)
        param = _param_of(message)
    kind = OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": OPENAI_CODES.get(status)}}


def route_status(path: str, status: int) -> int:
    """Under /v1/ a request the service cannot take as sent is a 400 (FastAPI's 422), as OpenAI answers it: its
    client raises BadRequestError, which migrated handlers catch."""
    return 400 if status == 422 and path.startswith(OPENAI_PREFIX) else status


FASTAPI_BODY_ERROR = "There was an error parsing the body"  # FastAPI's words for a body it cannot decode


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own handling of an HTTPException, with the body shaped for the route (and FastAPI's unparseable
    body named as such)."""
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail
    if exc.status_code == 400 and detail == FASTAPI_BODY_ERROR:
        detail = "request body: not a JSON object in UTF-8 (send Content-Type: application/json)"
    status = route_status(request.url.path, exc.status_code)
    return JSONResponse(error_payload(request.url.path, status, detail), status_code=status, headers=exc.headers)


async def pool_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Anything a route did not map itself."""
    err = http_error(exc)
    return JSONResponse(error_payload(request.url.path, err.status_code, err.detail), status_code=err.status_code,
                        headers=err.headers)


HANDLED = (engine_errors.PoolError, VoiceTooLargeError, VoiceStoreUnavailable)


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 (under /v1/ OpenAI's 400) shape, minus the echoed input (it can be megabytes of base64): each
    error names the field (loc) and the rule it broke (msg)."""
    assert isinstance(exc, RequestValidationError)
    detail = [{"loc": list(e.get("loc", ())), "msg": _rule(e), "type": e.get("type", "")} for e in exc.errors()]
    status = route_status(request.url.path, 422)
    return JSONResponse(error_payload(request.url.path, status, detail), status_code=status)


def _rule(error: Mapping) -> str:
    """The rule an error broke, in words; for the body as a whole, what to send instead (FastAPI's "Field required" of
    an empty body, "Input should be a valid dictionary" of a form or text body, "JSON decode error" without why)."""
    loc, kind = tuple(error.get("loc", ())), error.get("type", "")
    if kind == "json_invalid":
        reason = (error.get("ctx") or {}).get("error")
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return f"not valid JSON{at}{f' ({reason})' if reason else ''}"
    if loc == ("body",) and kind == "missing":
        return "a JSON object is required, sent with Content-Type: application/json"
    if loc == ("body",) and kind in ("model_attributes_type", "dict_type"):
        return "must be a JSON object, sent with Content-Type: application/json"
    return str(error.get("msg", "")).removeprefix("Value error, ")
