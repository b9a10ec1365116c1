"""Causal attention over the paged KV cache, behind one interface.

A step (prefill or decode) is described by `AttentionMetadata`; `PagedKVCache.attend_fn(meta)` returns
the per-layer function the transformer calls. Three backends, chosen once at start-up
(`select_backend`):

- "flash": flash-attn's varlen kernel for prefills without a cached prefix (its paged kernels need
  256-token pages, too coarse for reusing voice prompts), the Triton kernel for everything else;
- "triton": `engine.ops.paged_attention` for prefill and decode (CUDA);
- "torch": SDPA over gathered blocks, any device (the CPU path, and the reference the others are
  checked against).

The cache has one extra block at the end (`scratch_slot`) that absorbs the K/V writes of padding
rows, so a CUDA-graph batch bucket can be padded without branching on the host.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.engine_config import ATTENTION_BACKENDS
from engine.models.minicpm import AttendFn
from engine.ops import paged_attention as paged
from engine.ops.batch_invariant import one_thread
from engine.ops.platform import HAVE_TRITON
from engine.ops.rotary import rotary_qk, rotary_store_kv
from engine.options import batch_invariant

BACKENDS = ATTENTION_BACKENDS


@dataclass
class AttentionMetadata:
    """Where the step's new tokens go and what each of them attends to.

    Tokens of all sequences are flattened, T rows. Row t belongs to block-table row `row_index[t]`
    and sees the cached tokens 0..token_context_lens[t]-1 (itself included: K/V are stored first).
    """

    is_prefill: bool  # False: a decode step, exactly one new token per sequence (the fused decode attention's contract)
    slot_mapping: torch.Tensor  # (T,) int64 flat cache slot of each new token
    block_tables: torch.Tensor  # (B, max_blocks) int32
    row_index: torch.Tensor  # (T,) int32
    token_context_lens: torch.Tensor  # (T,) int32
    # Host copies for the torch/flash prefill paths (per sequence): new tokens and tokens after the step.
    query_lens: list[int] | None = None
    key_lens: list[int] | None = None


def select_backend(device: torch.device, dtype: torch.dtype, requested: str | None = None) -> str:
    """The best backend this process can run, or the requested one if it can run it."""
    usable = ["torch"]
    if device.type == "cuda" and HAVE_TRITON:
        usable.insert(0, "triton")
        if dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn") is not None:
            usable.insert(0, "flash")
    if requested is None:
        return usable[0]
    if requested not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {requested!r}")
    if requested not in usable:
        raise ValueError(f"attention backend {requested!r} is not usable here (usable: {usable})")
    return requested


class PagedKVCache:
    """K and V for every layer of one causal stack: (layers, blocks + 1, block_size, kv_heads, head_dim)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, backend: str = "torch") -> None:
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.scratch_slot = num_blocks * block_size
        self.backend = backend

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def attend_fn(self, meta: AttentionMetadata) -> AttendFn:
        backend = self.backend
        exact = batch_invariant(meta.slot_mapping.device.type)
        # Flash-attn for a prefill without a cached prefix only; in exact mode never (one kernel for every token).
        if backend == "flash" and (exact or not (meta.is_prefill and meta.query_lens is not None
                                                 and meta.query_lens == meta.key_lens)):
            backend = "triton"
        invariant = backend == "torch" and exact

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   rope: torch.Tensor | None = None) -> torch.Tensor:
            k_cache, v_cache = self.k[layer], self.v[layer]
            # A decode step (one new token per sequence) of few sequences: rotary and cache write inside the attention.
            if backend == "triton" and not meta.is_prefill:
                out = paged.decode_attention(q, k, v, rope, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                                             meta.row_index, meta.token_context_lens)
                if out is not None:
                    return out.flatten(-2)
            # The Triton attention reads K/V from the cache only: there rotary and cache write are one kernel.
            q_rot = rotary_store_kv(q, k, v, rope, k_cache, v_cache, meta.slot_mapping) \
                if backend == "triton" else None
            if q_rot is None:
                q, k = rotate_and_store(q, k, v, rope, k_cache, v_cache, meta.slot_mapping)
            else:
                q = q_rot
            if backend == "triton":
                return paged.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.row_index,
                                       meta.token_context_lens).flatten(-2)
            if backend == "flash":
                return flash_prefill_attention(q, k, v, meta)
            if invariant:
                return invariant_attention(q, k_cache, v_cache, meta)
            if meta.is_prefill and meta.query_lens is not None:
                return torch_prefill_attention(q, k, v, k_cache, v_cache, meta)
            return torch_paged_attention(q, k_cache, v_cache, meta)

        return attend


def rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor | None,
                     k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k (rope (T, 2, D) rows, or None), then k and v into the cache: (q, k) rotated."""
    if rope is not None:
        q, k = rotary_qk(q, k, rope[..., 0, :], rope[..., 1, :])
    store_kv(k_cache, v_cache, k, v, slot_mapping)
    return q, k


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' K/V into their slots (padding rows point at the scratch block)."""
    k_cache.view(-1, *k_cache.shape[-2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[-2:])[slot_mapping] = v


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


def torch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata) -> torch.Tensor:
    """Each query token attends to the first token_context_lens[t] cached tokens of its block-table row
    (decode: one token per sequence; also prefill shaped for a graph, without host-side lengths)."""
    b, bs = q.shape[0], k_cache.shape[1]
    table = meta.block_tables[meta.row_index.long()].long().clamp(min=0)
    keys = k_cache[table].view(b, -1, *k_cache.shape[-2:]).transpose(1, 2)
    values = v_cache[table].view(b, -1, *v_cache.shape[-2:]).transpose(1, 2)
    positions = torch.arange(table.shape[1] * bs, device=q.device)
    mask = (positions[None, :] < meta.token_context_lens[:, None]).view(b, 1, 1, -1)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
    return o.squeeze(2).flatten(-2)


def invariant_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
    """Each token's attention computed by itself over exactly its own cached context (contiguous, unpadded): a
    function of its query and those keys alone, whatever else the step holds and whether its prompt's first blocks
    came from the prefix cache (EngineOptions.batch_invariant; host-side lengths: the CPU path)."""
    rows, lens = meta.row_index.tolist(), meta.token_context_lens.tolist()
    longest: dict[int, int] = {}
    for r, n in zip(rows, lens, strict=True):
        longest[r] = max(longest.get(r, 0), n)
    context = {r: (_gather(k_cache, meta.block_tables[r], n).transpose(0, 1),
                   _gather(v_cache, meta.block_tables[r], n).transpose(0, 1)) for r, n in longest.items()}
    out = torch.empty_like(q)
    with one_thread():  # the CPU kernel splits a one-query context across its threads: their count would show
        for t, (r, n) in enumerate(zip(rows, lens, strict=True)):
            keys, values = (c[:, :n].contiguous().unsqueeze(0) for c in context[r])
            out[t] = F.scaled_dot_product_attention(q[t, :, None].unsqueeze(0), keys, values,
                                                    enable_gqa=True)[0, :, 0]
    return out.flatten(-2)


def flash_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            meta: AttentionMetadata) -> torch.Tensor:
    """flash-attn varlen causal attention over the new tokens (no cached prefix)."""
    from flash_attn import flash_attn_varlen_func

    assert meta.query_lens is not None
    lens = torch.tensor([0, *meta.query_lens], dtype=torch.int32, device=q.device)
    cu = lens.cumsum(0, dtype=torch.int32)
    longest = max(meta.query_lens)
    return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True).flatten(-2)
