"""OpenAI-compatible speech: POST /v1/audio/speech, GET /v1/audio/voices, GET /v1/models (and /v1/models/{model}).
The official `openai` client works unmodified (client.audio.speech.create / with_streaming_response, models.list /
retrieve); `voice` is "default" (zero-shot) or a cached voice's id, as a string or OpenAI's {"id": ...} (OpenAI's
built-in voice names are unknown here, 400, unless NANOVLLM_VOICE_ALIASES names them); `input` is spoken as written
(a voice description comes in `instructions`); `pcm` is 24 kHz as OpenAI's unless sample_rate says otherwise;
requests it cannot take as sent are 400s, as OpenAI's."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response

from engine import PoolError
from service import longform, synthesis
from service.audio import MEDIA_TYPES, STREAMED
from service.conditioning import Conditioning
from service.deps import LoadedState, State, mark_audio
from service.errors import http_error
from service.routers.voices import voice_info
from service.schemas import ModelCard, ModelList, SpeechRequest, VoiceList
from service.shared_adapters import sync_adapters
from service.state import ServiceState

router = APIRouter(prefix="/v1", tags=["openai"])
# what OpenAI examples and its client's model names send: served by our model
OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-03-20",
                      "gpt-4o-mini-tts-2025-12-15")


async def adapter_ids(state: ServiceState, wanted: str | None = None) -> list[str]:
    """The runtime LoRA adapters, each a model id of its own (`wanted`: the one a request names, waited for while
    it downloads)."""
    await sync_adapters(state, wanted)
    try:
        return [a.name for a in await state.runtime_adapters()]
    except PoolError as e:
        raise http_error(e) from e


def model_ids(state: ServiceState) -> list[str]:
    return [state.model_id, "voxcpm", *OPENAI_MODEL_NAMES]


async def _voice(state: ServiceState, voice: str) -> Conditioning:
    voice = state.settings.voice_alias_map().get(voice, voice)  # NANOVLLM_VOICE_ALIASES (OpenAI's names, ...)
    if voice == "default":
        return Conditioning()
    v = await state.store.get(voice)
    if v is None:
        # 400 as OpenAI answers a voice it does not have (404 on the native routes: an id unknown or evicted)
        raise HTTPException(400, f"voice: unknown voice {voice!r}; use 'default' or an id from /v1/audio/voices")
    return Conditioning(prompt_latents=v.prompt_latents, prompt_text=v.prompt_text, ref_latents=v.ref_latents)


@router.post("/audio/speech", response_class=Response,
             responses={200: {"content": {t: {} for t in (*MEDIA_TYPES.values(), "text/event-stream")}}})
async def speech(req: SpeechRequest, request: Request, state: LoadedState) -> Response:
    """mp3 and pcm stream as they are generated; wav, flac and opus are sent whole."""
    lora_name = None
    if req.model not in model_ids(state):
        if req.model not in await adapter_ids(state, req.model):
            raise HTTPException(404, f"model: unknown model {req.model!r}; GET /v1/models lists them")
        lora_name = req.model  # a runtime LoRA adapter of our model
    cond = await _voice(state, req.voice)
    longform.check_length(state, req.input, "input")
    design = longform.design_of(req.instructions)
    fmt, route = req.response_format, "/v1/audio/speech"
    params = req.sampling(state.model.max_model_len)

    async def start(sse: bool, blocking: bool) -> synthesis.Generation | longform.LongGeneration:
        return await longform.generate(state, route, req.input, cond, params, fmt, field="input", blocking=blocking,
                                       retry_badcase=req.retry_badcase, timings=req.timings,
                                       granularity=req.split_granularity, design=design, sse=sse,
                                       lora_name=lora_name, normalize=req.normalize, speed=req.speed,
                                       sample_rate=req.output_rate(fmt))

    if req.stream_format == "sse" or fmt in STREAMED:
        mark_audio(request)  # a stream: its first byte is its first audio
    if req.stream_format == "sse":  # streams: until their first bytes the client may leave (a seat's wait)
        gen = await synthesis.unless_disconnected(request, start(sse=True, blocking=False))
        return synthesis.AudioStreamResponse(gen, "text/event-stream", synthesis.audio_headers(state, fmt, gen),
                                             body=synthesis.sse_body(gen, req.input))
    if fmt in STREAMED:
        return synthesis.stream_response(await synthesis.unless_disconnected(request, start(sse=False,
                                                                                            blocking=False)), fmt)

    async def whole() -> Response:  # sent whole: abort if the client leaves
        gen = await start(sse=False, blocking=True)
        data = await gen.collect()
        headers = synthesis.audio_headers(state, fmt, gen)
        if req.timings:
            headers.update(longform.timing_header(gen))
        return Response(data, media_type=MEDIA_TYPES[fmt], headers=headers)

    return await synthesis.unless_disconnected(request, whole())


@router.get("/audio/voices", response_model=VoiceList)
async def voices(state: State) -> VoiceList:
    """'default' (zero-shot), the names NANOVLLM_VOICE_ALIASES gives, and every cached voice usable as `voice`."""
    default = {"id": "default", "kind": "zero-shot", "nbytes": 0, "created": 0.0}
    aliases = [{"id": name, "kind": "alias", "alias_of": voice, "nbytes": 0, "created": 0.0}
               for name, voice in state.settings.voice_alias_map().items()]
    cached = [voice_info(state, v) for v in await state.store.list()] if state.loaded else []
    return VoiceList(voices=[default, *aliases, *cached])


@router.get("/models", response_model=ModelList)
async def models(state: State) -> ModelList:
    return ModelList(data=[ModelCard(id=m) for m in (*model_ids(state), *await adapter_ids(state))])


@router.get("/models/{model}", response_model=ModelCard)
async def model(model: str, state: State) -> ModelCard:
    if model not in model_ids(state) and model not in await adapter_ids(state, model):
        raise HTTPException(404, f"model: unknown model {model!r}; GET /v1/models lists them")
    return ModelCard(id=model)
