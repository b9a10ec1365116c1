"""Running one generation: submit it with the response's encoder, pull the first encoded bytes before any response
starts (request errors become a 4xx, and the first bytes are the true TTFB), then either stream the rest or
collect it. Whatever ends the response (done, error, client gone) closes the engine request, which aborts it
and frees its KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import HTTPException, Request
from starlette.responses import StreamingResponse

from engine import GenerationStream, OverloadedError, PoolError, SamplingParams, SynthesisRequest
from service.audio import MEDIA_TYPES, make_encoder, output_rate, sse_event
from service.conditioning import Conditioning
from service.errors import http_error
from service.normalize import normalize_target
from service.shared_adapters import sync_adapters
from service.state import ServiceState

if TYPE_CHECKING:
    from service.longform import LongGeneration

log = logging.getLogger(__name__)
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": recorded in the metrics, never seen by the client
FINISH_HEADER = "X-Finish-Reason"


class Generation:
    """An engine request whose first encoded bytes have arrived."""

    def __init__(self, state: ServiceState, route: str, stream: GenerationStream, first: bytes | None,
                 sample_rate: int | None = None) -> None:
        self.state, self.route, self.stream, self.first = state, route, stream, first
        self.sample_rate = sample_rate  # the output's rate where the request set one
        self._counted = 0  # samples already in the audio-seconds metric
        self._ended_counted = False

    @property
    def finish_reason(self) -> str | None:
        return self.stream.finish_reason

    @property
    def generated_patches(self) -> int:
        """The audio patches the engine made (OpenAI's output tokens)."""
        return self.stream.samples // self.state.model.samples_per_patch

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            data = self.first
            while data is not None:
                yield data
                data = await anext(self.stream, None)
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort the engine request if it still runs; count the audio made (once)."""
        self.stream.close()
        samples = self.stream.samples - self._counted
        if samples:
            self._counted += samples
            self.state.metrics.audio_seconds.labels(self.route).inc(samples / self.state.sample_rate)
        if self.stream.finish_reason and self.stream.worker is not None and not self._ended_counted:  # not refused
            self._ended_counted = True
            self.state.metrics.finished.labels(self.route, self.stream.finish_reason).inc()

    async def collect(self) -> bytes:
        return b"".join([c async for c in self.chunks()])


async def start(state: ServiceState, route: str, text: str, cond: Conditioning, params: SamplingParams, fmt: str,
                sse: bool = False, lora_name: str | None = None, normalize: bool = False, speed: float = 1.0,
                sample_rate: int | None = None) -> Generation:
    s = state.settings
    if normalize:  # in the normalisation process: the first call loads the grammars (about 1.5 s)
        text = await state.normalizer(normalize_target, text)
    if lora_name is not None:
        await sync_adapters(state, lora_name)  # an adapter registered on another replica: taken here first
    encoder = make_encoder(fmt, state.sample_rate, s.mp3_bitrate_kbps, s.mp3_quality, sse, speed, sample_rate)
    request = SynthesisRequest(text, cond.prompt_text, cond.prompt_latents, None, cond.ref_latents, params, lora_name)
    stream = state.pool.submit(request, encoder)
    gen = Generation(state, route, stream, None, sample_rate)
    try:
        gen.first = await anext(stream, None)
    except PoolError as e:
        await gen.close()  # a whole-file format's first bytes are its last: what it made, and why it ended, count
        if isinstance(e, OverloadedError):
            state.metrics.overloaded.labels(route).inc()
        raise http_error(e, terms=cond.terms) from e
    except BaseException:  # cancelled while waiting: the engine request must not outlive us
        await gen.close()
        raise
    return gen


def audio_headers(state: ServiceState, fmt: str, gen: Generation | None = None) -> dict[str, str]:
    encoding = {"pcm": "pcm_s16le"}.get(fmt, fmt)
    rate = output_rate(state.sample_rate, fmt, gen.sample_rate if gen is not None else None)
    headers = {"X-Audio-Sample-Rate": str(rate), "X-Audio-Channels": "1",
               "X-Audio-Encoding": encoding, "Cache-Control": "no-store"}
    if gen is not None:
        headers["X-Request-Id"] = gen.stream.request_id
        if gen.finish_reason:  # known once the whole body is made (blocking routes)
            headers[FINISH_HEADER] = gen.finish_reason
    return headers


class ClientStalled(Exception):
    """The client took none of a stream's audio for NANOVLLM_SEND_TIMEOUT_S."""


class IntendedCutOffs(logging.Filter):
    """uvicorn logs every response left unterminated as a nameless ERROR. The service leaves one so on purpose (a
    stream the engine broke off, a client that stalled), each logged as a warning naming it: that response's own
    line is dropped, and any other still shows. uvicorn logs it in the request's task as the app returns, so the
    mark is a context variable of that task (a time window also hid another response's line when uvicorn, its
    client gone, logged none)."""

    MESSAGE = "ASGI callable returned without completing response"

    def __init__(self) -> None:
        super().__init__()
        self.marked: ContextVar[bool] = ContextVar("voxcpm_cut_off_on_purpose", default=False)

    def expect(self) -> None:
        self.marked.set(True)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.marked.get() and record.getMessage().startswith(self.MESSAGE))


CUT_OFFS = IntendedCutOffs()  # on the "uvicorn.error" logger (service.app)


class AudioStreamResponse(StreamingResponse):
    """Streams a generation's bytes. Starlette stops iterating when the client disconnects but does not close the
    iterator; we do, at once, so the engine request is aborted now rather than whenever it is collected. A stream
    the engine fails midway (its worker died) is left unterminated, so the client sees it cut off rather than a
    clean end. Where the server speaks the ASGI trailers extension (HTTP/2), the finish reason follows the body as
    a trailer."""

    def __init__(self, gen: Generation, media_type: str, headers: dict[str, str],
                 body: AsyncIterator[bytes] | None = None) -> None:
        self.gen = gen
        self.failure: PoolError | None = None
        super().__init__(self._guarded(body or gen.chunks()), media_type=media_type, headers=headers)

    async def _guarded(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for data in body:
                yield data
        except PoolError as e:
            self.failure = e
            log.warning("stream %s broke off: %s", self.gen.stream.request_id, e)
        finally:
            await body.aclose()  # type: ignore[attr-defined]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        trailers = "http.response.trailers" in scope.get("extensions", {})
        if trailers:
            self.headers["Trailer"] = FINISH_HEADER

        async def guarded_send(message: dict) -> None:
            if message["type"] == "http.response.start" and trailers:
                message = {**message, "trailers": True}
            elif message["type"] == "http.response.body":
                if not message.get("more_body") and self.failure:
                    return  # no terminating chunk: the server closes the connection, the client sees a cut-off stream
                try:  # a client that takes nothing would hold its socket and the audio made for it for good
                    await asyncio.wait_for(send(message), self.gen.state.settings.send_timeout_s)
                except asyncio.TimeoutError:
                    raise ClientStalled from None
                return
            await send(message)

        try:
            await super().__call__(scope, receive, guarded_send)
            if trailers and not self.failure:
                reason = (self.gen.finish_reason or "aborted").encode()
                await send({"type": "http.response.trailers", "headers": [(FINISH_HEADER.lower().encode(), reason)],
                            "more_trailers": False})
            if self.failure:
                CUT_OFFS.expect()
        except ClientStalled:  # left unterminated: the server closes the connection
            log.warning("stream %s: its client took no audio for %g s: dropped", self.gen.stream.request_id,
                        self.gen.state.settings.send_timeout_s)
            CUT_OFFS.expect()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def stream_response(gen: Generation, fmt: str, sse: bool = False) -> AudioStreamResponse:
    media = "text/event-stream" if sse else MEDIA_TYPES[fmt]
    return AudioStreamResponse(gen, media, audio_headers(gen.state, fmt, gen))


async def sse_body(gen: Generation | LongGeneration, text: str) -> AsyncIterator[bytes]:
    """OpenAI's stream_format=sse: the delta events, then speech.audio.done (with why the stream ended, and its usage:
    the input's text tokens, the audio patches made)."""
    try:
        async for data in gen.chunks():
            yield data
    finally:  # closed at a yield (client gone): abort the engine request now, not at garbage collection
        await gen.close()
    tokenizer = gen.state.pool.client.tokenizer
    n_in = len(await asyncio.to_thread(tokenizer.encode, text)) if tokenizer is not None else 0
    n_out = gen.generated_patches
    usage = {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}
    yield sse_event({"type": "speech.audio.done", "usage": usage, "finish_reason": gen.finish_reason})


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it, which closes its engine request
    (aborted, KV blocks freed). Starlette does not cancel an endpoint when its client leaves, so without this a
    blocking generation runs to max_generate_length for nobody, and a stream waiting for a seat keeps its place in
    the queue until its first audio. The body has been read
    by then, so the next message `receive` gives is the disconnect."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise HTTPException(CLIENT_CLOSED, "client disconnected")
    return task.result()


