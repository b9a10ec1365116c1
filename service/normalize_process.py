"""Text normalisation in a child process of each API process, spawned on the first `normalize: true` request.

Why: wetext's matcher holds the GIL while it works, so normalising on a thread (as before) stalled the process's event
loop and encoder threads 15-20 ms per 200-character piece of prose and up to ~110 ms for text dense with amounts
(docs/normalization.md): every stream of that process waited. In a child it costs this process a message each way.
One child per API process: normalisations queue there, as they queued behind the GIL before.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from service.normalize import load

log = logging.getLogger(__name__)


TIMEOUT_S = 10.0  # a segment's normalisation takes well under a second (docs/normalization.md)
START_S = 120.0  # more for a new child's first call: spawned, it loads the grammars (1.7 s warm, a cold disk more)


class NormalizeProcess:
    """`await normalizer(normalize, text)`: `normalize` (or `normalize_target`) of `text` in the child; a child that
    does not answer within `timeout_s` (wedged) is killed and the text spoken as written, as where a grammar fails
    (it held every normalising request of the process for good)."""

    def __init__(self, timeout_s: float = TIMEOUT_S) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self.timeout_s = timeout_s
        # one call in the child at a time, the rest waiting here: the deadline is then the call's own work, not its
        # wait behind others (queued in the executor, healthy calls timed out and killed a healthy child)
        self._turn = asyncio.Lock()
        self._fresh = True  # the next call is a new child's first

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:  # spawned, not forked: this process runs threads; the child loads the grammars first
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=load)
        return self._pool

    async def __call__(self, fn: Callable[[str], str], text: str) -> str:
        async with self._turn:
            try:
                try:
                    return await self._call(fn, text)
                except BrokenProcessPool:  # the child died (killed, out of memory): a new one, and one more try
                    log.warning("the normalisation process died: starting another")
                    self._kill()  # not `close`: its wait for the executor would stall this event loop
                    return await self._call(fn, text)
            except asyncio.TimeoutError:
                log.warning("the normalisation process gave no answer in time (%g s a call, %g s to start): killed; "
                            "%d characters spoken as written", self.timeout_s, START_S, len(text))
                self._kill()
                return text

    async def _call(self, fn: Callable[[str], str], text: str) -> str:
        loop = asyncio.get_running_loop()
        if self._fresh:  # a new child answers a call of its own first, within START_S (its spawn, the grammars' load):
            # a real call given that time held every call behind it that long when its text wedged the child
            await asyncio.wait_for(loop.run_in_executor(self._executor(), load), START_S)
            self._fresh = False
        return await asyncio.wait_for(loop.run_in_executor(self._executor(), fn, text), self.timeout_s)

    def _kill(self) -> None:
        """Kill the child (a wedged one would never take its next call) and forget it: the next call starts one."""
        if self._pool is not None:
            for proc in list((self._pool._processes or {}).values()):  # the executor has no public kill
                proc.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            self._fresh = True

    def close(self) -> None:
        """Stop the child (after the call it is making, at most a segment's normalisation); waited for, so that the
        executor's queues are released before the process exits (not, leaked semaphores warned of at exit)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            self._fresh = True
