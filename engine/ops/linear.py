"""Which kernel multiplies a projection: the one-row GEMV, the skinny gate/up kernel, split-K partials or cuBLAS.

Every bias-free projection of the transformers goes through here, so what multiplies, say, a one-row o_proj is
decided in one place. Split-K (EngineOptions.split_k): where a GEMM has few output tiles for its length of K, cuBLAS
leaves most SMs idle; a strided batched GEMM over slices of K writes fp32 partials that the add + RMSNorm after it
sums (`norm.add_rms_norm`). The eager path is `F.linear`. With FP8 weights (`engine.ops.fp8`), a call of at least
`fp8_min_rows` rows on a weight with an FP8 companion runs the FP8 GEMM before any of these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops import fp8, gated_gemm, gemv, platform, silu_mul, skinny_gemm
from engine.options import current


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T without bias: on CUDA up to `gemv_max_rows` (EngineOptions) rows (one by default) go to the
    weight-streaming GEMV kernel chained by PDL (`gemv.gemv`: the LMs' one-row decode chain), the rest to
    cuBLAS."""
    if (quantized := fp8.companion(x, weight)) is not None:
        return fp8.fp8_linear(x, quantized)
    if platform.kernels(x) and (out := _gemv(x, weight)) is not None:
        return out
    return F.linear(x, weight)


def _gemv(x: torch.Tensor, weight: torch.Tensor, silu_gate: bool = False,
          partials: bool = False) -> torch.Tensor | None:
    """`gemv.gemv` where it takes the call, on the weight's FP8 companion where it has one
    (`fp8.small_rows_companion`), else on the weight; None where it does not take it."""
    small = fp8.small_rows_companion(weight)
    if small is not None and gemv.gemv_supported(x, small.data, silu_gate, partials, scaled=True):
        return gemv.gemv(x, small.data, silu_gate, scale=small.scale)
    if gemv.gemv_supported(x, weight, silu_gate, partials):
        return gemv.gemv(x, weight, silu_gate)
    return None


def silu_gate_linear(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for the fused [gate; up] weight (2I, K): for a few rows on CUDA one
    weight-streaming kernel with the gated product in its epilogue (where it beats cuBLAS + `silu_mul`; the other
    projections stay on cuBLAS, which the same kernel did not beat), for many rows where the weight has an interleaved
    companion the GEMM with the gate in its epilogue (`gated_gemm`), else the GEMM and `silu_mul`."""
    if (quantized := fp8.companion(x, gate_up_weight)) is not None:
        gate_up = fp8.fp8_linear(x, quantized)
    elif platform.kernels(x) and (out := _gemv(x, gate_up_weight, silu_gate=True)) is not None:
        return out
    elif platform.kernels(x) and skinny_gemm.skinny_supported(x, gate_up_weight, silu_gate=True):
        return skinny_gemm.skinny_matmul(x, gate_up_weight, silu_gate=True)
    elif (interleaved := gated_gemm.companion(x, gate_up_weight)) is not None:
        return gated_gemm.gated_gemm(x, interleaved)
    else:
        gate_up = F.linear(x, gate_up_weight)
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_mul.silu_mul(gate, up)


def residual_splits(rows: int, k_dim: int, n: int) -> int:
    """How many K slices `residual_linear` uses for (rows, K) @ (K, n): 1 (one GEMM) where splitting measured no
    faster (many outputs, or a short K: docs/benchmarks.md, `VOXCPM_SPLIT_K`)."""
    outputs = rows * n
    if k_dim < 1024 or outputs > (1100 << 10 if k_dim >= 4096 else 360 << 10):
        return 1
    return 4 if k_dim >= 4096 and n <= 1024 and outputs <= 180 << 10 else 2


def split_k_views(x2: torch.Tensor, weight: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views for a batched GEMM over `splits` slices of K (no copies): x2 (rows, K) contiguous -> (S, rows, K/S) with
    strides (K/S, K, 1); weight (N, K) contiguous -> (S, K/S, N), column-major slices that cuBLAS reads as they are.
    bmm of the two, summed over S, is x2 @ weight.T."""
    rows, k_dim = x2.shape
    part = k_dim // splits
    return (x2.view(rows, splits, part).transpose(0, 1),
            weight.view(weight.shape[0], splits, part).permute(1, 2, 0))


def residual_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for the last projection of a residual branch, which `add_rms_norm` adds to the stream: the output,
    or on CUDA where `residual_splits` says so, its S partial products over slices of K, (S, *x.shape[:-1], N)
    fp32 (fp32 accumulation throughout; only the summation order differs from one GEMM's). One-row calls go to the
    GEMV kernel (`linear`), which returns partials where it cuts K into slices; FP8 calls return the output."""
    if (quantized := fp8.companion(x, weight)) is not None:
        return fp8.fp8_linear(x, quantized)
    if platform.kernels(x) and (out := _gemv(x, weight, partials=True)) is not None:
        return out
    k_dim, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k_dim)
    splits = residual_splits(x2.shape[0], k_dim, n) if current().split_k and platform.kernels(x) else 1
    # Each slice a whole number of 16-byte rows (cuBLAS's aligned kernels), K a multiple of the slice count.
    if (splits == 1 or k_dim % (8 * splits) or x.dtype not in (torch.float16, torch.bfloat16)
            or weight.dtype != x.dtype or not weight.is_contiguous() or torch.is_grad_enabled()):
        return F.linear(x, weight)
    x_slices, w_slices = split_k_views(x2.contiguous(), weight, splits)
    return torch.bmm(x_slices, w_slices, out_dtype=torch.float32).view(splits, *x.shape[:-1], n)

