"""A request's voice fields -> the latents and transcript the engine takes. Every lookup and decode
happens here, before a response starts, and each failure names the field it concerns."""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass, field

import numpy as np
from fastapi import HTTPException

from engine import RequestError
from engine.io.audio import AudioError, clip_duration
from service.errors import ENGINE_REF_FIELDS, http_error
from service.schemas import GenerateRequest
from service.state import ServiceState


@dataclass
class Conditioning:
    prompt_latents: bytes | None = None
    prompt_text: str = ""
    ref_latents: bytes | None = None
    # The engine's voice fields -> the request fields they came from, for the engine's messages (`in_route_terms`).
    terms: dict[str, str] = field(default_factory=dict)

    def name_reference(self, request_field: str) -> None:
        """The engine's every name of the reference (`ENGINE_REF_FIELDS`) is `request_field` in its messages."""
        self.terms.update(dict.fromkeys(ENGINE_REF_FIELDS, request_field))


def latent_patches(state: ServiceState, latents: np.ndarray | bytes | None) -> int:
    """Whole patches of a voice's latents (float32 bytes as stored, or frames), 0 for none."""
    if latents is None:
        return 0
    frames = len(latents) // state.frame_bytes if isinstance(latents, bytes) else len(latents)
    return frames // state.model.patch_size


INLINE_B64_CHARS = 64 * 1024  # larger payloads (audio clips: megabytes) are decoded in a thread


async def b64decode(value: str, field: str) -> bytes:
    """Decode (off the event loop when large: a multi-megabyte clip would stall every stream)."""
    if value.startswith("data:") and "," in value:  # tolerate a data: URI
        value = value.split(",", 1)[1]
    try:
        if len(value) > INLINE_B64_CHARS:
            data = await asyncio.to_thread(base64.b64decode, value, validate=True)
        else:
            data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise HTTPException(400, f"{field}: not valid base64 ({e})") from e
    if not data:
        raise HTTPException(400, f"{field}: decodes to no bytes")
    return data


async def check_clip(state: ServiceState, data: bytes, fmt: str, field: str) -> None:
    """Decodable and not too long, from the file's header, before the clip travels to a worker (which decodes it
    and refuses silent or too short audio)."""
    try:
        seconds = await asyncio.to_thread(clip_duration, data, fmt) if len(data) > INLINE_B64_CHARS \
            else clip_duration(data, fmt)
    except AudioError as e:
        raise HTTPException(400, f"{field}: {e}") from e
    limit = state.settings.max_audio_seconds
    if seconds > limit:
        raise HTTPException(413, f"{field}: {seconds:.1f} s of audio is longer than this service takes "
                                 f"({limit:g} s)")


async def encode_clip(state: ServiceState, data: bytes, fmt: str, padding: str, field: str) -> bytes:
    await check_clip(state, data, fmt, field)
    try:
        return await state.pool.encode_latents(data, fmt, padding=padding)
    except RequestError as e:
        raise http_error(e, field) from e


def check_latents(state: ServiceState, raw: bytes, field: str) -> bytes:
    """float32 (frames, feat_dim), frames a positive multiple of the patch size, all finite."""
    row = state.frame_bytes
    patch = state.model.patch_size
    if len(raw) % row:
        raise HTTPException(400, f"{field}: {len(raw)} bytes is not float32 rows of feat_dim={state.feat_dim} "
                                 f"({row} bytes each)")
    frames = len(raw) // row
    if frames == 0 or frames % patch:
        raise HTTPException(400, f"{field}: {frames} frames; must be a positive multiple of patch_size={patch}")
    if not np.isfinite(np.frombuffer(raw, dtype=np.float32)).all():
        raise HTTPException(400, f"{field}: contains NaN or infinity")
    return raw


async def voice_of(state: ServiceState, voice_id: str, kind: str, field: str):
    v = await state.store.get(voice_id)
    if v is None or v.kind != kind:
        raise HTTPException(404, f"{field}: no cached {kind} {voice_id!r} (unknown, deleted or evicted)")
    return v


async def resolve(state: ServiceState, req: GenerateRequest) -> Conditioning:
    """The combination rules are already checked by the schema; this decodes and looks up."""
    cond = Conditioning()

    async def prompt() -> None:
        if req.prompt_wav_base64 is not None:
            data = await b64decode(req.prompt_wav_base64, "prompt_wav_base64")
            cond.prompt_latents = await encode_clip(state, data, req.prompt_wav_format, "left", "prompt_wav_base64")
            cond.prompt_text = req.prompt_text or ""
            cond.terms["prompt_latents"] = "prompt_wav_base64"
        elif req.prompt_latents_base64 is not None:
            raw = await b64decode(req.prompt_latents_base64, "prompt_latents_base64")
            cond.prompt_latents = check_latents(state, raw, "prompt_latents_base64")
            cond.prompt_text = req.prompt_text or ""
            cond.terms["prompt_latents"] = "prompt_latents_base64"
        elif req.prompt_id is not None:
            v = await voice_of(state, req.prompt_id, "prompt", "prompt_id")
            cond.prompt_latents, cond.prompt_text = v.prompt_latents, v.prompt_text
            cond.terms.update(prompt_text="prompt_id", prompt_latents="prompt_id")
        elif req.hifi_id is not None:
            v = await voice_of(state, req.hifi_id, "hifi", "hifi_id")
            cond.prompt_latents, cond.prompt_text, cond.ref_latents = v.prompt_latents, v.prompt_text, v.ref_latents
            cond.terms.update(prompt_text="hifi_id", prompt_latents="hifi_id")
            cond.name_reference("hifi_id")

    async def reference() -> None:
        if req.ref_audio_wav_base64 is not None:
            data = await b64decode(req.ref_audio_wav_base64, "ref_audio_wav_base64")
            cond.ref_latents = await encode_clip(state, data, req.ref_audio_wav_format, "right",
                                                 "ref_audio_wav_base64")
            cond.name_reference("ref_audio_wav_base64")
        elif req.ref_audio_latents_base64 is not None:
            raw = await b64decode(req.ref_audio_latents_base64, "ref_audio_latents_base64")
            cond.ref_latents = check_latents(state, raw, "ref_audio_latents_base64")
            cond.name_reference("ref_audio_latents_base64")
        elif req.ref_audio_id is not None:
            cond.ref_latents = (await voice_of(state, req.ref_audio_id, "reference", "ref_audio_id")).ref_latents
            cond.name_reference("ref_audio_id")

    await asyncio.gather(prompt(), reference())  # both clips encode concurrently
    return cond
