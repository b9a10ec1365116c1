"""Soak a running voxcpm-serve: many requests at a fixed concurrency over mixed routes, voices and formats, a share
of them dropped by the client at a random point, every one under a hang guard. Prints (and writes) what each
request got; the caller then checks the service is idle with nothing leaked (tests/test_reliability.py does).

    uv run python tools/soak.py --url http://127.0.0.1:8000 --requests 1000 --concurrency 16 --disconnect 0.3

Outcomes: `completed` (whole response, checked), `disconnected` (the client left on purpose), `refused` (503 with
Retry-After: overload or a worker restarting), `client_error` (4xx: a bug in this mix), `server_error` (5xx or a
malformed response), `cut` (the connection broke without the client leaving), `hung` (no answer within the guard).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import time
import wave
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

STREAMED = {"/generate": ("mp3", "pcm"), "/v1/audio/speech": ("mp3", "pcm", "sse")}
BLOCKING = {"/generate_blocking": ("mp3", "pcm"), "/generate_blocking_wav": ("wav",),
            "/v1/audio/speech": ("wav", "flac", "opus")}
VOICES = ("zero-shot", "design", "hifi_id", "prompt_id", "ref_audio_id")


@dataclass
class SoakResult:
    requests: int
    concurrency: int
    disconnect_share: float
    wall_s: float
    outcomes: dict[str, int]
    by_route: dict[str, int]
    problems: list[str] = field(default_factory=list)  # the first few unexpected answers, for the report


def wav_bytes(seconds: float, sr: int = 16000, seed: int = 0) -> bytes:
    """A voice-like test clip (a tone and some noise, pitch by seed) as a 16-bit mono WAV file (the tests use it)."""
    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sin(2 * np.pi * (150 + 20 * seed) * t) + 0.02 * np.random.default_rng(seed).standard_normal(t.size)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((x * 32767).astype(np.int16).tobytes())
    return buf.getvalue()


def clip(seconds: float = 1.0) -> str:
    return base64.b64encode(wav_bytes(seconds, seed=5)).decode()


async def register_voices(client: httpx.AsyncClient) -> dict[str, str]:
    r = await client.post("/add_hifi", json={"wav_base64": clip(), "prompt_text": "A soak test clip."})
    r.raise_for_status()
    v = r.json()
    return {"hifi_id": v["hifi_id"], "prompt_id": v["prompt_id"], "ref_audio_id": v["reference_id"]}


def make_request(rng: random.Random, voices: dict[str, str], max_patches: int) -> tuple[str, str, dict, bool]:
    """(route, format, JSON body, streamed) of one random request."""
    streamed = rng.random() < 0.7
    table = STREAMED if streamed else BLOCKING
    route = rng.choice(sorted(table))
    fmt = rng.choice(table[route])
    voice = rng.choice(VOICES)
    text = rng.choice(("Hello there.", "A soak test sentence.", "Numbers: one, two, three."))
    sampling = {"max_generate_length": rng.randint(1, max_patches), "seed": rng.randrange(2**31)}
    if route == "/v1/audio/speech":
        body = {"model": "tts-1", "input": text, **sampling}
        if fmt == "sse":
            body.update(response_format=rng.choice(("mp3", "pcm")), stream_format="sse")
        else:
            body["response_format"] = fmt
        if voice == "design":
            body["instructions"] = "A calm voice"
        elif voice != "zero-shot":
            body["voice"] = voices[voice]
    else:
        body = {"target_text": f"(A calm voice){text}" if voice == "design" else text, **sampling}
        if fmt != "wav":
            body["response_format"] = fmt
        if voice in voices:
            body[voice] = voices[voice]
    return route, fmt, body, streamed


def check_body(fmt: str, streamed: bool, data: bytes, headers: httpx.Headers) -> str | None:
    """Why a completed response is malformed, or None."""
    if not data:
        return "empty body"
    if fmt == "pcm" and len(data) % 2:
        return f"odd pcm length {len(data)}"
    if fmt == "sse" and b"speech.audio.done" not in data:
        return "sse without its done event"
    if "x-request-id" not in headers:
        return "no X-Request-Id"
    if not streamed and "x-finish-reason" not in headers:
        return "blocking response without X-Finish-Reason"
    return None


async def one(client: httpx.AsyncClient, rng: random.Random, voices: dict[str, str], max_patches: int,
              disconnect: float, guard_s: float) -> tuple[str, str, str | None]:
    """(route, outcome, problem) of one request."""
    route, fmt, body, streamed = make_request(rng, voices, max_patches)
    leave = rng.random() < disconnect
    leave_after_chunks = rng.randint(0, 3)
    leave_after_s = rng.uniform(0.0, 0.3)

    async def run() -> tuple[str, str | None]:
        async with client.stream("POST", route, json=body) as r:
            if r.status_code == 503:
                await r.aread()
                return ("refused", None) if r.headers.get("retry-after") else ("server_error", "503 no Retry-After")
            if r.status_code != 200:
                text = (await r.aread())[:300].decode(errors="replace")
                return ("client_error" if r.status_code < 500 else "server_error"), f"{r.status_code} {text}"
            data = bytearray()
            chunks = 0
            async for chunk in r.aiter_raw():
                data += chunk
                chunks += 1
                if leave and streamed and chunks > leave_after_chunks:
                    return "disconnected", None  # leaving the block closes the connection mid-stream
            problem = check_body(fmt, streamed, bytes(data), r.headers)
            return ("server_error", f"{route} {fmt}: {problem}") if problem else ("completed", None)

    try:
        if leave and not streamed:  # a blocking request: the client gives up while it is being generated
            try:
                outcome, problem = await asyncio.wait_for(run(), leave_after_s)
            except asyncio.TimeoutError:
                return route, "disconnected", None
        else:
            outcome, problem = await asyncio.wait_for(run(), guard_s)
    except asyncio.TimeoutError:
        return route, "hung", f"{route} no answer within {guard_s} s"
    except httpx.HTTPError as e:
        return route, "cut", f"{route} {type(e).__name__}: {e}"
    return route, outcome, problem


async def soak(url: str, requests: int, concurrency: int, disconnect: float, max_patches: int = 4,
               seed: int = 0, guard_s: float = 60.0) -> SoakResult:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(guard_s), limits=limits) as client:
        voices = await register_voices(client)
        todo = iter(range(requests))
        outcomes: Counter[str] = Counter()
        by_route: Counter[str] = Counter()
        problems: list[str] = []

        async def lane() -> None:
            for _ in todo:
                route, outcome, problem = await one(client, rng, voices, max_patches, disconnect, guard_s)
                outcomes[outcome] += 1
                by_route[route] += 1
                if problem and len(problems) < 20:
                    problems.append(problem)

        t0 = time.monotonic()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        wall = time.monotonic() - t0
    return SoakResult(requests, concurrency, disconnect, round(wall, 2), dict(outcomes), dict(by_route), problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--disconnect", type=float, default=0.3, help="share of requests the client drops")
    ap.add_argument("--max-patches", type=int, default=4, help="max_generate_length drawn from 1..this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--guard-s", type=float, default=60.0, help="a request without an answer this long is hung")
    ap.add_argument("--out", type=Path, help="write the result as JSON")
    args = ap.parse_args()
    result = asyncio.run(soak(args.url, args.requests, args.concurrency, args.disconnect, args.max_patches,
                              args.seed, args.guard_s))
    text = json.dumps(asdict(result), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
