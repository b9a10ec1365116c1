"""Live text over a WebSocket: /v1/audio/speech/stream, with vLLM-Omni's message names (docs/http-api.md, Live text).

One connection is one session: a `session.config`, then `input.text` deltas (`flush`, `input.done`). A receive loop
feeds the deltas to a `LiveSegmenter` and puts each finished segment on a queue; a send loop runs one
`LongFormSpeech` over that queue (so a segment is submitted as soon as its boundary arrives, the next while the
current one decodes) and sends each segment as `audio.start`, binary audio, `audio.done`. The two run concurrently;
whichever ends first (a protocol error, the client leaving, the speech done) ends the other, and ending the speech
aborts every segment still generating, which frees their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable

import numpy as np
from fastapi import APIRouter, HTTPException, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from engine import OverloadedError
from service.audio import STREAMED, Encoder, make_encoder, output_rate
from service.deps import key_matches, key_of, unavailable_reason
from service.errors import LIVE_TERMS, http_error, in_route_terms
from service.longform import (
    LongFormOptions,
    LongFormSpeech,
    SegmentStarted,
    SegmentTiming,
    check_length,
    check_segments_fit,
    design_of,
)
from service.routers.openai import _voice, adapter_ids, model_ids
from service.schemas import SpeechStreamConfig
from service.segmenter import LiveSegmenter, Segment
from service.shared_adapters import sync_adapters
from service.state import ServiceState

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["openai"])
ROUTE = "/v1/audio/speech/stream"
SUBPROTOCOL = "voxcpm"  # what the server answers to a client that offers it (a browser needs one answered)
KEY_PROTOCOL = "bearer."  # a subprotocol "bearer.<key>": the API key where a client cannot set headers (browsers)

# Close codes (RFC 6455)
NORMAL = 1000
STALLED = 1001  # the client took nothing for NANOVLLM_SEND_TIMEOUT_S: as gone as one that left
POLICY = 1008  # the client broke the protocol, a limit or the key rule, or sent a request the service refuses
TOO_BIG = 1009  # a message over NANOVLLM_WS_MAX_MESSAGE_BYTES
SERVER_ERROR = 1011  # the service failed (a worker's error)
TRY_LATER = 1013  # loading, overloaded or shutting down: connect again shortly


class SessionError(Exception):
    """Ends a session: sent as {"type": "error", "message"}, then the connection closes with `code`."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def close_code(status: int) -> int:
    """An HTTP status's close code: 503 -> try later, another 4xx -> policy, the rest -> server error."""
    if status == 503:
        return TRY_LATER
    return POLICY if 400 <= status < 500 else SERVER_ERROR


def session_error(e: Exception) -> SessionError:
    """An HTTP refusal or an engine (or voice store) error as the session's end."""
    http = e if isinstance(e, HTTPException) else http_error(e)
    return SessionError(in_route_terms(str(http.detail), LIVE_TERMS), close_code(http.status_code))


def chosen_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol to answer: ours where offered, else the first offered that is not a key (a browser fails a
    handshake whose answer names none of its offers); never a `bearer.<key>`, which the answer would echo in clear (a
    client offering only its key still connects, without a subprotocol)."""
    if SUBPROTOCOL in offered:
        return SUBPROTOCOL
    return next((o for o in offered if not o.startswith(KEY_PROTOCOL)), None)


def given_key(ws: WebSocket) -> str:
    """The API key of a handshake: `Authorization: Bearer` / `X-API-Key`, else a `bearer.<key>` subprotocol."""
    key = key_of(ws.headers)
    if key:
        return key
    for protocol in ws.scope.get("subprotocols") or []:
        if protocol.startswith(KEY_PROTOCOL):
            return protocol[len(KEY_PROTOCOL):]
    return ""


def config_error(e: ValidationError) -> str:
    """The first problem of a session.config, naming its field."""
    err = e.errors()[0]
    field = ".".join(str(p) for p in err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    return f"session.config: {field}: {message}" if field else f"session.config: {message}"


class LiveSession:
    """One WebSocket session (see the module's docstring)."""

    def __init__(self, state: ServiceState, ws: WebSocket) -> None:
        self.state, self.ws = state, ws
        s = state.settings
        self.max_bytes, self.idle_s, self.max_chars = s.ws_max_message_bytes, s.ws_idle_timeout_s, s.max_text_chars
        self.segments: asyncio.Queue[Segment | None] = asyncio.Queue()
        self.segmenter = LiveSegmenter(s.segment_chars)
        self.chars = 0  # text received so far (and the instructions)
        self.counted = ""
        self.input_done = False
        self.speech: LongFormSpeech | None = None
        self.encoder: Encoder | None = None
        self.fmt = "pcm"
        self.sample_rate = state.sample_rate

    # --- receiving ------------------------------------------------------------------------------------------

    async def message(self, timeout_s: float | None, waiting_for: str) -> dict:
        """The client's next message as a JSON object; a SessionError for anything else or for none in time."""
        try:
            msg = await asyncio.wait_for(self.ws.receive(), timeout_s)
        except asyncio.TimeoutError:
            raise SessionError(f"{waiting_for}: nothing received for {timeout_s:g} s", POLICY) from None
        if msg["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(msg.get("code", 1000))
        text = msg.get("text")
        if text is None:
            raise SessionError("message: binary frames are not accepted; send JSON text messages", POLICY)
        size = len(text.encode())
        if size > self.max_bytes:
            raise SessionError(f"message: {size} bytes exceeds the limit of {self.max_bytes} bytes "
                               "(NANOVLLM_WS_MAX_MESSAGE_BYTES)", TOO_BIG)
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise SessionError(f"message: not JSON ({e})", POLICY) from None
        except RecursionError:  # the parser recurses per level of nesting
            raise SessionError("message: not JSON (nested too deeply)", POLICY) from None
        if not isinstance(body, dict) or not isinstance(body.get("type"), str):
            raise SessionError("message: a JSON object with a string field 'type' is expected", POLICY)
        for key, value in body.items():  # JSON's escapes can spell a lone UTF-16 half, which no text encodes
            try:
                json.dumps(value, ensure_ascii=False).encode()
            except (UnicodeEncodeError, RecursionError) as e:  # recursion: parsed deeper than this stack reaches
                where = "message: type" if key == "type" else f"{body['type']}: {key}"
                rule = (": nested too deeply" if isinstance(e, RecursionError)
                        else " holds an unpaired surrogate (a lone \\ud800-\\udfff escape)")
                raise SessionError(where + rule, POLICY) from None
        return body

    async def configure(self) -> None:
        """Wait for session.config and make the session's speech from it (every refusal names its field)."""
        s = self.state.settings
        body = await self.message(s.ws_config_timeout_s, "session.config")
        if body["type"] != "session.config":
            raise SessionError(f"{body['type']}: the first message must be session.config", POLICY)
        try:
            config = SpeechStreamConfig.model_validate(body)
        except ValidationError as e:
            raise SessionError(config_error(e), POLICY) from None
        try:
            params = config.sampling(self.state.model.max_model_len)
            out_rate = config.output_rate(config.response_format)
            # the instructions count toward the session's text, as they count toward a request's on the routes
            instructions = (config.instructions or "").strip()
            check_length(self.state, instructions, "instructions")
            self.chars, self.counted = len(instructions), " (with the instructions)" if instructions else ""
        except HTTPException as e:  # its fields' rules that depend on the deployment: named as the schema's are
            raise SessionError(f"session.config: {e.detail}", close_code(e.status_code)) from None
        try:
            lora_name = None
            if config.model not in model_ids(self.state):
                if config.model not in await adapter_ids(self.state, config.model):
                    raise HTTPException(404, f"model: unknown model {config.model!r}; GET /v1/models lists them")
                lora_name = config.model
                await sync_adapters(self.state, lora_name)
            cond = await _voice(self.state, config.voice)
            design = design_of(config.instructions)
            if design:  # with the voice, the description (the first segment carries it) must leave a text room
                await check_segments_fit(self.state, [Segment(0, "a", 0, 1, "none")], cond, params, design,
                                         "instructions", design_only=True)
        except (WebSocketDisconnect, OSError):
            raise
        except Exception as e:
            raise session_error(e) from None
        self.segmenter = LiveSegmenter(s.segment_chars, config.split_granularity)
        self.fmt = config.response_format
        self.sample_rate = output_rate(self.state.sample_rate, self.fmt, out_rate)
        self.encoder = make_encoder(self.fmt, self.state.sample_rate, s.mp3_bitrate_kbps, s.mp3_quality,
                                    speed=config.speed, out_rate=out_rate)
        options = LongFormOptions.from_settings(s, config.retry_badcase)
        self.speech = LongFormSpeech(self.state, ROUTE, self.queued(), cond, params, options, lora_name, design,
                                     config.normalize, config.speed, first_checked=False)

    async def queued(self) -> AsyncIterator[Segment]:
        while (segment := await self.segments.get()) is not None:
            yield segment

    def put(self, segments: list[Segment]) -> None:
        for segment in segments:
            self.segments.put_nowait(segment)

    async def receive_loop(self) -> None:
        """Text in until the client leaves (after input.done, only to notice that); returns never."""
        while True:
            body = await self.message(None if self.input_done else self.idle_s, "idle")
            kind = body["type"]
            if self.input_done:
                raise SessionError(f"{kind}: input.done was sent; the session takes no more messages", POLICY)
            if kind == "input.text":
                text = body.get("text")
                if not isinstance(text, str):
                    raise SessionError("input.text: text must be a string", POLICY)
                self.chars += len(text)
                if self.chars > self.max_chars:
                    raise SessionError(f"input.text: {self.chars} characters{self.counted} is more than this service "
                                       f"speaks in one session (NANOVLLM_MAX_TEXT_CHARS = {self.max_chars})", POLICY)
                self.put(self.segmenter.feed(text))
            elif kind == "flush":
                self.put(self.segmenter.flush())
            elif kind == "input.done":
                self.put(self.segmenter.done())
                self.segments.put_nowait(None)
                self.input_done = True
            elif kind == "session.config":
                raise SessionError("session.config: the session is already configured", POLICY)
            else:
                raise SessionError(f"type: unknown message type {kind!r} (input.text, flush or input.done)", POLICY)

    # --- sending --------------------------------------------------------------------------------------------

    async def encode(self, samples: np.ndarray, last: bool) -> None:
        assert self.encoder is not None
        data = await asyncio.to_thread(self.encoder, samples, last)
        if data:
            await self.send(self.ws.send_bytes(data))

    async def end_segment(self) -> None:
        """A segment's audio is all in: pcm and mp3 flush the speed and rate stages (the stream goes on), the
        whole-file formats send the segment's file."""
        if self.fmt not in STREAMED:
            await self.encode(np.zeros(0, np.float32), True)
            return
        end = getattr(self.encoder, "end_segment", None)
        if end is not None:
            data = await asyncio.to_thread(end, np.zeros(0, np.float32))
            if data:
                await self.send(self.ws.send_bytes(data))

    async def send(self, sending: Awaitable[None]) -> None:
        """One message out within NANOVLLM_SEND_TIMEOUT_S: a client that takes nothing that long has left (it held
        the audio made for it, and the drain, for good)."""
        try:
            await asyncio.wait_for(sending, self.state.settings.send_timeout_s)
        except asyncio.TimeoutError:
            log.warning("speech stream session: its client took nothing for %g s: ended",
                        self.state.settings.send_timeout_s)
            raise WebSocketDisconnect(STALLED) from None

    async def start_segment(self, index: int, text: str) -> None:
        await self.send(self.ws.send_json({"type": "audio.start", "segment_index": index, "sentence_index": index,
                                           "text": text, "format": self.fmt, "sample_rate": self.sample_rate}))

    async def send_loop(self) -> None:
        """The speech's events -> audio.start, binary audio, audio.done per segment, then session.done. A segment's
        frames begin with the pause before it, so the frames played back to back are the session's stream."""
        assert self.speech is not None
        events = self.speech.events()
        held: list[np.ndarray] = []  # audio before the next segment's start (the pause): sent as its first frames
        started = False
        count, duration = 0, 0.0
        try:
            async for ev in events:
                if isinstance(ev, np.ndarray):
                    if started:
                        await self.encode(ev, False)
                    else:
                        held.append(ev)
                elif isinstance(ev, SegmentStarted):
                    await self.start_segment(ev.segment.index, ev.segment.text)
                    started = True
                    for samples in held:
                        await self.encode(samples, False)
                    held = []
                elif isinstance(ev, SegmentTiming):
                    if not started:  # a silent segment
                        await self.start_segment(ev.index, ev.text)
                    await self.end_segment()
                    started = False
                    count, duration = count + 1, ev.start_s + ev.duration_s
                    await self.send(self.ws.send_json({"type": "audio.done", "segment_index": ev.index,
                                                       "sentence_index": ev.index, "start_s": round(ev.start_s, 6),
                                                       "duration_s": round(ev.duration_s, 6),
                                                       "finish_reason": ev.finish_reason, "text_start": ev.start,
                                                       "text_end": ev.end}))
            if self.fmt in STREAMED:
                await self.encode(np.zeros(0, np.float32), True)  # MP3's last frames
        except (WebSocketDisconnect, OSError):
            raise  # the client left
        except Exception as e:
            if isinstance(e, OverloadedError):  # counted as the HTTP routes' refusals are (the alert watches it)
                self.state.metrics.overloaded.labels(ROUTE).inc()
            raise session_error(e) from e
        finally:
            await events.aclose()
            await self.speech.aclose()
        reason = self.speech.finish_reason or "stop"
        self.state.metrics.finished.labels(ROUTE, reason).inc()
        await self.ws.send_json({"type": "session.done", "segments": count, "total_sentences": count,
                                 "duration_s": round(duration, 6), "finish_reason": reason})

    # --- the session ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        tasks: list[asyncio.Task] = []
        try:
            keys = self.state.api_keys
            if keys and not key_matches(keys, given_key(self.ws)):
                raise SessionError("authorization: a valid API key is required (Authorization: Bearer <key>, or "
                                   "the subprotocol bearer.<key>)", POLICY)
            reason = unavailable_reason(self.state)
            if reason is not None:
                raise SessionError(reason, TRY_LATER)
            await self.configure()
            tasks = [asyncio.create_task(self.receive_loop()), asyncio.create_task(self.send_loop())]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()  # the other loop: the client left, broke the protocol, or the speech is done
            await asyncio.gather(*tasks, return_exceptions=True)
            first = done.pop()
            if first.exception() is not None:
                raise first.exception()
            await self.ws.close(NORMAL)
        except SessionError as e:
            await self.fail(e)
        except (WebSocketDisconnect, OSError):
            pass  # the client left: the speech is ended, its segments aborted
        except Exception as e:  # a fault of ours: the client still gets an error and a close frame
            log.exception("speech stream session failed")
            await self.fail(SessionError(f"server: the session failed ({type(e).__name__})", SERVER_ERROR))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.speech is not None:
                await self.speech.aclose()

    async def fail(self, e: SessionError) -> None:
        if e.code == SERVER_ERROR:
            log.warning("speech stream session failed: %s", e.message)
        with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):  # the client may be gone already
            await self.ws.send_json({"type": "error", "message": e.message})
            await self.ws.close(e.code, reason=e.message.encode()[:120].decode(errors="ignore"))  # a frame's limit


@router.websocket("/audio/speech/stream")
async def speech_stream(ws: WebSocket) -> None:
    """Live text in, audio out (docs/http-api.md, Live text)."""
    await ws.accept(subprotocol=chosen_subprotocol(ws.scope.get("subprotocols") or []))
    await LiveSession(ws.app.state.service, ws).run()
