"""The words every layer of the engine and the service shares, defined once at the bottom: a request's sampling
parameters and their bounds (the HTTP schemas derive theirs from `SAMPLING_LIMITS`), its text as token ids, why a
stream ended, what a runtime LoRA adapter may be called and how one is described.

Torch-free: the service's API processes import it without loading torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "aborted", "error"]


@dataclass(frozen=True)
class Bound:
    low: float
    high: float
    doc: str


# Every numeric sampling field's accepted range, checked by the engine and, with the same numbers, by the
# HTTP schemas. max_generate_length's upper bound is the deployment's max_model_len (checked by the engine).
SAMPLING_LIMITS: dict[str, Bound] = {
    "max_generate_length": Bound(1, 2**31 - 1, "Most patches generated (each patch is one chunk of audio)."),
    "temperature": Bound(0.0, 10.0, "Scale of the initial CFM noise; 0 = deterministic."),
    "cfg_value": Bound(0.0, 20.0, "Classifier-free guidance strength."),
    "min_len": Bound(0, 2**31 - 1, "The stop head is honoured only after this many patches."),
    "seed": Bound(0, 2**64 - 1, "Makes the request reproducible (same seed, same audio); the noise generator takes "
                                "32 bits, a seed's high half folded into its low."),
}
INTEGER_FIELDS = frozenset({"max_generate_length", "min_len", "seed"})
REF_MARKER_TOKENS = 2  # a reference clip's start and end tokens around its patches in the prompt (engine/prompt.py)


def longest_part(target_tokens: int, voice_tokens: Mapping[str, int]) -> str:
    """The request field of an over-long prompt's longest part, the one to shorten: a voice part (`prompt_text`,
    `prompt_latents`, `ref_latents`: its tokens) longer than the target text, else `target_text`."""
    longest = max(voice_tokens, key=voice_tokens.__getitem__, default="")
    return longest if longest and voice_tokens[longest] > target_tokens else "target_text"


def max_patches(target_tokens: int, max_generate_length: int) -> int:
    """The official length cap of one generation: at most 6 patches per target text token plus 10."""
    return min(int(target_tokens * 6.0 + 10), max_generate_length)


@dataclass
class SamplingParams:
    """Per-request generation parameters (names as in nano-vllm-voxcpm)."""

    max_generate_length: int = 2000
    temperature: float = 1.0  # multiplies the CFM start noise; 0 = deterministic
    cfg_value: float = 2.0
    min_len: int = 2  # the stop head is honoured only after this many patches
    seed: int | None = None

    def validate(self) -> None:
        for name, bound in SAMPLING_LIMITS.items():  # every field, in declaration order
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            kind = int if name in INTEGER_FIELDS else int | float
            if isinstance(value, bool) or not isinstance(value, kind) or value != value:  # NaN != NaN
                raise ValueError(f"{name}: must be {'an integer' if kind is int else 'a number'}, got {value!r}")
            if not bound.low <= value <= bound.high:
                raise ValueError(f"{name}: must be in [{_num(bound.low)}, {_num(bound.high)}], got {value!r}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# What a runtime LoRA adapter may be called (the engine, the service's schemas and settings check the same).
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


@dataclass
class AdapterInfo:
    """A registered runtime LoRA adapter, as the engine describes it (and the service's /loras shows it)."""

    name: str
    source: str  # the weights file the worker read
    rank: int
    layers: int  # layers it adapts
    resident: bool  # in a device slot now (else loaded on its next request)
    slot: int | None = None
    requests: int = 0  # requests using it now


@dataclass
class TextIds:
    """A request's text as token ids, made by the client (`engine.serving.stream.text_ids`) so that the worker, which
    takes a burst's requests one at a time, does not tokenize them: ~0.3 ms of a 470-character text each."""

    target: list[int]  # the target text's (its length caps the generation)
    text: list[int] | None = None  # the prompt transcript's and the target's together (a continuation prompt)
