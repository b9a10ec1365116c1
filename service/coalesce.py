"""Queue coalescing (NANOVLLM_QUEUE_COALESCE_MS): the first generation request to arrive opens a short
window; every request arriving inside it is released with it when the window closes, so they reach the
engine together and are admitted in one scheduling round (one batched prefill) instead of trickling
into successive steps."""

from __future__ import annotations

import asyncio


class Coalescer:
    def __init__(self, window_ms: float) -> None:
        self.window_s = window_ms / 1000.0
        self.waiting = 0  # requests held in the current window (part of the queue depth metric)
        self._gate: asyncio.Future[None] | None = None

    async def admit(self) -> None:
        """Return when this request's window closes (at once when coalescing is off)."""
        if self.window_s <= 0:
            return
        if self._gate is None or self._gate.done():
            loop = asyncio.get_running_loop()
            self._gate = loop.create_future()
            loop.call_later(self.window_s, _open, self._gate)
        self.waiting += 1
        try:
            await asyncio.shield(self._gate)  # one cancelled waiter must not cancel the others' window
        finally:
            self.waiting -= 1


def _open(gate: asyncio.Future[None]) -> None:
    if not gate.done():
        gate.set_result(None)
