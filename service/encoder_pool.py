"""EncoderPool: the API process's audio-encoding threads, earliest deadline first.

A chunk's deadline is when a listener who started at the stream's first output would run out of audio without it
(first output time + audio seconds made before it); a stream that has made nothing yet is due at once (its first
bytes are the time to first audio). So when encoding falls behind, streams with the least audio in hand go first and
a stream seconds ahead waits. The threads, the per-stream order and the timing hook are the engine client's
(`engine.serving.transforms.TransformThreads`); the metrics observe each chunk's wait and CPU time through it: the
first bytes' wait is part of the time to first audio, and long waits of later chunks mean the encoders run behind
the engine.
"""

from __future__ import annotations

from engine.serving.transforms import TransformedStream, TransformThreads


class EncoderPool(TransformThreads):
    def due(self, stream: TransformedStream) -> float:
        if stream.first_output_at is None:
            return float("-inf")
        return stream.first_output_at + stream.transformed_samples / self.sample_rate
