"""The typed messages between a pool's clients and an engine worker process (and what a worker is started with),
and the one definition of a request's sampling parameters and their bounds (the HTTP schemas derive theirs from
`SAMPLING_LIMITS`).

Torch-free on purpose: the service's API processes import it (and the client) without loading torch.
Every message is a dataclass pickled over a `multiprocessing.connection` socket; arrays travel as numpy.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from engine.engine_config import EngineConfig

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
    "seed": Bound(0, 2**64 - 1, "Makes the request reproducible (same seed, same audio)."),
}
INTEGER_FIELDS = frozenset({"max_generate_length", "min_len", "seed"})


@dataclass
class SamplingParams:
    """Per-request generation parameters (names as in nano-vllm-voxcpm)."""

    max_generate_length: int = 2000
    temperature: float = 1.0  # multiplies the CFM start noise; 0 = deterministic
    cfg_value: float = 2.0
    min_len: int = 2  # the stop head is honoured only after this many patches
    seed: int | None = None

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "seed":
                continue
            kind = int if f.name in INTEGER_FIELDS else int | float
            if isinstance(value, bool) or not isinstance(value, kind) or value != value:  # NaN != NaN
                raise ValueError(f"{f.name}: must be {'an integer' if kind is int else 'a number'}, got {value!r}")
            bound = SAMPLING_LIMITS[f.name]
            if not bound.low <= value <= bound.high:
                raise ValueError(f"{f.name}: must be in [{_num(bound.low)}, {_num(bound.high)}], got {value!r}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# What a runtime LoRA adapter may be called (the engine, the service's schemas and settings check the same).
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


@dataclass
class TextIds:
    """A request's text as token ids, made by the client (`engine.serving.client.text_ids`) so that the worker, which
    takes a burst's requests one at a time, does not tokenize them: ~0.3 ms of a 470-character text each."""

    target: list[int]  # the target text's (its length caps the generation)
    text: list[int] | None = None  # the prompt transcript's and the target's together (a continuation prompt)


@dataclass
class SynthesisRequest:
    """One generation: the text, its conditioning (latents: float32 (frames, feat_dim) arrays or their bytes) and
    its sampling parameters."""

    target_text: str
    prompt_text: str = ""
    prompt_latents: np.ndarray | bytes | None = None  # continuation prompt, with prompt_text as its transcript
    prompt_id: str | None = None  # a prompt registered with AddPrompt (instead of prompt_latents)
    ref_latents: np.ndarray | bytes | None = None  # reference-audio condition (VoxCPM2)
    params: SamplingParams = field(default_factory=SamplingParams)
    lora_name: str | None = None  # a runtime LoRA adapter registered with RegisterLoRA
    text_ids: TextIds | None = None  # tokenized by the client (not with prompt_id: that transcript is the worker's)


# --- client -> worker -------------------------------------------------------------------------------


@dataclass
class Generate:
    request_id: str
    request: SynthesisRequest


@dataclass
class Abort:
    request_id: str


@dataclass
class EncodeLatents:
    call_id: str
    wav: bytes
    wav_format: str | None
    padding: Literal["left", "right"]


@dataclass
class AddPrompt:
    prompt_id: str
    latents: np.ndarray
    text: str


@dataclass
class RemovePrompt:
    prompt_id: str


@dataclass
class RegisterLoRA:
    """Register a LoRA adapter (official format; a path on the worker's machine) under `name`. Registering a name
    again with the same weights file answers as the first time (a restarted worker gets every adapter again)."""

    call_id: str
    name: str
    path: str


@dataclass
class UnregisterLoRA:
    call_id: str
    name: str


@dataclass
class ListLoRAs:
    call_id: str


@dataclass
class GetStats:
    call_id: str


# --- worker -> client -------------------------------------------------------------------------------


@dataclass
class Ready:
    """Sent once the model is loaded and warm (to a client connecting later: at once)."""

    info: dict[str, Any]


@dataclass
class ErrorInfo:
    kind: str  # engine.errors kind: "request", "prompt_not_found", "engine", "overloaded", ...
    message: str


@dataclass
class AudioEvent:
    """One request's next chunk (float32 samples at the model's sample rate), or its end."""

    request_id: str
    audio: np.ndarray | None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None


@dataclass
class WorkerLoad:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


@dataclass
class StepEvents:
    """Everything one engine step produced for one client, with the worker's load after it."""

    events: list[AudioEvent]
    load: WorkerLoad


@dataclass
class Reply:
    call_id: str
    value: Any = None
    error: ErrorInfo | None = None


@dataclass
class Goodbye:
    """The worker is stopping on purpose: callers get PoolStoppedError, not WorkerDiedError."""

    reason: str


# --- owner <-> worker (the control pipe of the process that spawned it) -------------------------------


@dataclass
class Started:
    info: dict[str, Any]


@dataclass
class Fatal:
    message: str


@dataclass
class Stop:
    pass


@dataclass
class WorkerOptions:
    """Everything a worker process is started with."""

    model_path: str
    device: str
    engine: EngineConfig
    address: str  # the Unix socket clients connect to
    authkey: bytes
    warmup: bool = True
    log_level: int = logging.INFO
    torch_threads: int | None = None  # CPU threads for torch ops; default: 1 on a GPU, torch's choice on the CPU
    name: str = "voxcpm-worker"  # the process name `ps` and `top` show
    spawned_at: float = 0.0  # time.time() when the owner spawned it (start-up phases are reported from it)
    cpus: list[int] | None = None  # CPU cores it runs on (its own), None = wherever the OS puts it


def name_process(name: str) -> None:
    """Set the name `ps`, `top` and psutil show for this process (Linux; at most 15 characters)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(name[:15])
