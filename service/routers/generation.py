"""POST /generate (streaming MP3 or PCM), /generate_blocking (MP3 or PCM), /generate_blocking_wav (WAV)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from service import conditioning, longform, synthesis
from service.audio import MEDIA_TYPES
from service.deps import LoadedState, mark_audio
from service.schemas import GenerateRequest
from service.state import ServiceState

router = APIRouter(tags=["generation"])
AUDIO = {200: {"content": {"audio/mpeg": {}, "audio/pcm": {}}, "description": "Audio."}}


async def _start(state: ServiceState, req: GenerateRequest, route: str, fmt: str,
                 blocking: bool) -> synthesis.Generation | longform.LongGeneration:
    longform.check_length(state, req.target_text, "target_text")
    params = req.sampling(state.model.max_model_len)
    out_rate = req.output_rate(fmt)
    cond = await conditioning.resolve(state, req)
    design, text = longform.split_design(req.target_text)
    return await longform.generate(state, route, text, cond, params, fmt, field="target_text", blocking=blocking,
                                   retry_badcase=req.retry_badcase, timings=req.timings,
                                   granularity=req.split_granularity, design=design, lora_name=req.lora_name,
                                   normalize=req.normalize, speed=req.speed, sample_rate=out_rate)


async def _whole(state: ServiceState, req: GenerateRequest, route: str, fmt: str) -> Response:
    gen = await _start(state, req, route, fmt, blocking=True)
    data = await gen.collect()
    headers = synthesis.audio_headers(state, fmt, gen)
    if req.timings:
        headers.update(longform.timing_header(gen))
    return Response(data, media_type=MEDIA_TYPES[fmt], headers=headers)


@router.post("/generate", responses=AUDIO, response_class=Response)
async def generate(req: GenerateRequest, request: Request, state: LoadedState) -> Response:
    """Stream audio as it is generated: MP3 frames (playable from the first bytes) or raw s16le PCM.
    Any error in the request is answered with a 4xx before the stream starts."""
    mark_audio(request)
    gen = await synthesis.unless_disconnected(request, _start(state, req, "/generate", req.response_format,
                                                              blocking=False))
    return synthesis.stream_response(gen, req.response_format)


@router.post("/generate_blocking", responses=AUDIO, response_class=Response)
async def generate_blocking(req: GenerateRequest, request: Request, state: LoadedState) -> Response:
    """The whole utterance as one MP3 (or PCM) body; `X-Finish-Reason` says why it ended (stop or length)."""
    return await synthesis.unless_disconnected(request, _whole(state, req, "/generate_blocking",
                                                               req.response_format))


@router.post("/generate_blocking_wav", responses={200: {"content": {"audio/wav": {}}}}, response_class=Response)
async def generate_blocking_wav(req: GenerateRequest, request: Request, state: LoadedState) -> Response:
    """The whole utterance as one 16-bit WAV file (response_format is ignored)."""
    return await synthesis.unless_disconnected(request, _whole(state, req, "/generate_blocking_wav", "wav"))
