"""The runtime LoRA adapters registered through the service, kept where every API process and the next start of the
service find them.

Each API process's engine client gives every worker it (re)connects to the adapters in its registrations
(`EngineClient.loras`). With a plain dict those were only the ones registered through that process: a restarted API
process forgot them (a worker restarted after that lost them for good), and a restarted service had none. This
mapping is a SQLite table beside the voice cache (per model; in the scratch dir with NANOVLLM_VOICE_STORE=memory):
`POST /loras` adds to it and `DELETE /loras/{name}` removes from it through whichever process serves the call, and
every process reads the current set when it replays, so a worker gets exactly the adapters registered now.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, ItemsView, Iterator, MutableMapping
from pathlib import Path
from typing import Any


class LoRARegistrations(MutableMapping[str, str]):
    """name -> the adapter's local path (fetched into the cache dir), in a SQLite file shared across processes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # autocommit: each statement is its own transaction; WAL lets the other API processes read meanwhile
        self._db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS loras (name TEXT PRIMARY KEY, path TEXT NOT NULL, "
                         "registered REAL NOT NULL)")
        self._changing = asyncio.Lock()  # this process's share of `changing`

    @contextlib.asynccontextmanager
    async def changing(self) -> AsyncIterator[None]:
        """One registration or removal at a time over every API process: each changes the workers and this table in
        turn, and a removal between a registration's two steps left the removed adapter here (a restarted worker
        was given it again). A lock file beside the table, polled: a cancelled request leaves no thread behind."""
        async with self._changing:
            fd = os.open(self.path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        await asyncio.sleep(0.01)
                yield
            finally:
                os.close(fd)  # and its lock with it

    def __getitem__(self, name: str) -> str:
        with self._lock:
            row = self._db.execute("SELECT path FROM loras WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise KeyError(name)
        return row[0]

    def __setitem__(self, name: str, path: str) -> None:
        with self._lock:
            self._db.execute("INSERT INTO loras VALUES (?, ?, ?) ON CONFLICT (name) DO UPDATE SET "
                             "path = excluded.path, registered = excluded.registered", (name, path, time.time()))

    def __delitem__(self, name: str) -> None:
        with self._lock:
            deleted = self._db.execute("DELETE FROM loras WHERE name = ?", (name,)).rowcount
        if not deleted:
            raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows())

    def items(self) -> ItemsView[str, str]:
        """One read: a consistent set, whatever another process removes meanwhile."""
        return ItemsView(self._rows())

    def pop(self, name: str, *default: Any) -> Any:
        """Removed and returned in one statement (two processes unregistering a name at once: one gets it)."""
        with self._lock:
            row = self._db.execute("DELETE FROM loras WHERE name = ? RETURNING path", (name,)).fetchone()
        if row is not None:
            return row[0]
        if default:
            return default[0]
        raise KeyError(name)

    def _rows(self) -> dict[str, str]:
        with self._lock:
            return dict(self._db.execute("SELECT name, path FROM loras ORDER BY registered, name").fetchall())

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM loras").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
