"""SyncVoxCPMServerPool: the async pool (`engine.serving.pool`) behind blocking calls, driven from a private event loop
thread, and its blocking generate iterator (`SyncStream`), which another thread may close while one waits in next()."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np

from engine.engine_config import EngineConfig
from engine.errors import PoolStoppedError
from engine.serving.pool import AsyncVoxCPMServerPool
from engine.serving.stream import GenerationStream
from engine.vocabulary import FinishReason

T = TypeVar("T")


class SyncVoxCPMServerPool:
    """The async pool behind blocking calls, driven from a private event loop thread."""

    def __init__(self, model: str, devices: list[str], config: EngineConfig, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="voxcpm-pool-loop", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._closed = False  # the loop is stopping or gone: nothing more may be submitted to it
        self._stopping = threading.Lock()  # one stop() at a time; the others return once it is done

        async def make() -> AsyncVoxCPMServerPool:
            return AsyncVoxCPMServerPool(model, devices, config, **kwargs)

        try:
            self.pool = self._run(make())
        except BaseException:  # (the pool stopped its workers): the loop thread must not outlive the failure
            self._close_loop()
            raise

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._closed:  # a coroutine handed to a stopped loop would never finish: its caller would hang
                coro.close()
                raise PoolStoppedError("the pool is stopped")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self._submit(coro).result(timeout)

    def __getattr__(self, name: str) -> Any:
        """The async pool's attribute `name`; its coroutine methods become blocking ones run on the pool's loop (a
        property, or a plain method like `snapshot`, is read or called from the caller's thread)."""
        if name.startswith("_") or name == "pool":
            raise AttributeError(name)
        attr = getattr(self.pool, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        @functools.wraps(attr)
        def blocking(*args: Any, **kwargs: Any) -> Any:
            return self._run(attr(*args, **kwargs))

        return blocking

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | {n for n in dir(self.pool) if not n.startswith("_")})

    def generate(self, target_text: str, **kwargs: Any) -> SyncStream:
        """Blocking iterator of float32 chunks; closing it (break + close(), also from another thread
        while one waits in next()) aborts the request."""
        async def make() -> GenerationStream:
            return self.pool.generate(target_text, **kwargs)

        return SyncStream(self, self._run(make()))

    def stop(self) -> None:
        """Stop the workers and the loop thread (from any thread, any number of times: each returns once stopped)."""
        with self._stopping:
            with self._lock:
                if self._closed:
                    return
            self._run(self.pool.stop())
            self._close_loop()

    def _close_loop(self) -> None:
        with self._lock:
            self._closed = True
        # Let the calls already submitted (other threads' next() on a generate, now failed with
        # PoolStoppedError) finish before the loop stops, or their threads would wait forever.
        asyncio.run_coroutine_threadsafe(_settle(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> SyncVoxCPMServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _settle(timeout: float = 5.0) -> None:
    """Wait for the loop's other tasks, then cancel what is left (their callers get CancelledError)."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    if tasks:
        _, left = await asyncio.wait(tasks, timeout=timeout)
        for t in left:
            t.cancel()
        if left:
            await asyncio.wait(left, timeout=timeout)


class SyncStream:
    """The sync pool's generate iterator. Unlike a generator, it may be closed from another thread while
    one is blocked in next(): the pending step is cancelled (the request is aborted) and next() ends."""

    def __init__(self, pool: SyncVoxCPMServerPool, stream: GenerationStream) -> None:
        self._pool, self._stream = pool, stream
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[np.ndarray] | None = None
        self._task: asyncio.Task[Any] | None = None  # the loop-side task of the pending next()
        self._closed = False

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._stream.finish_reason

    def __iter__(self) -> SyncStream:
        return self

    def __next__(self) -> np.ndarray:
        with self._lock:
            if self._closed:
                raise StopIteration
            if self._pending is not None:
                raise RuntimeError("this generate iterator is already being advanced by another thread")
            try:
                fut = self._pending = self._pool._submit(self._step())
            except BaseException:
                self._closed = True
                self._stream.close()  # the pool stopped under it: "aborted", not a finish_reason of None for good
                raise
        try:
            return fut.result()
        except StopAsyncIteration:
            self._closed = True
            raise StopIteration from None
        except concurrent.futures.CancelledError:
            if self._closed:  # close() from another thread
                raise StopIteration from None
            raise
        except BaseException as e:
            if fut.done() and not fut.cancelled() and fut.exception() is e:
                self._closed = True  # the stream has ended with this error
            else:  # interrupted in the wait (Ctrl-C): the request is aborted with its pending step, not orphaned
                self.close()
            raise
        finally:
            with self._lock:
                self._pending = None

    async def _step(self) -> np.ndarray:
        self._task = asyncio.current_task()
        return await self._stream.__anext__()

    async def _aclose(self) -> None:
        # The stream is closed first (the request aborted, finish_reason "aborted"), then a next() in flight is
        # cancelled and waited for: the other way round, that next() ended its loop before the reason was set.
        self._stream.close()
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    def close(self) -> None:
        """Abort the request (no-op once it has ended)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(PoolStoppedError):
            fut = self._pool._submit(self._aclose())
            if threading.current_thread() is not self._pool._thread:  # never wait on the loop from itself
                fut.result()

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            self._stream.close()

