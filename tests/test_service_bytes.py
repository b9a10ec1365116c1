"""The API-process path (an app connected to engine workers it does not own, its audio encoded on the engine
client's encoder threads) against the pool's own chunks: per format, a client gets exactly the bytes the reference
encoders make of the pool's float chunks for the same seed, and a client that leaves frees the engine at once."""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from engine.serving.processes import WorkerSet
from engine.serving.voxcpm import engine_config
from service.audio import make_encoder
from service.engine_setup import WorkerEndpoint
from tests.service_harness import SAMPLE_RATE, SAMPLES_PER_PATCH, TLS, LiveServer, service_settings

TEXT = "The same words, through the pool and over HTTP."
PATCHES = 6
SEED = 11


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    tmp = tmp_path_factory.mktemp("svc-bytes")
    workers = WorkerSet(str(ckpt), ["cpu"], engine_config(max_num_seqs=4, max_model_len=512,
                                                          max_num_batched_tokens=2048))
    endpoint = WorkerEndpoint(workers.addresses, workers.authkey, str(ckpt), demo=False,
                              voice_db=Path(tmp) / "voices.db", multiprocess_metrics=False)
    s = LiveServer(service_settings(ckpt, tmp), endpoint).start()
    try:
        assert not s.state.owns_workers
        yield s
    finally:
        s.stop()
        workers.stop()


@pytest.fixture(scope="module")
def reference(server) -> list[np.ndarray]:
    """The pool's float32 chunks for TEXT and SEED (through the same workers, no transform), the text tokenized by
    the worker: the service's API process tokenizes what it sends, so the routes below check that too."""
    client = server.state.pool.client
    assert client.tokenizer is not None  # the service tokenizes in its API processes

    async def chunks() -> list[np.ndarray]:
        stream = server.state.pool.generate(TEXT, max_generate_length=PATCHES, seed=SEED)
        out = [c async for c in stream]
        assert stream.finish_reason == "length" and stream.request.text_ids is None
        return out

    tokenizer, client.tokenizer = client.tokenizer, None
    try:
        out = server.call(chunks())
    finally:
        client.tokenizer = tokenizer
    assert len(out) == PATCHES and all(len(c) == SAMPLES_PER_PATCH for c in out)
    assert float(np.abs(np.concatenate(out)).max()) > 1e-3  # audio, not silence
    return out


def encoded(chunks: list[np.ndarray], fmt: str) -> bytes:
    """What the service's encoder makes of the chunks, fed one by one as a stream is."""
    enc = make_encoder(fmt, SAMPLE_RATE)
    return b"".join(enc(c, i == len(chunks) - 1) or b"" for i, c in enumerate(chunks))


def test_a_prepared_mp3_encoder_makes_the_same_bytes(reference):
    """The service prepares each MP3 encoder (LAME's set-up) before the first chunk: the output must not change."""
    prepared = make_encoder("mp3", SAMPLE_RATE)
    prepared.prepare()
    assert b"".join(prepared(c, i == len(reference) - 1) or b"" for i, c in enumerate(reference)) \
        == encoded(reference, "mp3")
    sse = make_encoder("mp3", SAMPLE_RATE, sse=True)
    assert sse.prepare.__self__ is sse.inner  # SSE around MP3 prepares the MP3 encoder


def body(fmt: str = "mp3") -> dict:
    return {"target_text": TEXT, "max_generate_length": PATCHES, "seed": SEED, "response_format": fmt}


@pytest.mark.parametrize("fmt", ["mp3", "pcm"])
def test_streams_are_the_pools_chunks_encoded(server, reference, fmt):
    with httpx.Client(verify=TLS, base_url=server.url, timeout=120) as c, \
            c.stream("POST", "/generate", json=body(fmt)) as r:
        assert r.status_code == 200, r.read()
        data = b"".join(r.iter_raw())
        request_id = r.headers["x-request-id"]
    assert data == encoded(reference, fmt)
    assert request_id and "-" in request_id
    if fmt == "pcm":  # exact: the float chunks rounded to 16 bits
        ints = np.frombuffer(data, "<i2").astype(np.float64) / 32767
        assert np.abs(ints - np.concatenate(reference)).max() <= 0.5 / 32767 + 1e-7
    else:  # the MP3 decodes to the same waveform (lossy, delayed by the encoder: aligned by correlation)
        audio, sr = sf.read(io.BytesIO(data))
        ref = np.concatenate(reference)
        assert sr == SAMPLE_RATE
        lag = int(np.argmax(np.correlate(audio[:4000], ref[:2000], "valid")))
        n = min(len(ref), len(audio) - lag)
        corr = np.corrcoef(audio[lag:lag + n], ref[:n])[0, 1]
        assert corr > 0.9, corr


@pytest.mark.parametrize("route, fmt", [("/generate_blocking", "mp3"), ("/generate_blocking", "pcm"),
                                        ("/generate_blocking_wav", "wav")])
def test_blocking_routes_are_the_pools_chunks_encoded(server, reference, route, fmt):
    r = httpx.post(server.url + route, json=body("pcm" if fmt == "wav" else fmt), timeout=120, verify=TLS)
    assert r.status_code == 200, r.text
    assert r.content == encoded(reference, fmt)
    assert r.headers["x-finish-reason"] == "length"


MODEL_RATE = {"pcm": {"sample_rate": SAMPLE_RATE}}  # /v1's pcm is OpenAI's 24 kHz unless the model's rate is asked


@pytest.mark.parametrize("fmt", ["mp3", "pcm", "wav", "flac", "opus"])
def test_openai_formats_are_the_pools_chunks_encoded(server, reference, fmt):
    r = httpx.post(server.url + "/v1/audio/speech", timeout=120,
                   json={"model": "tts-1", "input": TEXT, "response_format": fmt, "seed": SEED,
                         "max_generate_length": PATCHES, **MODEL_RATE.get(fmt, {})}, verify=TLS)
    assert r.status_code == 200, r.text
    if fmt == "opus":  # an Ogg stream carries a random serial number: the same audio, not the same bytes
        ours, sr = sf.read(io.BytesIO(r.content))
        theirs, _ = sf.read(io.BytesIO(encoded(reference, fmt)))
        assert sr == 48000 and np.array_equal(ours, theirs) and len(ours) >= PATCHES * SAMPLES_PER_PATCH - 960
        return
    assert r.content == encoded(reference, fmt)
    if fmt in ("wav", "flac"):  # lossless: the 16-bit samples themselves
        ints, sr = sf.read(io.BytesIO(r.content), dtype="int16")
        assert sr == SAMPLE_RATE and ints.tobytes() == encoded(reference, "pcm")


@pytest.mark.parametrize("fmt", ["mp3", "pcm"])
def test_sse_deltas_are_the_pools_chunks_encoded(server, reference, fmt):
    r = httpx.post(server.url + "/v1/audio/speech", timeout=120,
                   json={"model": "tts-1", "input": TEXT, "response_format": fmt, "stream_format": "sse",
                         "seed": SEED, "max_generate_length": PATCHES, **MODEL_RATE.get(fmt, {})}, verify=TLS)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["finish_reason"] == "length"
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == encoded(reference, fmt)


def test_disconnect_frees_the_engine_at_once(server):
    """A client that leaves mid-stream: its request is aborted and its KV blocks and slot are free again before
    the engine could have finished it (a generous hang guard, not a timing assertion)."""
    total = server.pool_stats().total_blocks
    long_text = "A longer sentence, so the stream could run a few hundred patches. " * 2  # ~200 patches
    with httpx.Client(verify=TLS, base_url=server.url, timeout=120) as c, \
            c.stream("POST", "/generate", json={**body("pcm"), "target_text": long_text,
                                                "max_generate_length": 300}) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()  # keep a reference: a discarded httpx iterator closes the connection itself
        next(chunks)
        busy = server.pool_stats()
        assert busy.running == 1 and busy.free_blocks < total and busy.free_slots == 3, busy
    steps_at_close = busy.steps
    deadline = time.monotonic() + 30
    while True:
        s = server.pool_stats()
        if s.running == s.waiting == 0 and s.free_blocks == total and s.free_slots == 4:
            break
        assert time.monotonic() < deadline, f"engine not freed: {s}"
        time.sleep(0.02)
    assert s.steps - steps_at_close < 150  # aborted, not run to its end
