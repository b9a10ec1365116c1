"""EngineConfig: how one engine is sized and run (batch, lengths, memory, graphs, coalescing), with the engine
switches (`EngineOptions`) it carries to the workers. Torch-free, so the processes that only start workers (the
service's supervisor) build one without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.options import EngineOptions

# The dtype names an EngineConfig takes (engine.config.parse_dtype makes them torch dtypes, in the processes that
# run the engine): a config names its dtype, so that building and pickling one for the workers needs no torch.
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "float32": "float32", "fp32": "float32"}  # name -> torch attribute

if TYPE_CHECKING:
    import torch


@dataclass
class EngineConfig:
    max_num_seqs: int = 16
    max_model_len: int = 4096
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: CUDA measures free memory, CPU fits max_num_seqs full sequences
    gpu_memory_utilization: float = 0.9  # share of the device's memory this engine may end up using
    enforce_eager: bool = False  # no CUDA graphs
    attention_backend: str | None = None  # "flash" | "triton" | "torch"; default: the best available
    inference_timesteps: int = 10
    dtype: str | torch.dtype | None = None  # a name of DTYPE_NAMES (or a torch dtype); default: the checkpoint's
    # Launch a decode step before reading the previous one's outputs, so the host's work between steps
    # overlaps the device's (a sequence that stops computes one patch more, dropped). None: the options' choice,
    # else on for CUDA, off on the CPU where a step is synchronous anyway.
    pipeline_decode: bool | None = None
    # Window gathering requests that arrive together into one scheduling round (one batched prefill): new
    # requests wait up to this long for others before they are admitted. 0 = admit at once.
    coalesce_ms: float = 0.0
    # A request still waiting for a seat this long after it arrived is failed (OverloadedError); None = no limit.
    queue_timeout_s: float | None = None
    # A LoRA adapter (official format: its directory or weights file) merged into the weights at load (a model
    # passed to LLMEngine already loaded is changed in place).
    lora_path: str | None = None
    # False: serve that adapter as a runtime adapter named `lora_name`, the one of every request that names none
    # (other runtime adapters then apply to the base weights, as they were trained; needs max_loras >= 1).
    lora_merge: bool = True
    lora_name: str = "default"
    # Runtime LoRA adapters (registered by name, chosen per request): how many may be resident on the device at once
    # (0: none, no per-step cost) and the largest rank they may have (their slots are sized for it).
    max_loras: int = 0
    max_lora_rank: int = 32
    # The engine switches, read from the VOXCPM_* variables when the config is made (here, not in the workers).
    options: EngineOptions = field(default_factory=EngineOptions.from_env)

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size", "inference_timesteps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in [0.05, 1]")
        if self.max_num_batched_tokens < self.max_model_len:
            # A preempted stream is recomputed in one prefill of up to max_model_len tokens.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if not 0.0 <= self.coalesce_ms <= 1000.0:
            raise ValueError("coalesce_ms must be in [0, 1000]")
        if self.queue_timeout_s is not None and self.queue_timeout_s <= 0:
            raise ValueError("queue_timeout_s must be > 0")
        if self.lora_path and not self.lora_merge and self.max_loras < 1:
            raise ValueError("lora_merge=False serves the start-up adapter as a runtime adapter: max_loras must be "
                             ">= 1")
        if not 0 <= self.max_loras <= 64:
            raise ValueError("max_loras must be in [0, 64]")
        if not 1 <= self.max_lora_rank <= 256:
            raise ValueError("max_lora_rank must be in [1, 256]")
        if isinstance(self.dtype, str) and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_NAMES)}")
