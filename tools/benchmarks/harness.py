"""The benchmarks' shared harness (the subcommands of tools/bench.py): targets, measurement, workloads,
environment facts, output.

Two targets with one interface:
- PoolTarget: the engine pool in this process (`engine.VoxCPM.from_pretrained`, or nano-vllm-voxcpm's);
- HttpTarget: a running voxcpm-serve over HTTP (httpx streaming; /generate as raw PCM or MP3, whose
  durations are read from the MP3 frame headers; /generate_blocking).
Both give `stream(req)` (an async iterator of (arrival perf_counter time, audio seconds) per piece that
arrives), `blocking(req)` ((ttfb, wall, audio seconds) measured from the call) and `voice(kind)` (register a
clip as a continuation prompt / reference / HiFi bundle, or encode it to inline latents).

Metrics (the protocol of shared/bench): TTFB = submit -> first audio; RTF = wall / audio seconds;
underruns = gaps heard by a listener who starts at the first piece and plays everything back to back;
throughput = audio seconds generated / wall seconds (per burst, or inside a time window for the
duration-based workloads); GPU memory = nvidia-smi's memory.used, sampled outside the timed regions.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import importlib.metadata
import inspect
import io
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import wave
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
BENCH = "tools/bench.py"  # the entry point, as a result's "command" names it

# The protocol's text: ~80 English words, long enough for 100 patches (16 s at 48 kHz).
TEXT = (
    "Streaming speech synthesis has to start talking almost at once and then keep ahead of the "
    "listener for as long as the sentence lasts. A production service also has to do this for many "
    "people at the same time, on one graphics card, without a single gap in the audio. This paragraph "
    "is long enough to keep the model busy for several seconds, which makes the measurement of the "
    "real time factor stable, and short enough that a whole run of the benchmark finishes quickly."
)
# HiFi mode: the transcript given with the synthetic 5 s clip (the same string as the anchor run).
CLIP_TEXT = "This is a five second reference clip used for cloning."
CFG_VALUE = 2.0
TEMPERATURE = 1.0
GAP_TOLERANCE_S = 1e-3
VOICE_KINDS = ("zeroshot", "latents", "prompt", "reference", "hifi")


# ---------------------------------------------------------------- measurement


def count_underruns(arrivals: list[float], durations: list[float]) -> tuple[int, float]:
    """Gaps heard by a listener who starts at the first chunk and plays every chunk back to back.
    Returns (number of gaps, total silent seconds)."""
    if not arrivals:
        return 0, 0.0
    play_end = arrivals[0]  # when the buffered audio runs out
    gaps, silent = 0, 0.0
    for at, dur in zip(arrivals, durations, strict=True):
        if at > play_end + GAP_TOLERANCE_S:
            gaps += 1
            silent += at - play_end
            play_end = at  # playback resumes when the late chunk lands
        play_end += dur
    return gaps, silent


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else None


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def chunk_samples(chunk: Any, channels: int) -> int:
    # Chunks are 1-D float32 arrays; a multi-channel chunk counts frames, not samples.
    return int(np.asarray(chunk).size) // max(channels, 1)


def request_record(arrivals: list[float], durations: list[float], start: float = 0.0) -> dict[str, Any]:
    """One request's measurements from its pieces' arrival times (relative to the run's clock, the request
    submitted at `start`) and audio seconds."""
    if not arrivals:
        raise RuntimeError("request produced no audio")
    audio_s = sum(durations)
    gaps, gap_s = count_underruns(arrivals, durations)
    wall = arrivals[-1] - start
    return {"start": start, "ttfb": arrivals[0] - start, "wall": wall, "audio_s": audio_s,
            "rtf": wall / audio_s if audio_s > 0 else None, "gaps": gaps, "gap_s": gap_s, "chunks": len(arrivals),
            "arrivals": arrivals, "durations": durations}


def request_stats(reqs: list[dict[str, Any]], errors: list[str]) -> dict[str, Any]:
    """The per-request part of a result row (the keys of the stream benchmark's rows, in its order)."""
    ttfb = [r["ttfb"] for r in reqs]
    rtf = [r["rtf"] for r in reqs if r["rtf"] is not None]
    return {
        "requests": len(reqs),
        "failed": len(errors),
        "errors": errors[:5],
        "ttfb_p50": percentile(ttfb, 50),
        "ttfb_p95": percentile(ttfb, 95),
        "ttfb_p99": percentile(ttfb, 99),
        "rtf_mean": mean(rtf),
        "rtf_p95": percentile(rtf, 95),
        "wall_mean": mean([r["wall"] for r in reqs]),
        "audio_s_mean": mean([r["audio_s"] for r in reqs]),
        "chunks_mean": mean([r["chunks"] for r in reqs]),
        "streams_with_underrun": sum(1 for r in reqs if r["gaps"] > 0),
        "underrun_gaps_total": sum(r["gaps"] for r in reqs),
        "underrun_s_total": sum(r["gap_s"] for r in reqs),
    }


def audio_in_window(reqs: Iterable[dict[str, Any]], t_from: float, t_to: float) -> float:
    """Audio seconds whose pieces arrived in [t_from, t_to] (steady-state throughput of a time window)."""
    return sum(d for r in reqs for at, d in zip(r["arrivals"], r["durations"], strict=True) if t_from <= at <= t_to)


def errors_of(outs: Iterable[Any]) -> list[str]:
    return [f"{type(o).__name__}: {o}" for o in outs if isinstance(o, BaseException)]


# ---------------------------------------------------------------- MP3 frame headers

_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by version bits
_L3_KBPS = {3: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
            2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)}


def mp3_frame(header: bytes) -> tuple[int, int, int] | None:
    """(frame bytes, samples, sample rate) of an MPEG audio layer III frame header, None if not one."""
    if len(header) < 4 or header[0] != 0xFF or header[1] & 0xE0 != 0xE0:
        return None
    version, layer = (header[1] >> 3) & 3, (header[1] >> 1) & 3
    br_index, sr_index, padding = header[2] >> 4, (header[2] >> 2) & 3, (header[2] >> 1) & 1
    if version == 1 or layer != 1 or br_index in (0, 15) or sr_index == 3:
        return None
    sr = _MP3_RATES[version][sr_index]
    kbps = _L3_KBPS[3 if version == 3 else 2][br_index]
    per_frame = 1152 if version == 3 else 576
    return per_frame // 8 * kbps * 1000 // sr + padding, per_frame, sr


class Mp3Counter:
    """Audio seconds in an MP3 byte stream fed piece by piece (complete frames only; a frame split across
    pieces counts when its last byte arrives). A LAME/Xing info frame carries no audio and is skipped."""

    def __init__(self) -> None:
        self.buf = b""
        self.first = True

    def feed(self, data: bytes) -> float:
        self.buf += data
        seconds, pos = 0.0, 0
        if self.first and self.buf.startswith(b"ID3"):
            if len(self.buf) < 10:
                return 0.0
            size = 10 + sum((b & 0x7F) << (7 * (3 - i)) for i, b in enumerate(self.buf[6:10]))
            if len(self.buf) < size:
                return 0.0
            pos = size
        while len(self.buf) - pos >= 4:
            frame = mp3_frame(self.buf[pos:pos + 4])
            if frame is None:
                pos += 1  # resynchronise on the next sync word
                continue
            size, samples, sr = frame
            if len(self.buf) - pos < size:
                break
            body = self.buf[pos:pos + size]
            if not (self.first and (b"Xing" in body[:64] or b"Info" in body[:64])):
                seconds += samples / sr
            self.first = False
            pos += size
        self.buf = self.buf[pos:]
        return seconds


# ---------------------------------------------------------------- environment facts


def gpu_index(devices: list[int | str]) -> int | None:
    """The first pool device as a GPU index (for nvidia-smi), None when the pool runs on the CPU."""
    for d in devices:
        if isinstance(d, int):
            return d
        if d.startswith("cuda"):
            return int(d.partition(":")[2] or 0)
    return None


def nvidia_smi(query: str, device: int | None) -> str | None:
    if device is None or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", str(device)],
                             capture_output=True, text=True, timeout=15, check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return None
    return out.splitlines()[0].strip() if out else None


def gpu_mem_used_mib(device: int | None) -> int | None:
    # The model lives in worker processes, so the parent's torch.cuda counters would read zero.
    v = nvidia_smi("memory.used", device)
    try:
        return int(float(v)) if v is not None else None
    except ValueError:
        return None


def engine_version(engine: str) -> str | None:
    if engine == "nanovllm":
        try:
            return importlib.metadata.version("nano-vllm-voxcpm")
        except importlib.metadata.PackageNotFoundError:
            return None
    version = None
    try:
        version = importlib.metadata.version("voxcpm-serve")
    except importlib.metadata.PackageNotFoundError:
        try:  # a plain checkout (the GPU machine): the version from pyproject.toml
            import tomllib

            version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
        except (ImportError, OSError, KeyError):
            pass
    try:  # VOXCPM_COMMIT: set by whoever copied the tree to a machine without its .git (or with a stale one)
        sha = os.environ.get("VOXCPM_COMMIT") or subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
            check=True).stdout.strip()
        version = f"{version}+g{sha}" if version else f"g{sha}"
    except (subprocess.SubprocessError, OSError):
        pass  # the GPU machine's copy of the tree has no .git
    return version


def torch_facts(device: int | None, touch_cuda: bool) -> dict[str, Any]:
    """torch version and GPU name. CUDA is touched only once the pool has stopped (touch_cuda): a CUDA
    context in the parent would show up in the nvidia-smi memory readings."""
    facts: dict[str, Any] = {"torch": None, "gpu_name": nvidia_smi("name", device)}
    try:
        import torch
    except ImportError:
        return facts
    facts["torch"] = torch.__version__
    if touch_cuda and device is not None:
        try:
            if torch.cuda.is_available():
                facts["gpu_name"] = torch.cuda.get_device_name(device)
        except RuntimeError:
            pass
    return facts


# ---------------------------------------------------------------- synthetic clips


def synthetic_clip_wav(seconds: float = 5.0, sr: int = 16000, seed: int = 0) -> bytes:
    """A voiced-ish signal: a tone (150 Hz for seed 0, another pitch and noise per seed) with a slow
    tremolo and light noise, as 16-bit mono WAV (written with the stdlib so the benchmark needs no
    soundfile)."""
    t = np.arange(int(seconds * sr), dtype=np.float64) / sr
    tremolo = 1.0 + 0.5 * np.sin(2 * np.pi * 4.0 * t)
    x = 0.3 * tremolo * np.sin(2 * np.pi * (150.0 + 7.0 * seed) * t)
    x += 0.02 * np.random.default_rng(seed).standard_normal(t.size)
    pcm = (np.clip(x, -1.0, 1.0) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


# ---------------------------------------------------------------- requests and targets


@dataclass
class Req:
    """One generation: text, patch count, conditioning (from `Target.voice`, target-specific fields)."""

    text: str = TEXT
    patches: int = 100
    voice: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None


Piece = tuple[float, float]  # (arrival perf_counter time, audio seconds)


class Target:
    """What the workloads drive. Subclasses: PoolTarget, HttpTarget."""

    name = "?"
    sample_rate = 0
    channels = 1
    gpu: int | None = None  # GPU index for nvidia-smi readings
    facts: dict[str, Any]

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    def stream(self, req: Req) -> AsyncIterator[Piece]:
        raise NotImplementedError

    async def blocking(self, req: Req) -> tuple[float, float, float]:
        """(ttfb, wall, audio seconds) from the call: the whole utterance in one response."""
        raise NotImplementedError

    async def voice(self, kind: str, clip: bytes, clip_text: str = CLIP_TEXT) -> dict[str, Any]:
        """Register (or encode) a clip; returns the conditioning fields for Req.voice. kinds: zeroshot,
        latents (inline prompt latents, no cache), prompt, reference, hifi (prompt + reference)."""
        raise NotImplementedError

    async def queue_depth(self) -> int | None:
        """Requests waiting (not yet decoding), where the target can tell cheaply."""
        return None


CLIENT_LOG_HANDLER = "voxcpm-bench-client"


def log_client_handoffs() -> None:
    """With VOXCPM_LOG_LEVEL=DEBUG (the workers then log each arrival and step), this process's engine client logs when
    each request goes to its worker and when it was sent, as a service's API processes do: `profiler.py timeline` reads
    the three together (stderr, labelled `client`)."""
    import logging

    from engine.options import current
    from engine.serving.processes import worker_log_level

    logger = logging.getLogger("engine.serving")
    if worker_log_level(current()) > logging.DEBUG or any(h.name == CLIENT_LOG_HANDLER for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.name = CLIENT_LOG_HANDLER
    handler.setFormatter(logging.Formatter("%(asctime)s client %(levelname)s %(name)s: %(message)s"))
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)


class PoolTarget(Target):
    name = "pool"

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.engine = getattr(a, "engine", "voxcpm-serve")
        self.gpu = gpu_index(a.devices)
        self.pool: Any = None
        self.prompt_ids: list[str] = []
        self.facts = {}

    async def start(self) -> None:
        a = self.a
        if self.engine == "nanovllm":
            from nanovllm_voxcpm import VoxCPM
        else:
            from engine import VoxCPM
            log_client_handoffs()
        self.pool = VoxCPM.from_pretrained(
            model=a.model, devices=a.devices, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
            max_num_batched_tokens=a.max_num_batched_tokens, gpu_memory_utilization=a.gpu_memory_utilization,
            enforce_eager=a.enforce_eager, inference_timesteps=a.inference_timesteps, **a.pool_kwargs)
        await self.pool.wait_for_ready()
        info = await self.pool.get_model_info()
        self.sample_rate, self.channels = int(info["sample_rate"]), int(info.get("channels", 1) or 1)
        self.facts = {"model": a.model, "engine": self.engine, "model_info": _plain_info(info),
                      "pool": {"max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len,
                               "max_num_batched_tokens": a.max_num_batched_tokens,
                               "gpu_memory_utilization": a.gpu_memory_utilization,
                               "enforce_eager": a.enforce_eager, "inference_timesteps": a.inference_timesteps,
                               "devices": a.devices, **a.pool_kwargs}}

    async def stop(self) -> None:
        if self.pool is not None:
            for pid in self.prompt_ids:
                with contextlib.suppress(Exception):
                    await self.pool.remove_prompt(pid)
            await self.pool.stop()

    async def stream(self, req: Req) -> AsyncIterator[Piece]:  # type: ignore[override]
        agen = self.pool.generate(target_text=req.text, max_generate_length=req.patches, cfg_value=CFG_VALUE,
                                  temperature=TEMPERATURE, **({"seed": req.seed} if req.seed is not None else {}),
                                  **req.voice)
        try:
            async for chunk in agen:
                yield time.perf_counter(), chunk_samples(chunk, self.channels) / self.sample_rate
        finally:
            await agen.aclose()

    async def blocking(self, req: Req) -> tuple[float, float, float]:
        # In process the whole utterance is in hand when its last chunk is: TTFB = wall.
        t0 = time.perf_counter()
        audio = sum([d async for _, d in self.stream(req)])
        wall = time.perf_counter() - t0
        return wall, wall, audio

    async def voice(self, kind: str, clip: bytes, clip_text: str = CLIP_TEXT) -> dict[str, Any]:
        if kind == "zeroshot":
            return {}
        if kind == "latents":
            return {"prompt_latents": await self.pool.encode_latents(clip, "wav"), "prompt_text": clip_text}
        out: dict[str, Any] = {}
        if kind in ("prompt", "hifi"):
            pid = await self.pool.add_prompt(clip, "wav", clip_text)
            self.prompt_ids.append(pid)
            out["prompt_id"] = pid
        if kind in ("reference", "hifi"):
            # the pool keeps no reference cache: the latents travel with each request (the service caches them)
            padding = {"padding": "right"} if self.engine == "voxcpm-serve" else {}
            out["ref_audio_latents"] = await self.pool.encode_latents(clip, "wav", **padding)
        if not out:
            raise ValueError(f"unknown voice kind {kind!r} (known: {', '.join(VOICE_KINDS)})")
        return out

    async def queue_depth(self) -> int | None:
        snap = getattr(self.pool, "snapshot", None)
        if snap is None:
            return None
        return sum(int(w.get("waiting", 0)) for w in snap())


def _plain_info(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if isinstance(v, str | int | float | bool | list | dict) or v is None}


class HttpTarget(Target):
    name = "http"

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.url = a.url.rstrip("/")
        self.fmt = a.format
        self.gpu = a.gpu_index
        self.client: Any = None
        self.created: list[tuple[str, str]] = []  # (route prefix, id) to delete at the end
        self.facts = {}

    async def start(self) -> None:
        import httpx

        self.client = httpx.AsyncClient(
            base_url=self.url, timeout=httpx.Timeout(connect=30.0, read=self.a.http_timeout, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        deadline = time.monotonic() + self.a.ready_timeout
        while True:
            try:
                if (await self.client.get("/ready")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.url}/ready did not answer 200 within {self.a.ready_timeout:.0f} s")
            await asyncio.sleep(0.25)
        info = (await self.client.get("/info")).json()
        model = info.get("model", {})
        self.sample_rate, self.channels = int(model["sample_rate"]), int(model.get("channels", 1) or 1)
        self.facts = {"url": self.url, "format": self.fmt, "model_info": _plain_info(model),
                      "service": {k: info.get(k) for k in ("mp3", "queue_coalesce_ms")}}

    async def stop(self) -> None:
        if self.client is None:
            return
        for route, vid in self.created:
            with contextlib.suppress(Exception):
                await self.client.delete(f"{route}/{vid}")
        await self.client.aclose()

    def _body(self, req: Req) -> dict[str, Any]:
        body = {"target_text": req.text, "max_generate_length": req.patches, "cfg_value": CFG_VALUE,
                "temperature": TEMPERATURE, "response_format": self.fmt, **req.voice}
        if req.seed is not None:
            body["seed"] = req.seed
        return body

    def _counter(self) -> Callable[[bytes], float]:
        if self.fmt == "mp3":
            return Mp3Counter().feed
        frame = 2 * self.channels  # s16le
        held = [0]

        def pcm(data: bytes) -> float:  # a network piece may end mid-sample: count whole frames only
            held[0] += len(data)
            n, held[0] = divmod(held[0], frame)
            return n / self.sample_rate

        return pcm

    async def stream(self, req: Req) -> AsyncIterator[Piece]:  # type: ignore[override]
        count = self._counter()
        async with self.client.stream("POST", "/generate", json=self._body(req)) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
            async for data in r.aiter_raw():
                seconds = count(data)
                if seconds > 0:
                    yield time.perf_counter(), seconds

    async def blocking(self, req: Req) -> tuple[float, float, float]:
        count = self._counter()
        t0 = time.perf_counter()
        ttfb, audio = None, 0.0
        async with self.client.stream("POST", "/generate_blocking", json=self._body(req)) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
            async for data in r.aiter_raw():
                if ttfb is None and data:
                    ttfb = time.perf_counter() - t0
                audio += count(data)
        wall = time.perf_counter() - t0
        if ttfb is None or audio <= 0:
            raise RuntimeError("response carried no audio")
        return ttfb, wall, audio

    async def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self.client.post(route, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{route}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    async def voice(self, kind: str, clip: bytes, clip_text: str = CLIP_TEXT) -> dict[str, Any]:
        b64 = base64.b64encode(clip).decode()
        if kind == "zeroshot":
            return {}
        if kind == "latents":
            lat = await self._post("/encode_latents", {"wav_base64": b64, "wav_format": "wav"})
            return {"prompt_latents_base64": lat["prompt_latents_base64"], "prompt_text": clip_text}
        if kind == "prompt":
            pid = (await self._post("/add_prompt", {"wav_base64": b64, "prompt_text": clip_text}))["prompt_id"]
            self.created.append(("/prompts", pid))
            return {"prompt_id": pid}
        if kind == "reference":
            rid = (await self._post("/add_reference", {"wav_base64": b64}))["reference_id"]
            self.created.append(("/references", rid))
            return {"ref_audio_id": rid}
        if kind == "hifi":
            out = await self._post("/add_hifi", {"wav_base64": b64, "prompt_text": clip_text})
            self.created += [("/hifi", out["hifi_id"]), ("/prompts", out["prompt_id"]),
                             ("/references", out["reference_id"])]
            return {"hifi_id": out["hifi_id"]}
        raise ValueError(f"unknown voice kind {kind!r} (known: {', '.join(VOICE_KINDS)})")

    async def queue_depth(self) -> int | None:
        try:
            text = (await self.client.get("/metrics")).text
        except Exception:
            return None
        for line in text.splitlines():
            if line.startswith("voxcpm_queue_depth"):
                return int(float(line.split()[-1]))
        return None


def make_target(a: argparse.Namespace) -> Target:
    return HttpTarget(a) if a.target == "http" else PoolTarget(a)


# ---------------------------------------------------------------- workloads


async def timed_stream(target: Target, req: Req, t0: float, start: float = 0.0) -> dict[str, Any]:
    """Stream one request; times are relative to t0 (the run's clock), the request submitted at `start`."""
    arrivals: list[float] = []
    durations: list[float] = []
    async for at, seconds in target.stream(req):
        arrivals.append(at - t0)
        durations.append(seconds)
    return request_record(arrivals, durations, start)


async def timed_blocking(target: Target, req: Req, t0: float) -> dict[str, Any]:
    start = time.perf_counter() - t0
    ttfb, wall, audio = await target.blocking(req)
    rec = request_record([start + wall], [audio], start)
    rec["ttfb"] = ttfb  # first byte of the response (over HTTP the body starts once the audio is encoded)
    return rec


async def burst(target: Target, reqs: list[Req], blocking: bool = False) -> tuple[list[dict], list[str], dict]:
    """len(reqs) requests submitted at once; TTFB and wall count from this single submit instant."""
    t0 = time.perf_counter()
    if blocking:
        outs = await asyncio.gather(*(timed_blocking(target, r, t0) for r in reqs), return_exceptions=True)
    else:
        outs = await asyncio.gather(*(timed_stream(target, r, t0) for r in reqs), return_exceptions=True)
    wall = time.perf_counter() - t0
    ok = [o for o in outs if isinstance(o, dict)]
    return ok, errors_of(outs), {"wall": wall, "audio_s": sum(r["audio_s"] for r in ok)}


async def bursts(target: Target, make: Callable[[int, int], list[Req]], c: int, iters: int, bar: tqdm,
                 label: str = "", blocking: bool = False, warmup: bool = True) -> dict[str, Any]:
    """One warm-up burst (unless warmup=False), then `iters` counted bursts of c requests; make(iteration, c)
    gives each burst's requests (iteration 0 is the warm-up). Returns a result row."""
    reqs: list[dict] = []
    walls: list[dict] = []
    errors: list[str] = []
    mem: list[int] = []
    for it in range(0 if warmup else 1, iters + 1):
        bar.set_postfix_str(f"{label or f'c={c}'} burst={'warm-up' if it == 0 else it}")
        ok, errs, b = await burst(target, make(it, c), blocking)
        m = await asyncio.to_thread(gpu_mem_used_mib, target.gpu)  # between bursts, outside the timed region
        if m is not None:
            mem.append(m)
        bar.update()
        if it == 0:
            continue  # warm-up: compiles, graph captures and allocator growth land here
        reqs += ok
        errors += errs
        walls.append(b)
    return {"label": label, "concurrency": c, **request_stats(reqs, errors),
            "throughput_audio_s_per_s": mean([b["audio_s"] / b["wall"] for b in walls if b["wall"] > 0]),
            "burst_walls": [b["wall"] for b in walls], "gpu_mem_used_mib_max": max(mem) if mem else None}


class Sampler:
    """Samples in-flight requests and the target's queue depth every `period` seconds during a timed run,
    and GPU memory every `mem_period` (nvidia-smi in a thread)."""

    def __init__(self, target: Target, period: float = 0.05, mem_period: float = 2.0) -> None:
        self.target, self.period, self.mem_period = target, period, mem_period
        self.in_flight = 0
        self.flight: list[int] = []
        self.queue: list[int] = []
        self.mem: list[int] = []
        self._tasks: list[asyncio.Task] = []

    async def _loop(self) -> None:
        while True:
            self.flight.append(self.in_flight)
            q = await self.target.queue_depth() if isinstance(self.target, PoolTarget) else None
            if q is not None:
                self.queue.append(q)
            await asyncio.sleep(self.period)

    async def _slow(self) -> None:
        while True:
            if isinstance(self.target, HttpTarget):  # a /metrics scrape is too heavy for every 50 ms
                q = await self.target.queue_depth()
                if q is not None:
                    self.queue.append(q)
            m = await asyncio.to_thread(gpu_mem_used_mib, self.target.gpu)
            if m is not None:
                self.mem.append(m)
            await asyncio.sleep(self.mem_period)

    def __enter__(self) -> Sampler:
        self._tasks = [asyncio.ensure_future(self._loop()), asyncio.ensure_future(self._slow())]
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()

    def facts(self) -> dict[str, Any]:
        return {"in_flight_max": max(self.flight, default=0), "in_flight_mean": mean([float(x) for x in self.flight]),
                "queue_depth_max": max(self.queue) if self.queue else None,
                "queue_depth_mean": mean([float(x) for x in self.queue]),
                "gpu_mem_used_mib_max": max(self.mem) if self.mem else None}


async def _tracked(sampler: Sampler, work: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    sampler.in_flight += 1
    try:
        return await work
    finally:
        sampler.in_flight -= 1


async def closed_loop(target: Target, users: int, duration: float, warmup: float, make: Callable[[int], Req],
                      bar: tqdm | None = None) -> dict[str, Any]:
    """`users` users, each sending its next request when the previous one ends, for warmup + duration seconds.
    Requests started inside the measured window [warmup, warmup + duration] are counted (those still running
    at its end finish first); throughput = audio arriving inside the window / duration."""
    t0 = time.perf_counter()
    end = warmup + duration
    records: list[dict] = []
    errors: list[str] = []
    counter = iter(range(10**9))

    async def user(sampler: Sampler) -> None:
        while (start := time.perf_counter() - t0) < end:
            try:
                rec = await _tracked(sampler, timed_stream(target, make(next(counter)), t0, start))
                rec["counted"] = start >= warmup
                records.append(rec)
            except Exception as e:
                if start >= warmup:
                    errors.append(f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.1)  # a target refusing at once must not be hammered in a tight loop
            if bar is not None:
                bar.update(1)

    with Sampler(target) as sampler:
        await asyncio.gather(*(user(sampler) for _ in range(users)))
    span = time.perf_counter() - t0
    counted = [r for r in records if r["counted"]]
    return {"label": f"users={users}", "concurrency": users, **request_stats(counted, errors),
            "throughput_audio_s_per_s": audio_in_window(records, warmup, end) / duration if duration > 0 else None,
            "started": len(counted) + len(errors), "achieved_rps": (len(counted) + len(errors)) / duration,
            "duration_s": duration, "warmup_s": warmup, "drain_s": max(span - end, 0.0), **sampler.facts()}


async def open_loop(target: Target, rate: float, duration: float, make: Callable[[int], Req], seed: int = 0,
                    idle_ttfb: float | None = None, bar: tqdm | None = None) -> dict[str, Any]:
    """Poisson arrivals at `rate` requests/s for `duration` seconds, each request streamed whatever the load
    (no client-side limit). TTFB counts from the scheduled arrival, so it includes any queueing; the queueing
    estimate is TTFB minus the idle TTFB (one request alone, measured before)."""
    rng = np.random.default_rng(seed)
    arrivals: list[float] = []
    t = float(rng.exponential(1.0 / rate))
    while t < duration:
        arrivals.append(t)
        t += float(rng.exponential(1.0 / rate))
    records: list[dict] = []
    lags: list[float] = []
    t0 = time.perf_counter()

    async def arrive(i: int, at: float, sampler: Sampler) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        lags.append(time.perf_counter() - t0 - at)
        try:
            rec = await _tracked(sampler, timed_stream(target, make(i), t0, at))
            records.append(rec)
            return rec
        finally:
            if bar is not None:
                bar.update(1)

    with Sampler(target) as sampler:
        outs = await asyncio.gather(*(arrive(i, at, sampler) for i, at in enumerate(arrivals)),
                                    return_exceptions=True)
    span = time.perf_counter() - t0
    ok = [o for o in outs if isinstance(o, dict)]
    row = {"label": f"rate={rate:g}/s", "concurrency": None, **request_stats(ok, errors_of(outs)),
           "throughput_audio_s_per_s": audio_in_window(ok, 0.0, duration) / duration,
           "offered_rps": rate, "arrivals": len(arrivals), "achieved_rps": len(arrivals) / duration,
           "completed_rps": len(ok) / span if span > 0 else None, "duration_s": duration,
           "drain_s": max(span - duration, 0.0), "client_lag_max_s": max(lags, default=0.0),
           "idle_ttfb": idle_ttfb, **sampler.facts()}
    if idle_ttfb is not None:
        waits = [max(r["ttfb"] - idle_ttfb, 0.0) for r in ok]
        row.update(queue_wait_est_p50=percentile(waits, 50), queue_wait_est_p95=percentile(waits, 95))
    return row


# ---------------------------------------------------------------- CLI, output


def positive_ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("needs comma-separated positive integers")
    return out


def positive_floats(text: str) -> list[float]:
    out = [float(x) for x in text.split(",") if x.strip()]
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError("needs comma-separated positive numbers")
    return out


def parse_choices(ap: argparse.ArgumentParser, flag: str, value: str, choices: tuple[str, ...] | list[str]
                  ) -> list[str]:
    """A comma-separated list flag, every item one of `choices` (else the parser's usage error)."""
    items = [m.strip() for m in value.split(",") if m.strip()]
    if not items or any(m not in choices for m in items):
        ap.error(f"{flag}: choose from {', '.join(choices)}")
    return items


def command_line(command: str, argv: list[str]) -> list[str]:
    """A benchmark's command as it would be typed: the entry point, the subcommand, its flags."""
    return [BENCH, command, *argv]


def device_doc(tool: str, command: str, argv: list[str], **params: Any) -> tuple[str, dict[str, Any]]:
    """An in-process benchmark's device (the GPU when there is one) and its results document's head: the tool, the
    command as typed, the date, its parameters, the device, torch and the GPU."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, {"tool": tool, "command": "python " + " ".join(command_line(command, argv)),
                    "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **params,
                    "device": device, **torch_facts(0 if device == "cuda" else None, touch_cuda=device == "cuda")}


def subcommand_parser(command: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of one subcommand of tools/bench.py, its description the benchmark's docstring."""
    return argparse.ArgumentParser(prog=f"bench.py {command}", description=inspect.cleandoc(doc or ""),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


POOL_KWARGS_HELP = ("extra JSON keyword arguments for from_pretrained; repeated, the objects are merged, later keys "
                    "winning (a wrapper's own settings beside the caller's)")


def add_pool_arguments(p: argparse._ActionsContainer) -> None:
    """The engine pool's settings, as every pool benchmark (`parser`, `stream`) takes them."""
    p.add_argument("--devices", default="auto", help="comma-separated GPU indices or device names (cpu; "
                   "nano-vllm-voxcpm: GPU indices only); auto: GPU 0 if nvidia-smi sees one, else cpu")
    p.add_argument("--max-num-seqs", type=int, help="default: the largest concurrency")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--inference-timesteps", type=int, default=10)
    p.add_argument("--pool-kwargs", action="append", help=POOL_KWARGS_HELP)


def parser(doc: str | None, command: str, conc: str | None = "1,8", patches: int = 100, iters: int | None = 2,
           duration: float | None = None) -> argparse.ArgumentParser:
    """The flags every workload shares. conc/iters/duration None: the workload has no such flag."""
    ap = subcommand_parser(command, doc)
    g = ap.add_argument_group("target")
    g.add_argument("--target", choices=["pool", "http"], default="pool",
                   help="pool: the engine in this process; http: a running voxcpm-serve at --url")
    g.add_argument("--model", help="checkpoint directory (pool target)")
    g.add_argument("--engine", choices=["voxcpm-serve", "nanovllm"], default="voxcpm-serve",
                   help="pool target: our pool or nano-vllm-voxcpm's")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="service base URL (http target)")
    g.add_argument("--format", choices=["pcm", "mp3"], default="pcm",
                   help="http: audio format asked for (mp3 durations are read from its frame headers)")
    g.add_argument("--gpu-index", type=int, default=None,
                   help="http: the service's GPU for nvidia-smi memory readings (default: 0 if nvidia-smi sees one)")
    g.add_argument("--ready-timeout", type=float, default=900, help="http: seconds to wait for /ready")
    g.add_argument("--http-timeout", type=float, default=600, help="http: read timeout per request, seconds")
    add_pool_arguments(ap.add_argument_group("pool (pool target)"))
    w = ap.add_argument_group("workload")
    if conc is not None:
        w.add_argument("--conc", type=positive_ints, default=positive_ints(conc),
                       help=f"comma-separated concurrencies (default {conc})")
    w.add_argument("--patches", type=int, default=patches, help=f"patches per request (default {patches})")
    if iters is not None:
        w.add_argument("--iters", type=int, default=iters, help="counted bursts per row, after one warm-up")
    if duration is not None:
        w.add_argument("--duration", type=float, default=duration, help="measured seconds per row")
    w.add_argument("--text", default=TEXT, help="target text (default: the protocol's ~80-word paragraph)")
    w.add_argument("--clip-seconds", type=float, default=5.0, help="length of the synthetic voice clips")
    w.add_argument("--out", help="write the results JSON here (rewritten after every row)")
    return ap


def merged_pool_kwargs(ap: argparse.ArgumentParser, values: list[str] | None) -> dict[str, Any]:
    """The --pool-kwargs objects merged in order (a later one's keys win)."""
    merged: dict[str, Any] = {}
    for value in values or ():
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            ap.error(f"--pool-kwargs is not JSON ({e}): {value!r}")
        if not isinstance(obj, dict):
            ap.error(f"--pool-kwargs must be a JSON object, got {value!r}")
        merged.update(obj)
    return merged


def finish_args(ap: argparse.ArgumentParser, a: argparse.Namespace, max_conc: int, argv: list[str],
                command: str) -> argparse.Namespace:
    """Validate and complete the shared flags; a.argv = the command as it would be typed."""
    a.argv = command_line(command, argv)
    if a.target == "pool" and not a.model:
        ap.error("--model is required with --target pool")
    # nvidia-smi (asked once, and only when needed) keeps CUDA out of this process
    gpu0 = (a.devices == "auto" or a.gpu_index is None) and nvidia_smi("name", 0) is not None
    if a.devices == "auto":  # one GPU, as the anchors
        a.devices = "0" if gpu0 else "cpu"
    a.devices = [int(x) if x.strip().isdigit() else x.strip() for x in a.devices.split(",") if x.strip()]
    if a.gpu_index is None and gpu0:
        a.gpu_index = 0
    a.max_num_seqs = a.max_num_seqs or max_conc
    a.pool_kwargs = merged_pool_kwargs(ap, a.pool_kwargs)
    if a.patches < 1:
        ap.error("--patches must be positive")
    return a


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    if path:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(path)  # atomic, so a kill mid-write never leaves half a file


def _f(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, spec)


BASE_COLUMNS: list[tuple[str, str, str]] = [
    ("requests", "reqs", "5d"), ("failed", "fail", "4d"), ("ttfb_p50", "ttfb50", "7.3f"),
    ("ttfb_p95", "ttfb95", "7.3f"), ("ttfb_p99", "ttfb99", "7.3f"), ("rtf_mean", "rtf", "6.3f"),
    ("rtf_p95", "rtf95", "6.3f"), ("throughput_audio_s_per_s", "aud-s/s", "8.1f"),
]


def print_table(doc: dict[str, Any], extra: list[tuple[str, str, str]] | None = None) -> None:
    """The result rows as a fixed-width table on stdout. extra: (key, header, format) columns."""
    print(f"\n{doc['tool']}  target={doc['target']} {doc.get('url') or doc.get('model') or ''}  "
          f"{doc.get('engine_version') or ''}  patches={doc.get('patches')}  startup={_f(doc.get('startup_s'), '.1f')}s"
          f"  gpu={doc.get('gpu_name')}  torch={doc.get('torch')}")
    rows = doc["results"]
    width = max([len("row")] + [len(str(r.get("label", ""))) for r in rows])
    cols = BASE_COLUMNS + (extra or [])
    head = f"{'row':<{width}} " + " ".join(f"{h:>{max(len(h), 7)}}" for _, h, _ in cols)
    print(head + f" {'underrun':>9} {'gap-s':>7} {'mem-MiB':>8}")
    for r in rows:
        cells = " ".join(f"{_f(r.get(k), spec):>{max(len(h), 7)}}" for k, h, spec in cols)
        under = f"{r.get('streams_with_underrun', 0):>4}/{r.get('requests', 0):<4}"
        print(f"{str(r.get('label', '')):<{width}} {cells} {under} {_f(r.get('underrun_s_total'), '7.2f')} "
              f"{_f(r.get('gpu_mem_used_mib_max'), '8d'):>8}")


class Run:
    """A tool's results document: environment facts, rows added as they finish (the JSON rewritten after each,
    so a run cut off still leaves its finished rows with "complete": false)."""

    def __init__(self, tool: str, a: argparse.Namespace, params: dict[str, Any]) -> None:
        self.a = a
        self.doc: dict[str, Any] = {
            "tool": tool, "target": a.target, "command": shlex.join(["python", *a.argv]), "argv": a.argv,
            "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "engine_version": engine_version(a.engine) if a.target == "pool" else None,
            "patches": a.patches, "text_words": len(a.text.split()), **params,
            **torch_facts(None, touch_cuda=False), "complete": False, "results": [],
        }

    def add(self, row: dict[str, Any]) -> None:
        self.doc["results"].append(row)
        keys = ("label", "concurrency", "requests", "failed", "ttfb_p50", "ttfb_p95", "rtf_mean",
                "throughput_audio_s_per_s", "streams_with_underrun")
        tqdm.write(json.dumps({k: row.get(k) for k in keys}), file=sys.stderr)
        write_json(self.a.out, self.doc)


Body = Callable[[Target, argparse.Namespace, Run, tqdm], Awaitable[None]]


def run_tool(tool: str, a: argparse.Namespace, params: dict[str, Any], body: Body, total: int | None,
             extra_columns: list[tuple[str, str, str]] | None = None, unit: str = "burst") -> dict[str, Any]:
    """Start the target, run body(target, args, run, progress bar), stop the target; then the environment
    facts, the JSON and the table. Returns the results document."""
    run = Run(tool, a, params)
    target = make_target(a)

    async def go() -> None:
        t = time.perf_counter()
        try:
            await target.start()
            run.doc["startup_s"] = time.perf_counter() - t  # pool: load to ready; http: until /ready answered
            run.doc.update(target.facts, sample_rate=target.sample_rate, channels=target.channels,
                           gpu_mem_used_mib_after_startup=await asyncio.to_thread(gpu_mem_used_mib, target.gpu))
            with tqdm(total=total, desc=tool, unit=unit, file=sys.stderr, dynamic_ncols=True) as bar:
                await body(target, a, run, bar)
        finally:
            await target.stop()

    asyncio.run(go())
    run.doc["complete"] = True
    # CUDA only now, after the pool stopped; an http target's GPU is not ours to touch
    run.doc.update(torch_facts(target.gpu, touch_cuda=a.target == "pool"))
    write_json(a.out, run.doc)
    print_table(run.doc, extra_columns)
    return run.doc


def clips(n: int, seconds: float, first_seed: int = 0) -> list[bytes]:
    """n different synthetic clips (seed 0 is the anchor runs' clip)."""
    return [synthetic_clip_wav(seconds, seed=first_seed + i) for i in range(n)]
