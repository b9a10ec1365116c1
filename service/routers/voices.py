"""Voice caches: /encode_latents, /add_prompt, /add_reference, /add_hifi, their DELETEs and GET listings.
Ids are content hashes of (kind, uploaded bytes, transcript): registering the same clip again is a cache
hit that skips encoding."""

from __future__ import annotations

import asyncio
import base64

from fastapi import APIRouter, HTTPException

from engine.vocabulary import REF_MARKER_TOKENS
from service.conditioning import b64decode, encode_clip, latent_patches, voice_of
from service.deps import LoadedState, State
from service.schemas import (
    AddHifiRequest,
    AddHifiResponse,
    AddPromptRequest,
    AddPromptResponse,
    AddReferenceRequest,
    AddReferenceResponse,
    Deleted,
    EncodeLatentsRequest,
    EncodeLatentsResponse,
    VoiceInfo,
    VoiceList,
)
from service.state import ServiceState
from service.voice_store import Voice, VoiceSummary, VoiceTooLargeError, voice_id

router = APIRouter(tags=["voices"])


def _facts(state: ServiceState) -> dict:
    return {"feat_dim": state.feat_dim, "sample_rate": state.sample_rate, "channels": 1}


def voice_info(state: ServiceState, v: VoiceSummary) -> VoiceInfo:
    row = state.frame_bytes
    return VoiceInfo(id=v.id, kind=v.kind, prompt_text=v.prompt_text, prompt_frames=v.prompt_bytes // row,
                     ref_frames=v.ref_bytes // row, nbytes=v.nbytes, created=v.created)


async def _check_fits(state: ServiceState, prompt_text: str, latents: bytes | None,
                      ref_latents: bytes | None = None) -> None:
    """A voice that alone fills the model's context could never be used: refused before it is cached, naming the
    larger part (its transcript's tokens, or its audio's patches: as continuation prompt and, for a HiFi voice, as
    reference too, with the reference's two marker tokens)."""
    info, tokenizer = state.model, state.pool.client.tokenizer
    if tokenizer is None:  # the worker tokenizes (and refuses at the first use)
        return
    text = len(await asyncio.to_thread(tokenizer.encode, prompt_text)) if prompt_text else 0  # megabytes: off the loop
    audio, ref = latent_patches(state, latents), latent_patches(state, ref_latents)
    markers = REF_MARKER_TOKENS if ref_latents is not None else 0
    total = text + audio + ref + markers
    if total + 3 > info.max_model_len:  # + one token of a text, the audio-start token and one patch to generate
        field = "prompt_text" if text >= audio + ref else "wav_base64"
        parts = []
        if latents is not None:
            role = " as the prompt" if ref_latents is not None else ""
            parts += [f"{text} of transcript", f"{audio} of audio{role}"]
        if ref_latents is not None:
            parts.append(f"{ref} of audio as the reference and its {markers} marker tokens")
        alone = "; /add_prompt and /add_reference take the clip in one role" if latents is not None and ref_latents \
            is not None else ""
        raise HTTPException(422, f"{field}: the voice is {total} tokens ({', '.join(parts)}), which leaves no room "
                                 f"for a text within max_model_len={info.max_model_len}{alone}")


async def _cached(state: ServiceState, vid: str) -> bool:
    return await state.store.get(vid) is not None


@router.post("/encode_latents", response_model=EncodeLatentsResponse)
async def encode_latents(req: EncodeLatentsRequest, state: LoadedState) -> EncodeLatentsResponse:
    """An audio clip -> float32 latents (continuation-prompt padding), for prompt_latents_base64."""
    data = await b64decode(req.wav_base64, "wav_base64")
    lat = await encode_clip(state, data, req.wav_format, "left", "wav_base64")
    return EncodeLatentsResponse(prompt_latents_base64=base64.b64encode(lat).decode(), **_facts(state))


@router.post("/add_prompt", response_model=AddPromptResponse)
async def add_prompt(req: AddPromptRequest, state: LoadedState) -> AddPromptResponse:
    """Cache a continuation prompt (clip + transcript); use it as prompt_id."""
    data = await b64decode(req.wav_base64, "wav_base64")
    pid = await asyncio.to_thread(voice_id, "prompt", data, req.prompt_text)  # hashing megabytes: off the loop
    if not await _cached(state, pid):
        lat = await encode_clip(state, data, req.wav_format, "left", "wav_base64")
        await _check_fits(state, req.prompt_text, lat)
        await state.store.put(Voice("prompt", pid, prompt_text=req.prompt_text, prompt_latents=lat))
    return AddPromptResponse(prompt_id=pid, **_facts(state))


@router.post("/add_reference", response_model=AddReferenceResponse)
async def add_reference(req: AddReferenceRequest, state: LoadedState) -> AddReferenceResponse:
    """Cache a reference clip (VoxCPM2 reference-audio condition); use it as ref_audio_id."""
    data = await b64decode(req.wav_base64, "wav_base64")
    rid = await asyncio.to_thread(voice_id, "reference", data)
    if not await _cached(state, rid):
        lat = await encode_clip(state, data, req.wav_format, "right", "wav_base64")
        await _check_fits(state, "", None, lat)
        await state.store.put(Voice("reference", rid, ref_latents=lat))
    return AddReferenceResponse(reference_id=rid, **_facts(state))


@router.post("/add_hifi", response_model=AddHifiResponse)
async def add_hifi(req: AddHifiRequest, state: LoadedState) -> AddHifiResponse:
    """Cache one clip in both roles ("Ultimate cloning"): continuation prompt with its transcript and
    reference. Also registers the prompt and the reference alone."""
    data = await b64decode(req.wav_base64, "wav_base64")
    hid, pid, rid = await asyncio.to_thread(lambda: (voice_id("hifi", data, req.prompt_text),
                                                     voice_id("prompt", data, req.prompt_text),
                                                     voice_id("reference", data)))
    if not (await _cached(state, hid) and await _cached(state, pid) and await _cached(state, rid)):
        # one upload, one decode on our side; the engine pads the clip differently for each role
        prompt_lat, ref_lat = await asyncio.gather(encode_clip(state, data, req.wav_format, "left", "wav_base64"),
                                                   encode_clip(state, data, req.wav_format, "right", "wav_base64"))
        await _check_fits(state, req.prompt_text, prompt_lat, ref_lat)  # as a HiFi voice: both roles at once
        voices = [Voice("prompt", pid, prompt_text=req.prompt_text, prompt_latents=prompt_lat),
                  Voice("reference", rid, ref_latents=ref_lat),
                  Voice("hifi", hid, prompt_text=req.prompt_text, prompt_latents=prompt_lat, ref_latents=ref_lat,
                        parts={"prompt_id": pid, "reference_id": rid})]
        try:  # before any is added: the last would evict the first (an id answered that is gone)
            state.store.check_holds(voices)
        except VoiceTooLargeError as e:
            raise HTTPException(413, f"wav_base64: the HiFi voice and its prompt and reference: {e}") from e
        for voice in voices:
            await state.store.put(voice)
    return AddHifiResponse(hifi_id=hid, prompt_id=pid, reference_id=rid, **_facts(state))


async def _delete(state: ServiceState, vid: str, kind: str, field: str) -> Deleted:
    await voice_of(state, vid, kind, field)
    if not await state.store.delete(vid):  # deleted meanwhile (by another request or replica): one of them did it
        raise HTTPException(404, f"{field}: no cached {kind} {vid!r} (deleted meanwhile)")
    return Deleted(deleted=vid)


@router.delete("/prompts/{prompt_id}", response_model=Deleted)
async def delete_prompt(prompt_id: str, state: State) -> Deleted:
    return await _delete(state, prompt_id, "prompt", "prompt_id")


@router.delete("/references/{reference_id}", response_model=Deleted)
async def delete_reference(reference_id: str, state: State) -> Deleted:
    return await _delete(state, reference_id, "reference", "reference_id")


@router.delete("/hifi/{hifi_id}", response_model=Deleted)
async def delete_hifi(hifi_id: str, state: State) -> Deleted:
    """Removes the bundle; the prompt and reference registered with it stay until deleted or evicted."""
    return await _delete(state, hifi_id, "hifi", "hifi_id")


async def _listing(state: ServiceState, kind: str) -> VoiceList:
    return VoiceList(voices=[voice_info(state, v) for v in await state.store.list(kind)])


@router.get("/prompts", response_model=VoiceList)
async def list_prompts(state: LoadedState) -> VoiceList:
    return await _listing(state, "prompt")


@router.get("/references", response_model=VoiceList)
async def list_references(state: LoadedState) -> VoiceList:
    return await _listing(state, "reference")


@router.get("/hifi", response_model=VoiceList)
async def list_hifi(state: LoadedState) -> VoiceList:
    return await _listing(state, "hifi")
