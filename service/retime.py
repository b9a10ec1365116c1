"""Per-stream audio stages run before the encoder: a pitch-preserving time-stretch (`speed`) and a resampler
(`sample_rate`). Each is a callable (samples, last) -> samples on float32 mono audio, stateful across one stream's
chunks (in order, one at a time, on an encoder thread), flushed when `last` is true and then ready for more (a new
segment); `AudioStages` chains them in front of an encoder with the encoder's own (samples, last) -> bytes | None
interface, and `end_segment` flushes the stages at a segment's end without ending the encoder's stream.

The stretch is Signalsmith Stretch (MIT) through `python-stretch` (MIT). Its binding stretches a whole buffer per
call and resets, so a stream is stretched in fixed blocks of input (absolute positions, so the output does not depend
on how the engine chunks the audio), each run with context on both sides and joined to the previous block by a short
crossfade after lining the two up. The output of N input samples is exactly round(N / speed) samples.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import soxr
from python_stretch.Signalsmith import Stretch

SPEED_MIN, SPEED_MAX = 0.25, 4.0
RESAMPLED_FORMATS = ("pcm", "wav")  # the formats `sample_rate` applies to
OUTPUT_RATES = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)  # what `sample_rate` accepts
STRETCH_SEED = 0  # Signalsmith randomises phases; a fixed seed keeps a seeded request's bytes reproducible

Stage = Callable[[np.ndarray, bool], np.ndarray]


class TimeStretch:
    """Plays a stream `speed` times as fast at the same pitch. Input is cut into blocks of `block_s` seconds; each is
    stretched with `context_s` of input either side (the stretcher's window is 0.12 s, so its edges never reach the
    kept part), moved by at most `max_lag_s` to line up with its neighbour (half a period of a 62 Hz voice) and
    overlapped with it by `crossfade_s` of output. A block is emitted once its right context has arrived, so the
    first audio waits for block_s + context_s of input."""

    def __init__(self, sample_rate: int, speed: float, block_s: float = 0.5, context_s: float = 0.15,
                 crossfade_s: float = 0.01, max_lag_s: float = 0.008) -> None:
        if not SPEED_MIN <= speed <= SPEED_MAX:
            raise ValueError(f"speed must be within {SPEED_MIN}-{SPEED_MAX} (got {speed})")
        self.speed = speed
        self._stretch = Stretch(STRETCH_SEED)
        self._stretch.preset(1, sample_rate)
        self._stretch.timeFactor = speed
        self._block = max(1, round(block_s * sample_rate))
        self._context = round(context_s * sample_rate)
        self._fade = round(crossfade_s * sample_rate)
        self._max_lag = round(max_lag_s * sample_rate)
        ramp = np.sin(np.linspace(0.0, np.pi / 2, 2 * self._fade, dtype=np.float32)) ** 2
        self._fade_in, self._fade_out = ramp, 1.0 - ramp  # gains summing to 1: the blocks are aligned, so correlated
        self._input = np.zeros(0, np.float32)  # input samples from absolute index self._input_start on
        self._input_start = 0
        self._total_in = 0
        self._next_block = 0  # index of the next block to stretch
        self._tail = np.zeros(0, np.float32)  # the previous block's output past its boundary, to crossfade

    def _out_index(self, in_index: int) -> int:
        return round(in_index / self.speed)

    def __call__(self, samples: np.ndarray, last: bool) -> np.ndarray:
        if len(samples):
            self._input = np.concatenate([self._input, np.asarray(samples, np.float32)])
            self._total_in += len(samples)
        parts = []
        while True:
            start = self._next_block * self._block
            end = start + self._block
            final = last and end + self._context >= self._total_in  # the rest goes in this block
            if not final and end + self._context > self._total_in:
                break  # its right context has not arrived yet
            if final:
                end = self._total_in
            parts.append(self._stretch_block(start, end, final))
            self._next_block = 0 if final else self._next_block + 1
            if final:
                break
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def _best_lag(self, out: np.ndarray, first: int) -> int:
        """How far to move this block's start (within +-max_lag) so that it lines up with the previous block's tail:
        the two runs' phases differ, and a crossfade of waves out of phase dips (WSOLA's alignment, on the output)."""
        lo = max(0, first - self._max_lag)
        region = out[lo:first + self._max_lag + len(self._tail)]
        if len(region) < len(self._tail):
            return 0
        scores = np.correlate(region, self._tail, mode="valid")
        return int(np.argmax(scores)) + lo - first

    def _stretch_block(self, start: int, end: int, final: bool) -> np.ndarray:
        """The output for input [start, end): from X before its output boundary (crossfaded with the previous block's
        tail) to X before the next boundary, keeping the 2X past that as the next tail (X = crossfade / 2)."""
        win_start = max(0, start - self._context)
        win_end = end if final else end + self._context
        window = self._input[win_start - self._input_start:win_end - self._input_start]
        out = self._stretch.process(window[np.newaxis, :])[0] if len(window) else np.zeros(0, np.float32)
        out_offset = self._out_index(win_start)  # output index of out[0]
        lo = self._out_index(start) - self._fade if start else 0
        hi = self._out_index(end) if final else self._out_index(end) + self._fade
        first = lo - out_offset
        if start and len(self._tail):
            first += self._best_lag(out, first)
        piece = out[max(0, first):max(0, first + hi - lo)]
        piece = np.pad(piece, (0, max(0, hi - lo - len(piece))))  # rounding can leave the stretcher a sample short
        if start and len(self._tail):
            n = min(len(self._tail), len(piece))
            piece[:n] = self._tail[:n] * self._fade_out[:n] + piece[:n] * self._fade_in[:n]
        if final:  # flushed: the stage starts afresh, so a stream can be flushed at each segment's end
            self._tail = np.zeros(0, np.float32)
            self._input = np.zeros(0, np.float32)
            self._input_start = self._total_in = 0
            return piece.astype(np.float32, copy=False)
        self._tail = piece[len(piece) - 2 * self._fade:].copy()
        keep_from = end - self._context  # the next block's left context starts here
        self._input = self._input[keep_from - self._input_start:]
        self._input_start = keep_from
        return piece[:len(piece) - 2 * self._fade].astype(np.float32, copy=False)


class Resample:
    """A stream from `in_rate` to `out_rate` with soxr's streaming resampler (HQ, as engine.io.audio.resample)."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream = self._new_stream()

    def _new_stream(self) -> soxr.ResampleStream:
        return soxr.ResampleStream(self.in_rate, self.out_rate, 1, dtype="float32", quality="HQ")

    def __call__(self, samples: np.ndarray, last: bool) -> np.ndarray:
        out = self._stream.resample_chunk(np.asarray(samples, np.float32), last=last)
        if last:  # soxr takes nothing after the last chunk: a fresh stream for the next segment
            self._stream = self._new_stream()
        return out


class AudioStages:
    """Stages in front of an encoder, as one encoder: (samples, last) -> bytes | None."""

    def __init__(self, stages: list[Stage], encoder: Callable[[np.ndarray, bool], bytes | None]) -> None:
        self.stages, self.encoder = stages, encoder
        if hasattr(encoder, "prepare"):
            self.prepare = encoder.prepare

    def __call__(self, samples: np.ndarray, last: bool) -> bytes | None:
        for stage in self.stages:
            samples = stage(samples, last)
        if not len(samples) and not last:
            return None
        return self.encoder(samples, last)

    def end_segment(self, samples: np.ndarray) -> bytes | None:
        """`samples` as a segment's last chunk: the stages flush (the segment's stretched audio is all out, exactly
        round(N / speed) samples of it) and start afresh for the next one, while the encoder's stream goes on."""
        for stage in self.stages:
            samples = stage(samples, True)
        return self.encoder(samples, False) if len(samples) else None


def audio_stages(sample_rate: int, speed: float = 1.0, out_rate: int | None = None) -> list[Stage]:
    """The stages a stream of `sample_rate` audio needs for `speed` and `out_rate`: none at speed 1 and the native
    rate, so that path is today's, byte for byte."""
    stages: list[Stage] = []
    if speed != 1.0:
        stages.append(TimeStretch(sample_rate, speed))
    if out_rate is not None and out_rate != sample_rate:
        stages.append(Resample(sample_rate, out_rate))
    return stages
