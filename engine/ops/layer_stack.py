"""The decoder stack of a local module (LocEnc, DiT) as one persistent Triton kernel, for a few rows.

Why: at B=1 a decode step runs the DiT's 12 layers 9 times (and the LocEnc's 12 once), and as separate kernels each
layer is 8 launches of mostly fixed latency (launch, the first DRAM round trips, the tail). Here one grid (as many
programs as fit on the SMs at once; one per SM by default) runs the layer's phases back to back, separated by
grid-wide barriers (an atomic counter) instead of kernel boundaries:

  0  x = x_prev + the previous layer's down projection (fp32 partials, summed and rounded here); RMSNorm(x) (rows)
  1  q/k/v projection of the normed rows                                                    (BLOCK_N-column tiles)
  2  attention with the rotary embedding                                                     ((sequence, head) pairs)
  3  o projection, split along K into fp32 partials                                                  (tiles x splits)
  4  x1 = x + o; RMSNorm(x1); x1 is the layer's residual output                                                (rows)
  5  gate/up projection with the SiLU gate                                                                     (tiles)
  6  down projection, split along K into fp32 partials, summed by the next layer's phase 0              (tiles x splits)

A stack ends with phase 0 alone under its final norm. The whole stack is one launch: the layers' weights are stacks
(`MiniCPM.stack_layer_weights`), layer l's at row l. Each program also prefetches into L2 the first weights of its
units of the next projection during the phase before it (`_prefetch`, EngineOptions.layer_prefetch_mb).

The rounding points are the eager layer's (each projection's output rounded to the dtype after fp32 accumulation,
split partials summed in split order first, as cuBLAS's split-K does; the norms, attention and SiLU gate as in
their own ops). The barriers need every program resident at once: the grid never exceeds what the compiled
variant's registers, shared memory and threads let the SMs hold together (`_programs_per_sm`), and launches of this
kernel must not overlap (one counter per device, stream-ordered: the engine runs the local modules on one stream;
kernels of other streams, like the VAE's, only delay programs, they finish on their own). The fused launch is a
cooperative one (EngineOptions.layer_cooperative): the driver then guarantees that co-residency, or refuses the
launch where the process may use fewer SMs than the device reports (an MPS client with an active-thread limit); the
grid is then halved until it is accepted (`_launch_fused`), instead of spinning into the barrier's trap. Without
barriers (Triton's interpreter, which runs programs one after another, or mode "phases") each phase is its own
launch of the same kernel: same arithmetic, kernel boundaries instead of barriers.

One file because the kernel and its launcher are one contract, as in every op module: the grid the launcher sizes is
what the kernel's barriers count on, and the settings it picks are the variant the kernel compiles.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.ops.dense_attention import MAX_DENSE_LEN
from engine.ops.platform import HAVE_TRITON, interpreted, usable
from engine.options import current

if TYPE_CHECKING:
    import torch

    from engine.config import TransformerConfig
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

log = logging.getLogger(__name__)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from engine.ops.dense_attention import attend_heads
    from engine.ops.paged_attention import prefetch_l2
    from engine.ops.silu_mul import silu_mul_math

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
                    prefetch_l2(ptrs)
                    if GATE:  # the up rows follow the gate rows
                        prefetch_l2(ptrs + N * K)

    @triton.jit
    def _residual_norm_rows(x_ptr, part_ptr, w_ptr, x_out_ptr, y_ptr, rows, has_part, eps, scale, pid, nprog,
                            H: tl.constexpr, SPLITS: tl.constexpr, HAS_SCALE: tl.constexpr,
                            BLOCK_H: tl.constexpr, CACHE: tl.constexpr):
        # x + round(sum of the partials) [* scale], stored, and its RMSNorm: `add_rms_norm`'s op order.
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        for r in range(pid, rows, nprog):
            x = tl.load(x_ptr + r * H + cols, mask=mask, other=0.0, cache_modifier=CACHE)
            if has_part:
                h = tl.zeros((BLOCK_H,), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    h += tl.load(part_ptr + (s * rows + r) * H + cols, mask=mask, other=0.0, cache_modifier=CACHE)
                h = h.to(x.dtype)  # the projection's output rounding
                if HAS_SCALE:
                    h = (h.to(tl.float32) * scale).to(x.dtype)
                x = (x.to(tl.float32) + h.to(tl.float32)).to(x.dtype)
            tl.store(x_out_ptr + r * H + cols, x, mask=mask)
            xf = x.to(tl.float32)
            y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)).to(x.dtype)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            tl.store(y_ptr + r * H + cols, (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask)

    @triton.jit
    def _project(a_ptr, w_ptr, out_ptr, rows, pid, nprog, N: tl.constexpr, K: tl.constexpr, SPLITS: tl.constexpr,
                 SILU_GATE: tl.constexpr, PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out = a (rows, K) @ w (N [x 2 with the gate], K).T, one unit per BLOCK_N columns and K split: the weight
        # tile is the dot's left operand (a few activation rows fill its narrow side), streamed once from HBM.
        KS: tl.constexpr = K // SPLITS
        m = tl.arange(0, BLOCK_M)
        m_ok = m < rows
        kk = tl.arange(0, BLOCK_K)
        for unit in range(pid, (N // BLOCK_N) * SPLITS, nprog):
            split = unit % SPLITS
            cols = (unit // SPLITS) * BLOCK_N + tl.arange(0, BLOCK_N)
            w_ptrs = w_ptr + cols[:, None].to(tl.int64) * K + split * KS + kk[None, :]
            a_ptrs = a_ptr + m[None, :] * K + split * KS + kk[:, None]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for _ in range(0, KS, BLOCK_K):
                a = tl.load(a_ptrs, mask=m_ok[None, :], other=0.0, cache_modifier=".cg")
                acc = tl.dot(tl.load(w_ptrs, eviction_policy="evict_first"), a, acc, input_precision=DOT_PRECISION)
                if SILU_GATE:  # the up rows follow the gate rows
                    acc_up = tl.dot(tl.load(w_ptrs + N * K, eviction_policy="evict_first"), a, acc_up,
                                    input_precision=DOT_PRECISION)
                w_ptrs += BLOCK_K
                a_ptrs += BLOCK_K
            out_mask = m_ok[None, :]
            if PARTIAL:
                tl.store(out_ptr + (split * rows + m[None, :]) * N + cols[:, None], acc, mask=out_mask)
            else:
                y = acc.to(out_ptr.dtype.element_ty)
                if SILU_GATE:  # silu_mul's op order on the rounded halves
                    up = acc_up.to(out_ptr.dtype.element_ty)
                    y = silu_mul_math(y.to(tl.float32), up)
                tl.store(out_ptr + m[None, :] * N + cols[:, None], y, mask=out_mask)

    @triton.jit
    def _layer_phases(l, qkv_w_ptr, o_w_ptr, gate_up_w_ptr, down_w_ptr, post_norm_ptr, cos_ptr, sin_ptr, xn_ptr,
                      normed_ptr, qkv_ptr, attn_ptr, o_part_ptr, x_out_ptr, normed2_ptr, act_ptr, down_part_ptr,
                      sync_ptr, sync_base, pid, nprog, sequences, seq_len, rows, stride_cl, stride_sl, eps, scale,
                      sm_scale,
                      H: tl.constexpr, NQKV: tl.constexpr, HQ: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr,
                      F: tl.constexpr, O_SPLITS: tl.constexpr, DOWN_SPLITS: tl.constexpr, HAS_SCALE: tl.constexpr,
                      ROPE: tl.constexpr, PHASE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                      PF_O: tl.constexpr, PF_GATE_UP: tl.constexpr, PF_DOWN: tl.constexpr):
        # Phases 1-6 of layer l (its weights at l's row of each stack), barriers between them when ALL.
        ALL: tl.constexpr = PHASE < 0
        D: tl.constexpr = 2 * HALF
        li = l.to(tl.int64)
        qkv_w = qkv_w_ptr + li * (NQKV * H)
        o_w = o_w_ptr + li * (H * HQ * D)
        gate_up_w = gate_up_w_ptr + li * (2 * F * H)
        down_w = down_w_ptr + li * (H * F)
        if ALL or PHASE == 1:
            _project(normed_ptr, qkv_w, qkv_ptr, rows, pid, nprog, NQKV, H, 1, False, False, DOT_PRECISION,
                     BLOCK_M, BLOCK_N, BLOCK_K)
        if ALL:
            _prefetch(o_w, pid, nprog, H, HQ * D, O_SPLITS, False, PF_O, BLOCK_N)
        _grid_sync(sync_ptr, (sync_base + 1) * nprog, ALL)
        if ALL or PHASE == 2:
            hk_cols: tl.constexpr = (NQKV - HQ * D) // 2
            for unit in range(pid, sequences * HQ, nprog):
                n = unit // HQ  # (sequence, head) pairs: offsets stay far below 2**31
                seq_stride = seq_len * NQKV  # q, k and v: column ranges of the q/k/v rows
                attend_heads(qkv_ptr, qkv_ptr + HQ * D, qkv_ptr + HQ * D + hk_cols, cos_ptr, sin_ptr, attn_ptr, n,
                             unit % HQ, HQ, seq_stride, NQKV, D, seq_stride, NQKV, D, seq_stride, NQKV, D, stride_cl,
                             stride_sl, seq_len, sm_scale, GROUP, 1, HALF, BLOCK_L, ROPE, DOT_PRECISION, ".cg")
        _grid_sync(sync_ptr, (sync_base + 2) * nprog, ALL)
        if ALL or PHASE == 3:
            _project(attn_ptr, o_w, o_part_ptr, rows, pid, nprog, H, HQ * D, O_SPLITS, False, True,
                     DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        if ALL:
            _prefetch(gate_up_w, pid, nprog, F, H, 1, True, PF_GATE_UP, BLOCK_N)
        _grid_sync(sync_ptr, (sync_base + 3) * nprog, ALL)
        if ALL or PHASE == 4:
            _residual_norm_rows(xn_ptr, o_part_ptr, post_norm_ptr + li * H, x_out_ptr, normed2_ptr, rows, 1, eps,
                                scale, pid, nprog, H, O_SPLITS, HAS_SCALE, BLOCK_H, ".cg")
        _grid_sync(sync_ptr, (sync_base + 4) * nprog, ALL)
        if ALL or PHASE == 5:
            _project(normed2_ptr, gate_up_w, act_ptr, rows, pid, nprog, F, H, 1, True, False, DOT_PRECISION,
                     BLOCK_M, BLOCK_N, BLOCK_K)
        if ALL:
            _prefetch(down_w, pid, nprog, H, F, DOWN_SPLITS, False, PF_DOWN, BLOCK_N)
        _grid_sync(sync_ptr, (sync_base + 5) * nprog, ALL)
        if ALL or PHASE == 6:
            _project(act_ptr, down_w, down_part_ptr, rows, pid, nprog, H, F, DOWN_SPLITS, False, True,
                     DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)

    # Not specialised on `sequences` == 1, `has_part`, `num_layers` or `layer`: fewer variants to compile at start-up,
    # no cost at run time.
    @triton.jit(do_not_specialize=["sequences", "has_part", "num_layers", "layer"])
    def _dense_layer_kernel(x_ptr, down_part_ptr, x_out_ptr, in_norm_ptr, post_norm_ptr, qkv_w_ptr, o_w_ptr,
                            gate_up_w_ptr, down_w_ptr, cos_ptr, sin_ptr, xn_ptr, normed_ptr, qkv_ptr, attn_ptr,
                            o_part_ptr, normed2_ptr, act_ptr, sync_ptr, sequences, seq_len, has_part, num_layers,
                            layer, stride_cl, stride_sl, eps, scale, sm_scale,
                            H: tl.constexpr, NQKV: tl.constexpr, HQ: tl.constexpr, GROUP: tl.constexpr,
                            HALF: tl.constexpr, F: tl.constexpr, O_SPLITS: tl.constexpr, DOWN_SPLITS: tl.constexpr,
                            HAS_SCALE: tl.constexpr, ROPE: tl.constexpr,
                            PHASE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_L: tl.constexpr, PF_QKV: tl.constexpr, PF_O: tl.constexpr,
                            PF_GATE_UP: tl.constexpr, PF_DOWN: tl.constexpr):
        # PHASE -1: the whole stack of `num_layers` layers and its final norm, grid barriers between the phases;
        # 0..6: that phase of layer `layer` only (a launch per phase; phase 0 of layer `num_layers` is the final norm).
        # The weights are stacks (`MiniCPM.stack_layer_weights`): layer l's at row l; in_norm has the final norm last.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        rows = sequences * seq_len
        ALL: tl.constexpr = PHASE < 0
        # PF_*: how far along K each projection's units are prefetched into L2 ahead of it (0: not), in fused
        # launches only: from the phase before, which would otherwise leave HBM idle.
        if ALL:
            _prefetch(qkv_w_ptr, pid, nprog, NQKV, H, 1, False, PF_QKV, BLOCK_N)
            _residual_norm_rows(x_ptr, down_part_ptr, in_norm_ptr, xn_ptr, normed_ptr, rows, has_part, eps, scale, pid,
                                nprog, H, DOWN_SPLITS, HAS_SCALE, BLOCK_H, "")
            _grid_sync(sync_ptr, nprog, True)
            for l in range(num_layers):
                base = 1 + 7 * l  # barriers before this layer's phases
                _layer_phases(l, qkv_w_ptr, o_w_ptr, gate_up_w_ptr, down_w_ptr, post_norm_ptr, cos_ptr, sin_ptr,
                              xn_ptr, normed_ptr, qkv_ptr, attn_ptr, o_part_ptr, x_out_ptr, normed2_ptr, act_ptr,
                              down_part_ptr, sync_ptr, base, pid, nprog, sequences, seq_len, rows, stride_cl,
                              stride_sl, eps, scale, sm_scale, H, NQKV, HQ, GROUP, HALF, F, O_SPLITS, DOWN_SPLITS,
                              HAS_SCALE, ROPE, PHASE, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_H, BLOCK_L,
                              PF_O, PF_GATE_UP, PF_DOWN)
                if l + 1 < num_layers:  # the next layer's first weights, while the last programs finish
                    _prefetch(qkv_w_ptr + (l + 1).to(tl.int64) * (NQKV * H), pid, nprog, NQKV, H, 1, False, PF_QKV,
                              BLOCK_N)
                _grid_sync(sync_ptr, (base + 6) * nprog, True)
                # The residual update by the down projection and the next layer's input norm (the final norm last).
                _residual_norm_rows(x_out_ptr, down_part_ptr, in_norm_ptr + (l + 1).to(tl.int64) * H, xn_ptr,
                                    normed_ptr, rows, 1, eps, scale, pid, nprog, H, DOWN_SPLITS, HAS_SCALE, BLOCK_H,
                                    ".cg")
                _grid_sync(sync_ptr, (base + 7) * nprog, True)
            # The last program out resets the counters for the next launch: everyone is past every barrier.
            if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
                tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        elif PHASE == 0:
            _residual_norm_rows(x_ptr, down_part_ptr, in_norm_ptr + layer.to(tl.int64) * H, xn_ptr, normed_ptr, rows,
                                has_part, eps, scale, pid, nprog, H, DOWN_SPLITS, HAS_SCALE, BLOCK_H, "")
        else:
            _layer_phases(layer, qkv_w_ptr, o_w_ptr, gate_up_w_ptr, down_w_ptr, post_norm_ptr, cos_ptr, sin_ptr,
                          xn_ptr, normed_ptr, qkv_ptr, attn_ptr, o_part_ptr, x_out_ptr, normed2_ptr, act_ptr,
                          down_part_ptr, sync_ptr, 0, pid, nprog, sequences, seq_len, rows, stride_cl, stride_sl, eps,
                          scale, sm_scale, H, NQKV, HQ, GROUP, HALF, F, O_SPLITS, DOWN_SPLITS, HAS_SCALE, ROPE, PHASE,
                          DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_H, BLOCK_L, PF_O, PF_GATE_UP, PF_DOWN)


# The launch settings (EngineOptions.layer_*): at most 64 rows (more: tiles past the SM's resources); wider units
# read the rows' activations from L2 fewer times over, narrower ones make more units; with 32 columns one program
# per SM streams as fast as two and leaves fewer programs to meet at each grid barrier; the L2 prefetch is about what
# HBM delivers in the idle phase before a projection (more only evicts what is still to be used).
_resident: dict[tuple, int] = {}
_sync: dict[torch.device, torch.Tensor] = {}  # the barrier counter and the exit counter, per device
_sm_count: dict[torch.device, int] = {}
_grid_cap: dict[torch.device, int] = {}  # per device: the largest cooperative grid accepted after a refusal
_plain_launch: set[torch.device] = set()  # devices without cooperative launches


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
            raise RuntimeError("layer_stack.prepare(device) must run before a CUDA graph capture")
        _sync[device] = torch.zeros(2, device=device, dtype=torch.int32)


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


def _launch_fused(grid: int, args: tuple, kwargs: dict, device: torch.device) -> None:
    """One fused (all-phase) launch of `grid` programs, cooperative where kwargs ask for it. A cooperative grid the
    driver refuses as too large (the process has fewer SMs than the device reports) is halved until accepted, and
    that size kept as the device's cap (with one program per SM, the default, every variant's fused grid is one per
    SM, so one cap serves them all). The engine's warm-up runs every shape before its graph capture, where a refusal
    would invalidate the capture: there it is an error. The phases loop over their units, so any grid size computes
    the same."""
    if not kwargs.get("launch_cooperative_grid"):
        _dense_layer_kernel[(grid,)](*args, **kwargs)
        return
    if device in _plain_launch:
        _dense_layer_kernel[(grid,)](*args, **dict(kwargs, launch_cooperative_grid=False))
        return
    grid = min(grid, _grid_cap.get(device, grid))
    while True:
        try:
            _dense_layer_kernel[(grid,)](*args, **kwargs)
            return
        except RuntimeError as e:  # refused: nothing ran, the error is not sticky
            message = str(e)
            if "not supported" in message:  # a GPU or driver without cooperative launches: plain ones
                log.warning("layer kernel: no cooperative launch on %s (%s); plain launches", device, message)
                _plain_launch.add(device)
                _dense_layer_kernel[(grid,)](*args, **dict(kwargs, launch_cooperative_grid=False))
                return
            if "cooperative launch" not in message or grid == 1:  # "too many blocks in cooperative launch"
                raise
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"layer kernel: cooperative grid of {grid} refused during a CUDA graph capture "
                                   "(the warm-up before it did not run this shape)") from e
        grid //= 2
        _grid_cap[device] = grid
        log.warning("layer kernel: a cooperative grid was refused on %s (fewer usable SMs than the %d it reports, "
                    "e.g. an MPS client's limit); trying %d programs", device, _sms(device), grid)


def _plan(cfg: TransformerConfig, sms: int) -> tuple[int, int, int] | None:
    """(o splits, down splits, K tile) for this stack's shapes, or None where the tiles do not divide them. The
    projections to `hidden` columns are split along K until their units fill the SMs."""
    h, f, q_width = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    opts = current()
    block_n, max_k_tile = opts.layer_block_n, opts.layer_launch[0]
    if any(n % block_n for n in (h, f, q_width, cfg.num_key_value_heads * cfg.head_dim)):
        return None
    splits = max(1, min(4, sms // (h // block_n)))
    while splits > 1 and (q_width % (splits * 16) or f % (splits * 16)):
        splits -= 1
    block_k = next((b for b in (512, 256, 128, 64, 32, 16) if b <= max_k_tile and h % b == 0
                    and q_width // splits % b == 0 and f // splits % b == 0), None)
    return None if block_k is None else (splits, splits, block_k)


def _prefetch_len(rows: int, k: int, elem_size: int) -> int:
    """How far along K (elements, whole 128-byte lines) a projection's units are prefetched: its first
    `layer_prefetch_mb` (EngineOptions) in all. rows: the weight's rows (gate and up together); k: the K of one
    split."""
    line = 128 // elem_size
    return 0 if k % line else min(k, current().layer_prefetch_bytes // (rows * elem_size)) // line * line


def supported(stack: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `dense_stack` runs this MiniCPM stack on x (N, L, hidden): CUDA (or the interpreter), fused
    projections, layer weights stacked (`MiniCPM.stack_layer_weights`), few rows, shapes the tiles divide."""
    o = current()
    if o.layer_kernel == "off" or not (HAVE_TRITON and usable(x) and x.dim() == 3 and len(stack.layers)):
        return False
    cfg, layer = stack.cfg, stack.layers[0]
    d = cfg.head_dim
    return (x.shape[0] * x.shape[1] <= o.layer_max_rows and x.shape[1] <= MAX_DENSE_LEN
            and layer.self_attn.qkv_weight is not None and layer.mlp.gate_up_weight is not None
            and x.dtype == layer.self_attn.qkv_weight.dtype and x.shape[-1] == cfg.hidden_size
            and d >= 32 and d & (d - 1) == 0 and cfg.num_attention_heads % cfg.num_key_value_heads == 0
            and _plan(cfg, _sms(x.device) * o.layer_launch[3]) is not None and stack.layer_weight_stacks() is not None)


def dense_stack(stack: torch.nn.Module, x: torch.Tensor, rope: torch.Tensor | None,
                only_phases: tuple[int, ...] | None = None) -> torch.Tensor:
    """stack(x) for a non-causal MiniCPM stack (its final norm applied), where `supported`: x (N, L, hidden);
    rope (L, 2, head_dim) rows or None. One launch for the whole stack (mode "fused"), or one per phase of each layer
    and one for the final norm (mode "phases"; only_phases, for timing them one by one: only these phases of each
    layer)."""
    cfg, layers = stack.cfg, stack.layers
    n, seq_len, h = x.shape
    rows, dev, dtype = n * seq_len, _device(x.device), x.dtype
    hq, hk, d, f = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    nqkv = (hq + 2 * hk) * d
    sms = _sms(dev)
    opts = current()
    _, stages, warps, programs_per_sm = opts.layer_launch
    block_n = opts.layer_block_n
    o_splits, down_splits, block_k = _plan(cfg, sms * programs_per_sm)
    fused_launch = opts.layer_kernel == "fused" and not interpreted()
    x = x.reshape(rows, h).contiguous()

    def buffer(*shape: int, fp32: bool = False) -> torch.Tensor:
        return torch.empty(shape, device=dev, dtype=torch.float32 if fp32 else dtype)

    x_res, x_mid, normed, normed2 = buffer(rows, h), buffer(rows, h), buffer(rows, h), buffer(rows, h)
    qkv, attn, act = buffer(rows, nqkv), buffer(rows, hq * d), buffer(rows, f)
    o_part, down_part = buffer(o_splits, rows, h, fp32=True), buffer(down_splits, rows, h, fp32=True)
    prepare(dev)
    cos, sin = (rope[:, 0, :], rope[:, 1, :]) if rope is not None else (x, x)
    units = (rows, nqkv // block_n, n * hq, h // block_n * o_splits, rows, f // block_n, h // block_n * down_splits)
    pf_names = ("PF_QKV", "PF_O", "PF_GATE_UP", "PF_DOWN")
    pf_shapes = ((nqkv, h), (h, hq * d // o_splits), (2 * f, h), (h, f // down_splits))
    prefetch = {name: _prefetch_len(n_rows, k, x.element_size()) if fused_launch else 0
                for name, (n_rows, k) in zip(pf_names, pf_shapes, strict=True)}
    scale = layers[0].residual_scale
    settings = dict(H=h, NQKV=nqkv, HQ=hq, GROUP=hq // hk, HALF=d // 2, F=f, O_SPLITS=o_splits,
                    DOWN_SPLITS=down_splits, HAS_SCALE=scale is not None, ROPE=rope is not None,
                    DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                    BLOCK_M=max(32, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
                    BLOCK_H=triton.next_power_of_2(h), BLOCK_L=max(16, triton.next_power_of_2(seq_len)), **prefetch,
                    num_stages=stages, num_warps=warps)
    grids: dict[int, int] = {}  # per phase: the same for every layer
    w = stack.layer_weight_stacks()
    assert w is not None  # `supported` checked it

    def launch(layer: int, x_in: torch.Tensor, phase: int) -> None:
        args = (
            x_in, down_part, x_res, w["input_norm"], w["post_norm"], w["qkv"], w["o"], w["gate_up"], w["down"], cos,
            sin, x_mid, normed, qkv, attn, o_part, normed2, act, _sync[dev], n, seq_len, 0 if layer == 0 else 1,
            len(layers), layer, cos.stride(0), sin.stride(0), cfg.rms_norm_eps, 1.0 if scale is None else scale,
            d ** -0.5)
        kwargs = dict(settings, PHASE=phase)
        if phase < 0 and opts.layer_cooperative:  # (a launch option, but also part of the compiled variant's cache key)
            kwargs["launch_cooperative_grid"] = True
        if phase not in grids:
            if phase < 0:  # every program resident at once, or a barrier cannot complete (and traps)
                grids[phase] = min(sms * min(programs_per_sm, _programs_per_sm(args, kwargs, seq_len, dev)), max(units))
            else:
                grids[phase] = min(sms * programs_per_sm, units[phase])
        if phase < 0:
            _launch_fused(grids[phase], args, kwargs, dev)
        else:
            _dense_layer_kernel[(grids[phase],)](*args, **kwargs)

    if fused_launch:
        launch(0, x, -1)  # every layer and the final norm
    else:
        for i in range(len(layers)):
            for phase in only_phases or range(len(units)):
                launch(i, x if i == 0 else x_res, phase)
        launch(len(layers), x_res, 0)  # the last layer's down projection added, the final norm
    return normed.view(n, seq_len, h)
