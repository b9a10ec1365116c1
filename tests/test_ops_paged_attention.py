"""The Triton paged-attention kernel against a plain torch reference.

On CPU the kernel runs through Triton's interpreter. TRITON_INTERPRET=1 must be set before `triton.jit` wraps the
kernel, so those checks run in a fresh subprocess (`_interpreter_main`), which prints one JSON line per case; the
pytest side only reads them. On CUDA the kernel is compiled and checked directly, including CUDA-graph replay.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import options
from engine.ops.platform import HAVE_TRITON
from tests.conftest import interpreter_rows, patch_triton_interpreter, relative_error

REPO_ROOT = Path(__file__).resolve().parent.parent
BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # max relative error
DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        row_index: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None
                        ) -> torch.Tensor:
    """fp32 attention of every query token over cached positions 0..ctx-1 of its row; 0 where ctx == 0."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    rows, ctx = row_index.long(), context_lens.long()
    for row in rows.unique().tolist():  # all queries of one sequence at once
        idx = (rows == row).nonzero().squeeze(1)
        n = int(ctx[idx].max())
        if n == 0:
            continue
        blocks = block_tables[row, : (n + block_size - 1) // block_size].long()
        keys = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # (n, H, D)
        values = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,nhd->thn", q[idx].float(), keys) * scale
        visible = torch.arange(n, device=q.device)[None, :] < ctx[idx][:, None]  # (tq, n)
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1).nan_to_num(0.0)
        out[idx] = torch.einsum("thn,nhd->thd", probs, values)
    return out


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    row_index: torch.Tensor
    context_lens: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.row_index, self.context_lens


def make_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, lens: list[int], mode: str,
              dtype: torch.dtype, device: str = "cpu", seed: int = 0, num_padding_rows: int = 0) -> Case:
    """Random cache with shuffled physical blocks; queries per `mode`.

    decode: one query per sequence (context = length), rows in reverse order to exercise row_index.
    prefill: every position p of every sequence (context = p + 1).
    prefix: only the last 3 positions of each sequence are queries; the rest is a cached prefix.
    num_padding_rows: extra query rows with context 0 (as in a padded captured batch); their output must be 0.
    Cache slots no query may read (sequence tails, spare blocks) hold NaN, and unused table entries are -1.
    """
    g = torch.Generator().manual_seed(seed)
    needed = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(needed) + 3
    physical = torch.randperm(num_blocks, generator=g)
    block_tables = torch.full((len(lens), max(needed) + 2), -1, dtype=torch.int32)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)  # slots holding a sequence's token
    used = 0
    for i, n in enumerate(lens):
        blocks = physical[used:used + needed[i]]
        used += needed[i]
        block_tables[i, : needed[i]] = blocks.int()
        written[blocks] = (torch.arange(needed[i] * block_size) < n).view(needed[i], block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).masked_fill(~written[:, :, None, None], float("nan"))
    v_cache = torch.randn(shape, generator=g).masked_fill(~written[:, :, None, None], float("nan"))

    if mode == "decode":
        rows = list(range(len(lens)))[::-1]
        ctx = [lens[r] for r in rows]
    elif mode == "prefill":
        rows = [i for i, n in enumerate(lens) for _ in range(n)]
        ctx = [p + 1 for n in lens for p in range(n)]
    elif mode == "prefix":
        rows = [i for i, n in enumerate(lens) for _ in range(max(0, n - 3), n)]
        ctx = [p + 1 for n in lens for p in range(max(0, n - 3), n)]
    else:
        raise ValueError(mode)
    rows += [0] * num_padding_rows
    ctx += [0] * num_padding_rows

    # q as a view of a wider fused projection: the token stride is not num_heads * head_dim
    q = torch.randn(len(rows), num_heads + 2 * num_kv_heads, head_dim, generator=g)[:, :num_heads]
    return Case(q=q.to(device=device, dtype=dtype), k_cache=k_cache.to(device=device, dtype=dtype),
                v_cache=v_cache.to(device=device, dtype=dtype), block_tables=block_tables.to(device),
                row_index=torch.tensor(rows, dtype=torch.int32, device=device),
                context_lens=torch.tensor(ctx, dtype=torch.int32, device=device))


# ---------------------------------------------------------------------------------------------------------------
# Interpreter checks (CPU), run in a subprocess

INTERPRETER_CONFIGS = [(4, 4, 32, 16), (8, 2, 64, 16), (16, 2, 128, 32)]  # (heads, kv_heads, head_dim, block_size)
# 150 > the default tiles (64 keys fp32, 128 keys 16-bit), so decode and prefix queries cross tiles; prefill (every
# position a query, the costly mode in the interpreter) stays within one default tile and crosses tiles in the
# "tile16" cases (16-key tiles: whole 16-slot blocks, or half of a 32-slot block).
INTERPRETER_LENS = {"decode": [1, 17, 40, 150], "prefix": [1, 17, 40, 150], "prefill": [1, 17, 40]}
# Each (configuration, mode) in one dtype, alternating: every mode and configuration meets both (CUDA: every dtype).
INTERPRETER_CASES = [
    f"{('fp32', 'bf16')[i % 2]}-h{h}-kv{kv}-d{d}-bs{bs}-{mode}"
    for i, ((h, kv, d, bs), mode) in enumerate(itertools.product(INTERPRETER_CONFIGS, ("decode", "prefill", "prefix")))
] + ["fp16-h8-kv2-d64-bs16-decode", "fp32-h8-kv2-d64-bs16-decode-tile16", "bf16-h8-kv2-d64-bs16-prefill-tile16",
      "fp32-h16-kv2-d128-bs32-prefill-tile16"]


# decode_attention: the new token's rotary embedding and K/V cache write inside the split kernel
FUSED_CASES = ["fp32-h8-kv2-d64-bs16-rope", "bf16-h16-kv2-d128-bs16-rope", "bf16-h8-kv2-d64-bs16-norope"]


def rotate_half_ref(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) * cos + rotate_half(x) * sin in fp32 (rope (T, 2, D)), rounded to x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * rope[:, None, 0] + rotated * rope[:, None, 1]).to(x.dtype)


@dataclass
class FusedInputs:
    """A decode step for `decode_attention` (args in its order) and what it must produce."""
    args: tuple  # q, new_k, new_v, rope, k_cache, v_cache, slots, block_tables, row_index, context_lens
    ref: torch.Tensor  # attention output of the real rows (rotate, store, then the reference)
    k_new: torch.Tensor  # the rotated new k of every row (the real ones first)
    rows: int  # real rows (2 padding rows follow)

    def to(self, device: str) -> FusedInputs:
        return FusedInputs(tuple(x.to(device) if x is not None else None for x in self.args), self.ref, self.k_new,
                           self.rows)


def fused_decode_inputs(name: str, seed: int, lens: list[int] | None = None) -> FusedInputs:
    """A decode case (CPU) whose new tokens' cache slots hold NaN (so the kernel must write them); padding rows as the
    runner makes them (context 1, the scratch slot at the end of the cache)."""
    dtype_name, h, kv, d, bs, rope_kind = name.split("-")
    dtype, (h, kv, d, bs) = DTYPE_NAMES[dtype_name], (int(h[1:]), int(kv[2:]), int(d[1:]), int(bs[2:]))
    case = make_case(h, kv, d, bs, lens or [1, 17, 40, 150], "decode", dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    t = len(case.q)
    scratch = case.k_cache.shape[0] * bs  # one more block at the end: the padding rows' slot
    k_cache = torch.cat((case.k_cache, torch.full_like(case.k_cache[:1], float("nan"))))
    v_cache = torch.cat((case.v_cache, torch.full_like(case.v_cache[:1], float("nan"))))
    pos = case.context_lens.long() - 1
    slots = case.block_tables[case.row_index.long(), pos // bs].long() * bs + pos % bs
    row_index = torch.cat((case.row_index, torch.zeros(2, dtype=torch.int32)))
    context_lens = torch.cat((case.context_lens, torch.ones(2, dtype=torch.int32)))
    slots = torch.cat((slots, torch.full((2,), scratch)))
    q = torch.randn(t + 2, h + 2 * kv, d, generator=g).to(dtype)[:, :h]  # a view with a wider token stride
    new_k, new_v = (torch.randn(t + 2, kv, d, generator=g).to(dtype) for _ in range(2))
    angles = torch.rand(t + 2, d // 2, generator=g) * 6.3
    rope = torch.stack((angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)), dim=1) if rope_kind == "rope" else None
    k_cache.view(-1, kv, d)[slots[:t]] = float("nan")
    v_cache.view(-1, kv, d)[slots[:t]] = float("nan")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_new = rotate_half_ref(new_k, rope) if rope is not None else new_k
    k_ref.view(-1, kv, d)[slots] = k_new
    v_ref.view(-1, kv, d)[slots] = new_v
    q_ref = rotate_half_ref(q, rope) if rope is not None else q
    ref = reference_attention(q_ref[:t], k_ref, v_ref, case.block_tables, case.row_index, case.context_lens)
    return FusedInputs((q, new_k, new_v, rope, k_cache, v_cache, slots, case.block_tables, row_index, context_lens),
                       ref, k_new, t)


def fused_decode_result(inputs: FusedInputs, out: torch.Tensor) -> dict:
    """The output and the cache slots (as they are now in inputs.args) against what they must be."""
    q, new_k, new_v, _, k_cache, v_cache, slots = (x.cpu() if x is not None else None for x in inputs.args[:7])
    t, kv, d = inputs.rows, new_k.shape[1], new_k.shape[2]
    flat_k, flat_v = k_cache.view(-1, kv, d), v_cache.view(-1, kv, d)
    return {"err": relative_error(out.cpu()[:t], inputs.ref), "dtype_ok": out.dtype == q.dtype,
            "cache_err": max(relative_error(flat_k[slots[:t]], inputs.k_new[:t]),
                             relative_error(flat_v[slots[:t]], new_v[:t])),
            "cache_finite": bool(torch.isfinite(flat_k[slots]).all() and torch.isfinite(flat_v[slots]).all())}


def fused_decode_check(name: str, decode_attention: Callable, seed: int, device: str = "cpu") -> dict:
    """decode_attention against rotating and storing first, then the reference (`fused_decode_inputs`)."""
    inputs = fused_decode_inputs(name, seed).to(device)
    out = decode_attention(*inputs.args)
    if out is None:
        return {"case": name, "error": "decode_attention did not apply"}
    return {"case": name, **fused_decode_result(inputs, out)}


def _parse_case(name: str) -> tuple[torch.dtype, tuple[int, int, int, int], str]:
    dtype, h, kv, d, bs, mode = name.split("-")[:6]
    return DTYPE_NAMES[dtype], (int(h[1:]), int(kv[2:]), int(d[1:]), int(bs[2:])), mode


def _interpreter_main(shard: int = 0, shards: int = 1) -> None:
    """Entry point of a subprocess (TRITON_INTERPRET=1): one JSON line per case of this shard's."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    patch_triton_interpreter()
    import engine.ops.paged_attention as ta

    assert ta.interpreted(), "the kernel was compiled, not interpreted"
    default_block_n = dict(ta._BLOCK_N)
    default_split = options.current().attn_split_keys
    mine = {name for i, name in enumerate([*INTERPRETER_CASES, *FUSED_CASES]) if i % shards == shard}
    for name in (n for n in INTERPRETER_CASES if n in mine):
        dtype, (h, kv, d, bs), mode = _parse_case(name)
        ta._BLOCK_N = dict.fromkeys(default_block_n, 16) if name.endswith("tile16") else default_block_n
        case = make_case(h, kv, d, bs, INTERPRETER_LENS[mode], mode, dtype, seed=zlib.crc32(name.encode()),
                         num_padding_rows=2 if mode == "decode" else 0)
        try:
            args = case.args()
            q, k_cache, _, block_tables = args[:4]
            ref = reference_attention(*args)
            result = {"case": name}
            # the keys split across programs (the default for so few rows; 16: many splits per row) and not split;
            # a setting that launches what an earlier one did (no split for a prefill's many rows) is not run again
            outs: dict[int, torch.Tensor] = {}
            for split_keys in (default_split, 16, 0):
                with options.override(attn_split_keys=split_keys):
                    launched = ta.split_keys_for(q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1])
                    if launched not in outs:
                        outs[launched] = ta.paged_attention(*args)
                    out = outs[launched]
                result[f"split{split_keys}"] = {
                    "err": relative_error(out, ref), "padding_zero": bool((out[case.context_lens == 0] == 0).all()),
                    "dtype_ok": out.dtype == dtype, "counters_zero": all(
                        bool((c == 0).all()) for c in ta._counters.values())}
        except Exception as e:  # report, and keep checking the other cases
            result = {"case": name, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(result), flush=True)
    for name in (n for n in FUSED_CASES if n in mine):
        try:
            result = fused_decode_check(name, ta.decode_attention, zlib.crc32(name.encode()))
        except Exception as e:
            result = {"case": name, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    return {r["case"]: r for r in interpreter_rows("tests.test_ops_paged_attention")}


def _interpreted(results: dict[str, dict], name: str) -> dict:
    """One case's result from the interpreter subprocess, which ran without an error."""
    result = results.get(name)
    assert result is not None, f"{name}: no result from the interpreter subprocess"
    assert "error" not in result, f"{name}: {result['error']}"
    return result


def _assert_fused(result: dict, dtype: torch.dtype, what: str) -> None:
    assert result["err"] <= BOUNDS[dtype] and result["cache_err"] <= BOUNDS[dtype], (what, result)
    assert result["cache_finite"] and result["dtype_ok"], (what, result)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not importable")
@pytest.mark.parametrize("name", INTERPRETER_CASES)
def test_interpreter_matches_reference(interpreter_results: dict[str, dict], name: str) -> None:
    result = _interpreted(interpreter_results, name)
    dtype = _parse_case(name)[0]
    runs = {k: v for k, v in result.items() if k.startswith("split")}
    assert len(runs) == 3, runs.keys()
    for how, r in runs.items():
        assert r["err"] <= BOUNDS[dtype], f"{name} {how}: max relative error {r['err']:.3e} > {BOUNDS[dtype]:.0e}"
        assert r["padding_zero"], f"{name} {how}: rows with context 0 are not 0"
        assert r["dtype_ok"], f"{name} {how}: output dtype differs from q's"
        assert r["counters_zero"], f"{name} {how}: the split rows' arrival counters were not reset"


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not importable")
@pytest.mark.parametrize("name", FUSED_CASES)
def test_interpreter_decode_attention(interpreter_results: dict[str, dict], name: str) -> None:
    """The split kernel rotating the new token and writing its K/V itself matches rotate-store-then-attend."""
    _assert_fused(_interpreted(interpreter_results, name), DTYPE_NAMES[name.split("-")[0]], name)


def test_split_applies_to_decode_sized_calls() -> None:
    """Which calls split their keys: few (token, kv head) rows and tables holding more than one split's keys."""
    if not HAVE_TRITON:
        pytest.skip("triton not importable")
    import engine.ops.paged_attention as ta

    split = options.current().attn_split_keys
    assert ta.split_keys_for(num_tokens=1, num_kv_heads=2, table_keys=1024) == split > 0
    assert ta.split_keys_for(num_tokens=32, num_kv_heads=2, table_keys=1024) == split
    assert ta.split_keys_for(num_tokens=33, num_kv_heads=2, table_keys=1024) == 0  # enough programs already
    assert ta.split_keys_for(num_tokens=1, num_kv_heads=2, table_keys=split) == 0  # one split: nothing to split
    with options.override(attn_split_keys=0):
        assert ta.split_keys_for(num_tokens=1, num_kv_heads=2, table_keys=1024) == 0  # off


def test_reference_matches_sdpa() -> None:
    """The reference itself against SDPA with a causal mask on one contiguous sequence (GQA)."""
    case = make_case(8, 2, 32, 16, [37], "prefill", torch.float32)
    ref = reference_attention(*case.args())
    keys = case.k_cache[case.block_tables[0, :3].long()].flatten(0, 1)[:37]
    values = case.v_cache[case.block_tables[0, :3].long()].flatten(0, 1)[:37]
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (case.q, keys, values))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert relative_error(ref, sdpa[0].transpose(0, 1)) < 1e-5


def test_cpu_without_interpreter_raises() -> None:
    if not HAVE_TRITON:
        pytest.skip("triton not importable")
    from engine.ops.paged_attention import paged_attention
    from engine.ops.platform import interpreted

    if interpreted():
        pytest.skip("interpreter mode: CPU tensors are allowed")
    case = make_case(4, 4, 32, 16, [5], "decode", torch.float32)
    with pytest.raises(RuntimeError, match="CUDA"):
        paged_attention(*case.args())


def test_imports_without_triton() -> None:
    """With triton unimportable (as on macOS) every op module imports, and the paged attention says why it cannot
    run (a fresh interpreter: the modules of this one were imported with triton)."""
    code = (
        "import sys, pkgutil, importlib\n"
        "sys.modules['triton'] = None\n"
        "import engine.ops\n"
        "for m in pkgutil.iter_modules(engine.ops.__path__):\n"
        "    importlib.import_module('engine.ops.' + m.name)\n"
        "from engine.ops import paged_attention, platform\n"
        "assert platform.HAVE_TRITON is False\n"
        "import torch\n"
        "q = torch.zeros(1, 4, 32)\n"
        "cache = torch.zeros(2, 16, 4, 32)\n"
        "one = torch.zeros(1, dtype=torch.int32)\n"
        "try:\n"
        "    paged_attention.paged_attention(q, cache, cache, one.view(1, 1), one, one + 1)\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e), e\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    raise SystemExit('paged_attention ran without triton')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "refused:" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------------------------
# CUDA

needs_cuda = pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")


def _cuda_lens(num_seqs: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 1001, (num_seqs,), generator=g).tolist()
    lens[:3] = [1, 16, 1000]  # edges: one token, exactly one block, the longest
    return lens


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("mode", ["decode", "decode-split", "prefill", "prefix"])
def test_cuda_matches_reference(dtype: torch.dtype, mode: str) -> None:
    """decode-split: few enough rows (12 sequences + 5 padding rows, 2 kv heads) that the keys are split."""
    import engine.ops.paged_attention as ta

    num_seqs = {"decode": 64, "decode-split": 12, "prefill": 12, "prefix": 64}[mode]  # prefill: every position a query
    mode = mode.removesuffix("-split")
    case = make_case(16, 2, 128, 16, _cuda_lens(num_seqs, seed=1), mode, dtype, device="cuda", seed=2,
                     num_padding_rows=5 if mode == "decode" else 0)
    split = ta.split_keys_for(len(case.q), 2, case.block_tables.shape[1] * 16)
    assert (split > 0) == (num_seqs == 12 and mode == "decode"), split
    paged_attention = ta.paged_attention
    out = paged_attention(*case.args())
    ref = reference_attention(*case.args())
    assert out.dtype == dtype and out.shape == case.q.shape
    err = relative_error(out, ref)
    assert err <= BOUNDS[dtype], f"{mode} {dtype}: max relative error {err:.3e} > {BOUNDS[dtype]:.0e}"
    assert (out[case.context_lens == 0] == 0).all()
    assert all(bool((c == 0).all()) for c in ta._counters.values())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", FUSED_CASES)
def test_cuda_decode_attention(name: str) -> None:
    import engine.ops.paged_attention as ta

    result = fused_decode_check(name, ta.decode_attention, zlib.crc32(name.encode()), device="cuda")
    assert "error" not in result, result
    _assert_fused(result, DTYPE_NAMES[name.split("-")[0]], name)
    assert all(bool((c == 0).all()) for c in ta._counters.values())


@pytest.mark.gpu
@needs_cuda
def test_cuda_decode_attention_repeated_and_graphed() -> None:
    """The fused split kernel launched again and again (random contexts, base-LM-like with rotary then residual-LM-like
    without, back to back), and captured in a CUDA graph replayed over new inputs: every output and new cache slot
    right and the arrival counters back at 0 after every launch (a race between the splits, or a counter left set,
    shows here, not in the interpreter, which runs the programs one after another)."""
    import engine.ops.paged_attention as ta

    g = torch.Generator().manual_seed(7)
    for i in range(12):
        lens = [200, *torch.randint(1, 400, (int(torch.randint(0, 24, (1,), generator=g)),), generator=g).tolist()]
        for name in ("bf16-h16-kv2-d128-bs16-rope", "bf16-h16-kv2-d128-bs16-norope"):
            inputs = fused_decode_inputs(name, 100 + i, lens).to("cuda")
            out = ta.decode_attention(*inputs.args)
            assert out is not None, lens
            _assert_fused(fused_decode_result(inputs, out), torch.bfloat16, f"launch {i} {name} {lens}")
            assert all(bool((c == 0).all()) for c in ta._counters.values()), (i, name)

    lens = [1, 17, 40, 150, 300, 64, 65, 129]
    static = fused_decode_inputs("bf16-h16-kv2-d128-bs16-rope", 1, lens).to("cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles, allocates the counters outside the capture
        ta.decode_attention(*static.args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.decode_attention(*static.args)
    for seed, order in ((2, lens), (3, lens[::-1]), (4, lens[3:] + lens[:3])):
        source = fused_decode_inputs("bf16-h16-kv2-d128-bs16-rope", seed, order)
        for dst, src in zip(static.args, source.args, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        _assert_fused(fused_decode_result(FusedInputs(static.args, source.ref, source.k_new, source.rows), out),
                      torch.bfloat16, f"graph replay {seed}")
        assert all(bool((c == 0).all()) for c in ta._counters.values())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_seqs", [32, 24], ids=["whole", "split"])
def test_cuda_graph_replay(dtype: torch.dtype, num_seqs: int) -> None:
    """Capture one decode step, rewrite every input in place (new queries, tables, lengths), replay, compare; 24
    sequences + 4 padding rows: the keys split (the arrival counters must come back to 0 after every replay)."""
    import engine.ops.paged_attention as ta
    paged_attention = ta.paged_attention

    first = make_case(16, 2, 128, 16, _cuda_lens(num_seqs, seed=3), "decode", dtype, device="cuda", seed=4,
                      num_padding_rows=4)
    # Same number of blocks and query rows (the graph's shapes), different lengths and block placement.
    second = make_case(16, 2, 128, 16, _cuda_lens(num_seqs, seed=3)[::-1], "decode", dtype, device="cuda", seed=5,
                       num_padding_rows=4)
    assert second.k_cache.shape == first.k_cache.shape and second.block_tables.shape == first.block_tables.shape
    static = make_case(16, 2, 128, 16, _cuda_lens(num_seqs, seed=3), "decode", dtype, device="cuda", seed=4,
                       num_padding_rows=4)
    assert (ta.split_keys_for(num_seqs + 4, 2, static.block_tables.shape[1] * 16) > 0) == (num_seqs == 24)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernel outside the capture
        paged_attention(*static.args())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(*static.args())

    for source in (first, second):
        for dst, src in zip(static.args(), source.args(), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        err = relative_error(out, reference_attention(*source.args()))
        assert err <= BOUNDS[dtype], f"graph replay {dtype}: max relative error {err:.3e} > {BOUNDS[dtype]:.0e}"
        assert all(bool((c == 0).all()) for c in ta._counters.values())
        assert (out[source.context_lens == 0] == 0).all()
