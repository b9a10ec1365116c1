"""A whole decoder layer of the local modules (LocEnc, DiT) as one persistent Triton kernel, for a few rows.

Why: at B=1 a decode step runs the DiT's 12 layers 9 times (and the LocEnc's 12 once), and each layer was 8 kernels
of 2-10 us, mostly fixed latency (launch, the first DRAM round trips, the tail): 34.3 us per layer on an H100 where
its 35 MB of weights take 11.5 us at HBM rate. Here one grid (as many programs as fit on the SMs at once, up to 4 per
SM; 2 fit for the shipped variants on an H100) runs the layer's phases back to back, separated by grid-wide barriers
(an atomic counter) instead of kernel boundaries:

  0  x = x_prev + the previous layer's down projection (fp32 partials, summed and rounded here); RMSNorm(x) (rows)
  1  q/k/v projection of the normed rows                                                    (BLOCK_N-column tiles)
  2  attention with the rotary embedding                                                     ((sequence, head) pairs)
  3  o projection, split along K into fp32 partials                                                  (tiles x splits)
  4  x1 = x + o; RMSNorm(x1); x1 is the layer's residual output                                                (rows)
  5  gate/up projection with the SiLU gate                                                                     (tiles)
  6  down projection, split along K into fp32 partials, summed by the next layer's phase 0              (tiles x splits)

A stack ends with phase 0 alone under its final norm. Each program also prefetches into L2 the first weights of its
units of the next projection from the phase before it (`_prefetch`, `PREFETCH_BYTES`). Measured (H100,
docs/benchmarks.md, profile steps 12-13): 33.3 us per DiT layer at B=1 (2 programs per SM: what fits), 31.75 with the
prefetch; B=1 step 6.94 -> 6.50 ms. A barrier costs about what a kernel boundary in a CUDA graph costs; the gain is
fewer, fuller phases, and several programs per SM keeping enough weight bytes in flight.

The rounding points are the eager layer's (each projection's output rounded to the dtype after fp32 accumulation,
split partials summed in split order first, as cuBLAS's split-K does; the norms, attention and SiLU gate as in
`engine.triton_kernels`). The barriers need every program resident at once: the grid never exceeds what the compiled
variant's registers, shared memory and threads let the SMs hold together (`_programs_per_sm`), and launches of this
kernel must not overlap (one counter per device, stream-ordered: the engine runs the local modules on one stream;
kernels of other streams, like the VAE's, only delay programs, they finish on their own). Without barriers (Triton's
interpreter, which runs programs one after another, or mode "phases") each phase is its own launch of the same
kernel: same arithmetic, kernel boundaries instead of barriers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from engine import triton_kernels
from engine.triton_attention import HAVE_TRITON, _is_interpreted

if TYPE_CHECKING:
    import torch

    from engine.config import TransformerConfig
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from engine.triton_kernels import attend_heads

    @triton.jit
    def _grid_sync(sync_ptr, target, ACTIVE: tl.constexpr):
        """Every program's stores so far visible to every program once all `target` arrivals are counted (nothing
        when not ACTIVE: one launch per phase). A grid that never completes (programs not all resident) traps after
        ~seconds of spinning: the launch fails with a CUDA error (the worker restarts) instead of going on with
        another program's phase unfinished."""
        if ACTIVE:
            tl.debug_barrier()  # all threads of this program are done with the phase
            arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") + 1
            spins = 0
            while (arrived < target) & (spins < 4_000_000):
                arrived = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
                spins += 1
            if arrived < target:
                tl.inline_asm_elementwise("trap;", "=r,r", [arrived], dtype=tl.int32, is_pure=False, pack=1)
            tl.debug_barrier()

    @triton.jit
    def _prefetch(w_ptr, pid, nprog, N: tl.constexpr, K: tl.constexpr, SPLITS: tl.constexpr, GATE: tl.constexpr,
                  PF_K: tl.constexpr, BLOCK_N: tl.constexpr):
        # The first PF_K weight elements along K of each of this program's units of a coming projection (the unit
        # order of `_project`) into L2, one `prefetch` per 128-byte line: nothing held, nothing waited for. Issued
        # before a phase that leaves HBM idle (a barrier, a norm, the attention), so the projection after it starts
        # on L2 hits instead of a DRAM round trip.
        if PF_K > 0:
            LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
            KS: tl.constexpr = K // SPLITS
            rows = tl.arange(0, BLOCK_N)
            lines = tl.arange(0, 16) * LINE
            for unit in range(pid, (N // BLOCK_N) * SPLITS, nprog):
                base = w_ptr + ((unit // SPLITS) * BLOCK_N + rows)[:, None].to(tl.int64) * K + (unit % SPLITS) * KS
                for c in tl.static_range(0, PF_K, 16 * LINE):
                    ptrs = base + tl.minimum(c + lines, PF_K - LINE)[None, :]
                    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                              is_pure=False, pack=1)
                    if GATE:  # the up rows follow the gate rows
                        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs + N * K],
                                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _row_scale(ss_ptr, rows, eps, H: tl.constexpr, T: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_M: tl.constexpr):
        # rsqrt(mean of squares + eps) of each row, from the per-column-tile sums of squares ss (T, rows) that the
        # producer of the rows wrote beside them
        t = tl.arange(0, BLOCK_T)
        m = tl.arange(0, BLOCK_M)
        ss = tl.load(ss_ptr + t[:, None] * rows + m[None, :], mask=(t[:, None] < T) & (m[None, :] < rows), other=0.0,
                     cache_modifier=".cg")
        return tl.rsqrt(tl.sum(ss, axis=0) / H + eps)

    @triton.jit
    def _tile_sums(x_ptr, ss_ptr, rows, pid, nprog, H: tl.constexpr, T: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_N: tl.constexpr):
        # per row: the sums of squares of each BLOCK_N-column tile (the form in which the layers pass the residual
        # stream's norm statistics along)
        t = tl.arange(0, BLOCK_T)[:, None]
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        for r in range(pid, rows, nprog):
            xf = tl.load(x_ptr + r * H + cols, mask=t < T, other=0.0).to(tl.float32)
            tl.store(ss_ptr + tl.arange(0, BLOCK_T) * rows + r, tl.sum(xf * xf, axis=1), mask=tl.arange(0, BLOCK_T) < T)

    @triton.jit
    def _final_norm_rows(x_ptr, ss_ptr, w_ptr, y_ptr, rows, eps, pid, nprog, H: tl.constexpr, T: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        # RMSNorm of rows whose tile sums of squares are known: `add_rms_norm`'s op order
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        t = tl.arange(0, BLOCK_T)
        for r in range(pid, rows, nprog):
            ss = tl.load(ss_ptr + t * rows + r, mask=t < T, other=0.0, cache_modifier=".cg")
            xf = tl.load(x_ptr + r * H + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            y = (xf * tl.rsqrt(tl.sum(ss, axis=0) / H + eps)).to(y_ptr.dtype.element_ty)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            tl.store(y_ptr + r * H + cols, (y.to(tl.float32) * w.to(tl.float32)).to(y_ptr.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def _unit_acc(a_ptr, w_ptr, tile, split, rows, row_scale, norm_w_ptr, N: tl.constexpr, K: tl.constexpr,
                  SPLITS: tl.constexpr, SILU_GATE: tl.constexpr, NORM_A: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # a (rows, K) @ w (N [x 2 with the gate], K).T for one BLOCK_N-column tile and K split, fp32 (BLOCK_N,
        # BLOCK_M) (and the up half's): the weight tile is the dot's left operand (a few activation rows fill its
        # narrow side), streamed once from HBM. NORM_A: a is the residual stream, RMS-normed here on load (row_scale,
        # then the norm weight, each rounded: `add_rms_norm`'s op order), not read from a normed copy.
        KS: tl.constexpr = K // SPLITS
        m = tl.arange(0, BLOCK_M)
        m_ok = m < rows
        kk = tl.arange(0, BLOCK_K)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        w_ptrs = w_ptr + cols[:, None].to(tl.int64) * K + split * KS + kk[None, :]
        a_ptrs = a_ptr + m[None, :] * K + split * KS + kk[:, None]
        nw_ptrs = norm_w_ptr + split * KS + kk
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(0, KS, BLOCK_K):
            a = tl.load(a_ptrs, mask=m_ok[None, :], other=0.0, cache_modifier=".cg")
            if NORM_A:
                a = (a.to(tl.float32) * row_scale[None, :]).to(a.dtype)
                a = (a.to(tl.float32) * tl.load(nw_ptrs).to(tl.float32)[:, None]).to(a.dtype)
                nw_ptrs += BLOCK_K
            acc = tl.dot(tl.load(w_ptrs, eviction_policy="evict_first"), a, acc, input_precision=DOT_PRECISION)
            if SILU_GATE:  # the up rows follow the gate rows
                acc_up = tl.dot(tl.load(w_ptrs + N * K, eviction_policy="evict_first"), a, acc_up,
                                input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
        return acc, acc_up

    @triton.jit
    def _project(a_ptr, w_ptr, out_ptr, rows, pid, nprog, row_scale, norm_w_ptr, N: tl.constexpr, K: tl.constexpr,
                 SILU_GATE: tl.constexpr, NORM_A: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out = a @ w.T rounded to the dtype (with the SiLU gate: silu_mul's op order on the rounded halves), a unit
        # per BLOCK_N columns
        m = tl.arange(0, BLOCK_M)
        for tile in range(pid, N // BLOCK_N, nprog):
            acc, acc_up = _unit_acc(a_ptr, w_ptr, tile, 0, rows, row_scale, norm_w_ptr, N, K, 1, SILU_GATE, NORM_A,
                                    DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
            y = acc.to(out_ptr.dtype.element_ty)
            if SILU_GATE:
                g = y.to(tl.float32)
                up = acc_up.to(out_ptr.dtype.element_ty)
                s = (g / (1.0 + tl.exp(-g))).to(up.dtype)
                y = (s.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + m[None, :] * N + cols[:, None], y, mask=m[None, :] < rows)

    @triton.jit
    def _project_residual(a_ptr, w_ptr, part_ptr, x_ptr, x_out_ptr, ss_out_ptr, count_ptr, rows, scale, pid, nprog,
                          H: tl.constexpr, K: tl.constexpr, SPLITS: tl.constexpr, HAS_SCALE: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        # x_out = x + round(a @ w.T) [* scale] (the residual update) and its tile sums of squares, a unit per
        # BLOCK_N columns and K split: each unit stores its fp32 partial, and the last of a tile's SPLITS units to
        # finish (a counter per tile) sums them in split order (cuBLAS split-K's order), adds the residual and
        # resets the counter. Replaces a phase of rows (and a barrier) behind the projection.
        m = tl.arange(0, BLOCK_M)
        m_ok = m[None, :] < rows
        for unit in range(pid, (H // BLOCK_N) * SPLITS, nprog):
            tile = unit // SPLITS
            acc, _ = _unit_acc(a_ptr, w_ptr, tile, unit % SPLITS, rows, m, x_ptr, H, K, SPLITS, False, False,
                               DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(part_ptr + ((unit % SPLITS) * rows + m[None, :]) * H + cols[:, None], acc, mask=m_ok)
            tl.debug_barrier()  # every thread's partial stored before the count (released at gpu scope)
            if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                h = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    h += tl.load(part_ptr + (s * rows + m[None, :]) * H + cols[:, None], mask=m_ok, other=0.0,
                                 cache_modifier=".cg")
                x = tl.load(x_ptr + m[None, :] * H + cols[:, None], mask=m_ok, other=0.0, cache_modifier=".cg")
                h = h.to(x.dtype)  # the projection's output rounding
                if HAS_SCALE:
                    h = (h.to(tl.float32) * scale).to(x.dtype)
                x = (x.to(tl.float32) + h.to(tl.float32)).to(x.dtype)
                tl.store(x_out_ptr + m[None, :] * H + cols[:, None], x, mask=m_ok)
                xf = x.to(tl.float32)
                tl.store(ss_out_ptr + tile * rows + m, tl.sum(xf * xf, axis=0), mask=m < rows)
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _attention_tail(qkv_ptr, cos_ptr, sin_ptr, attn_ptr, head_count_ptr, group_count_ptr, tile, sequences,
                        seq_len, stride_cl, stride_sl, sm_scale, NQKV: tl.constexpr, HQ: tl.constexpr,
                        GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
                        ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # After a q/k/v tile is stored: a k or v tile counts for its kv head; the last q tile of a query head waits
        # for its kv head's k and v tiles and computes that head's attention for every sequence. Replaces the
        # attention phase (and a barrier). Needs every program of the launch resident (the k/v tiles come first in
        # the unit order, so that programs run one after another, as in the interpreter, never wait either).
        D: tl.constexpr = 2 * HALF
        PER_HEAD: tl.constexpr = D // BLOCK_N
        Q_TILES: tl.constexpr = HQ * PER_HEAD
        KV_TILES: tl.constexpr = (HQ // GROUP) * PER_HEAD  # of k (and as many of v)
        tl.debug_barrier()  # every thread's part of the tile stored before the count
        if tile >= Q_TILES:
            tl.atomic_add(group_count_ptr + ((tile - Q_TILES) % KV_TILES) // PER_HEAD, 1, sem="acq_rel",
                          scope="gpu")
        else:
            head = tile // PER_HEAD
            if tl.atomic_add(head_count_ptr + head, 1, sem="acq_rel", scope="gpu") == PER_HEAD - 1:
                group = head // GROUP
                ready = tl.atomic_add(group_count_ptr + group, 0, sem="acquire", scope="gpu")
                spins = 0
                while (ready < 2 * PER_HEAD) & (spins < 4_000_000):
                    ready = tl.atomic_add(group_count_ptr + group, 0, sem="acquire", scope="gpu")
                    spins += 1
                if ready < 2 * PER_HEAD:
                    tl.inline_asm_elementwise("trap;", "=r,r", [ready], dtype=tl.int32, is_pure=False, pack=1)
                tl.debug_barrier()
                seq_stride = seq_len * NQKV  # q, k and v: column ranges of the q/k/v rows
                hk_cols: tl.constexpr = KV_TILES * BLOCK_N
                for n in range(0, sequences):
                    attend_heads(qkv_ptr, qkv_ptr + HQ * D, qkv_ptr + HQ * D + hk_cols, cos_ptr, sin_ptr, attn_ptr,
                                 n, head, HQ, seq_stride, NQKV, D, seq_stride, NQKV, D, seq_stride, NQKV,
                                 D, stride_cl, stride_sl, seq_len, sm_scale, GROUP, 1, HALF, BLOCK_L, ROPE,
                                 DOT_PRECISION, ".cg")
                tl.atomic_xchg(head_count_ptr + head, 0, sem="relaxed", scope="gpu")

    # Not specialised on `sequences` == 1 or `first`: fewer variants to compile at start-up, no cost at run time.
    @triton.jit(do_not_specialize=["sequences", "first"])
    def _dense_layer_kernel(x_ptr, ss_ptr, x_mid_ptr, ss_mid_ptr, x_out_ptr, ss_out_ptr, in_norm_ptr, post_norm_ptr,
                            qkv_w_ptr, o_w_ptr, gate_up_w_ptr, down_w_ptr, cos_ptr, sin_ptr, qkv_ptr, attn_ptr,
                            o_part_ptr, act_ptr, down_part_ptr, y_ptr, sync_ptr, counts_ptr, sequences, seq_len, first,
                            stride_cl, stride_sl, eps, scale, sm_scale,
                            H: tl.constexpr, NQKV: tl.constexpr, HQ: tl.constexpr, GROUP: tl.constexpr,
                            HALF: tl.constexpr, F: tl.constexpr, O_SPLITS: tl.constexpr, DOWN_SPLITS: tl.constexpr,
                            HAS_SCALE: tl.constexpr, ROPE: tl.constexpr, ATTN_TAIL: tl.constexpr,
                            PHASE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, PF_QKV: tl.constexpr, PF_O: tl.constexpr,
                            PF_GATE_UP: tl.constexpr, PF_DOWN: tl.constexpr):
        # PHASE -1: phases 0-5, grid barriers between them; 0..6: that phase only (a launch per phase).
        # x (rows, H) is the residual stream, ss its tile sums of squares (T, rows) (phase 0 makes them for a stack's
        # first layer); the layer leaves the next x and ss in x_out and ss_out. counts_ptr: the o tiles' counters,
        # the down tiles', the query heads', the kv heads' (`COUNTS`).
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        rows = sequences * seq_len
        D: tl.constexpr = 2 * HALF
        T: tl.constexpr = H // BLOCK_N
        ALL: tl.constexpr = PHASE < 0
        TILE_COUNTS: tl.constexpr = 256
        # PF_*: how far along K each projection's units are prefetched into L2 ahead of it (0: not), in fused
        # launches only: from the phase before, which would otherwise leave HBM idle.
        if ALL:
            _prefetch(qkv_w_ptr, pid, nprog, NQKV, H, 1, False, PF_QKV, BLOCK_N)
        if ALL or PHASE == 0:  # noqa: SIM102 (a constexpr guard around a run-time one)
            if first:
                _tile_sums(x_ptr, ss_ptr, rows, pid, nprog, H, T, BLOCK_T, BLOCK_N)
        barriers = first  # 0 or 1 barrier so far, the same in every program
        if first:
            _grid_sync(sync_ptr, nprog, ALL)
        if ALL or PHASE == 1:
            # q/k/v of the input-normed rows; with ATTN_TAIL the k and v tiles first, then the attention
            r = _row_scale(ss_ptr, rows, eps, H, T, BLOCK_T, BLOCK_M)
            m = tl.arange(0, BLOCK_M)
            Q_TILES: tl.constexpr = HQ * D // BLOCK_N
            NT: tl.constexpr = NQKV // BLOCK_N
            for unit in range(pid, NT, nprog):
                tile = (unit + Q_TILES) % NT if ATTN_TAIL else unit
                acc, _ = _unit_acc(x_ptr, qkv_w_ptr, tile, 0, rows, r, in_norm_ptr, NQKV, H, 1, False, True,
                                   DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
                cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                tl.store(qkv_ptr + m[None, :] * NQKV + cols[:, None], acc.to(qkv_ptr.dtype.element_ty),
                         mask=m[None, :] < rows)
                if ATTN_TAIL:
                    _attention_tail(qkv_ptr, cos_ptr, sin_ptr, attn_ptr, counts_ptr + 2 * TILE_COUNTS,
                                    counts_ptr + 3 * TILE_COUNTS, tile, sequences, seq_len, stride_cl, stride_sl,
                                    sm_scale, NQKV, HQ, GROUP, HALF, BLOCK_N, BLOCK_L, ROPE, DOT_PRECISION)
        if ALL:
            _prefetch(o_w_ptr, pid, nprog, H, HQ * D, O_SPLITS, False, PF_O, BLOCK_N)
        barriers += 1
        _grid_sync(sync_ptr, barriers * nprog, ALL)
        if not ATTN_TAIL:
            if ALL or PHASE == 2:
                hk_cols: tl.constexpr = (NQKV - HQ * D) // 2
                for unit in range(pid, sequences * HQ, nprog):
                    n = unit // HQ  # (sequence, head) pairs: offsets stay far below 2**31
                    seq_stride = seq_len * NQKV  # q, k and v: column ranges of the q/k/v rows
                    attend_heads(qkv_ptr, qkv_ptr + HQ * D, qkv_ptr + HQ * D + hk_cols, cos_ptr, sin_ptr, attn_ptr,
                                 n, unit % HQ, HQ, seq_stride, NQKV, D, seq_stride, NQKV, D, seq_stride, NQKV, D,
                                 stride_cl, stride_sl, seq_len, sm_scale, GROUP, 1, HALF, BLOCK_L, ROPE,
                                 DOT_PRECISION, ".cg")
            barriers += 1
            _grid_sync(sync_ptr, barriers * nprog, ALL)
        if ALL or PHASE == 3:
            if ATTN_TAIL and pid == 0:  # every attention tail has read its kv head's count
                for g in range(0, HQ // GROUP):
                    tl.atomic_xchg(counts_ptr + 3 * TILE_COUNTS + g, 0, sem="relaxed", scope="gpu")
            _project_residual(attn_ptr, o_w_ptr, o_part_ptr, x_ptr, x_mid_ptr, ss_mid_ptr, counts_ptr, rows, scale,
                              pid, nprog, H, HQ * D, O_SPLITS, HAS_SCALE, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        if ALL:
            _prefetch(gate_up_w_ptr, pid, nprog, F, H, 1, True, PF_GATE_UP, BLOCK_N)
        barriers += 1
        _grid_sync(sync_ptr, barriers * nprog, ALL)
        if ALL or PHASE == 4:
            r2 = _row_scale(ss_mid_ptr, rows, eps, H, T, BLOCK_T, BLOCK_M)
            _project(x_mid_ptr, gate_up_w_ptr, act_ptr, rows, pid, nprog, r2, post_norm_ptr, F, H, True, True,
                     DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        if ALL:
            _prefetch(down_w_ptr, pid, nprog, H, F, DOWN_SPLITS, False, PF_DOWN, BLOCK_N)
        barriers += 1
        _grid_sync(sync_ptr, barriers * nprog, ALL)
        if ALL or PHASE == 5:
            _project_residual(act_ptr, down_w_ptr, down_part_ptr, x_mid_ptr, x_out_ptr, ss_out_ptr,
                              counts_ptr + TILE_COUNTS, rows, scale, pid, nprog, H, F, DOWN_SPLITS, HAS_SCALE,
                              DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        if PHASE == 6:  # a stack's final norm, alone
            _final_norm_rows(x_ptr, ss_ptr, in_norm_ptr, y_ptr, rows, eps, pid, nprog, H, T, BLOCK_T, BLOCK_H)
        if ALL:  # noqa: SIM102 (a constexpr guard: Triton would emit the atomic under `and`)
            # The last program out resets the counters for the next launch: everyone is past every barrier.
            if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
                tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


# Rows (sequences x tokens) up to which a stack runs as layer kernels (VOXCPM_LAYER_MAX_ROWS): the DiT at B=1 (22 rows),
# the LocEnc up to B=12.
MAX_ROWS = min(64, int(os.environ.get("VOXCPM_LAYER_MAX_ROWS", "64")))  # more: tiles past the SM's resources
# VOXCPM_LAYER_ATTN_TAIL=0: the attention as a phase of its own, not in the q/k/v tiles' tails.
ATTN_TAIL = os.environ.get("VOXCPM_LAYER_ATTN_TAIL", "1") != "0"
# VOXCPM_LAYER_KERNEL: "fused" (default) one launch per layer with grid barriers; "phases" a launch per phase (same
# arithmetic, for comparison); "off" the layer's separate kernels.
MODE = os.environ.get("VOXCPM_LAYER_KERNEL", "fused")
if MODE not in ("fused", "phases", "off"):
    raise ValueError(f"VOXCPM_LAYER_KERNEL={MODE!r}: use 'fused' (default), 'phases' or 'off'")
BLOCK_N = 16
# (largest K tile, pipeline stages, warps, programs per SM) of the launches: tools/bench_kernels.py --only layer sweeps
# them. More than one program per SM keeps more weight bytes in flight per SM; the fused grid is capped by what the
# compiled variant's registers and shared memory let reside at once (the shipped bf16 variants: 88 KB of shared
# memory, 2 per SM on an H100).
LAUNCH = tuple(int(v) for v in os.environ.get("VOXCPM_LAYER_LAUNCH", "128,4,4,4").split(","))
if len(LAUNCH) != 4 or min(LAUNCH) < 1:
    raise ValueError(f"VOXCPM_LAYER_LAUNCH={LAUNCH}: four positive integers (K tile, stages, warps, programs per SM)")
# Bytes of each projection's weights prefetched into L2 ahead of it in a fused launch (VOXCPM_LAYER_PREFETCH_MB, 0:
# none): about what HBM delivers in the idle phase before it; more only evicts what is still to be used. DiT B=1 on an
# H100 (tools/bench_kernels.py --only layer): 0 MB 33.5 us per layer, 2 MB 31.75, 4 MB 32.1, 8 MB 32.4, 16 MB 33.9.
PREFETCH_BYTES = int(float(os.environ.get("VOXCPM_LAYER_PREFETCH_MB", "2")) * 2**20)
_resident: dict[tuple, int] = {}
_sync: dict[torch.device, torch.Tensor] = {}  # the barrier counter and the exit counter, per device
# the o tiles', down tiles', query heads' and kv heads' counters (COUNTS each; every launch leaves them zeroed)
_counts: dict[torch.device, torch.Tensor] = {}
COUNTS = 256  # the kernel's TILE_COUNTS: hidden / BLOCK_N and the heads stay below it (`supported`)
_sm_count: dict[torch.device, int] = {}


def _device(device: torch.device) -> torch.device:
    """`cuda` as `cuda:<current>`: one key per GPU for the counters."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _sms(device: torch.device) -> int:
    if device not in _sm_count:
        cuda = device.type == "cuda"
        _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 8
    return _sm_count[device]


def prepare(device: torch.device) -> None:
    """Allocate the device's barrier counters (zeroed; every fused launch leaves them zeroed). Outside a CUDA graph
    capture: a counter allocated inside one would live in that graph's private memory pool."""
    device = _device(torch.device(device))
    if device not in _sync:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("triton_layer.prepare(device) must run before a CUDA graph capture")
        _sync[device] = torch.zeros(2, device=device, dtype=torch.int32)
        _counts[device] = torch.zeros(4 * COUNTS, device=device, dtype=torch.int32)


def _programs_per_sm(args: tuple, kwargs: dict, seq_len: int, device: torch.device) -> int:
    """How many programs of this kernel variant fit on one SM at once (threads, registers as the hardware allocates
    them, shared memory, the block limit). Looked up per launch configuration: the compiled variant (`warmup`) is
    consulted once, not at every eager launch. The key holds what picks the variant besides the constexprs: the
    dtype, and `seq_len` (Triton specialises integers equal to 1 or divisible by 16; pointers come from torch
    allocations, 16-byte aligned)."""
    key = (device, args[0].dtype, seq_len == 1, seq_len % 16 == 0, *sorted(kwargs.items()))
    if key not in _resident:
        compiled = _dense_layer_kernel.warmup(*args, grid=(1,), **kwargs)  # compiles (or finds), launches nothing
        compiled._init_handles()  # loads the module: n_regs is known from here (Triton 3.6)
        props = torch.cuda.get_device_properties(device)
        warps = kwargs["num_warps"]
        regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # allocated per warp in units of 256
        fits = [props.max_threads_per_multi_processor // (32 * warps), props.regs_per_multiprocessor // (
            regs_per_warp * warps), 32]  # 32: blocks per SM (sm_80 / sm_90)
        if compiled.metadata.shared:  # the driver reserves 1 KB per resident block
            fits.append(props.shared_memory_per_multiprocessor // (compiled.metadata.shared + 1024))
        _resident[key] = max(1, min(fits))
    return _resident[key]


def _plan(cfg: TransformerConfig, sms: int) -> tuple[int, int, int] | None:
    """(o splits, down splits, K tile) for this stack's shapes, or None where the tiles do not divide them. The
    projections to `hidden` columns are split along K until their units fill the SMs."""
    h, f, q_width = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    if any(n % BLOCK_N for n in (h, f, q_width, cfg.num_key_value_heads * cfg.head_dim)):
        return None
    splits = max(1, min(4, sms // (h // BLOCK_N)))
    while splits > 1 and (q_width % (splits * 16) or f % (splits * 16)):
        splits -= 1
    block_k = next((b for b in (512, 256, 128, 64, 32, 16) if b <= LAUNCH[0] and h % b == 0
                    and q_width // splits % b == 0 and f // splits % b == 0), None)
    return None if block_k is None else (splits, splits, block_k)


def _prefetch_len(rows: int, k: int, elem_size: int) -> int:
    """How far along K (elements, whole 128-byte lines) a projection's units are prefetched: its first
    `PREFETCH_BYTES` in all. rows: the weight's rows (gate and up together); k: the K of one split."""
    line = 128 // elem_size
    return 0 if k % line else min(k, PREFETCH_BYTES // (rows * elem_size)) // line * line


def supported(stack: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `dense_stack` runs this MiniCPM stack on x (N, L, hidden): CUDA (or the interpreter), fused
    projections, few rows, shapes the tiles divide."""
    if MODE == "off" or not (HAVE_TRITON and triton_kernels.usable(x) and x.dim() == 3 and len(stack.layers)):
        return False
    cfg, layer = stack.cfg, stack.layers[0]
    d = cfg.head_dim
    return (x.shape[0] * x.shape[1] <= MAX_ROWS and x.shape[1] <= triton_kernels.MAX_DENSE_LEN
            and layer.self_attn.qkv_weight is not None and layer.mlp.gate_up_weight is not None
            and x.dtype == layer.self_attn.qkv_weight.dtype and x.shape[-1] == cfg.hidden_size
            and d >= 32 and d & (d - 1) == 0 and cfg.num_attention_heads % cfg.num_key_value_heads == 0
            and cfg.hidden_size // BLOCK_N <= COUNTS and cfg.num_attention_heads <= COUNTS
            and _plan(cfg, _sms(x.device) * LAUNCH[3]) is not None)


def dense_stack(stack: torch.nn.Module, x: torch.Tensor, rope: torch.Tensor | None,
                only_phases: tuple[int, ...] | None = None) -> torch.Tensor:
    """stack(x) for a non-causal MiniCPM stack (its final norm applied), where `supported`: x (N, L, hidden);
    rope (L, 2, head_dim) rows or None. One launch per layer, plus one for the final norm. only_phases (mode
    "phases", for timing them one by one): launch only these phases of each layer."""
    cfg, layers = stack.cfg, stack.layers
    n, seq_len, h = x.shape
    rows, dev, dtype = n * seq_len, _device(x.device), x.dtype
    hq, hk, d, f = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    nqkv = (hq + 2 * hk) * d
    sms = _sms(dev)
    o_splits, down_splits, block_k = _plan(cfg, sms * LAUNCH[3])
    fused_launch = MODE == "fused" and not _is_interpreted()
    x = x.reshape(rows, h).contiguous()

    def buffer(*shape: int, fp32: bool = False) -> torch.Tensor:
        return torch.empty(shape, device=dev, dtype=torch.float32 if fp32 else dtype)

    tiles = h // BLOCK_N
    # the residual stream and its tile sums of squares: the input, then two buffers the layers alternate between
    streams = [(x, buffer(tiles, rows, fp32=True))] + [(buffer(rows, h), buffer(tiles, rows, fp32=True))
                                                       for _ in range(2)]
    x_mid, ss_mid, normed = buffer(rows, h), buffer(tiles, rows, fp32=True), buffer(rows, h)
    qkv, attn, act = buffer(rows, nqkv), buffer(rows, hq * d), buffer(rows, f)
    o_part, down_part = buffer(o_splits, rows, h, fp32=True), buffer(down_splits, rows, h, fp32=True)
    prepare(dev)
    cos, sin = (rope[:, 0, :], rope[:, 1, :]) if rope is not None else (x, x)
    units = (rows, nqkv // BLOCK_N, n * hq, h // BLOCK_N * o_splits, f // BLOCK_N, h // BLOCK_N * down_splits, rows)
    # The attention as the q/k/v tiles' tails needs a program per q/k/v unit (all resident in a fused launch: checked
    # there; run in unit order otherwise).
    attn_tail = ATTN_TAIL and units[1] <= sms * LAUNCH[3]
    pf_names = ("PF_QKV", "PF_O", "PF_GATE_UP", "PF_DOWN")
    pf_shapes = ((nqkv, h), (h, hq * d // o_splits), (2 * f, h), (h, f // down_splits))
    prefetch = {name: _prefetch_len(n_rows, k, x.element_size()) if fused_launch else 0
                for name, (n_rows, k) in zip(pf_names, pf_shapes, strict=True)}
    scale = layers[0].residual_scale
    settings = dict(H=h, NQKV=nqkv, HQ=hq, GROUP=hq // hk, HALF=d // 2, F=f, O_SPLITS=o_splits,
                    DOWN_SPLITS=down_splits, HAS_SCALE=scale is not None, ROPE=rope is not None, ATTN_TAIL=attn_tail,
                    DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                    BLOCK_M=max(32, triton.next_power_of_2(rows)), BLOCK_N=BLOCK_N, BLOCK_K=block_k,
                    BLOCK_H=triton.next_power_of_2(h), BLOCK_T=triton.next_power_of_2(tiles),
                    BLOCK_L=max(16, triton.next_power_of_2(seq_len)), **prefetch,
                    num_stages=LAUNCH[1], num_warps=LAUNCH[2])
    grids: dict[int, int] = {}  # per phase: the same for every layer

    def launch(layer: torch.nn.Module, i: int, norm: torch.Tensor, phase: int) -> None:
        (x_in, ss_in), (x_out, ss_out) = streams[0 if i == 0 else 2 - i % 2], streams[1 + i % 2]
        args = (
            x_in, ss_in, x_mid, ss_mid, x_out, ss_out, norm, layer.post_attention_layernorm.weight,
            layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
            layer.mlp.down_proj.weight, cos, sin, qkv, attn, o_part, act, down_part, normed, _sync[dev],
            _counts[dev], n, seq_len, int(i == 0), cos.stride(0), sin.stride(0), cfg.rms_norm_eps,
            1.0 if scale is None else scale, d ** -0.5)
        kwargs = dict(settings, PHASE=phase)
        if phase not in grids:
            if phase < 0:  # every program resident at once, or a barrier cannot complete (and traps)
                grids[phase] = min(sms * min(LAUNCH[3], _programs_per_sm(args, kwargs, seq_len, dev)), max(units))
                if settings["ATTN_TAIL"] and grids[phase] < units[1]:  # too few resident: the attention phase
                    settings["ATTN_TAIL"] = False
                    kwargs = dict(settings, PHASE=phase)
                    grids[phase] = min(sms * min(LAUNCH[3], _programs_per_sm(args, kwargs, seq_len, dev)), max(units))
            else:
                grids[phase] = min(sms * LAUNCH[3], units[phase])
        _dense_layer_kernel[(grids[phase],)](*args, **kwargs)

    layer_phases = (0, 1) + (() if attn_tail else (2,)) + (3, 4, 5)
    for i, layer in enumerate(layers):
        for phase in (-1,) if fused_launch else [p for p in only_phases or layer_phases if p != 0 or i == 0]:
            launch(layer, i, layer.input_layernorm.weight, phase)
    launch(layers[-1], len(layers), stack.norm.weight, 6)  # the final norm of the last layer's output
    return normed.view(n, seq_len, h)
