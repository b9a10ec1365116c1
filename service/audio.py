"""Audio out: float32 chunks -> MP3 (streaming, one lameenc encoder per stream), WAV, FLAC, Opus, raw PCM.
Callers run the encoders in a thread (`asyncio.to_thread`): LAME is CPU work that must not stall the loop."""

from __future__ import annotations

import io

import lameenc
import numpy as np
import soundfile as sf

from engine.audio import resample

MEDIA_TYPES = {"mp3": "audio/mpeg", "wav": "audio/wav", "flac": "audio/flac", "opus": "audio/ogg",
               "pcm": "audio/pcm"}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # the only rates Opus encodes


def pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> little-endian signed 16-bit PCM."""
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class Mp3Stream:
    """One MP3 encoder for one response: frames carry no container header, so the bytes are playable from
    the first frame on and concatenating the outputs gives one valid file."""

    def __init__(self, sample_rate: int, bitrate_kbps: int, quality: int) -> None:
        self._enc = lameenc.Encoder()
        self._enc.set_bit_rate(bitrate_kbps)
        self._enc.set_in_sample_rate(sample_rate)
        self._enc.set_channels(1)
        self._enc.set_quality(quality)

    def encode(self, samples: np.ndarray) -> bytes:
        return bytes(self._enc.encode(pcm16(samples)))

    def flush(self) -> bytes:
        return bytes(self._enc.flush())


def encode_whole(samples: np.ndarray, sample_rate: int, fmt: str, bitrate_kbps: int = 192, quality: int = 2) -> bytes:
    """A whole utterance in one of MEDIA_TYPES' formats."""
    if fmt == "pcm":
        return pcm16(samples)
    if fmt == "mp3":
        enc = Mp3Stream(sample_rate, bitrate_kbps, quality)
        return enc.encode(samples) + enc.flush()
    buf = io.BytesIO()
    ints = np.frombuffer(pcm16(samples), "<i2")  # the same 16-bit samples as the pcm format
    if fmt == "wav":
        sf.write(buf, ints, sample_rate, format="WAV", subtype="PCM_16")
    elif fmt == "flac":
        sf.write(buf, ints, sample_rate, format="FLAC", subtype="PCM_16")
    elif fmt == "opus":
        if sample_rate not in OPUS_RATES:  # e.g. 44.1 kHz models: Opus needs 48 kHz
            samples, sample_rate = resample(samples, sample_rate, 48000), 48000
        sf.write(buf, samples, sample_rate, format="OGG", subtype="OPUS")
    else:
        raise ValueError(f"unknown audio format {fmt!r}")
    return buf.getvalue()


def output_rate(sample_rate: int, fmt: str) -> int:
    """The sample rate a client finds in the file we send."""
    return 48000 if fmt == "opus" and sample_rate not in OPUS_RATES else sample_rate
