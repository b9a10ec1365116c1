"""Cached voices: prompts (latents + transcript), references (latents) and HiFi bundles (both from one
clip). Bounded by count and bytes with least-recently-used eviction; ids are content hashes, so the same
clip registered twice is one entry.

`VoiceStore` is the interface the routers use (async, so a store shared across machines, such as Redis, fits
behind it). `SqliteVoiceStore` keeps the voices in one SQLite database, which every API process of a service
opens (SQLite's locking makes each put, eviction and delete atomic across them): on disk under the cache dir
by default, so a restart keeps the voices, or in a file of the service's private temporary directory
(`NANOVLLM_VOICE_STORE=memory`), gone when it stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

KINDS = ("prompt", "reference", "hifi")


class VoiceTooLargeError(ValueError):
    """One voice is larger than the whole cache."""


class VoiceStoreUnavailable(RuntimeError):
    """The store did not answer (a shared store's server down or unreachable): 503, retry later."""


@dataclass
class Voice:
    kind: str  # one of KINDS
    id: str
    prompt_text: str = ""
    prompt_latents: bytes | None = None  # float32 (frames, feat_dim), left-padded: continuation prompt
    ref_latents: bytes | None = None  # float32 (frames, feat_dim), right-padded: reference condition
    created: float = field(default_factory=time.time)
    parts: dict[str, str] = field(default_factory=dict)  # hifi: the prompt_id / reference_id made with it

    @property
    def nbytes(self) -> int:
        return len(self.prompt_latents or b"") + len(self.ref_latents or b"") + len(self.prompt_text.encode())


@dataclass
class VoiceSummary:
    """A listing row: a voice without its latents."""

    kind: str
    id: str
    prompt_text: str
    prompt_bytes: int
    ref_bytes: int
    nbytes: int
    created: float


def voice_id(kind: str, source: bytes, text: str = "") -> str:
    """Content address of a voice: the kind, the uploaded bytes and the transcript."""
    h = hashlib.blake2b(digest_size=12)
    for part in (kind.encode(), source, text.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


class VoiceStore(ABC):
    up = True  # the last call reached the store
    max_entries: int  # its bounds: beyond them the least recently used voices are evicted
    max_bytes: int

    def check_holds(self, voices: list[Voice]) -> None:
        """That `voices`, added together, fit the bounds at all (else adding the last evicts the first)."""
        need = sum(v.nbytes for v in voices)
        if need > self.max_bytes or len(voices) > self.max_entries:
            raise VoiceTooLargeError(f"{len(voices)} voices of {need} bytes in all exceed the cache size "
                                     f"({self.max_entries} entries, {self.max_bytes} bytes)")

    @abstractmethod
    async def get(self, voice_id: str) -> Voice | None:
        """The voice (marked as recently used) or None."""

    @abstractmethod
    async def put(self, voice: Voice) -> list[str]:
        """Add or refresh a voice; returns the ids evicted to stay within bounds."""

    @abstractmethod
    async def delete(self, voice_id: str) -> bool:
        """False if there was no such voice."""

    @abstractmethod
    async def list(self, kind: str | None = None) -> list[VoiceSummary]:
        """Voices, least recently used first."""

    @abstractmethod
    async def usage(self) -> dict[str, int]:
        """entries, bytes and per-kind counts (for /metrics and /info)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the store holds open."""

    async def aclose(self) -> None:
        self.close()

    async def check(self) -> bool:
        """Whether the store answers now (a local database always does)."""
        return True


SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    prompt_text TEXT NOT NULL,
    prompt_latents BLOB,
    ref_latents BLOB,
    nbytes INTEGER NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,  -- a use counter (max + 1 at each use): an exact LRU order, no clock ties
    parts TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS voices_lru ON voices (last_used);
"""
NEXT_USE = "(SELECT coalesce(max(last_used), 0) + 1 FROM voices)"  # one statement: atomic across processes


class SqliteVoiceStore(VoiceStore):
    def __init__(self, path: Path, max_entries: int, max_bytes: int) -> None:
        self.path, self.max_entries, self.max_bytes = Path(path), max_entries, max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()  # sqlite3 connections belong to the thread that made them
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        db = self._db()
        with db:
            db.executescript(SCHEMA)
        self._trim()  # bounds lowered since the last start

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None,  # explicit transactions below
                                 check_same_thread=False)  # closed by close() from another thread
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
            with self._lock:
                self._connections.append(db)
        return db

    # --- blocking implementations (run in a thread) ---------------------------------------------------
    def _get(self, voice_id: str) -> Voice | None:
        db = self._db()
        row = db.execute("SELECT kind, prompt_text, prompt_latents, ref_latents, created, parts "
                         "FROM voices WHERE id = ?", (voice_id,)).fetchone()
        if row is None:
            return None
        db.execute(f"UPDATE voices SET last_used = {NEXT_USE} WHERE id = ?", (voice_id,))
        return Voice(row[0], voice_id, row[1], row[2], row[3], row[4], json.loads(row[5]))

    def _put(self, voice: Voice) -> list[str]:
        if voice.nbytes > self.max_bytes:
            raise VoiceTooLargeError(f"voice of {voice.nbytes} bytes exceeds the cache size {self.max_bytes}")
        db = self._db()
        db.execute("BEGIN IMMEDIATE")  # one writer at a time across processes: the bounds hold
        try:
            if db.execute(f"UPDATE voices SET last_used = {NEXT_USE} WHERE id = ?", (voice.id,)).rowcount:
                db.execute("COMMIT")
                return []
            evicted = self._evict(db, voice.nbytes)
            db.execute(f"INSERT INTO voices VALUES (?, ?, ?, ?, ?, ?, ?, {NEXT_USE}, ?)",
                       (voice.id, voice.kind, voice.prompt_text, voice.prompt_latents, voice.ref_latents,
                        voice.nbytes, voice.created, json.dumps(voice.parts)))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        if evicted:
            log.info("voice cache full: evicted %s", ", ".join(evicted))
        return evicted

    def _evict(self, db: sqlite3.Connection, incoming: int) -> list[str]:
        """Least recently used first, until one more voice of `incoming` bytes fits (inside a write transaction)."""
        evicted = []
        count, total = db.execute("SELECT count(*), coalesce(sum(nbytes), 0) FROM voices").fetchone()
        while count and (count + (incoming >= 0) > self.max_entries or total + max(incoming, 0) > self.max_bytes):
            old_id, n = db.execute("SELECT id, nbytes FROM voices ORDER BY last_used, rowid LIMIT 1").fetchone()
            db.execute("DELETE FROM voices WHERE id = ?", (old_id,))
            evicted.append(old_id)
            count, total = count - 1, total - n
        return evicted

    def _trim(self) -> None:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        evicted = self._evict(db, -1)
        db.execute("COMMIT")
        if evicted:
            log.info("voice cache over its bounds: evicted %d voices", len(evicted))

    def _delete(self, voice_id: str) -> bool:
        return bool(self._db().execute("DELETE FROM voices WHERE id = ?", (voice_id,)).rowcount)

    def _list(self, kind: str | None) -> list[VoiceSummary]:
        sql = ("SELECT kind, id, prompt_text, length(prompt_latents), length(ref_latents), nbytes, created "
               "FROM voices {} ORDER BY last_used, rowid")
        rows = (self._db().execute(sql.format("WHERE kind = ?"), (kind,)) if kind is not None else
                self._db().execute(sql.format("")))
        return [VoiceSummary(r[0], r[1], r[2], r[3] or 0, r[4] or 0, r[5], r[6]) for r in rows]

    def _usage(self) -> dict[str, int]:
        out = {"entries": 0, "bytes": 0, **dict.fromkeys(KINDS, 0)}
        for kind, count, nbytes in self._db().execute("SELECT kind, count(*), sum(nbytes) FROM voices GROUP BY kind"):
            out[kind] = count
            out["entries"] += count
            out["bytes"] += nbytes
        return out

    # --- the interface ------------------------------------------------------------------------------
    async def get(self, voice_id: str) -> Voice | None:
        return await asyncio.to_thread(self._get, voice_id)

    async def put(self, voice: Voice) -> list[str]:
        return await asyncio.to_thread(self._put, voice)

    async def delete(self, voice_id: str) -> bool:
        return await asyncio.to_thread(self._delete, voice_id)

    async def list(self, kind: str | None = None) -> list[VoiceSummary]:
        return await asyncio.to_thread(self._list, kind)

    async def usage(self) -> dict[str, int]:
        return await asyncio.to_thread(self._usage)

    def close(self) -> None:
        with self._lock:
            for db in self._connections:
                db.close()
            self._connections.clear()
