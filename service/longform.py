"""The segmented generation path: segments (from `service.segmenter`) -> one engine request each -> one audio
stream, in order. docs/long-form.md has the rules; in short:

- One voice: every segment gets the request's conditioning and seed. With no prompt audio (zero-shot, voice design,
  a reference alone) the first segment's own latents and text become the continuation prompt of every later one.
- Pipelined: the next segment is submitted while the current one decodes (at most two engine requests at once), and
  its chunks are read into a queue as they come, whatever the listener's pace.
- Joined: silence trimmed at the edges where two segments meet, short fades there, a pause between them (longer
  after a paragraph); no loudness normalisation. The first segment's start and the last one's end stay as generated.
- Fitted: every segment fits max_model_len. One that cannot with the request's own voice is refused before any
  audio; where a later one with the first segment carried would not fit, less is carried (the first segment's
  audio as a reference, or nothing), never less text.
- Bad cases: a segment whose patches reach `badcase_ratio` per text token is generated again with the next seed, up
  to `badcase_tries` times; a segment is then held back until it is done.

`LongFormSpeech.events()` yields the joined float32 audio, a `SegmentStarted` before each segment's first sample and
a `SegmentTiming` after its last; the HTTP routes encode it (`LongGeneration`), a WebSocket can feed it live text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

import numpy as np
from fastapi import HTTPException

from engine import GenerationStream, OverloadedError, PoolError, SamplingParams, SynthesisRequest
from engine.io.tokenizer import text_tokens_many
from engine.serving.stream import text_ids, tokenizable
from engine.vocabulary import REF_MARKER_TOKENS, SAMPLING_LIMITS, TextIds, longest_part, max_patches
from service import synthesis
from service.audio import make_encoder, sse_event
from service.conditioning import Conditioning, latent_patches
from service.errors import http_error, in_route_terms
from service.normalize import normalize
from service.segmenter import Granularity, Segment, split_text
from service.settings import BaseServiceSettings
from service.shared_adapters import sync_adapters
from service.state import ServiceState

SILENCE = 10 ** (-50 / 20)  # -50 dBFS: quieter edge samples are trimmed where two segments meet
FINISH_ORDER = ("stop", "length", "aborted", "error")  # the request's reason: its segments' worst
TIMINGS_HEADER = "X-Segment-Timings"
# Segments whose timings a blocking response's header may carry (~110 bytes each: ~14 KiB; a reverse proxy's header
# buffer must hold it, e.g. nginx `proxy_buffer_size 16k`; Python's http.client refuses a header line past 64 KiB).
MAX_HEADER_TIMINGS = 128
VOICE_DESIGN = re.compile(r"^\s*\([^()]*\)")  # "(description)text": the description leads the first segment only

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LongFormOptions:
    """How segments are joined and guarded (NANOVLLM_* settings, `retry_badcase` per request)."""

    sentence_pause_s: float = 0.2
    paragraph_pause_s: float = 0.6
    fade_s: float = 0.01
    retry_badcase: bool = False
    badcase_ratio: float = 6.0
    badcase_tries: int = 3

    @classmethod
    def from_settings(cls, s: BaseServiceSettings, retry_badcase: bool) -> LongFormOptions:
        return cls(s.segment_pause_ms / 1000, s.paragraph_pause_ms / 1000, s.segment_fade_ms / 1000, retry_badcase,
                   s.badcase_ratio, s.badcase_tries)


@dataclass(frozen=True)
class SegmentStarted:
    segment: Segment
    start_s: float  # where its audio starts in the stream


@dataclass(frozen=True)
class SegmentTiming:
    """One segment's place in the audio, from exact sample counts (pauses lie between segments, in none)."""

    index: int
    text: str
    start: int  # character offsets into the request's text
    end: int
    start_s: float
    duration_s: float
    finish_reason: str
    tries: int

    def public(self, with_text: bool = True) -> dict:
        d = {"index": self.index, "start": self.start, "end": self.end, "start_s": round(self.start_s, 6),
             "duration_s": round(self.duration_s, 6), "finish_reason": self.finish_reason, "tries": self.tries}
        return {**d, "text": self.text} if with_text else d


def next_seed(seed: int | None, attempt: int) -> int | None:
    """The seed of a bad case's `attempt`-th regeneration (a random request stays random)."""
    if seed is None or attempt == 0:
        return seed
    return (seed + attempt) % (SAMPLING_LIMITS["seed"].high + 1)


def split_design(text: str) -> tuple[str, str]:
    """'(description)text' -> ('(description)', 'text'); no description -> ('', text)."""
    m = VOICE_DESIGN.match(text)
    return (m.group(0), text[m.end():]) if m else ("", text)


def spoken_as_written(text: str) -> str:
    """A text whose voice description comes apart (/v1's instructions, a live session's): its own leading '(...)'
    reads as brackets, so that the model speaks it ("(555) 123-4567") rather than taking it for a description, the
    form the model knows; the length stays, and with it every offset into the text."""
    m = VOICE_DESIGN.match(text)
    if not m:
        return text
    lead = m.group(0)
    return lead.replace("(", "[", 1)[:-1] + "]" + text[m.end():]


def design_of(instructions: str | None) -> str:
    """The voice-design prefix '(instructions)' of a route with an `instructions` field ('' for none). Parentheses
    inside read as brackets: one would close the description early ("(a) b)Hi" speaks "b)Hi")."""
    text = (instructions or "").strip()
    return f"({text.replace('(', '[').replace(')', ']')})" if text else ""


@dataclass(frozen=True)
class Positions:
    """What one generation takes of a sequence, counted as the engine counts it (engine/prompt.py and the scheduler's
    never_fits): its prompt (text, voice and markers) and the patches it may generate."""

    prompt: int
    cap: int
    text: int  # the prompt's text tokens (the target's, with a continuation prompt's transcript)

    def fits(self, limit: int) -> bool:
        return self.prompt < limit and self.prompt + self.cap <= limit


def position_limit(state: ServiceState) -> int:
    """The longest sequence a worker runs: max_model_len, or fewer where its KV cache holds fewer positions."""
    info = state.model
    cache = info.kv_blocks * info.block_size
    return min(info.max_model_len, cache) if cache > 0 else info.max_model_len


ESTIMATE_SLACK = 32  # tokens: a transcript and a text counted together differ from their counts apart by a few at most


def positions(state: ServiceState, request: SynthesisRequest, ids: TextIds) -> Positions:
    return positions_of(state, request, len(ids.target), len(ids.text if ids.text is not None else ids.target))


def positions_of(state: ServiceState, request: SynthesisRequest, target: int, text: int) -> Positions:
    """`positions` from the counts: `target` tokens of the target text, `text` of the prompt's text."""
    ref = request.ref_latents
    prompt = ((latent_patches(state, ref) + REF_MARKER_TOKENS if ref is not None else 0) + text + 1
              + latent_patches(state, request.prompt_latents))
    return Positions(prompt, max_patches(target, request.params.max_generate_length), text)


class EdgeShaper:
    """One segment's audio as it streams: leading silence dropped and a fade-in (trim_start), trailing silence and a
    fade-out (end(shape=True)); the tail that may still be trimmed or faded is held back."""

    def __init__(self, fade_n: int, trim_start: bool) -> None:
        self.fade_n, self.trim_start = fade_n, trim_start and fade_n > 0
        self.started = not self.trim_start
        self.faded = 0 if self.trim_start else fade_n
        self.held = np.zeros(0, np.float32)

    def push(self, chunk: np.ndarray) -> np.ndarray:
        if not self.started:
            loud = np.flatnonzero(np.abs(chunk) > SILENCE)
            if not len(loud):
                return chunk[:0]
            chunk, self.started = chunk[loud[0]:], True
        if self.faded < self.fade_n:
            k = min(self.fade_n - self.faded, len(chunk))
            chunk = chunk.copy()
            chunk[:k] *= np.arange(self.faded + 1, self.faded + k + 1, dtype=np.float32) / (self.fade_n + 1)
            self.faded += k
        if self.fade_n == 0:
            return chunk
        self.held = np.concatenate([self.held, chunk])
        loud = np.flatnonzero(np.abs(self.held) > SILENCE)
        keep_from = max(0, (loud[-1] + 1 if len(loud) else 0) - self.fade_n)
        out, self.held = self.held[:keep_from], self.held[keep_from:]
        return out

    def end(self, shape: bool) -> np.ndarray:
        tail, self.held = self.held, np.zeros(0, np.float32)
        if not shape or self.fade_n == 0:
            return tail
        loud = np.flatnonzero(np.abs(tail) > SILENCE)
        tail = tail[:loud[-1] + 1] if len(loud) else tail[:0]
        k = min(self.fade_n, len(tail))
        if k:
            tail = tail.copy()
            tail[-k:] *= np.arange(k, 0, -1, dtype=np.float32) / (k + 1)
        return tail


class SegmentJob:
    """One segment's engine request (generated again on a bad case): its float32 chunks into a queue as they come,
    or all at its end when bad cases are guarded; then None (or the exception that ended it)."""

    def __init__(self, speech: LongFormSpeech, segment: Segment, prompt: asyncio.Future | None,
                 after: SegmentJob | None) -> None:
        self.speech, self.segment, self.prompt = speech, segment, prompt
        # submitted once the segment before it is generating: a continuation queues ahead of new requests, so it
        # must not overtake that one (a first segment still waiting would time out behind it)
        self.after = after
        self.started = asyncio.Event()  # its engine request made its first patch (or it ended)
        self.failed = False  # it ended in an error: no segment after it is heard
        self.queue: asyncio.Queue[np.ndarray | BaseException | None] = asyncio.Queue()
        self.latents: asyncio.Future[tuple[np.ndarray, str]] = asyncio.get_running_loop().create_future()
        self.finish_reason = "aborted"
        self.tries = 0
        self.request_id = ""
        # as written, for the model: a first segment's leading '(...)' is text, never a description of the voice
        self.written = spoken_as_written(segment.text) if segment.index == 0 else segment.text
        self.text = self.written  # as spoken: normalised per segment when asked (timings stay on the written text)
        self.task = asyncio.ensure_future(self._run())

    async def request(self, attempt: int, prompt: tuple[np.ndarray, str] | None) -> SynthesisRequest:
        sp, cond = self.speech, self.speech.cond
        text = (sp.design + self.text) if self.segment.index == 0 else self.text
        params = dataclasses.replace(sp.params, seed=next_seed(sp.params.seed, attempt))
        prompt_latents, prompt_text = cond.prompt_latents, cond.prompt_text
        if prompt is not None:
            prompt_latents, prompt_text = prompt
        request = SynthesisRequest(text, prompt_text, prompt_latents, None, cond.ref_latents, params, sp.lora_name,
                                   return_latents=sp.continues and self.segment.index == 0,
                                   continuation=self.segment.index > 0 or attempt > 0,
                                   lora_lease=sp.request_id if sp.lora_name is not None else None)
        # an HTTP text's first segment was checked as written before any audio; a later one (a normalised first one,
        # longer than written; a live session's first) is fitted here: it must never fail mid-stream
        if self.segment.index == 0 and not sp.normalize and sp.first_checked:
            return request
        written = ((sp.design if self.segment.index == 0 else "") + self.written) if sp.normalize else None
        request = await sp.fitted(request, self.segment, prompt[0] if prompt is not None else None, written)
        if written is not None and request.target_text == written:  # spoken as written: its transcript too
            self.text = self.written
        return request

    async def _run(self) -> None:
        sp = self.speech
        try:
            if sp.normalize:
                spoken = await sp.state.normalizer(normalize, self.segment.text)
                self.text = spoken_as_written(spoken) if self.segment.index == 0 else spoken
            prompt = await self.prompt if self.prompt is not None else None
            if self.after is not None:
                await self.after.started.wait()
                if self.after.failed:  # never submitted: the stream ends with the segment before
                    raise PoolError(f"segment {self.after.segment.index} failed")
            for attempt in range(sp.options.badcase_tries if sp.options.retry_badcase else 1):
                self.tries = attempt + 1
                # only the first segment's first try may be refused for a full queue or time out in it
                stream = sp.state.pool.submit(await self.request(attempt, prompt), None)
                self.request_id = self.request_id or stream.request_id
                held: list[np.ndarray] = []
                try:
                    async for chunk in stream:
                        self.started.set()
                        (held.append if sp.options.retry_badcase else self.queue.put_nowait)(chunk)
                finally:
                    stream.close()
                    sp.count_audio(stream.samples)
                capped = self._capped(stream)
                if capped:
                    sp.state.metrics.segments_capped.labels(sp.route).inc()
                if capped and sp.options.retry_badcase and self.tries < sp.options.badcase_tries:
                    continue
                for chunk in held:
                    self.queue.put_nowait(chunk)
                self.finish_reason = stream.finish_reason or "stop"
                if stream.latents and not self.latents.done():
                    self.latents.set_result((np.concatenate(stream.latents), self.text))
                break
        except BaseException as e:  # to the reader (a request error before any audio becomes a 4xx there)
            self.failed = True
            self.started.set()
            self.finish_reason = "aborted" if isinstance(e, asyncio.CancelledError) else "error"
            if not self.latents.done():
                self.latents.set_exception(e if isinstance(e, Exception) else PoolError("segment aborted"))
                self.latents.exception()  # retrieved: later segments see it, nothing is logged as lost
            self.queue.put_nowait(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        self.started.set()
        self.queue.put_nowait(None)

    def _capped(self, stream: GenerationStream) -> bool:
        """Its patches reached badcase_ratio per target text token (the official bad case)."""
        if stream.finish_reason != "length":
            return False
        ids = stream.request.text_ids
        patches = stream.samples // self.speech.samples_per_patch
        if ids is None:  # no client-side tokens: the engine's own cap, unless max_generate_length cut it first
            return patches < stream.request.params.max_generate_length
        return patches >= self.speech.options.badcase_ratio * len(ids.target)

    def cancel(self) -> None:
        self.task.cancel()


class LongFormSpeech:
    """Segments -> one float32 audio stream with their timings (see the module's docstring)."""

    def __init__(self, state: ServiceState, route: str, segments: AsyncIterable[Segment], cond: Conditioning,
                 params: SamplingParams, options: LongFormOptions, lora_name: str | None = None,
                 design: str = "", normalize: bool = False, speed: float = 1.0, first_checked: bool = True) -> None:
        self.state, self.route, self.cond, self.params = state, route, cond, params
        self.options, self.lora_name, self.design, self.normalize = options, lora_name, design, normalize
        self.speed = speed  # the stream is time-stretched by it after joining: its times are the generated / speed
        self.first_checked = first_checked  # the first segment was checked to fit before any audio (not live text's)
        self.segments = aiter(segments)
        self.continues = cond.prompt_latents is None  # the first segment becomes the others' continuation prompt
        self.sample_rate = state.sample_rate
        self.samples_per_patch = state.model.samples_per_patch
        self.timings: list[SegmentTiming] = []
        self.samples = 0  # samples of the joined stream so far
        self.generated_samples = 0  # what the engine made, every segment's tries (`count_audio`)
        self.request_id = f"long-{uuid.uuid4().hex[:12]}"
        self.finish_reason: str | None = None
        self._jobs: list[SegmentJob] = []
        # the adapter leased for the segments: unregistered (or registered again) meanwhile, it speaks them all
        self._leased = False

    def count_audio(self, samples: int) -> None:
        """A segment's try ended having made `samples` (kept or regenerated)."""
        self.generated_samples += samples
        if samples:
            self.state.metrics.audio_seconds.labels(self.route).inc(samples / self.sample_rate)

    async def fitted(self, request: SynthesisRequest, segment: Segment, anchor: np.ndarray | None,
                     written: str | None = None) -> SynthesisRequest:
        """A later (or a normalised) segment's request made to fit the sequence the engine runs (refused there, it
        would cut the stream half-way). `anchor`: the first segment's latents it carries as its continuation prompt,
        kept whole where they fit with their transcript; else carried alone as the reference (VoxCPM2: as many of its
        first patches as fit; a request's own reference is kept instead); else not carried. A text that cannot fit
        even alone (known only at its turn: a normalised one, a live session's; written ones were checked before any
        audio) gets the length cap that fits; a normalised one whose prompt alone leaves no room is spoken as
        `written` (its text as the request sent it, which was checked). Tokenized here, so the client sends these ids
        as they are."""
        tokenizer = self.state.pool.client.tokenizer
        if tokenizer is None or not tokenizable(request):
            return request
        ids = await asyncio.to_thread(text_ids, tokenizer, request)
        if ids is None:  # a text the tokenizer refuses: the engine refuses it, naming the field
            return request
        given, request = request, dataclasses.replace(request, text_ids=ids)
        limit = position_limit(self.state)
        if positions(self.state, request, ids).fits(limit):
            return request
        if anchor is not None:
            ids = TextIds(ids.target)
            request = dataclasses.replace(request, prompt_text="", prompt_latents=None, text_ids=ids)
            alone = positions(self.state, request, ids)
            room = limit - alone.prompt - alone.cap - REF_MARKER_TOKENS
            if request.ref_latents is None and self.state.model.version >= 2 and room > 0:
                kept = min(latent_patches(self.state, anchor), room)
                log.info("%s segment %d: the first segment's audio carried as a %d-patch reference (with its "
                         "transcript it exceeds %d positions)", self.request_id, segment.index, kept, limit)
                return dataclasses.replace(request, ref_latents=anchor[:kept * self.state.model.patch_size])
            log.info("%s segment %d: the first segment's audio not carried (it exceeds %d positions)",
                     self.request_id, segment.index, limit)
        need = positions(self.state, request, ids)
        if need.prompt >= limit and written is not None and written != request.target_text:
            log.warning("%s segment %d: spoken as written (normalised, its prompt leaves no room within %d positions)",
                        self.request_id, segment.index, limit)
            return await self.fitted(dataclasses.replace(given, target_text=written), segment, anchor)
        if need.fits(limit) or need.prompt >= limit:  # no room at all: the engine refuses it, naming the field
            return request
        log.warning("%s segment %d: its length cap lowered from %d to %d patches to fit %d positions",
                    self.request_id, segment.index, need.cap, limit - need.prompt, limit)
        return dataclasses.replace(request, params=dataclasses.replace(request.params,
                                                                       max_generate_length=limit - need.prompt))

    async def _next_job(self, first: SegmentJob | None, previous: SegmentJob | None) -> SegmentJob | None:
        segment = await anext(self.segments, None)
        if segment is None:
            return None
        prompt = first.latents if (first is not None and self.continues) else None
        job = SegmentJob(self, segment, prompt, previous)
        self._jobs.append(job)
        return job

    @staticmethod
    async def _shaped(job: SegmentJob, shaper: EdgeShaper, ahead: asyncio.Future) -> AsyncIterator[np.ndarray]:
        """A segment's chunks through its edge shaper, then its tail (faded unless no segment follows)."""
        while (item := await job.queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield shaper.push(item)
        last = ahead.done() and ahead.result() is None
        yield shaper.end(shape=not last)

    async def events(self) -> AsyncIterator[np.ndarray | SegmentStarted | SegmentTiming]:
        fade_n = int(round(self.options.fade_s * self.sample_rate))
        reasons: list[str] = []
        ahead: asyncio.Task | None = None
        try:
            if self.lora_name is not None:
                self.state.pool.client.lease_lora(self.request_id, self.lora_name)
                self._leased = True
            job = await self._next_job(None, None)
            first = job
            pending_pause = 0
            while job is not None:
                ahead = asyncio.ensure_future(self._next_job(first, job))  # submitted while this one decodes
                shaper = EdgeShaper(fade_n, trim_start=job.segment.index > 0)
                start_s: float | None = None
                produced = 0
                async for out in self._shaped(job, shaper, ahead):
                    if not len(out):
                        continue
                    if start_s is None:
                        if pending_pause:
                            yield np.zeros(pending_pause, np.float32)
                            self.samples += pending_pause
                        pending_pause, start_s = 0, self.samples / self.sample_rate
                        yield SegmentStarted(job.segment, start_s / self.speed)
                    yield out
                    self.samples += len(out)
                    produced += len(out)
                if start_s is None:  # a silent segment: it takes no time
                    start_s = self.samples / self.sample_rate
                reasons.append(job.finish_reason)
                timing = SegmentTiming(job.segment.index, job.segment.text, job.segment.start, job.segment.end,
                                       start_s / self.speed, produced / self.sample_rate / self.speed,
                                       job.finish_reason, job.tries)
                self.timings.append(timing)
                yield timing
                pause_s = {"sentence": self.options.sentence_pause_s,
                           "paragraph": self.options.paragraph_pause_s}.get(job.segment.pause, 0.0)
                pending_pause += int(round(pause_s * self.sample_rate))
                job, ahead = await ahead, None
            self.finish_reason = max(reasons, key=FINISH_ORDER.index) if reasons else "stop"
        except BaseException:
            self.finish_reason = "aborted" if self.finish_reason is None else self.finish_reason
            raise
        finally:
            if ahead is not None and not ahead.done():  # the next segment's submission, if still on its way
                ahead.cancel()
                with contextlib.suppress(BaseException):
                    await ahead
            await self.aclose()

    async def aclose(self) -> None:
        """Cancel every segment still running (their engine requests abort, KV blocks freed)."""
        if self.finish_reason is None:
            self.finish_reason = "aborted"
        for job in self._jobs:
            job.cancel()
        for job in self._jobs:
            with contextlib.suppress(BaseException):
                await job.task
        self._jobs.clear()
        if self._leased:
            self._leased = False
            self.state.pool.client.lease_lora(self.request_id, None)


async def iterate(segments: list[Segment]) -> AsyncIterator[Segment]:
    for segment in segments:
        yield segment


class _StreamId:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class LongGeneration:
    """A long-form request encoded for HTTP, shaped like `synthesis.Generation` (chunks, collect, close,
    finish_reason) so the same responses send it. With `sse` and `timings`, timings travel as `speech.segment` events
    (without `timings`, only OpenAI's own event types)."""

    def __init__(self, speech: LongFormSpeech, fmt: str, sse: bool, sample_rate: int | None = None,
                 timings: bool = False) -> None:
        self.speech, self.state, self.route = speech, speech.state, speech.route
        s = self.state.settings
        self.encoder = make_encoder(fmt, self.state.sample_rate, s.mp3_bitrate_kbps, s.mp3_quality, sse, speech.speed,
                                    sample_rate)
        self.sample_rate = sample_rate  # the output's rate where the request set one (synthesis.audio_headers)
        self.segment_events = sse and timings
        self.stream = _StreamId(speech.request_id)
        self._events = speech.events()
        self.first: bytes | None = None
        self._body = self._encoded()
        self._counted = False

    @property
    def finish_reason(self) -> str | None:
        return self.speech.finish_reason

    @property
    def generated_patches(self) -> int:
        return self.speech.generated_samples // self.speech.samples_per_patch

    async def _encoded(self) -> AsyncIterator[bytes]:
        async for ev in self._events:
            if isinstance(ev, np.ndarray):
                data = await asyncio.to_thread(self.encoder, ev, False)
                if data:
                    yield data
            elif isinstance(ev, SegmentTiming) and self.segment_events:
                yield sse_event({"type": "speech.segment", **ev.public()})
        data = await asyncio.to_thread(self.encoder, np.zeros(0, np.float32), True)
        if data:
            yield data

    async def start(self) -> None:
        """Pull the first bytes: a request error of the first segment becomes a 4xx before any response."""
        try:
            self.first = await anext(self._body, None)
        except PoolError as e:
            await self.close()
            if isinstance(e, OverloadedError):
                self.state.metrics.overloaded.labels(self.route).inc()
            raise http_error(e, terms=self.speech.cond.terms) from e
        except BaseException:
            await self.close()
            raise

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            if self.first is not None:
                yield self.first
                async for data in self._body:
                    yield data
        finally:
            await self.close()

    async def close(self) -> None:
        await self._body.aclose()
        await self._events.aclose()
        await self.speech.aclose()
        if not self._counted and self.finish_reason:
            self._counted = True
            self.state.metrics.finished.labels(self.route, self.finish_reason).inc()

    async def collect(self) -> bytes:
        return b"".join([c async for c in self.chunks()])


async def start(state: ServiceState, route: str, segments: list[Segment], cond: Conditioning,
                params: SamplingParams, fmt: str, options: LongFormOptions, sse: bool = False,
                lora_name: str | None = None, design: str = "", normalize: bool = False, speed: float = 1.0,
                sample_rate: int | None = None, timings: bool = False) -> LongGeneration:
    """A long-form generation whose first encoded bytes have arrived."""
    if lora_name is not None:
        await sync_adapters(state, lora_name)
    speech = LongFormSpeech(state, route, iterate(segments), cond, params, options, lora_name, design, normalize,
                            speed)
    gen = LongGeneration(speech, fmt, sse, sample_rate, timings)
    await gen.start()
    return gen


def _limit_words(state: ServiceState, limit: int) -> str:
    mml = state.model.max_model_len
    return f"max_model_len={mml}" if limit == mml else f"the KV cache's {limit} positions (max_model_len={mml})"


async def check_segments_fit(state: ServiceState, segments: list[Segment], cond: Conditioning,
                             params: SamplingParams, design: str, design_field: str = "",
                             design_only: bool = False) -> None:
    """Refuse before any audio (422) a text with a segment that cannot be generated with the request's own voice: the
    engine would refuse it only when its turn comes, mid-stream. (What a later segment carries of the first is
    shortened to fit as it goes: `LongFormSpeech.fitted`.) The message starts with the field to change, in engine
    terms. `design_field`: the request field the voice description came in when not in the text (`instructions`),
    counted as its own part of the first segment's prompt (the engine counts it in the text). `design_only`: one
    text, refused here (400, as the engine refuses) only where that field is the one to change; the engine names
    the rest."""
    tokenizer = state.pool.client.tokenizer
    if tokenizer is None:
        return
    continuation = cond.prompt_latents is not None
    texts = [(design + spoken_as_written(s.text)) if s.index == 0 else s.text for s in segments]
    described = bool(design and design_field)
    # Each text and the transcript counted apart, their sum the estimate: counting each segment with the transcript
    # cost segments x transcript (3,333 paragraphs and a 20,000-character transcript took 10 GB). Where the estimate
    # is near the limit, or over it (the message gives the counts), the segment is counted as the engine counts it.
    alone = [*texts, *([design] if described else [])]
    tokens = await asyncio.to_thread(text_tokens_many, tokenizer, [(t, "", False) for t in alone])
    # the transcript as the engine reads it, not as a target text (white space collapsed: 100-300 tokens fewer)
    transcript = (await asyncio.to_thread(tokenizer.encode_many, [cond.prompt_text]))[0] if continuation else []
    design_ids = tokens.pop() if described else ([], None)
    design_tokens = 0 if isinstance(design_ids, Exception) else len(design_ids[0])
    voice = SynthesisRequest("", cond.prompt_text, cond.prompt_latents, None, cond.ref_latents, params)
    limit = position_limit(state)
    for segment, text, ids in zip(segments, texts, tokens, strict=True):
        if isinstance(ids, Exception):  # a text the tokenizer refuses: the engine refuses it, naming the field
            continue
        if continuation and not isinstance(transcript, Exception):
            estimate = positions_of(state, voice, len(ids[0]), len(transcript) + len(ids[0]))
            if estimate.fits(limit - ESTIMATE_SLACK):
                continue
        if continuation:
            (ids,) = await asyncio.to_thread(text_tokens_many, tokenizer, [(text, cond.prompt_text, True)])
            if isinstance(ids, Exception):
                continue
        need = positions(state, voice, TextIds(*ids))
        if need.fits(limit):
            continue
        where = (f"segment {segment.index + 1} of {len(segments)} (characters {segment.start}-{segment.end})"
                 if len(segments) > 1 else "the text")
        if need.prompt < limit:
            if design_only:
                continue
            each = (f": each segment of a long text is one generation, here of at most {limit - need.prompt} patches"
                    if len(segments) > 1 else "")
            message = (f"max_generate_length: {where} is a prompt of {need.prompt} tokens (text and voice) plus up "
                       f"to {need.cap} patches, which exceeds {_limit_words(state, limit)}{each}")
        else:
            target = len(ids[0])
            described_tokens = min(design_tokens, target) if segment.index == 0 else 0
            parts = {"prompt_text": need.text - target, "prompt_latents": latent_patches(state, cond.prompt_latents),
                     "ref_latents": latent_patches(state, cond.ref_latents)}
            if described_tokens:
                parts[design_field] = described_tokens
            field = longest_part(target - described_tokens, parts)
            if design_only and field != design_field:
                continue
            of_design = f", {described_tokens} of {design_field}" if described_tokens else ""
            message = (f"{field}: {where} is a prompt of {need.prompt} tokens ({target - described_tokens} of text"
                       f"{of_design}, {need.prompt - target} of voice), which leaves no room to generate within "
                       f"{_limit_words(state, limit)}")
        raise HTTPException(400 if design_only else 422, in_route_terms(message, cond.terms))


def check_length(state: ServiceState, text: str, field: str, counted: str = "") -> None:
    """`counted`: what the count covers when more than `field` ("input and instructions")."""
    limit = state.settings.max_text_chars
    if len(text) > limit:
        raise HTTPException(422, f"{field}: {len(text)} characters{f' ({counted})' if counted else ''} is more than "
                                 f"this service speaks in one request (NANOVLLM_MAX_TEXT_CHARS = {limit})")


async def generate(state: ServiceState, route: str, text: str, cond: Conditioning, params: SamplingParams, fmt: str,
                   *, field: str, blocking: bool, retry_badcase: bool | None, timings: bool,
                   granularity: Granularity = "sentence", design: str = "", sse: bool = False,
                   lora_name: str | None = None, normalize: bool = False, speed: float = 1.0,
                   sample_rate: int | None = None) -> synthesis.Generation | LongGeneration:
    """Any text: one segment (and no guard or timings asked) -> today's single generation, byte for byte; more ->
    the segmented path. `text` excludes a voice-design `design` prefix; offsets are into `text` as written, plus
    `len(design)` where the design leads the text the client sent (`field` names it in errors)."""
    own_design = field == "target_text"  # the description leads the text the client sent, else it came separately
    if own_design or not design:
        check_length(state, design + text, field)
    else:  # the longer of the two is named; the count is of what the client sent (not the parentheses added)
        check_length(state, design[1:-1] + text, "instructions" if len(design) - 2 > len(text) else field,
                     f"{field} and instructions")
    base = len(design) if own_design else 0
    # a second description the text starts with (/generate's) leads the first segment whole, never cut; a text whose
    # description comes apart is spoken as written (`spoken_as_written`)
    lead, rest = split_design(text) if own_design else ("", text)
    segments = split_text(rest, state.settings.segment_chars, granularity, base=base + len(lead)) \
        if rest.strip() else []
    if not segments:  # the schemas refuse a blank text: a voice description was all of it, or no word is in it
        description = lead.strip() or design
        raise HTTPException(422, f"{field}: nothing to speak after the voice description {description!r}"
                            if description else f"{field}: nothing to speak (no letter or digit)")
    if timings and not blocking and not sse:
        raise HTTPException(422, "timings: a streamed response has no place for them (its headers go before the "
                                 "audio): ask a blocking route (the X-Segment-Timings header), or /v1/audio/speech "
                                 "with stream_format 'sse' (a speech.segment event for each segment)")
    if timings and blocking and len(segments) > MAX_HEADER_TIMINGS:
        raise HTTPException(422, f"timings: the text is {len(segments)} segments, more than the X-Segment-Timings "
                                 f"header holds ({MAX_HEADER_TIMINGS}, ~{MAX_HEADER_TIMINGS * 110 // 1024} KiB); "
                                 "send shorter texts, or stream from /v1/audio/speech with stream_format 'sse' "
                                 "(a speech.segment event for each segment)")
    design_field = "" if own_design or not design else "instructions"  # a description sent apart is named apart
    design, text = design + lead, rest
    if len(segments) <= 1 and not retry_badcase and not timings:
        if design and design_field:  # the engine would name all of the prompt's text (the description in it) `input`
            await check_segments_fit(state, segments, cond, params, design, design_field, design_only=True)
        first, last = segments[0].start - base - len(lead), segments[0].end - base - len(lead)
        if text[:first].strip() or text[last:].strip():  # what the segmenter left out (no words: "*" x 30,000) is
            text = text[first:last]  # not spoken either: the whole was refused as too long where segments were not
        return await synthesis.start(state, route, design + spoken_as_written(text), cond, params, fmt, sse=sse,
                                     lora_name=lora_name, normalize=normalize, speed=speed, sample_rate=sample_rate)
    # as written: a spoken form longer than that is fitted at its turn (`LongFormSpeech.fitted`)
    await check_segments_fit(state, segments, cond, params, design, design_field)
    options = LongFormOptions.from_settings(state.settings, blocking if retry_badcase is None else retry_badcase)
    return await start(state, route, segments, cond, params, fmt, options, sse=sse, lora_name=lora_name,
                       design=design, normalize=normalize, speed=speed, sample_rate=sample_rate, timings=timings)


def timing_header(gen: synthesis.Generation | LongGeneration) -> dict[str, str]:
    """X-Segment-Timings: the segments' offsets and times as compact JSON (the texts are the request's own)."""
    if not isinstance(gen, LongGeneration):
        return {}
    return {TIMINGS_HEADER: json.dumps([t.public(with_text=False) for t in gen.speech.timings],
                                       separators=(",", ":"))}
