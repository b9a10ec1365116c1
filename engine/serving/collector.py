"""Python's cyclic garbage collector in a serving process: the start-up's heap frozen out of it, its pauses counted.

A full collection walks every object the collector tracks, and a worker's start-up leaves a few hundred thousand of
them (torch, the model's modules, the tokenizer) that live as long as the process. Walking them stops the step loop,
and with it every stream the worker serves (`tools/bench.py gc`, docs/benchmarks.md). `freeze_startup_heap` moves
them to the permanent generation (`gc.freeze`) once the process is ready, so a collection while serving walks what
requests made. Objects frozen are still freed by their reference counts; only cycles among them are never collected:
what the start-up made and a process later drops (an API process's connections to a worker that restarted) stays
in memory if it is in a cycle, a bounded cost against a pause of every stream.
`CollectorPauses` counts the collections that still run and their time (the worker's `WorkerStats`).
"""

from __future__ import annotations

import gc
import time
from typing import Any


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object left (those the process keeps): how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class CollectorPauses:
    """The collector's passes in this process from now on, by `gc.callbacks`: how many, their summed seconds and the
    longest (each pass holds the interpreter: the step loop and every thread wait)."""

    def __init__(self) -> None:
        self.collections = 0
        self.seconds = 0.0
        self.longest_s = 0.0
        self._started = 0.0
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._started
        self.collections += 1
        self.seconds += elapsed
        self.longest_s = max(self.longest_s, elapsed)

    def close(self) -> None:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)
