"""Attention backends on the CPU: backend selection, and the flash-attn prefill path's wiring (cu_seqlens,
layout) checked against the torch path through a stand-in `flash_attn` module written here (flash-attn
itself needs CUDA). The Triton kernel has its own tests (test_ops_paged_attention.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from engine.runner.attention import AttentionMetadata, PagedKVCache, flash_prefill_attention, select_backend


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, **_):
    """flash_attn_varlen_func semantics on SDPA: packed (T, H, D) sequences, causal per sequence."""
    assert causal and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        qi, ki, vi = (t[a:b].transpose(0, 1) for t in (q, k, v))
        assert b - a <= max_q
        out.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True).transpose(0, 1))
    return torch.cat(out)


def test_flash_prefill_matches_torch_prefill(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_varlen_reference))
    torch.manual_seed(0)
    lens, heads, kv_heads, dim, block = [5, 1, 12], 8, 2, 16, 4
    t = sum(lens)
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    cache = PagedKVCache(1, 8, block, kv_heads, dim, torch.float32, "cpu")
    tables = [[0, 1], [2], [3, 4, 5]]
    slots, rows, positions = [], [], []
    for i, n in enumerate(lens):
        slots += [tables[i][j // block] * block + j % block for j in range(n)]
        rows += [i] * n
        positions += range(n)
    width = max(map(len, tables))
    meta = AttentionMetadata(True, torch.tensor(slots), torch.tensor([r + [0] * (width - len(r)) for r in tables],
                                                                     dtype=torch.int32),
                             torch.tensor(rows, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32) + 1,
                             query_lens=lens, key_lens=lens)
    expected = cache.attend_fn(meta)(0, q, k, v)  # torch backend
    got = flash_prefill_attention(q, k, v, meta)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_backend_selection_on_cpu():
    cpu = torch.device("cpu")
    assert select_backend(cpu, torch.float32) == "torch"
    assert select_backend(cpu, torch.bfloat16, "torch") == "torch"
    with pytest.raises(ValueError, match="not usable here"):
        select_backend(cpu, torch.bfloat16, "triton")
    with pytest.raises(ValueError, match="must be one of"):
        select_backend(cpu, torch.bfloat16, "xformers")
