"""The voice store shared by replicas (`NANOVLLM_REDIS_URL`): the same voices, bounds and LRU order as
`SqliteVoiceStore`, in one Redis (or Valkey) that every replica's API processes reach.

Layout under a prefix per model (`voxcpm:<fingerprint>:`): a hash per voice (`v:<id>`: its fields and latents), a
sorted set `lru` (id -> its last use, a shared counter `use` incremented at each use: an exact order across replicas,
no clocks), and a hash `usage` (bytes and per-kind counts). Each add (with its evictions), use, delete and listing is
one Lua script: atomic on the server, so the bounds hold whichever replicas add at once.

Each replica keeps the latents it has read in a small local LRU (ids are content hashes: an id's latents never
change), but every use still asks Redis whether the voice exists (and marks it used), so a delete on any replica is
honoured by the next request on every other. Every call is bounded by `NANOVLLM_REDIS_TIMEOUT_S`; a failure raises
`VoiceStoreUnavailable` (503 + Retry-After naming the store) and the connection pool reconnects on the next call.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import Gauge
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from service.settings import Settings
from service.voice_store import (
    KINDS,
    SqliteVoiceStore,
    Voice,
    VoiceStore,
    VoiceStoreUnavailable,
    VoiceSummary,
    VoiceTooLargeError,
)

log = logging.getLogger(__name__)

# KEYS: lru, use, usage. ARGV: voice key prefix, id ('' to trim only), kind, nbytes (-1: trim only), max_entries,
# max_bytes, then the voice's field/value pairs. Returns the evicted ids.
PUT = """
local vkey = ARGV[1] .. ARGV[2]
local incoming = tonumber(ARGV[4])
if incoming >= 0 and redis.call('EXISTS', vkey) == 1 then
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[2]), ARGV[2])
  return {}
end
local max_entries, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6])
local count = redis.call('ZCARD', KEYS[1])
local total = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0')
local adding = incoming >= 0 and 1 or 0
local evicted = {}
while count > 0 and (count + adding > max_entries or total + math.max(incoming, 0) > max_bytes) do
  local old = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  local meta = redis.call('HMGET', ARGV[1] .. old, 'kind', 'nbytes')
  redis.call('DEL', ARGV[1] .. old)
  redis.call('ZREM', KEYS[1], old)
  if meta[1] then
    redis.call('HINCRBY', KEYS[3], meta[1], -1)
    redis.call('HINCRBY', KEYS[3], 'bytes', -tonumber(meta[2]))
    total = total - tonumber(meta[2])
  end
  count = count - 1
  evicted[#evicted + 1] = old
end
if adding == 1 then
  redis.call('HSET', vkey, unpack(ARGV, 7))
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[2]), ARGV[2])
  redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
  redis.call('HINCRBY', KEYS[3], 'bytes', incoming)
end
return evicted
"""
# KEYS: lru, use. ARGV: voice key prefix, id, '1' for the fields too. Marks the voice used (where the server takes
# writes: a full one refuses them, and its voices must still be read); nil if there is none.
GET = """
local vkey = ARGV[1] .. ARGV[2]
if redis.call('EXISTS', vkey) == 0 then return false end
local use = redis.pcall('INCR', KEYS[2])
if type(use) == 'number' then redis.pcall('ZADD', KEYS[1], use, ARGV[2]) end
if ARGV[3] == '1' then
  return redis.call('HMGET', vkey, 'kind', 'prompt_text', 'prompt_latents', 'ref_latents', 'created', 'parts')
end
return 1
"""
# KEYS: lru, usage. ARGV: voice key prefix, id. 1 if it was there. (A full server takes it: once a script has
# deleted, Redis 7 and Valkey let it write the counters.)
DELETE = """
local vkey = ARGV[1] .. ARGV[2]
local meta = redis.call('HMGET', vkey, 'kind', 'nbytes')
if not meta[1] then return 0 end
redis.call('DEL', vkey)
redis.call('ZREM', KEYS[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], meta[1], -1)
redis.call('HINCRBY', KEYS[2], 'bytes', -tonumber(meta[2]))
return 1
"""
# KEYS: lru. ARGV: voice key prefix, kind ('' for all). Rows of (id, kind, prompt_text, prompt bytes, ref bytes,
# nbytes, created), least recently used first.
LIST = """
local rows = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local vkey = ARGV[1] .. id
  local m = redis.call('HMGET', vkey, 'kind', 'prompt_text', 'nbytes', 'created')
  if m[1] and (ARGV[2] == '' or ARGV[2] == m[1]) then
    rows[#rows + 1] = {id, m[1], m[2], redis.call('HSTRLEN', vkey, 'prompt_latents'),
                       redis.call('HSTRLEN', vkey, 'ref_latents'), m[3], m[4]}
  end
end
return rows
"""


def redacted(url: str) -> str:
    """The URL without credentials (it appears in error messages and /info)."""
    parts = urlsplit(url)
    host = parts.hostname or parts.path or "localhost"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path if parts.hostname else ''}"


def model_namespace(model_path: str) -> str:
    """Latents belong to one model: its config and directory name key the voices (replicas mount it anywhere)."""
    config = Path(model_path, "config.json").read_bytes()
    return hashlib.blake2b(Path(model_path).name.encode() + b"\0" + config, digest_size=8).hexdigest()


class RedisVoiceStore(VoiceStore):
    def __init__(self, url: str, namespace: str, max_entries: int, max_bytes: int, timeout_s: float,
                 local_cache_bytes: int | None = None) -> None:
        self.url, self.max_entries, self.max_bytes, self.timeout_s = url, max_entries, max_bytes, timeout_s
        self.where = redacted(url)
        # one retry on a fresh connection: a pooled one may have died with a restarted server
        self.redis = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                    retry=Retry(NoBackoff(), 1), retry_on_timeout=True)
        p = f"voxcpm:{namespace}:"
        self.voice_prefix, self.lru, self.use, self.usage_key = p + "v:", p + "lru", p + "use", p + "usage"
        self._put, self._get, self._delete, self._list = (self.redis.register_script(s) for s in (PUT, GET, DELETE,
                                                                                                   LIST))
        self._local: OrderedDict[str, Voice] = OrderedDict()
        self._local_bytes = 0
        self._local_max = max_bytes if local_cache_bytes is None else local_cache_bytes
        self._trimmed = False
        self.up = True

    async def call(self, what: str, coro):
        """Bounded (a hung server costs at most the timeout and its one retry) and typed."""
        try:
            out = await asyncio.wait_for(coro, 2 * self.timeout_s + 0.5)
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            if self.up:
                log.warning("voice store %s unreachable (%s): %s", self.where, what, e or type(e).__name__)
            self.up = False
            raise VoiceStoreUnavailable(f"voice store ({self.where}) unreachable: {e or type(e).__name__}") from e
        if not self.up:
            log.info("voice store %s reachable again", self.where)
        self.up = True
        return out

    # --- the local copy of latents read ---------------------------------------------------------------
    def _remember(self, voice: Voice) -> None:
        if voice.id in self._local or voice.nbytes > self._local_max:
            return
        self._local[voice.id] = voice
        self._local_bytes += voice.nbytes
        while self._local_bytes > self._local_max:
            _, old = self._local.popitem(last=False)
            self._local_bytes -= old.nbytes

    def _forget(self, voice_id: str) -> None:
        old = self._local.pop(voice_id, None)
        if old is not None:
            self._local_bytes -= old.nbytes

    # --- the interface ------------------------------------------------------------------------------
    async def get(self, voice_id: str) -> Voice | None:
        known = self._local.get(voice_id)
        row = await self.call("get", self._get(keys=[self.lru, self.use],
                                                args=[self.voice_prefix, voice_id, "0" if known else "1"]))
        if row is None:
            self._forget(voice_id)
            return None
        if known is not None:  # there when the store answered (a delete or an eviction meanwhile dropped our copy)
            if voice_id in self._local:
                self._local.move_to_end(voice_id)
            return known
        try:
            kind, text, prompt_lat, ref_lat, created, parts = row
            voice = Voice(kind.decode(), voice_id, text.decode(), prompt_lat or None, ref_lat or None, float(created),
                          json.loads(parts))
        except (TypeError, ValueError, AttributeError) as e:  # an entry not written by this service: none
            log.error("voice %s in the store is malformed (%s): read as unknown", voice_id, e)
            return None
        self._remember(voice)
        return voice

    async def put(self, voice: Voice) -> list[str]:
        if voice.nbytes > self.max_bytes:
            raise VoiceTooLargeError(f"voice of {voice.nbytes} bytes exceeds the cache size {self.max_bytes}")
        fields = ["kind", voice.kind, "prompt_text", voice.prompt_text, "prompt_latents", voice.prompt_latents or b"",
                  "ref_latents", voice.ref_latents or b"", "nbytes", voice.nbytes, "created", repr(voice.created),
                  "parts", json.dumps(voice.parts)]
        evicted = await self._put_script(voice.id, voice.kind, voice.nbytes, fields)
        self._remember(voice)
        return evicted

    async def _put_script(self, voice_id: str, kind: str, nbytes: int, fields: list) -> list[str]:
        raw = await self.call("put", self._put(keys=[self.lru, self.use, self.usage_key],
                                                args=[self.voice_prefix, voice_id, kind, nbytes, self.max_entries,
                                                      self.max_bytes, *fields]))
        evicted = [i.decode() for i in raw]
        for old in evicted:
            self._forget(old)
        if evicted:
            log.info("voice cache full: evicted %s", ", ".join(evicted))
        return evicted

    async def trim(self) -> None:
        """Evict down to this replica's bounds (lowered since voices were added), once per start."""
        if not self._trimmed:
            await self._put_script("", "", -1, [])
            self._trimmed = True

    async def delete(self, voice_id: str) -> bool:
        self._forget(voice_id)
        return bool(await self.call("delete", self._delete(keys=[self.lru, self.usage_key],
                                                            args=[self.voice_prefix, voice_id])))

    async def list(self, kind: str | None = None) -> list[VoiceSummary]:
        rows = await self.call("list", self._list(keys=[self.lru], args=[self.voice_prefix, kind or ""]))
        out = []
        for row in rows:
            try:
                i, k, t, pb, rb, n, c = row
                out.append(VoiceSummary(k.decode(), i.decode(), t.decode(), int(pb), int(rb), int(n), float(c)))
            except (TypeError, ValueError, AttributeError) as e:  # malformed (see `get`): not listed
                log.error("a malformed voice in the store is not listed (%s): %r", e, row[:1])
        return out

    async def usage(self) -> dict[str, int]:
        raw = await self.call("usage", self.redis.hgetall(self.usage_key))
        counts = {k.decode(): int(v) for k, v in raw.items()}
        out = {"entries": sum(counts.get(k, 0) for k in KINDS), "bytes": counts.get("bytes", 0)}
        return {**out, **{k: counts.get(k, 0) for k in KINDS}}

    async def check(self) -> bool:
        """Ping (and trim once reachable); whether the store answers."""
        try:
            await self.call("ping", self.redis.ping())
            await self.trim()
        except VoiceStoreUnavailable:
            return False
        return True

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        await self.redis.aclose()


def open_voice_store(settings: Settings, voice_db: Path, model_path: str) -> VoiceStore:
    """Redis with NANOVLLM_REDIS_URL, else the SQLite database at `voice_db`."""
    if settings.redis_url:
        return RedisVoiceStore(settings.redis_url, model_namespace(model_path), settings.voice_cache_max_entries,
                               settings.voice_cache_max_bytes, settings.redis_timeout_s)
    return SqliteVoiceStore(voice_db, settings.voice_cache_max_entries, settings.voice_cache_max_bytes)


async def watch_store(store: VoiceStore, up: Gauge, interval_s: float = 1.0) -> None:
    """Keeps the store's health gauge current without traffic (and trims a shared store once it answers)."""
    while True:
        up.set(1 if await store.check() else 0)
        await asyncio.sleep(interval_s)
