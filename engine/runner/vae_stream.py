"""The VAE decode's second CUDA stream, and its graphs replayed behind the step that made their patches.

The stop head and the VAE need only a step's patch and old hidden state, the LMs only the encoded patch, so on CUDA
the VAE runs beside the LMs. In small batch buckets it stays inside the step's graph (forked onto this stream and
joined within it): a small batch's VAE fits there, and its audio is ready with its step. From
`EngineOptions.vae_overlap_min_batch` rows on it is a graph of its own, replayed on this stream behind the step, so
it overlaps the next step's DiT instead of ending its own step; the next step then waits only until the VAE has
taken copies of its inputs, and anything touching the VAE states or the audio buffer joins this stream first.
"""

from __future__ import annotations

import torch

from engine.options import current
from engine.runner.buffers import DecodeBuffers


class VaeStream:
    def __init__(self, device: torch.device, use_graphs: bool) -> None:
        opts = current()
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and opts.vae_stream else None
        self.overlap = self.stream is not None and use_graphs and opts.vae_overlap
        self.overlap_min_batch = opts.vae_overlap_min_batch
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch bucket -> its VAE graph (buckets that overlap)
        self.inputs_taken: torch.cuda.Event | None = None  # the last VAE launch has copied its inputs
        self.unjoined = False  # a VAE graph was launched behind a step since the last `join`

    def overlaps(self, batch: int) -> bool:
        """Whether this batch bucket's VAE decode is its own graph, replayed behind the step (else inside it)."""
        return self.overlap and batch >= self.overlap_min_batch

    def reset(self) -> None:
        """Forget the graphs (the buffers they address were replaced)."""
        self.graphs.clear()
        self.inputs_taken = None
        self.unjoined = False

    def join(self) -> None:
        """Order the current stream's next work after every VAE graph launched behind a step so far (before touching
        VAE states or the audio buffer)."""
        if self.unjoined:
            assert self.stream is not None
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.unjoined = False

    def wait_inputs_taken(self, stream: torch.cuda.Stream) -> None:
        """Order `stream` after the last VAE launch has read its step's slot index and patch (the next step overwrites
        them)."""
        if self.inputs_taken is not None:
            stream.wait_event(self.inputs_taken)

    def after(self, main: torch.cuda.Stream, ready: torch.cuda.Event | None) -> torch.cuda.Stream:
        """Where a step's outputs are copied to the host: `main` after the whole step, or with `ready` (recorded in the
        step once its outputs are written: DecodeStep.outputs_ready) this stream once that event has fired."""
        if ready is None:
            return main
        assert self.stream is not None
        self.stream.wait_event(ready)
        return self.stream

    def launch_behind(self, main: torch.cuda.Stream, batch: int, buf: DecodeBuffers) -> torch.cuda.Stream:
        """Replay bucket `batch`'s VAE graph behind the step just queued on `main` (the step's rows: the bucket's): it
        takes copies of its inputs and decodes while the next step's graph runs. Returns its stream (the audio copy
        goes after it)."""
        side = self.stream
        assert side is not None
        side.wait_stream(main)
        with torch.cuda.stream(side):
            buf.vae_index[:batch].copy_(buf.step_inputs(batch).slot_index)
            buf.vae_patch[:batch].copy_(buf.patch(batch))
            self.inputs_taken = torch.cuda.Event()
            self.inputs_taken.record(side)
            self.graphs[batch].replay()
        self.unjoined = True
        return side
