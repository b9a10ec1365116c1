"""The LoRA term of a projection for a batch whose rows use different adapters, or none.

Every resident adapter of a layer sits in one stacked pair: `a` (S * r, in) holds slot s's A in rows s*r..s*r+r
(ranks below r padded with zero rows), `b` (out, S * r) its B times alpha / r in the same columns. A row's mask
(S * r,) is 1.0 on its slot's columns and 0.0 elsewhere (a row without an adapter: all zeros), so

    delta = ((x a^T) * mask) b^T

is each row's own x A^T B^T * alpha / r, with fixed shapes whatever the mix of adapters: a CUDA graph captured once
serves every batch. Two skinny GEMMs per adapted layer; there is no fused kernel yet, so this is also the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def slot_mask(slots: torch.Tensor, column_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N,) slot per row (-1: no adapter) -> (N, S * r) mask, given each column's slot `column_slots` (S * r,)."""
    return (column_slots[None, :] == slots[:, None]).to(dtype)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x (N, ..., in) -> (N, ..., out): each leading row's adapter term; mask (N, S * r) per leading row. `a` may
    stack several layers' slots (G * S * r rows: q, k and v): the mask then applies to each group."""
    t = F.linear(x, a)
    groups, columns = t.shape[-1] // mask.shape[1], mask.shape[1]
    masked = t.view(*t.shape[:-1], groups, columns) * mask.view(mask.shape[0], *([1] * (x.dim() - 1)), columns)
    return F.linear(masked.view(t.shape), b)


@dataclass
class LoRAContext:
    """The slot of each column of the stacked weights, and the mask of the rows the next layers see (None: outside
    the backbone's calls, no LoRA term)."""

    column_slots: torch.Tensor
    mask: torch.Tensor | None = None

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
    delta = lora_delta(x, stack.a, stack.b, stack.context.mask)
    if out.dim() == x.dim() + 1:
        out[0] += delta.float()
        return out
    return out + delta


def add_lora_qkv(attention: nn.Module, x: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """The fused q/k/v projection's output `qkv` (.., q | k | v) plus each row's q, k and v terms, as one term: the
    three layers' A stacked, their B block-diagonal (`LoRASlots` keeps each layer's slots views of these)."""
    stack: LoRAStack | None = getattr(attention, "qkv_lora", None)
    if stack is None or stack.context.mask is None:
        return qkv
    return qkv + lora_delta(x, stack.a, stack.b, stack.context.mask)

