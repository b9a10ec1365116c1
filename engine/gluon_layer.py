"""EXPERIMENTAL, not yet run on a GPU: a local module's whole stack (LocEnc, DiT at few rows) as one persistent Gluon
kernel whose programs copy each projection's weights into shared memory two phases ahead (VOXCPM_LAYER_KERNEL=gluon;
the default stays `engine.triton_layer`).

Why: the Triton layer kernel runs a DiT layer at B=1 in ~30 us on an H100 against ~11.5 us of weight reads, because
every projection phase starts its weight stream after the grid barrier before it (Triton ties loads to the loop that
consumes them). Gluon, Triton's lower-level dialect, has explicit shared memory and cp.async groups: here each
program holds its unit of the current projection in shared memory while the next projection's unit is already on
its way (q/k/v and gate/up share one buffer, o and down the other; 192 KB, one program per SM), so HBM streams
through the barriers, the norms and the attention. `tools/bench_staged_weights.py` measures the effect on the
projection phases alone first; this kernel is what follows if it pays (docs/benchmarks.md, profile step 14).

Same phases and rounding points as `engine.triton_layer` (32-column units, split-K o and down projections summed in
split order by the next row phase), every layer of the stack in one launch (weights through a pointer table), the
final norm at the end. Needs every program resident (grid barriers) and one unit per program per projection.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from engine.triton_attention import HAVE_TRITON, _is_interpreted

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch

try:  # Gluon ships with Triton >= 3.4
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    HAVE_GLUON = HAVE_TRITON
except ImportError:  # pragma: no cover - older Triton
    HAVE_GLUON = False

BN, KC, GROUP_CHUNKS = 32, 64, 4  # unit rows (output columns), K chunk, chunks per cp.async group
SPLITS = 4  # o and down projections: K splits (units = hidden / BN * SPLITS)

if HAVE_GLUON:

    @gluon.jit
    def _sync(sync_ptr, target):
        gl.thread_barrier()
        arrived = gl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") + 1
        spins = 0
        while (arrived < target) & (spins < 4_000_000):
            arrived = gl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        if arrived < target:  # not all programs resident: fail the launch instead of running on
            gl.inline_asm_elementwise("trap;", "=r,r", [arrived], dtype=gl.int32, is_pure=False, pack=1)
        gl.thread_barrier()

    @gluon.jit
    def _release(sync_ptr, nprog):
        # after a launch's last barrier: the last program out resets the barrier counters for the next launch
        if gl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
            gl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _issue(buf, w_ptr, unit, live, UNITS: gl.constexpr, ROWS: gl.constexpr, K: gl.constexpr,
               NCH: gl.constexpr, SPLIT: gl.constexpr, GATED: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr,
               GROUP_CHUNKS: gl.constexpr, SPLITS: gl.constexpr):
        # this program's unit of a (ROWS, K) weight into buf, chunk by chunk ((BN, KC) each; gated: gate and up
        # chunks alternate), GROUP_CHUNKS to a cp.async group; without a unit (or not live) the copies are predicated
        # off and the groups still committed, so every program counts the same groups
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        r = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        c = gl.arange(0, KC, layout=gl.SliceLayout(0, layout))
        ok = (unit < UNITS) & live & (r[:, None] < BN)
        if SPLIT:
            row0 = (unit // SPLITS) * BN
            col0 = (unit % SPLITS) * (NCH * KC)
        else:
            row0 = unit * BN
            col0 = 0
        base = w_ptr + (row0 + r)[:, None].to(gl.int64) * K + col0 + c[None, :]
        for i in gl.static_range(NCH):
            if GATED:  # noqa: SIM108 (a constexpr branch) chunk i: gate rows at K chunk i // 2 (even), up (odd)
                ptrs = base + (i % 2) * (ROWS // 2) * K + (i // 2) * KC
            else:
                ptrs = base + i * KC
            async_copy.async_copy_global_to_shared(buf.index(i), ptrs, mask=ok)
            if i % GROUP_CHUNKS == GROUP_CHUNKS - 1:
                async_copy.commit_group()

    @gluon.jit
    def _project(buf, a_ptr, unit, rows, K: gl.constexpr, NCH: gl.constexpr, NEWER: gl.constexpr,
                 SPLIT: gl.constexpr, GATED: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, KC: gl.constexpr,
                 GROUP_CHUNKS: gl.constexpr, SPLITS: gl.constexpr):
        # (acc, acc_up): the unit's weight chunks in buf (BN, KC each) times the rows' activations a (rows, K), fp32
        # (BN, BM); each chunk waited for as it is needed (NEWER: cp.async groups committed after this unit's)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 2], instr_shape=[16, 8])
        dot0: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        dot1: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        a_layout: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
        kk = gl.arange(0, KC, layout=gl.SliceLayout(1, a_layout))
        m = gl.arange(0, BM, layout=gl.SliceLayout(0, a_layout))
        STEPS: gl.constexpr = NCH // 2 if GATED else NCH
        GROUPS: gl.constexpr = NCH // GROUP_CHUNKS
        col0 = (unit % SPLITS) * (STEPS * KC) if SPLIT else 0
        a_base = a_ptr + m[None, :] * K + col0 + kk[:, None]
        a_ok = m[None, :] < rows
        acc = gl.zeros([BN, BM], gl.float32, mma)
        acc_up = gl.zeros([BN, BM], gl.float32, mma)
        a_next = gl.load(a_base, mask=a_ok, other=0.0, cache_modifier=".cg")
        for s in gl.static_range(STEPS):
            a = gl.convert_layout(a_next, dot1)
            if s + 1 < STEPS:
                a_next = gl.load(a_base + (s + 1) * KC, mask=a_ok, other=0.0, cache_modifier=".cg")
            if GATED:
                async_copy.wait_group(GROUPS - 1 - (2 * s + 1) // GROUP_CHUNKS + NEWER)
                acc = mma_v2(buf.index(2 * s).load(dot0), a, acc)
                acc_up = mma_v2(buf.index(2 * s + 1).load(dot0), a, acc_up)
            else:
                async_copy.wait_group(GROUPS - 1 - s // GROUP_CHUNKS + NEWER)
                acc = mma_v2(buf.index(s).load(dot0), a, acc)
        return acc, acc_up

    @gluon.jit
    def _store_tile(out_ptr, tile, rows, row_stride, col0, BN: gl.constexpr, BM: gl.constexpr):
        # a (BN, BM) tile of outputs (columns col0.., rows m) at out_ptr[m * row_stride + col]
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        t = gl.convert_layout(tile, layout)
        c = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        m = gl.arange(0, BM, layout=gl.SliceLayout(0, layout))
        gl.store(out_ptr + m[None, :] * row_stride + col0 + c[:, None], t, mask=m[None, :] < rows)

    @gluon.jit
    def _residual_norm(x_ptr, part_ptr, w_ptr, y_ptr, rows, has_part, eps, scale, pid, nprog, H: gl.constexpr,
                       SPLITS: gl.constexpr, HAS_SCALE: gl.constexpr, BLOCK_H: gl.constexpr):
        # x += round(sum of the split partials) [* scale] in place (a row per program), y = RMSNorm(x) * w:
        # `add_rms_norm`'s op order
        layout: gl.constexpr = gl.BlockedLayout([BLOCK_H // 128], [32], [4], [0])
        cols = gl.arange(0, BLOCK_H, layout=layout)
        mask = cols < H
        for r in range(pid, rows, nprog):
            x = gl.load(x_ptr + r * H + cols, mask=mask, other=0.0, cache_modifier=".cg")
            if has_part:
                h = gl.zeros([BLOCK_H], gl.float32, layout)
                for s in gl.static_range(SPLITS):
                    h += gl.load(part_ptr + (s * rows + r) * H + cols, mask=mask, other=0.0, cache_modifier=".cg")
                h = h.to(x.dtype)
                if HAS_SCALE:
                    h = (h.to(gl.float32) * scale).to(x.dtype)
                x = (x.to(gl.float32) + h.to(gl.float32)).to(x.dtype)
                gl.store(x_ptr + r * H + cols, x, mask=mask)
            xf = x.to(gl.float32)
            y = (xf * gl.rsqrt(gl.sum(xf * xf, axis=0) / H + eps)).to(x.dtype)
            w = gl.load(w_ptr + cols, mask=mask, other=0.0)
            gl.store(y_ptr + r * H + cols, (y.to(gl.float32) * w.to(gl.float32)).to(x.dtype), mask=mask)

    @gluon.jit
    def _attention(qkv_ptr, cos_ptr, sin_ptr, o_ptr, sequences, seq_len, stride_cl, stride_sl, sm_scale, pid, nprog,
                   NQKV: gl.constexpr, HQ: gl.constexpr, GROUP: gl.constexpr, HALF: gl.constexpr,
                   BLOCK_L: gl.constexpr, ROPE: gl.constexpr):
        # one (sequence, query head) per unit: rotary on q and k (fp32, rounded), softmax(q k^T * scale) v over the
        # sequence's positions, as `engine.triton_kernels.attend_heads` does it
        D: gl.constexpr = 2 * HALF
        HK: gl.constexpr = HQ // GROUP
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
        o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
        rows = gl.arange(0, BLOCK_L, layout=gl.SliceLayout(1, ld))
        d = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))[None, :]
        rmask = rows[:, None] < seq_len
        keys = gl.arange(0, BLOCK_L, layout=gl.SliceLayout(0, s_mma))[None, :] < seq_len
        if ROPE:
            c1 = gl.load(cos_ptr + rows[:, None] * stride_cl + d, mask=rmask, other=0.0)
            c2 = gl.load(cos_ptr + rows[:, None] * stride_cl + HALF + d, mask=rmask, other=0.0)
            s1 = gl.load(sin_ptr + rows[:, None] * stride_sl + d, mask=rmask, other=0.0)
            s2 = gl.load(sin_ptr + rows[:, None] * stride_sl + HALF + d, mask=rmask, other=0.0)
        for unit in range(pid, sequences * HQ, nprog):
            n = unit // HQ
            h = unit % HQ
            base = qkv_ptr + (n * seq_len + rows[:, None]) * NQKV
            qb = base + h * D
            kb = base + HQ * D + (h // GROUP) * D
            vb = base + (HQ + HK) * D + (h // GROUP) * D
            q1 = gl.load(qb + d, mask=rmask, other=0.0, cache_modifier=".cg")
            q2 = gl.load(qb + HALF + d, mask=rmask, other=0.0, cache_modifier=".cg")
            k1 = gl.load(kb + d, mask=rmask, other=0.0, cache_modifier=".cg")
            k2 = gl.load(kb + HALF + d, mask=rmask, other=0.0, cache_modifier=".cg")
            v1 = gl.load(vb + d, mask=rmask, other=0.0, cache_modifier=".cg")
            v2 = gl.load(vb + HALF + d, mask=rmask, other=0.0, cache_modifier=".cg")
            dtype = q1.dtype
            if ROPE:
                q1f, q2f, k1f, k2f = q1.to(gl.float32), q2.to(gl.float32), k1.to(gl.float32), k2.to(gl.float32)
                q1, q2 = (q1f * c1 - q2f * s1).to(dtype), (q2f * c2 + q1f * s2).to(dtype)
                k1, k2 = (k1f * c1 - k2f * s1).to(dtype), (k2f * c2 + k1f * s2).to(dtype)
            s_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_mma, k_width=2)
            s_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=s_mma, k_width=2)
            scores = gl.zeros([BLOCK_L, BLOCK_L], gl.float32, s_mma)
            scores = mma_v2(gl.convert_layout(q1, s_a), gl.convert_layout(gl.permute(k1, [1, 0]), s_b), scores)
            scores = mma_v2(gl.convert_layout(q2, s_a), gl.convert_layout(gl.permute(k2, [1, 0]), s_b), scores)
            scores = gl.where(keys, scores * sm_scale, float("-inf"))
            p = gl.exp(scores - gl.max(scores, axis=1)[:, None])
            p = (p / gl.sum(p, axis=1)[:, None]).to(dtype)
            o_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
            o_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=o_mma, k_width=2)
            pa = gl.convert_layout(p, o_a)
            o1 = mma_v2(pa, gl.convert_layout(v1, o_b), gl.zeros([BLOCK_L, HALF], gl.float32, o_mma))
            o2 = mma_v2(pa, gl.convert_layout(v2, o_b), gl.zeros([BLOCK_L, HALF], gl.float32, o_mma))
            ob = o_ptr + (n * seq_len + rows[:, None]) * (HQ * D) + h * D
            gl.store(ob + d, gl.convert_layout(o1.to(dtype), ld), mask=rmask)
            gl.store(ob + HALF + d, gl.convert_layout(o2.to(dtype), ld), mask=rmask)

    @gluon.jit(do_not_specialize=["sequences", "layers"])
    def _stack_kernel(x_ptr, table_ptr, ref_ptr, final_norm_ptr, cos_ptr, sin_ptr, normed_ptr, qkv_ptr, attn_ptr,
                      o_part_ptr, act_ptr, down_part_ptr, y_ptr, sync_ptr, sequences, seq_len, layers, stride_cl,
                      stride_sl, eps, scale, sm_scale, H: gl.constexpr, NQKV: gl.constexpr, HQ: gl.constexpr,
                      GROUP: gl.constexpr, HALF: gl.constexpr, F: gl.constexpr, HAS_SCALE: gl.constexpr,
                      ROPE: gl.constexpr, BM: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_L: gl.constexpr,
                      BN: gl.constexpr, KC: gl.constexpr, GROUP_CHUNKS: gl.constexpr, SPLITS: gl.constexpr):
        # x (rows, H): the stack's input, updated in place as the residual stream; table (layers, 6) int64: where
        # each layer's q/k/v, o, gate/up and down weights and its two norm weights start, in elements from ref_ptr
        # (multiples of 8: 16-byte aligned, which the copies' vector width needs to know); y: the final norm's
        # output
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        rows = sequences * seq_len
        D: gl.constexpr = 2 * HALF
        smem: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        # q/k/v and gate/up in one buffer, o and down in the other
        C_QKV: gl.constexpr = H // KC
        C_O: gl.constexpr = HQ * D // SPLITS // KC
        C_GU: gl.constexpr = 2 * H // KC
        C_DOWN: gl.constexpr = F // SPLITS // KC
        G_QKV: gl.constexpr = C_QKV // GROUP_CHUNKS
        G_O: gl.constexpr = C_O // GROUP_CHUNKS
        G_GU: gl.constexpr = C_GU // GROUP_CHUNKS
        G_DOWN: gl.constexpr = C_DOWN // GROUP_CHUNKS
        U_QKV: gl.constexpr = NQKV // BN
        U_O: gl.constexpr = H // BN * SPLITS
        U_GU: gl.constexpr = F // BN
        buf_a = gl.allocate_shared_memory(gl.bfloat16, [C_GU, BN, KC], smem)
        buf_b = gl.allocate_shared_memory(gl.bfloat16, [C_DOWN, BN, KC], smem)
        qkv_w = ref_ptr + gl.multiple_of(gl.load(table_ptr + 0), 8)
        o_w = ref_ptr + gl.multiple_of(gl.load(table_ptr + 1), 8)
        _issue(buf_a, qkv_w, pid, True, U_QKV, NQKV, H, C_QKV, False, False, BN, KC, GROUP_CHUNKS, SPLITS)
        _issue(buf_b, o_w, pid, True, U_O, H, HQ * D, C_O, True, False, BN, KC, GROUP_CHUNKS, SPLITS)
        bar = 0
        for layer in range(layers):
            row = table_ptr + layer * 6
            nxt = table_ptr + ((layer + 1) % layers) * 6
            live = layer + 1 < layers  # the last layer's look-ahead copies are predicated off
            gate_up_w = ref_ptr + gl.multiple_of(gl.load(row + 2), 8)
            down_w = ref_ptr + gl.multiple_of(gl.load(row + 3), 8)
            in_norm = ref_ptr + gl.load(row + 4)
            post_norm = ref_ptr + gl.load(row + 5)
            # 0: the previous down projection added, the input norm
            _residual_norm(x_ptr, down_part_ptr, in_norm, normed_ptr, rows, layer > 0, eps, scale, pid, nprog, H,
                           SPLITS, HAS_SCALE, BLOCK_H)
            bar += 1
            _sync(sync_ptr, bar * nprog)
            # 1: q/k/v (newer groups: this layer's o)
            acc, _ = _project(buf_a, normed_ptr, pid, rows, H, C_QKV, G_O, False, False, BN, BM, KC, GROUP_CHUNKS,
                              SPLITS)
            if pid < U_QKV:
                _store_tile(qkv_ptr, acc.to(gl.bfloat16), rows, NQKV, pid * BN, BN, BM)
            gl.thread_barrier()  # every warp done with buffer a
            _issue(buf_a, gate_up_w, pid, True, U_GU, 2 * F, H, C_GU, False, True, BN, KC, GROUP_CHUNKS, SPLITS)
            bar += 1
            _sync(sync_ptr, bar * nprog)
            # 2: attention
            _attention(qkv_ptr, cos_ptr, sin_ptr, attn_ptr, sequences, seq_len, stride_cl, stride_sl, sm_scale, pid,
                       nprog, NQKV, HQ, GROUP, HALF, BLOCK_L, ROPE)
            bar += 1
            _sync(sync_ptr, bar * nprog)
            # 3: o, split along K into fp32 partials (newer groups: gate/up)
            acc, _ = _project(buf_b, attn_ptr, pid, rows, HQ * D, C_O, G_GU, True, False, BN, BM, KC, GROUP_CHUNKS,
                              SPLITS)
            if pid < U_O:
                _store_tile(o_part_ptr + (pid % SPLITS) * rows * H, acc, rows, H, (pid // SPLITS) * BN, BN, BM)
            gl.thread_barrier()
            _issue(buf_b, down_w, pid, True, U_O, H, F, C_DOWN, True, False, BN, KC, GROUP_CHUNKS, SPLITS)
            bar += 1
            _sync(sync_ptr, bar * nprog)
            # 4: the o projection added, the post-attention norm
            _residual_norm(x_ptr, o_part_ptr, post_norm, normed_ptr, rows, True, eps, scale, pid, nprog, H, SPLITS,
                           HAS_SCALE, BLOCK_H)
            bar += 1
            _sync(sync_ptr, bar * nprog)
            # 5: gate/up with the SiLU gate (newer groups: down); silu_mul's op order on the rounded halves
            acc, acc_up = _project(buf_a, normed_ptr, pid, rows, H, C_GU, G_DOWN, False, True, BN, BM, KC,
                                   GROUP_CHUNKS, SPLITS)
            if pid < U_GU:
                g = acc.to(gl.bfloat16).to(gl.float32)
                up = acc_up.to(gl.bfloat16)
                silu = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16)
                _store_tile(act_ptr, (silu.to(gl.float32) * up.to(gl.float32)).to(gl.bfloat16), rows, F, pid * BN,
                            BN, BM)
            gl.thread_barrier()
            _issue(buf_a, ref_ptr + gl.multiple_of(gl.load(nxt + 0), 8), pid, live, U_QKV, NQKV, H, C_QKV, False,
                   False, BN, KC, GROUP_CHUNKS, SPLITS)
            bar += 1
            _sync(sync_ptr, bar * nprog)
            # 6: down, split along K into fp32 partials (newer groups: the next layer's q/k/v)
            acc, _ = _project(buf_b, act_ptr, pid, rows, F, C_DOWN, G_QKV, True, False, BN, BM, KC, GROUP_CHUNKS,
                              SPLITS)
            if pid < U_O:
                _store_tile(down_part_ptr + (pid % SPLITS) * rows * H, acc, rows, H, (pid // SPLITS) * BN, BN, BM)
            gl.thread_barrier()
            _issue(buf_b, ref_ptr + gl.multiple_of(gl.load(nxt + 1), 8), pid, live, U_O, H, HQ * D, C_O, True,
                   False, BN, KC, GROUP_CHUNKS, SPLITS)
            bar += 1
            _sync(sync_ptr, bar * nprog)
        async_copy.wait_group(0)
        # the last down projection added, the stack's final norm
        _residual_norm(x_ptr, down_part_ptr, final_norm_ptr, y_ptr, rows, True, eps, scale, pid, nprog, H, SPLITS,
                       HAS_SCALE, BLOCK_H)
        _release(sync_ptr, nprog)


# per stack: (its weights' addresses, their offsets from the first q/k/v weight); rebuilt when a weight moves
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def supported(stack: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `dense_stack` takes this stack and input: CUDA (sm_90+, enough shared memory) bf16, fused projections,
    at most 32 rows, and the shapes its units cover with one unit per program (hidden 1024 and ffn 4096 for the
    released models)."""
    if not (HAVE_GLUON and x.is_cuda and not _is_interpreted() and x.dtype == torch.bfloat16 and x.dim() == 3):
        return False
    cfg, layer = stack.cfg, stack.layers[0] if len(stack.layers) else None
    if layer is None or layer.self_attn.qkv_weight is None or layer.mlp.gate_up_weight is None:
        return False
    h, f, d, hq, hk = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_attention_heads,
                       cfg.num_key_value_heads)
    nqkv = (hq + 2 * hk) * d
    props = torch.cuda.get_device_properties(x.device)
    chunk = KC * GROUP_CHUNKS
    shared = (2 * h + f // SPLITS) * BN * 2 + 16 * 1024  # the two weight buffers and the layouts' scratch
    return (torch.cuda.get_device_capability(x.device)[0] >= 9 and shared <= props.shared_memory_per_block_optin
            and x.shape[0] * x.shape[1] <= 32  # one 32-row tile (64 rows spill registers)
            and x.shape[1] <= 16 and x.shape[-1] == h and d in (64, 128) and hq % hk == 0 and h % chunk == 0
            and f % (SPLITS * chunk) == 0 and hq * d % (SPLITS * chunk) == 0 and nqkv % BN == 0 and hq * d <= f
            and max(nqkv // BN, h // BN * SPLITS, f // BN) <= props.multi_processor_count and h <= 4096
            and stack.norm.weight.dtype == layer.self_attn.qkv_weight.dtype == torch.bfloat16)


def dense_stack(stack: torch.nn.Module, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
    """stack(x) (its final norm applied) in one launch, where `supported`; rope (L, 2, head_dim) rows or None."""
    from engine import triton_layer  # the barrier counters (one launch at a time per device, stream-ordered)
    cfg, layers = stack.cfg, stack.layers
    n, seq_len, h = x.shape
    rows, dev = n * seq_len, x.device
    hq, hk, d, f = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    nqkv = (hq + 2 * hk) * d
    ref = layers[0].self_attn.qkv_weight
    weights = [(lyr.self_attn.qkv_weight, lyr.self_attn.o_proj.weight, lyr.mlp.gate_up_weight,
                lyr.mlp.down_proj.weight, lyr.input_layernorm.weight, lyr.post_attention_layernorm.weight)
               for lyr in layers]
    addresses = tuple(t.data_ptr() for row in weights for t in row)
    known, table = _tables.get(stack, (None, None))
    if known != addresses:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gluon_layer.dense_stack: the stack's first call (or moved weights) inside a capture")
        if any(t.dtype != ref.dtype or not t.is_contiguous()
               or (t.data_ptr() - ref.data_ptr()) % (16 if i < 4 else 2) for row in weights for i, t in enumerate(row)):
            raise ValueError("gluon_layer: the weights must be contiguous bf16, the projections 16-byte aligned")
        table = torch.tensor([[(t.data_ptr() - ref.data_ptr()) // ref.element_size() for t in row] for row in weights],
                             dtype=torch.int64, device=dev)
        _tables[stack] = (addresses, table)
    triton_layer.prepare(dev)
    sync = triton_layer._sync[triton_layer._device(dev)]
    xs = x.reshape(rows, h).clone(memory_format=torch.contiguous_format)  # the residual stream, updated in place

    def buffer(*shape: int, fp32: bool = False) -> torch.Tensor:
        return torch.empty(shape, device=dev, dtype=torch.float32 if fp32 else x.dtype)

    normed, y = buffer(rows, h), buffer(rows, h)
    qkv, attn, act = buffer(rows, nqkv), buffer(rows, hq * d), buffer(rows, f)
    o_part, down_part = buffer(SPLITS, rows, h, fp32=True), buffer(SPLITS, rows, h, fp32=True)
    cos, sin = (rope[:, 0, :], rope[:, 1, :]) if rope is not None else (xs, xs)
    scale = layers[0].residual_scale
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    _stack_kernel[(sms,)](
        xs, table, layers[0].self_attn.qkv_weight, stack.norm.weight, cos, sin, normed, qkv, attn, o_part, act,
        down_part, y, sync, n, seq_len, len(layers), cos.stride(0), sin.stride(0), cfg.rms_norm_eps,
        1.0 if scale is None else scale, d ** -0.5,
        H=h, NQKV=nqkv, HQ=hq, GROUP=hq // hk, HALF=d // 2, F=f, HAS_SCALE=scale is not None, ROPE=rope is not None,
        BM=32, BLOCK_H=1 << (h - 1).bit_length(), BLOCK_L=16, BN=BN, KC=KC,
        GROUP_CHUNKS=GROUP_CHUNKS, SPLITS=SPLITS, num_warps=4)
    return y.view(n, seq_len, h)
