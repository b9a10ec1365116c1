"""What encoding costs the host: core-seconds per audio-second for each response format, on this machine.

    python tools/bench_encode.py --seconds 30 --out encode.json

Each format is encoded by the service's own encoders (service/audio.py), fed 160 ms chunks of 48 kHz noise-like
audio the way a stream is (whole files too: they gather the chunks and encode at the last one), on one thread;
core-s per audio-s = CPU seconds / audio seconds (the inverse is "x real time" per core). MP3 is also run on
several threads at once, to check that LAME's encoding scales over cores (it releases the GIL).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from benchlib import write_json  # noqa: E402

from service.audio import make_encoder  # noqa: E402

CASES = [("mp3", {"mp3_bitrate_kbps": 192, "mp3_quality": q}, f"mp3 192 kbps q{q}") for q in (0, 1, 2)] + [
    ("mp3", {"mp3_bitrate_kbps": 128, "mp3_quality": 2}, "mp3 128 kbps q2"),
    ("pcm", {}, "pcm s16le"), ("wav", {}, "wav"), ("flac", {}, "flac"), ("opus", {}, "opus"),
]


def speech_like(seconds: float, sr: int, seed: int = 0) -> np.ndarray:
    """Noise shaped like speech (syllable-rate envelope, a few harmonics): the encoders' work depends on content."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    voiced = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / sr) / k for k in range(1, 6))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 4 * t)) ** 2
    return (0.2 * envelope * voiced + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def encode_all(audio: np.ndarray, chunk: int, fmt: str, sr: int, options: dict) -> int:
    enc = make_encoder(fmt, sr, **options)
    n = 0
    for i in range(0, len(audio), chunk):
        n += len(enc(audio[i:i + chunk], i + chunk >= len(audio)) or b"")
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--sample-rate", type=int, default=48000)
    ap.add_argument("--chunk", type=int, default=7680, help="samples per chunk (VoxCPM2: one 160 ms patch)")
    ap.add_argument("--threads", default="1,2,4,8,16", help="thread counts for the parallel MP3 check")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    sr = a.sample_rate
    audio = speech_like(a.seconds, sr)
    doc = {"tool": "bench_encode", "seconds": a.seconds, "sample_rate": sr, "chunk": a.chunk,
           "cpus": len(os.sched_getaffinity(0)), "formats": [], "mp3_threads": []}
    for fmt, options, label in CASES:
        encode_all(audio[: sr], a.chunk, fmt, sr, options)  # warm-up
        c0, w0 = time.process_time(), time.perf_counter()
        nbytes = encode_all(audio, a.chunk, fmt, sr, options)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        row = {"format": label, "core_s_per_audio_s": cpu / a.seconds, "x_realtime_per_core": a.seconds / cpu,
               "wall_s": wall, "bytes": nbytes}
        doc["formats"].append(row)
        print(f"{label:18s} {row['core_s_per_audio_s']:.5f} core-s per audio-s ({row['x_realtime_per_core']:.0f}x "
              "real time per core)", flush=True)
    for n in [int(x) for x in a.threads.split(",") if x.strip()]:
        threads = [threading.Thread(target=encode_all, args=(audio, a.chunk, "mp3", sr, {})) for _ in range(n)]
        w0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - w0
        doc["mp3_threads"].append({"threads": n, "audio_s_per_s": n * a.seconds / wall})
        print(f"mp3 q2 on {n} threads: {n * a.seconds / wall:.0f} audio-s/s", flush=True)
    write_json(a.out, doc)


if __name__ == "__main__":
    main()
