"""EngineClient: one process's connections to the engine workers.

A library pool has one client; the service has one in each API process. A client routes each request to the
least-loaded ready worker and turns the worker's per-step messages into one async stream per request
(`engine.serving.stream.GenerationStream`). A request may carry a *transform* (the service's audio encoder): it
runs on the client's transform threads (`engine.serving.transforms`; the service's are its deadline-ordered
`service.encoder_pool.EncoderPool`), so encoding spreads over cores instead of serialising on the event loop.

Threads per worker connection (`engine.serving.worker_link.WorkerLink`): a reader (unpickles messages; hands audio
to the loop or the encoder pool) and a sender. A connection that breaks fails its requests at once (WorkerDiedError,
or PoolStoppedError after the worker said Goodbye) and is re-established in the background: a restarted worker
listens on the same address, and the client's registered prompts are sent to it again. Torch-free: API processes
import it without torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Iterable, MutableMapping
from multiprocessing.connection import Client, Connection
from typing import Any, TypeVar

import numpy as np

from engine.errors import (
    LoRANotFoundError,
    OverloadedError,
    PoolError,
    PoolStoppedError,
    WorkerDiedError,
    error_from,
)
from engine.io.tokenizer import TextTokenizer
from engine.serving import protocol as p
from engine.serving.reports import WorkerInfo, WorkerLoad, WorkerStats
from engine.serving.routing import LoadTable
from engine.serving.stream import GenerationStream, StreamItem, TextIdsBatcher, Transform
from engine.serving.transforms import TransformThreads
from engine.serving.worker_link import WorkerLink
from engine.vocabulary import AdapterInfo

log = logging.getLogger(__name__)

R = TypeVar("R")
RECONNECT_S = (0.05, 0.5)  # first and longest pause between connection attempts
STATS_TIMEOUT_S = 5.0  # a worker that answers no GetStats within this is stuck: the pool is not ready until it answers
REPLAY = "replay:"  # call ids of registrations sent again to a (re)connected worker, answered to nobody
def _deliver(items: Iterable[tuple[GenerationStream, StreamItem]]) -> None:
    for stream, item in items:
        stream.put(item)


class EngineClient:
    """Connections from this process to every engine worker (by Unix socket address)."""

    def __init__(self, addresses: list[str], authkey: bytes, encoder_threads: int = 4,
                 load: LoadTable | None = None, queue_bound: int | None = None,
                 loras: MutableMapping[str, str] | None = None,
                 transform_threads: type[TransformThreads] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.authkey = authkey
        self.links = [WorkerLink(self, i, a) for i, a in enumerate(addresses)]
        self.load = load or LoadTable(len(addresses))  # shared with the other API processes of a service
        self.queue_bound = queue_bound  # requests a worker may hold beyond its max_num_seqs (None: no bound)
        self.encoders = (transform_threads or TransformThreads)(max(1, encoder_threads), self.loop)
        self.ids = itertools.count()
        self.name = os.urandom(4).hex()  # request ids are this client's name and a counter: unique across clients
        self.prompts: dict[str, tuple[np.ndarray, str]] = {}
        # Runtime LoRA adapters to register again on a (re)connected worker: name -> path. Those registered through
        # this client, or a mapping shared with other clients of the same workers and kept across restarts (the
        # service's `LoRARegistrations`).
        self.loras: MutableMapping[str, str] = loras if loras is not None else {}
        # this client's long texts' adapter leases: lease -> the adapter's name and path when it began (`lease_lora`)
        self.lora_leases: dict[str, tuple[str, str | None]] = {}
        self.lora_changes = asyncio.Lock()  # one registration or removal at a time: each changes the workers in turn
        # The checkpoint's tokenizer, when the owner sets it (the pool does): requests are then tokenized here (in
        # the service, beside the other API processes) instead of one after another in the worker's loop, which a
        # burst's requests all wait for.
        self.tokenizer: TextTokenizer | None = None
        self.tokenizing = TextIdsBatcher()
        self.closed = False
        self._tasks = [asyncio.ensure_future(self._keep_connected(link)) for link in self.links]

    # --- connections --------------------------------------------------------------------------------
    async def _keep_connected(self, link: WorkerLink) -> None:
        pause = RECONNECT_S[0]
        while not self.closed:
            try:
                conn = await asyncio.to_thread(Client, link.address, "AF_UNIX", authkey=self.authkey)
            except (OSError, EOFError) as e:  # not listening (yet, or any more)
                log.debug("worker %d at %s: %s", link.index, link.address, e)
                await asyncio.sleep(pause)
                pause = min(RECONNECT_S[1], 2 * pause)
                continue
            except Exception as e:  # authentication failed, ...
                log.error("worker %d at %s refused us: %s", link.index, link.address, e)
                await asyncio.sleep(RECONNECT_S[1])
                continue
            if self.closed:
                conn.close()
                return
            pause = RECONNECT_S[0]
            closed = link.attach(conn)
            for prompt_id, (latents, text) in self.prompts.items():  # a restarted worker learns them again
                link.send(p.AddPrompt(prompt_id, latents, text))
            for name, path in self.loras.items():  # and the adapters (answered as replays: only errors are logged)
                link.send(p.RegisterLoRA(f"{REPLAY}{name}", name, path))
            for lease, (name, path) in self.lora_leases.items():  # and the leases (the adapter read again if need be)
                link.send(p.LeaseLoRA(lease, name, path))
            await closed.wait()

    def on_message(self, link: WorkerLink, msg: Any) -> None:
        link.answering = True
        if isinstance(msg, p.Ready):
            link.info, link.ready, link.down = msg.info, True, False
            self.encoders.sample_rate = msg.info.sample_rate
            link.ready_event.set()
        elif isinstance(msg, p.Reply):
            if msg.call_id.startswith(REPLAY):
                if msg.error is not None:
                    log.error("worker %d did not take adapter %s again: %s", link.index,
                              msg.call_id.removeprefix(REPLAY), msg.error.message)
                return
            fut = link.calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    fut.set_exception(error_from(msg.error.kind, msg.error.message))
                else:
                    fut.set_result(msg.value)
        elif isinstance(msg, p.Goodbye):
            link.stopped_reason = msg.reason
        else:
            log.error("unexpected message %r from worker %d", type(msg).__name__, link.index)

    def on_closed(self, link: WorkerLink, conn: Connection) -> None:
        """A connection ended: fail what waits on it, and let _keep_connected make a new one."""
        if conn is not link.conn:
            return
        link.close_connection()
        link.conn = None
        link.connected = link.ready = False
        link.down = not self.closed
        link.ready_event = asyncio.Event()
        if self.closed or link.stopped_reason:
            err: PoolError = PoolStoppedError(f"worker {link.index} stopped: {link.stopped_reason or 'pool closed'}")
        else:
            err = WorkerDiedError(f"worker {link.index} ({link.info.device if link.info else link.address}) exited")
            log.error("lost the connection to worker %d: its requests failed", link.index)
        for stream in list(link.streams.values()):
            stream.put(StreamItem(None, finished=True, finish_reason="error", error=err))
        link.streams.clear()
        for fut in link.calls.values():
            if not fut.done():
                fut.set_exception(err)
        link.calls.clear()
        link.closed_event.set()

    # --- events (the reader thread) -----------------------------------------------------------------
    def dispatch(self, link: WorkerLink, msg: p.StepEvents) -> None:
        """A step's events: plain streams' chunks go to the loop in one callback, transformed ones to the encoders."""
        plain: list[tuple[GenerationStream, StreamItem]] = []
        for ev in msg.events:
            stream = link.streams.get(ev.request_id)
            if stream is None:
                continue  # closed meanwhile
            if stream.transform is None:
                plain.append((stream, stream.convert(ev)))
            else:
                self.encoders.submit(stream, ev)
        self.loop.call_soon_threadsafe(self._on_step, link, msg.load, plain)

    @staticmethod
    def _on_step(link: WorkerLink, load: WorkerLoad, plain: list[tuple[GenerationStream, StreamItem]]) -> None:
        link.load, link.answering = load, True
        _deliver(plain)

    # --- state --------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """No connection is broken (a worker may still be loading)."""
        return not self.closed and not any(link.down for link in self.links)

    @property
    def ready(self) -> bool:
        """Every worker has reported ready (loaded; one may be `stuck` since, which the pool's `ready` says)."""
        return not self.closed and all(link.ready for link in self.links)

    @property
    def stuck(self) -> list[int]:
        """The ready workers whose last stats call went unanswered for STATS_TIMEOUT_S (a GPU call that never
        returns, a deadlock): connected, yet serving nothing."""
        return [link.index for link in self.links if link.ready and not link.answering]

    @property
    def info(self) -> WorkerInfo | None:
        """The model facts of the first ready worker (None before any)."""
        return next((link.info for link in self.links if link.ready), None)

    async def wait_for_ready(self, timeout: float | None = None) -> None:
        async def all_ready() -> None:
            while not self.ready:
                if self.closed:
                    raise PoolStoppedError("the pool is stopped")
                await self._some_ready(self.links, 0.5)

        await asyncio.wait_for(all_ready(), timeout)

    @staticmethod
    async def _some_ready(links: list[WorkerLink], timeout: float | None) -> None:
        """Until one of the links not ready turns ready (or the timeout passes)."""
        waits = [asyncio.ensure_future(link.ready_event.wait()) for link in links if not link.ready]
        if not waits:
            return
        _, pending = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()

    def snapshot(self) -> list[dict[str, int]]:
        """Per worker, without a round trip: this client's in-flight requests and the load the worker last
        reported with its events (running, waiting, free_blocks, total_blocks: every client's requests)."""
        return [{"in_flight": len(link.streams), "alive": int(link.connected), **vars(link.load)}
                for link in self.links]

    async def pick(self, bounded: bool = True) -> WorkerLink:
        """The ready worker with the fewest requests in flight (over every process routing to it); waits while the
        workers are still loading."""
        while True:
            if self.closed:
                raise PoolStoppedError("the pool is stopped")
            ready = [link for link in self.links if link.ready]
            if ready:
                loads = self.load.loads()
                best = min(ready, key=lambda lk: loads[lk.index])
                if self.queue_bound is not None and bounded:
                    capacity = (best.info.max_num_seqs if best.info else 0) + self.queue_bound
                    if loads[best.index] >= capacity:
                        raise OverloadedError(f"every worker holds {capacity} requests ({capacity - self.queue_bound} "
                                              f"running, {self.queue_bound} waiting): try again shortly")
                return best
            if all(link.down for link in self.links):
                raise WorkerDiedError("no worker is running; restart the pool")
            await self._some_ready(self.links, 0.5)

    # --- calls --------------------------------------------------------------------------------------
    def generate(self, request: p.SynthesisRequest, transform: Transform | None = None) -> GenerationStream:
        """The request's stream (it is sent to a worker on the first `anext`)."""
        return GenerationStream(self, request, transform)

    async def call(self, link: WorkerLink, make: Callable[[str], p.Call[R]]) -> R:
        """Ask `link`'s worker the call `make(call_id)` builds; its typed answer, or the error it sent raised."""
        call_id = f"c{next(self.ids)}"
        fut: asyncio.Future[R] = self.loop.create_future()
        link.calls[call_id] = fut
        try:
            link.send(make(call_id))
            return await fut
        finally:
            link.calls.pop(call_id, None)

    async def encode_latents(self, wav: bytes, wav_format: str | None, padding: str) -> np.ndarray:
        # the queue bound is the generations': an encode or a listing is no seat's work (it was refused as overloaded)
        return await self.call(await self.pick(bounded=False), lambda cid: p.EncodeLatents(cid, wav, wav_format,
                                                                                           padding))

    async def stats(self) -> list[WorkerStats | None]:
        """Per worker: running/waiting sequences, free KV blocks, preemptions... (None for one not ready, or one that
        did not answer within STATS_TIMEOUT_S: it is `stuck` until it sends anything again)."""
        async def one(link: WorkerLink) -> WorkerStats | None:
            if not link.ready:
                return None
            try:
                return await asyncio.wait_for(self.call(link, p.GetStats), STATS_TIMEOUT_S)
            except asyncio.TimeoutError:
                if link.answering:
                    log.error("worker %d answered nothing for %g s (stuck?): not ready until it does", link.index,
                              STATS_TIMEOUT_S)
                link.answering = False
                return None

        return list(await asyncio.gather(*(one(link) for link in self.links)))

    async def register_lora(self, name: str, path: str) -> AdapterInfo:
        """Register an adapter on every worker (a worker still loading, or restarted later, gets it when it connects);
        undone everywhere if one refuses it. Its description on the first worker."""
        async with self.lora_changes:
            done: list[WorkerLink] = []
            try:
                for link in self.links:
                    if link.ready:
                        done.append(link)
                        described = await self.call(link, lambda cid: p.RegisterLoRA(cid, name, path))
            except PoolError:
                for link in done[:-1]:
                    with contextlib.suppress(PoolError):
                        await self.call(link, lambda cid: p.UnregisterLoRA(cid, name))
                raise
            if not done:
                raise WorkerDiedError("no worker is ready to take the adapter; retry when the pool is ready")
            self.loras[name] = path
            for link in self.links:
                if link.connected and not link.ready:
                    link.send(p.RegisterLoRA(f"{REPLAY}{name}", name, path))
            return described

    async def unregister_lora(self, name: str) -> None:
        """Unregister an adapter on every worker (requests using it finish with it)."""
        async with self.lora_changes:
            known = self.loras.pop(name, None) is not None
            missing = 0
            ready = [link for link in self.links if link.ready]
            for link in ready:
                try:
                    await self.call(link, lambda cid: p.UnregisterLoRA(cid, name))
                except LoRANotFoundError:
                    missing += 1
            if not known and ready and missing == len(ready):
                raise LoRANotFoundError(f"lora_name: no adapter named {name!r}")

    def lease_lora(self, lease: str, name: str | None) -> None:
        """Lease `lease` (a long text's id) binds adapter `name` as registered now on every worker, for the requests
        that carry the lease (`SynthesisRequest.lora_lease`): unregistered meanwhile, or the name registered again, they
        still get it. `name` None ends the lease."""
        path = self.loras.get(name) if name is not None else None
        if name is None:
            self.lora_leases.pop(lease, None)
        else:
            self.lora_leases[lease] = (name, path)
        for link in self.links:
            if link.connected:
                link.send(p.LeaseLoRA(lease, name, path))

    async def list_loras(self) -> list[AdapterInfo]:
        """The adapters a worker holds (every worker holds the same ones)."""
        return await self.call(await self.pick(bounded=False), p.ListLoRAs)

    def add_prompt(self, prompt_id: str, latents: np.ndarray, text: str) -> None:
        self.prompts[prompt_id] = (latents, text)
        for link in self.links:
            if link.connected:
                link.send(p.AddPrompt(prompt_id, latents, text))

    def remove_prompt(self, prompt_id: str) -> bool:
        if self.prompts.pop(prompt_id, None) is None:
            return False
        for link in self.links:
            if link.connected:
                link.send(p.RemovePrompt(prompt_id))
        return True

    async def close(self) -> None:
        """Drop every connection (their requests fail with PoolStoppedError) and stop the encoder threads."""
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            task.cancel()
        for link in self.links:
            conn = link.conn
            link.close_connection()
            if conn is not None:
                self.on_closed(link, conn)
        self.encoders.stop()
