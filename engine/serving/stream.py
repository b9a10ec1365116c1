"""GenerationStream: one request's output as an async iterator, fed by the client's reader thread (or its transform
threads) through a queue. It is sent to a worker on its first `anext` (tokenized first, where the client has the
checkpoint's tokenizer) and reaches its client and worker connection only through what they offer it (`StreamClient`,
`StreamLink`: `engine.serving.client`'s EngineClient and its link). Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engine.errors import PoolError, RequestError, error_from
from engine.io.tokenizer import TextTokenizer, text_tokens_many
from engine.serving import protocol as p
from engine.vocabulary import FinishReason, TextIds

if TYPE_CHECKING:
    from engine.serving.routing import LoadTable
    from engine.serving.transforms import TransformThreads

log = logging.getLogger(__name__)

# A stream's transform: (chunk, is_last) -> what the stream yields for it (None: nothing for this chunk). One with a
# `prepare()` method has it run on an encoder thread when the request is sent, before its first chunk.
Transform = Callable[[np.ndarray, bool], Any]
# A longer text alone is tokenized on a thread: 20,000 characters take ~10 ms that the loop's other streams would wait.
TOKENIZE_INLINE_CHARS = 2000


@dataclass
class StreamItem:
    """What a stream's queue holds: a yielded value (or None), the samples behind it, and how it ends."""

    value: Any
    samples: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    latents: np.ndarray | None = None  # the patch behind the chunk (requests with return_latents)


class StreamLink(Protocol):
    """What a stream uses of the worker connection it is sent on."""

    index: int
    connected: bool
    streams: dict[str, GenerationStream]

    def send(self, msg: Any) -> None: ...


class StreamClient(Protocol):
    """What a stream uses of the client that made it."""

    name: str
    ids: Iterator[int]
    tokenizer: TextTokenizer | None
    tokenizing: TextIdsBatcher
    load: LoadTable
    encoders: TransformThreads

    async def pick(self, bounded: bool = True) -> StreamLink: ...


class GenerationStream:
    """One request's output as an async iterator: float32 chunks, or what its transform makes of them.
    `finish_reason` ("stop", "length", "aborted", "error") is set once it ends; closing it early (aclose, break,
    garbage collection) aborts the request, which frees its KV blocks and slot in the engine at once."""

    def __init__(self, client: StreamClient, request: p.SynthesisRequest, transform: Transform | None) -> None:
        self.client, self.request, self.transform = client, request, transform
        self.request_id = f"{client.name}-{next(client.ids)}"
        self.finish_reason: FinishReason | None = None
        self.samples = 0  # samples generated so far
        self.latents: list[np.ndarray] = []  # each patch's latents so far, with request.return_latents
        self.lock = threading.Lock()  # guards what the encoder pool's threads share below
        self.pending: list[tuple[Any, float]] = []  # events waiting for the transform, with when each came
        self.scheduled = False  # queued in the encoder pool (for its earliest pending event)
        self.first_output_at: float | None = None  # monotonic time the transform first gave something to send
        self.transformed_samples = 0
        self._queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._link: StreamLink | None = None
        self._link_counted = False  # it counts in its worker's load (from attach() until the worker is done with it)
        self._release_lock = threading.Lock()
        self._ended = False  # the last item was taken, or the stream was closed

    def __aiter__(self) -> GenerationStream:
        return self

    @property
    def closed(self) -> bool:
        """Ended: its last item was taken, or it was closed (aborted)."""
        return self._ended

    @property
    def worker(self) -> int | None:
        """The index of the worker it was routed to (None before it started)."""
        return self._link.index if self._link is not None else None

    async def __anext__(self) -> Any:
        if self._link is None and not self._ended:
            await self._start()
        while not self._ended:
            item = await self._queue.get()
            self.samples += item.samples
            if item.latents is not None:
                self.latents.append(item.latents)
            if item.error is not None:
                self._end("error")
                self._abort_engine_request()  # an encoder's failure leaves the request running; a worker's, ended
                raise item.error
            if item.finished:
                self._end(item.finish_reason or "stop")
            if item.value is not None:
                return item.value
        raise StopAsyncIteration

    async def _start(self) -> None:
        try:
            self.request.params.validate()
        except ValueError as e:
            self._end("error")
            raise RequestError(str(e)) from e
        tokenizer = self.client.tokenizer  # before pick(): between picking and attach() the shared counts are stale
        try:
            if tokenizer is not None and self.request.text_ids is None:
                ids = await self.client.tokenizing.text_ids(tokenizer, self.request)
                self.request = dataclasses.replace(self.request, text_ids=ids)
            # refused (OverloadedError) when every worker's queue is full, but a continuation
            link = await self.client.pick(bounded=not self.request.continuation)
        except asyncio.CancelledError:  # its caller went away (a client's disconnect) before it was sent
            self._end("aborted")
            raise
        except BaseException:
            self._end("error")
            raise
        if self._ended:  # closed while it was tokenized or waited for a worker: never sent, never counted
            return
        self.attach(link)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("generate %s to worker %d", self.request_id, link.index)
        try:
            link.send(p.Generate(self.request_id, self.request))
        except BaseException:
            self._end("error")
            raise

    def attach(self, link: StreamLink) -> None:
        """Route to `link`'s worker: its events reach this stream, it counts in the load, and the transform's
        prepare() (if any) is queued ahead of the first chunk."""
        self._link, self._link_counted = link, True
        self.client.load.add(link.index, 1)
        link.streams[self.request_id] = self
        if hasattr(self.transform, "prepare"):
            self.client.encoders.prepare(self)

    def _end(self, reason: FinishReason) -> None:
        if self._ended:
            return
        self._ended = True
        if self.finish_reason is None:
            self.finish_reason = reason
        self._release()

    def _release(self) -> None:
        """The worker is done with the request: it stops counting in the load (once)."""
        with self._release_lock:  # close() may come from another thread (garbage collection)
            link, self._link_counted = (self._link if self._link_counted else None), False
        if link is not None:
            link.streams.pop(self.request_id, None)
            self.client.load.add(link.index, -1)

    def put(self, item: StreamItem) -> None:
        """From the event loop: the next item (dropped once the stream is closed). Its last leaves the load at once:
        the load counts the workers' work, and a consumer that reads slowly, or not at all, holds none of it (eight
        clients that never read held every admission place of an idle engine)."""
        if not self._ended:
            self._queue.put_nowait(item)
            if item.finished:
                self._release()

    def convert(self, ev: p.AudioEvent) -> StreamItem:
        """An event -> the queue item (on an encoder thread when there is a transform)."""
        if ev.error is not None:
            error = error_from(ev.error.kind, ev.error.message)
            return StreamItem(None, finished=True, finish_reason="error", error=error)
        audio = ev.audio
        if audio is None:
            if self.transform is None or not ev.finished:
                return StreamItem(None, finished=ev.finished, finish_reason=ev.finish_reason, latents=ev.latents)
            audio = np.zeros(0, np.float32)  # an end without a chunk: the transform still flushes
        value: Any = audio
        if self.transform is not None:
            try:
                value = self.transform(audio, ev.finished)
            except Exception as e:  # an encoder bug fails this stream only
                return self._encoding_failed("transform", e)
        return StreamItem(value, len(audio), ev.finished, ev.finish_reason, latents=ev.latents)

    def prepare(self) -> StreamItem | None:
        """Run the transform's prepare() (on an encoder thread); its failure fails the stream as an encoding one."""
        try:
            self.transform.prepare()  # type: ignore[union-attr]
        except Exception as e:
            return self._encoding_failed("preparing the transform", e)
        return None

    def _encoding_failed(self, what: str, e: Exception) -> StreamItem:
        log.exception("%s of %s failed", what, self.request_id)
        return StreamItem(None, finished=True, finish_reason="error",
                     error=PoolError(f"encoding the audio failed: {type(e).__name__}: {e}"))

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Leaving the block ends the request (a `break` out of `async for` alone does not: the stream lives on)."""
        self.close()

    def close(self) -> None:
        """Abort the request if it is still running (idempotent; safe from any thread)."""
        if self._ended:
            return
        self._end("aborted")
        self._abort_engine_request()

    def _abort_engine_request(self) -> None:
        """Tell the worker to drop the request (it ignores one it has finished already)."""
        link = self._link
        if link is not None and link.connected:
            with contextlib.suppress(PoolError):
                link.send(p.Abort(self.request_id))

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class TextIdsBatcher:
    """The client's tokenization: the requests of the streams that start in one turn of the event loop (a burst)
    tokenized together, in one call into the tokenizer's backend (which spreads them over its threads), instead of one
    after another on the loop while the burst's first requests wait to be sent. One short text is tokenized on the
    loop (a thread hop would cost more); several, or a long one, on a thread, the loop's other streams going on."""

    def __init__(self) -> None:
        self.pending: list[tuple[TextTokenizer, p.SynthesisRequest, asyncio.Future[TextIds | None]]] = []

    async def text_ids(self, tokenizer: TextTokenizer, request: p.SynthesisRequest) -> TextIds | None:
        """What `text_ids` gives, batched with the other requests of this turn of the loop."""
        if not tokenizable(request):
            return None
        future: asyncio.Future[TextIds | None] = asyncio.get_running_loop().create_future()
        self.pending.append((tokenizer, request, future))
        if len(self.pending) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        batch, self.pending = [entry for entry in self.pending if not entry[2].done()], []  # done: cancelled
        for tokenizer in {id(entry[0]): entry[0] for entry in batch}.values():
            group = [(request, future) for tok, request, future in batch if tok is tokenizer]
            requests = [request for request, _ in group]
            if len(group) == 1 and _chars(requests[0]) <= TOKENIZE_INLINE_CHARS:
                _resolve(group, _text_ids_or_none(tokenizer, requests))
            else:
                done = asyncio.ensure_future(asyncio.to_thread(_text_ids_or_none, tokenizer, requests))
                done.add_done_callback(
                    lambda task, group=group: _resolve(group, None if task.cancelled() else task.result()))


def _chars(request: p.SynthesisRequest) -> int:
    return sum(len(t) for t in (request.target_text, request.prompt_text) if isinstance(t, str))


def _text_ids_or_none(tokenizer: TextTokenizer, requests: list[p.SynthesisRequest]) -> list[TextIds | None] | None:
    """`text_ids_many`, or None (logged) where the tokenizer failed: the worker tokenizes these requests then."""
    try:
        return text_ids_many(tokenizer, requests)
    except Exception:
        log.exception("tokenizing in the client failed: the worker tokenizes these requests")
        return None


def _resolve(group: list[tuple[p.SynthesisRequest, asyncio.Future[TextIds | None]]],
             ids: list[TextIds | None] | None) -> None:
    """Each waiting stream its ids; None for all when the tokenizer failed (the worker tokenizes, or refuses, then)."""
    for (_, future), one in zip(group, [None] * len(group) if ids is None else ids, strict=True):
        if not future.done():  # its stream was cancelled meanwhile
            future.set_result(one)


def tokenizable(request: p.SynthesisRequest) -> bool:
    """Whether the client can tokenize the request's text: a registered prompt's transcript is the worker's, and a text
    that is not one (or is empty) is left to the worker to refuse."""
    return (request.prompt_id is None and isinstance(request.target_text, str) and bool(request.target_text.strip())
            and (request.prompt_latents is None or isinstance(request.prompt_text, str)))


def text_ids_many(tokenizer: TextTokenizer, requests: list[p.SynthesisRequest]) -> list[TextIds | None]:
    """`text_ids` of several tokenizable requests, in one call into the tokenizer's backend."""
    tokens = text_tokens_many(tokenizer, [(r.target_text, r.prompt_text or "", r.prompt_latents is not None)
                                          for r in requests])
    return [None if isinstance(ids, Exception) else TextIds(*ids) for ids in tokens]


def text_ids(tokenizer: TextTokenizer, request: p.SynthesisRequest) -> TextIds | None:
    """The request's text as the worker would tokenize it (engine.prompt.build_prompt), or None where the client
    cannot: a registered prompt's transcript is the worker's, and a text that fails is left to the worker to refuse."""
    return text_ids_many(tokenizer, [request])[0] if tokenizable(request) else None
