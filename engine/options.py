"""Every engine switch in one frozen, typed, documented object, each registered once with its `VOXCPM_*` variable
(the way vLLM's `envs.py` does it). The variables are read here and nowhere else: `EngineOptions.from_env()` when an
`EngineConfig` is made; the config carries the options to the worker processes, and each worker (or an in-process
`LLMEngine`) installs them as the process's options. Kernel modules read `current()` when they launch; tests build
options (`override(...)`) instead of patching module globals.

Defaults are the fastest measured configuration; most switches exist to measure the other side (numbers in
docs/benchmarks.md, keyed by the variable). What an operator may need is in the README's table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

_FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _flag(value: str) -> bool:
    # The words pydantic-settings takes for the NANOVLLM_* switches; anything else is refused (a `false` read as on
    # would turn the switch the other way).
    word = value.strip().lower()
    if word not in _FLAG_WORDS:
        raise ValueError("use 1 or 0 (true/false, yes/no, on/off)")
    return _FLAG_WORDS[word]


def _choice(*allowed: Any, cast: Callable[[str], Any] = str) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        if cast(value) not in allowed:
            raise ValueError(f"use one of {', '.join(map(str, allowed))}")
        return cast(value)

    return parse


def _launch(value: str) -> tuple[int, int, int, int]:
    parts = tuple(int(v) for v in value.split(","))
    if len(parts) != 4 or min(parts) < 1:
        raise ValueError("four positive integers: K tile, pipeline stages, warps, programs per SM")
    return parts  # type: ignore[return-value]


def _rows(value: str) -> int:
    rows = int(value)
    if rows < 0:
        raise ValueError("use 0 (off) or a positive number of rows")
    return rows


def _min_rows(value: str) -> int:
    rows = int(value)
    if rows < 1:
        raise ValueError("use a positive number of rows")
    return rows


def _split_keys(value: str) -> int:
    keys = int(value)
    if keys and (keys < 16 or keys & (keys - 1)):
        raise ValueError("use 0 (never split) or a power of two >= 16")
    return keys


def _megabytes(value: str) -> float:
    mb = float(value)
    if not math.isfinite(mb) or mb < 0:
        raise ValueError("use 0 (none) or a positive number of MB")
    return mb


def _log_level(value: str) -> str | None:
    level = value.strip().upper() or None
    if level is not None and level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def _file(value: str) -> str:
    if not os.path.isfile(os.path.expanduser(value)):
        raise ValueError("no such file")
    return value


def _option(env: str, default: Any, parse: Callable[[str], Any], doc: str) -> Any:
    return field(default=default, metadata={"env": env, "parse": parse, "doc": doc})


@dataclass(frozen=True)
class EngineOptions:
    # --- kernels ----------------------------------------------------------------------------------------------
    fuse: bool = _option("VOXCPM_FUSE", True, _flag, "Triton kernels (element-wise, local attention, VAE "
                         "residual unit, CFG step); off: eager torch ops on CUDA too.")
    split_k: bool = _option("VOXCPM_SPLIT_K", True, _flag, "The o and down projections as split-K GEMMs where one "
                            "GEMM leaves most SMs idle, the partials summed by the add + RMSNorm after them.")
    skinny_rows: int = _option("VOXCPM_SKINNY_ROWS", 64, lambda v: min(64, _rows(v)), "Rows up to which the gate/up "
                               "projection runs as the Triton GEMM with the SiLU gate fused (0: cuBLAS + SiLU).")
    gated_gemm_min_rows: int = _option("VOXCPM_GATED_GEMM_MIN_ROWS", 2048, _rows, "Rows from which the DiT's gate/up "
                                       "projection and its SiLU gate run as one Triton GEMM over an interleaved "
                                       "copy of the weight (engine.ops.gated_gemm; the copy costs the DiT's gate/up "
                                       "weights again); with FP8 weights the FP8 GEMM with the gate in its "
                                       "epilogue (engine.ops.fp8_gemm) wherever the FP8 GEMM runs, on Blackwell, "
                                       "and on Hopper with fp8_fast_accum; 0: off "
                                       "(cuBLAS + silu_mul, or the FP8 GEMM + the gated quantiser).")
    gemv_max_rows: int = _option("VOXCPM_GEMV_MAX_ROWS", 1, _rows, "Activation rows up to which a bias-free "
                                 "projection runs on the weight-streaming GEMV kernel (0: cuBLAS / skinny).")
    pdl: bool = _option("VOXCPM_PDL", True, _flag, "Programmatic dependent launch for the one-row LM chain.")
    attn_split_keys: int = _option("VOXCPM_ATTN_SPLIT_KEYS", 128, _split_keys, "Keys per program when the paged "
                                   "attention splits a token's context across programs; 0: never split.")
    fast_sin: bool = _option("VOXCPM_FAST_SIN", True, _flag, "The hardware sin approximation in the Snake kernels.")
    # --- FP8 weights (EngineConfig.quantization) ---------------------------------------------------------------------
    fp8_min_rows: int = _option("VOXCPM_FP8_MIN_ROWS", 1024, _min_rows, "With quantization='fp8' on a GPU with "
                                "FP8 GEMMs: activation rows from which a projection runs as the FP8 GEMM (fewer rows: "
                                "the bf16 kernels, as without quantization; on an H200 the LMs' 128 rows and the "
                                "LocEnc's 640 ran slower in FP8, the DiT's 2816 faster).")
    fp8_gated_min_rows: int = _option("VOXCPM_FP8_GATED_MIN_ROWS", 64, _rows, "With FP8 weights where the gated "
                                      "FP8 GEMM runs (gated_gemm_min_rows): rows from which a gate/up projection "
                                      "of fewer than fp8_min_rows rows (the LMs' decode, the local modules' at a "
                                      "few sequences) runs as that GEMM on the e4m3 weight (an interleaved copy of "
                                      "every stack's), its product in bf16 for the bf16 down projection; 0: the "
                                      "bf16 kernels.")
    fp8_small_rows: bool = _option("VOXCPM_FP8_SMALL_ROWS", True, _flag, "With FP8 weights: below fp8_min_rows, "
                                   "the one-row GEMV reads the e4m3 weights (bf16 activations, each output channel "
                                   "scaled; H200, B=1: base LM 1.15 -> 0.89 ms); 0: the bf16 weights.")
    fp8_fast_accum: bool = _option("VOXCPM_FP8_FAST_ACCUM", False, _flag, "The FP8 GEMMs' fast accumulation (the "
                                   "tensor cores' partial sums not promoted to fp32 along K; cuBLAS's and the Triton "
                                   "FP8 GEMM's). On Hopper the DiT's gated FP8 GEMM runs only with it.")
    fp8_quant_kernel: bool = _option("VOXCPM_FP8_QUANT_KERNEL", True, _flag, "The FP8 GEMM's per-token activation "
                                     "quantisation as one Triton kernel; 0: torch ops (amax, divide, clamp, cast).")
    # --- the local modules' layer kernel -------------------------------------------------------------------------
    layer_kernel: str = _option("VOXCPM_LAYER_KERNEL", "fused", _choice("fused", "phases", "off"),
                                "The DiT / LocEnc stacks as one persistent kernel launch (fused), one launch per "
                                "phase (phases), or the layers' separate kernels (off).")
    layer_max_rows: int = _option("VOXCPM_LAYER_MAX_ROWS", 64, lambda v: min(64, _rows(v)), "Rows (sequences x "
                                  "tokens, at most 64) up to which the layer kernel runs.")
    layer_block_n: int = _option("VOXCPM_LAYER_BLOCK_N", 32, _choice(16, 32, 64, cast=int), "The layer kernel's "
                                 "output columns per unit.")
    layer_launch: tuple[int, int, int, int] = _option("VOXCPM_LAYER_LAUNCH", (128, 4, 4, 1), _launch,
                                                      "The layer kernel's K tile, pipeline stages, warps and "
                                                      "programs per SM at most.")
    layer_prefetch_mb: float = _option("VOXCPM_LAYER_PREFETCH_MB", 4.0, _megabytes, "MB of each projection's first "
                                       "weights the layer kernel prefetches into L2 from the phase before it.")
    layer_cooperative: bool = _option("VOXCPM_LAYER_COOPERATIVE", True, _flag, "The fused layer kernel as a "
                                      "cooperative launch (co-residency of its grid guaranteed by the driver).")
    # --- the VAE ---------------------------------------------------------------------------------------------------
    vae_stream: bool = _option("VOXCPM_VAE_STREAM", True, _flag, "The VAE decode on a second stream beside the LMs.")
    vae_overlap: bool = _option("VOXCPM_VAE_OVERLAP", True, _flag, "The VAE as its own graph replayed behind the "
                                "step (from vae_overlap_min_batch on), instead of joined inside the step graph.")
    vae_overlap_min_batch: int = _option("VOXCPM_VAE_OVERLAP_MIN_BATCH", 32, _min_rows, "Batch buckets from which the "
                                         "VAE graph runs behind the step.")
    vae_fp16_gemm: bool = _option("VOXCPM_VAE_FP16_GEMM", True, _flag, "The fp32 VAE decoder's upsampler GEMMs and "
                                  "1x1 convs of >= 256 channels on fp16 operands (fp32 accumulation and output) where "
                                  "the process's matmuls may use TF32: TF32's 10-bit mantissa at twice its rate; "
                                  "activations beyond fp16's range saturate. 0: TF32.")
    early_outputs: bool = _option("VOXCPM_EARLY_OUTPUTS", True, _flag, "Where the VAE runs inside the step "
                                  "(beside the LMs), the step's audio, patches and stop flags go to the host once "
                                  "they are made (an event the step graph records), not when the LMs' advance "
                                  "ends; 0: after the whole step.")
    # --- the runtime ---------------------------------------------------------------------------------------------
    lora_kernel: bool = _option("VOXCPM_LORA_KERNEL", True, _flag, "The LoRA terms of steps of mixed runtime "
                                "adapters by the Triton kernels (a few rows: one kernel per term; more: the shrink "
                                "as one GEMM, then a mask-expand-add kernel); 0: the eager masked GEMMs.")
    lora_merged_steps: bool = _option("VOXCPM_LORA_MERGED_STEPS", True, _flag, "A step whose rows all use one "
                                      "runtime LoRA adapter (or none) runs on the weights with that adapter merged, "
                                      "with every fused kernel; the adapted weights are rewritten from a base copy "
                                      "kept on the device when the step's adapter changes. Off: every step of an "
                                      "engine with runtime adapters adds their terms (always in batch-invariant "
                                      "steps: a merged step rounds otherwise).")
    pipeline_decode: bool | None = _option("VOXCPM_PIPELINE_DECODE", None, _flag, "Launch the next decode step "
                                           "before reading the previous one; unset: on CUDA yes, on the CPU no.")
    batch_invariant: bool | None = _option("VOXCPM_BATCH_INVARIANT", None, _flag, "Batch-invariant steps: a "
                                           "request's audio for its seed does not depend on what else is batched "
                                           "or on what its prompt found in the prefix cache (`ops.batch_invariant`"
                                           "); unset: on the CPU yes, on CUDA no (there it turns off the kernels that "
                                           "choose by the batch: `batch_invariant_kernels`).")
    precompile: bool = _option("VOXCPM_PRECOMPILE", True, _flag, "Compile the kernel manifest's variants missing "
                               "from the kernel cache ahead of time, in parallel, during start-up.")
    kernel_manifest: str | None = _option("VOXCPM_KERNEL_MANIFEST", None, _file, "A kernel manifest file used beside "
                                          "the shipped ones (another GPU architecture or model shape).")
    log_level: str | None = _option("VOXCPM_LOG_LEVEL", None, _log_level, "The workers' "
                                    "log level (DEBUG: each step's timeline), and the engine client's in the service's "
                                    "API processes (DEBUG: each request's hand-off); unset: the parent's.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineOptions:
        """The options the VOXCPM_* variables set (defaults for the others); a bad value raises, naming it."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ValueError as e:
                raise ValueError(f"{f.metadata['env']}={raw!r}: {e}") from e
        return cls(**values)

    def batch_invariant_kernels(self) -> EngineOptions:
        """These options with every CUDA kernel choice made by the batch turned off (batch_invariant on a GPU): the
        one-row GEMV, the skinny GEMM and the gated GEMM (projections run as fixed-shape tiles instead), split-K
        partials, the paged attention's key splits (and the decode kernel's rotary and K/V write that come with them),
        the local modules' layer kernel (taken up to a row count), the LoRA kernels (one kernel for a few rows, another
        for more) and merged-adapter steps (merged or not by the batch's adapters); the FP8 GEMM (quantization='fp8')
        then runs at every row count, in fixed-shape tiles like the other GEMMs, instead of from a row count on."""
        return dataclasses.replace(self, gemv_max_rows=0, skinny_rows=0, gated_gemm_min_rows=0, split_k=False,
                                   attn_split_keys=0, layer_kernel="off", lora_kernel=False, lora_merged_steps=False,
                                   fp8_min_rows=1, fp8_gated_min_rows=0)

    @property
    def layer_prefetch_bytes(self) -> int:
        return int(self.layer_prefetch_mb * 2**20)


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES, which limits the GPUs a pool may count without initialising CUDA."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


_current: EngineOptions | None = None


def current() -> EngineOptions:
    """This process's options: those installed, else the environment's (a script using the kernels directly)."""
    global _current
    if _current is None:
        _current = EngineOptions.from_env()
    return _current


def batch_invariant(device_type: str, options: EngineOptions | None = None) -> bool:
    """Whether steps on a device of this type ("cpu", "cuda") run batch-invariantly: EngineOptions.batch_invariant of
    this process (or `options`), unset meaning on the CPU."""
    chosen = (options or current()).batch_invariant
    return device_type == "cpu" if chosen is None else chosen


def install(options: EngineOptions) -> None:
    """Make `options` this process's (a worker, with the options its config carries)."""
    global _current
    _current = options


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[EngineOptions]:
    """This process's options with some changed, for the duration of the block (tests, benchmark sweeps)."""
    global _current
    before = current()
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before
