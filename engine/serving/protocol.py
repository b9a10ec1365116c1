"""The typed messages between a pool's clients and an engine worker process (and what a worker is started with).
The words they carry that every layer shares (sampling parameters, text ids, finish reasons) are `engine.vocabulary`'s.

Torch-free on purpose: the service's API processes import it (and the client) without loading torch.
Every message is a dataclass pickled over a `multiprocessing.connection` socket; arrays travel as numpy.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from engine.vocabulary import FinishReason, SamplingParams, TextIds

if TYPE_CHECKING:
    from engine.engine_config import EngineConfig

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
    torch_threads: int | None = None  # torch's threads; default 1 on a GPU, on the CPU its cores less one if shared
    name: str = "voxcpm-worker"  # the process name `ps` and `top` show
    spawned_at: float = 0.0  # time.time() when the owner spawned it (start-up phases are reported from it)
    cpus: list[int] | None = None  # CPU cores it runs on (its own), None = wherever the OS puts it


def name_process(name: str) -> None:
    """Set the name `ps`, `top` and psutil show for this process (Linux; at most 15 characters)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(name[:15])
