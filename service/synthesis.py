"""Running one generation: submit (through the coalescing window), pull the first chunk before any
response starts (request errors become a 4xx, and the first chunk is the true TTFB), then either stream
the rest or collect it. Whatever ends the response (done, error, client gone) closes the engine request,
which aborts it and frees its KV blocks."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from fastapi import HTTPException, Request
from starlette.responses import StreamingResponse

from engine import PoolError
from service.audio import MEDIA_TYPES, Mp3Stream, encode_whole, output_rate, pcm16
from service.conditioning import Conditioning
from service.errors import http_error
from service.state import ServiceState

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": recorded in the metrics, never seen by the client


@dataclass
class Params:
    max_generate_length: int = 2000
    temperature: float = 1.0
    cfg_value: float = 2.0
    seed: int | None = None


class Generation:
    """An engine request whose first chunk has arrived."""

    def __init__(self, state: ServiceState, route: str, first: np.ndarray | None,
                 rest: AsyncIterator[np.ndarray]) -> None:
        self.state, self.route, self.first, self.rest = state, route, first, rest
        self.samples = 0

    async def chunks(self) -> AsyncIterator[np.ndarray]:
        try:
            chunk = self.first
            while chunk is not None:
                self.samples += len(chunk)
                yield chunk
                chunk = await anext(self.rest, None)
        finally:
            await self.close()

    async def close(self) -> None:
        await self.rest.aclose()  # aborts the engine request if it is still running
        if self.samples:
            self.state.metrics.audio_seconds.labels(self.route).inc(self.samples / self.state.sample_rate)
            self.samples = 0

    async def collect(self) -> np.ndarray:
        parts = [c async for c in self.chunks()]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)


async def start(state: ServiceState, route: str, text: str, cond: Conditioning, params: Params) -> Generation:
    await state.coalescer.admit()
    agen = state.pool.generate(target_text=text, prompt_latents=cond.prompt_latents, prompt_text=cond.prompt_text,
                               ref_audio_latents=cond.ref_latents, max_generate_length=params.max_generate_length,
                               temperature=params.temperature, cfg_value=params.cfg_value, seed=params.seed)
    try:
        first = await anext(agen, None)
    except PoolError as e:
        await agen.aclose()
        raise http_error(e) from e
    except BaseException:  # cancelled while waiting: the engine request must not outlive us
        await agen.aclose()
        raise
    return Generation(state, route, first, agen)


def audio_headers(state: ServiceState, fmt: str) -> dict[str, str]:
    encoding = {"pcm": "pcm_s16le"}.get(fmt, fmt)
    return {"X-Audio-Sample-Rate": str(output_rate(state.sample_rate, fmt)), "X-Audio-Channels": "1",
            "X-Audio-Encoding": encoding, "Cache-Control": "no-store"}


class ClosingStreamingResponse(StreamingResponse):
    """Starlette stops iterating when the client disconnects but does not close the iterator; we do, at
    once, so the engine request is aborted now rather than whenever the generator is collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def mp3_bytes(gen: Generation) -> AsyncIterator[bytes]:
    s = gen.state.settings
    enc = Mp3Stream(gen.state.sample_rate, s.mp3_bitrate_kbps, s.mp3_quality)
    try:
        async for chunk in gen.chunks():
            data = await asyncio.to_thread(enc.encode, chunk)
            if data:
                yield data
        yield await asyncio.to_thread(enc.flush)
    finally:  # closed at a yield (client gone): close the engine request now, not at garbage collection
        await gen.close()


async def pcm_bytes(gen: Generation) -> AsyncIterator[bytes]:
    try:
        async for chunk in gen.chunks():
            yield pcm16(chunk)
    finally:
        await gen.close()


async def sse_events(gen: Generation, fmt: str, text: str) -> AsyncIterator[bytes]:
    """OpenAI's stream_format=sse: speech.audio.delta events (base64 audio), then speech.audio.done."""
    source = mp3_bytes(gen) if fmt == "mp3" else pcm_bytes(gen)
    try:
        async for data in source:
            if data:
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
                yield f"data: {json.dumps(event)}\n\n".encode()
    finally:
        await source.aclose()
    n_in = len(text)
    usage = {"input_tokens": n_in, "output_tokens": 0, "total_tokens": n_in}
    yield f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n".encode()


def stream_response(gen: Generation, fmt: str) -> ClosingStreamingResponse:
    body = mp3_bytes(gen) if fmt == "mp3" else pcm_bytes(gen)
    return ClosingStreamingResponse(body, media_type=MEDIA_TYPES[fmt], headers=audio_headers(gen.state, fmt))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it, which closes its engine request
    (aborted, KV blocks freed). Starlette does not cancel a non-streaming endpoint when its client leaves,
    so without this a blocking generation runs to max_generate_length for nobody. The body has been read
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


async def whole_file(gen: Generation, fmt: str) -> bytes:
    samples = await gen.collect()
    s = gen.state.settings
    return await asyncio.to_thread(encode_whole, samples, gen.state.sample_rate, fmt, s.mp3_bitrate_kbps,
                                   s.mp3_quality)
