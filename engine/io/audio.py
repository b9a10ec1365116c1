"""Audio in and out: decode uploaded audio, resample, turn a clip into latents, float samples to 16-bit PCM.

Resampling uses soxr at "HQ" quality, which is what librosa.load (the official VoxCPM2 loader)
uses by default, so a clip at any rate encodes to the same latents as in the official package.
Torch is imported only by `encode_latents`: the service's API processes use the rest without it.
"""

from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING

import numpy as np
import soundfile as sf
import soxr

if TYPE_CHECKING:
    import torch

    from engine.models.audio_vae import AudioVAE


class AudioError(ValueError):
    """Audio that cannot be decoded or used; the message says why."""


MIN_CLIP_SECONDS = 0.1  # shorter is no voice to follow, only padding
SILENCE_PEAK_DBFS = -60.0  # a clip whose loudest sample is below this holds no voice (latents of silence)


def _decode_failure(fmt: str | None, err: Exception) -> AudioError:
    """libsndfile's reason, without the in-memory file's repr it starts with ("Error opening <_io.BytesIO ...>: ")."""
    reason = re.sub(r"^Error opening <[^>]*>: ", "", str(err)).strip() or type(err).__name__
    return AudioError(f"could not decode audio ({fmt or 'unknown format'}): {reason}")


def clip_duration(data: bytes, fmt: str | None = None) -> float:
    """Seconds of audio in a file, from its header alone (no decoding): checks a limit before the work."""
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as e:  # libsndfile raises several types for corrupt input
        raise _decode_failure(fmt, e) from e
    if info.frames <= 0 or info.samplerate <= 0:
        raise AudioError("audio is empty")
    return info.frames / info.samplerate


def decode_audio(data: bytes, fmt: str | None = None) -> tuple[np.ndarray, int]:
    """Any container libsndfile reads (wav, flac, ogg, mp3, ...) -> mono float32 samples, sample rate.
    The container is detected from the bytes; `fmt` (the client's claim) only labels errors."""
    try:
        samples, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # libsndfile raises several types for corrupt input
        raise _decode_failure(fmt, e) from e
    if samples.size == 0:
        raise AudioError("audio is empty")
    mono = samples.mean(axis=1).astype(np.float32)
    if mono.size < MIN_CLIP_SECONDS * sr:
        raise AudioError(f"audio is {mono.size / sr:.3f} s long; a clip needs at least {MIN_CLIP_SECONDS} s")
    if not np.isfinite(mono).all():
        raise AudioError("audio contains NaN or infinite samples")
    peak = float(np.abs(mono).max())
    if peak < 10 ** (SILENCE_PEAK_DBFS / 20):
        level = f"peak {20 * np.log10(peak):.0f} dBFS" if peak > 0 else "all samples zero"
        raise AudioError(f"audio is silent ({level}; a voice clip peaks above {SILENCE_PEAK_DBFS:.0f} dBFS)")
    return mono, int(sr)


def resample(samples: np.ndarray, sr: int, target_sr: int) -> np.ndarray:
    if sr == target_sr:
        return samples.astype(np.float32)
    return soxr.resample(samples, sr, target_sr, quality="HQ").astype(np.float32)


def pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> little-endian signed 16-bit PCM: round(clip(x, -1, 1) * 32767), computed in place on one
    scaled copy (clipping after the scaling gives the same float32 values; it runs for every chunk of every stream)."""
    y = np.multiply(samples, 32767.0, dtype=np.float32)
    np.clip(y, -32767.0, 32767.0, out=y)
    np.rint(y, out=y)
    return y.astype("<i2").tobytes()


def encode_latents(vae: AudioVAE, samples: np.ndarray, sr: int, patch_size: int,
                   padding: str = "left") -> torch.Tensor:
    """A clip -> (frames, latent_dim) float32 latents, frames a multiple of patch_size.

    The clip is zero-padded to whole patches before encoding: on the left for a continuation prompt
    (so no silence sits between the prompt and the generated speech), on the right for a reference.
    """
    import torch

    if padding not in ("left", "right"):
        raise ValueError("padding must be left or right")
    audio = torch.from_numpy(resample(samples, sr, vae.sample_rate)).unsqueeze(0)
    if audio.shape[1] < vae.chunk_size:
        raise AudioError(f"audio is shorter than one latent frame ({vae.chunk_size / vae.sample_rate * 1000:.0f} ms)")
    patch_len = patch_size * vae.chunk_size
    pad = -audio.shape[1] % patch_len
    audio = torch.nn.functional.pad(audio, (pad, 0) if padding == "left" else (0, pad))
    device = next(vae.parameters()).device
    cudnn = torch.backends.cudnn
    # Every clip length is a new shape: cuDNN's benchmark mode (on for the decode's fixed shapes) would search
    # algorithms for each of the encoder's convolutions again, per upload.
    with torch.inference_mode(), cudnn.flags(enabled=cudnn.enabled, benchmark=False,
                                             deterministic=cudnn.deterministic, allow_tf32=cudnn.allow_tf32):
        return vae.encode(audio.to(device), vae.sample_rate)[0].T.float().cpu().contiguous()
