"""Long-form text over real HTTP on loopback (tiny checkpoints, CPU): long English and Chinese texts stream to
the end, each segment's audio is that segment generated alone, timings add up to the samples sent, and the bad-case
guard regenerates a segment that never stops (and counts it)."""

from __future__ import annotations

import base64
import json
import time

import httpx
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosedOK
from websockets.sync.client import connect

from engine import SamplingParams, SynthesisRequest
from engine.io.tokenizer import text_tokens
from engine.vocabulary import max_patches
from service.longform import next_seed
from service.normalize import normalize
from service.segmenter import split_text
from tests.service_harness import (
    SAMPLE_RATE,
    SAMPLES_PER_PATCH,
    TLS,
    LiveServer,
    live_server,
    service_settings,
    wav_bytes,
)

N = 2  # patches per segment (max_generate_length applies per segment)
EN = ("Dr. Smith paid $3.14 for tea, e.g. at noon on Friday. \"Really?!\" she asked... Yes!\n\n" * 250)[:20000]
ZH = ("今天天气很好，我们去公园散步吧！你觉得怎么样？好的；我们走。然后喝一杯咖啡。" * 160)[:5000]


JOINED_BACK_TO_BACK = {"voice_store": "memory", "segment_pause_ms": 0, "paragraph_pause_ms": 0, "segment_fade_ms": 0}


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    """Joins without pauses or fades, so the stream is the segments' audio back to back (segment == alone)."""
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-long"), serverpool_max_model_len=2048,
                     serverpool_max_num_batched_tokens=4096, segment_chars=200, **JOINED_BACK_TO_BACK) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(verify=TLS, base_url=server.url, timeout=300) as c:
        yield c


def pcm(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, "<i2")


@pytest.mark.parametrize("text", [EN, ZH], ids=["en-20000", "zh-5000"])
def test_long_text_streams_to_the_end(client, text):
    segments = split_text(text, 200)
    with client.stream("POST", "/generate", json={"target_text": text, "max_generate_length": N, "seed": 1,
                                                  "response_format": "pcm"}) as r:
        assert r.status_code == 200
        body = b"".join(r.iter_bytes())
    assert len(body) == 2 * N * SAMPLES_PER_PATCH * len(segments)


def first_segment_latents(server: LiveServer, text: str, params: SamplingParams) -> bytes:
    """Segment 0 generated alone through the pool, with its latents (the later segments' continuation prompt)."""

    async def run() -> bytes:
        stream = server.state.pool.submit(SynthesisRequest(text, params=params, return_latents=True))
        async for _ in stream:
            pass
        return np.concatenate(stream.latents).astype(np.float32).tobytes()

    return server.call(run())


def test_each_segment_is_that_segment_alone(client, server):
    """Zero-shot: segment 0 alone, then every later one alone with segment 0's latents and text as its continuation
    prompt; the stream is exactly those, back to back, and the timings are their sample counts."""
    text = "First sentence of the talk. " * 8 + "Second part, spoken next. " * 8
    segments = split_text(text, 200)
    assert len(segments) == 3
    body = {"max_generate_length": N, "seed": 5, "response_format": "pcm"}
    r = client.post("/generate_blocking", json={"target_text": text, "timings": True, **body})
    whole = pcm(r)
    latents = first_segment_latents(server, segments[0].text, SamplingParams(max_generate_length=N, seed=5))
    prompt = {"prompt_latents_base64": base64.b64encode(latents).decode(), "prompt_text": segments[0].text}
    alone = [pcm(client.post("/generate", json={"target_text": segments[0].text, **body}))]
    alone += [pcm(client.post("/generate", json={"target_text": s.text, **prompt, **body})) for s in segments[1:]]
    assert np.array_equal(whole, np.concatenate(alone))
    timings = json.loads(r.headers["x-segment-timings"])
    assert [(t["index"], t["start"], t["end"]) for t in timings] == [(s.index, s.start, s.end) for s in segments]
    offsets = np.cumsum([0] + [len(a) for a in alone])
    assert [round(t["start_s"] * SAMPLE_RATE) for t in timings] == list(offsets[:-1])
    assert [round(t["duration_s"] * SAMPLE_RATE) for t in timings] == [len(a) for a in alone]


def test_prompted_segments_equal_alone(client):
    """With a prompt voice every segment uses it as is: each equals /generate of its text with the same voice."""
    clip = base64.b64encode(wav_bytes(1.0, seed=2)).decode()
    pid = client.post("/add_prompt", json={"wav_base64": clip, "prompt_text": "A prompt."}).json()["prompt_id"]
    text = "One two three four five. " * 10 + "Six seven eight nine ten. " * 10
    segments = split_text(text, 200)
    body = {"prompt_id": pid, "max_generate_length": N, "seed": 9, "response_format": "pcm"}
    whole = pcm(client.post("/generate", json={"target_text": text, **body}))
    alone = [pcm(client.post("/generate", json={"target_text": s.text, **body})) for s in segments]
    assert np.array_equal(whole, np.concatenate(alone))


def test_sse_carries_segment_timings_when_asked(client):
    """`timings` adds speech.segment events to OpenAI's two; without it a long input's stream has only OpenAI's
    event types (a client typed on them failed on the extra one)."""
    text = "A short first sentence here. " * 8 + "And a second one follows it. " * 8
    body = {"model": "tts-1", "input": text, "response_format": "pcm", "stream_format": "sse",
            "max_generate_length": N, "seed": 1}
    plain = client.post("/v1/audio/speech", json=body)
    assert plain.status_code == 200
    types = {json.loads(line[6:])["type"] for line in plain.text.splitlines() if line.startswith("data: ")}
    assert types == {"speech.audio.delta", "speech.audio.done"}
    r = client.post("/v1/audio/speech", json={**body, "timings": True})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    segs = [e for e in events if e["type"] == "speech.segment"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert [e["text"] for e in segs] == [s.text for s in split_text(text, 200)]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["output_tokens"] == N * len(segs)  # every segment's patches
    end = segs[-1]["start_s"] + segs[-1]["duration_s"]
    assert end * 24000 == pytest.approx(len(audio) // 2)  # /v1's pcm: OpenAI's 24 kHz


def test_badcase_guard_regenerates_and_counts(client, server):
    """The never-stopping checkpoint reaches every segment's length cap: with the guard each segment is generated
    badcase_tries times, the last kept (its seed the request's + tries - 1), and each cap is counted."""
    before = server.state.metrics.segments_capped.labels("/generate_blocking")._value.get()
    text = "Hi.\n\nBye."  # two segments (a paragraph break), a few tokens each: short caps
    segments = split_text(text, 200)
    assert len(segments) == 2
    r = client.post("/generate_blocking", json={"target_text": text, "seed": 4, "timings": True,
                                                "response_format": "pcm"})
    timings = json.loads(r.headers["x-segment-timings"])
    assert [t["tries"] for t in timings] == [3] * len(segments)
    after = server.state.metrics.segments_capped.labels("/generate_blocking")._value.get()
    assert after - before == 3 * len(segments)
    assert next_seed(4, 2) == 6


def test_streamed_guard_holds_segments_back_and_matches_blocking(client):
    """retry_badcase on a stream: each segment is sent once it is done, so the bytes are the blocking route's."""
    body = {"target_text": "Hi.\n\nBye.", "seed": 4, "response_format": "pcm"}
    blocking = pcm(client.post("/generate_blocking", json=body))
    streamed = pcm(client.post("/generate", json={**body, "retry_badcase": True}))
    assert np.array_equal(streamed, blocking)


def test_leaving_mid_stream_frees_every_segment(client, server):
    """A client that leaves a long stream aborts the segments in flight: the worker runs nothing afterwards and every
    KV block is free again."""
    total = server.pool_stats().total_blocks
    with client.stream("POST", "/generate", json={"target_text": EN, "max_generate_length": 50, "seed": 1,
                                                  "response_format": "pcm"}) as r:
        assert r.status_code == 200
        next(r.iter_bytes())
    server.wait(lambda: (lambda s: s.running == 0 and s.waiting == 0 and s.free_blocks == total)(server.pool_stats()),
                "segments still running after the client left", limit_s=60)


def test_a_split_text_is_normalised_per_segment_and_stretched_as_one_stream(client):
    """normalize: each segment is normalised before it is spoken (the same audio as the text written out); speed 2:
    the stream lasts half as long (the stretcher's exact length rule) and the timings are the generated ones / 2."""
    written = "Then we met 2 friends near the old bridge. " * 8
    spoken = "Then we met two friends near the old bridge. " * 8
    body = {"max_generate_length": N, "seed": 7, "response_format": "pcm"}
    # the two texts split alike (4 sentences a segment), so the spoken one is what each written segment becomes
    assert [s.text.count(".") for s in split_text(written, 200)] == [s.text.count(".") for s in split_text(spoken, 200)]
    normalised = pcm(client.post("/generate_blocking", json={"target_text": written, "normalize": True, **body}))
    assert np.array_equal(normalised, pcm(client.post("/generate_blocking", json={"target_text": spoken, **body})))
    assert not np.array_equal(normalised, pcm(client.post("/generate_blocking", json={"target_text": written, **body})))
    plain = client.post("/generate_blocking", json={"target_text": spoken, "timings": True, **body})
    fast = client.post("/generate_blocking", json={"target_text": spoken, "timings": True, "speed": 2.0, **body})
    assert abs(len(pcm(fast)) - round(len(pcm(plain)) / 2)) <= 1
    slow_t, fast_t = (json.loads(r.headers["X-Segment-Timings"]) for r in (plain, fast))
    assert [t["index"] for t in fast_t] == [t["index"] for t in slow_t]
    for a, b in zip(slow_t, fast_t, strict=True):
        assert b["duration_s"] == pytest.approx(a["duration_s"] / 2) and b["start_s"] == pytest.approx(a["start_s"] / 2)


def test_a_split_text_is_never_refused_mid_stream_for_a_full_queue(checkpoint_factory, tmp_path):
    """One seat and no queue: the first segment takes the seat, and each later one (submitted while the one before
    decodes) continues an admitted stream, so it waits for the seat instead of failing the response half-way."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    settings = service_settings(ckpt, tmp_path, serverpool_max_num_seqs=1, max_queued_requests=0, segment_chars=200,
                                voice_store="memory", segment_pause_ms=0, paragraph_pause_ms=0, segment_fade_ms=0)
    server = LiveServer(settings).start()
    try:
        text = "One more sentence for a seat. " * 20
        assert len(split_text(text, 200)) >= 3
        with httpx.Client(verify=TLS, base_url=server.url, timeout=300) as c:
            r = c.post("/generate_blocking", json={"target_text": text, "max_generate_length": N, "seed": 3,
                                                   "response_format": "pcm", "timings": True})
            assert r.status_code == 200 and r.headers["X-Finish-Reason"] == "length", r.text
            assert len(json.loads(r.headers["X-Segment-Timings"])) == len(split_text(text, 200))
    finally:
        server.stop()


def test_a_first_segment_refused_before_audio_submits_no_later_one(checkpoint_factory, tmp_path):
    """One seat, taken, and no queue: a prompted long text's first segment is refused (503) and the segments after it
    are never submitted (a continuation would wait for the seat ahead of new requests until the stream closed)."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    settings = service_settings(ckpt, tmp_path, serverpool_max_num_seqs=1, max_queued_requests=0, segment_chars=1000,
                                voice_store="memory", queue_coalesce_ms=0)
    server = LiveServer(settings).start()
    submitted: list[str] = []
    pool = server.state.pool
    submit = pool.submit

    def recorded(request: SynthesisRequest, *args):
        submitted.append(request.target_text)
        return submit(request, *args)

    pool.submit = recorded
    text = "One more sentence for a seat. " * 100
    hold = "Held seat: a text long enough for a stream of a few hundred patches. " * 3
    assert len(split_text(text, 1000)) >= 3
    try:
        with httpx.Client(verify=TLS, base_url=server.url, timeout=300) as c:
            clip = base64.b64encode(wav_bytes(1.0, seed=2)).decode()
            pid = c.post("/add_prompt", json={"wav_base64": clip, "prompt_text": "A prompt."}).json()["prompt_id"]
            with c.stream("POST", "/generate", json={"target_text": hold, "max_generate_length": 240,
                                                     "response_format": "pcm"}) as held:
                chunks = held.iter_bytes()  # kept: a generator let go closes the response
                next(chunks)
                r = c.post("/generate", json={"target_text": text, "prompt_id": pid, "max_generate_length": N,
                                              "response_format": "pcm"})
                assert r.status_code == 503 and "retry-after" in r.headers, r.status_code
                time.sleep(0.5)  # a later segment, were it submitted, would be by now
        server.wait(lambda: (lambda s: s.running == 0 and s.waiting == 0)(server.pool_stats()), "requests left over")
        assert submitted == [hold, split_text(text, 1000)[0].text]
    finally:
        server.stop()


def test_v1_input_that_starts_with_a_parenthesis_is_spoken_as_written(client):
    """/v1's voice description comes in `instructions`: an input's own leading '(...)' is text to speak (as OpenAI
    speaks it), not the model's description form it was taken for ("(555) 123-4567" lost its "(555)"). It reaches
    the model in brackets, on the one-segment path and the segmented one, with normalisation too: the audio of
    /generate's "[555] ..." at the same seed; /generate's own '(...)' stays a description."""
    lead = "(555) 123-4567 is my number"
    for body in ({"max_generate_length": N, "seed": 2},
                 {"max_generate_length": N, "seed": 2, "split_granularity": "clause", "timings": True},
                 {"max_generate_length": N, "seed": 2, "normalize": True}):
        text = lead + "." if "timings" not in body else lead + ", " + " ".join(["word"] * 60)
        r = client.post("/v1/audio/speech", json={**body, "model": "tts-1", "response_format": "wav", "input": text})
        assert r.status_code == 200, r.text
        bracketed = client.post("/generate_blocking_wav", json={**body, "target_text": "[555]" + text[5:]})
        described = client.post("/generate_blocking_wav", json={**body, "target_text": text})
        assert r.content == bracketed.content, body
        assert r.content != described.content, body
        if "timings" in body:
            spans = [(t["start"], t["end"]) for t in json.loads(r.headers["X-Segment-Timings"])]
            assert len(spans) >= 2 and spans[0][0] == 0 and spans[-1][1] == len(text)  # spoken from its first byte


def test_one_segment_beside_text_without_words_is_spoken_as_that_segment(client, server):
    """A text whose one spoken segment sits beside a long run without words ("*" x 30,000): the segmenter leaves that
    run out, and so does the one-segment path (it sent the whole text: refused as too long for the model unless
    `timings` took the segmented path); the audio is the segment's own."""
    body = {"max_generate_length": N, "seed": 3, "response_format": "pcm"}
    for text in ("Hello. " + "*" * 30000, "-" * 5000 + " Hello."):
        (segment,) = split_text(text, server.settings.segment_chars)
        alone = client.post("/generate_blocking", json={**body, "target_text": segment.text})
        for extra in ({}, {"timings": True}):
            r = client.post("/generate_blocking", json={**body, **extra, "target_text": text})
            assert r.status_code == 200, (extra, r.text[:300])
            if not extra:
                assert r.content == alone.content


@pytest.mark.parametrize(("route", "extra"), [("/generate", {"target_text": "Hi. There."}),
                                              ("/v1/audio/speech", {"model": "tts-1", "input": "Hi. There."})])
def test_timings_on_a_streamed_response_are_refused_naming_where_they_come(client, route, extra):
    """A streamed response cannot carry timings (its headers go before the audio): 422 saying where they come (they
    were dropped without a word, the text spoken as segments all the same)."""
    r = client.post(route, json={**extra, "timings": True, "max_generate_length": N, "response_format": "pcm"})
    assert r.status_code in (400, 422), r.text  # /v1: OpenAI's 400
    message = r.json()["detail"] if route == "/generate" else r.json()["error"]["message"]
    assert message.startswith("timings: a streamed response has no place for them") and "sse" in message, message


@pytest.mark.parametrize("extra", [{}, {"timings": True}, {"retry_badcase": True}])
@pytest.mark.parametrize("route", ["/generate", "/generate_blocking", "/generate_blocking_wav"])
def test_a_voice_description_with_nothing_after_it_is_refused(client, route, extra):
    """'(calm voice)' alone leaves nothing to speak, on the single and the segmented path alike (the latter flushed an
    MP3 encoder that never encoded: a 500); nor does a text without a letter or a digit."""
    r = client.post(route, json={"target_text": "(calm voice)", "max_generate_length": N, **extra})
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == "target_text: nothing to speak after the voice description '(calm voice)'"
    # nor do zero-width spaces or symbols alone (each was spoken: babble to the length cap)
    for text in ("\u200b\u200b", "* * *"):
        r = client.post(route, json={"target_text": text, "max_generate_length": N, **extra})
        assert r.status_code == 422, r.text
        assert r.json()["detail"] == "target_text: nothing to speak (no letter or digit)", r.text


def test_timings_past_what_a_header_holds_are_refused_naming_the_field(client):
    """A blocking response's timings travel in one header: a text of more segments than it holds (each paragraph is
    one here) is a 422 naming `timings` before anything is generated; as many as it holds are answered."""
    from service.longform import MAX_HEADER_TIMINGS
    over = client.post("/generate_blocking", json={"target_text": "Hi.\n\n" * (MAX_HEADER_TIMINGS + 1),
                                                   "max_generate_length": 1, "timings": True})
    expected = f"timings: the text is {MAX_HEADER_TIMINGS + 1} segments, more than the X-Segment-Timings header holds"
    assert over.status_code == 422 and over.json()["detail"].startswith(expected), over.text
    fits = client.post("/generate_blocking", json={"target_text": "Hi.\n\n" * 3, "max_generate_length": 1,
                                                   "timings": True})
    assert fits.status_code == 200 and len(json.loads(fits.headers["X-Segment-Timings"])) == 3


def test_the_text_limit_counts_input_and_instructions_as_sent(client, server):
    """The limit counts the characters the client sent (not the parentheses the service puts around instructions)."""
    limit = server.settings.max_text_chars
    body = {"model": "tts-1", "input": "x" * (limit - 10), "instructions": "y" * 11}
    r = client.post("/v1/audio/speech", json=body)
    assert r.status_code == 400 and f"{limit + 1} characters (input and instructions)" in r.json()["error"]["message"]


# --- every segment fits max_model_len -----------------------------------------------------------------------------
# Segments near the largest size (1000) on a model of max_model_len 512: a later segment's prompt with the first
# segment carried (its text and audio) exceeds it, which the engine refused when that segment's turn came (the stream
# cut half-way, or a blocking route's 400 after the whole text was generated).
FIT_LEN = 512
PARAGRAPH = "The quick brown fox jumps over the lazy dog near the river bank today. " * 13


@pytest.fixture(scope="module")
def fit_server(checkpoint_factory, tmp_path_factory):
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-long-fit"), serverpool_max_model_len=FIT_LEN,
                     segment_chars=1000, **JOINED_BACK_TO_BACK) as s:
        yield s


@pytest.fixture(scope="module")
def fit_client(fit_server):
    with httpx.Client(verify=TLS, base_url=fit_server.url, timeout=300) as c:
        yield c


def tokens(server: LiveServer, text: str, prompt_text: str = "") -> int:
    """The prompt's text tokens as the engine counts them (the target's, with a transcript's)."""
    target, both = text_tokens(server.state.pool.client.tokenizer, text, prompt_text, bool(prompt_text))
    return len(both if both is not None else target)


cap = max_patches  # the engine's length cap of one generation


def latents_b64(server: LiveServer, patches: int, seed: int) -> str:
    info = server.state.model
    values = np.random.default_rng(seed).standard_normal((patches * info.patch_size, info.feat_dim))
    return base64.b64encode(values.astype(np.float32).tobytes()).decode()


def test_a_later_segment_carries_the_first_as_a_reference_cut_to_fit(fit_client, fit_server):
    """Zero-shot: the first segment's text and audio with the second's text exceed max_model_len, so the second
    carries the first one's audio alone as its reference, its first patches that fit: the stream is whole, and the
    second segment is exactly that segment generated alone with that reference."""
    text = PARAGRAPH + "\n\n" + PARAGRAPH
    segments = split_text(text, 1000)
    mgl = 130
    t0, t1 = tokens(fit_server, segments[0].text), tokens(fit_server, segments[1].text)
    assert len(segments) == 2 and t0 + 1 + cap(t0, mgl) <= FIT_LEN  # the first fits alone
    assert tokens(fit_server, segments[1].text, segments[0].text) + 1 + mgl + cap(t1, mgl) > FIT_LEN  # carried: not
    kept = FIT_LEN - (t1 + 1 + cap(t1, mgl)) - 2  # the reference's patches that fit beside its markers
    assert 0 < kept < mgl
    body = {"max_generate_length": mgl, "seed": 2, "response_format": "pcm"}
    with fit_client.stream("POST", "/generate", json={"target_text": text, **body}) as r:
        assert r.status_code == 200
        whole = np.frombuffer(b"".join(r.iter_bytes()), "<i2")
    latents = first_segment_latents(fit_server, segments[0].text, SamplingParams(max_generate_length=mgl, seed=2))
    frames = kept * fit_server.state.model.patch_size * fit_server.state.frame_bytes
    ref = base64.b64encode(latents[:frames]).decode()
    alone = [pcm(fit_client.post("/generate", json={"target_text": segments[0].text, **body})),
             pcm(fit_client.post("/generate", json={"target_text": segments[1].text, "ref_audio_latents_base64": ref,
                                                    **body}))]
    assert len(whole) == 2 * mgl * SAMPLES_PER_PATCH
    assert np.array_equal(whole, np.concatenate(alone))


def test_a_voxcpm1_later_segment_carries_nothing_where_the_first_would_not_fit(checkpoint_factory, tmp_path):
    """VoxCPM1.x has no reference audio: where the first segment's text and audio with the second's text exceed
    max_model_len, the second segment is generated without it, exactly as alone (the stream whole, never cut)."""
    ckpt = checkpoint_factory("tiny-voxcpm1.5", stop="never")
    server = LiveServer(service_settings(ckpt, tmp_path, serverpool_max_model_len=FIT_LEN, segment_chars=1000,
                                         **JOINED_BACK_TO_BACK)).start()
    try:
        text = PARAGRAPH + "\n\n" + PARAGRAPH
        segments = split_text(text, 1000)
        mgl = 130
        t0, t1 = tokens(server, segments[0].text), tokens(server, segments[1].text)
        assert len(segments) == 2 and t0 + 1 + cap(t0, mgl) <= FIT_LEN and t1 + 1 + cap(t1, mgl) <= FIT_LEN
        assert tokens(server, segments[1].text, segments[0].text) + 1 + mgl + cap(t1, mgl) > FIT_LEN
        body = {"max_generate_length": mgl, "seed": 4, "response_format": "pcm"}
        with httpx.Client(verify=TLS, base_url=server.url, timeout=300) as c:
            with c.stream("POST", "/generate", json={"target_text": text, **body}) as r:
                assert r.status_code == 200
                whole = np.frombuffer(b"".join(r.iter_bytes()), "<i2")
            alone = [pcm(c.post("/generate", json={"target_text": s.text, **body})) for s in segments]
        assert len(alone[0]) == len(alone[1]) and len(alone[0]) % mgl == 0  # every patch of both (its own rate)
        assert np.array_equal(whole, np.concatenate(alone))
    finally:
        server.stop()


def test_a_request_reference_is_kept_and_the_first_segment_not_carried_where_both_exceed(fit_client, fit_server):
    """A reference alone: the later segment would carry the first one's text and audio beside the request's reference;
    where that exceeds max_model_len it keeps the request's reference only (the same voice), exactly as alone."""
    text = PARAGRAPH + "\n\n" + PARAGRAPH
    segments = split_text(text, 1000)
    body = {"max_generate_length": 20, "seed": 3, "response_format": "pcm",
            "ref_audio_latents_base64": latents_b64(fit_server, 10, seed=1)}
    t1 = tokens(fit_server, segments[1].text)
    assert 10 + 2 + tokens(fit_server, segments[1].text, segments[0].text) + 1 + 20 + cap(t1, 20) > FIT_LEN
    r = fit_client.post("/generate_blocking", json={"target_text": text, "timings": True, **body})
    whole = pcm(r)
    assert [t["finish_reason"] for t in json.loads(r.headers["X-Segment-Timings"])] == ["length", "length"]
    alone = [pcm(fit_client.post("/generate", json={"target_text": s.text, **body})) for s in segments]
    assert np.array_equal(whole, np.concatenate(alone))


def test_many_segments_with_a_long_transcript_are_checked_at_the_cost_of_the_request(fit_client, fit_server,
                                                                                     monkeypatch):
    """Whether every segment fits is counted from each text and the transcript apart (and the transcript with the
    one segment refused): counting each segment with the transcript cost segments x transcript, 3,333 short
    paragraphs and a long transcript (37 KiB) 10 GB and a minute of the API process. The refusal is as before."""
    tokenizer = fit_server.state.pool.client.tokenizer
    encode_many = tokenizer.encode_many
    tokenized: list[int] = []

    def counted(texts: list[str]) -> list:
        tokenized.append(sum(map(len, texts)))
        return encode_many(texts)

    monkeypatch.setattr(tokenizer, "encode_many", counted)
    text, transcript = "Hi.\n\n" * 300, "word " * 600  # a voice longer than the model: segment 1 is refused
    r = fit_client.post("/generate", json={"target_text": text, "prompt_text": transcript, "max_generate_length": 5,
                                           "prompt_latents_base64": latents_b64(fit_server, 2, seed=3)})
    assert r.status_code == 422 and r.json()["detail"].startswith("prompt_text: segment 1 of 300"), r.text
    assert sum(tokenized) < 3 * (len(text) + len(transcript)), tokenized


def test_a_transcript_of_many_lines_is_counted_as_the_engine_reads_it(fit_client, fit_server):
    """The fit check counts the voice's transcript as the engine reads it, white space and all: counted as a target
    text (white space collapsed) it came out 100-300 tokens short, and a segment that cannot fit went to the engine,
    refused there instead of before any audio."""
    tok = fit_server.state.pool.client.tokenizer
    text, g, patches = "Hi.\n\nThere.", 5, 2
    target = tokens(fit_server, "There.")
    for lines in range(10, 400):  # raw over the limit, collapsed well under it
        transcript = "Hi  there ,  you .\n" * lines
        raw, collapsed = len(tok.encode(transcript)), len(tok.encode(" ".join(transcript.split())))
        need = target + 1 + patches + cap(target, g)
        if raw + need > FIT_LEN and collapsed + need < FIT_LEN - 40:
            break
    else:
        pytest.skip("this tokenizer reads white space as the words around it")
    r = fit_client.post("/generate_blocking", json={"target_text": text, "prompt_text": transcript, "timings": True,
                                                    "prompt_latents_base64": latents_b64(fit_server, patches, seed=4),
                                                    "max_generate_length": g, "response_format": "pcm"})
    assert r.status_code == 422 and "segment 1 of 2" in r.json()["detail"], r.text


@pytest.mark.parametrize(("route", "text_field", "extra"), [("/generate", "target_text", {}),
                                                            ("/v1/audio/speech", "input", {"model": "tts-1"})])
def test_a_segment_that_cannot_fit_is_refused_before_any_audio(fit_client, fit_server, route, text_field, extra):
    """A short first segment that fits and a long second one that cannot, whatever is carried: a 4xx naming the field
    and the rule before anything is generated (it was a stream cut at the second segment)."""
    text = "Hi.\n\n" + PARAGRAPH
    segments = split_text(text, 1000)
    t1 = tokens(fit_server, segments[1].text)
    assert len(segments) == 2 and t1 + 1 + cap(t1, 300) > FIT_LEN
    r = fit_client.post(route, json={text_field: text, "max_generate_length": 300, "response_format": "pcm", **extra})
    assert r.status_code == (422 if route == "/generate" else 400), r.text  # /v1: OpenAI's status
    detail = r.json()["detail"] if route == "/generate" else r.json()["error"]["message"]
    assert detail == (f"max_generate_length: segment 2 of 2 (characters {segments[1].start}-{segments[1].end}) is a "
                      f"prompt of {t1 + 1} tokens (text and voice) plus up to 300 patches, which exceeds "
                      f"max_model_len={FIT_LEN}: each segment of a long text is one generation, here of at most "
                      f"{FIT_LEN - t1 - 1} patches")
    # a voice that leaves the second segment no room at all is named in the request's words
    voice = {"prompt_latents_base64": latents_b64(fit_server, 300, seed=2), "prompt_text": "Hi."}
    r = fit_client.post("/generate", json={"target_text": text, "max_generate_length": 5, **voice})
    assert r.status_code == 422 and r.json()["detail"].startswith(
        "prompt_latents_base64: segment 2 of 2 (characters 5-"), r.text


def test_a_normalised_segment_longer_than_written_gets_a_lower_cap_not_a_cut_stream(fit_client, fit_server):
    """normalize: a segment is known only when its turn comes; one whose spoken form cannot fit alone is generated
    with the length cap that fits (it ends 'length'), and the stream ends whole."""
    text = "Hi.\n\n" + "Call 1234567 now. " * 10
    segments = split_text(text, 1000)
    t1 = tokens(fit_server, normalize(segments[1].text))
    mgl = 300
    assert len(segments) == 2 and t1 + 1 < FIT_LEN < t1 + 1 + cap(t1, mgl)
    written = tokens(fit_server, segments[1].text)  # as written it fits: the check before any audio lets it in
    assert written + 1 + cap(written, mgl) <= FIT_LEN
    r = fit_client.post("/generate_blocking", json={"target_text": text, "normalize": True, "timings": True,
                                                    "max_generate_length": mgl, "seed": 1, "response_format": "pcm"})
    timings = json.loads(r.headers["X-Segment-Timings"])
    assert [t["finish_reason"] for t in timings] == ["length", "length"]
    assert round(timings[1]["duration_s"] * SAMPLE_RATE) == (FIT_LEN - t1 - 1) * SAMPLES_PER_PATCH
    assert len(pcm(r)) == (cap(tokens(fit_server, "Hi."), mgl) + FIT_LEN - t1 - 1) * SAMPLES_PER_PATCH


def test_a_normalised_segment_with_no_room_is_spoken_as_written_and_the_written_text_checked_first(fit_client,
                                                                                                  fit_server):
    """normalize: a segment whose spoken form alone leaves no room to generate is spoken as written (the stream is the
    one without normalisation, byte for byte; it was cut at that segment); a written text that cannot fit is refused
    before any audio, as without normalisation."""
    text = "Hi.\n\n" + "Call 1234567 now. " * 13
    segments = split_text(text, 1000)
    written, spoken = tokens(fit_server, segments[1].text), tokens(fit_server, normalize(segments[1].text))
    assert len(segments) == 2 and spoken + 1 >= FIT_LEN and written + 1 + cap(written, 300) <= FIT_LEN
    body = {"target_text": text, "timings": True, "max_generate_length": 300, "seed": 5, "response_format": "pcm"}
    r = fit_client.post("/generate_blocking", json={**body, "normalize": True})
    assert r.status_code == 200, r.text
    assert [t["finish_reason"] for t in json.loads(r.headers["X-Segment-Timings"])] == ["length", "length"]
    assert np.array_equal(pcm(r), pcm(fit_client.post("/generate_blocking", json=body)))
    r = fit_client.post("/generate", json={**body, "timings": False, "normalize": True, "max_generate_length": 400})
    assert r.status_code == 422 and r.json()["detail"].startswith(
        "max_generate_length: segment 2 of 2 (characters 5-"), r.text


@pytest.mark.parametrize("route", ["/generate_blocking", "/v1/audio/speech"])
def test_a_wide_space_before_a_period_is_spoken_not_a_500(client, route):
    """A one-letter word, a no-break space and a period panicked the sentence splitter (a BaseException: uvicorn's
    plain 500)."""
    field = {"input": "Hello, A\u00a0. B", "model": "tts-1"} if route.startswith("/v1") else {
        "target_text": "Hello, A\u00a0. B"}
    r = client.post(route, json={**field, "max_generate_length": 3, "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0, r.text


def test_a_normalised_first_segment_longer_than_written_gets_a_lower_cap(fit_client, fit_server):
    """normalize: the first segment fits as written (checked before any audio) but not as spoken with its cap: it is
    generated with the cap that fits, as a later one is (it was a 400 naming max_generate_length, a field the client
    may not have sent)."""
    text = "Call 1234567 now. " * 10 + "\n\nHi."
    segments = split_text(text, 1000)
    written, spoken = tokens(fit_server, segments[0].text), tokens(fit_server, normalize(segments[0].text))
    mgl = 300
    assert len(segments) == 2 and written + 1 + cap(written, mgl) <= FIT_LEN < spoken + 1 + cap(spoken, mgl)
    assert spoken + 1 < FIT_LEN
    r = fit_client.post("/generate_blocking", json={"target_text": text, "normalize": True, "timings": True,
                                                    "max_generate_length": mgl, "seed": 1, "response_format": "pcm"})
    assert r.status_code == 200, r.text
    timings = json.loads(r.headers["X-Segment-Timings"])
    assert timings[0]["finish_reason"] == "length"
    assert round(timings[0]["duration_s"] * SAMPLE_RATE) == (FIT_LEN - spoken - 1) * SAMPLES_PER_PATCH


def test_a_live_first_segment_too_long_for_its_cap_gets_a_lower_cap(fit_server):
    """A live session's first segment fits the model only with a lower length cap: it is spoken with the cap that
    fits, as every later segment is (nothing checks a live text before its audio: it ended the session with 1008,
    while the same sentence as a second segment was spoken)."""
    sentence = "One long sentence " + "keeps going with many plain words and " * 6 + "then it ends."
    assert len(split_text(sentence, 1000)) == 1
    written = tokens(fit_server, sentence.strip())
    mgl = 400
    assert written + 1 < FIT_LEN < written + 1 + cap(written, mgl)
    url = fit_server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url, open_timeout=60) as ws:
        ws.send(json.dumps({"type": "session.config", "max_generate_length": mgl, "seed": 1, "response_format": "pcm"}))
        ws.send(json.dumps({"type": "input.text", "text": sentence}))
        ws.send(json.dumps({"type": "input.done"}))
        audio, events = b"", []
        with pytest.raises(ConnectionClosedOK):
            while True:
                msg = ws.recv(timeout=120)
                if isinstance(msg, bytes):
                    audio += msg
                else:
                    events.append(json.loads(msg))
    assert [e["type"] for e in events if e["type"] == "error"] == [], events
    assert events[-1]["type"] == "session.done"
    assert len(audio) // 2 == (FIT_LEN - written - 1) * SAMPLES_PER_PATCH
