"""Audio out: float32 chunks -> MP3 (streaming, one LAME encoder per response), raw 16-bit PCM, WAV, FLAC, Opus,
and server-sent events around MP3 or PCM.

Each response gets one *encoder*: a callable (chunk, is_last) -> bytes | None that the engine client runs on
its encoder threads (a stream's chunks in order, one thread at a time), so the CPU work of encoding spreads
over cores and never runs on the event loop. LAME releases the GIL while it encodes; numpy's conversion to
16-bit does too. An encoder with set-up work has a `prepare()`, which the client runs on an encoder thread
when the request is sent, so that work is done while the engine prefills, not on the way to the first audio.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable

import lameenc
import numpy as np
import soundfile as sf

from engine.io.audio import pcm16, resample
from service.retime import AudioStages, audio_stages

MEDIA_TYPES = {"mp3": "audio/mpeg", "wav": "audio/wav", "flac": "audio/flac", "opus": "audio/ogg",
               "pcm": "audio/pcm"}
STREAMED = ("mp3", "pcm")  # formats sent as they are generated; the others are whole files
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # the only rates Opus encodes

Encoder = Callable[[np.ndarray, bool], "bytes | None"]


class Mp3Encoder:
    """One MP3 stream: frames carry no container header, so the bytes are playable from the first frame on and
    concatenating the outputs gives one valid file."""

    def __init__(self, sample_rate: int, bitrate_kbps: int, quality: int) -> None:
        self._enc = lameenc.Encoder()
        self._enc.set_bit_rate(bitrate_kbps)
        self._enc.set_in_sample_rate(sample_rate)
        self._enc.set_channels(1)
        self._enc.set_quality(quality)

    def prepare(self) -> None:
        """LAME's set-up (lame_init_params, ~1 ms a stream): lameenc runs it on the first encode, so encoding
        nothing runs it now (the output is the same; a test checks it)."""
        self._enc.encode(b"")

    def __call__(self, samples: np.ndarray, last: bool) -> bytes | None:
        # LAME refuses to flush a stream that never encoded (an empty live session): encoding nothing starts it.
        out = bytes(self._enc.encode(pcm16(samples))) if len(samples) or last else b""
        if last:
            out += bytes(self._enc.flush())
        return out or None


def pcm_encoder(samples: np.ndarray, last: bool) -> bytes | None:
    """Raw little-endian signed 16-bit mono."""
    return pcm16(samples) or None


class FileEncoder:
    """A whole WAV, FLAC or Opus file, made when the last chunk arrives (16-bit samples gathered until then)."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        self.fmt, self.sample_rate = fmt, sample_rate
        self._parts: list[bytes] = []

    def __call__(self, samples: np.ndarray, last: bool) -> bytes | None:
        self._parts.append(pcm16(samples))
        if not last:
            return None
        ints = np.frombuffer(b"".join(self._parts), "<i2")
        self._parts = []
        return encode_file(ints, self.sample_rate, self.fmt)


class SseEncoder:
    """OpenAI's stream_format=sse: each piece of the inner encoder's output as a `speech.audio.delta` event."""

    def __init__(self, inner: Encoder) -> None:
        self.inner = inner
        if hasattr(inner, "prepare"):
            self.prepare = inner.prepare

    def __call__(self, samples: np.ndarray, last: bool) -> bytes | None:
        data = self.inner(samples, last)
        if not data:
            return None
        return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})


def sse_event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def make_encoder(fmt: str, sample_rate: int, mp3_bitrate_kbps: int = 192, mp3_quality: int = 3,
                 sse: bool = False, speed: float = 1.0, out_rate: int | None = None) -> Encoder:
    """The encoder of one response in `fmt` (one of MEDIA_TYPES) for audio at `sample_rate`: played `speed` times as
    fast (same pitch) and resampled to `out_rate` where asked (service.retime), else exactly today's encoder."""
    stages = audio_stages(sample_rate, speed, out_rate)
    rate = out_rate or sample_rate
    if fmt == "mp3":
        enc: Encoder = Mp3Encoder(rate, mp3_bitrate_kbps, mp3_quality)
    elif fmt == "pcm":
        enc = pcm_encoder
    elif fmt in MEDIA_TYPES:
        enc = FileEncoder(fmt, rate)
    else:
        raise ValueError(f"unknown audio format {fmt!r}")
    if stages:
        enc = AudioStages(stages, enc)
    return SseEncoder(enc) if sse else enc


def encode_file(ints: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """16-bit samples -> a WAV, FLAC or Opus file."""
    buf = io.BytesIO()
    if fmt == "wav":
        sf.write(buf, ints, sample_rate, format="WAV", subtype="PCM_16")
    elif fmt == "flac":
        sf.write(buf, ints, sample_rate, format="FLAC", subtype="PCM_16")
    elif fmt == "opus":
        samples = ints.astype(np.float32) / 32768.0
        if sample_rate not in OPUS_RATES:  # e.g. 44.1 kHz models: Opus needs 48 kHz
            samples, sample_rate = resample(samples, sample_rate, 48000), 48000
        sf.write(buf, samples, sample_rate, format="OGG", subtype="OPUS")
    else:
        raise ValueError(f"unknown file format {fmt!r}")
    return buf.getvalue()


def output_rate(sample_rate: int, fmt: str, requested: int | None = None) -> int:
    """The sample rate a client finds in the file we send (`requested`: the request's sample_rate, if any)."""
    if requested is not None:
        return requested
    return 48000 if fmt == "opus" and sample_rate not in OPUS_RATES else sample_rate
