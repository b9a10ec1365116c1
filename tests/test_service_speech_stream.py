"""Live text over a real WebSocket on loopback (/v1/audio/speech/stream; tiny never-stopping checkpoint, CPU): text fed
a word at a time is spoken before input.done, each segment framed by audio.start / audio.done with timings that are
its sample counts, a client leaving mid-stream frees every KV block, and each malformed message or broken limit gets
an error message and its close code."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import soundfile as sf
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.service_harness import SAMPLE_RATE, LiveServer, live_server, small_window_socket

N = 2  # patches per segment (max_generate_length applies per segment)
TEXT = ("The first sentence is spoken while the rest is still being typed. Then another one follows it. "
        "And a third to keep the stream busy. ")
WORDS = TEXT.split() * 4
GUARD_S = 120  # a hang guard, never a timing assertion


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-ws"), voice_store="memory",
                     ws_config_timeout_s=1.0, ws_idle_timeout_s=2.0, ws_max_message_bytes=2048,
                     max_text_chars=3000) as s:
        yield s


def ws_url(server: LiveServer) -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"


@contextmanager
def open_session(server: LiveServer, **config) -> Iterator[ClientConnection]:
    with connect(ws_url(server), open_timeout=GUARD_S) as ws:
        ws.send(json.dumps({"type": "session.config", "max_generate_length": N, "seed": 1, **config}))
        yield ws


def until_session_done(ws: ClientConnection) -> list[dict | bytes]:
    """Every message up to session.done (then the server closes normally)."""
    out: list[dict | bytes] = []
    while True:
        msg = ws.recv(timeout=GUARD_S)
        out.append(msg if isinstance(msg, bytes) else json.loads(msg))
        if isinstance(out[-1], dict) and out[-1]["type"] == "session.done":
            break
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=GUARD_S)
    assert closed.value.rcvd.code == 1000
    return out


def refused(ws: ClientConnection) -> tuple[str, int]:
    """The error message and the close code that follow a refusal (audio before it is skipped)."""
    message = None
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            msg = ws.recv(timeout=GUARD_S)
            if isinstance(msg, str) and json.loads(msg)["type"] == "error":
                message = json.loads(msg)["message"]
    assert message is not None, "closed without an error message"
    return message, closed.value.rcvd.code


def test_words_one_at_a_time_are_spoken_before_input_done(server):
    """An LLM's pace: one word per message; the first segment's audio comes while words are still arriving, and
    every segment's frames and timings agree with the sample counts."""
    with open_session(server, response_format="pcm") as ws:
        first_audio_at_word = None
        messages: list[dict | bytes] = []
        deadline = time.monotonic() + GUARD_S
        i = 0
        while first_audio_at_word is None:
            assert time.monotonic() < deadline, "no audio before input.done"
            ws.send(json.dumps({"type": "input.text", "text": WORDS[i % len(WORDS)] + " "}))
            i += 1
            try:
                while True:
                    msg = ws.recv(timeout=0.02)
                    messages.append(msg if isinstance(msg, bytes) else json.loads(msg))
                    if isinstance(msg, bytes) and first_audio_at_word is None:
                        first_audio_at_word = i
            except TimeoutError:
                pass
        assert first_audio_at_word < len(WORDS)  # while the text was still arriving
        ws.send(json.dumps({"type": "input.done"}))
        messages += until_session_done(ws)
    starts = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.start"]
    dones = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.done"]
    assert starts[0]["segment_index"] == 0 and starts[0]["text"].startswith("The first sentence")
    assert starts[0]["format"] == "pcm" and starts[0]["sample_rate"] == SAMPLE_RATE
    assert [s["segment_index"] for s in starts] == [d["segment_index"] for d in dones] == list(range(len(dones)))
    assert messages[-1] == {"type": "session.done", "segments": len(dones), "total_sentences": len(dones),
                            "duration_s": messages[-1]["duration_s"], "finish_reason": "length"}
    # each segment's frames lie between its audio.start and audio.done; the stream so far ends where it ends
    received = 0
    for m in messages:
        if isinstance(m, bytes):
            received += len(m) // 2
        elif m["type"] == "audio.done":
            assert round((m["start_s"] + m["duration_s"]) * SAMPLE_RATE) == received
            assert m["duration_s"] > 0 and m["finish_reason"] == "length"
    assert round(messages[-1]["duration_s"] * SAMPLE_RATE) == received


def test_flush_speaks_the_buffer_and_whole_file_formats_send_a_file_per_segment(server):
    """`flush` speaks a half sentence at once; wav: each segment's frames are one WAV file of its samples."""
    with open_session(server, response_format="wav", speed=1.5) as ws:
        ws.send(json.dumps({"type": "input.text", "text": "A half sentence with no end"}))
        ws.send(json.dumps({"type": "flush"}))
        start = json.loads(ws.recv(timeout=GUARD_S))
        assert start["type"] == "audio.start" and start["text"] == "A half sentence with no end"
        frames = []
        while isinstance(msg := ws.recv(timeout=GUARD_S), bytes):
            frames.append(msg)
        done = json.loads(msg)
        assert done["type"] == "audio.done" and done["segment_index"] == 0  # before input.done: nothing held back
        ws.send(json.dumps({"type": "input.text", "text": " and then the end."}))
        ws.send(json.dumps({"type": "input.done"}))
        rest = until_session_done(ws)
    assert len(frames) == 1
    audio, rate = sf.read(io.BytesIO(frames[0]), dtype="int16")
    assert rate == SAMPLE_RATE and len(audio) == round(done["duration_s"] * SAMPLE_RATE)
    assert done["duration_s"] == pytest.approx(N * 0.16 / 1.5, abs=2e-3)  # stretched (edges trimmed of silence)
    second = [m for m in rest if isinstance(m, dict) and m["type"] == "audio.start"]
    assert [s["text"] for s in second] == ["and then the end."] and rest[-1]["segments"] == 2


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus"])
def test_every_format(server, fmt):
    """mp3: one stream over the session (its frames decode as one file); flac and opus: one file per segment."""
    with open_session(server, response_format=fmt) as ws:
        ws.send(json.dumps({"type": "input.text", "text": "One sentence here. And a second one."}))
        ws.send(json.dumps({"type": "input.done"}))
        messages = until_session_done(ws)
    frames = [m for m in messages if isinstance(m, bytes)]
    starts = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.start"]
    assert [s["format"] for s in starts] == [fmt, fmt] and messages[-1]["segments"] == 2
    files = [b"".join(frames)] if fmt == "mp3" else frames
    assert len(files) == (1 if fmt == "mp3" else 2)
    for data in files:
        audio, _ = sf.read(io.BytesIO(data), dtype="int16")
        assert len(audio) > 0


@pytest.mark.parametrize("fmt", ["mp3", "pcm"])
def test_a_session_with_nothing_to_speak_ends_normally(server, fmt):
    """input.done before any text (or only blanks): no segment, session.done and a normal close; no audio, but for
    the MP3 stream's flush (LAME's padding frame of silence)."""
    with open_session(server, response_format=fmt) as ws:
        ws.send(json.dumps({"type": "input.text", "text": "   "}))
        ws.send(json.dumps({"type": "input.done"}))
        messages = until_session_done(ws)
    assert messages[-1]["segments"] == 0
    data = b"".join(m for m in messages if isinstance(m, bytes))
    if fmt == "pcm":
        assert data == b""
    else:  # too short a file for libsndfile: an MPEG-1 layer III frame header, at most two frames of 192 kbps
        assert data[:2] == b"\xff\xfb" and len(data) <= 2 * 576


def test_a_wide_space_before_a_period_is_spoken(server):
    """A no-break space between a one-letter word and a period panicked the sentence splitter: the socket closed 1011
    without an error message. Now both sentences are segments and the session ends normally."""
    with open_session(server, response_format="pcm") as ws:
        ws.send(json.dumps({"type": "input.text", "text": "Plan B\u00a0. Next one."}))
        ws.send(json.dumps({"type": "input.done"}))
        messages = until_session_done(ws)
    assert messages[-1]["segments"] == 2 and any(isinstance(m, bytes) and m for m in messages)


@pytest.mark.parametrize("leave", ["close", "drop"])
def test_a_client_leaving_mid_stream_frees_every_kv_block(server, leave):
    before = server.pool_stats()
    with open_session(server, max_generate_length=400) as ws:
        ws.send(json.dumps({"type": "input.text", "text": "One long sentence. Another one behind it. And more. "}))
        assert isinstance(ws.recv(timeout=GUARD_S), str)  # audio.start
        assert isinstance(ws.recv(timeout=GUARD_S), bytes)
        mid = server.pool_stats()
        assert mid.running >= 1 and mid.free_blocks < mid.total_blocks, (before, mid)
        if leave == "drop":  # the connection drops without a closing handshake
            ws.socket.close()
    # else leaving the block closed it with a closing handshake
    LiveServer.wait(lambda: (s := server.pool_stats()).running == s.waiting == 0
                    and s.free_blocks == s.total_blocks, "KV blocks not freed after the client left")
    after = server.pool_stats()
    assert after.free_slots == before.free_slots
    assert after.steps - before.steps < 3 * 400, (before, after)  # aborted, not run to the end


@pytest.mark.parametrize("messages, code, expected", [
    (["not json"], 1008, "message: not JSON"),
    ([b"\x00\x01"], 1008, "message: binary frames are not accepted"),
    ([{"type": "input.text", "text": "Hello."}], 1008, "input.text: the first message must be session.config"),
    ([{"type": "session.config", "colour": "blue"}], 1008, "session.config: colour: Extra inputs are not permitted"),
    ([{"type": "session.config", "speed": 5}], 1008, "session.config: speed: Input should be less than or equal to 4"),
    ([{"type": "session.config", "response_format": "mp3", "sample_rate": 24000}], 1008,
     "session.config: sample_rate: only pcm and wav output can be resampled"),
    ([{"type": "session.config", "voice": "alloy"}], 1008, "voice: unknown voice 'alloy'"),
    ([{"type": "session.config", "max_generate_length": 100000}], 1008,
     "session.config: max_generate_length: 100000 is more than this service can generate"),
    ([{"type": "session.config"}, {"type": "input.audio"}], 1008, "type: unknown message type 'input.audio'"),
    ([{"type": "session.config"}, {"type": "input.text", "text": 3}], 1008, "input.text: text must be a string"),
    ([{"type": "session.config"}, {"type": "session.config"}], 1008, "session.config: the session is already"),
    ([{"type": "session.config"}, [1, 2]], 1008, "message: a JSON object with a string field 'type'"),
    ([{"type": "session.config", "max_generate_length": 400}, {"type": "input.text", "text": "Long."},
      {"type": "input.done"}, {"type": "input.text", "text": "x"}], 1008,
     "input.text: input.done was sent"),
    ([{"type": "session.config"}, {"type": "input.text", "text": "x" * 3000}], 1009,
     "bytes exceeds the limit of 2048 bytes (NANOVLLM_WS_MAX_MESSAGE_BYTES)"),
    ([{"type": "session.config"}] + [{"type": "input.text", "text": "word " * 300}] * 3, 1008,
     "input.text: 4500 characters is more than this service speaks in one session (NANOVLLM_MAX_TEXT_CHARS = 3000)"),
    ([{"type": "session.config", "instructions": "calm " * 300}] + [{"type": "input.text", "text": "word " * 200}] * 2,
     1008, "input.text: 3499 characters (with the instructions) is more than this service speaks in one session"),
    # instructions that leave no room for a text are refused at once (they were taken, then blamed on input.text)
    ([{"type": "session.config", "instructions": "word " * 390}], 1008,
     "instructions: the text is a prompt of"),
    ([{"type": "session.config"}, {"type": "input.text", "text": "hi \ud800 there."}], 1008,
     "input.text: text holds an unpaired surrogate"),
    ([{"type": "session.config", "voice": "\udc00"}], 1008, "session.config: voice holds an unpaired surrogate"),
    ([{"type": "\udc00"}], 1008, "message: type holds an unpaired surrogate"),
    (["[" * 2000], 1008, "message: not JSON (nested too deeply)"),  # a RecursionError: 1011 and a traceback
    ([], 1008, "session.config: nothing received for 1 s"),
    ([{"type": "session.config"}, {"type": "input.text", "text": "Then silence"}], 1008,
     "idle: nothing received for 2 s"),
], ids=["not-json", "binary", "text-first", "unknown-field", "bad-speed", "rate-with-mp3", "unknown-voice",
        "too-long-for-the-model", "unknown-type", "text-not-string", "config-twice", "not-an-object",
        "after-done", "message-cap", "text-cap", "text-cap-with-instructions", "long-instructions",
        "lone-surrogate-text", "lone-surrogate-voice", "lone-surrogate-type", "nested", "config-timeout",
        "idle-timeout"])
def test_malformed_messages_and_limits(server, messages, code, expected):
    with connect(ws_url(server), open_timeout=GUARD_S) as ws:
        for m in messages:
            ws.send(m if isinstance(m, str | bytes) else json.dumps(m))
        message, got = refused(ws)
    assert expected in message and got == code, (message, got)
    LiveServer.wait(lambda: (s := server.pool_stats()).running == s.waiting == 0
                    and s.free_blocks == s.total_blocks, "a refused session left KV blocks behind")


def test_a_message_far_over_the_limit_is_refused_as_it_comes(server):
    """A message over twice NANOVLLM_WS_MAX_MESSAGE_BYTES is refused by the WebSocket protocol as its frames come
    (1009), not read whole before the session refuses it (uvicorn's own limit let 40 sessions each send 15 MiB)."""
    with connect(ws_url(server), open_timeout=GUARD_S, max_size=None) as ws:
        ws.send(json.dumps({"type": "session.config"}))
        ws.send(json.dumps({"type": "input.text", "text": "x" * (10 * 2048)}))
        with pytest.raises(ConnectionClosed) as closed:
            while True:  # the session's own refusal (an error message naming the setting) would come first
                msg = ws.recv(timeout=GUARD_S)
                assert not (isinstance(msg, str) and json.loads(msg)["type"] == "error"), msg
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value


def masked_text_frame(text: str) -> bytes:
    """A client's text frame (masked, as a client's must be; a zero mask leaves the payload as it is)."""
    payload = text.encode()
    assert len(payload) < 65536
    size = bytes([0x80 | len(payload)]) if len(payload) < 126 else bytes([0x80 | 126]) + len(payload).to_bytes(2, "big")
    return bytes([0x81]) + size + bytes(4) + payload


def test_a_client_that_takes_nothing_for_the_send_timeout_is_ended(checkpoint_factory, tmp_path, caplog):
    """A session whose client takes none of its audio for NANOVLLM_SEND_TIMEOUT_S ends as one whose client left (it
    held the audio made for it, and a shutdown's drain, for as long as the client liked): read afterwards, the
    connection holds what the sockets took and no session.done."""
    with live_server(checkpoint_factory, tmp_path, voice_store="memory", send_timeout_s=2) as server, \
            small_window_socket(server.port, GUARD_S) as raw:
        raw.sendall(b"GET /v1/audio/speech/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    b"Sec-WebSocket-Version: 13\r\n\r\n")
        handshake = b""
        while b"\r\n\r\n" not in handshake:
            handshake += raw.recv(1)
        assert handshake.startswith(b"HTTP/1.1 101"), handshake
        for message in ({"type": "session.config", "max_generate_length": 100, "seed": 1, "response_format": "pcm"},
                        {"type": "input.text", "text": "A sentence to speak. " * 12}, {"type": "input.done"}):
            raw.sendall(masked_text_frame(json.dumps(message)))
        # taking nothing: once the sockets hold all they can, a write waits on the client past the timeout
        LiveServer.wait(lambda: "took nothing" in caplog.text, "the session never gave up on its client")
        received = b""
        with contextlib.suppress(TimeoutError):
            raw.settimeout(5)  # the end: the server closes, or sends nothing more
            while data := raw.recv(1 << 16):
                received += data
        assert received and b"session.done" not in received
        LiveServer.wait(lambda: (s := server.pool_stats()).free_blocks == s.total_blocks, "KV blocks held after it")
