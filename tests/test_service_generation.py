"""/generate, /generate_blocking, /generate_blocking_wav over real HTTP on the real pool: audio formats,
sample rate and duration, every conditioning path, every invalid combination (a 4xx naming the field,
before any audio), and a client disconnect aborting the engine request."""

from __future__ import annotations

import base64
import io
import json
import socket

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.service_harness import SAMPLE_RATE, SAMPLES_PER_PATCH, TLS, LiveServer, live_server, wav_bytes

CLIP = base64.b64encode(wav_bytes(1.0)).decode()
CLIP2 = base64.b64encode(wav_bytes(1.2, seed=1)).decode()


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    # max_model_len 4096: room for a stream of 2000 patches in the disconnect test
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-gen"), serverpool_max_model_len=4096,
                     serverpool_max_num_batched_tokens=4096) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(verify=TLS, base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ids(client):
    """Cached voices for the id-based paths."""
    out = {}
    out["prompt_id"] = client.post("/add_prompt", json={"wav_base64": CLIP, "prompt_text": "A prompt."}).json()[
        "prompt_id"]
    out["ref_audio_id"] = client.post("/add_reference", json={"wav_base64": CLIP2}).json()["reference_id"]
    hifi = client.post("/add_hifi", json={"wav_base64": CLIP, "prompt_text": "A prompt."}).json()
    out["hifi_id"] = hifi["hifi_id"]
    lat = client.post("/encode_latents", json={"wav_base64": CLIP}).json()
    out["prompt_latents_base64"] = lat["prompt_latents_base64"]
    return out


def pcm(client, body: dict, route: str = "/generate") -> np.ndarray:
    r = client.post(route, json={"response_format": "pcm", "seed": 3, **body})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/pcm" and r.headers["x-audio-encoding"] == "pcm_s16le"
    return np.frombuffer(r.content, "<i2")


def test_streaming_mp3_decodes_with_rate_and_duration(client):
    n = 5
    with client.stream("POST", "/generate", json={"target_text": "Streaming mp3.", "max_generate_length": n,
                                                  "seed": 1}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "audio/mpeg"
        assert r.headers["x-audio-sample-rate"] == str(SAMPLE_RATE) and r.headers["x-audio-channels"] == "1"
        parts = list(r.iter_raw())
    data = b"".join(parts)
    # the first bytes are an MP3 frame (sync word), not a container header, and decode on their own
    assert data[0] == 0xFF and data[1] & 0xE0 == 0xE0
    first, sr_first = sf.read(io.BytesIO(parts[0]))
    assert sr_first == SAMPLE_RATE and len(first) > 0
    audio, sr = sf.read(io.BytesIO(data))
    assert sr == SAMPLE_RATE and audio.ndim == 1
    expected = n * SAMPLES_PER_PATCH  # never-stop checkpoint: exactly n patches
    assert abs(len(audio) - expected) <= 2 * 1152 + 576  # MP3 encoder delay and last-frame padding


def test_streaming_pcm_is_exact(client):
    assert len(pcm(client, {"target_text": "Raw pcm.", "max_generate_length": 3})) == 3 * SAMPLES_PER_PATCH


def test_blocking_mp3_and_wav(client):
    body = {"target_text": "Blocking.", "max_generate_length": 4, "seed": 2}
    r = client.post("/generate_blocking", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    mp3, sr = sf.read(io.BytesIO(r.content))
    assert sr == SAMPLE_RATE and abs(len(mp3) - 4 * SAMPLES_PER_PATCH) <= 2 * 1152 + 576
    r = client.post("/generate_blocking_wav", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    wav, sr = sf.read(io.BytesIO(r.content), dtype="int16")
    assert sr == SAMPLE_RATE and len(wav) == 4 * SAMPLES_PER_PATCH
    # the same seed through the streaming route gives the same samples
    assert same_audio(wav, pcm(client, {**body, "seed": 2}))


CONDITIONINGS = {
    "zero-shot": {},
    "prompt_wav": {"prompt_wav_base64": CLIP, "prompt_wav_format": "wav", "prompt_text": "A prompt."},
    "prompt_latents": {"prompt_latents_base64": "@prompt_latents_base64", "prompt_text": "A prompt."},
    "prompt_id": {"prompt_id": "@prompt_id"},
    "ref_wav": {"ref_audio_wav_base64": CLIP2, "ref_audio_wav_format": "wav"},
    "ref_id": {"ref_audio_id": "@ref_audio_id"},
    "hifi_id": {"hifi_id": "@hifi_id"},
    "prompt_id+ref_id": {"prompt_id": "@prompt_id", "ref_audio_id": "@ref_audio_id"},
    "prompt_wav+ref_wav": {"prompt_wav_base64": CLIP, "prompt_text": "A prompt.", "ref_audio_wav_base64": CLIP2},
}


def _fill(body: dict, ids: dict) -> dict:
    return {k: ids[v[1:]] if isinstance(v, str) and v.startswith("@") else v for k, v in body.items()}


@pytest.fixture(scope="module")
def zero_shot(client) -> np.ndarray:
    return pcm(client, {"target_text": "Conditioned.", "max_generate_length": 2})


@pytest.mark.parametrize("name", CONDITIONINGS)
def test_every_conditioning_path(client, ids, zero_shot, name):
    """Each voice form reaches the engine: the same text and seed sound different from zero-shot."""
    out = pcm(client, {"target_text": "Conditioned.", "max_generate_length": 2, **_fill(CONDITIONINGS[name], ids)})
    assert len(out) == 2 * SAMPLES_PER_PATCH
    if name == "zero-shot":
        assert same_audio(out, zero_shot)  # seeded: the same request, the same audio
    else:
        assert not same_audio(out, zero_shot), f"{name} gave the zero-shot audio: its voice was dropped"


def same_audio(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to 2 LSB of 16-bit PCM: a prefix-cache hit reuses KV computed in another batch shape, which
    rounds differently in float32 (the same request twice differs by 1 LSB too)."""
    return a.shape == b.shape and int(np.abs(a.astype(int) - b.astype(int)).max()) <= 2


def test_cached_paths_equal_inline_paths(client, ids):
    """An id is exactly its clip: hifi_id == the clip inline in both roles, prompt_id == its latents."""
    base = {"target_text": "Same voice.", "max_generate_length": 3}
    inline_hifi = {"prompt_wav_base64": CLIP, "prompt_text": "A prompt.", "ref_audio_wav_base64": CLIP}
    assert same_audio(pcm(client, {**base, "hifi_id": ids["hifi_id"]}), pcm(client, {**base, **inline_hifi}))
    by_latents = {"prompt_latents_base64": ids["prompt_latents_base64"], "prompt_text": "A prompt."}
    assert same_audio(pcm(client, {**base, "prompt_id": ids["prompt_id"]}), pcm(client, {**base, **by_latents}))
    inline_ref = {"ref_audio_wav_base64": CLIP2}
    assert same_audio(pcm(client, {**base, "ref_audio_id": ids["ref_audio_id"]}), pcm(client, {**base, **inline_ref}))
    ref_lat = client.post("/encode_latents", json={"wav_base64": CLIP2}).json()["prompt_latents_base64"]
    # /encode_latents pads for a prompt (left); a 1.2 s clip is not a whole number of patches, so the
    # reference (right padding) differs: both must still be accepted
    assert len(pcm(client, {**base, "ref_audio_latents_base64": ref_lat})) == 3 * SAMPLES_PER_PATCH


BAD_LATENTS = base64.b64encode(np.zeros(64 * 5, np.float32).tobytes()).decode()
GOOD_LATENTS = base64.b64encode(np.zeros(64 * 4, np.float32).tobytes()).decode()  # one patch of feat_dim 64


def b64_samples(samples: np.ndarray, sr: int = 16000, subtype: str = "PCM_16") -> str:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype=subtype)
    return base64.b64encode(buf.getvalue()).decode()


NAN_CLIP = np.full(16000, 0.1, np.float32)
NAN_CLIP[100] = np.nan
INVALID = [
    ({"prompt_id": "x", "hifi_id": "y"}, 422, "prompt_id and hifi_id are mutually exclusive"),
    ({"prompt_wav_base64": CLIP, "prompt_text": "t", "prompt_id": "x"}, 422, "mutually exclusive"),
    ({"ref_audio_wav_base64": CLIP, "ref_audio_id": "x"}, 422, "ref_audio_wav_base64 and ref_audio_id"),
    ({"hifi_id": "x", "ref_audio_id": "y"}, 422, "hifi_id already carries its reference"),
    ({"prompt_wav_base64": CLIP}, 422, "prompt_text is required with prompt_wav_base64"),
    ({"prompt_latents_base64": BAD_LATENTS}, 422, "prompt_text is required with prompt_latents_base64"),
    ({"prompt_text": "orphan"}, 422, "prompt_text is only valid with"),
    ({"lora_name": "a"}, 400, "lora_name: this engine serves no runtime LoRA adapters (max_loras=0)"),
    ({"lora_name": "../a"}, 422, "lora_name"),
    ({"temperature": -1}, 422, "temperature"),
    ({"cfg_value": -0.5}, 422, "cfg_value"),
    ({"max_generate_length": 0}, 422, "max_generate_length"),
    ({"seed": 2**64}, 422, "seed"),  # past torch's range it would fail every request on the worker
    ({"temperature": 10.5}, 422, "temperature"),  # the engine's bound (engine.serving.protocol.SAMPLING_LIMITS)
    ({"cfg_value": 20.5}, 422, "cfg_value"),
    ({"min_len": -1}, 422, "min_len"),
    ({"temperature": float("nan")}, 422, "Input should be a finite number"),  # was "less than or equal to 10"
    ({"speed": float("inf")}, 422, "finite number"),
    ({"max_generate_length": 1_000_000_000}, 422, "max_generate_length: 1000000000 is more than this service can "
                                                  "generate in one request (max_model_len = 4096)"),
    ({"target_text": "x" * 100_001}, 422, "target_text: 100001 characters is more than this service speaks"),
    ({"response_format": "ogg"}, 422, "response_format"),
    ({"target_text": ""}, 422, "target_text"),
    ({"prompt_wav_base64": "***", "prompt_text": "t"}, 400, "prompt_wav_base64: not valid base64"),
    ({"ref_audio_wav_base64": base64.b64encode(b"not audio at all").decode()}, 400, "ref_audio_wav_base64: could "
                                                                                    "not decode audio"),
    ({"ref_audio_wav_base64": b64_samples(np.zeros(16000))}, 400, "ref_audio_wav_base64: audio is silent"),
    ({"ref_audio_wav_base64": b64_samples(np.zeros(0))}, 400, "ref_audio_wav_base64: audio is empty"),
    ({"prompt_wav_base64": base64.b64encode(wav_bytes(0.05)).decode(), "prompt_text": "t"}, 400,
     "prompt_wav_base64: audio is 0.050 s long; a clip needs at least 0.1 s"),
    ({"ref_audio_wav_base64": base64.b64encode(wav_bytes(61, sr=8000)).decode()}, 413,
     "ref_audio_wav_base64: 61.0 s of audio is longer than this service takes (60 s)"),
    ({"ref_audio_wav_base64": b64_samples(NAN_CLIP, subtype="FLOAT")}, 400, "NaN or infinite samples"),
    ({"prompt_latents_base64": BAD_LATENTS, "prompt_text": "t"}, 400, "prompt_latents_base64: 5 frames"),
    ({"ref_audio_latents_base64": base64.b64encode(b"abc").decode()}, 400, "ref_audio_latents_base64: 3 bytes"),
    ({"prompt_id": "nope"}, 404, "prompt_id: no cached prompt"),
    ({"ref_audio_id": "nope"}, 404, "ref_audio_id: no cached reference"),
    ({"hifi_id": "nope"}, 404, "hifi_id: no cached hifi"),
    # the engine's verdict, still before the stream (a long target text is split; a long prompt transcript is not)
    ({"prompt_latents_base64": GOOD_LATENTS, "prompt_text": "word " * 3000}, 400, "max_model_len"),
]


@pytest.mark.parametrize("route", ["/generate", "/generate_blocking_wav"])
@pytest.mark.parametrize("body,status,message", INVALID, ids=[m for _, _, m in INVALID])
def test_invalid_requests_are_4xx_naming_the_field(client, route, body, status, message):
    # json.dumps writes NaN and Infinity as JavaScript does (clients send them; httpx's json= refuses them)
    r = client.post(route, content=json.dumps({"target_text": "Invalid.", **body}),
                    headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert message in str(r.json()["detail"]), r.json()


def test_schema_bounds_are_the_engines():
    """One table of sampling bounds: every route's schema takes its limits from the engine's."""
    from engine.vocabulary import SAMPLING_LIMITS
    from service.schemas import GenerateRequest, SpeechRequest

    for model in (GenerateRequest, SpeechRequest):
        for name, bound in SAMPLING_LIMITS.items():
            meta = {type(m).__name__: m for m in model.model_fields[name].metadata}
            assert meta["Ge"].ge == bound.low and meta["Le"].le == bound.high, (model.__name__, name)


def test_default_length_fits_the_deployment():
    """Unset, max_generate_length is the seed fork's 2000, or max_model_len where that is smaller."""
    from service.schemas import GenerateRequest

    assert GenerateRequest(target_text="x").sampling(4096).max_generate_length == 2000
    assert GenerateRequest(target_text="x").sampling(512).max_generate_length == 512
    assert GenerateRequest(target_text="x", max_generate_length=300).sampling(512).max_generate_length == 300


def test_min_len_and_finish_reason(client):
    """min_len is settable over HTTP; a blocking response says why it ended."""
    r = client.post("/generate_blocking", json={"target_text": "Short.", "max_generate_length": 3, "min_len": 3,
                                                "response_format": "pcm", "seed": 1})
    assert r.status_code == 200 and r.headers["x-finish-reason"] == "length"
    assert len(r.content) == 3 * SAMPLES_PER_PATCH * 2


def test_prompt_id_of_another_kind_is_404(client, ids):
    r = client.post("/generate", json={"target_text": "x", "prompt_id": ids["ref_audio_id"]})
    assert r.status_code == 404 and "prompt_id" in r.json()["detail"]


def test_client_disconnect_aborts_the_engine_request(server):
    """Leave a long stream after its first chunk: the engine request is aborted (its KV blocks and slot
    come back long before it could have finished on its own)."""
    text = "A sentence repeated until the stream could run for two thousand patches. " * 25
    before = server.pool_stats()
    with httpx.Client(verify=TLS, base_url=server.url, timeout=120) as c, \
            c.stream("POST", "/generate", json={"target_text": text, "response_format": "pcm"}) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()  # keep a reference: a discarded httpx iterator closes the connection itself
        next(chunks)
        mid = server.pool_stats()
        assert mid.running == 1 and mid.free_blocks < mid.total_blocks, f"{before} {mid}"
    # leaving the block closed the connection mid-stream
    LiveServer.wait(lambda: (s := server.pool_stats()).running == s.waiting == 0
                    and s.free_blocks == s.total_blocks, "KV blocks not freed after the disconnect")
    after = server.pool_stats()
    assert after.free_slots == before.free_slots
    # left alone it would run 2000 steps; the abort stops it after a handful
    assert after.steps - before.steps < 1000, (before, after)


@pytest.mark.parametrize("route", ["/generate_blocking", "/generate_blocking_wav"])
def test_client_disconnect_aborts_a_blocking_request(server, route):
    """A blocking route sends nothing until the end, so Starlette never notices the client leaving: the
    route watches for the disconnect itself and aborts the engine request."""
    text = "A sentence repeated until the request could run for two thousand patches. " * 25
    before = server.pool_stats()
    body = json.dumps({"target_text": text}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST {route} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        LiveServer.wait(lambda: server.pool_stats().running == 1, "the request never started")
    LiveServer.wait(lambda: (s := server.pool_stats()).running == s.waiting == 0
                    and s.free_blocks == s.total_blocks, "KV blocks not freed after the disconnect")
    after = server.pool_stats()
    assert after.free_slots == before.free_slots
    assert after.steps - before.steps < 1000, (before, after)


# A voice that fits max_model_len=256 alone but not with TARGET (~90 tokens; one segment), its longest part the voice's:
# a ~160-token transcript, or a clip of 28 s (175 patches; a hifi's 16 s is 100 patches twice, prompt and reference).
TARGET = "word " * 45
LONG_TRANSCRIPT = "word " * 80
OVER_LONG_VOICES = {
    "prompt_id-transcript": ("/add_prompt", 1.0, LONG_TRANSCRIPT, "prompt_id"),
    "prompt_id-clip": ("/add_prompt", 28.0, "A clip.", "prompt_id"),
    "hifi_id-transcript": ("/add_hifi", 1.0, LONG_TRANSCRIPT, "hifi_id"),
    "hifi_id-clip": ("/add_hifi", 16.0, "A clip.", "hifi_id"),
    "ref_audio_id": ("/add_reference", 28.0, None, "ref_audio_id"),
    "prompt_wav_base64": (None, 28.0, "A clip.", "prompt_wav_base64"),
    "ref_audio_wav_base64": (None, 28.0, None, "ref_audio_wav_base64"),
}


@pytest.fixture(scope="module")
def short_context(checkpoint_factory, tmp_path_factory):
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-gen-256"), serverpool_max_model_len=256,
                     warmup=False) as s, httpx.Client(verify=TLS, base_url=s.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("name", OVER_LONG_VOICES)
def test_an_over_long_voice_names_the_request_field_it_came_from(short_context, name):
    """The engine names an over-long prompt's longest part by its own field (prompt_text, prompt_latents,
    ref_latents); a native route names the voice field of the request: the cached id, or the inline clip."""
    add_route, seconds, transcript, field = OVER_LONG_VOICES[name]
    clip = base64.b64encode(wav_bytes(seconds, seed=7)).decode()
    if add_route is None:
        voice = {field: clip, **({"prompt_text": transcript} if transcript else {})}
    else:
        added = short_context.post(add_route, json={"wav_base64": clip,
                                                    **({"prompt_text": transcript} if transcript else {})})
        assert added.status_code == 200, added.text
        voice = {field: added.json()["reference_id" if field == "ref_audio_id" else field]}
    r = short_context.post("/generate", json={"target_text": TARGET, "max_generate_length": 2, **voice})
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert detail.startswith(f"{field}: the prompt (text and voice) is "), detail
    assert "within max_model_len=256" in detail, detail

