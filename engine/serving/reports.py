"""What a worker reports about itself, typed: its model facts and start-up (`WorkerInfo`, once, with `Ready`), its
load with every step's events (`WorkerLoad`) and its counters on request (`WorkerStats`; `SendWaits` sums two).
Shapes after vLLM v1's `SchedulerStats` riding on `EngineCoreOutputs`: fields a reader names, never string keys.

`describe(engine)` makes a worker's WorkerInfo. Torch-free: the service's API processes read them without loading
torch.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.vocabulary import AdapterInfo

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

KernelStat = int | float | str | list[str]  # a count, seconds, or the kernels' names


@dataclass
class StartupTimes:
    """Where a worker's cold start went, in seconds (None: the phase did not run)."""

    load_s: float = 0.0  # weights read and placed
    precompile_wait_s: float = 0.0  # kernels still compiling when the weights were in
    kv_s: float = 0.0  # KV cache sizing and allocation
    graphs_s: float = 0.0  # CUDA graphs, warm-up and capture together
    graph_warmup_s: float = 0.0
    graph_capture_s: float = 0.0
    startup_s: float = 0.0  # the engine's whole construction
    kernels: dict[str, KernelStat] = field(default_factory=dict)  # what the kernel cache and the JIT did
    warmup_zeroshot_s: float | None = None
    warmup_encode_s: float | None = None
    warmup_hifi_s: float | None = None
    warmup_s: float | None = None
    process_import_s: float | None = None  # spawn, Python, torch and the engine's imports
    spawn_to_ready_s: float | None = None


@dataclass
class WorkerInfo:
    """The model facts a client reads once (GET /info shows them)."""

    architecture: str
    version: int
    sample_rate: int  # of the audio it streams
    encoder_sample_rate: int  # of the clips it encodes
    feat_dim: int
    patch_size: int
    samples_per_patch: int
    dtype: str
    vae_dtype: str  # the VAE decoder's
    vae_check_db: float | None  # a float16 decoder's start-up check: its test clip's audio from float32's (None: none)
    device: str
    max_num_seqs: int
    max_model_len: int
    inference_timesteps: int
    coalesce_ms: float
    attention_backend: str
    cuda_graphs: int
    pipelined_decode: bool
    lora_merged_layers: int  # layers the start-up adapter changed when merged
    lora_merged_steps: bool  # a step of one runtime adapter runs on merged weights
    max_loras: int
    max_lora_rank: int
    kv_blocks: int
    block_size: int
    startup: StartupTimes = field(default_factory=StartupTimes)
    channels: int = 1

    def as_dict(self) -> dict[str, Any]:
        """One flat mapping, the start-up phases beside the facts (the library's `get_model_info()` and /info)."""
        facts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "startup"}
        return {**facts, **dataclasses.asdict(self.startup)}


@dataclass
class WorkerLoad:
    """What a worker holds now; sent with every step's events, so routing needs no round trip."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


@dataclass
class WorkerStats(WorkerLoad):
    """A worker's counters (GetStats): its load, its slots, and what it has done since it started."""

    free_slots: int = 0
    total_slots: int = 0
    preemptions: int = 0
    prompts: int = 0  # continuation prompts registered with it
    clients: int = 0  # connected clients
    steps: int = 0
    step_seconds: float = 0.0  # summed over the steps
    messages_sent: int = 0  # to its clients (a step's events, replies)
    send_seconds: float = 0.0  # summed over those: from queued for a client to written to it
    gc_collections: int = 0  # the garbage collector's passes in the worker process (engine.serving.collector)
    gc_seconds: float = 0.0  # summed over those: the process, its step loop included, waited for each
    gc_longest_s: float = 0.0
    gc_frozen_objects: int = 0  # objects out of the collector now: the start-up's, frozen once ready, less those freed
    loras: list[AdapterInfo] = field(default_factory=list)


class SendWaits:
    """How long the worker's messages waited from being queued for a client to being written to it, summed over its
    sender threads (WorkerStats' messages_sent / send_seconds): pickling and writing, a client slow to read, and a
    sender waiting for the interpreter while the main thread runs the next step."""

    def __init__(self) -> None:
        self.messages = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.messages += 1
            self.seconds += seconds


def describe(engine: LLMEngine) -> WorkerInfo:
    """The model facts a client reads once (GET /info shows them)."""
    m, cfg = engine.model, engine.config
    return WorkerInfo(
        architecture=m.config.architecture, version=m.config.version, sample_rate=m.vae.out_sample_rate,
        encoder_sample_rate=m.vae.sample_rate, feat_dim=m.config.feat_dim, patch_size=m.config.patch_size,
        samples_per_patch=engine.runner.samples_per_patch, dtype=str(engine.runner.dtype).removeprefix("torch."),
        vae_dtype=str(engine.model.vae.decoder.engine_dtype).removeprefix("torch."), vae_check_db=engine.vae_check_db,
        device=str(engine.device), max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
        inference_timesteps=cfg.inference_timesteps, coalesce_ms=cfg.coalesce_ms,
        attention_backend=engine.runner.backend, cuda_graphs=len(engine.runner.graphs),
        pipelined_decode=engine.pipeline, lora_merged_layers=engine.lora_layers,
        lora_merged_steps=engine.runner.lora is not None and engine.runner.lora.merges, max_loras=cfg.max_loras,
        max_lora_rank=cfg.max_lora_rank, kv_blocks=len(engine.blocks.blocks), block_size=cfg.block_size,
        startup=StartupTimes(startup_s=engine.startup_s, **engine.startup_phases))
