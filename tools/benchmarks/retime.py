"""What `speed` and `sample_rate` cost the host: core-seconds per audio-second of the service's stages
(service/retime.py) on this machine, and how steady a stretched tone stays.

    python tools/bench.py retime --seconds 20 --out retime.json

Each stage is fed 160 ms chunks of 48 kHz speech-like audio (tools/benchmarks/encode.py) on one thread, the way an
encoder thread feeds it; core-s per audio-s = CPU seconds over seconds of generated (input) audio. The stretch is
also run on several threads at once: the binding holds the GIL while it stretches, so it does not scale over
threads; the JSON says how far it does.

The tone check stretches a steady 440 Hz sine at each speed and reports the spread of its level over 10 ms frames
(dB below and above the input's level): a steady input should stay steady, so the spread is what the stretcher itself
adds (phase-vocoder amplitude modulation, and any dip at the service's block joins). It is measured both as streamed
by the service and as one whole-buffer call of the library, to tell the two apart. It is no intelligibility test.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
from python_stretch.Signalsmith import Stretch

from service.retime import STRETCH_SEED, Resample, TimeStretch
from tools.benchmarks.encode import speech_like
from tools.benchmarks.harness import subcommand_parser, write_json


def run_stage(stage: Any, audio: np.ndarray, chunk: int) -> int:
    n = 0
    for i in range(0, len(audio), chunk):
        n += len(stage(audio[i:i + chunk], i + chunk >= len(audio)))
    return n


def level_spread_db(out: np.ndarray, reference_rms: float, frame: int) -> tuple[float, float]:
    """The lowest and highest 10 ms level of `out` (its first and last tenth left out) in dB re `reference_rms`."""
    mid = out[len(out) // 10: len(out) - len(out) // 10]
    frames = mid[:len(mid) // frame * frame].reshape(-1, frame)
    level = 20 * np.log10(np.sqrt(np.mean(frames ** 2, axis=1)) / reference_rms + 1e-12)
    return float(level.min()), float(level.max())


def main(argv: list[str]) -> dict[str, Any]:
    ap = subcommand_parser("retime", __doc__)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--sample-rate", type=int, default=48000)
    ap.add_argument("--chunk", type=int, default=7680, help="samples per chunk (VoxCPM2: one 160 ms patch)")
    ap.add_argument("--speeds", default="0.25,0.5,0.75,1.25,1.5,2,3,4")
    ap.add_argument("--rates", default="8000,16000,22050,24000,44100")
    ap.add_argument("--threads", default="1,2,4", help="thread counts for the stretch's scaling check")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    sr, speeds = a.sample_rate, [float(s) for s in a.speeds.split(",")]
    audio = speech_like(a.seconds, sr)
    doc: dict[str, Any] = {"tool": "bench_retime", "seconds": a.seconds, "sample_rate": sr, "chunk": a.chunk,
                           "cpus": len(os.sched_getaffinity(0)), "stretch": [], "resample": [],
                           "stretch_threads": [], "tone": []}
    run_stage(TimeStretch(sr, 2.0), audio[:sr], a.chunk)  # warm-up
    for speed in speeds:
        c0 = time.process_time()
        n_out = run_stage(TimeStretch(sr, speed), audio, a.chunk)
        cpu = time.process_time() - c0
        row = {"speed": speed, "core_s_per_audio_s": cpu / a.seconds, "out_samples": n_out,
               "out_expected": round(len(audio) / speed)}
        doc["stretch"].append(row)
        print(f"stretch x{speed:<5g} {row['core_s_per_audio_s']:.5f} core-s per generated audio-s", flush=True)
    for rate in [int(r) for r in a.rates.split(",") if r.strip()]:
        c0 = time.process_time()
        run_stage(Resample(sr, rate), audio, a.chunk)
        row = {"rate": rate, "core_s_per_audio_s": (time.process_time() - c0) / a.seconds}
        doc["resample"].append(row)
        print(f"resample to {rate:<6d} {row['core_s_per_audio_s']:.5f} core-s per audio-s", flush=True)
    for n in [int(x) for x in a.threads.split(",") if x.strip()]:
        threads = [threading.Thread(target=run_stage, args=(TimeStretch(sr, 2.0), audio, a.chunk)) for _ in range(n)]
        w0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        row = {"threads": n, "speed": 2.0, "audio_s_per_s": n * a.seconds / (time.perf_counter() - w0)}
        doc["stretch_threads"].append(row)
        print(f"stretch x2 on {n} threads: {row['audio_s_per_s']:.0f} audio-s/s", flush=True)
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(3 * sr) / sr)).astype(np.float32)
    rms = float(np.sqrt(np.mean(tone ** 2)))
    for speed in speeds:
        streamed = np.concatenate(_chunks_through(TimeStretch(sr, speed), tone, a.chunk))
        whole_stretch = Stretch(STRETCH_SEED)
        whole_stretch.preset(1, sr)
        whole_stretch.timeFactor = speed
        whole = whole_stretch.process(tone[np.newaxis, :])[0]
        frame = sr // 100
        s_lo, s_hi = level_spread_db(streamed, rms, frame)
        w_lo, w_hi = level_spread_db(whole, rms, frame)
        doc["tone"].append({"speed": speed, "streamed_db": [s_lo, s_hi], "whole_db": [w_lo, w_hi]})
        print(f"tone x{speed:<5g} 10 ms level {s_lo:+.1f}..{s_hi:+.1f} dB streamed, {w_lo:+.1f}..{w_hi:+.1f} dB whole",
              flush=True)
    write_json(a.out, doc)
    return doc


def _chunks_through(stage: TimeStretch, audio: np.ndarray, chunk: int) -> list[np.ndarray]:
    return [stage(audio[i:i + chunk], i + chunk >= len(audio)) for i in range(0, len(audio), chunk)]
