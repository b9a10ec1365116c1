"""The worker process: one LLMEngine on one device, driven over a pipe by the server pool.

Messages in (tuples): ("generate", rid, request dict), ("abort", rid), ("encode_latents", rid, bytes,
format, padding), ("add_prompt", prompt_id, latents float32 bytes, text), ("remove_prompt", prompt_id),
("stats", rid), ("stop",).
Messages out: ("ready", info) or ("fatal", message) once; then ("events", [(rid, audio | None,
finished, error kind | None, error message | None), ...], load snapshot) after engine steps,
and ("reply", rid, value | None, error kind | None, message | None) for the other requests.
The loop never blocks while sequences run; with nothing to do it sleeps in `poll`. Parent gone = exit.
Everything out goes through one sender thread, in order: pickling a step's audio and writing it to
the pipe then overlaps the next step's GPU work instead of delaying its launch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from engine.audio import AudioError, decode_audio, encode_latents
from engine.errors import PromptNotFoundError, RequestError
from engine.llm_engine import EngineConfig, LLMEngine
from engine.prompt import PromptError
from engine.sequence import SamplingParams

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("max_generate_length", "temperature", "cfg_value", "min_len", "seed")


class DeviceLostError(RuntimeError):
    """The worker's device cannot run work any more (a sticky CUDA error): the worker process ends."""


def latents_from(value: Any, feat_dim: int, field: str) -> torch.Tensor:
    """Latents given as float32 bytes, a numpy array or a tensor -> (frames, feat_dim) float32 tensor."""
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw or len(raw) % (4 * feat_dim):
            raise RequestError(f"{field}: float32 bytes must be a positive multiple of 4 * feat_dim = "
                               f"{4 * feat_dim} bytes, got {len(raw)}")
        return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy()).reshape(-1, feat_dim)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu()
    raise RequestError(f"{field} must be float32 bytes, a numpy array or a tensor, got {type(value).__name__}")


class Worker:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.prompts: dict[str, tuple[torch.Tensor, str]] = {}
        self.rid_of: dict[int, str] = {}  # engine seq id -> request id
        self.seq_of: dict[str, int] = {}
        self.steps = 0
        self.step_seconds = 0.0
        # Bounded: when the parent lags, the engine waits here instead of piling audio up in memory.
        self.outbox: queue.Queue[tuple | None] = queue.Queue(maxsize=64)
        self.sender = threading.Thread(target=self._send_loop, name="worker-sender", daemon=True)
        self.sender.start()

    def _send_loop(self) -> None:
        try:
            while (msg := self.outbox.get()) is not None:
                self.conn.send(msg)
        except (EOFError, OSError):  # parent gone: the main loop notices and exits too
            pass
        except BaseException:  # e.g. a message that cannot be pickled: callers would wait forever
            log.critical("worker sender failed, exiting so the pool fails callers and restarts:\n%s",
                         traceback.format_exc())
            os._exit(70)

    def send(self, msg: tuple) -> None:
        self.outbox.put(msg)

    def close(self) -> None:
        """Flush what is queued and stop the sender."""
        self.outbox.put(None)
        self.sender.join(timeout=10)

    def info(self) -> dict[str, Any]:
        m, cfg = self.engine.model, self.engine.config
        return {
            "architecture": m.config.architecture,
            "version": m.config.version,
            "sample_rate": m.vae.out_sample_rate,
            "encoder_sample_rate": m.vae.sample_rate,
            "channels": 1,
            "feat_dim": m.config.feat_dim,
            "patch_size": m.config.patch_size,
            "samples_per_patch": self.engine.runner.samples_per_patch,
            "dtype": str(self.engine.runner.dtype).removeprefix("torch."),
            "device": str(self.engine.device),
            "max_num_seqs": cfg.max_num_seqs,
            "max_model_len": cfg.max_model_len,
            "inference_timesteps": cfg.inference_timesteps,
            "attention_backend": self.engine.runner.backend,
            "cuda_graphs": len(self.engine.runner.graphs),
            "pipelined_decode": self.engine.pipeline,
            "kv_blocks": len(self.engine.blocks.blocks),
            "block_size": cfg.block_size,
            "startup_s": self.engine.startup_s,
            **self.engine.startup_phases,
        }

    def load(self) -> dict[str, int]:
        """The cheap part of stats(), sent with step events."""
        sched, blocks = self.engine.scheduler, self.engine.blocks
        return {"running": len(sched.running), "waiting": len(sched.waiting), "free_blocks": blocks.num_free,
                "total_blocks": len(blocks.blocks)}

    def _send_events(self, events: list[tuple]) -> None:
        # The load snapshot rides along, so the pool knows each worker's load without asking.
        self.send(("events", events, self.load()))

    def stats(self) -> dict[str, Any]:
        return {
            **self.load(),
            "free_slots": len(self.engine.runner.free_slots),
            "preemptions": self.engine.scheduler.num_preemptions,
            "prompts": len(self.prompts),
            "steps": self.steps,
            "step_seconds": self.step_seconds,
        }

    # --- requests -----------------------------------------------------------------------------
    def _add(self, rid: str, req: dict[str, Any]) -> None:
        feat_dim = self.engine.model.config.feat_dim
        prompt_text = req.get("prompt_text") or ""
        prompt_latents = None
        if req.get("prompt_id") is not None:
            if req.get("prompt_latents") is not None:
                raise RequestError("give prompt_id or prompt_latents, not both")
            if req["prompt_id"] not in self.prompts:
                raise PromptNotFoundError(f"prompt_id {req['prompt_id']!r} is not registered")
            prompt_latents, prompt_text = self.prompts[req["prompt_id"]]
        elif req.get("prompt_latents") is not None:
            prompt_latents = latents_from(req["prompt_latents"], feat_dim, "prompt_latents")
        ref = req.get("ref_audio_latents")
        ref_latents = latents_from(ref, feat_dim, "ref_audio_latents") if ref is not None else None
        try:
            params = SamplingParams(**{k: req[k] for k in SAMPLING_FIELDS if req.get(k) is not None})
            params.validate()
            seq_id = self.engine.add_request(str(req.get("target_text", "")), params, prompt_text, prompt_latents,
                                             ref_latents)
        except (ValueError, TypeError, PromptError) as e:
            raise RequestError(str(e)) from e
        self.rid_of[seq_id] = rid
        self.seq_of[rid] = seq_id

    def _encode(self, data: bytes, fmt: str | None, padding: str) -> bytes:
        m = self.engine.model
        try:
            samples, sr = decode_audio(data, fmt)
            lat = encode_latents(m.vae, samples, sr, m.config.patch_size, padding)
        except (AudioError, ValueError) as e:
            raise RequestError(str(e)) from e
        return lat.numpy().astype(np.float32).tobytes()

    def handle(self, msg: tuple) -> bool:
        """Act on one message; False means stop."""
        op = msg[0]
        if op == "stop":
            return False
        if op == "generate":
            rid = msg[1]
            log.debug("generate %s received", rid)
            try:
                self._add(rid, msg[2])
            except RequestError as e:
                self._send_events([(rid, None, True, e.kind, str(e))])
            except Exception as e:  # a bug must fail this request, not the worker
                log.error("adding request failed:\n%s", traceback.format_exc())
                self._send_events([(rid, None, True, "engine", f"{type(e).__name__}: {e}")])
        elif op == "abort":
            seq_id = self.seq_of.pop(msg[1], None)
            if seq_id is not None:
                self.rid_of.pop(seq_id, None)
                self.engine.abort(seq_id)
        elif op == "add_prompt":
            _, prompt_id, raw, text = msg
            try:
                self.prompts[prompt_id] = (latents_from(raw, self.engine.model.config.feat_dim, "latents"), text)
            except RequestError as e:  # the pool checks first; never let a bad prompt end the worker
                log.error("prompt %s not registered: %s", prompt_id, e)
        elif op == "remove_prompt":
            self.prompts.pop(msg[1], None)
        elif op in ("encode_latents", "stats"):
            rid = msg[1]
            try:
                value = self._encode(*msg[2:]) if op == "encode_latents" else self.stats()
                self.send(("reply", rid, value, None, None))
            except RequestError as e:
                self.send(("reply", rid, None, e.kind, str(e)))
            except Exception as e:  # a bug or out of memory (a huge clip) fails this call, not the worker
                log.error("%s failed:\n%s", op, traceback.format_exc())
                self.send(("reply", rid, None, "engine", f"{type(e).__name__}: {e}"))
        else:
            log.error("unknown message %r", op)
        return True

    def step(self) -> None:
        t0 = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception as error:  # a bug or OOM: fail what is running, keep serving (a lost device: exit)
            message = traceback.format_exc()
            log.error("engine step failed:\n%s", message)
            out = []
            for seq_id, rid in list(self.rid_of.items()):
                self.engine.abort(seq_id)
                out.append((rid, None, True, "engine", f"engine step failed: {message.strip().splitlines()[-1]}"))
            self.rid_of.clear()
            self.seq_of.clear()
            self._send_events(out)
            if not self._device_usable():
                raise DeviceLostError(f"{self.engine.device} no longer runs work") from error
            return
        self.steps += 1
        dt = time.perf_counter() - t0
        self.step_seconds += dt
        if log.isEnabledFor(logging.DEBUG):  # the timeline of a burst: arrivals (above), steps, first audio
            log.debug("step %d: %.1f ms, %d events, %d waiting, %d running", self.steps, 1000 * dt, len(events),
                      len(self.engine.scheduler.waiting), len(self.engine.scheduler.running))
        out = []
        for ev in events:
            rid = self.rid_of.get(ev.seq_id)
            if rid is None:
                continue
            if ev.finished:
                self.rid_of.pop(ev.seq_id, None)
                self.seq_of.pop(rid, None)
            if ev.error is not None:
                out.append((rid, None, True, "request", ev.error))
            else:
                out.append((rid, ev.audio, ev.finished, None, None))
        if out or self.steps % 20 == 0:  # with no events, still refresh the load snapshot now and then
            self._send_events(out)

    def _device_usable(self) -> bool:
        """After a failed step: whether the device still runs work. Out of memory passes; a CUDA error such as an
        illegal address, or a layer kernel's trap (engine/triton_layer.py), is sticky: every later call would fail,
        so the worker ends and the pool (the service) restarts it on a fresh CUDA context."""
        device = self.engine.device
        if device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(device)
            return torch.ones(1, device=device).add_(1).item() == 2.0
        except RuntimeError:
            return False

    def run(self) -> None:
        while True:
            timeout = 0 if self.engine.has_unfinished() else None
            while self.conn.poll(timeout):
                if not self.handle(self.conn.recv()):
                    return
                timeout = 0
            if self.engine.has_unfinished():
                self.step()


def worker_main(conn: Connection, model_path: str, device: str, config: dict[str, Any], log_level: int) -> None:
    """Process entry point (spawned)."""
    logging.basicConfig(level=max(log_level, logging.INFO),  # DEBUG only for our loggers, not torch's
                        format=f"%(asctime)s worker[{device}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("engine").setLevel(log_level)
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        engine = LLMEngine(model_path, EngineConfig(**config), device)
        worker = Worker(engine, conn)
        worker.send(("ready", worker.info()))
    except BaseException as e:  # report why instead of dying silently
        log.error("worker failed to start:\n%s", traceback.format_exc())
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    try:
        with contextlib.suppress(EOFError, OSError, KeyboardInterrupt):  # parent gone or interrupted: exit quietly
            worker.run()
    except DeviceLostError:
        log.critical("worker exiting, its device is lost:\n%s", traceback.format_exc())
        raise SystemExit(75) from None  # the pool fails callers at once; the service restarts the worker
    finally:
        worker.close()

