"""The engine worker: one LLMEngine on one device, serving any number of clients (the process's start-up, which
loads the engine and then runs a `Worker`, is `engine.serving.worker_startup`).

Clients (a library pool, or each of the service's API processes) connect to the worker's Unix socket and
exchange the typed messages of `engine.serving.protocol`; a request's events go back to the client that
sent it, one `StepEvents` message per client per engine step. The process that spawned the worker keeps a
control pipe to it (start-up outcome, Stop, Ping; the pipe closing means the owner is gone and the worker exits).

The loop never blocks while sequences run; with nothing to do it sleeps in `wait`. Sending happens on one
thread per client (pickling a step's audio and writing it overlaps the next step's GPU work); a client that
does not read makes its sender's bounded queue fill up and the engine wait, rather than pile audio up.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

import numpy as np
import torch

from engine.errors import PoolError, PromptNotFoundError, RequestError
from engine.io.audio import AudioError, decode_audio, encode_latents
from engine.io.lora import weights_file
from engine.llm_engine import LLMEngine, StepEvent
from engine.prompt import PromptError, latents_tensor
from engine.serving import protocol as p
from engine.serving.collector import CollectorPauses
from engine.serving.reports import SendWaits, WorkerInfo, WorkerStats, describe
from engine.vocabulary import AdapterInfo

log = logging.getLogger(__name__)

OUTBOX_MESSAGES = 64  # steps of audio a client may fall behind before the engine waits for it
LOAD_REFRESH_STEPS = 20  # with no events for a client, still refresh its load snapshot this often


class DeviceLostError(RuntimeError):
    """The worker's device cannot run work any more (a sticky CUDA error): the worker process ends."""


class ClientLink:
    """The worker's side of one client connection: its sender thread, and the requests it owns."""

    def __init__(self, conn: Connection, index: int, waits: SendWaits) -> None:
        self.conn, self.index, self.waits = conn, index, waits  # waits: the worker's, shared by its links
        self.requests: dict[str, int] = {}  # request id -> engine seq id
        self.pending: list[p.AudioEvent] = []  # this step's events, sent together
        self.steps_since_sent = 0
        self.gone = False  # its connection broke (the main loop drops it)
        self._outbox: queue.Queue[Any] = queue.Queue(maxsize=OUTBOX_MESSAGES)
        self._sender = threading.Thread(target=self._send_loop, name=f"worker-sender-{index}", daemon=True)
        self._sender.start()

    def send(self, msg: Any) -> None:
        self._outbox.put((msg, time.perf_counter()))

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            if self.gone:
                continue  # keep draining, so that a send() waiting on a full queue returns
            msg, queued = item
            try:
                self.conn.send(msg)
            except (EOFError, OSError):
                self.gone = True
                continue
            except BaseException:  # e.g. a message that cannot be pickled: its callers would wait forever
                log.critical("worker sender failed, exiting so callers fail and the worker restarts:\n%s",
                             traceback.format_exc())
                os._exit(70)
            self.waits.add(time.perf_counter() - queued)

    def close(self) -> None:
        """Flush what is queued, stop the sender and close the connection."""
        self._outbox.put(None)
        self._sender.join(timeout=10)
        self.conn.close()


class Acceptor:
    """Accepts client connections on a thread (from before the model loads: a client's authentication handshake
    does not wait for the load) and hands them to the main loop, which watches `wake_fd`."""

    def __init__(self, listener: Listener | None = None) -> None:
        self._new: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        if listener is not None:
            threading.Thread(target=self._accept_loop, args=(listener,), name="worker-accept", daemon=True).start()

    def _accept_loop(self, listener: Listener) -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:  # the listener was closed: the worker is stopping
                return
            except Exception as e:  # a peer that failed the authentication handshake, and the like
                log.warning("refused a connection: %s", e)
                continue
            self.attach(conn)

    def attach(self, conn: Connection) -> None:
        """Hand a client connection to the main loop (from any thread)."""
        self._new.put(conn)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def take(self) -> list[Connection]:
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self.wake_fd, 4096)
        out = []
        while not self._new.empty():  # the main loop is the one consumer: not empty means the get succeeds
            out.append(self._new.get_nowait())
        return out


@dataclass
class RegisteredPrompt:
    latents: torch.Tensor
    text: str
    owners: set[int] = field(default_factory=set)  # client links that registered it (ids are content hashes)


class Worker:
    def __init__(self, engine: LLMEngine, control: Connection | None = None, info: WorkerInfo | None = None,
                 acceptor: Acceptor | None = None) -> None:
        self.engine = engine
        self.control = control
        self.info = info or describe(engine)
        self.acceptor = acceptor or Acceptor()
        self.links: dict[int, ClientLink] = {}
        self.owner: dict[int, tuple[ClientLink, str]] = {}  # engine seq id -> (client, request id)
        self.latents_wanted: set[int] = set()  # seq ids whose events carry their patches' latents
        self.prompts: dict[str, RegisteredPrompt] = {}
        self.encodes: deque[tuple[ClientLink, p.EncodeLatents]] = deque()  # clips to encode, one between two steps
        self.steps = 0
        self.step_seconds = 0.0
        self.send_waits = SendWaits()
        self.collector = CollectorPauses()  # the garbage collector's pauses of this process, from here on
        self._link_ids = 0

    # --- connections ------------------------------------------------------------------------------
    def _take_new_links(self) -> None:
        for conn in self.acceptor.take():
            self._link_ids += 1
            link = self.links[self._link_ids] = ClientLink(conn, self._link_ids, self.send_waits)
            link.send(p.Ready(self.info))

    def drop(self, link: ClientLink) -> None:
        """A client went away: its requests are aborted, its prompts released, its adapter leases ended."""
        self.links.pop(link.index, None)
        for seq_id in list(link.requests.values()):
            self._abort(seq_id)
        for pid in [pid for pid, pr in self.prompts.items() if link.index in pr.owners]:
            self._release_prompt(pid, link)
        self.engine.end_lora_leases(link.index)
        link.close()

    def _release_prompt(self, prompt_id: str, link: ClientLink) -> None:
        pr = self.prompts.get(prompt_id)
        if pr is not None:
            pr.owners.discard(link.index)
            if not pr.owners:
                del self.prompts[prompt_id]

    # --- requests ---------------------------------------------------------------------------------
    def _abort(self, seq_id: int) -> tuple[ClientLink, str] | None:
        """Abort a request (its KV blocks and slot freed now) and forget it; whose it was (client, request id)."""
        owner = self.owner.pop(seq_id, None)
        self.latents_wanted.discard(seq_id)
        self.engine.abort(seq_id)
        if owner is not None:
            owner[0].requests.pop(owner[1], None)
        return owner

    def _add(self, link: ClientLink, rid: str, req: p.SynthesisRequest) -> None:
        feat_dim = self.engine.model.config.feat_dim
        prompt_text = req.prompt_text or ""
        prompt_latents = latents_tensor(req.prompt_latents, feat_dim, "prompt_latents")
        if req.prompt_id is not None:
            if prompt_latents is not None:
                raise RequestError("prompt_id: give prompt_id or prompt_latents, not both")
            pr = self.prompts.get(req.prompt_id)
            if pr is None:
                raise PromptNotFoundError(f"prompt_id {req.prompt_id!r} is not registered")
            prompt_latents, prompt_text = pr.latents, pr.text
        ref_latents = latents_tensor(req.ref_latents, feat_dim, "ref_audio_latents")
        try:  # add_request validates the params
            seq_id = self.engine.add_request(req.target_text, req.params, prompt_text, prompt_latents, ref_latents,
                                             lora_name=req.lora_name,
                                             text_ids=req.text_ids if req.prompt_id is None else None,
                                             continuation=req.continuation,
                                             lora_lease=(link.index, req.lora_lease) if req.lora_lease else None)
        except PoolError:
            raise  # a kind of its own: an unknown adapter (404), every adapter slot held (503)
        except (ValueError, TypeError, PromptError) as e:
            raise RequestError(str(e)) from e
        link.requests[rid] = seq_id
        self.owner[seq_id] = (link, rid)
        if req.return_latents:
            self.latents_wanted.add(seq_id)

    def handle(self, link: ClientLink, msg: Any) -> None:
        """Act on one client message."""
        if isinstance(msg, p.Generate):
            log.debug("generate %s received", msg.request_id)
            try:
                self._add(link, msg.request_id, msg.request)
            except PoolError as e:
                self._fail_now(link, msg.request_id, p.ErrorInfo(e.kind, str(e)))
            except Exception as e:  # a bug must fail this request, not the worker
                log.error("adding request failed:\n%s", traceback.format_exc())
                self._fail_now(link, msg.request_id, p.ErrorInfo("engine", f"{type(e).__name__}: {e}"))
        elif isinstance(msg, p.Abort):
            if (seq_id := link.requests.get(msg.request_id)) is not None:
                self._abort(seq_id)
        elif isinstance(msg, p.AddPrompt):
            try:
                latents = latents_tensor(msg.latents, self.engine.model.config.feat_dim, "latents")
            except RequestError as e:  # the client checks first; never let a bad prompt end the worker
                log.error("prompt %s not registered: %s", msg.prompt_id, e)
                return
            pr = self.prompts.setdefault(msg.prompt_id, RegisteredPrompt(latents, msg.text))
            pr.owners.add(link.index)
        elif isinstance(msg, p.RemovePrompt):
            self._release_prompt(msg.prompt_id, link)
        elif isinstance(msg, p.LeaseLoRA):
            try:
                self.engine.lease_lora(link.index, msg.lease, msg.name, msg.path)
            except (OSError, ValueError) as e:  # the adapter's file gone or bad: its segments fail as unknown
                log.error("lease %s on adapter %s not taken: %s", msg.lease, msg.name, e)
        elif isinstance(msg, p.EncodeLatents):  # one between two steps: a burst of uploads stalled every stream
            self.encodes.append((link, msg))
        elif isinstance(msg, p.Call):
            self._answer(link, msg)
        else:
            log.error("unknown message %r", type(msg).__name__)

    def _answer(self, link: ClientLink, msg: p.Call) -> None:
        try:
            link.send(p.Reply(msg.call_id, getattr(self, msg.method)(msg)))
        except PoolError as e:
            link.send(p.Reply(msg.call_id, error=p.ErrorInfo(e.kind, str(e))))
        except Exception as e:  # a bug or out of memory (a huge clip) fails this call, not the worker
            log.error("%s failed:\n%s", type(msg).__name__, traceback.format_exc())
            link.send(p.Reply(msg.call_id, error=p.ErrorInfo("engine", f"{type(e).__name__}: {e}")))

    # --- calls (p.Call.method names them; each answers its message with the value its Call type declares) ----------
    def encode_latents(self, msg: p.EncodeLatents) -> np.ndarray:
        m = self.engine.model
        try:
            samples, sr = decode_audio(msg.wav, msg.wav_format)
            lat = encode_latents(m.vae, samples, sr, m.config.patch_size, msg.padding)
        except (AudioError, ValueError) as e:
            raise RequestError(str(e)) from e
        return lat.numpy().astype(np.float32)

    def list_loras(self, msg: p.ListLoRAs) -> list[AdapterInfo]:
        return self.engine.list_loras()

    def unregister_lora(self, msg: p.UnregisterLoRA) -> None:
        with adapter_errors():
            self.engine.unregister_lora(msg.name)

    def register_lora(self, msg: p.RegisterLoRA) -> AdapterInfo:
        with adapter_errors():
            known = {a.name: a for a in self.engine.list_loras()}.get(msg.name)
            if known is not None and known.source == str(weights_file(msg.path)):
                return known  # the same adapter again (a client's replay): already there
            return self.engine.register_lora(msg.name, msg.path)

    def _fail_now(self, link: ClientLink, rid: str, error: p.ErrorInfo) -> None:
        link.send(p.StepEvents([p.AudioEvent(rid, None, True, "error", error)], self.load()))

    # --- state --------------------------------------------------------------------------------------
    def load(self) -> p.WorkerLoad:
        """The cheap part of stats(), sent with step events."""
        sched, blocks = self.engine.scheduler, self.engine.blocks
        return p.WorkerLoad(len(sched.running), len(sched.waiting), blocks.num_free, len(blocks.blocks))

    def stats(self, msg: p.GetStats | None = None) -> WorkerStats:
        return WorkerStats(**vars(self.load()), free_slots=len(self.engine.runner.free_slots),
                           total_slots=self.engine.runner.max_num_seqs,
                           preemptions=self.engine.scheduler.num_preemptions, prompts=len(self.prompts),
                           clients=len(self.links), steps=self.steps, step_seconds=self.step_seconds,
                           messages_sent=self.send_waits.messages, send_seconds=self.send_waits.seconds,
                           gc_collections=self.collector.collections, gc_seconds=self.collector.seconds,
                           gc_longest_s=self.collector.longest_s, gc_frozen_objects=gc.get_freeze_count(),
                           loras=self.engine.list_loras())

    # --- the loop -----------------------------------------------------------------------------------
    def step(self) -> None:
        t0 = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception as error:  # a bug or OOM: fail what is running, keep serving (a lost device: exit)
            message = traceback.format_exc()
            log.error("engine step failed:\n%s", message)
            info = p.ErrorInfo("engine", f"engine step failed: {message.strip().splitlines()[-1]}")
            rejected, queued = self.engine.after_failed_step()
            for ev in rejected:  # refused in that step: their own reasons, not the step's
                self._route(ev)
            for seq_id, (link, rid) in [(i, owner) for i, owner in self.owner.items() if i not in queued]:
                self._abort(seq_id)
                link.pending.append(p.AudioEvent(rid, None, True, "error", info))
            self._flush(force=True)
            if not self._device_usable():
                raise DeviceLostError(f"{self.engine.device} no longer runs work") from error
            return
        self.steps += 1
        dt = time.perf_counter() - t0
        self.step_seconds += dt
        if log.isEnabledFor(logging.DEBUG):  # the timeline of a burst: arrivals (above), steps, first audio
            log.debug("step %d: %.1f ms, %d events, %d waiting, %d running", self.steps, 1000 * dt, len(events),
                      len(self.engine.scheduler.waiting), len(self.engine.scheduler.running))
        for ev in events:
            self._route(ev)
        self._flush()

    def _route(self, ev: StepEvent) -> None:
        owner = self.owner.get(ev.seq_id)
        if owner is None:
            return
        link, rid = owner
        latents = ev.patch.float().numpy() if ev.patch is not None and ev.seq_id in self.latents_wanted else None
        if ev.finished:
            del self.owner[ev.seq_id]
            self.latents_wanted.discard(ev.seq_id)
            link.requests.pop(rid, None)
        if ev.error is not None:
            link.pending.append(p.AudioEvent(rid, None, True, "error", p.ErrorInfo(ev.error_kind, ev.error)))
        else:
            link.pending.append(p.AudioEvent(rid, ev.audio, ev.finished, ev.finish_reason, latents=latents))

    def _flush(self, force: bool = False) -> None:
        """One message per client with this step's events (the load snapshot rides along)."""
        load = None
        for link in self.links.values():
            link.steps_since_sent += 1
            if link.pending or force or link.steps_since_sent >= LOAD_REFRESH_STEPS:
                load = load or self.load()
                link.send(p.StepEvents(link.pending, load))
                link.pending = []
                link.steps_since_sent = 0

    def expire_waiting(self) -> None:
        """Fail the new requests still waiting for a seat past the queue timeout (their clients answer 503)."""
        limit, waiting = self.engine.config.queue_timeout_s, self.engine.scheduler.waiting
        if limit is None or not waiting:
            return
        now = time.monotonic()
        expired = [s for s in waiting if not s.ahead_of_new and now - s.arrival > limit]
        for seq in expired:
            if (owner := self._abort(seq.seq_id)) is not None:
                link, rid = owner
                link.pending.append(p.AudioEvent(rid, None, True, "error", p.ErrorInfo(
                    "overloaded", f"waited {now - seq.arrival:.1f} s for a seat (queue timeout {limit:g} s)")))
        if expired:
            log.warning("%d request(s) waited past the queue timeout: failed", len(expired))
            self._flush()

    def _device_usable(self) -> bool:
        """After a failed step: whether the device still runs work. Out of memory passes; a CUDA error such as an
        illegal address, or a layer kernel's trap (engine/ops/layer_stack.py), is sticky: every later call would fail,
        so the worker ends and its owner restarts it on a fresh CUDA context."""
        device = self.engine.device
        if device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(device)
            return torch.ones(1, device=device).add_(1).item() == 2.0
        except RuntimeError:
            return False

    def _read(self, link: ClientLink) -> None:
        try:
            while link.conn.poll(0):
                msg = link.conn.recv()
                for one in p.unbatched(msg):
                    self.handle(link, one)
        except (EOFError, OSError):
            link.gone = True
        if link.gone:
            self.drop(link)

    def run(self) -> None:
        """Serve until Stop arrives or the owner goes away."""
        self._take_new_links()
        while True:
            timeout = 0 if self.engine.has_work() or self.encodes else self.engine.idle_wait()
            watched: list[Any] = [self.acceptor.wake_fd, *(link.conn for link in self.links.values())]
            if self.control is not None:
                watched.append(self.control)
            by_conn = {link.conn: link for link in self.links.values()}
            for ready in wait(watched, timeout):
                if ready is self.control:
                    try:
                        msg = self.control.recv()
                    except (EOFError, OSError):
                        msg = p.Stop()  # the owner is gone
                    if isinstance(msg, p.Stop):
                        return
                    if isinstance(msg, p.Ping):
                        self.control.send(p.Pong())
                elif ready == self.acceptor.wake_fd:
                    self._take_new_links()
                else:
                    self._read(by_conn[ready])
            for link in [lk for lk in self.links.values() if lk.gone]:
                self.drop(link)
            self.expire_waiting()
            if self.engine.has_work():
                self.step()
            if self.encodes and not (encode := self.encodes.popleft())[0].gone:
                self._answer(*encode)

    def close(self, goodbye: str | None = "the worker is stopping") -> None:
        """Flush what is queued and close every client connection; with `goodbye`, first tell the clients that the
        stop is deliberate (their callers get PoolStoppedError rather than WorkerDiedError)."""
        for link in list(self.links.values()):
            if goodbye is not None:
                link.send(p.Goodbye(goodbye))
            link.close()
        self.links.clear()
        self.collector.close()


@contextlib.contextmanager
def adapter_errors() -> Iterator[None]:
    """A LoRAError (a ValueError naming the adapter or its name) is the caller's: a RequestError; PoolErrors pass."""
    try:
        yield
    except PoolError:
        raise
    except ValueError as e:
        raise RequestError(str(e)) from e
