"""The gate/up projection with its SiLU gate as one Triton GEMM, for many rows (EngineOptions.gated_gemm_min_rows).

cuBLAS + `silu_mul` writes the (rows, 2I) gate/up output and reads it back; at the DiT's rows of a large batch that
output no longer fits in L2 (B=128: 46 MB). This GEMM keeps it in registers: its weight is a copy of the fused
[gate; up] weight with rows as (gate_i, up_i) pairs (`interleave`), so one accumulator of 2 * BLOCK_N columns holds
both halves of BLOCK_N outputs and the epilogue splits them. The copy is the weight's companion (an attribute of the
tensor, as FP8's: found by a getattr, graph-capturable), made at load for the DiT's MLPs (`attach`). The result is
rounded as cuBLAS + `silu_mul` round it (each half to the dtype, then SiLU and the product); the eager reference is
that pair. H200, bf16, K 1024, N 4096 (`bench.py kernels --only mlp`): 2816 rows 83.7 against 86.0 us, 5632 rows
151.6 against 164.5.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.ops import platform
from engine.ops.platform import HAVE_TRITON
from engine.options import current

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from engine.ops.silu_mul import silu_mul_math

    @triton.jit
    def grouped_tile(pid, rows, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Tile pid's (row tile, column tile): GROUP_M row tiles sweep the columns together (weight tiles shared in
        L2)."""
        row_tiles, col_tiles = tl.cdiv(rows, BLOCK_M), n // BLOCK_N
        first = pid // (GROUP_M * col_tiles) * GROUP_M
        size = min(row_tiles - first, GROUP_M)
        return first + (pid % (GROUP_M * col_tiles)) % size, (pid % (GROUP_M * col_tiles)) // size

    @triton.jit
    def _gated_gemm_kernel(x_ptr, w_ptr, o_ptr, rows, n, stride_x, stride_o, K: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # Output tile (BLOCK_M rows, BLOCK_N columns) of silu(x gate^T) * (x up^T) from the interleaved weight's
        # 2 * BLOCK_N rows; each thread holds both columns of a (gate, up) pair.
        tile_m, tile_n = grouped_tile(tl.program_id(0), rows, n, BLOCK_M, BLOCK_N, GROUP_M)
        m = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)) % rows  # the last tile's extra rows repeat real ones
        kk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + m[:, None].to(tl.int64) * stride_x + kk[None, :]
        w_rows = tile_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        w_ptrs = w_ptr + w_rows[None, :].to(tl.int64) * K + kk[:, None]
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        y = silu_mul_math(gate.to(o_ptr.dtype.element_ty).to(tl.float32), up.to(o_ptr.dtype.element_ty))
        out_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(o_ptr + out_m[:, None].to(tl.int64) * stride_o + cols[None, :], y, mask=out_m[:, None] < rows)

    @triton.jit
    def _gated_gemm_persistent_kernel(x_desc, w_desc, o_desc, rows, n, tiles, K: tl.constexpr, BLOCK_M: tl.constexpr,
                                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                                      PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
        # `_gated_gemm_kernel`'s tiles, PROGRAMS programs each taking every PROGRAMS-th tile, the operands read and the
        # result written through tensor descriptors (TMA: rows past the end read as zeros and are not written); with
        # WARP_SPECIALIZE the compiler gives the loads their own warps, so a tile's epilogue overlaps the next's loads.
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
            tile_m, tile_n = grouped_tile(tile, rows, n, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                acc = tl.dot(x_desc.load([tile_m * BLOCK_M, k]), w_desc.load([tile_n * 2 * BLOCK_N, k]).T, acc)
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
            dtype = o_desc.dtype
            o_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], silu_mul_math(gate.to(dtype).to(tl.float32),
                                                                             up.to(dtype)).to(dtype))


# (BLOCK_M, BLOCK_N output columns, BLOCK_K, stages, warps, GROUP_M): the fastest of the swept tiles at 1408-5632
# rows on an H200 (`bench.py kernels --only mlp`)
GatedGemmConfig = tuple[int, int, int, int, int, int]
DEFAULT_CONFIG: GatedGemmConfig = (128, 128, 64, 3, 8, 8)
INTERLEAVED_ATTR = "gate_up_interleaved"  # the companion's attribute on a fused gate/up weight


def interleave(gate_up: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """The fused [gate; up] weight (2I, K) with its rows as (gate_i, up_i) pairs: a contiguous copy, or written in
    place into `into` (contiguous, the same shape; no allocation, so a captured graph may do it)."""
    two_n, k_dim = gate_up.shape
    out = torch.empty_like(gate_up, memory_format=torch.contiguous_format) if into is None else into
    out.view(two_n // 2, 2, k_dim).copy_(gate_up.detach().view(2, two_n // 2, k_dim).transpose(0, 1))
    return out


def shape_ok(gate_up: torch.Tensor, config: GatedGemmConfig = DEFAULT_CONFIG) -> bool:
    """Whether the kernel's tiles divide the weight (I by BLOCK_N, K by BLOCK_K), in a 16-bit dtype."""
    block_n, block_k = config[1], config[2]
    return (gate_up.dim() == 2 and gate_up.dtype in (torch.bfloat16, torch.float16)
            and gate_up.shape[0] % (2 * block_n) == 0 and gate_up.shape[1] % block_k == 0)


def attach(gate_up: torch.Tensor) -> None:
    """Give a fused gate/up weight its interleaved companion (from its current values)."""
    setattr(gate_up, INTERLEAVED_ATTR, interleave(gate_up))


def companion_of(gate_up: torch.Tensor) -> torch.Tensor | None:
    return getattr(gate_up, INTERLEAVED_ATTR, None)


def companion(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor | None:
    """The interleaved weight a call silu_gate(x @ gate_up.T) runs this GEMM on: where the weight has one, the call
    has at least EngineOptions.gated_gemm_min_rows rows (0: never) and the kernels run (host-side checks only)."""
    weight = companion_of(gate_up)
    min_rows = current().gated_gemm_min_rows
    if weight is None or not min_rows or x.numel() < min_rows * x.shape[-1] or x.dtype != weight.dtype:
        return None
    return weight if platform.kernels(x) else None


def gated_gemm(x: torch.Tensor, interleaved: torch.Tensor, config: GatedGemmConfig | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T), x (..., K), for the `interleave`d weight (2I, K): (..., I) in x's dtype.
    config None: the persistent kernel at PERSISTENT where it fits (`persistent_fits`), else the tiled one at
    DEFAULT_CONFIG."""
    if config is None:
        if PERSISTENT is not None and persistent_fits(x, interleaved, PERSISTENT[0]):
            return gated_gemm_persistent(x, interleaved, *PERSISTENT)
        config = DEFAULT_CONFIG
    block_m, block_n, block_k, stages, warps, group = config
    k_dim = x.shape[-1]
    x2 = x.reshape(-1, k_dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, n = x2.shape[0], interleaved.shape[0] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        _gated_gemm_kernel[(triton.cdiv(rows, block_m) * (n // block_n),)](
            x2, interleaved, out, rows, n, x2.stride(0), out.stride(0), K=k_dim, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, GROUP_M=group, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_stages=stages, num_warps=warps)
    return out.view(*x.shape[:-1], n)


# The persistent kernel's (tiles, warp specialisation) where it runs (Hopper on); None: the tiled kernel everywhere.
PERSISTENT: tuple[GatedGemmConfig, bool] | None = ((128, 128, 64, 4, 8, 8), False)


def persistent_fits(x: torch.Tensor, interleaved: torch.Tensor, config: GatedGemmConfig) -> bool:
    """Whether `gated_gemm_persistent` takes the call: CUDA with tensor descriptors (compute capability 9 on), the
    weight's tiles as `shape_ok` wants them, 16-byte rows."""
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9 and x.dtype == interleaved.dtype
            and shape_ok(interleaved, config) and interleaved.is_contiguous() and x.shape[-1] % 8 == 0)


def gated_gemm_persistent(x: torch.Tensor, interleaved: torch.Tensor, config: GatedGemmConfig = DEFAULT_CONFIG,
                          warp_specialize: bool = True, programs: int | None = None) -> torch.Tensor:
    """`gated_gemm` as a persistent kernel over tensor descriptors (Hopper's TMA), its loads in warps of their own
    where `warp_specialize`; `programs` None: one per SM (at most one per tile)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_n, block_k, stages, warps, group = config
    k_dim = x.shape[-1]
    x2 = x.reshape(-1, k_dim).contiguous()
    rows, n = x2.shape[0], interleaved.shape[0] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        tiles = triton.cdiv(rows, block_m) * (n // block_n)
        programs = min(programs or torch.cuda.get_device_properties(x.device).multi_processor_count, tiles)
        _gated_gemm_persistent_kernel[(programs,)](
            TensorDescriptor.from_tensor(x2, [block_m, block_k]),
            TensorDescriptor.from_tensor(interleaved, [2 * block_n, block_k]),
            TensorDescriptor.from_tensor(out, [block_m, block_n]), rows, n, tiles, K=k_dim, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group, PROGRAMS=programs, WARP_SPECIALIZE=warp_specialize,
            num_stages=stages, num_warps=warps)
    return out.view(*x.shape[:-1], n)
