"""TransformThreads: the threads that run streams' transforms (a library caller's, or the service's audio encoders)
off the event loop, so encoding spreads over cores instead of serialising on the loop.

A stream's chunks are transformed in order, one at a time: a stream is queued once, for its next chunk, and queued
again when that one is done. Across streams the queue is ordered by `due(stream)`: here the order of arrival; the
service orders by each listener's deadline (`service.encoder_pool.EncoderPool`).

`observer`, when set, is told of each event transformed: whether it made its stream's first bytes, how long it waited
after it came (for a thread, or behind its stream's previous event) and the CPU time the transform took (its wall time
is longer where more threads than cores are encoding). Torch-free.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.serving.protocol import AudioEvent

log = logging.getLogger(__name__)
PREPARE = object()  # the pending "event" that runs a transform's prepare()
_END = object()


class TransformedStream(Protocol):
    """What the threads use of a stream (`engine.serving.stream.GenerationStream`)."""

    lock: threading.Lock  # guards the fields below, shared by the reader thread and these
    pending: list[tuple[Any, float]]  # events waiting for the transform, with when each came
    scheduled: bool  # queued here (for its earliest pending event)
    first_output_at: float | None  # monotonic time the transform first gave something to send
    transformed_samples: int

    @property
    def closed(self) -> bool: ...
    def convert(self, ev: AudioEvent) -> Any: ...
    def prepare(self) -> Any: ...
    def put(self, item: Any) -> None: ...


class TransformThreads:
    def __init__(self, count: int, loop: asyncio.AbstractEventLoop, sample_rate: int = 48000) -> None:
        self.loop, self.sample_rate = loop, sample_rate
        self.observer: Callable[[bool, float, float], None] | None = None
        self.queue: queue.PriorityQueue[tuple[float, int, Any]] = queue.PriorityQueue()
        self._order = itertools.count()
        self.threads = [threading.Thread(target=self._run, name=f"voxcpm-encoder-{i}", daemon=True)
                        for i in range(count)]
        for t in self.threads:
            t.start()

    def due(self, stream: TransformedStream) -> float:
        """The stream's place in the queue for its next event (ties: arrival order). All equal: first come first."""
        return 0.0

    def submit(self, stream: TransformedStream, ev: AudioEvent | object) -> None:
        """From the reader thread: a stream's next event (or, from the loop, PREPARE before any)."""
        with stream.lock:
            stream.pending.append((ev, time.monotonic()))
            if stream.scheduled:
                return  # queued already, for its earliest chunk
            stream.scheduled = True
            due = self.due(stream)
        self.queue.put((due, next(self._order), stream))

    def prepare(self, stream: TransformedStream) -> None:
        """Run the stream's transform's prepare() ahead of its chunks."""
        self.submit(stream, PREPARE)

    def _run(self) -> None:
        while (job := self.queue.get())[2] is not _END:
            stream = job[2]
            with stream.lock:
                if stream.closed:  # aborted meanwhile: its chunks are nobody's
                    stream.pending.clear()
                    stream.scheduled = False
                    continue
                ev, came = stream.pending.pop(0)
            observed = self.observer is not None and ev is not PREPARE
            began, cpu = (time.monotonic(), time.thread_time()) if observed else (0.0, 0.0)
            item = stream.prepare() if ev is PREPARE else stream.convert(ev)
            with stream.lock:
                first = stream.first_output_at is None and item is not None and item.value is not None
                if first:  # this event made the stream's first bytes (a whole-file encoder's is its last chunk)
                    stream.first_output_at = time.monotonic()
                stream.transformed_samples += item.samples if item is not None else 0
                again = bool(stream.pending)
                stream.scheduled = again
                due = self.due(stream)
            if again:
                self.queue.put((due, next(self._order), stream))
            if observed:  # before the item is delivered: counted before its bytes are sent
                self._observe(first, began - came, time.thread_time() - cpu)
            if item is None:
                continue
            try:
                self.loop.call_soon_threadsafe(stream.put, item)
            except RuntimeError:  # the loop is closed
                return

    def _observe(self, first: bool, wait_s: float, cpu_s: float) -> None:
        observer = self.observer
        if observer is None:
            return
        try:
            observer(first, wait_s, cpu_s)
        except Exception:  # a metrics bug must not stop this thread (its streams would hang): told once, then off
            log.exception("the transform threads' observer failed; it is not called again")
            self.observer = None

    def stop(self) -> None:
        for _ in self.threads:
            self.queue.put((float("inf"), next(self._order), _END))
