"""Where each request goes: the in-flight requests per worker, as every process that routes to them sees it.

With several API processes routing to the same workers, each one's own count is not enough: at the start of a
burst they would all decide at once on the same empty picture, and a worker given more than it can run at once
keeps the excess waiting for a whole generation. So each routing process keeps its in-flight count per worker in
its own row of a table that all of them map (a small file in the service's private directory), and routes by the
column sums. Each process writes only its row (no locks); the supervisor clears the row of one that died.
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import numpy as np


class LoadTable:
    def __init__(self, workers: int, path: str | Path | None = None, row: int = 0) -> None:
        """A private table (one row) when `path` is None; else the shared one at `path` (made by `create`)."""
        if path is None:
            self._map: mmap.mmap | bytearray = bytearray(8 * workers)
            rows = 1
        else:
            with open(path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), 0)
            rows = len(self._map) // (8 * workers)
        self.counts = np.frombuffer(self._map, dtype=np.int64).reshape(rows, workers)
        self.row = row
        self.counts[row] = 0  # a restarted process starts from nothing in flight
        self._lock = threading.Lock()  # a stream may be closed from another thread (garbage collection)

    @staticmethod
    def create(path: str | Path, rows: int, workers: int) -> None:
        Path(path).write_bytes(bytes(8 * rows * workers))

    @staticmethod
    def clear_row(path: str | Path, row: int, workers: int) -> None:
        """Forget what a process that died had in flight (its requests died with it)."""
        table = LoadTable(workers, path, row)
        table.close()

    def loads(self) -> np.ndarray:
        """In-flight requests per worker, over every routing process."""
        return self.counts.sum(axis=0)

    def add(self, worker: int, n: int) -> None:
        with self._lock:
            self.counts[self.row, worker] += n

    def close(self) -> None:
        self.counts = np.zeros((1, 1), np.int64)  # drop the view before the map goes
        if isinstance(self._map, mmap.mmap):
            self._map.close()
