"""One client's connection to one engine worker (`EngineClient` holds one per worker): its state (connected,
ready, answering), its in-flight streams and calls, and its two threads: a sender that writes what one turn of the
client's event loop sent as one message, and a reader that hands the worker's messages back to the client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any, Protocol

from engine.errors import WorkerDiedError
from engine.serving import protocol as p
from engine.serving.reports import WorkerInfo, WorkerLoad
from engine.serving.stream import GenerationStream

log = logging.getLogger(__name__)

_END = object()  # the sender's last item


class LinkOwner(Protocol):
    """What a link needs of its client (`EngineClient`): its event loop, and where the worker's messages go."""

    loop: asyncio.AbstractEventLoop

    def dispatch(self, link: WorkerLink, msg: p.StepEvents) -> None: ...
    def on_message(self, link: WorkerLink, msg: Any) -> None: ...
    def on_closed(self, link: WorkerLink, conn: Connection) -> None: ...


class WorkerLink:
    """This client's connection to one worker."""

    def __init__(self, client: LinkOwner, index: int, address: str) -> None:
        self.client, self.index, self.address = client, index, address
        self.conn: Connection | None = None
        self.connected = False  # the connection is up (not necessarily ready)
        self.ready = False  # Ready received on the current connection
        self.answering = True  # answered its last stats call in time, or sent anything since (`EngineClient.stats`)
        self.down = False  # a connection broke and has not been re-established yet
        self.info: WorkerInfo | None = None  # from its Ready (kept after it goes down: its device names it)
        self.load = WorkerLoad()
        self.streams: dict[str, GenerationStream] = {}
        self.calls: dict[str, asyncio.Future[Any]] = {}
        self.ready_event = asyncio.Event()
        self.stopped_reason: str | None = None  # the worker said Goodbye on this connection
        self.closed_event = asyncio.Event()  # set when the current connection ends
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # The messages this turn of the event loop sends, posted to the sender as one when the turn ends: a burst's
        # requests (their streams resume in one turn after their tokenization) reach the worker in one read.
        self._turn: list[Any] | None = None
        self._turn_lock = threading.Lock()

    def send(self, msg: Any) -> None:
        """Queue `msg` for the worker (from any thread, a finalizer's included; in order with what this process sent
        before it)."""
        if not self.connected:
            raise WorkerDiedError(f"worker {self.index} is not connected")
        # Nothing is allocated under the lock: an allocation may run the garbage collector, whose finalizers (a
        # stream's close) send too, in this thread.
        on_loop, fresh = self._on_loop(), [msg]
        with self._turn_lock:
            if self._turn is not None:  # a turn is being gathered: join it, so nothing overtakes what it holds
                self._turn.append(msg)
                return
            if not on_loop:
                self._outbox.put(msg)
                return
            self._turn = fresh
        self.client.loop.call_soon(self._post_turn)

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.client.loop
        except RuntimeError:  # no loop runs in this thread
            return False

    def _post_turn(self) -> None:
        """The turn's messages to the sender, as one item (under the lock: a send from another thread comes after)."""
        with self._turn_lock:
            if self._turn is not None:
                self._outbox.put(self._turn)
            self._turn = None

    def attach(self, conn: Connection) -> asyncio.Event:
        """Start serving a fresh connection (event loop thread); the event is set when it ends."""
        self.conn, self.connected, self.stopped_reason, self.answering = conn, True, None, True
        self.closed_event = asyncio.Event()
        self._outbox = queue.SimpleQueue()
        threading.Thread(target=self._write, args=(conn, self._outbox), name=f"voxcpm-sender-{self.index}",
                         daemon=True).start()
        threading.Thread(target=self._read, args=(conn,), name=f"voxcpm-reader-{self.index}", daemon=True).start()
        return self.closed_event

    def _write(self, conn: Connection, outbox: queue.SimpleQueue[Any]) -> None:
        while (msg := outbox.get()) is not _END:
            if isinstance(msg, list):  # a turn's messages
                msg = msg[0] if len(msg) == 1 else p.MessageBatch(msg)
            try:
                conn.send(msg)
            except (OSError, ValueError):
                return  # the reader sees the connection close
            if log.isEnabledFor(logging.DEBUG):  # a burst's timeline, with the worker's
                for sent in p.unbatched(msg):
                    if isinstance(sent, p.Generate):
                        log.debug("generate %s sent", sent.request_id)

    def _read(self, conn: Connection) -> None:
        loop, client = self.client.loop, self.client
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError, TypeError):  # TypeError: closed by close_connection() while reading
                break
            try:
                if isinstance(msg, p.StepEvents):
                    client.dispatch(self, msg)
                else:
                    loop.call_soon_threadsafe(client.on_message, self, msg)
            except RuntimeError:  # the loop is closed
                break
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(client.on_closed, self, conn)

    def close_connection(self) -> None:
        self._post_turn()  # this turn's messages are queued before the end (what is not written before the close is
        # lost, as any queued message is: the worker aborts the requests of a connection that went away)
        self._outbox.put(_END)
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
