"""A tour of every voxcpm-serve route (writes the audio it gets under --out).

    uv run python tools/client.py --url http://127.0.0.1:8000 [--clip voice.wav --text "Its transcript."]
"""

from __future__ import annotations

import argparse
import base64
import io
import math
import struct
import wave
from pathlib import Path

import httpx


def tone_wav(seconds: float = 1.0, sr: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes(b"".join(struct.pack("<h", int(9000 * math.sin(2 * math.pi * 180 * i / sr)))
                               for i in range(int(seconds * sr))))
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clip", type=Path, help="a voice clip (default: a synthetic tone)")
    ap.add_argument("--text", default="A short transcript.", help="the clip's transcript")
    ap.add_argument("--out", type=Path, default=Path("client_out"))
    ap.add_argument("--max-len", type=int, default=20, help="max_generate_length per request (patches)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    clip = base64.b64encode(a.clip.read_bytes() if a.clip else tone_wav()).decode()
    c = httpx.Client(base_url=a.url, timeout=300)

    def show(r: httpx.Response, what: str) -> httpx.Response:
        r.raise_for_status()
        ctype = r.headers.get("content-type", "")
        body = f"{len(r.content)} bytes" if ctype.startswith("audio") else r.text[:160]
        print(f"{r.request.method:6} {r.request.url.path:24} {r.status_code} {what}: {body}")
        return r

    show(c.get("/health"), "liveness")
    show(c.get("/ready"), "readiness")
    show(c.get("/info"), "model")
    lat = show(c.post("/encode_latents", json={"wav_base64": clip}), "latents").json()
    pid = show(c.post("/add_prompt", json={"wav_base64": clip, "prompt_text": a.text}), "prompt").json()["prompt_id"]
    rid = show(c.post("/add_reference", json={"wav_base64": clip}), "reference").json()["reference_id"]
    hifi = show(c.post("/add_hifi", json={"wav_base64": clip, "prompt_text": a.text}), "hifi").json()["hifi_id"]
    for kind in ("prompts", "references", "hifi"):
        show(c.get(f"/{kind}"), "listing")

    text = "Hello from voxcpm-serve."
    bodies = {
        "zero_shot": {},
        "prompt_latents": {"prompt_latents_base64": lat["prompt_latents_base64"], "prompt_text": a.text},
        "prompt_id": {"prompt_id": pid},
        "ref_audio_id": {"ref_audio_id": rid},
        "hifi_id": {"hifi_id": hifi},
    }
    for name, extra in bodies.items():
        body = {"target_text": text, "max_generate_length": a.max_len, **extra}
        with c.stream("POST", "/generate", json=body) as r:
            r.raise_for_status()
            (a.out / f"{name}.mp3").write_bytes(b"".join(r.iter_bytes()))
        print(f"POST   /generate                200 {name}: streamed to {a.out / (name + '.mp3')} "
              f"({r.headers['x-audio-sample-rate']} Hz)")
    body = {"target_text": text, "max_generate_length": a.max_len}
    (a.out / "blocking.mp3").write_bytes(show(c.post("/generate_blocking", json=body), "mp3").content)
    (a.out / "blocking.wav").write_bytes(show(c.post("/generate_blocking_wav", json=body), "wav").content)

    speech = {"model": "tts-1", "input": text, "voice": hifi, "response_format": "flac",
              "max_generate_length": a.max_len}
    (a.out / "openai.flac").write_bytes(show(c.post("/v1/audio/speech", json=speech), "openai flac").content)
    show(c.get("/v1/audio/voices"), "voices")
    show(c.get("/v1/models"), "models")
    show(c.delete(f"/hifi/{hifi}"), "deleted")
    show(c.delete(f"/prompts/{pid}"), "deleted")
    show(c.delete(f"/references/{rid}"), "deleted")
    metrics = show(c.get("/metrics"), "prometheus").text
    ttfb = [line for line in metrics.splitlines() if line.startswith("voxcpm_time_to_first_audio_byte_seconds_")]
    print("\n".join(ttfb))


if __name__ == "__main__":
    main()
