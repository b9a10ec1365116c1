"""Batch-invariant execution on the CPU: what a request's row computes never depends on the rows beside it.

A BLAS GEMM rounds a row differently with the number of rows it is given and the row's position among them (MKL's
kernels treat the last rows of a call apart: a row of a 5-row call differs in the last bit from the same row in a
16-row call), and a convolution or an attention call may do the same with its batch. So a request's audio would
change with what else is batched and with how much of its prompt came from the prefix cache. Inside
`BatchInvariantMode` every operation that mixes rows runs as calls of one fixed shape:

- a projection (`aten.linear`) as one batched GEMM over tiles of `TILE_ROWS` rows (the last tile zero-padded):
  every tile is the same (TILE_ROWS, K) x (K, N) problem, whose rows MKL computes alike at every position;
- a convolution, a GEMM of another form and SDPA one sample (batch entry) at a time.

Everything else the engine runs is per row (element-wise, or reduced over the last dimension) already. The LMs'
attention over the paged cache is made invariant where it is computed (`runner.attention.invariant_attention`:
each token over exactly its own context). The mode is a `TorchDispatchMode`, entered around an engine step; it sees
the ops before they are decomposed, and the calls it makes run below it (not intercepted again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engine.options import current

TILE_ROWS = 8
aten = torch.ops.aten


def batch_invariant(device: torch.device) -> bool:
    """Whether steps on `device` run batch-invariantly: EngineOptions.batch_invariant, unset meaning on the CPU."""
    chosen = current().batch_invariant
    return device.type == "cpu" if chosen is None else chosen


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with every row computed in a (TILE_ROWS, K) tile of one batched GEMM."""
    k_dim, n = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, k_dim)
    count = rows.shape[0]
    tiles = -(-count // TILE_ROWS) or 1
    padded = F.pad(rows, (0, 0, 0, tiles * TILE_ROWS - count))
    out = torch.bmm(padded.view(tiles, TILE_ROWS, k_dim), weight.t().expand(tiles, k_dim, n))
    out = out.view(tiles * TILE_ROWS, n)[:count]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)


def tiled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N), both sides tiled (either may carry the batch): every output tile one
    (TILE_ROWS, K) x (K, TILE_ROWS) problem."""
    m, k_dim = a.shape
    n = b.shape[1]
    tm, tn = -(-m // TILE_ROWS) or 1, -(-n // TILE_ROWS) or 1
    a_t = F.pad(a, (0, 0, 0, tm * TILE_ROWS - m)).view(tm, 1, TILE_ROWS, k_dim).expand(tm, tn, TILE_ROWS, k_dim)
    b_t = F.pad(b, (0, tn * TILE_ROWS - n)).view(k_dim, tn, TILE_ROWS).permute(1, 0, 2)
    b_t = b_t.unsqueeze(0).expand(tm, tn, k_dim, TILE_ROWS)
    out = torch.bmm(a_t.reshape(-1, TILE_ROWS, k_dim), b_t.reshape(-1, k_dim, TILE_ROWS))
    return out.view(tm, tn, TILE_ROWS, TILE_ROWS).transpose(1, 2).reshape(tm * TILE_ROWS, tn * TILE_ROWS)[:m, :n]


def _per_sample(func: Callable[..., torch.Tensor], x: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
    """func over a batched input (N, ...) one sample at a time."""
    if x.dim() < 3 or x.shape[0] <= 1:
        return func(x, *rest, **kwargs)
    return torch.cat([func(x[i:i + 1], *rest, **kwargs) for i in range(x.shape[0])])


def _sdpa(func: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          attn_mask: torch.Tensor | None = None, *rest: Any, **kwargs: Any) -> torch.Tensor:
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
    return torch.stack([tiled_mm(a[i], b[i]) for i in range(a.shape[0])])


HANDLERS: dict[Any, Callable[..., torch.Tensor]] = {
    aten.linear.default: lambda func, x, w, b=None: tiled_linear(x, w, b),
    aten.mm.default: lambda func, a, b: tiled_mm(a, b),
    aten.addmm.default: lambda func, c, a, b, beta=1, alpha=1: beta * c + alpha * tiled_mm(a, b),
    aten.bmm.default: lambda func, a, b: _bmm(a, b),
    aten.baddbmm.default: lambda func, c, a, b, beta=1, alpha=1: beta * c + alpha * _bmm(a, b),
    aten.conv1d.default: _per_sample,
    aten.conv_transpose1d.default: _per_sample,
    aten.scaled_dot_product_attention.default: _sdpa,
}


class BatchInvariantMode(TorchDispatchMode):
    """Inside it, the CPU ops that mix rows run batch-invariantly (module docstring); ops on other devices pass."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = HANDLERS.get(func)
        if handler is None or not (isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"):
            return func(*args, **kwargs)
        return handler(func, *args, **kwargs)
