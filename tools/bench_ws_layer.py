"""Can a warp-specialised kernel keep HBM streaming a DiT layer's weights through its grid barriers? (GPU, sm_90)

The layer kernel (`engine/triton_layer.py`) runs a DiT layer at B=1 in ~28.6 us on an H100 against ~10.3 us of
weight reads (34.6 MB at 3.35 TB/s): each of its four projection phases starts streaming only after the grid
barrier before it. Weights do not depend on activations, so a producer warp per program can load them ahead into a
shared-memory ring (TMA, mbarriers) while the program's consumer warpgroup waits at a barrier or works on another
phase; the consumer multiplies from the ring with wgmma. This measures that on the DiT's four projections
(q/k/v split 8 ways along K, o 8 ways, gate/up whole, down 8 ways; 64-column units, one persistent program per SM,
`--layers` layers with their own weights in one launch), with grid barriers between the phases and, with
`--light`, three more barriers standing in for the norms and the attention (the layer kernel's seven phases).

The activations are fixed inputs (not the previous phase's output) and the outputs fp32 partials: the timing
structure of the projection phases, not the layer's arithmetic; the partials are checked against torch. Reference:
the layer kernel's whole layer (`tools/bench_kernels.py --only layer`). Prints us per layer, writes JSON.

    python tools/bench_ws_layer.py --out ws.json                # on the GPU machine
    python tools/bench_ws_layer.py --compile-only               # here: compiles for sm_90, no GPU
"""

from __future__ import annotations

import argparse
import json
import time

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# activation rows (22 padded), unit columns (wgmma M), K chunk (a 128-byte TMA row)
BM, BN, KC = gl.constexpr(32), gl.constexpr(64), gl.constexpr(64)
# the DiT's shapes (VoxCPM2) at B=1: 2 CFG halves x 11 tokens
H, QKV, F, ROWS = gl.constexpr(1024), gl.constexpr(2560), gl.constexpr(4096), gl.constexpr(22)
# per projection phase, for the host: (weight rows N, K, K splits)
PHASES = ((2560, 1024, 8), (1024, 2048, 8), (8192, 1024, 1), (1024, 4096, 8))
_BM, _BN, _KC, _ROWS = BM.value, BN.value, KC.value, ROWS.value


@gluon.jit
def _grid_sync(sync_ptr, target):
    gl.thread_barrier()
    arrived = gl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") + 1
    spins = 0
    while (arrived < target) & (spins < 4_000_000):
        arrived = gl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if arrived < target:  # not all programs resident: fail the launch instead of hanging
        gl.inline_asm_elementwise("trap;", "=r,r", [arrived], dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()


@gluon.jit
def _produce(w_desc, ring, full, empty, it, layer, pid, nprog, N: gl.constexpr, K: gl.constexpr,
             SPLITS: gl.constexpr, NS: gl.constexpr, TILED: gl.constexpr):
    # this program's units of one projection, chunk by chunk into the ring (waits only for a free slot). TILED: the
    # weights stored chunk after chunk ((N / BN, K / KC, BN, KC): each chunk 8 contiguous KB) instead of (N, K)
    KS: gl.constexpr = K // SPLITS
    for unit in range(pid, (N // BN) * SPLITS, nprog):
        row = layer * N + (unit // SPLITS) * BN
        k0 = (unit % SPLITS) * KS
        for c in range(KS // KC):
            s = it % NS
            mbarrier.wait(empty.index(s), ((it // NS) & 1) ^ 1)
            mbarrier.expect(full.index(s), BN * KC * 2)
            if TILED:
                chunk = (row // BN) * (K // KC) + k0 // KC + c
                tma.async_copy_global_to_shared(w_desc, [chunk * BN, 0], full.index(s), ring.index(s))
            else:
                tma.async_copy_global_to_shared(w_desc, [row, k0 + c * KC], full.index(s), ring.index(s))
            it += 1
    return it


@gluon.jit
def _producer(w0, w1, w2, w3, ring, full, empty, layers, pid, nprog, NS: gl.constexpr, TILED: gl.constexpr):
    it = 0
    for layer in range(layers):
        it = _produce(w0, ring, full, empty, it, layer, pid, nprog, QKV, H, 8, NS, TILED)
        it = _produce(w1, ring, full, empty, it, layer, pid, nprog, H, 2 * H, 8, NS, TILED)
        it = _produce(w2, ring, full, empty, it, layer, pid, nprog, 2 * F, H, 1, NS, TILED)
        it = _produce(w3, ring, full, empty, it, layer, pid, nprog, H, F, 8, NS, TILED)


@gluon.jit
def _consume(a_desc, out_ptr, ring, full, empty, act, act_bar, it, act_phase, pid, nprog, N: gl.constexpr,
             K: gl.constexpr, SPLITS: gl.constexpr, NS: gl.constexpr, ACT: gl.constexpr, PIPE: gl.constexpr,
             MMA: gl.constexpr):
    # this program's units of one projection: its activation range by TMA, then one wgmma per weight chunk from
    # the ring (the slot released once the wgmma is done); fp32 partials (SPLITS, BM, N) stored from registers
    KS: gl.constexpr = K // SPLITS
    NCH: gl.constexpr = KS // KC
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    cols = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    rows = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    for unit in range(pid, (N // BN) * SPLITS, nprog):
        col0 = (unit // SPLITS) * BN
        split = unit % SPLITS
        if ACT:  # (ACT 0: the activations left in shared memory from before, to time the loop without their load)
            mbarrier.expect(act_bar, NCH * BM * KC * 2)
            for c in gl.static_range(NCH):
                tma.async_copy_global_to_shared(a_desc, [0, split * KS + c * KC], act_bar, act.index(c))
            mbarrier.wait(act_bar, act_phase)
            act_phase ^= 1
        acc = gl.zeros([BN, BM], gl.float32, mma)
        prev = 0
        for c in gl.static_range(NCH):
            s = it % NS
            mbarrier.wait(full.index(s), (it // NS) & 1)
            if MMA:  # (MMA 0: the chunk only waited for and released, to time the pipeline without the wgmma)
                acc = warpgroup_mma(ring.index(s), act.index(c).permute((1, 0)), acc, is_async=True)
            if PIPE:  # the previous chunk's wgmma done: its slot back to the producer
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if c > 0:
                    mbarrier.arrive(empty.index(prev), count=1)
                prev = s
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(s), count=1)
            it += 1
        if PIPE:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(prev), count=1)
        ptrs = out_ptr + (split * BM + rows[None, :]) * N + (col0 + cols)[:, None]
        gl.store(ptrs, acc, mask=rows[None, :] < 22)
    return it, act_phase


@gluon.jit
def _consumer(a0, a1, a2, a3, o0, o1, o2, o3, ring, full, empty, act, act_bar, sync_ptr, layers, pid, nprog,
              LIGHT: gl.constexpr, NS: gl.constexpr, ACT: gl.constexpr, PIPE: gl.constexpr, SYNC: gl.constexpr,
              MMA: gl.constexpr):
    # per layer: [norm stand-in] q/k/v | [attention stand-in] o | [norm stand-in] gate/up | down, a grid barrier
    # after each phase (SYNC 0: none, to time the phases without them)
    it = 0
    act_phase = 0
    target = 0
    for _layer in range(layers):
        if LIGHT:
            target += nprog
            _grid_sync(sync_ptr, target)
        it, act_phase = _consume(a0, o0, ring, full, empty, act, act_bar, it, act_phase, pid, nprog, QKV, H, 8, NS,
                                 ACT, PIPE, MMA)
        if SYNC:
            target += nprog
            _grid_sync(sync_ptr, target)
        if LIGHT:
            target += nprog
            _grid_sync(sync_ptr, target)
        it, act_phase = _consume(a1, o1, ring, full, empty, act, act_bar, it, act_phase, pid, nprog, H, 2 * H, 8,
                                 NS, ACT, PIPE, MMA)
        if SYNC:
            target += nprog
            _grid_sync(sync_ptr, target)
        if LIGHT:
            target += nprog
            _grid_sync(sync_ptr, target)
        it, act_phase = _consume(a2, o2, ring, full, empty, act, act_bar, it, act_phase, pid, nprog, 2 * F, H, 1, NS,
                                 ACT, PIPE, MMA)
        if SYNC:
            target += nprog
            _grid_sync(sync_ptr, target)
        it, act_phase = _consume(a3, o3, ring, full, empty, act, act_bar, it, act_phase, pid, nprog, H, F, 8, NS,
                                 ACT, PIPE, MMA)
        if SYNC:
            target += nprog
            _grid_sync(sync_ptr, target)
    # the last program out resets the counters for the next launch (SYNC and LIGHT 0: no counter was used)
    if (SYNC | LIGHT) and gl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        gl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _ws_layers_kernel(w0, w1, w2, w3, a0, a1, a2, a3, o0, o1, o2, o3, sync_ptr, layers, LIGHT: gl.constexpr,
                      NS: gl.constexpr, ACT_CHUNKS: gl.constexpr, ACT: gl.constexpr = 1, PIPE: gl.constexpr = 0,
                      SYNC: gl.constexpr = 1, MMA: gl.constexpr = 1,
                      TILED: gl.constexpr = 0):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ring = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, KC], w0.layout)
    act = gl.allocate_shared_memory(gl.bfloat16, [ACT_CHUNKS, BM, KC], a0.layout)
    full = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    act_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(act_bar, count=1)
    gl.warp_specialize([
        (_consumer, (a0, a1, a2, a3, o0, o1, o2, o3, ring, full, empty, act, act_bar, sync_ptr, layers, pid, nprog,
                     LIGHT, NS, ACT, PIPE, SYNC, MMA)),
        (_producer, (w0, w1, w2, w3, ring, full, empty, layers, pid, nprog, NS, TILED)),
    ], [1], [40])


@gluon.jit
def _stream_consumer(ring, full, empty, chunks, NS: gl.constexpr):
    for it in range(chunks):
        s = it % NS
        mbarrier.wait(full.index(s), (it // NS) & 1)
        mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def _stream_producer(desc, ring, full, empty, first, chunks, NS: gl.constexpr, R: gl.constexpr):
    for it in range(chunks):
        s = it % NS
        mbarrier.wait(empty.index(s), ((it // NS) & 1) ^ 1)
        mbarrier.expect(full.index(s), R * KC * 2)
        tma.async_copy_global_to_shared(desc, [(first + it) * R, 0], full.index(s), ring.index(s))


@gluon.jit
def _stream_kernel(desc, chunks, NS: gl.constexpr, R: gl.constexpr):
    # the TMA streaming rate alone: each program reads its `chunks` consecutive (R, KC) boxes of a (rows, KC) buffer
    # through a ring of NS slots, released as soon as they land
    ring = gl.allocate_shared_memory(gl.bfloat16, [NS, R, KC], desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_stream_consumer, (ring, full, empty, chunks, NS)),
        (_stream_producer, (desc, ring, full, empty, gl.program_id(0) * chunks, chunks, NS, R)),
    ], [1], [40])


def stream_rates(torch, ws: list, layers: int) -> list[dict]:
    """TB/s of `_stream_kernel` over every layer's weights (as one (rows, KC) buffer) per box size and ring depth."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    flat = torch.cat([w.reshape(-1) for w in ws]).view(-1, _KC)
    sms = torch.cuda.get_device_properties(flat.device).multi_processor_count
    out = []
    for r, ns in ((64, 8), (64, 16), (128, 8), (128, 12), (256, 4), (256, 6)):
        chunks = flat.shape[0] // r // sms
        layout = gl.NVMMASharedLayout.get_default_for([r, _KC], gl.bfloat16)
        desc = TensorDescriptor.from_tensor(flat, [r, _KC], layout)
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _stream_kernel[(sms,)](desc, chunks, NS=ns, R=r, num_warps=4)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = sorted(times)[10]
        nbytes = chunks * sms * r * _KC * 2
        row = {"box_rows": r, "box_kb": r * _KC * 2 // 1024, "ring_slots": ns, "tb_s": round(nbytes / t / 1e12, 2),
               "us_per_layer_bytes": round(t / (nbytes / (flat.numel() * 2 / layers)) * 1e6, 2)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def _descs(torch, layers: int, device: str):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    g = torch.Generator(device=device).manual_seed(0)
    w_layout = gl.NVMMASharedLayout.get_default_for([_BN, _KC], gl.bfloat16)
    a_layout = gl.NVMMASharedLayout.get_default_for([_BM, _KC], gl.bfloat16)
    ws, acts, outs, wd, ad, td = [], [], [], [], [], []
    for n, k, splits in PHASES:
        w = torch.randn(layers * n, k, generator=g, device=device, dtype=torch.bfloat16) * k ** -0.5
        a = torch.zeros(_BM, k, device=device, dtype=torch.bfloat16)
        a[:_ROWS] = torch.randn(_ROWS, k, generator=g, device=device, dtype=torch.bfloat16)
        ws.append(w)
        acts.append(a)
        outs.append(torch.zeros(splits, _BM, n, device=device, dtype=torch.float32))
        wd.append(TensorDescriptor.from_tensor(w, [_BN, _KC], w_layout))
        tiled = w.view(layers * n // _BN, _BN, k // _KC, _KC).permute(0, 2, 1, 3).contiguous().view(-1, _KC)
        td.append(TensorDescriptor.from_tensor(tiled, [_BN, _KC], w_layout))
        ad.append(TensorDescriptor.from_tensor(a, [_BM, _KC], a_layout))
    return ws, acts, outs, wd, ad, td


def compile_only(act_chunks: int, stages) -> None:
    """Compile the variants for sm_90 (no GPU needed) and print their shared memory and key PTX instructions."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = _ws_layers_kernel.arg_names
    w_layout = gl.NVMMASharedLayout.get_default_for([_BN, _KC], gl.bfloat16)
    a_layout = gl.NVMMASharedLayout.get_default_for([_BM, _KC], gl.bfloat16)
    sig = {}
    for n in names:
        if n[0] == "w" and len(n) == 2:
            sig[n] = f"tensordesc<bf16[{_BN}, {_KC}],{w_layout!r}>"
        elif n[0] == "a" and len(n) == 2:
            sig[n] = f"tensordesc<bf16[{_BM}, {_KC}],{a_layout!r}>"
        else:
            sig[n] = {"sync_ptr": "*i32", "layers": "i32"}.get(n, "*fp32" if n[0] == "o" else "constexpr")
    for light in (0, 1):
        for ns in stages:
            constexprs = {(names.index(k),): v for k, v in dict(LIGHT=light, NS=ns, ACT_CHUNKS=act_chunks, ACT=1,
                                                                    PIPE=1, SYNC=1, MMA=1, TILED=1).items()}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
            t0 = time.perf_counter()
            kernel = triton.compile(GluonASTSource(_ws_layers_kernel, sig, constexprs, attrs),
                                    target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            ptx = kernel.asm["ptx"]
            barriers = sorted({ln.strip() for ln in ptx.splitlines() if "bar.sync" in ln or "barrier.sync" in ln})
            print(f"light {light} ring {ns}: compiled in {time.perf_counter() - t0:.1f} s, shared "
                  f"{kernel.metadata.shared} B, tma loads {ptx.count('cp.async.bulk.tensor')}, wgmma "
                  f"{ptx.count('wgmma.mma_async')}, barriers "
                  f"{barriers}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    # LIGHT:NS:ACT:PIPE:SYNC:MMA:TILED per variant (light phases, ring slots, activation loads, pipelined wgmma,
    # barriers, wgmma, chunk-contiguous weights); ACT, SYNC and MMA off only to time the kernel without them
    ap.add_argument("--variants", default="0:16:1:0:1:1:1,0:16:0:0:0:0:1")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    act_chunks = max(k // s // _KC for _, k, s in PHASES)
    if args.compile_only:
        compile_only(act_chunks, [16])
        return
    import torch

    dev = "cuda"
    ws, acts, outs, wd, ad, td = _descs(torch, args.layers, dev)
    sync = torch.zeros(2, device=dev, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    variants = [dict(LIGHT=light, NS=ns, ACT=act, PIPE=pipe, SYNC=sync, MMA=mma, TILED=tiled)
                for light, ns, act, pipe, sync, mma, tiled in
                (tuple(int(x) for x in v.split(":")) for v in args.variants.split(","))]
    for v in variants:
        def launch(v=v):
            _ws_layers_kernel[(sms,)](*(td if v["TILED"] else wd), *ad, *outs, sync, args.layers,
                                      ACT_CHUNKS=act_chunks, num_warps=4, **v)
        launch()
        torch.cuda.synchronize()
        err = 0.0  # the last layer's partials summed over the splits, against torch
        for (n, _, _), w, a, o in zip(PHASES, ws, acts, outs, strict=True):
            ref = a[:_ROWS].float() @ w[(args.layers - 1) * n:].float().T
            err = max(err, float((o.sum(0)[:_ROWS] - ref).abs().max() / ref.abs().max()))
            o.zero_()
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            launch()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        us = sorted(times)[len(times) // 2] / args.layers * 1e6
        row = {**{k.lower(): val for k, val in v.items()}, "us_per_layer": round(us, 2), "rel_err": err}
        rows.append(row)
        print(json.dumps(row), flush=True)
    streams = stream_rates(torch, ws, args.layers)
    copies = []  # HBM reference: copying every layer's weights (read + write), us per layer's bytes read
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for w in ws:
            w.clone()
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - t0)
    weight_mb = sum(n * k * 2 for n, k, _ in PHASES) / 2**20
    copy_tb_s = 2 * weight_mb * 2**20 * args.layers / sorted(copies)[5] / 1e12
    print(json.dumps({"copy_tb_s": round(copy_tb_s, 2), "weights_at_copy_rate_us_per_layer":
                      round(weight_mb * 2**20 / (copy_tb_s * 1e12) * 1e6, 2)}), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "layers": args.layers, "weight_mb_per_layer": round(weight_mb, 1), "copy_tb_s": round(copy_tb_s, 2),
              "rows": rows, "tma_stream": streams}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
