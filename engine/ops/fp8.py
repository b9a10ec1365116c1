"""FP8 (e4m3) weights for the projections' large-row GEMMs (EngineConfig.quantization = "fp8").

- Weights: one fp32 scale per output channel (row), amax / 448 (e4m3's largest finite value; computed as amax times
  1/448 rounded to fp32, alike in torch and the kernel); the weight divided by it and rounded to float8_e4m3fn
  (nearest, ties to even: 3 mantissa bits, so each element is off by at most 2^-4 of its own size, or 2^-10 of the
  scale where it falls below e4m3's normal range).
- Activations: the same rule per token (row), computed for each call (`quantize_rows`: one Triton kernel per call on
  CUDA, `EngineOptions.fp8_quant_kernel`; its eager torch reference beside it), or by the add + RMSNorm kernel that
  makes them, which attaches them to its output (`attach_rows`; `quantized` finds them).
- The GEMM: `torch._scaled_mm(x_fp8, w_fp8.t(), scale_a (M, 1), scale_b (1, N), out_dtype=bf16)`, rowwise scaling,
  use_fast_accum as `EngineOptions.fp8_fast_accum` says (off: the tensor cores' partial sums promoted to fp32), on
  GPUs where torch runs it (sm89, sm90, sm100: `gemm_supported` probes it once per device).
- The MLP (`fp8_mlp`): the gate/up GEMM's output goes through one kernel that makes the SiLU-gated product and
  quantises it per row for the down GEMM (`silu_mul_quantized`; its reference: `silu_mul`, then `quantize_rows`).
  Where the fused weight has the gated companion (`attach_gated`: the DiT's, on Blackwell, and on Hopper with the fast
  accumulation), the gate/up GEMM is the Triton FP8 GEMM with the gate in its epilogue (`engine.ops.fp8_gemm`, its
  partial sums promoted as `fp8_fast_accum` says), and only the product is quantised.
- Below `fp8_min_rows`, from `fp8_gated_min_rows` rows (the LMs' and LocEnc's decode rows), a gate/up weight with a
  gated companion (then every stack's; a few-rows one where the DiT's is not) runs as the gated FP8 GEMM over narrow
  tiles up to 192 rows (`gated_linear`), its rows quantised by the norm before it; the product stays bf16 for the
  bf16 down GEMM (a row quantiser before the down GEMM costs what its FP8 GEMM saves at these rows).

A weight's companion (`Fp8Weight`) is an attribute of the weight tensor itself (`FP8_ATTR`): `engine.ops.linear`
is handed the same tensor objects every call, so finding it costs a getattr, allocates nothing and never waits for
the device (graph capture). It is made at load, after the projections are fused and stacked (`stack_layer_weights`
moves their storage, not the tensor objects) and after a merged LoRA adapter went into the weights
(`minicpm.quantize_projections`), and remade in place when runtime LoRA merges rewrite the weights (`requantize`).
The bf16 weights stay: calls of fewer than `fp8_min_rows` rows run the bf16 kernels as before, except where a
weight-streaming kernel reads the FP8 weights instead (`small_rows_companion`, EngineOptions.fp8_small_rows: the
one-row GEMV): bf16 activations times the e4m3 values, each output channel's sum scaled, half the weight bytes of a
step that is bound by reading them.

Where torch has no FP8 GEMM (the CPU, older GPUs, a model not in bf16), `dequantize_in_place` replaces the weights by
their FP8 values instead: every call then computes with the FP8 model's weights, its activations unquantised.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.ops import fp8_gemm, gated_gemm, platform
from engine.ops.platform import HAVE_TRITON
from engine.ops.silu_mul import silu_mul
from engine.options import current

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

log = logging.getLogger(__name__)

E4M3_MAX = 448.0
SCALE_FLOOR = 1e-12  # an all-zero row's amax: its scale stays finite and its values zero
FP8_ATTR = "fp8"  # the companion's attribute on a weight tensor
GATED_ATTR = "fp8_gated"  # the gated FP8 GEMM's companion on a fused gate/up weight (`attach_gated`)
FEW_ROWS_GATED_ATTR = "fp8_gated_few_rows"  # the same, for calls below fp8_min_rows only (`gated_few_rows`)
ROWS_ATTR = "fp8_rows"  # an activation's rows quantised by the kernel that made it (`attach_rows`)
QUANTISER_CONSTANTS = {"FLOOR": SCALE_FLOOR, "FP8_MAX": E4M3_MAX, "INV_MAX": 1.0 / E4M3_MAX}  # the kernels' rule
MAX_KERNEL_COLS = 16384  # the kernel holds a row in registers; longer rows take the torch ops

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from engine.ops.silu_mul import silu_mul_math

    @triton.jit
    def store_quantized_row(x, q_ptr, s_ptr, row, n_cols, cols, mask, FLOOR: tl.constexpr, FP8_MAX: tl.constexpr,
                            INV_MAX: tl.constexpr):
        # A row's fp32 values x: its amax, its scale, its values divided (IEEE division, as torch's) and cast.
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR) * INV_MAX
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, stride_x, FLOOR: tl.constexpr, FP8_MAX: tl.constexpr,
                              INV_MAX: tl.constexpr, BLOCK: tl.constexpr):
        # One program per row.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        store_quantized_row(x, q_ptr, s_ptr, row, n_cols, cols, mask, FLOOR, FP8_MAX, INV_MAX)

    @triton.jit
    def _silu_mul_quantize_kernel(gu_ptr, q_ptr, s_ptr, n_cols, stride_gu, FLOOR: tl.constexpr,
                                  FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr, BLOCK: tl.constexpr):
        # One program per row: `_silu_mul_kernel`'s product of the row's two halves (gate, then up), rounded to the
        # dtype as it would be stored, then `_quantize_rows_kernel` on it; the bf16 product is never written.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
        x = silu_mul_math(g, u).to(tl.float32)
        store_quantized_row(x, q_ptr, s_ptr, row, n_cols, cols, mask, FLOOR, FP8_MAX, INV_MAX)


def quantize_rows_reference(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 (M, K) -> (float8_e4m3fn (M, K), fp32 scales (M, 1)): each row over its own amax / 448 (eager torch)."""
    x32 = x2.float()
    # Times 1/448 rounded to fp32 (torch's CUDA division by a scalar multiplies by its reciprocal: so does the kernel).
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp_min(SCALE_FLOOR) * (1.0 / E4M3_MAX)
    return (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def empty_rows(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for `rows` quantised rows of `cols` values and their scales, as the quantisers return them."""
    return (torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


def quantize_rows_triton(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference` as one kernel launch (rows of at most MAX_KERNEL_COLS, unit column stride)."""
    rows, k_dim = x2.shape
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, scale = empty_rows(rows, k_dim, x2.device)
    if rows:
        block = triton.next_power_of_2(k_dim)
        _quantize_rows_kernel[(rows,)](x2, q, scale, k_dim, x2.stride(0), **QUANTISER_CONSTANTS, BLOCK=block,
                                       num_warps=max(4, min(16, block // 1024)))
    return q, scale


def _quant_kernel(x2: torch.Tensor, cols: int) -> bool:
    """Whether the Triton quantisers take rows of `cols` values of x2 (EngineOptions.fp8_quant_kernel)."""
    return platform.kernels(x2) and current().fp8_quant_kernel and cols <= MAX_KERNEL_COLS


def kernel_quantises(x: torch.Tensor) -> bool:
    """Whether x's rows are quantised by a Triton kernel (so one that makes x may do it: `attach_rows`)."""
    return _quant_kernel(x, x.shape[-1])


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantisation: the Triton kernel where it runs (EngineOptions.fp8_quant_kernel), else torch."""
    if _quant_kernel(x2, x2.shape[-1]):
        return quantize_rows_triton(x2)
    return quantize_rows_reference(x2)


def attach_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Hand the FP8 GEMM that reads x its rows already quantised (`quantize_rows` of them, bitwise), made by the
    kernel that wrote x (`norm.add_rms_norm`): an attribute of the tensor object, as weights carry their companions,
    so the layers in between pass x on unchanged and a capture records nothing extra."""
    setattr(x, ROWS_ATTR, (q, scale))


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K)'s rows quantised: the pair its kernel attached, else `quantize_rows` of them."""
    attached = getattr(x, ROWS_ATTR, None)
    return attached if attached is not None else quantize_rows(x.reshape(-1, x.shape[-1]))


def silu_mul_quantized_triton(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul_quantized` as one kernel launch (halves of at most MAX_KERNEL_COLS, unit column stride)."""
    rows, width = gate_up.shape
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    n = width // 2
    q, scale = empty_rows(rows, n, gate_up.device)
    if rows:
        block = triton.next_power_of_2(n)
        _silu_mul_quantize_kernel[(rows,)](gate_up, q, scale, n, gate_up.stride(0), **QUANTISER_CONSTANTS,
                                           BLOCK=block, num_warps=max(4, min(16, block // 1024)))
    return q, scale


def silu_mul_quantized(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of a fused gate/up projection's output (M, 2I), quantised per row: (e4m3 (M, I), fp32 scales
    (M, 1)). One kernel where the quantiser kernel runs; else `silu_mul`, then `quantize_rows`: the same values."""
    if _quant_kernel(gate_up, gate_up.shape[-1] // 2):
        return silu_mul_quantized_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return quantize_rows(silu_mul(gate, up))


@dataclass(frozen=True)
class Fp8Weight:
    """A projection weight (N, K) in e4m3 (contiguous) and its per-output-channel scales as (1, N) fp32, the layout
    `_scaled_mm`'s rowwise scaling takes for its second operand."""

    data: torch.Tensor
    scale: torch.Tensor

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the FP8 values stand for, rounded once to `dtype`."""
        return (self.data.float() * self.scale.view(-1, 1)).to(dtype)


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    q, scale = quantize_rows(weight.detach())
    return Fp8Weight(q.contiguous(), scale.view(1, -1).contiguous())


def gemm_shape_ok(weight: torch.Tensor) -> bool:
    """`_scaled_mm` multiplies K and N that are multiples of 16 only."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


_probed: dict[torch.device, bool] = {}


def gemm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the FP8 GEMM runs for a model of this dtype on this device: CUDA, sm89 or newer, bf16, and a small
    rowwise-scaled `_scaled_mm` runs there (probed once per device; torch refuses e.g. consumer Blackwell)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    if device not in _probed:
        try:
            a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
            torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                             scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
            _probed[device] = True
        except RuntimeError as e:
            log.warning("no FP8 GEMM on %s (%s): FP8 weights dequantised", device, e)
            _probed[device] = False
    return _probed[device]


def attach(weight: torch.Tensor) -> None:
    """Give `weight` its FP8 companion (from its current values)."""
    setattr(weight, FP8_ATTR, quantize_weight(weight))


def companion_of(weight: torch.Tensor | None) -> Fp8Weight | None:
    return getattr(weight, FP8_ATTR, None)


def interleaved(weight: Fp8Weight, into: Fp8Weight | None = None) -> Fp8Weight:
    """A fused [gate; up] FP8 weight (2I, K) and its scales with rows as (gate_i, up_i) pairs, the layout of the gated
    GEMMs (`gated_gemm.interleave`): copies, or written in place into `into` (capturable)."""
    data = gated_gemm.interleave(weight.data, None if into is None else into.data)
    scale = gated_gemm.interleave(weight.scale.view(-1, 1), None if into is None else into.scale.view(-1, 1))
    return Fp8Weight(data, scale.view(1, -1)) if into is None else into


def attach_gated(gate_up: torch.Tensor, few_rows_only: bool = False) -> None:
    """Give a fused gate/up weight with an FP8 companion the gated FP8 GEMM's: that companion `interleaved` (e4m3, a
    quarter of the bf16 weight's bytes again); `few_rows_only`: for calls below fp8_min_rows alone (from
    fp8_min_rows rows such a weight keeps cuBLAS + the gated quantiser)."""
    fp8 = companion_of(gate_up)
    assert fp8 is not None
    setattr(gate_up, FEW_ROWS_GATED_ATTR if few_rows_only else GATED_ATTR, interleaved(fp8))


def gated_companion_of(gate_up: torch.Tensor | None) -> Fp8Weight | None:
    """The gated companion for calls of any row count (not one for few rows only)."""
    return getattr(gate_up, GATED_ATTR, None)


def few_rows_gated_companion_of(gate_up: torch.Tensor | None) -> Fp8Weight | None:
    """The gated companion calls below fp8_min_rows run on: the one for any row count, else the one for few rows."""
    return getattr(gate_up, GATED_ATTR, None) or getattr(gate_up, FEW_ROWS_GATED_ATTR, None)


def gated_few_rows(x: torch.Tensor, gate_up: torch.Tensor | None) -> Fp8Weight | None:
    """The gated companion a gate/up call on x of fewer than `fp8_min_rows` rows runs on (`gated_linear`): where the
    weight has one, x has at least `fp8_gated_min_rows` rows (EngineOptions; 0: never; nor with the gated GEMMs off)
    and the kernels run on its device; else None (the bf16 kernels). Host-side shapes only."""
    gated = few_rows_gated_companion_of(gate_up)
    opts = current()
    rows = x.numel() // max(1, x.shape[-1])
    if (gated is None or not opts.fp8_gated_min_rows or not opts.gated_gemm_min_rows
            or not opts.fp8_gated_min_rows <= rows < opts.fp8_min_rows):
        return None
    return gated if platform.kernels(x) else None


def reads_quantized(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether the call of `weight` on x quantises x's rows (so the norm that makes x may do it: `attach_rows`)."""
    return companion(x, weight) is not None or gated_few_rows(x, weight) is not None


def gated_linear(x: torch.Tensor, gated: Fp8Weight) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) in x's dtype by the gated FP8 GEMM on the interleaved e4m3 weight, x's rows
    quantised (by the norm that made them, where it did); narrow tiles up to `fp8_gemm.FEW_ROWS` rows."""
    x_fp8, x_scale = quantized(x)
    tiles = fp8_gemm.FEW_ROWS_GATED_TILES if x_fp8.shape[0] <= fp8_gemm.FEW_ROWS else fp8_gemm.GATED_TILES
    out = fp8_gemm.fp8_matmul(x_fp8, x_scale, gated.data, gated.scale, x.dtype, tiles, gated=True)
    return out.view(*x.shape[:-1], out.shape[-1])


def small_rows_companion(weight: torch.Tensor | None) -> Fp8Weight | None:
    """The FP8 weight a weight-streaming kernel reads for a call below `fp8_min_rows` rows (the caller knows its
    rows): the weight's companion where it has one and EngineOptions.fp8_small_rows is on, else None."""
    return companion_of(weight) if current().fp8_small_rows else None


def requantize(weight: torch.Tensor) -> None:
    """Rewrite `weight`'s companion in place from the weight's current values (after a LoRA merge rewrote them);
    queued on the current stream, capturable (the companion's memory stays where the graphs read it)."""
    fp8 = companion_of(weight)
    assert fp8 is not None
    q, scale = quantize_rows(weight.detach())
    fp8.data.copy_(q)
    fp8.scale.copy_(scale.view(1, -1))
    for gated in (getattr(weight, GATED_ATTR, None), getattr(weight, FEW_ROWS_GATED_ATTR, None)):
        if gated is not None:
            interleaved(fp8, into=gated)


def dequantize_in_place(weight: torch.Tensor) -> None:
    """Replace the weight's values by the FP8 ones they round to (devices without the FP8 GEMM)."""
    weight.data.copy_(quantize_weight(weight).dequantized(weight.dtype))


def companion(x: torch.Tensor, weight: torch.Tensor | None) -> Fp8Weight | None:
    """The FP8 weight a call x @ weight.T runs on: the weight's companion where it has one and the call has at least
    `fp8_min_rows` rows (host-side shapes only), else None (the bf16 kernels)."""
    fp8 = getattr(weight, FP8_ATTR, None)
    if fp8 is None or x.numel() < current().fp8_min_rows * x.shape[-1]:
        return None
    return fp8


def scaled_matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: Fp8Weight,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """(M, K) e4m3 row-major x (K, N) e4m3 column-major (the weight's transpose view), each side's rows scaled."""
    return torch._scaled_mm(x_fp8, weight.data.t(), scale_a=x_scale, scale_b=weight.scale, out_dtype=out_dtype,
                            use_fast_accum=current().fp8_fast_accum)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x (..., K) @ W.T by the FP8 GEMM: x quantised per token, the product accumulated in fp32, out in x's dtype."""
    x_fp8, x_scale = quantized(x)
    return scaled_matmul(x_fp8, x_scale, weight, x.dtype).view(*x.shape[:-1], weight.data.shape[0])


def mlp_companions(x: torch.Tensor, gate_up_weight: torch.Tensor,
                   down_weight: torch.Tensor) -> tuple[Fp8Weight, Fp8Weight, Fp8Weight | None] | None:
    """The FP8 weights an MLP call on x runs `fp8_mlp` with: both projections' companions where both take these
    rows (`companion`), and the gate/up weight's gated companion where it has one and the gated GEMMs are on
    (EngineOptions.gated_gemm_min_rows not 0: the batch-invariant mode turns them off); else None (the MLP's other
    paths)."""
    gate_up, down = companion(x, gate_up_weight), companion(x, down_weight)
    if gate_up is None or down is None:
        return None
    gated = gated_companion_of(gate_up_weight) if current().gated_gemm_min_rows and platform.kernels(x) else None
    return gate_up, down, gated


def fp8_mlp(x: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight, gated: Fp8Weight | None = None) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) on the FP8 GEMMs: x (..., K) quantised per token, the gated product quantised
    per token for the down GEMM, the output in x's dtype. With `gated` (the gate/up weight `interleave`d) the gate is
    in the gate/up GEMM's epilogue (`fp8_gemm.fp8_matmul`), else in the quantiser after it (`silu_mul_quantized`)."""
    if gated is not None:
        x_fp8, x_scale = quantized(x)
        act, act_scale = quantize_rows(fp8_gemm.fp8_matmul(x_fp8, x_scale, gated.data, gated.scale, x.dtype,
                                                           fp8_gemm.GATED_TILES, gated=True))
    else:
        gate_up_out = fp8_linear(x, gate_up)
        act, act_scale = silu_mul_quantized(gate_up_out.reshape(-1, gate_up_out.shape[-1]))
    return scaled_matmul(act, act_scale, down, x.dtype).view(*x.shape[:-1], down.data.shape[0])


def fp8_linear_reference(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """`fp8_linear` in eager fp32 on any device: both sides quantised and dequantised, multiplied, rounded once."""
    k_dim = x.shape[-1]
    x_fp8, x_scale = quantize_rows_reference(x.reshape(-1, k_dim))
    out = (x_fp8.float() * x_scale) @ weight.dequantized(torch.float32).t()
    return out.to(x.dtype).view(*x.shape[:-1], weight.data.shape[0])
