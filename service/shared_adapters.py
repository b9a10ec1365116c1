"""Runtime LoRA adapters shared by replicas (with NANOVLLM_REDIS_URL): the registrations (name -> the URI and digest
it was registered with) live in a Redis hash beside the voices, and each replica's workers hold what that hash says.

The rule: before a replica answers anything that involves adapters (POST/GET/DELETE /loras, a generation naming a
`lora_name`, the OpenAI routes' `model`, /v1/models), it reads the hash and brings its own workers in line: an
adapter registered elsewhere is fetched (into this replica's cache dir, digest checked) and registered, one
unregistered elsewhere is unregistered here. So a registration or a removal on any replica is served by every
replica from its next such request (a download longer than FETCH_WAIT_S goes on in the background, waited for only by
a request that names its adapter). Each replica's own registrations (`LoRARegistrations`, local paths) still replay
the adapters to its restarted workers. Redis unreachable: those requests get 503 naming the store, like voices.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from engine import LoRANotFoundError, PoolError
from service.engine_setup import fetch_limits, source_endpoints
from service.lora_source import AdapterSourceError, fetch_in_background, local_refusal
from service.redis_store import RedisVoiceStore

if TYPE_CHECKING:
    from service.state import ServiceState

log = logging.getLogger(__name__)

RETRY_S = 30  # an adapter registered elsewhere that this replica could not fetch or load: tried again after this
# how long a sync waits for an adapter's download under its locks (a copy on disk, a path: at once); a longer one
# goes on in the background, waited for, without the locks, only by a request that names that adapter
FETCH_WAIT_S = 2.0


class SharedAdapters:
    def __init__(self, store: RedisVoiceStore) -> None:
        self.store = store
        self.key = store.voice_prefix.removesuffix("v:") + "loras"
        self.lock = asyncio.Lock()  # one reconciliation at a time in this process
        self.sources: dict[str, dict] = {}  # name -> the registration this process's workers hold
        # name -> (a registration this process could not take, when to try it again): not every request re-fetches
        self.failed: dict[str, tuple[dict, float]] = {}
        self.downloads: dict[tuple[str, str | None], asyncio.Task[Path]] = {}  # (uri, sha256) -> its fetch

    async def registered(self) -> dict[str, dict]:
        raw = await self.store.call("adapters", self.store.redis.hgetall(self.key))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def add(self, name: str, uri: str, sha256: str | None) -> bool:
        """Share this replica's new registration; False if another replica registered the name first from another
        source (two registering it at once: the first write stands, the other answers 409 and converges to it)."""
        source = {"uri": uri, "sha256": sha256}
        value = json.dumps(source)
        while not await self.store.call("adapters", self.store.redis.hsetnx(self.key, name, value)):
            held = await self.store.call("adapters", self.store.redis.hget(self.key, name))
            if held is None:  # removed between the two calls: try the write again
                continue
            if json.loads(held) != source:
                return False
            break
        self.sources[name] = source
        return True

    def holds_other(self, name: str, uri: str, sha256: str | None) -> bool:
        """Whether this process's workers hold the name's shared registration from another source (as of the last
        sync)."""
        held = self.sources.get(name)
        return held is not None and held != {"uri": uri, "sha256": sha256}

    async def remove(self, name: str) -> bool:
        self.sources.pop(name, None)
        return bool(await self.store.call("adapters", self.store.redis.hdel(self.key, name)))

    async def sync(self, state: ServiceState, wanted: str | None = None) -> None:
        """This replica's workers hold the shared registrations (VoiceStoreUnavailable when unreachable), but those
        still downloading: the sync waits for the one its request names (`wanted`), without the locks, and for no
        other (a slow source held every request involving adapters for as long as it took)."""
        if not state.loaded or not state.model.max_loras:
            return
        waited: asyncio.Task | None = None
        while True:
            async with self.lock:
                shared = await self.registered()
                self.failed = {n: f for n, f in self.failed.items() if n in shared}
                current = {_download_key(s) for s in shared.values()}
                for key in [k for k in self.downloads if k not in current]:  # no longer registered: forgotten
                    del self.downloads[key]
                if not self.in_line(shared, state.pool.client.loras):
                    async with state.adapter_changes():  # alone over the API processes, as POST and DELETE /loras
                        await self._reconcile(state, shared)
                source = shared.get(wanted) if wanted is not None else None
                pending = self.downloads.get(_download_key(source)) if source is not None else None
            if pending is None or (pending.done() and pending is waited):  # taken by this round, or not to be
                return
            await asyncio.wait({pending})  # then taken (or refused) by the next round, which forgets it
            waited = pending

    def in_line(self, shared: dict[str, dict], local: MutableMapping[str, str]) -> bool:
        """Whether this process's workers hold what is shared (or wait to try an adapter again, or for its download:
        each sync waited on a download under the locks again)."""
        return all(n in shared for n in local) and all(self._settled(n, src, local) for n, src in shared.items())

    def _settled(self, name: str, source: dict, local: MutableMapping[str, str]) -> bool:
        """The shared registration `name` is held from `source`, or was refused here and waits to be tried again, or
        its download goes on."""
        failed = self.failed.get(name)
        download = self.downloads.get(_download_key(source))
        return (name in local and self.sources.get(name) == source) or (
            failed is not None and failed[0] == source and time.monotonic() < failed[1]) or (
            download is not None and not download.done())

    async def _reconcile(self, state: ServiceState, shared: dict[str, dict]) -> None:
        """Bring the workers in line, but for the registrations whose downloads go on."""
        local = state.pool.client.loras
        for name in [n for n in local if n not in shared]:
            self.sources.pop(name, None)
            with contextlib.suppress(LoRANotFoundError):
                await state.pool.unregister_lora(name)
            log.info("adapter %s unregistered (removed on another replica)", name)
        for name, source in shared.items():
            if self._settled(name, source, local):
                continue
            s = state.settings
            refusal = local_refusal(s.lora_dir, source["uri"])
            path: Path | None = None
            fetch_error: AdapterSourceError | None = None
            if refusal is None:
                key = _download_key(source)
                download = self.downloads.get(key)
                if download is None:  # started here: waited for a moment (a copy on disk, a path: at once)
                    download = self.downloads[key] = asyncio.ensure_future(fetch_in_background(
                        source["uri"], s.cache_path, source["sha256"], source_endpoints(s), fetch_limits(s),
                        background=True))
                    download.add_done_callback(_retrieved)
                    await asyncio.wait({download}, timeout=FETCH_WAIT_S)
                if not download.done():  # the name's adapter as it was until the download lands
                    continue
                del self.downloads[key]
                try:
                    path = download.result()
                except AdapterSourceError as e:
                    fetch_error = e
            if path is not None and local.get(name) == str(path) and name not in self.sources:  # registered from it
                # here already, by another API process of this replica: taken as it is (registering it again left
                # its requests a moment of 404)
                self.failed.pop(name, None)
                self.sources[name] = source
                continue
            if name in local:  # registered again elsewhere (or replayed from before): the adapter held under
                # the name is another one, never to be served again, whether the new one can be taken or not
                self.sources.pop(name, None)
                with contextlib.suppress(LoRANotFoundError):
                    await state.pool.unregister_lora(name)
            if refusal is not None:  # this replica's policy on local files holds for others' registrations too
                log.error("adapter %s registered on another replica not taken here: %s", name, refusal)
                self.failed[name] = (source, time.monotonic() + RETRY_S)
                continue
            try:
                if fetch_error is not None:
                    raise fetch_error
                await state.pool.register_lora(name, str(path))
            except (AdapterSourceError, PoolError) as e:  # requests naming it get 404 from the workers
                log.error("adapter %s registered on another replica not taken here (tried again in %d s): %s",
                          name, RETRY_S, e)
                self.failed[name] = (source, time.monotonic() + RETRY_S)
                continue
            self.failed.pop(name, None)
            self.sources[name] = source
            log.info("adapter %s registered (from another replica)", name)


def _download_key(source: dict) -> tuple[str, str | None]:
    """A registration's download, by what it fetches (its URI and digest)."""
    return source["uri"], source["sha256"]


def _retrieved(task: asyncio.Task) -> None:
    """A download's outcome is read where it is taken; one forgotten (its registration gone) is read here."""
    if not task.cancelled():
        task.exception()


async def sync_adapters(state: ServiceState, wanted: str | None = None) -> None:
    """Bring this replica's adapters in line with the shared registrations, where there are any; `wanted`: the
    adapter the request names (its download, if one goes on, is waited for)."""
    if state.shared_adapters is not None:
        await state.shared_adapters.sync(state, wanted)
