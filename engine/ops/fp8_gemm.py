"""The FP8 (e4m3, rowwise-scaled) GEMM as a Triton kernel, for the DiT's gate/up projection with its SiLU gate.

cuBLAS (`torch._scaled_mm`, `engine.ops.fp8`) writes the gate/up output (rows x 2I, bf16) that the SiLU-gated
quantiser reads back (B=128: 46 MB a layer). `fp8_matmul` computes `(x_fp8 @ w_fp8.T) * x_scale * w_scale` in fp32,
the scales in its epilogue; with `gated=True`, on a weight with its rows as (gate_i, up_i) pairs and its scales alike
(`fp8.interleaved`, the bf16 gated GEMM's layout), the epilogue makes silu(gate) * up, so only that product is written
(rounded as `_scaled_mm`'s bf16 output and `silu_mul` round it: each half to the dtype, then SiLU and the product).
It is tiled over pointers (the CPU interpreter runs it) or persistent over tensor descriptors (Hopper). For the plain
projections it measured no faster than cuBLAS (docs/benchmarks.md, Refuted): only the gated form is used. Its eager
reference is `fp8.fp8_linear_reference` (and `silu_mul` of it).

Accumulation: Hopper's FP8 tensor cores keep a dot's partial sums in an accumulator narrower than fp32, and Triton
leaves them there on sm90 unless told how many products to accumulate before adding into fp32
(`max_num_imprecise_acc`). The kernels take EngineOptions.fp8_fast_accum as cuBLAS does: off, the partial sums are
promoted every K tile (BLOCK_K products: on an H200 the same error against an exact product as cuBLAS without fast
accumulation, 2.0e-4 rms at K=1024 against 7.4e-4, 2.0e-4 against 1.7e-3 at K=4096); on, never. Promoted, the
gated GEMM is slower on Hopper than cuBLAS + the gated quantiser (H200, 2816 rows, with the row quantiser after it:
94.9 against 68.5 us), so there it runs only with the fast accumulation (`gated_supported`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.ops.platform import HAVE_TRITON
from engine.options import current

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from engine.ops.gated_gemm import grouped_tile
    from engine.ops.silu_mul import silu_mul_math

    @triton.jit
    def _scaled_epilogue(acc, xs_ptr, ws_ptr, m, w_cols, rows, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         GATED: tl.constexpr, dtype: tl.constexpr):
        # acc (BLOCK_M, W_COLS) fp32 times each row's and each weight row's scale; gated: the interleaved halves
        # rounded to the dtype, then SiLU(gate) * up.
        acc = acc * tl.load(xs_ptr + m, mask=m < rows, other=0.0)[:, None] * tl.load(ws_ptr + w_cols)[None, :]
        if GATED:  # a constexpr branch: the one return sees only the taken side's shape
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
            y = silu_mul_math(gate.to(dtype).to(tl.float32), up.to(dtype))
        else:
            y = acc.to(dtype)
        return y

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr, rows, n, stride_x, stride_o, K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         GATED: tl.constexpr, W_COLS: tl.constexpr, IMPRECISE: tl.constexpr):
        # Output tile (BLOCK_M rows, BLOCK_N columns) from W_COLS weight rows (2 * BLOCK_N when gated); IMPRECISE:
        # products a dot accumulates before promoting them to fp32 (None: the backend's default; sm90: never).
        tile_m, tile_n = grouped_tile(tl.program_id(0), rows, n, BLOCK_M, BLOCK_N, GROUP_M)
        m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + (m % rows)[:, None].to(tl.int64) * stride_x + kk[None, :]  # extra rows repeat real ones
        w_cols = tile_n * W_COLS + tl.arange(0, W_COLS)
        w_ptrs = w_ptr + w_cols[None, :].to(tl.int64) * K + kk[:, None]
        acc = tl.zeros((BLOCK_M, W_COLS), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc, max_num_imprecise_acc=IMPRECISE)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y = _scaled_epilogue(acc, xs_ptr, ws_ptr, m, w_cols, rows, BLOCK_M, BLOCK_N, GATED, o_ptr.dtype.element_ty)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(o_ptr + m[:, None].to(tl.int64) * stride_o + cols[None, :], y, mask=m[:, None] < rows)

    @triton.jit
    def _fp8_gemm_persistent_kernel(x_desc, xs_ptr, w_desc, ws_ptr, o_desc, rows, n, tiles, K: tl.constexpr,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                    GROUP_M: tl.constexpr, GATED: tl.constexpr, W_COLS: tl.constexpr,
                                    IMPRECISE: tl.constexpr, PROGRAMS: tl.constexpr):
        # `_fp8_gemm_kernel`'s tiles, every PROGRAMS-th to a program, through tensor descriptors (TMA: rows past the
        # end read as zeros and are not written).
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
            tile_m, tile_n = grouped_tile(tile, rows, n, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tl.zeros((BLOCK_M, W_COLS), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                acc = tl.dot(x_desc.load([tile_m * BLOCK_M, k]), w_desc.load([tile_n * W_COLS, k]).T, acc,
                             max_num_imprecise_acc=IMPRECISE)
            m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
            w_cols = tile_n * W_COLS + tl.arange(0, W_COLS)
            o_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N],
                         _scaled_epilogue(acc, xs_ptr, ws_ptr, m, w_cols, rows, BLOCK_M, BLOCK_N, GATED, o_desc.dtype))


# (BLOCK_M, BLOCK_N output columns, BLOCK_K, stages, warps, GROUP_M, persistent)
Fp8Tiles = tuple[int, int, int, int, int, int, bool]
DEFAULT_TILES: Fp8Tiles = (128, 128, 128, 4, 8, 8, False)
# The gated GEMM's tiles: the fastest swept on an H200 at the DiT's 1408-5632 rows (`bench.py kernels --only fp8`).
# With the row quantiser after it and its partial sums never promoted 33.5 / 63.1 / 119.8 us, against cuBLAS with the
# fast accumulation + the gated quantiser's 34.7 / 61.4 / 120.9.
GATED_TILES: Fp8Tiles = (128, 128, 128, 4, 8, 8, True)
# Up to FEW_ROWS rows (the LMs' decode at B <= 192, the DiT's at B <= 8), narrow tiles: every SM streams its share of
# the weight. H200, gate/up with the product not quantised: the LM's (K=2048) at 64 / 128 rows 11.1 / 11.8 us against
# GATED_TILES' 16.0 / 16.2 and bf16 cuBLAS + silu_mul's 18.1 / 19.2, the DiT's (K=1024) at 176 rows 7.5 against 11.1
# and bf16's 10.0; GATED_TILES the faster at the LM's 256 rows (16.5 against 19.6), the DiT's 352 (11.4 against 12.9).
FEW_ROWS = 192
FEW_ROWS_GATED_TILES: Fp8Tiles = (64, 32, 128, 4, 4, 8, False)


def gated_supported(device: torch.device, k_dim: int, w_rows: int) -> bool:
    """Whether the gated GEMM at GATED_TILES runs for a fused gate/up weight (2I, K) on `device`: Triton, a data-centre
    GPU with tensor descriptors and the ~200 KB of shared memory its four stages take (compute capability 9 or 10:
    Hopper, Blackwell; not the consumer sm120's ~100 KB), on Hopper only with EngineOptions.fp8_fast_accum (its
    partial sums promoted, the kernel is slower there than cuBLAS + the gated quantiser), the tiles dividing the
    weight."""
    if not (HAVE_TRITON and device.type == "cuda"):
        return False
    major = torch.cuda.get_device_capability(device)[0]
    return (major == 10 or (major == 9 and current().fp8_fast_accum)) and tiles_fit(k_dim, w_rows, GATED_TILES, True)


def tiles_fit(k_dim: int, w_rows: int, tiles: Fp8Tiles, gated: bool) -> bool:
    """Whether `tiles` divide the weight: its rows (by BLOCK_N, twice that gated) and K (by BLOCK_K)."""
    return w_rows % (tiles[1] * (2 if gated else 1)) == 0 and k_dim % tiles[2] == 0


def fp8_matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype, tiles: Fp8Tiles = DEFAULT_TILES, gated: bool = False,
               programs: int | None = None) -> torch.Tensor:
    """(M, K) e4m3 rows times the (N, K) e4m3 weight's transpose (contiguous), each side's rows scaled (x_scale (M, 1),
    w_scale (1, N)), out (M, N) in out_dtype; `gated`: the weight's rows (gate_i, up_i) pairs, out silu(gate) * up,
    (M, N / 2). Persistent tiles: `programs` programs (None: one per SM, at most one per tile). With
    EngineOptions.fp8_fast_accum the partial sums are never promoted to fp32 on Hopper, else every BLOCK_K products."""
    block_m, block_n, block_k, stages, warps, group, persistent = tiles
    rows, k_dim = x_fp8.shape
    if (not tiles_fit(k_dim, w_fp8.shape[0], tiles, gated) or w_fp8.shape[1] != k_dim or not w_fp8.is_contiguous()
            or not w_scale.is_contiguous() or not x_scale.is_contiguous()):
        raise ValueError(f"fp8_matmul: tiles {tiles} (gated={gated}) do not divide the weight {tuple(w_fp8.shape)} "
                         f"for x {tuple(x_fp8.shape)}, or an operand is not contiguous")
    w_cols = 2 * block_n if gated else block_n
    n = w_fp8.shape[0] // (2 if gated else 1)
    if x_fp8.stride(-1) != 1:
        x_fp8 = x_fp8.contiguous()
    out = torch.empty((rows, n), dtype=out_dtype, device=x_fp8.device)
    if not rows:
        return out
    tile_count = triton.cdiv(rows, block_m) * (n // block_n)
    common = dict(K=k_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group, GATED=gated,
                  W_COLS=w_cols, IMPRECISE=None if current().fp8_fast_accum else block_k, num_stages=stages,
                  num_warps=warps)
    if persistent:
        from triton.tools.tensor_descriptor import TensorDescriptor

        programs = min(programs or torch.cuda.get_device_properties(x_fp8.device).multi_processor_count, tile_count)
        _fp8_gemm_persistent_kernel[(programs,)](
            TensorDescriptor.from_tensor(x_fp8.contiguous(), [block_m, block_k]), x_scale,
            TensorDescriptor.from_tensor(w_fp8, [w_cols, block_k]), w_scale,
            TensorDescriptor.from_tensor(out, [block_m, block_n]), rows, n, tile_count, PROGRAMS=programs, **common)
    else:
        _fp8_gemm_kernel[(tile_count,)](x_fp8, x_scale, w_fp8, w_scale, out, rows, n, x_fp8.stride(0),
                                        out.stride(0), **common)
    return out
