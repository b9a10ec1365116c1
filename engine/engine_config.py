"""EngineConfig: how one engine is sized and run (batch, lengths, memory, graphs, coalescing, adapters), with the
engine switches (`EngineOptions`) it carries to the workers. The one definition of each engine field: its default,
its bounds and its doc (`VoxCPM.from_pretrained` takes the fields as keywords, `ModelRunner` the config whole, and the
service's settings derive theirs from here). Torch-free, so the processes that only start workers (the service's
supervisor) build one without importing torch."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from engine.options import EngineOptions
from engine.vocabulary import LORA_NAME_PATTERN

# The dtype names an EngineConfig takes (engine.config.parse_dtype makes them torch dtypes, in the processes that
# run the engine): a config names its dtype, so that building and pickling one for the workers needs no torch.
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "float32": "float32", "fp32": "float32"}  # name -> torch attribute

ATTENTION_BACKENDS = ("flash", "triton", "torch")
QUANTIZATIONS = ("fp8",)

if TYPE_CHECKING:
    import torch


def setting(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            choices: tuple[str, ...] | None = None, pattern: str | None = None) -> Any:
    """One engine field: its default, bounds and doc, defined here once. `validate()` checks the bounds; the
    service's settings take the default, bounds and doc from here (`service.settings.engine_setting`)."""
    return field(default=default, metadata={"doc": doc, "ge": ge, "gt": gt, "le": le, "choices": choices,
                                                   "pattern": pattern})


@dataclass
class EngineConfig:
    max_num_seqs: int = setting(16, "Sequences decoded together per step.", ge=1)
    max_model_len: int = setting(4096, "Longest sequence (prompt + generated).", ge=16)
    max_num_batched_tokens: int = setting(8192, "Prefill token budget per step (>= max_model_len: a preempted "
                                                "stream is recomputed in one prefill).", ge=1)
    running_prefill_tokens: int | None = setting(
        None, "Prefill token budget of a step while streams are running: that step's prefill delays their next "
              "chunk, so a burst of arrivals is admitted over several steps, each within this budget (a prompt "
              "longer than it is admitted alone in its step); with nothing running a round admits up to "
              "max_num_batched_tokens. Unset: max_num_batched_tokens always.", ge=1)
    block_size: int = setting(16, "Tokens per KV block (a power of two).", ge=1)
    num_kv_blocks: int | None = setting(None, "KV blocks; unset: CUDA measures free memory, the CPU fits "
                                              "max_num_seqs full sequences.", ge=1)
    gpu_memory_utilization: float = setting(0.9, "Share of the device's memory this engine may end up using.",
                                            ge=0.05, le=1.0)
    enforce_eager: bool = setting(False, "No CUDA graphs.")
    attention_backend: str | None = setting(None, "The paged attention's kernels; unset: the best available.",
                                            choices=ATTENTION_BACKENDS)
    inference_timesteps: int = setting(10, "CFM Euler steps per patch.", ge=1, le=100)
    dtype: str | torch.dtype | None = setting(None, "The weights' dtype, a name of DTYPE_NAMES (or a torch dtype); "
                                                    "unset: the checkpoint's.", choices=tuple(DTYPE_NAMES))
    vae_dtype: str | None = setting(None, "The streaming VAE decoder's dtype, a name of DTYPE_NAMES; unset: "
                                          "float32, as the official package runs it. bfloat16 is faster at high "
                                          "batch (docs/benchmarks.md) and changes the audio by its rounding; the "
                                          "patches, and so what is said, do not depend on it. float16 is first "
                                          "checked on the model's latents of a test clip (at least 40 dB from "
                                          "float32's audio, else the start fails naming this field).",
                                    choices=tuple(DTYPE_NAMES))
    quantization: str | None = setting(None, "Weights of the LMs', LocEnc's and DiT's projections: 'fp8' (e4m3, a "
                                             "scale per output channel): on a GPU with FP8 GEMMs (sm89+, a bf16 "
                                             "model) calls of at least VOXCPM_FP8_MIN_ROWS rows run as FP8 GEMMs "
                                             "(activations quantised per token), fewer rows on the bf16 weights, "
                                             "which are kept; elsewhere (the CPU) the weights are replaced by their "
                                             "dequantised values. Unset: the checkpoint's weights.",
                                       choices=QUANTIZATIONS)
    pipeline_decode: bool | None = setting(None, "Launch a decode step before reading the previous one's outputs, so "
                                                 "the host's work between steps overlaps the device's (a sequence "
                                                 "that stops computes one patch more, dropped). Unset: on for CUDA, "
                                                 "off on the CPU where a step is synchronous anyway.")
    coalesce_ms: float = setting(0.0, "Window gathering generation requests that arrive together into one "
                                      "scheduling round (one batched prefill): new requests wait for others up to "
                                      "this long after the latest arrival, at most four windows after the first; "
                                      "0: admit at once.", ge=0.0, le=1000.0)
    queue_timeout_s: float | None = setting(None, "Longest a request waits for a seat, then it fails "
                                                  "(OverloadedError; the service's 503). None, the library's default: "
                                                  "no limit (the service's default is 30 s).", gt=0.0)
    lora_path: str | None = setting(None, "A LoRA adapter (official format: its directory or weights file) merged "
                                          "into the weights at load (a model passed to LLMEngine already loaded is "
                                          "changed in place).")
    lora_merge: bool = setting(True, "Merge the start-up adapter into the weights at load (the seed's "
                                     "instance-level adapter: no per-step cost; runtime adapters then apply on top "
                                     "of it). False: serve it as the runtime adapter `lora_name` of every request "
                                     "that names none (needs max_loras >= 1).")
    lora_name: str = setting("default", "The start-up adapter's name when it is served as a runtime adapter.",
                             pattern=LORA_NAME_PATTERN)
    max_loras: int = setting(0, "Runtime LoRA adapters (registered by name, chosen per request) resident on the "
                                "device at once; the least recently used idle one makes room. 0: runtime adapters "
                                "off (no per-step cost).", ge=0, le=64)
    max_lora_rank: int = setting(32, "Largest rank a runtime adapter may have (its slots are sized for it).",
                                 ge=1, le=256)
    lora_slot_wait_s: float = setting(0.5, "While a request waits for a LoRA slot (every slot held by running "
                                           "requests), later requests of resident adapters start before it for this "
                                           "long; then the busy slot with the fewest holds takes no new ones until "
                                           "it drains and the waiting request has it (a burst of more adapters than "
                                           "slots runs as many requests at once as fit; a steady stream of a "
                                           "resident adapter's requests starves no one). 0: at once.",
                                      ge=0.0, le=3600.0)
    # The engine switches, read from the VOXCPM_* variables when the config is made (here, not in the workers).
    options: EngineOptions = field(default_factory=EngineOptions.from_env)

    def validate(self) -> None:
        """Each field's type (a TypeError naming it: 10.5 steps or "false" as a switch reached the workers), its
        bounds, then the rules between fields (a ValueError naming the field)."""
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            kinds = [k for k in str(f.type).split(" | ") if k != "None"]
            if value is not None and meta and kinds and all(k in FIELD_TYPES for k in kinds):
                check_type(f.name, value, tuple(t for k in kinds for t in FIELD_TYPES[k]))
            if value is None or not meta or isinstance(value, bool):
                continue
            if meta["pattern"] is not None and isinstance(value, str) and not re.fullmatch(meta["pattern"], value):
                raise ValueError(f"{f.name}: {value!r} does not match {meta['pattern']}")
            if meta["choices"] is not None and isinstance(value, str) and value not in meta["choices"]:
                raise ValueError(f"{f.name}: {value!r} is not one of {sorted(meta['choices'])}")
            if meta["ge"] is not None and not value >= meta["ge"]:
                raise ValueError(f"{f.name} must be >= {meta['ge']:g}, got {value!r}")
            if meta["gt"] is not None and not value > meta["gt"]:
                raise ValueError(f"{f.name} must be > {meta['gt']:g}, got {value!r}")
            if meta["le"] is not None and not value <= meta["le"]:
                raise ValueError(f"{f.name} must be <= {meta['le']:g}, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.max_num_batched_tokens < self.max_model_len:
            # A preempted stream is recomputed in one prefill of up to max_model_len tokens.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len})")
        if self.lora_path and not self.lora_merge and self.max_loras < 1:
            raise ValueError("lora_merge=False serves the start-up adapter as a runtime adapter: max_loras must be "
                             ">= 1")


FIELD_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (float, int), "bool": (bool,), "str": (str,)}


def check_type(name: str, value: object, kinds: tuple[type, ...]) -> None:
    """`value` is one of `kinds` (a bool counts as no int here, though Python says it is), else a TypeError naming
    `name`."""
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise TypeError(f"{name}: {' or '.join(k.__name__ for k in kinds)} expected, got {value!r}")
ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig) if f.name != "options")
