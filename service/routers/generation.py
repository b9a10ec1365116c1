"""POST /generate (streaming MP3 or PCM), /generate_blocking (MP3 or PCM), /generate_blocking_wav (WAV)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from service import conditioning, synthesis
from service.audio import MEDIA_TYPES
from service.deps import LoadedState, mark_audio
from service.schemas import GenerateRequest
from service.state import ServiceState

router = APIRouter(tags=["generation"])
AUDIO = {200: {"content": {"audio/mpeg": {}, "audio/pcm": {}}, "description": "Audio."}}


async def _start(state: ServiceState, req: GenerateRequest, route: str, fmt: str) -> synthesis.Generation:
    params = req.sampling(state.model.max_model_len)
    out_rate = req.output_rate(fmt)
    cond = await conditioning.resolve(state, req)
    return await synthesis.start(state, route, req.target_text, cond, params, fmt, lora_name=req.lora_name,
                                 normalize=req.normalize, speed=req.speed, sample_rate=out_rate)


async def _whole(state: ServiceState, req: GenerateRequest, route: str, fmt: str) -> Response:
    gen = await _start(state, req, route, fmt)
    data = await gen.collect()
    return Response(data, media_type=MEDIA_TYPES[fmt], headers=synthesis.audio_headers(state, fmt, gen))


@router.post("/generate", responses=AUDIO, response_class=Response)
async def generate(req: GenerateRequest, request: Request, state: LoadedState) -> Response:
    """Stream audio as it is generated: MP3 frames (playable from the first bytes) or raw s16le PCM.
    Any error in the request is answered with a 4xx before the stream starts."""
    mark_audio(request)
    gen = await _start(state, req, "/generate", req.response_format)
    return synthesis.stream_response(gen, req.response_format)


@router.post("/generate_blocking", responses=AUDIO, response_class=Response)
async def generate_blocking(req: GenerateRequest, request: Request, state: LoadedState) -> Response:
    """The whole utterance as one MP3 (or PCM) body; `X-Finish-Reason` says why it ended (stop or length)."""
    mark_audio(request)
    return await synthesis.unless_disconnected(request, _whole(state, req, "/generate_blocking",
                                                               req.response_format))


@router.post("/generate_blocking_wav", responses={200: {"content": {"audio/wav": {}}}}, response_class=Response)
async def generate_blocking_wav(req: GenerateRequest, request: Request, state: LoadedState) -> Response:
    """The whole utterance as one 16-bit WAV file (response_format is ignored)."""
    mark_audio(request)
    return await synthesis.unless_disconnected(request, _whole(state, req, "/generate_blocking_wav", "wav"))
