"""Continuous batching: which sequences to prefill and which to advance in the next engine step.

Every step advances all running sequences by one patch (so running streams keep their pace) and,
before that, prefills as many waiting sequences as the token budget and free KV blocks allow. While streams
run, that budget may be smaller (`running_prefill_tokens`): the step's prefill delays their next chunk, so a
burst of arrivals is admitted over several steps instead of one long stall. When
blocks run out mid-stream the most recently started sequence is preempted (its KV is dropped and
recomputed later). A request that can never fit fails instead of waiting forever.

A request may also wait for what only it needs (`Admission`: its runtime LoRA adapter's slot, while every slot holds
the adapters of running requests): it keeps its place in the queue while the requests behind it go ahead; after
`lora_slot_wait_s`, those that would hold the slot chosen to drain for it wait too (else a steady stream of that
slot's adapter would keep it from ever draining).

With a coalescing window, a request reaching an idle engine opens it: admissions wait until no request has
arrived for that long (at most a few windows), so requests arriving together are admitted in one round, one
batched prefill, instead of the first ones starting alone and the rest waiting for their step to end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status
from engine.vocabulary import longest_part

COALESCE_CAP = 4  # the window closes at most this many windows after the first request it holds


VOICE_PARTS = {"prompt_text": "transcript", "prompt_latents": "prompt audio", "ref_latents": "reference audio"}


def prompt_parts(seq: Sequence) -> tuple[str, str]:
    """The request field of a prompt's longest part (the target text, or the voice's transcript, prompt audio or
    reference audio: the one to shorten) and the prompt's tokens by part, in words."""
    text, voice = seq.prompt.target_tokens, seq.prompt.voice_tokens
    words = ", ".join(f"{n} of {VOICE_PARTS[f]}" for f, n in voice.items() if n)
    field = longest_part(text, voice)
    rest = seq.num_prompt_tokens - text  # the voice's parts and the markers
    return field, f"{text} of text, {rest} of voice" + (f": {words}" if words else "")


class Rejected(Exception):
    """From an `Admission`: the waiting request can never start now; the message (naming its field) says why, and
    `kind` which error its caller gets (an `engine.errors` kind: an adapter unregistered meanwhile is not found)."""

    def __init__(self, message: str, kind: str = "request") -> None:
        super().__init__(message)
        self.kind = kind


# Whether a waiting request that fits may start now (taking what it needs), or waits; raises Rejected. The flag: a
# request ahead of it in this round waits (held), so it may have to leave alone what that one waits for.
Admission = Callable[[Sequence, bool], bool]


@dataclass
class Schedule:
    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    rejected: list[tuple[Sequence, str, str]] = field(default_factory=list)  # can never run: (seq, reason, kind)
    preempted: list[Sequence] = field(default_factory=list)  # lost their KV this round, back to waiting

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.rejected)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, coalesce_s: float = 0.0, admit: Admission | None = None,
                 running_prefill_tokens: int | None = None) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.running_prefill_tokens = running_prefill_tokens
        self.max_model_len = max_model_len
        self.coalesce_s = coalesce_s
        self.admit = admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # An admission round that left requests waiting for KV blocks or an adapter slot while others run records
        # the count of changes: until a request is added, finished or preempted (the only ways blocks and slots are
        # freed) or an adapter unregistered, the next round would stop at the same place, so can_admit says no (and
        # a pipelined engine launches its next decode ahead instead of re-trying the admission every step).
        self.changes = 0
        self._stalled_at: int | None = None

    def add(self, seq: Sequence) -> None:
        """Queue a request: a continuation after the preempted streams and the continuations already waiting, ahead
        of new requests; a new one at the end."""
        if seq.continuation:
            ahead = next((i for i, s in enumerate(self.waiting) if not s.ahead_of_new), len(self.waiting))
            self.waiting.insert(ahead, seq)
        else:
            self.waiting.append(seq)
        self.changed()

    def changed(self) -> None:
        """What admission depends on may have changed: the next round looks at the queue again."""
        self.changes += 1

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def window_left(self, now: float | None = None) -> float:
        """Seconds until the coalescing window closes (0: admit now). It holds only an idle engine (a busy one admits
        at its next step, which gathers what arrived meanwhile by itself), and closes `coalesce_s` after the latest
        arrival, at most COALESCE_CAP windows after the first, or at once when the queue would fill every seat."""
        if not self.coalesce_s or not self.waiting or self.running:
            return 0.0
        if self.waiting[0].ahead_of_new or len(self.waiting) >= self.max_num_seqs:
            return 0.0  # a preempted stream resumes at once, a continuation starts at once
        now = time.monotonic() if now is None else now
        first, latest = self.waiting[0].arrival, self.waiting[-1].arrival
        closes = min(latest + self.coalesce_s, first + COALESCE_CAP * self.coalesce_s)
        return max(0.0, closes - now)

    @property
    def can_admit(self) -> bool:
        """Whether the next schedule() would look at the waiting queue."""
        if not self.waiting or len(self.running) >= self.max_num_seqs or self.window_left():
            return False
        return self._stalled_at != self.changes

    def never_fits(self, seq: Sequence) -> str | None:
        """Why the request can never run here, starting with the request field to change, or None."""
        longest = seq.num_prompt_tokens + seq.max_patches
        if seq.num_prompt_tokens >= self.max_model_len:
            field, parts = prompt_parts(seq)
            return (f"{field}: the prompt (text and voice) is {seq.num_prompt_tokens} tokens ({parts}), which leaves "
                    f"no room to generate within max_model_len={self.max_model_len}")
        if longest > self.max_model_len:
            return (f"max_generate_length: a prompt of {seq.num_prompt_tokens} tokens (text and voice) plus up to "
                    f"{seq.max_patches} patches exceeds max_model_len={self.max_model_len}")
        if self.blocks.blocks_needed(longest) > len(self.blocks.blocks):
            return (f"max_generate_length: the request needs {self.blocks.blocks_needed(longest)} KV blocks, the "
                    f"cache has {len(self.blocks.blocks)}")
        if seq.num_tokens > self.max_num_batched_tokens:
            field, parts = prompt_parts(seq)
            return (f"{field}: the prompt of {seq.num_tokens} tokens ({parts}) exceeds max_num_batched_tokens="
                    f"{self.max_num_batched_tokens}")
        return None

    def schedule(self) -> Schedule:
        out = Schedule()
        # Make room for every running sequence's next token first: running streams have priority.
        while self.running and sum(map(self.blocks.needs_new_block, self.running)) > self.blocks.num_free:
            out.preempted.append(self.running[-1])
            self._preempt(self.running[-1])
        budget = self.max_num_batched_tokens
        if self.running and self.running_prefill_tokens is not None:
            budget = min(budget, self.running_prefill_tokens)  # the running streams wait for this step's prefill
        held: list[Sequence] = []  # waiting for what only they need: back at the head, in order, afterwards
        # stalled: the round stopped for blocks (not this step's budget); over_budget: it stopped for the budget, so
        # the next step admits more whatever a held request waits for
        tried = stalled = over_budget = False
        while self.can_admit:
            tried = True
            seq = self.waiting[0]
            reason = self.never_fits(seq)
            if reason is not None:
                self.waiting.popleft()
                out.rejected.append((seq, reason, "request"))
                continue
            # Keep one free block per running sequence for its next patch. With nothing running, what it
            # needs exactly (its prefill and its first patch): never_fits let in a request that fills the
            # whole cache, and the heuristic reserve would keep it waiting forever at the queue's head.
            if self.running:
                need = self.blocks.blocks_needed(seq.num_tokens) + len(self.running) + 1
            else:
                need = self.blocks.blocks_needed(seq.num_tokens + 1)
            # The round's first prompt goes in over budget (never_fits bounds it by max_num_batched_tokens): a
            # prompt longer than the running budget must not wait forever.
            over_budget = seq.num_tokens > budget and bool(out.prefill)
            if over_budget or self.blocks.num_free < need:
                stalled = not over_budget
                break
            if self.admit is not None:
                try:
                    ready = self.admit(seq, bool(held))
                except Rejected as e:
                    self.waiting.popleft()
                    out.rejected.append((seq, str(e), e.kind))
                    continue
                if not ready:
                    held.append(self.waiting.popleft())
                    continue
            self.waiting.popleft()
            self.blocks.allocate(seq)
            budget -= seq.num_tokens - seq.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.prefill.append(seq)
        self.waiting.extendleft(reversed(held))
        if tried:  # else the last round's record stands: nothing it depends on has changed
            stuck = ((stalled or (held and not over_budget)) and self.waiting and self.running
                     and len(self.running) < self.max_num_seqs)
            self._stalled_at = self.changes if stuck else None
        out.decode = list(self.running)
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.changed()
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and free its blocks (done, cancelled or failed)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.blocks.free(seq)
        seq.status = Status.FINISHED
        self.changed()
        seq.finish_reason = reason
