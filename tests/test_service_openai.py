"""/v1/audio/speech with the official `openai` client, unmodified: every response format decoded,
streaming (audio and sse), cached voices, instructions, and clear rejections."""

from __future__ import annotations

import base64
import io
import json
import re

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from tests.service_harness import (
    SAMPLE_RATE,
    SAMPLES_PER_PATCH,
    TLS,
    LiveServer,
    live_server,
    service_settings,
    wav_bytes,
)

N = 3  # patches per request (max_generate_length)
EXTRA = {"max_generate_length": N, "seed": 1}


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-openai"), voice_store="memory",
                     voice_aliases="alloy=default") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.mark.parametrize("fmt", ["mp3", "wav", "flac", "opus", "pcm"])
def test_every_format_round_trips(client, fmt):
    r = client.audio.speech.create(model="tts-1", voice="default", input="Hello.", response_format=fmt,
                                   extra_body=EXTRA)
    data = r.content
    if fmt == "pcm":  # OpenAI's pcm: 24 kHz, which its clients assume (the model's is 48)
        assert r.response.headers["x-audio-sample-rate"] == "24000" and len(data) == N * SAMPLES_PER_PATCH
        return
    audio, sr = sf.read(io.BytesIO(data))
    assert sr == SAMPLE_RATE
    slack = {"wav": 0, "flac": 0}.get(fmt, 2 * 1152 + 576)  # lossy codecs add priming/padding
    assert abs(len(audio) - N * SAMPLES_PER_PATCH) <= slack


def test_streaming_response_to_file(client, tmp_path):
    out = tmp_path / "speech.mp3"
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="default", input="Streamed.",
                                                            response_format="mp3", extra_body=EXTRA) as r:
        r.stream_to_file(out)
    audio, sr = sf.read(out)
    assert sr == SAMPLE_RATE and len(audio) > 0


def test_sse_stream(server):
    body = {"model": "tts-1", "input": "Events.", "response_format": "pcm", "stream_format": "sse", **EXTRA}
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        r = c.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
    assert len(pcm) == N * SAMPLES_PER_PATCH  # 24 kHz
    # usage counts the input's text tokens and the audio patches made (it was the input's characters and 0)
    tokens = len(server.state.pool.client.tokenizer.encode("Events."))
    assert events[-1]["usage"] == {"input_tokens": tokens, "output_tokens": N, "total_tokens": tokens + N}


def _pcm(r) -> np.ndarray:
    return np.frombuffer(r.content, "<i2")


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to 2 LSB (a prefix-cache hit reuses KV computed in another batch shape)."""
    return a.shape == b.shape and int(np.abs(a.astype(int) - b.astype(int)).max()) <= 2


def test_cached_voice_and_instructions(client, server):
    """`voice` and `instructions` reach the engine: each voice sounds like /generate with the same voice and
    unlike the default; instructions are voice design, '(instructions)input', their own parentheses as brackets."""
    clip = base64.b64encode(wav_bytes(1.0)).decode()
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        hifi = c.post("/add_hifi", json={"wav_base64": clip, "prompt_text": "A clip."}).json()
        voices = c.get("/v1/audio/voices").json()["voices"]
        models = c.get("/v1/models").json()

        def native(**fields) -> np.ndarray:
            r = c.post("/generate", json={"response_format": "pcm", **EXTRA, **fields})
            assert r.status_code == 200, r.text
            return np.frombuffer(r.content, "<i2")

        forms = {hifi["hifi_id"]: {"hifi_id": hifi["hifi_id"]}, hifi["prompt_id"]: {"prompt_id": hifi["prompt_id"]},
                 hifi["reference_id"]: {"ref_audio_id": hifi["reference_id"]}}
        expected = {voice: native(target_text="Cloned.", **form) for voice, form in forms.items()}
        designed = native(target_text="(A calm, low voice)Designed.")
        bracketed = native(target_text="(A calm [low] voice)Designed.")
    assert {"default", hifi["hifi_id"], hifi["prompt_id"], hifi["reference_id"]} <= {v["id"] for v in voices}
    assert "tts-1" in [m["id"] for m in models["data"]]

    def speech(voice: str, text: str, **kwargs) -> np.ndarray:
        r = client.audio.speech.create(model="tts-1", voice=voice, input=text, response_format="pcm",
                                       extra_body={**EXTRA, "sample_rate": SAMPLE_RATE}, **kwargs)
        assert len(r.content) == 2 * N * SAMPLES_PER_PATCH
        return _pcm(r)

    default = speech("default", "Cloned.")
    for voice, audio in expected.items():
        got = speech(voice, "Cloned.")
        assert _same(got, audio), f"voice {voice} is not the voice /generate gives"
        assert not _same(got, default), f"voice {voice} gave the default voice"
    with_design = speech("default", "Designed.", instructions="A calm, low voice")
    assert _same(with_design, designed)
    assert not _same(with_design, speech("default", "Designed."))
    # parentheses inside read as brackets ("(A calm (low) voice)" would end the description at "(low)")
    assert _same(speech("default", "Designed.", instructions="A calm (low) voice"), bracketed)
    assert len(client.models.list().data) >= 1


@pytest.mark.parametrize("kwargs,error,field", [
    ({"speed": 4.5}, openai.BadRequestError, "speed"),
    ({"extra_body": {"seed": 2**64}}, openai.BadRequestError, "seed"),
    ({"voice": "nova"}, openai.BadRequestError, "voice"),  # (alloy is an alias here)
    ({"model": "whisper-1"}, openai.NotFoundError, "model"),
    ({"response_format": "aac"}, openai.BadRequestError, "response_format"),
    ({"response_format": "wav", "extra_body": {"stream_format": "sse"}}, openai.BadRequestError, "response_format"),
])
def test_rejections_name_the_field(client, kwargs, error, field):
    """OpenAI's statuses, so OpenAI's client raises what it raises there (a request it cannot take as sent, an
    unknown voice included, is a 400: BadRequestError; FastAPI's 422 was UnprocessableEntityError); an unknown model
    is a 404."""
    args = {"model": "tts-1", "voice": "default", "input": "Nope.", **kwargs}
    with pytest.raises(error) as e:
        client.audio.speech.create(**args)
    err = e.value.body  # the client unwraps OpenAI's {"error": {...}}
    assert err["param"] == field and err["message"].startswith(field), err
    assert err["type"] == ("invalid_request_error" if error is openai.BadRequestError else "not_found_error")


def test_zero_length_input_rejected(server):
    with httpx.Client(verify=TLS, base_url=server.url) as c:
        r = c.post("/v1/audio/speech", json={"model": "tts-1", "input": ""})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input" and r.json()["error"]["type"] == "invalid_request_error"


def test_errors_name_the_field_the_client_sent(server):
    """The engine's "target_text" is `input` here; a description too long in characters or in tokens names
    `instructions`; an unparseable body names the body, not a JSON position. A native request whose voice's
    transcript is the long part names `prompt_text`."""
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        long_prompt = c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "instructions": "word " * 400})
        long_text_prompt = c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi there. " * 60,
                                                            "instructions": "word " * 400})
        long_design = c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.",
                                                       "instructions": "x" * server.settings.max_text_chars})
        garbage = c.post("/v1/audio/speech", content=b"garbage", headers={"content-type": "application/json"})
        latents = base64.b64encode(np.zeros((4, 64), np.float32).tobytes()).decode()
        long_voice = c.post("/generate_blocking", json={"target_text": "Hi.", "prompt_latents_base64": latents,
                                                        "prompt_text": "word " * 400})
    detail = long_voice.json()["detail"]  # the native route: the longest part's field, and each part's tokens
    assert long_voice.status_code == 400 and re.search(
        r"^prompt_text: .* tokens \(\d of text, \d{3,} of voice: \d{3,} of transcript, \d+ of prompt audio\)",
        detail), detail
    err = long_prompt.json()["error"]  # the description is the longest part of the prompt, not the input
    assert long_prompt.status_code == 400 and err["param"] == "instructions", err  # as the engine refuses one text
    assert re.search(r"^instructions: the text is a prompt of \d+ tokens \(\d of text, \d{3,} of instructions, "
                     r"\d of voice\), which leaves no room", err["message"]), err
    err = long_text_prompt.json()["error"]  # a long text: its first segment carries the description
    assert long_text_prompt.status_code == 400 and err["param"] == "instructions", err
    assert re.search(r"^instructions: segment 1 of \d+ \(characters 0-\d+\) is a prompt of \d+ tokens \(\d+ of text, "
                     r"\d{3,} of instructions", err["message"]), err
    err = long_design.json()["error"]
    assert long_design.status_code == 400 and err["param"] == "instructions", err
    assert "characters (input and instructions) is more than" in err["message"], err
    err = garbage.json()["error"]
    assert garbage.status_code == 400 and err["param"] == "body" and err["message"].startswith("body: "), err
    # an input in parentheses alone is spoken (/v1's voice description comes in `instructions`)
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        r = c.post("/v1/audio/speech", json={"model": "tts-1", "input": "(Applause)", "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0, r.text
    # a model name is one of /v1/models' ids or an adapter's: a longer one is refused unechoed (it came back whole)
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        r = c.post("/v1/audio/speech", json={"model": "m" * 100_000, "input": "Hi."})
        listed = {m["id"] for m in c.get("/v1/models").json()["data"]}
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "model" and len(r.content) < 1000, err
    assert {"gpt-4o-mini-tts-2025-03-20", "gpt-4o-mini-tts-2025-12-15"} <= listed  # OpenAI's dated snapshots


def test_openai_shaped_errors(server):
    """Under /v1 every error has OpenAI's shape, including the body limit, overload and unknown routes; the
    service's own routes keep FastAPI's {"detail": ...}."""
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        big = c.post("/v1/audio/speech", content=b"x" * (server.settings.max_request_bytes + 1),
                     headers={"content-type": "application/json"})
        missing = c.get("/v1/nothing-here")
        native = c.post("/generate", json={"target_text": ""})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert "NANOVLLM_MAX_REQUEST_BYTES" in big.json()["error"]["message"]
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert native.status_code == 422 and native.json()["detail"][0]["loc"] == ["body", "target_text"]


def test_voice_aliases_name_this_services_voices(client):
    """NANOVLLM_VOICE_ALIASES: OpenAI's built-in names (or any) as this service's voices, so OpenAI's samples run
    (alloy=default here); a name without one is still a 400 naming the field."""
    def speech(voice: str) -> bytes:
        return client.audio.speech.create(model="tts-1", voice=voice, input="Hi.", response_format="pcm",
                                          extra_body=EXTRA).content

    assert speech("alloy") == speech("default")
    listed = client.get("/audio/voices", cast_to=object)["voices"]  # listed for clients that enumerate voices
    assert {"id": "alloy", "kind": "alias", "alias_of": "default"}.items() <= listed[1].items(), listed[:2]
    with pytest.raises(openai.BadRequestError, match="voice: unknown voice 'nova'"):
        speech("nova")
    from pydantic import ValidationError

    from service.settings import Settings
    assert Settings(voice_aliases=" alloy = default , nova=abc").voice_alias_map() == {"alloy": "default",
                                                                                       "nova": "abc"}
    with pytest.raises(ValidationError, match="'nova' is not name=voice"):
        Settings(voice_aliases="alloy=default,nova")


def test_voices_endpoint_lists_default_first(server):
    with httpx.Client(verify=TLS, base_url=server.url) as c:
        assert c.get("/v1/audio/voices").json()["voices"][0]["id"] == "default"


@pytest.mark.parametrize("engine_field", ["prompt_text", "prompt_latents", "ref_latents", "ref_audio_latents",
                                          "ref_audio"])
def test_an_engine_message_about_the_voice_names_voice_here(engine_field):
    """The engine names the longest part of an over-long prompt by its own field; OpenAI's route (and the live
    session) take every voice as one `voice`."""
    from engine.errors import RequestError
    from service.errors import error_payload
    from service.routers.speech_stream import session_error
    message = f"{engine_field}: the prompt (text and voice) is 900 tokens (3 of text, 897 of voice: ...)"
    err = error_payload("/v1/audio/speech", 400, message)["error"]
    assert err["param"] == "voice" and err["message"] == "voice" + message[len(engine_field):], err
    assert session_error(RequestError(message)).message == "voice" + message[len(engine_field):]
    assert error_payload("/generate", 400, message) == {"detail": message}  # a native route keeps its own terms


def test_a_voice_id_longer_than_any_id_is_refused_not_echoed(server):
    """Cached voices' ids are 24 hex digits: a megabyte "id" is refused naming the field (422; /v1: OpenAI's 400), its
    value not sent back."""
    huge = "v" * 1_000_000
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        openai_route = c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": huge})
        native = c.post("/generate_blocking", json={"target_text": "Hi.", "prompt_id": huge})
    assert openai_route.status_code == 400 and openai_route.json()["error"]["param"] == "voice", openai_route.text[:300]
    assert native.status_code == 422 and native.json()["detail"][0]["loc"][-1] == "prompt_id", native.text[:300]
    assert len(openai_route.content) < 10_000 and len(native.content) < 10_000


def test_a_reference_on_a_model_without_one_names_the_field_given(checkpoint_factory, tmp_path):
    """VoxCPM1.x takes no reference audio: the engine refuses it as `ref_audio`, which is `voice` here and the
    request's own reference field on a native route (a hifi or reference voice can be cached there all the same)."""
    checkpoint = checkpoint_factory("tiny-voxcpm1.5", stop="never")
    server = LiveServer(service_settings(checkpoint, tmp_path, voice_store="memory", warmup=False)).start()
    refused = "reference audio is only supported by VoxCPM2 models"
    clip = base64.b64encode(wav_bytes(1.0)).decode()
    try:
        with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
            hifi = c.post("/add_hifi", json={"wav_base64": clip, "prompt_text": "A clip."}).json()
            for voice in (hifi["hifi_id"], hifi["reference_id"]):
                r = c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": voice, **EXTRA})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == "voice", err
                assert err["message"] == f"voice: {refused}", err
            for field, value in (("hifi_id", hifi["hifi_id"]), ("ref_audio_id", hifi["reference_id"]),
                                 ("ref_audio_wav_base64", clip)):
                r = c.post("/generate", json={"target_text": "Hi.", field: value, **EXTRA})
                assert r.status_code == 400 and r.json()["detail"] == f"{field}: {refused}", r.text
    finally:
        server.stop()


def test_what_openais_client_sends_is_served(client, server):
    """OpenAI's forms: voice as {"id": ...} (a custom voice), models.retrieve of a served name (a dated snapshot
    too) and 404 naming the model otherwise; /v1/audio/voices says the default voice is zero-shot; a lone surrogate
    in instructions (or a native prompt_text) is refused naming it (it was a 400 naming nothing; now /v1's 400 as
    OpenAI's, the native 422)."""
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        clip = base64.b64encode(wav_bytes(1.0, seed=5)).decode()
        pid = c.post("/add_prompt", json={"wav_base64": clip, "prompt_text": "A clip."}).json()["prompt_id"]
        as_object = client.audio.speech.create(model="gpt-4o-mini-tts-2025-12-15", voice={"id": pid}, input="Hi.",
                                               response_format="pcm", extra_body=EXTRA)
        as_string = client.audio.speech.create(model="tts-1", voice=pid, input="Hi.", response_format="pcm",
                                               extra_body=EXTRA)
        assert _same(_pcm(as_object), _pcm(as_string))
        assert client.models.retrieve("tts-1").id == "tts-1"
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("whisper-1")
        assert missing.value.body["param"] == "model" and "whisper-1" in missing.value.body["message"]
        default = c.get("/v1/audio/voices").json()["voices"][0]
        assert default["id"] == "default" and default["kind"] == "zero-shot"
        def post(path: str, body: dict) -> httpx.Response:  # json.dumps writes the lone half as its \u escape
            return c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})

        r = post("/v1/audio/speech", {"model": "tts-1", "input": "Hi.", "instructions": "calm \ud800"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "instructions", r.text
        assert "unpaired surrogate" in r.json()["error"]["message"]
        latents = base64.b64encode(np.zeros((4, 64), np.float32).tobytes()).decode()
        r = post("/generate_blocking", {"target_text": "Hi.", "prompt_latents_base64": latents,
                                        "prompt_text": "x\ud800"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "prompt_text", r.text


@pytest.mark.parametrize("route", ["/v1/audio/speech", "/generate"])
def test_a_body_that_is_not_a_json_object_says_what_to_send(server, route):
    """No body, a form or text body, broken JSON: each names the body and what to send (no body was "Field required"
    naming nothing, a form body "Input should be a valid dictionary...", broken JSON "JSON decode error" without
    where or why)."""
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        empty = c.post(route)
        form = c.post(route, data={"input": "Hi."})
        broken = c.post(route, content=b'{"model": "tts-1", "input":}', headers={"content-type": "application/json"})

    def said(r: httpx.Response) -> tuple[str | None, str]:
        assert r.status_code == (400 if route.startswith("/v1") else 422), r.text
        if route.startswith("/v1"):
            return r.json()["error"]["param"], r.json()["error"]["message"]
        (err,) = r.json()["detail"]
        return err["loc"][0], err["msg"]

    assert said(empty) == ("body", ("body: " if route.startswith("/v1") else "")
                           + "a JSON object is required, sent with Content-Type: application/json")
    assert said(form)[0] == "body" and said(form)[1].endswith("must be a JSON object, sent with Content-Type: "
                                                              "application/json")
    param, message = said(broken)
    assert param == "body" and "not valid JSON at character 27 (Expecting value)" in message, message
