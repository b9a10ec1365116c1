"""Cached voices: prompts (latents + transcript), references (latents) and HiFi bundles (both from one
clip). Bounded by count and bytes with least-recently-used eviction; ids are content hashes, so the same
clip registered twice is one entry.

`VoiceStore` is the interface the routers use (async, so a shared store such as Redis fits behind it);
`MemoryVoiceStore` is the LRU itself and `DiskVoiceStore` adds persistence under a directory, so a
restart keeps the voices."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

KINDS = ("prompt", "reference", "hifi")


class VoiceTooLargeError(ValueError):
    """One voice is larger than the whole cache."""


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


def voice_id(kind: str, source: bytes, text: str = "") -> str:
    """Content address of a voice: the kind, the uploaded bytes and the transcript."""
    h = hashlib.blake2b(digest_size=12)
    for part in (kind.encode(), source, text.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


class VoiceStore(ABC):
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
    def list(self, kind: str | None = None) -> list[Voice]:
        """Voices, least recently used first."""

    @abstractmethod
    def usage(self) -> dict[str, int]:
        """entries, bytes and per-kind counts (for /metrics and /info)."""


class MemoryVoiceStore(VoiceStore):
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._voices: OrderedDict[str, Voice] = OrderedDict()
        self._bytes = 0

    async def get(self, voice_id: str) -> Voice | None:
        v = self._voices.get(voice_id)
        if v is not None:
            self._voices.move_to_end(voice_id)
            await self._touched(v)
        return v

    async def put(self, voice: Voice) -> list[str]:
        if voice.nbytes > self.max_bytes:
            raise VoiceTooLargeError(f"voice of {voice.nbytes} bytes exceeds the cache size {self.max_bytes}")
        if voice.id in self._voices:
            await self.get(voice.id)
            return []
        evicted = []
        while voice.id not in self._voices and self._voices and (len(self._voices) >= self.max_entries
                                                                 or self._bytes + voice.nbytes > self.max_bytes):
            old_id = next(iter(self._voices))
            await self.delete(old_id)
            evicted.append(old_id)
        if voice.id in self._voices:  # a concurrent put of the same id won while we evicted: keep one
            return evicted
        self._voices[voice.id] = voice
        self._bytes += voice.nbytes
        await self._stored(voice)
        if evicted:
            log.info("voice cache full: evicted %s", ", ".join(evicted))
        return evicted

    async def delete(self, voice_id: str) -> bool:
        v = self._voices.pop(voice_id, None)
        if v is None:
            return False
        self._bytes -= v.nbytes
        await self._removed(v)
        return True

    def list(self, kind: str | None = None) -> list[Voice]:
        return [v for v in self._voices.values() if kind is None or v.kind == kind]

    def usage(self) -> dict[str, int]:
        out = {"entries": len(self._voices), "bytes": self._bytes}
        for k in KINDS:
            out[k] = sum(1 for v in self._voices.values() if v.kind == k)
        return out

    # persistence hooks (no-ops in memory)
    async def _stored(self, voice: Voice) -> None: ...

    async def _removed(self, voice: Voice) -> None: ...

    async def _touched(self, voice: Voice) -> None: ...


class DiskVoiceStore(MemoryVoiceStore):
    """One `<id>.json` (metadata) + `<id>.bin` (latents) per voice; the .json mtime is its last use, so the
    LRU order survives a restart. Files are written to a temporary name and renamed (no torn entries)."""

    def __init__(self, directory: Path, max_entries: int, max_bytes: int) -> None:
        super().__init__(max_entries, max_bytes)
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._load()

    def _load(self) -> None:
        metas = sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for path in metas:
            try:
                meta = json.loads(path.read_text())
                blob = path.with_suffix(".bin").read_bytes()
                n = meta["prompt_bytes"]
                v = Voice(kind=meta["kind"], id=meta["id"], prompt_text=meta["prompt_text"],
                          prompt_latents=blob[:n] if n else None, ref_latents=blob[n:] or None,
                          created=meta["created"], parts=meta.get("parts", {}))
            except (OSError, ValueError, KeyError) as e:
                log.warning("skipping unreadable cached voice %s: %s", path.name, e)
                continue
            self._voices[v.id] = v
            self._bytes += v.nbytes
        while len(self._voices) > self.max_entries or self._bytes > self.max_bytes:  # bounds lowered since
            old = self._voices.popitem(last=False)[1]
            self._bytes -= old.nbytes
            self._unlink(old.id)
        if self._voices:
            log.info("voice store %s: %d voices loaded", self.dir, len(self._voices))

    def _write(self, voice: Voice) -> None:
        meta = {"id": voice.id, "kind": voice.kind, "prompt_text": voice.prompt_text, "created": voice.created,
                "prompt_bytes": len(voice.prompt_latents or b""), "parts": voice.parts}
        blob = (voice.prompt_latents or b"") + (voice.ref_latents or b"")
        for suffix, data in ((".bin", blob), (".json", json.dumps(meta).encode())):  # .json last: it marks complete
            tmp = self.dir / f".{voice.id}{suffix}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.dir / f"{voice.id}{suffix}")

    def _unlink(self, voice_id: str) -> None:
        for suffix in (".json", ".bin"):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / f"{voice_id}{suffix}").unlink()

    def _utime(self, voice_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.dir / f"{voice_id}.json")

    async def _stored(self, voice: Voice) -> None:
        await asyncio.to_thread(self._write, voice)

    async def _removed(self, voice: Voice) -> None:
        await asyncio.to_thread(self._unlink, voice.id)

    async def _touched(self, voice: Voice) -> None:
        await asyncio.to_thread(self._utime, voice.id)
