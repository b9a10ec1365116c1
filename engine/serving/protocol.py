"""The typed messages between a pool's clients and an engine worker process (and what a worker is started with).
The words they carry that every layer shares (sampling parameters, text ids, finish reasons) are `engine.vocabulary`'s,
what a worker reports about itself `engine.serving.reports`'.

Torch-free on purpose: the service's API processes import it (and the client) without loading torch.
Every message is a dataclass pickled over a `multiprocessing.connection` socket; arrays travel as numpy.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Generic, Literal, TypeVar

import numpy as np

from engine.serving.reports import WorkerInfo, WorkerLoad, WorkerStats
from engine.vocabulary import AdapterInfo, FinishReason, SamplingParams, TextIds

if TYPE_CHECKING:
    from engine.engine_config import EngineConfig

R = TypeVar("R")

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
    return_latents: bool = False  # each AudioEvent also carries its patch's latents (long-form continuation prompts)
    # A later part of a request already admitted (a long text's next segment): never refused for a full queue nor failed
    # by the queue timeout, and admitted before new requests; refusing or delaying it would cut a stream mid-way.
    continuation: bool = False
    lora_lease: str | None = None  # a lease (`LeaseLoRA`) of this client: its adapter is lora_name's, leased then


# --- client -> worker -------------------------------------------------------------------------------


@dataclass
class Generate:
    request_id: str
    request: SynthesisRequest


@dataclass
class Abort:
    request_id: str


@dataclass
class Call(Generic[R]):
    """A question the worker answers with one `Reply` carrying an `R` (or an error). `method` names the worker's
    method that answers it, called with the message (dispatch by name, as vLLM v1's utility calls)."""

    call_id: str
    method: ClassVar[str]


@dataclass
class EncodeLatents(Call[np.ndarray]):
    """A clip's latents, float32 (frames, feat_dim)."""

    method: ClassVar[str] = "encode_latents"
    wav: bytes
    wav_format: str | None
    padding: Literal["left", "right"]


@dataclass
class RegisterLoRA(Call[AdapterInfo]):
    """Register a LoRA adapter (official format; a path on the worker's machine) under `name`. Registering a name
    again with the same weights file answers as the first time (a restarted worker gets every adapter again)."""

    method: ClassVar[str] = "register_lora"
    name: str
    path: str


@dataclass
class UnregisterLoRA(Call[None]):
    method: ClassVar[str] = "unregister_lora"
    name: str


@dataclass
class ListLoRAs(Call[list[AdapterInfo]]):
    method: ClassVar[str] = "list_loras"


@dataclass
class GetStats(Call[WorkerStats]):
    method: ClassVar[str] = "stats"


@dataclass
class MessageBatch:
    """Several client messages sent as one: those one turn of the client's event loop sent (a burst's requests), so
    the worker reads them at once and admits them together, instead of stepping after reading the first few."""

    messages: list[Generate | Abort | Call[object] | AddPrompt | RemovePrompt | LeaseLoRA]


def unbatched(msg: object) -> list[object] | tuple[object]:
    """The client messages one read from a connection holds: a `MessageBatch`'s, in order, or the message itself."""
    return msg.messages if isinstance(msg, MessageBatch) else (msg,)


@dataclass
class AddPrompt:
    prompt_id: str
    latents: np.ndarray
    text: str


@dataclass
class RemovePrompt:
    prompt_id: str


@dataclass
class LeaseLoRA:
    """Lease `lease` (a long text's) binds the adapter registered as `name` now for the requests naming it with the
    lease, unregistered meanwhile or not (`LoRASlots.lease`); `name` None ends the lease. `path`: where that adapter
    was registered from (a restarted worker not holding it reads it from there)."""

    lease: str
    name: str | None
    path: str | None = None


# --- worker -> client -------------------------------------------------------------------------------


@dataclass
class Ready:
    """Sent once the model is loaded and warm (to a client connecting later: at once)."""

    info: WorkerInfo


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
    latents: np.ndarray | None = None  # float32 (patch_size, feat_dim) behind the chunk, with return_latents only


@dataclass
class StepEvents:
    """Everything one engine step produced for one client, with the worker's load after it."""

    events: list[AudioEvent]
    load: WorkerLoad


@dataclass
class Reply(Generic[R]):
    """The answer to the `Call[R]` of the same id: its value, or why there is none."""

    call_id: str
    value: R | None = None
    error: ErrorInfo | None = None


@dataclass
class Goodbye:
    """The worker is stopping on purpose: callers get PoolStoppedError, not WorkerDiedError."""

    reason: str


# --- owner <-> worker (the control pipe of the process that spawned it) -------------------------------


@dataclass
class Started:
    info: WorkerInfo


@dataclass
class Fatal:
    message: str


@dataclass
class Stop:
    pass


@dataclass
class Ping:
    """Does the worker's loop still turn? Answered with Pong (`WorkerProcess.silent_s`): a worker stuck in a device
    call that never returns answers no message, and its owner kills it (`WorkerSet.kill_stuck`)."""


@dataclass
class Pong:
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
