"""`speed` (pitch-preserving time-stretch) and `sample_rate` (soxr resampling) on /generate and /v1/audio/speech:
durations, speed 1 byte for byte as without the field, and the refusals naming each field. The stages themselves
(service.retime) on synthetic audio: exact lengths, output independent of chunking, pitch kept."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import soundfile as sf

from service.retime import Resample, TimeStretch
from tests.service_harness import SAMPLE_RATE, SAMPLES_PER_PATCH, TLS, live_server

N = 20  # patches per request: 3.2 s of audio, several stretch blocks
BODY = {"target_text": "Speed.", "max_generate_length": N, "seed": 7}
SPEECH = {"model": "tts-1", "input": "Speed.", "max_generate_length": N, "seed": 7}


@pytest.fixture(scope="module")
def http(checkpoint_factory, tmp_path_factory):
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-speed"), voice_store="memory") as s, \
            httpx.Client(verify=TLS, base_url=s.url, timeout=120) as c:
        yield c


def _post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r


def _pcm(http: httpx.Client, path: str = "/generate", **fields) -> np.ndarray:
    base = BODY if path == "/generate" else SPEECH
    return np.frombuffer(_post(http, path, {**base, "response_format": "pcm", **fields}).content, "<i2")


@pytest.fixture(scope="module")
def native(http) -> np.ndarray:
    audio = _pcm(http)
    assert len(audio) == N * SAMPLES_PER_PATCH
    return audio


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_duration_is_one_over_speed(http, native, speed):
    got = _pcm(http, speed=speed)
    assert abs(len(got) / (len(native) / speed) - 1) < 0.02
    assert np.abs(got.astype(np.int32)).max() > 0  # audio, not a stretch of nothing


def test_openai_speed_and_rate(http, native):
    got = _pcm(http, "/v1/audio/speech", speed=2.0, sample_rate=24000)
    assert abs(len(got) / (len(native) / 2 / 2) - 1) < 0.02


@pytest.mark.parametrize("path,fmt", [("/generate", "mp3"), ("/generate", "pcm"), ("/generate_blocking", "mp3"),
                                      ("/v1/audio/speech", "mp3"), ("/v1/audio/speech", "wav")])
def test_speed_one_and_native_rate_are_todays_bytes(http, path, fmt):
    base = {**(BODY if path != "/v1/audio/speech" else SPEECH), "response_format": fmt}
    plain = _post(http, path, base).content
    rate = {"sample_rate": SAMPLE_RATE} if fmt in ("pcm", "wav") else {}
    assert _post(http, path, {**base, "speed": 1.0, **rate}).content == plain


@pytest.mark.parametrize("path", ["/generate", "/v1/audio/speech"])
@pytest.mark.parametrize("speed", [0.2, 4.5])
def test_speed_out_of_range_names_speed(http, path, speed):
    body = {**(BODY if path == "/generate" else SPEECH), "speed": speed}
    r = http.post(path, json=body)
    assert r.status_code == (422 if path == "/generate" else 400), r.text  # /v1: OpenAI's status
    if path == "/generate":
        assert r.json()["detail"][0]["loc"] == ["body", "speed"]
    else:
        err = r.json()["error"]
        assert err["param"] == "speed" and err["message"].startswith("speed"), err


def test_sample_rate_resamples_pcm_and_wav(http, native):
    r = _post(http, "/generate", {**BODY, "response_format": "pcm", "sample_rate": 24000})
    assert r.headers["X-Audio-Sample-Rate"] == "24000"
    assert abs(len(r.content) // 2 - len(native) * 24000 / SAMPLE_RATE) <= 2
    for path, body in (("/generate_blocking_wav", {**BODY, "sample_rate": 24000}),
                       ("/v1/audio/speech", {**SPEECH, "response_format": "wav", "sample_rate": 24000})):
        audio, sr = sf.read(io.BytesIO(_post(http, path, body).content), dtype="int16")
        assert sr == 24000 and abs(len(audio) - len(native) // 2) <= 2


@pytest.mark.parametrize("path,fields", [("/generate", {"sample_rate": 24001}),
                                         ("/generate", {"sample_rate": 24000, "response_format": "mp3"}),
                                         ("/v1/audio/speech", {"sample_rate": 23999, "response_format": "pcm"}),
                                         ("/v1/audio/speech", {"sample_rate": 24000, "response_format": "opus"})])
def test_bad_sample_rate_names_it(http, path, fields):
    r = http.post(path, json={**(BODY if path == "/generate" else SPEECH), **fields})
    assert r.status_code == (422 if path == "/generate" else 400), r.text
    body = r.json()
    if path == "/generate":
        detail = body["detail"]
        assert detail.startswith("sample_rate: only pcm and wav") if isinstance(detail, str) \
            else detail[0]["loc"] == ["body", "sample_rate"]
    else:
        assert body["error"]["param"] == "sample_rate" and body["error"]["message"].startswith("sample_rate"), body


# --- the stages on synthetic audio ----------------------------------------------------------------

def _voice_like(seconds: float) -> np.ndarray:
    """A gliding 24-harmonic tone with a syllable-rate envelope, as a stand-in for voiced speech."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    phase = 2 * np.pi * np.cumsum(140 + 30 * np.sin(2 * np.pi * 0.7 * t)) / SAMPLE_RATE
    tone = sum(np.sin(k * phase) / k for k in range(1, 25)) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    return (0.2 * tone).astype(np.float32)


def _run(stage, audio: np.ndarray, chunks: list[int]) -> np.ndarray:
    out, i = [], 0
    for n in chunks:
        out.append(stage(audio[i:i + n], False))
        i += n
    out.append(stage(audio[i:], True))
    return np.concatenate(out)


@pytest.mark.parametrize("speed", [0.25, 0.7, 1.5, 4.0])
def test_stretch_is_exact_in_length_and_blind_to_chunking(speed):
    audio = _voice_like(2.3)
    even = _run(TimeStretch(SAMPLE_RATE, speed), audio, [3840] * 20)
    ragged = _run(TimeStretch(SAMPLE_RATE, speed), audio, [1, 17000, 5, 9000, 30000])
    assert len(even) == round(len(audio) / speed)
    assert np.array_equal(even, ragged)


@pytest.mark.parametrize("speed", [0.5, 2.0, 4.0])
def test_stretch_keeps_the_pitch_and_level(speed):
    tone = np.sin(2 * np.pi * 440 * np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE).astype(np.float32) * 0.5
    out = _run(TimeStretch(SAMPLE_RATE, speed), tone, [7680] * 10)
    mid = out[len(out) // 10: -len(out) // 10]
    peak_hz = np.argmax(np.abs(np.fft.rfft(mid))) * SAMPLE_RATE / len(mid)
    assert abs(peak_hz - 440) < 5, peak_hz
    frames = mid[:len(mid) // 480 * 480].reshape(-1, 480)  # 10 ms: a dip at a block join would show
    level = np.sqrt(np.mean(frames ** 2, axis=1)) / np.sqrt(np.mean(tone ** 2))
    assert level.min() > 0.8 and level.max() < 1.4, (level.min(), level.max())


def test_streamed_resample_equals_whole():
    import soxr
    audio = _voice_like(1.1)
    streamed = _run(Resample(SAMPLE_RATE, 22050), audio, [3841] * 10)
    assert np.array_equal(streamed, soxr.resample(audio, SAMPLE_RATE, 22050, quality="HQ"))


def test_retime_bench(tmp_path):
    """`bench.py retime`: the stages' cost, exact stretched lengths, and a steady tone kept steady at 0.5 and 2."""
    import json

    from tools import bench
    out = tmp_path / "retime.json"
    doc = bench.main(["retime", "--seconds", "1", "--speeds", "0.5,2", "--rates", "24000", "--threads", "1,2",
                      "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert all(r["out_samples"] == r["out_expected"] and r["core_s_per_audio_s"] > 0 for r in doc["stretch"])
    assert [r["rate"] for r in doc["resample"]] == [24000] and [r["threads"] for r in doc["stretch_threads"]] == [1, 2]
    for row in doc["tone"]:
        assert -1 < row["streamed_db"][0] <= row["streamed_db"][1] < 1, row


def test_a_flushed_stage_starts_afresh_for_the_next_segment():
    """Segment by segment (the stages flushed at each end, the encoder's stream going on): each segment comes out as
    it would alone, round(N / speed) samples."""
    from engine.io.audio import pcm16
    from service.audio import pcm_encoder
    from service.retime import AudioStages, audio_stages

    first, second = _voice_like(1.3), _voice_like(0.9)[::-1].copy()
    alone = [_run(s, seg, [7680] * 3) for s, seg in ((TimeStretch(SAMPLE_RATE, 1.5), first),
                                                     (TimeStretch(SAMPLE_RATE, 1.5), second))]
    stages = AudioStages(audio_stages(SAMPLE_RATE, 1.5, 24000), pcm_encoder)
    out = [stages(first[:7680], False), stages.end_segment(first[7680:]), stages(second, True)]
    resampled = [_run(Resample(SAMPLE_RATE, 24000), a, []) for a in alone]
    got = np.frombuffer(b"".join(o or b"" for o in out), "<i2")
    assert np.array_equal(got, np.frombuffer(pcm16(np.concatenate(resampled)), "<i2"))
    stretch = TimeStretch(SAMPLE_RATE, 1.5)
    assert np.array_equal(np.concatenate([stretch(first, True), stretch(second, True)]), np.concatenate(alone))
