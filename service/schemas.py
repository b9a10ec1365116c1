"""Request and response bodies. Field names are the seed fork's (nano-vllm-voxcpm-hifi) so its clients
work unchanged; the OpenAI speech body follows the OpenAI API."""

from __future__ import annotations

from typing import Literal

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.vocabulary import LORA_NAME_PATTERN, SAMPLING_LIMITS, SamplingParams
from service.retime import OUTPUT_RATES, RESAMPLED_FORMATS, SPEED_MAX, SPEED_MIN

# --- voices ---------------------------------------------------------------------------------------


class WavUpload(BaseModel):
    wav_base64: str = Field(..., min_length=1, description="Base64 of a whole audio file (wav, flac, ogg, mp3).")
    wav_format: str = Field("wav", description="The file's container, e.g. 'wav' (labels errors; the bytes decide).")


class EncodeLatentsRequest(WavUpload):
    pass


class AudioFacts(BaseModel):
    feat_dim: int = Field(..., description="Latent width: reshape latents as (-1, feat_dim) float32.")
    sample_rate: int = Field(..., description="Sample rate of generated audio (Hz).")
    channels: int = Field(1, description="Channels of generated audio.")


class EncodeLatentsResponse(AudioFacts):
    prompt_latents_base64: str = Field(..., description="float32 little-endian bytes shaped (frames, feat_dim).")
    latents_dtype: Literal["float32"] = "float32"


def encodable(v: str | None) -> str | None:
    """Text as UTF-8 encodes it: JSON's escapes can spell a lone UTF-16 half, which no text holds (the tokenizer
    refused it naming no field)."""
    try:
        if v is not None:
            v.encode()
    except UnicodeEncodeError:
        raise ValueError("holds an unpaired surrogate (a lone \\ud800-\\udfff escape)") from None
    return v


def not_blank(v: str) -> str:
    """Text the model speaks or follows: whitespace alone is no text (nor a lone surrogate: `encodable`)."""
    if not v.strip():
        raise ValueError("must contain non-space characters")
    encodable(v)
    return v


class AddPromptRequest(WavUpload):
    prompt_text: str = Field(..., min_length=1, description="Transcript of the clip (continuation prompt).")

    _prompt_text = field_validator("prompt_text")(not_blank)


class AddPromptResponse(AudioFacts):
    prompt_id: str


class AddReferenceRequest(WavUpload):
    pass


class AddReferenceResponse(AudioFacts):
    reference_id: str


class AddHifiRequest(AddPromptRequest):
    prompt_text: str = Field(..., min_length=1, description="Transcript of the clip.")


class AddHifiResponse(AudioFacts):
    hifi_id: str = Field(..., description="The clip as continuation prompt and as reference at once.")
    prompt_id: str = Field(..., description="The same clip as a prompt alone.")
    reference_id: str = Field(..., description="The same clip as a reference alone.")


class VoiceInfo(BaseModel):
    id: str
    kind: Literal["prompt", "reference", "hifi", "zero-shot", "alias"]  # zero-shot: /v1's "default" voice
    alias_of: str | None = Field(None, description="The voice an alias names (NANOVLLM_VOICE_ALIASES; /v1 only).")
    prompt_text: str = ""
    prompt_frames: int = Field(0, description="Latent frames of the continuation prompt.")
    ref_frames: int = Field(0, description="Latent frames of the reference.")
    nbytes: int
    created: float = Field(..., description="Unix time it was added.")


class VoiceList(BaseModel):
    voices: list[VoiceInfo]


class Deleted(BaseModel):
    deleted: str = Field(..., description="The id removed.")


# --- LoRA adapters --------------------------------------------------------------------------------

LORA_NAME = LORA_NAME_PATTERN
VOICE_ID_MAX_CHARS = 128  # a cached voice's id is 24 hex digits; a longer one is no id (and is not echoed back)
MODEL_ID_MAX_CHARS = 256  # a model id, an adapter's name (64) or a hub id: a longer one is none (and not echoed back)


class RegisterLoRARequest(BaseModel):
    lora_name: str = Field(..., pattern=LORA_NAME, description="The adapter's name, as requests give it (lora_name, "
                                                               "or the OpenAI route's model).")
    lora_uri: str = Field(..., min_length=1, max_length=2048,
                          description="Its weights (official format): https:// or s3://bucket/key of "
                                      "lora_weights.safetensors (lora_config.json beside it), "
                                      "hf://owner/repo@revision?path=..., or a path / file:// inside "
                                      "NANOVLLM_LORA_DIR.")
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$", description="SHA-256 of the weights file: "
                                                                               "refused (400) when it differs.")


class LoRAInfo(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # made from the engine's AdapterInfo

    name: str
    source: str = Field(..., description="The weights file the workers read.")
    rank: int
    layers: int = Field(..., description="Layers it adapts.")
    resident: bool = Field(..., description="In a GPU slot now (else loaded on its next request).")
    slot: int | None = None
    requests: int = Field(0, description="Requests using it now.")


class LoRAList(BaseModel):
    loras: list[LoRAInfo]


# --- generation -----------------------------------------------------------------------------------

def _limited(name: str, default: float | None) -> object:
    """A sampling field with the engine's bounds and description (engine.serving.protocol.SAMPLING_LIMITS)."""
    b = SAMPLING_LIMITS[name]
    return Field(default, ge=b.low, le=b.high, description=b.doc)


TEXT_CHARS_CEILING = 10_000_000  # the schema's bound; the service's own (NANOVLLM_MAX_TEXT_CHARS) is checked per route
DEFAULT_GENERATE_LENGTH = 2000  # the seed fork's default, capped by the deployment's max_model_len


class SamplingFields(BaseModel):
    """The sampling parameters every generation route takes, bounded as the engine bounds them."""

    model_config = ConfigDict(allow_inf_nan=False)  # NaN (JSON's `NaN`) was refused as "less than or equal to 10"

    max_generate_length: int | None = Field(
        None, ge=SAMPLING_LIMITS["max_generate_length"].low, le=SAMPLING_LIMITS["max_generate_length"].high,
        description=f"{SAMPLING_LIMITS['max_generate_length'].doc} At most the service's max_model_len (GET /info); "
                    f"default {DEFAULT_GENERATE_LENGTH} or max_model_len if smaller.")
    temperature: float = _limited("temperature", 1.0)
    cfg_value: float = _limited("cfg_value", 2.0)
    min_len: int = _limited("min_len", 2)
    seed: int | None = _limited("seed", None)

    def sampling(self, max_model_len: int) -> SamplingParams:
        """The engine's parameters; a max_generate_length the model can never reach is the caller's error."""
        length = self.max_generate_length
        if length is None:
            length = min(DEFAULT_GENERATE_LENGTH, max_model_len)
        elif length > max_model_len:
            raise HTTPException(422, f"max_generate_length: {length} is more than this service can generate in one "
                                     f"request (max_model_len = {max_model_len})")
        return SamplingParams(max_generate_length=length, temperature=self.temperature, cfg_value=self.cfg_value,
                              min_len=self.min_len, seed=self.seed)


def normalize_field() -> object:
    return Field(False, description="Speak numbers, amounts, dates, times, units, percentages, phone numbers and words "
                                    "in capitals as words (English and Chinese; docs/normalization.md). Off: the text "
                                    "is spoken as written.")


OutputRate = Literal[OUTPUT_RATES]  # type: ignore[valid-type]


class PlaybackFields(BaseModel):
    """How the generated audio is played back: its speed and, for raw and WAV output, its sample rate."""

    model_config = ConfigDict(allow_inf_nan=False)

    speed: float = Field(1.0, ge=SPEED_MIN, le=SPEED_MAX,
                         description=f"Playback speed, {SPEED_MIN}-{SPEED_MAX}, at the same pitch (time-stretched "
                                     "after generation; 1.0 = the model's own pace, untouched). Intelligibility "
                                     "drops past about 2.5 (docs/http-api.md, Speed).")
    sample_rate: OutputRate | None = Field(  # type: ignore[valid-type]
        None, description=f"Output sample rate in Hz for {' and '.join(RESAMPLED_FORMATS)} (one of "
                          f"{', '.join(map(str, OUTPUT_RATES))}; resampled with soxr). Default: the model's rate "
                          "(GET /info).")

    def output_rate(self, fmt: str) -> int | None:
        """The requested rate for a response in `fmt`, or a 422 naming sample_rate where `fmt` cannot take one."""
        if self.sample_rate is not None and fmt not in RESAMPLED_FORMATS:
            raise HTTPException(422, f"sample_rate: only {' and '.join(RESAMPLED_FORMATS)} output can be resampled "
                                     f"(this response is {fmt}); drop sample_rate or ask for pcm or wav")
        return self.sample_rate


class LongFormFields(BaseModel):
    """How a text longer than one segment is spoken (docs/long-form.md)."""

    retry_badcase: bool | None = Field(None, description="Generate a segment again with the next seed when it reaches "
                                                         "its length cap (it never stopped), up to "
                                                         "NANOVLLM_BADCASE_TRIES times. Unset: on for blocking routes "
                                                         "of texts split into segments, off when streaming (true "
                                                         "holds back each segment until it is done).")
    timings: bool = Field(False, description="Per-segment timings (index, offsets into the text, start_s, "
                                             "duration_s): the X-Segment-Timings header on whole responses; "
                                             "stream_format=sse sends speech.segment events; a streamed response "
                                             "without SSE has no place for them (422).")
    split_granularity: Literal["sentence", "clause"] = Field(
        "sentence", description="Where a long text's segments may end: whole sentences (a longer one cut at "
                                "clauses, then spaces), or any clause.")


PROMPT_FORMS = "prompt_wav_base64 + prompt_text | prompt_latents_base64 + prompt_text | prompt_id | hifi_id"
REF_FORMS = "ref_audio_wav_base64 | ref_audio_latents_base64 | ref_audio_id"


class GenerateRequest(SamplingFields, PlaybackFields, LongFormFields):
    target_text: str = Field(..., min_length=1, max_length=TEXT_CHARS_CEILING,
                             description="Text to speak, up to NANOVLLM_MAX_TEXT_CHARS characters; a long one is "
                                         "split into segments (docs/long-form.md). '(description)text' = voice "
                                         "design.")
    prompt_wav_base64: str | None = Field(None, description="Continuation prompt: base64 audio file.")
    prompt_wav_format: str = Field("wav", description="Container of prompt_wav_base64.")
    prompt_text: str | None = Field(None, description="Transcript of the prompt audio (with a prompt form).")
    prompt_latents_base64: str | None = Field(None, description="Continuation prompt as /encode_latents latents.")
    prompt_id: str | None = Field(None, max_length=VOICE_ID_MAX_CHARS, description="A prompt from /add_prompt.")
    hifi_id: str | None = Field(None, max_length=VOICE_ID_MAX_CHARS,
                                description="A bundle from /add_hifi: its prompt and its reference.")
    ref_audio_wav_base64: str | None = Field(None, description="Reference audio (VoxCPM2): base64 audio file.")
    ref_audio_wav_format: str = Field("wav", description="Container of ref_audio_wav_base64.")
    ref_audio_latents_base64: str | None = Field(None, description="Reference as float32 latents bytes.")
    ref_audio_id: str | None = Field(None, max_length=VOICE_ID_MAX_CHARS,
                                     description="A reference from /add_reference.")
    lora_name: str | None = Field(None, pattern=LORA_NAME, description="A runtime LoRA adapter registered with POST "
                                                                       "/loras (404 if unknown; while every adapter "
                                                                       "slot is held the request waits in the queue: "
                                                                       "503 after NANOVLLM_QUEUE_TIMEOUT_S).")
    response_format: Literal["mp3", "pcm"] = Field("mp3", description="mp3, or pcm = raw s16le mono.")
    normalize: bool = normalize_field()

    _target_text = field_validator("target_text")(not_blank)
    _prompt_text = field_validator("prompt_text")(encodable)

    @model_validator(mode="after")
    def _forms(self) -> GenerateRequest:
        prompts = [n for n in ("prompt_wav_base64", "prompt_latents_base64", "prompt_id", "hifi_id")
                   if getattr(self, n) is not None]
        refs = [n for n in ("ref_audio_wav_base64", "ref_audio_latents_base64", "ref_audio_id")
                if getattr(self, n) is not None]
        if len(prompts) > 1:
            raise ValueError(f"{' and '.join(prompts)} are mutually exclusive (prompt forms: {PROMPT_FORMS})")
        if len(refs) > 1:
            raise ValueError(f"{' and '.join(refs)} are mutually exclusive (reference forms: {REF_FORMS})")
        if self.hifi_id is not None and refs:
            raise ValueError(f"hifi_id already carries its reference: drop {refs[0]}")
        needs_text = prompts and prompts[0] in ("prompt_wav_base64", "prompt_latents_base64")
        if needs_text and not (self.prompt_text or "").strip():
            raise ValueError(f"prompt_text is required with {prompts[0]} (the transcript of the prompt audio)")
        if (self.prompt_text or "").strip() and not needs_text:
            raise ValueError("prompt_text is only valid with prompt_wav_base64 or prompt_latents_base64")
        return self


# --- OpenAI ---------------------------------------------------------------------------------------


OPENAI_PCM_RATE = 24000


class SpeechRequest(SamplingFields, PlaybackFields, LongFormFields):
    model: str = Field(..., max_length=MODEL_ID_MAX_CHARS,
                       description="Any id from /v1/models (or tts-1, tts-1-hd, gpt-4o-mini-tts).")
    input: str = Field(..., min_length=1, max_length=TEXT_CHARS_CEILING,
                       description="Text to speak, up to NANOVLLM_MAX_TEXT_CHARS characters (split into segments "
                                   "when long).")
    voice: str = Field("default", max_length=VOICE_ID_MAX_CHARS,
                       description="'default' (zero-shot) or a cached hifi/prompt/reference id (or OpenAI's form "
                                   "{\"id\": id}).")
    instructions: str | None = Field(None, description="Voice design: spoken as '(instructions)input'.")
    response_format: Literal["mp3", "wav", "pcm", "flac", "opus"] = Field("mp3", description="Audio format.")
    stream_format: Literal["audio", "sse"] = Field("audio", description="Raw audio bytes, or server-sent events "
                                                                         "(mp3/pcm only).")
    normalize: bool = normalize_field()

    _input = field_validator("input")(not_blank)
    _instructions = field_validator("instructions")(encodable)

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, v: object) -> object:
        """OpenAI's custom-voice form {"id": ...} names the voice by its id."""
        return v["id"] if isinstance(v, dict) and set(v) == {"id"} else v

    def output_rate(self, fmt: str) -> int | None:
        """As PlaybackFields', but pcm is 24 kHz unless sample_rate says otherwise: OpenAI's pcm, which its clients
        play at that rate."""
        return super().output_rate(fmt) or (OPENAI_PCM_RATE if fmt == "pcm" else None)

    @model_validator(mode="after")
    def _supported(self) -> SpeechRequest:
        if self.sample_rate is not None and self.response_format not in RESAMPLED_FORMATS:
            raise ValueError(f"sample_rate: only {' and '.join(RESAMPLED_FORMATS)} output can be resampled "
                             f"(response_format is {self.response_format})")
        if self.stream_format == "sse" and self.response_format not in ("mp3", "pcm"):
            raise ValueError(f"response_format: {self.response_format} cannot stream as sse; use mp3 or pcm")
        return self


class SpeechStreamConfig(SamplingFields, PlaybackFields):
    """The first message of a /v1/audio/speech/stream session: the fields of /v1/audio/speech but `input` (the text
    arrives in input.text messages); an unknown field is an error naming it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["session.config"]
    model: str = Field("tts-1", max_length=MODEL_ID_MAX_CHARS,
                       description="Any id from /v1/models; a runtime LoRA adapter's name selects it.")
    voice: str = Field("default", max_length=VOICE_ID_MAX_CHARS,
                       description="'default' (zero-shot) or a cached hifi/prompt/reference id.")
    instructions: str | None = Field(None, description="Voice design: the first segment is spoken as "
                                                       "'(instructions)text'.")
    response_format: Literal["pcm", "mp3", "wav", "flac", "opus"] = Field(
        "pcm", description="pcm and mp3: one stream over the session; wav, flac and opus: one file per segment.")
    normalize: bool = normalize_field()
    split_granularity: Literal["sentence", "clause"] = Field(
        "sentence", description="Where a segment may end: at a sentence's end, or at any clause mark (earlier audio, "
                                "shorter segments).")
    retry_badcase: bool = Field(False, description="Generate a segment again with the next seed when it reaches its "
                                                   "length cap, holding each segment back until it is done.")

    @model_validator(mode="after")
    def _supported(self) -> SpeechStreamConfig:
        if self.sample_rate is not None and self.response_format not in RESAMPLED_FORMATS:
            raise ValueError(f"sample_rate: only {' and '.join(RESAMPLED_FORMATS)} output can be resampled "
                             f"(response_format is {self.response_format})")
        return self


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "voxcpm-serve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
