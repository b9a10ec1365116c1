"""The pinned host buffers a decode step's inputs are written to and its outputs copied into (CUDA), two of each used
in turn: the host fills or reads one while the device may still copy from or into the other; `queued_copy` for the
small tensors of a step's set-up."""

from __future__ import annotations

import torch

from engine.runner.buffers import DecodeBuffers


class HostStepBuffers:
    def __init__(self) -> None:
        self.host_out: list[tuple[torch.Tensor, torch.Tensor]] = []  # see outputs
        self.host_turn = 0
        self.host_in: list[torch.Tensor] = []  # see inputs
        self.host_in_copied: list[torch.cuda.Event | None] = [None, None]
        self.host_in_turn = 0

    def reset(self) -> None:
        """Forget the buffers (the device buffers they mirror were replaced): made again on first use."""
        self.host_out = []
        self.host_in = []

    def outputs(self, buffers: DecodeBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """The next of two sets of pinned host buffers for a step's outputs: a launched step copies into
        one while the host still reads the other (the previous step's)."""
        if not self.host_out:
            results, audio = buffers.results, buffers.audio
            self.host_out = [(torch.zeros(results.shape, pin_memory=True), torch.zeros(audio.shape, pin_memory=True))
                             for _ in range(2)]
        self.host_turn ^= 1
        return self.host_out[self.host_turn]

    def inputs(self, buffers: DecodeBuffers) -> torch.Tensor:
        """The next of two pinned byte buffers for a step's inputs (`DecodeBuffers.step_inputs` lays them out): the
        host fills one while the copy from the other may still be queued; its last copy is waited for first."""
        if not self.host_in:
            self.host_in = [torch.zeros(buffers.inputs.numel(), dtype=torch.uint8, pin_memory=True)
                            for _ in range(2)]
            self.host_in_copied = [None, None]
        self.host_in_turn ^= 1
        copied = self.host_in_copied[self.host_in_turn]
        if copied is not None:
            copied.synchronize()  # long done: the copy was queued two launches ago
        return self.host_in[self.host_in_turn]

    def send_inputs(self, buf: DecodeBuffers, packed: torch.Tensor, rows: int, stream: torch.cuda.Stream) -> None:
        """Queue on `stream` the copy of the `rows`-row inputs filled in `packed` (the last `inputs`) to the device
        buffer, and record when it is done (`inputs` waits for it two turns later)."""
        size = buf.input_bytes(rows)
        buf.inputs[:size].copy_(packed[:size], non_blocking=True)
        self.host_in_copied[self.host_in_turn] = copied = torch.cuda.Event()
        copied.record(stream)


def queued_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU tensor on `device`, its copy queued without the host waiting. A synchronous copy waits for all the
    work queued before it: after a prefill, the host could not prepare the first decode step while the prefill runs.
    On CUDA the tensor is pinned first (the caching host allocator keeps it until the copy is done); a tensor not on
    the CPU is copied as `.to` does."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
