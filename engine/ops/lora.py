"""The LoRA term of a projection for a batch whose rows use different adapters, or none.

Every resident adapter of a layer sits in one stacked pair: `a` (S * r, in) holds slot s's A in rows s*r..s*r+r
(ranks below r padded with zero rows), `b` (out, S * r) its B times alpha / r in the same columns. A row's mask
(S * r,) is 1.0 on its slot's columns and 0.0 elsewhere (a row without an adapter: all zeros), so

    delta = ((x a^T) * mask) b^T

is each row's own x A^T B^T * alpha / r, with fixed shapes whatever the mix of adapters: a CUDA graph captured once
serves every batch. That is the eager expression (the CPU's path).

On the kernel path a step applies ~290 terms (q/k/v as one term), and four or five small kernels per term (shrink,
mask, expand, add, a cast) were most of what runtime adapters cost. A few rows (a decode step of one or two requests)
take one kernel per term (`_lora_kernel`): each leading row's own slot only, shrink and expand in one launch, added
into the projection's output in place. More rows take two: the shrink as one GEMM over every slot, then
`_lora_expand_kernel`, which masks each row's slot, expands and adds in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.ops import platform
from engine.ops.platform import HAVE_TRITON
from engine.options import current

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

# Leading rows (requests' rows: the LM's, the DiT's CFG halves) up to which the term is one kernel. The kernel reads
# each row's slot weights once per output tile: cheap for a few rows, many reads of the same weights for a batch
# (which the two GEMMs over the stacked slots read once).
KERNEL_MAX_LEAD = 4
KERNEL_MAX_INNER = 64  # rows per leading row (the DiT's tokens of a patch)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _shrink(x, a_ptr, a_rows, k, mask, in_features, t, DOT_PRECISION: tl.constexpr):
        # t += x (I, K) @ A_s^T tile (K, R): A's rows `a_rows` at columns k
        a = tl.load(a_ptr + a_rows[None, :] * in_features + k[:, None], mask=mask, other=0.0)
        return tl.dot(x, a, t, input_precision=DOT_PRECISION)

    @triton.jit
    def _expand(t, b_ptr, b_cols, cols, mask, width, DOT_PRECISION: tl.constexpr):
        # t (I, R), rounded to the weights' dtype as the eager shrink's output is, @ B_s^T tile (R, N)
        bt = tl.load(b_ptr + cols[None, :] * width + b_cols[:, None], mask=mask, other=0.0)
        return tl.dot(t.to(bt.dtype), bt, input_precision=DOT_PRECISION)

    @triton.jit
    def _lora_kernel(x_ptr, slot_ptr, a_ptr, b_ptr, out_ptr, inner, in_features, out_features, q_end, k_end,
                     stride_x, stride_out, group_columns, RANK: tl.constexpr, GROUPS: tl.constexpr,
                     BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
        # One leading row (its `inner` rows of x share its slot) and BLOCK_N output columns. GROUPS = 3: q, k and v
        # as one term, A stacked (group g's slots at rows g * group_columns), B block-diagonal: output columns below
        # q_end take group 0's t, below k_end group 1's, the rest group 2's. The slot count (group_columns / RANK) is
        # a runtime value so that one compiled variant (one kernel manifest) serves every max_loras of a rank.
        lead = tl.program_id(0)
        slot = tl.load(slot_ptr + lead)
        if slot >= 0:
            i = tl.arange(0, BLOCK_I)
            rows = (lead * inner + i).to(tl.int64)
            imask = i < inner
            r = tl.arange(0, BLOCK_R)
            rmask = r < RANK
            own = slot * RANK + r  # the slot's rows of A (group 0), its columns of B
            ks = tl.arange(0, BLOCK_K)
            t0 = tl.zeros((BLOCK_I, BLOCK_R), dtype=tl.float32)
            t1 = tl.zeros((BLOCK_I, BLOCK_R), dtype=tl.float32)
            t2 = tl.zeros((BLOCK_I, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, in_features, BLOCK_K):
                k = k0 + ks
                kmask = k < in_features
                x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=imask[:, None] & kmask[None, :],
                            other=0.0)
                amask = kmask[:, None] & rmask[None, :]
                t0 = _shrink(x, a_ptr, own, k, amask, in_features, t0, DOT_PRECISION)
                if GROUPS == 3:
                    t1 = _shrink(x, a_ptr, own + group_columns, k, amask, in_features, t1, DOT_PRECISION)
                    t2 = _shrink(x, a_ptr, own + 2 * group_columns, k, amask, in_features, t2, DOT_PRECISION)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < out_features
            width = GROUPS * group_columns
            delta = _expand(t0, b_ptr, own, cols, rmask[:, None] & (cmask & (cols < q_end))[None, :], width,
                            DOT_PRECISION)
            if GROUPS == 3:
                in_k = cmask & (cols >= q_end) & (cols < k_end)
                delta += _expand(t1, b_ptr, own + group_columns, cols, rmask[:, None] & in_k[None, :], width,
                                 DOT_PRECISION)
                in_v = cmask & (cols >= k_end)
                delta += _expand(t2, b_ptr, own + 2 * group_columns, cols, rmask[:, None] & in_v[None, :], width,
                                 DOT_PRECISION)
            ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
            omask = imask[:, None] & cmask[None, :]
            o = tl.load(ptrs, mask=omask, other=0.0)
            tl.store(ptrs, (o.to(tl.float32) + delta).to(o.dtype), mask=omask)


    @triton.jit
    def _lora_expand_kernel(t_ptr, slot_ptr, b_ptr, out_ptr, rows, inner, width, out_features, q_end, k_end,
                            stride_out, group_columns, RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # out (rows, N) += (t masked to each row's slot) @ b^T for BLOCK_M rows and BLOCK_N columns: t = x a^T
        # (rows, width), width = groups * group_columns, slot s's columns of group g at g * group_columns + s * RANK.
        # Row r's slot is its leading row's, r // inner. q/k/v as one term (b block-diagonal): output columns below
        # q_end read group 0's columns of t only, below k_end group 1's, the rest group 2's. One slot's columns a
        # dot, so that a row's mask is constant along them (vector loads) whatever the slot count, a runtime value
        # (one compiled variant, one kernel manifest, serves every max_loras of a rank).
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < rows
        slot = tl.load(slot_ptr + m // inner, mask=mmask, other=-1)
        m64 = m.to(tl.int64)
        first = tl.program_id(1) * BLOCK_N
        cols = first + tl.arange(0, BLOCK_N)
        cmask = cols < out_features
        last = tl.minimum(first + BLOCK_N, out_features) - 1
        group_lo = (first >= q_end).to(tl.int32) + (first >= k_end).to(tl.int32)
        group_hi = (last >= q_end).to(tl.int32) + (last >= k_end).to(tl.int32)
        r = tl.arange(0, BLOCK_R)
        rmask = r < RANK
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(group_lo, group_hi + 1):
            for s in range(0, group_columns // RANK):
                own = mmask & (slot == s)
                k = g * group_columns + s * RANK + r
                t = tl.load(t_ptr + m64[:, None] * width + k[None, :], mask=own[:, None] & rmask[None, :], other=0.0)
                bt = tl.load(b_ptr + cols[None, :].to(tl.int64) * width + k[:, None],
                             mask=rmask[:, None] & cmask[None, :], other=0.0)
                acc = tl.dot(t, bt, acc, input_precision=DOT_PRECISION)
        ptrs = out_ptr + m64[:, None] * stride_out + cols[None, :]
        omask = mmask[:, None] & cmask[None, :]
        o = tl.load(ptrs, mask=omask, other=0.0)
        tl.store(ptrs, (o.to(tl.float32) + acc).to(o.dtype), mask=omask)


def slot_mask(slots: torch.Tensor, column_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N,) slot per row (-1: no adapter) -> (N, S * r) mask, given each column's slot `column_slots` (S * r,)."""
    return (column_slots[None, :] == slots[:, None]).to(dtype)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x (N, ..., in) -> (N, ..., out): each leading row's adapter term; mask (N, S * r) per leading row. `a` may
    stack several layers' slots (G * S * r rows: q, k and v): the mask then applies to each group."""
    linear = torch.nn.functional.linear
    t = linear(x, a)
    groups, columns = t.shape[-1] // mask.shape[1], mask.shape[1]
    masked = t.view(*t.shape[:-1], groups, columns) * mask.view(mask.shape[0], *([1] * (x.dim() - 1)), columns)
    return linear(masked.view(t.shape), b)


def _inner_rows(x: torch.Tensor) -> int:
    """Rows of x per leading row (x (N, ..., in))."""
    return x.numel() // (x.shape[0] * x.shape[-1])


def kernel_fits(x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor | None) -> bool:
    """Whether `add_lora_kernel` serves this term: the kernel path, a few leading rows, x and out row-major."""
    if not expand_fits(x, out, slots) or not 0 < x.shape[0] <= KERNEL_MAX_LEAD:
        return False
    return _inner_rows(x) <= KERNEL_MAX_INNER and x.is_contiguous()


def expand_fits(x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor | None) -> bool:
    """Whether `add_lora_expand` serves this term: the kernel path (and `EngineOptions.lora_kernel`), out
    row-major."""
    return (slots is not None and platform.kernels(x) and current().lora_kernel and x.dim() >= 2
            and out.is_contiguous() and x.numel() > 0)


def _rank_tile(rank: int) -> int:
    """The kernels' tile over a slot's `rank` columns (a dot's K or N: at least 16)."""
    return max(16, triton.next_power_of_2(rank))


def add_lora_kernel(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    rank: int, group_ends: tuple[int, int] | None = None) -> torch.Tensor:
    """out (x's leading shape, out) += each leading row's term, in place, by `_lora_kernel`: slots (N,) per leading
    row (-1: none), `rank` the slots' width (max_lora_rank); group_ends (q_end, k_end): a and b stack q, k and v
    (`add_lora_qkv`). out may be fp32 (a split-K partial)."""
    n_lead, in_features, out_features = x.shape[0], x.shape[-1], out.shape[-1]
    inner = _inner_rows(x)
    groups = 1 if group_ends is None else 3
    q_end, k_end = group_ends or (out_features, out_features)
    block_n = 64
    _lora_kernel[(n_lead, triton.cdiv(out_features, block_n))](
        x, slots, a, b, out, inner, in_features, out_features, q_end, k_end, in_features, out_features,
        a.shape[0] // groups, RANK=rank, GROUPS=groups,
        BLOCK_I=max(16, triton.next_power_of_2(inner)), BLOCK_R=_rank_tile(rank),
        # Wide K tiles: a program walks all of `in` alone, so few long loads in flight beat many short round trips.
        BLOCK_K=min(256, max(16, triton.next_power_of_2(in_features))), BLOCK_N=block_n,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=8)
    return out


def add_lora_expand(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    rank: int, slot_columns: int, group_ends: tuple[int, int] | None = None) -> torch.Tensor:
    """out (x's leading shape, out) += each leading row's term, in place: the shrink over every slot as one GEMM,
    then `_lora_expand_kernel` (mask, expand, add). slots (N,) per leading row (-1: none), `slot_columns` the
    columns of every slot (S * r); group_ends (q_end, k_end): a and b stack q, k and v (3 * S * r rows of a, b
    block-diagonal, `add_lora_qkv`). out may be fp32 (a split-K partial)."""
    t = torch.nn.functional.linear(x, a)  # in the weights' dtype, as the eager shrink's output
    width, out_features = t.shape[-1], out.shape[-1]
    rows = t.numel() // width
    q_end, k_end = group_ends or (out_features, out_features)
    block_m, block_n = 64, 64  # 128 x 128 past 256 rows measured the same (docs/benchmarks.md, Refuted)
    _lora_expand_kernel[(triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n))](
        t, slots, b, out, rows, _inner_rows(x), width, out_features, q_end, k_end, out_features, slot_columns,
        RANK=rank, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_rank_tile(rank),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return out


@dataclass
class LoRAContext:
    """The slot of each column of the stacked weights (`rank` columns per slot), and the rows the next layers see:
    their slots and mask (None: outside the backbone's calls, no LoRA term)."""

    column_slots: torch.Tensor
    rank: int
    mask: torch.Tensor | None = None
    slots: torch.Tensor | None = None

    def rows(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return slot_mask(slots, self.column_slots, dtype)


@dataclass
class LoRAStack:
    """One layer's slots: a (S * r, in), b (out, S * r) (B scaled by alpha / r), read through `context`'s mask."""

    a: torch.Tensor
    b: torch.Tensor
    context: LoRAContext


def add_lora(layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` (the layer's output for input x) plus each row's adapter term; out as split-K partials (S, ..., N) fp32
    takes it into its first partial. Unchanged for a layer without slots or outside a LoRA batch."""
    stack: LoRAStack | None = getattr(layer, "lora", None)
    if stack is None or stack.context.mask is None:
        return out
    ctx = stack.context
    partials = out.dim() == x.dim() + 1
    target = out[0] if partials else out  # where the term goes
    if kernel_fits(x, target, ctx.slots):
        add_lora_kernel(x, target, stack.a, stack.b, ctx.slots, ctx.rank)
        return out
    if expand_fits(x, target, ctx.slots):
        add_lora_expand(x, target, stack.a, stack.b, ctx.slots, ctx.rank, ctx.column_slots.numel())
        return out
    delta = lora_delta(x, stack.a, stack.b, ctx.mask)
    if partials:
        target += delta.float()
        return out
    return out + delta


def add_lora_qkv(attention: nn.Module, x: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """The fused q/k/v projection's output `qkv` (.., q | k | v) plus each row's q, k and v terms, as one term: the
    three layers' A stacked, their B block-diagonal (`LoRASlots` keeps each layer's slots views of these)."""
    stack: LoRAStack | None = getattr(attention, "qkv_lora", None)
    if stack is None or stack.context.mask is None:
        return qkv
    ctx = stack.context
    q_end = attention.num_heads * attention.head_dim
    ends = (q_end, q_end + attention.num_kv_heads * attention.head_dim)
    if kernel_fits(x, qkv, ctx.slots):
        return add_lora_kernel(x, qkv, stack.a, stack.b, ctx.slots, ctx.rank, ends)
    if expand_fits(x, qkv, ctx.slots):
        return add_lora_expand(x, qkv, stack.a, stack.b, ctx.slots, ctx.rank, ctx.column_slots.numel(), ends)
    return qkv + lora_delta(x, stack.a, stack.b, ctx.mask)
