"""The request body's size limit (NANOVLLM_MAX_REQUEST_BYTES), enforced while the body is read: a declared length
over it is refused before anything is read, and a body that turns out longer (chunked) as soon as it passes it,
so that no request makes the service hold or parse more than the limit. A body whose next bytes take longer than
NANOVLLM_BODY_TIMEOUT_S is refused too (408): uvicorn has no such timeout, and a slow upload held its connection
for good."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.exceptions import HTTPException

from service.errors import error_payload


class BodyLimitMiddleware:
    """Pure ASGI (streaming responses pass untouched); inside it the app's exception handling turns the
    HTTPException raised while reading into the 413 response."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, scope.get("path", ""), int(declared))
            return
        received, complete = 0, False

        async def limited_receive() -> dict:
            nonlocal received, complete
            if complete:  # after the body: waiting for the client to leave takes as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"request body: nothing of it arrived for {self.timeout_s:g} s "
                                         "(NANOVLLM_BODY_TIMEOUT_S)") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_bytes:  # FastAPI lets an HTTPException from reading the body through
                    raise HTTPException(413, self.detail(received))
            else:
                complete = True
            return message

        await self.app(scope, limited_receive, send)

    def detail(self, size: int) -> str:
        return (f"request body: {size} bytes or more exceeds the limit of {self.max_bytes} bytes "
                "(NANOVLLM_MAX_REQUEST_BYTES)")

    async def _refuse(self, send: Any, path: str, size: int) -> None:
        body = json.dumps(error_payload(path, 413, self.detail(size))).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
