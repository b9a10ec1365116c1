"""Causal attention over the paged KV cache, behind one interface.

A step (prefill or decode) is described by `AttentionMetadata`; `PagedKVCache.attend_fn(meta)` returns
the per-layer function the transformer calls. Today the only backend is the torch SDPA implementation
here (CPU and GPU); Triton / flash-attn backends for CUDA come with the runtime issue and will be
checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.minicpm import AttendFn


@dataclass
class AttentionMetadata:
    """Where the step's new tokens go and what each sequence attends to.

    Tokens of all sequences are flattened: sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1].
    slot_mapping gives each new token's flat cache slot (block * block_size + offset).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # (T,) int64
    block_tables: torch.Tensor  # (B, max_blocks) int32, -1 padded
    context_lens: torch.Tensor  # (B,) int32: tokens in cache after this step, per sequence
    cu_seqlens_q: torch.Tensor | None = None  # (B+1,) int32, prefill only
    query_lens: list[int] | None = None  # host copies for the torch path (prefill only)
    key_lens: list[int] | None = None


class PagedKVCache:
    """K and V for every layer of one causal stack: (layers, blocks, block_size, kv_heads, head_dim)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def attend_fn(self, meta: AttentionMetadata) -> AttendFn:
        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = self.k[layer], self.v[layer]
            store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            if meta.is_prefill:
                return torch_prefill_attention(q, k, v, k_cache, v_cache, meta)
            return torch_decode_attention(q, k_cache, v_cache, meta)

        return attend


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' K/V into their slots (slot -1 = padding token, not stored)."""
    flat_k = k_cache.view(-1, *k_cache.shape[-2:])
    flat_v = v_cache.view(-1, *v_cache.shape[-2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat_k[slot_mapping] = k
        flat_v[slot_mapping] = v
    else:
        flat_k[slot_mapping[valid]] = k[valid]
        flat_v[slot_mapping[valid]] = v[valid]


def _gather(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n cached tokens of one sequence: (n, kv_heads, head_dim)."""
    blocks = table[: (n + cache.shape[1] - 1) // cache.shape[1]].long()
    return cache[blocks].flatten(0, 1)[:n]


def torch_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix plus themselves."""
    assert meta.query_lens is not None and meta.key_lens is not None
    out, start = [], 0
    for i, (lq, lk) in enumerate(zip(meta.query_lens, meta.key_lens, strict=True)):
        qi = q[start:start + lq]
        if lk == lq:  # no cached prefix: the new tokens are all the keys
            ki, vi, mask = k[start:start + lq], v[start:start + lq], None
        else:
            ki, vi = _gather(k_cache, meta.block_tables[i], lk), _gather(v_cache, meta.block_tables[i], lk)
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (qi, ki, vi))
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        out.append(o[0].transpose(0, 1).flatten(-2))
        start += lq
    return torch.cat(out)


def torch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata) -> torch.Tensor:
    """One new token per sequence attending to its whole cache: q (B, heads, head_dim)."""
    b, bs = q.shape[0], k_cache.shape[1]
    table = meta.block_tables.long().clamp(min=0)
    keys = k_cache[table].view(b, -1, *k_cache.shape[-2:]).transpose(1, 2)
    values = v_cache[table].view(b, -1, *v_cache.shape[-2:]).transpose(1, 2)
    positions = torch.arange(table.shape[1] * bs, device=q.device)
    mask = (positions[None, :] < meta.context_lens[:, None]).view(b, 1, 1, -1)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
    return o.squeeze(2).flatten(-2)
