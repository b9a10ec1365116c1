"""Batch-invariant execution: what a request's row computes never depends on the rows beside it.

A GEMM library rounds a row differently with the number of rows it is given and the row's position among them (MKL
treats the last rows of a call apart: a row of a 5-row call differs in the last bit from the same row in a 16-row
call; cuBLAS picks its kernel, tiles and split-K by the shape), and a convolution or an attention call may do the
same with its batch. So a request's audio would change with what else is batched and with how much of its prompt
came from the prefix cache. Inside `BatchInvariantMode` every operation that mixes rows runs as calls of one fixed
shape:

- a projection (`aten.linear`) in tiles of a fixed number of rows (the last tile zero-padded): every tile the same
  (rows, K) x (K, N) problem, whose rows the library computes alike at every position (on the CPU one batched GEMM of
  24-row tiles, a lone tile on one thread; on CUDA one cuBLAS call per tile of `tile_rows` rows, since a batched call's
  kernel depends on the count);
- the FP8 GEMM (`aten._scaled_mm`) likewise, each tile with its rows' scales;
- another GEMM by its rows likewise (a batched one entry by entry), a convolution and SDPA one sample at a time, on
  the CPU on one thread (those kernels split a call across threads: the bytes would depend on the core count).

The rest must be per row already: element-wise ops, and reductions over the last dimension by the CPU's kernels or by
the Triton kernels that give each row its own program (torch's CUDA reductions split a row across threads by the
row count: not invariant). The engine turns off the CUDA kernels that choose by the batch
(`EngineOptions.batch_invariant_kernels`), and the LMs' attention is made invariant where it is computed
(`runner.attention`: on the CPU each token over exactly its own context; on CUDA the Triton kernel, one program per
token, without key splits). The mode is a `TorchDispatchMode`: it sees the ops before they are decomposed, and the
calls it makes run below it (not intercepted again).

The engine enters `BatchInvariantCalls` around a step and a graph capture: a `TorchFunctionMode` that gives the
engine's projections, convolutions and attention calls the handlers of their aten ops directly (`CALL_HANDLERS`), runs
the other calls that reach such an op (`ROW_MIXING_CALLS`: GEMMs) inside the dispatch mode, and every other call as
it is. A dispatch mode costs every op of an eager step ~14 us of Python, a function mode ~3 us: on the CPU, where
every step is eager, the tiny fp32 model generated ~3x slower in the dispatch mode than in none, ~1.8x in this one;
and a CPU step never enters the dispatch mode, whose first op imports torch._dynamo (~2 s of a worker's start).
`tests/test_determinism.py` checks that no row-mixing op of a step escapes the handlers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# The CPU's tile: rows MKL computes alike at every position of it. Measured on a Xeon (2026-12-01, each capability
# forced by `MKL_ENABLE_INSTRUCTIONS`): under AVX2 the last two rows of an 8-row tile (and of a 32-row one) differed in
# the last bit from the others, as if taken six at a time; under SSE4.2 the odd rows of 4- and 6-row tiles; under
# AVX-512 none. 12, 16, 24 and 48 rows were alike under all three. CUDA's: the smallest (`tile_rows`).
TILE_ROWS = {"cpu": 24, "cuda": 64}
TILE_MACS = 2**29  # CUDA: a tile of about this many multiply-adds (~1.4 us at an H100/H200's bf16 rate)
aten = torch.ops.aten


def tile_rows(device_type: str, k_dim: int, n: int) -> int:
    """Rows per tile of an (M, K) x (K, N) GEMM. On CUDA a function of the weight's shape alone (never of the batch):
    about TILE_MACS multiply-adds, a power of two from 64 to 4096, so that a small weight (the DiT's: ~1,400 rows at a
    batch of 64) takes few launches while a one-row step's tile of a large one (the LMs') still costs about what
    reading the weight does."""
    if device_type == "cpu":
        return TILE_ROWS["cpu"]
    rows = 1 << max(0, (TILE_MACS // max(1, k_dim * n)).bit_length() - 1)
    return min(4096, max(TILE_ROWS["cuda"], rows))


def _padded_rows(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, int, int]:
    """x (..., K) as (tiles * tile, K) rows, zero-padded (a fresh tensor); its row count and tile count."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    tiles = -(-count // tile) or 1
    return F.pad(rows, (0, 0, 0, tiles * tile - count)), count, tiles


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with every row computed in a (TILE_ROWS, K) tile of the same shape."""
    k_dim, n = x.shape[-1], weight.shape[0]
    tile = tile_rows(x.device.type, k_dim, n)
    padded, count, tiles = _padded_rows(x, tile)
    if x.device.type == "cpu":
        out = _cpu_tiles_bmm(padded.view(tiles, tile, k_dim), weight.t().expand(tiles, k_dim, n)).view(-1, n)
    else:
        out = torch.cat([F.linear(padded[i * tile:(i + 1) * tile], weight) for i in range(tiles)])
    out = out[:count]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)


def _cpu_tiles_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm of CPU tiles (T, tile, K) x (T, K, N), every tile's GEMM computed alike. MKL runs a batch's entries
    on a thread each, but a batch of one across its threads, splitting K under its AVX2 kernels: an (8, 256) x
    (256, 64) tile alone on 2 threads differed in the last bit from the same tile among others or on one thread
    (2026-12-01, `MKL_ENABLE_INSTRUCTIONS=AVX2` on a Xeon; never under AVX-512 or SSE4.2). So a lone tile runs on
    one thread."""
    if a.shape[0] > 1:
        return torch.bmm(a, b)
    with one_thread():
        return torch.bmm(a, b)


def tiled_scaled_mm(func: Callable[..., torch.Tensor], a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                    *rest: Any, **kwargs: Any) -> torch.Tensor:
    """The FP8 GEMM (`engine.ops.fp8`) like a projection: a's rows in zero-padded tiles of one shape, each with its
    rows' scales (padded with ones), or the tensor-wide scale as it is."""
    tile = tile_rows(a.device.type, a.shape[1], b.shape[1])
    padded, count, tiles = _padded_rows(a.view(torch.uint8), tile)  # as bytes: fp8 has no pad kernel
    padded = padded.view(a.dtype)
    # Rowwise where either side's scale is per row (one row's scale alone is a singleton too), else tensor-wise.
    scale_b = rest[0] if rest else kwargs.get("scale_b")
    rowwise = scale_a.numel() > 1 or (scale_b is not None and scale_b.numel() > 1)
    scales = F.pad(scale_a, (0, 0, 0, tiles * tile - count), value=1.0) if rowwise else None
    return torch.cat([func(padded[i * tile:(i + 1) * tile], b,
                           scale_a if scales is None else scales[i * tile:(i + 1) * tile], *rest, **kwargs)
                      for i in range(tiles)])[:count]


def tiled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N): on the CPU both sides tiled (either may carry the batch), every output tile one
    (24, K) x (K, 24) problem; on CUDA a's rows tiled as a projection's (in the engine's exact mode no CUDA GEMM carries
    the batch in its columns: the VAE upsampler's column GEMM is off there)."""
    if a.device.type != "cpu":
        return tiled_linear(a, b.t())
    tile = TILE_ROWS["cpu"]
    m, k_dim = a.shape
    n = b.shape[1]
    tm, tn = -(-m // tile) or 1, -(-n // tile) or 1
    a_t = F.pad(a, (0, 0, 0, tm * tile - m)).view(tm, 1, tile, k_dim).expand(tm, tn, tile, k_dim)
    b_t = F.pad(b, (0, tn * tile - n)).view(k_dim, tn, tile).permute(1, 0, 2)
    b_t = b_t.unsqueeze(0).expand(tm, tn, k_dim, tile)
    out = _cpu_tiles_bmm(a_t.reshape(-1, tile, k_dim), b_t.reshape(-1, k_dim, tile))
    return out.view(tm, tn, tile, tile).transpose(1, 2).reshape(tm * tile, tn * tile)[:m, :n]


@contextlib.contextmanager
def one_thread(device_type: str = "cpu") -> Iterator[None]:
    """On the CPU, torch on one thread for the block: a convolution or attention call splits its work across the
    threads, and how it rounds then depends on their count (the engine's bytes would depend on the machine's cores)."""
    threads = torch.get_num_threads()
    if device_type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _per_sample(func: Callable[..., torch.Tensor], x: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
    """func over a batched input (N, ...) one sample at a time (on the CPU on one thread)."""
    with one_thread(x.device.type):
        if x.dim() < 3 or x.shape[0] <= 1:
            return func(x, *rest, **kwargs)
        return torch.cat([func(x[i:i + 1], *rest, **kwargs) for i in range(x.shape[0])])


def _sdpa(func: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          attn_mask: torch.Tensor | None = None, *rest: Any, **kwargs: Any) -> torch.Tensor:
    with one_thread(q.device.type):
        if q.dim() < 4 or q.shape[0] <= 1:
            return func(q, k, v, attn_mask, *rest, **kwargs)
        out = []
        for i in range(q.shape[0]):
            mask = attn_mask
            if mask is not None and mask.dim() == 4 and mask.shape[0] > 1:
                mask = mask[i:i + 1]
            out.append(func(q[i:i + 1], k[i:i + 1], v[i:i + 1], mask, *rest, **kwargs))
        return torch.cat(out)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Entry by entry: on the CPU each tiled; on CUDA each a plain GEMM of the entries' one shape (a batched call's
    kernel depends on the count)."""
    if a.device.type == "cpu":
        return torch.stack([tiled_mm(a[i], b[i]) for i in range(a.shape[0])])
    return torch.stack([torch.mm(a[i], b[i]) for i in range(a.shape[0])])


def _baddbmm_(func: Callable[..., torch.Tensor], c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1,
              alpha: float = 1) -> torch.Tensor:
    """In place, entry by entry (the VAE's pointwise conv + residual on CUDA)."""
    for i in range(a.shape[0]):
        if a.device.type == "cpu":
            c[i].mul_(beta).add_(tiled_mm(a[i], b[i]), alpha=alpha)
        else:
            c[i].addmm_(a[i], b[i], beta=beta, alpha=alpha)
    return c


def _linear(func: Callable[..., torch.Tensor], input: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """aten.linear's and F.linear's handler (their parameters' names)."""
    return tiled_linear(input, weight, bias)


HANDLERS: dict[Any, Callable[..., torch.Tensor]] = {
    aten.linear.default: _linear,
    aten.mm.default: lambda func, a, b: tiled_mm(a, b),
    aten.addmm.default: lambda func, c, a, b, beta=1, alpha=1: beta * c + alpha * tiled_mm(a, b),
    aten.bmm.default: lambda func, a, b: _bmm(a, b),
    aten._scaled_mm.default: tiled_scaled_mm,
    aten.baddbmm.default: lambda func, c, a, b, beta=1, alpha=1: beta * c + alpha * _bmm(a, b),
    aten.baddbmm_.default: _baddbmm_,
    aten.conv1d.default: _per_sample,
    aten.conv_transpose1d.default: _per_sample,
    aten.scaled_dot_product_attention.default: _sdpa,
}


class BatchInvariantMode(TorchDispatchMode):
    """Inside it, the CPU and CUDA ops that mix rows run batch-invariantly (module docstring)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = HANDLERS.get(func)
        if handler is None or not (isinstance(args[0], torch.Tensor) and args[0].device.type in TILE_ROWS):
            return func(*args, **kwargs)
        return handler(func, *args, **kwargs)


# The Python calls the engine makes whose aten op is one of HANDLERS', with its handler (F.conv1d is torch.conv1d).
CALL_HANDLERS: dict[Any, Callable[..., torch.Tensor]] = {
    F.linear: _linear,
    F.conv1d: _per_sample,
    F.conv_transpose1d: _per_sample,
    F.scaled_dot_product_attention: _sdpa,
}
# The other Python calls that reach one of HANDLERS' ops (a GEMM that a matmul decomposes into, ...): they run inside
# the dispatch mode.
ROW_MIXING_CALLS: frozenset[Any] = frozenset({
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch.mm, torch.Tensor.mm, torch.addmm, torch.Tensor.addmm, torch.Tensor.addmm_,
    torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.Tensor.baddbmm_, torch._scaled_mm,
    torch.einsum, torch.tensordot,
})


class BatchInvariantCalls(TorchFunctionMode):
    """Inside it, the calls that mix rows run batch-invariantly and every other call as it is (module docstring: the
    same bytes as the dispatch mode around everything, at a fraction of its per-op cost)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = CALL_HANDLERS.get(func)
        if handler is not None:
            if isinstance(args[0], torch.Tensor) and args[0].device.type in TILE_ROWS:
                return handler(func, *args, **kwargs)
        elif func in ROW_MIXING_CALLS:
            with BatchInvariantMode():
                return func(*args, **kwargs)
        return func(*args, **kwargs)
