"""What encoding costs the host: core-seconds per audio-second for each response format, on this machine.

    python tools/bench.py encode --seconds 30 --out encode.json

Each format is encoded by the service's own encoders (service/audio.py), fed 160 ms chunks of 48 kHz noise-like
audio the way a stream is (whole files too: they gather the chunks and encode at the last one), on one thread;
core-s per audio-s = CPU seconds / audio seconds (the inverse is "x real time" per core); each MP3 quality's output is
decoded again for its waveform SNR against the input. MP3 is also run on several threads at once, to check that
LAME's encoding scales over cores (it releases the GIL).

--client-path STREAMS measures the same encoders on the API process's own path, without HTTP: a spawned process
plays an engine worker, sending a step's chunks for STREAMS streams every --step-ms over a real connection to a real
EngineClient (its reader thread, encoder pool of --encoder-threads and event loop, which takes each stream's
output); the CPU of this process per audio second is then set beside the encoder's cost alone, per format.

--burst STREAMS measures the floor under a burst's time to first audio: STREAMS new MP3 streams (encoders made and
prepared) each encode their first chunk at the same moment on each of --burst-threads thread counts (the cores the
API processes have); the time until the last first chunk is encoded is what a burst of that size adds to the
slowest streams' first bytes at the least, whatever the serving path does (median of 5 bursts).
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import soundfile as sf

from service.audio import make_encoder
from service.settings import BaseServiceSettings
from tools.benchmarks.harness import subcommand_parser, write_json

CASES = [("mp3", {"mp3_bitrate_kbps": 192, "mp3_quality": q}, f"mp3 192 kbps q{q}") for q in (0, 1, 2, 3, 5, 7)] + [
    ("mp3", {"mp3_bitrate_kbps": 128, "mp3_quality": 2}, "mp3 128 kbps q2"),
    ("pcm", {}, "pcm s16le"), ("wav", {}, "wav"), ("flac", {}, "flac"), ("opus", {}, "opus"),
]
SERVICE_QUALITY: int = BaseServiceSettings.model_fields["mp3_quality"].default  # the MP3 of all but CASES


def speech_like(seconds: float, sr: int, seed: int = 0) -> np.ndarray:
    """Noise shaped like speech (syllable-rate envelope, a few harmonics): the encoders' work depends on content."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    voiced = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / sr) / k for k in range(1, 6))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 4 * t)) ** 2
    return (0.2 * envelope * voiced + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def encode_all(audio: np.ndarray, chunk: int, fmt: str, sr: int, options: dict) -> int:
    return len(encode_bytes(audio, chunk, fmt, sr, options))


def encode_bytes(audio: np.ndarray, chunk: int, fmt: str, sr: int, options: dict) -> bytes:
    enc = make_encoder(fmt, sr, **options)
    return b"".join(enc(audio[i:i + chunk], i + chunk >= len(audio)) or b"" for i in range(0, len(audio), chunk))


def decoded_snr_db(audio: np.ndarray, data: bytes, max_lag: int = 4096) -> float:
    """Waveform SNR (dB) of the decoded MP3 against its input, the codec's delay found by cross-correlation: a check
    that a cheaper LAME quality does not break the audio, not a perceptual measure."""
    decoded, _ = sf.read(io.BytesIO(data), dtype="float32")
    head = min(len(audio), len(decoded) - max_lag, 1 << 16)
    corr = np.fft.irfft(np.fft.rfft(decoded[: head + max_lag], 2 * (head + max_lag))
                        * np.conj(np.fft.rfft(audio[:head], 2 * (head + max_lag))))
    lag = int(np.argmax(corr[:max_lag]))
    n = min(len(audio), len(decoded) - lag)
    error = decoded[lag:lag + n] - audio[:n]
    return float(10 * np.log10(np.sum(audio[:n] ** 2) / max(float(np.sum(error ** 2)), 1e-30)))


def _play_worker(conn: Any, request_ids: list[str], step_s: float, steps: int, chunk: int, sr: int) -> None:
    """The worker's side of --client-path (a spawned process): each step's chunks, every step_s."""
    from engine.serving import protocol as p

    audio = speech_like(8.0, sr)
    chunks = [audio[i:i + chunk] for i in range(0, len(audio) - chunk, chunk)]
    due = time.perf_counter()
    for k in range(steps):
        last = k == steps - 1
        conn.send(p.StepEvents([p.AudioEvent(rid, chunks[k % len(chunks)], finished=last,
                                             finish_reason="length" if last else None) for rid in request_ids],
                               p.WorkerLoad()))
        due += step_s
        time.sleep(max(0.0, due - time.perf_counter()))
    conn.recv()  # until the client has read everything


async def client_path(fmt: str, streams: int, step_s: float, steps: int, threads: int, chunk: int,
                      sr: int, quality: int) -> dict[str, Any]:
    """CPU of this process per audio second while a real EngineClient turns a worker's steps into encoded streams."""
    from engine.serving import protocol as p
    from engine.serving.client import EngineClient
    from engine.serving.routing import LoadTable
    from engine.serving.stream import GenerationStream
    from engine.serving.worker_link import WorkerLink
    from engine.vocabulary import SamplingParams
    from service.encoder_pool import EncoderPool

    client = EngineClient([], b"bench", encoder_threads=threads, load=LoadTable(1), transform_threads=EncoderPool)
    link = WorkerLink(client, 0, "played by a process of this benchmark")
    ours, theirs = mp.Pipe()
    request = p.SynthesisRequest("", "", None, None, None, SamplingParams(), None)
    runs = []
    for _ in range(streams):
        stream = GenerationStream(client, request, make_encoder(fmt, sr, mp3_quality=quality))
        stream.attach(link)  # routed to the played worker (nothing is sent: it plays the request's steps)
        runs.append(stream)
    worker = mp.get_context("spawn").Process(target=_play_worker, args=(
        theirs, [s.request_id for s in runs], step_s, steps, chunk, sr))
    c0, w0 = time.process_time(), time.perf_counter()
    link.attach(ours)
    worker.start()

    async def drain(stream: GenerationStream) -> int:
        return sum([len(b or b"") async for b in stream])

    nbytes = sum(await asyncio.gather(*(drain(s) for s in runs)))
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    client.closed = True  # the played worker's exit is no lost connection
    ours.send("done")
    worker.join()
    client.encoders.stop()
    audio_s = streams * steps * chunk / sr
    return {"format": fmt, "streams": streams, "step_ms": 1000 * step_s, "encoder_threads": threads,
            "core_s_per_audio_s": cpu / audio_s, "cores": cpu / wall, "bytes": nbytes}


def first_chunk_burst(audio: np.ndarray, chunk: int, sr: int, streams: int, threads: int, quality: int,
                      repeats: int = 5) -> dict[str, Any]:
    """`streams` prepared MP3 encoders encode a first chunk each at once on `threads` threads: the wall time to the
    last one (and the median one), the median over `repeats` bursts; and the MP3 bytes the last burst made."""
    lasts, middles, nbytes = [], [], 0
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(time.sleep, [0.01] * threads))  # its threads exist before the first timed burst
        for r in range(repeats):
            encoders = [make_encoder("mp3", sr, mp3_quality=quality) for _ in range(streams)]
            for enc in encoders:
                enc.prepare()  # type: ignore[attr-defined]  # as the service does while the engine prefills
            pieces = [audio[(i * chunk + r * 997) % (len(audio) - chunk):][:chunk] for i in range(streams)]
            go = threading.Event()  # every job is handed to the pool before the clock starts

            def encode(enc: Any, piece: np.ndarray, go: threading.Event = go) -> tuple[float, int]:
                go.wait()
                out = enc(piece, False)
                return time.perf_counter(), len(out or b"")

            jobs = [pool.submit(encode, enc, piece) for enc, piece in zip(encoders, pieces, strict=True)]
            w0 = time.perf_counter()
            go.set()
            done = [job.result() for job in jobs]
            ends = sorted(t - w0 for t, _ in done)
            nbytes = sum(n for _, n in done)
            lasts.append(ends[-1])
            middles.append(ends[len(ends) // 2])
    return {"streams": streams, "threads": threads, "last_ms": 1000 * float(np.median(lasts)),
            "median_ms": 1000 * float(np.median(middles)), "bytes": nbytes}


def main(argv: list[str]) -> dict[str, Any]:
    ap = subcommand_parser("encode", __doc__)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--sample-rate", type=int, default=48000)
    ap.add_argument("--chunk", type=int, default=7680, help="samples per chunk (VoxCPM2: one 160 ms patch)")
    ap.add_argument("--threads", default="1,2,4,8,16", help="thread counts for the parallel MP3 check")
    ap.add_argument("--client-path", type=int, default=0, metavar="STREAMS",
                    help="also measure the engine client's path with this many streams (0: not)")
    ap.add_argument("--step-ms", type=float, default=37.0, help="--client-path: a step's period (c=128 on one H100)")
    ap.add_argument("--encoder-threads", type=int, default=4, help="--client-path: the client's encoder threads")
    ap.add_argument("--burst", type=int, default=0, metavar="STREAMS",
                    help="also time a burst of this many new MP3 streams' first chunks (0: not)")
    ap.add_argument("--burst-threads", default="14", help="--burst: thread counts (the API processes' cores)")
    ap.add_argument("--quality", type=int, default=SERVICE_QUALITY,
                    help="LAME quality of the thread, client-path and burst measurements (the service's default)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    sr = a.sample_rate
    lame = {"mp3_quality": a.quality}
    audio = speech_like(a.seconds, sr)
    doc = {"tool": "bench_encode", "seconds": a.seconds, "sample_rate": sr, "chunk": a.chunk,
           "cpus": len(os.sched_getaffinity(0)), "mp3_quality": a.quality, "formats": [], "mp3_threads": [],
           "client_path": [], "burst": []}
    for fmt, options, label in CASES:
        encode_all(audio[: sr], a.chunk, fmt, sr, options)  # warm-up
        c0, w0 = time.process_time(), time.perf_counter()
        data = encode_bytes(audio, a.chunk, fmt, sr, options)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        row = {"format": label, "core_s_per_audio_s": cpu / a.seconds, "x_realtime_per_core": a.seconds / cpu,
               "wall_s": wall, "bytes": len(data)}
        if fmt == "mp3":
            row["snr_db"] = decoded_snr_db(audio, data)
        doc["formats"].append(row)
        print(f"{label:18s} {row['core_s_per_audio_s']:.5f} core-s per audio-s ({row['x_realtime_per_core']:.0f}x "
              "real time per core)" + (f", {row['snr_db']:.1f} dB SNR decoded" if "snr_db" in row else ""), flush=True)
    for n in [int(x) for x in a.threads.split(",") if x.strip()]:
        threads = [threading.Thread(target=encode_all, args=(audio, a.chunk, "mp3", sr, lame)) for _ in range(n)]
        w0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - w0
        doc["mp3_threads"].append({"threads": n, "audio_s_per_s": n * a.seconds / wall})
        print(f"mp3 q{a.quality} on {n} threads: {n * a.seconds / wall:.0f} audio-s/s", flush=True)
    steps = max(1, round(a.seconds * sr / a.chunk))
    for fmt in ("pcm", "mp3") if a.client_path else ():
        row = asyncio.run(client_path(fmt, a.client_path, a.step_ms / 1000, steps, a.encoder_threads, a.chunk, sr,
                                     a.quality))
        doc["client_path"].append(row)
        print(f"client path, {fmt}, {a.client_path} streams: {row['core_s_per_audio_s']:.5f} core-s per audio-s "
              f"({row['cores']:.2f} cores)", flush=True)
    for n in [int(x) for x in a.burst_threads.split(",") if x.strip()] if a.burst else ():
        row = first_chunk_burst(audio, a.chunk, sr, a.burst, n, a.quality)
        doc["burst"].append(row)
        print(f"burst of {a.burst} first MP3 chunks on {n} threads: the last encoded after {row['last_ms']:.1f} ms, "
              f"the median after {row['median_ms']:.1f} ms", flush=True)
    write_json(a.out, doc)
    return doc
