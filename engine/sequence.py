"""One generation request as the runtime tracks it (its prompt, sampling parameters, KV blocks, noise source and
generated patches; its hidden states and previous patch live in the model runner's slot buffers), and what one
engine step gives back for it."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.prompt import Prompt
from engine.vocabulary import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class StepEvent:
    """One sequence's output of one engine step: its new audio chunk, or why it ended."""

    seq_id: int
    audio: np.ndarray | None  # float32 chunk at the model's sample rate, None for an error
    patch: torch.Tensor | None  # the (P, D) latent patch behind the chunk (parity checks), None for an error
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str = "request"  # with an error: which `engine.errors` class its caller gets (ERROR_KINDS)


@dataclass(eq=False)
class Sequence:
    prompt: Prompt
    params: SamplingParams
    max_patches: int
    seq_id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)  # opens the scheduler's coalescing window
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_generated: int = 0
    finish_reason: str | None = None
    noise: torch.Generator | None = None
    injected_noise: list[torch.Tensor] | None = None  # tests: exact noise per step (parity with the official)
    slot: int | None = None  # row of the model runner's per-sequence state buffers while it holds one
    saved_vae_state: list[torch.Tensor] | None = None  # streaming VAE context parked during a preemption
    generated: list[torch.Tensor] = field(default_factory=list)  # (P, D) patches, kept for recompute
    lora_name: str | None = None  # its runtime LoRA adapter, held (resident) from admission to its end
    lora_slot: int = -1  # that adapter's slot in the runner's stacked LoRA weights, -1 for none
    lora_lease: tuple[int, str] | None = None  # (client, lease): the long text whose adapter it names (`LoRASlots`)
    continuation: bool = False  # the later part of an admitted stream: queued before new requests
    cache_salt: bytes = b""  # mixed into its prompt blocks' prefix-cache hashes (another adapter: other KV)

    @property
    def ahead_of_new(self) -> bool:
        """A preempted stream or a continuation: queued ahead of new requests, started without the coalescing window,
        never failed by the queue timeout (delaying it would stall or cut a stream already playing)."""
        return bool(self.num_generated) or self.continuation

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV is in the cache once prefilled: prompt + fed-back patches."""
        return len(self.prompt) + self.num_generated

    def prefill_inputs(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Token ids, features and audio mask of everything to prefill: the prompt and, after a
        preemption, the patches generated so far (a fed-back patch is exactly an audio position)."""
        p = self.prompt
        if not self.generated:
            return p.token_ids, p.feats, p.audio_mask
        gen = torch.stack([g.float().cpu() for g in self.generated])
        ids = p.token_ids + [0] * len(gen)
        mask = torch.cat((p.audio_mask, torch.ones(len(gen), dtype=torch.bool)))
        return ids, torch.cat((p.feats, gen)), mask

    def reset_for_recompute(self) -> None:
        """Preempted: its KV blocks are gone. It waits to be prefilled again over prompt + generated
        patches, which rebuilds the same state; the streamed audio and its VAE state are kept."""
        self.block_table = []
        self.num_cached_tokens = 0
        self.status = Status.WAITING
