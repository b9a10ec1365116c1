"""Does staging a phase's weights in shared memory before the grid barrier that precedes it pay? (GPU, sm_90)

The local modules' layer kernel (`engine/triton_layer.py`) runs a DiT layer at B=1 in ~30 us on an H100 where its
35 MB of weights take ~11.5 us at HBM rate: every phase starts its weight stream only after the barrier before it
(a DRAM round trip and a pipeline ramp each time), because Triton ties a kernel's loads to the loop that consumes
them. Gluon (Triton's lower-level dialect) gives explicit shared memory and cp.async groups, so a program can copy
its unit of the next projection into shared memory while it still computes the current one and waits at the
barrier. This measures that on the DiT's four projections (q/k/v, o split 4 ways along K, gate/up, down split 4
ways; 32-column units, one persistent program per SM, 12 layers with their own weights, the rows' activations
from L2), with grid barriers between the phases, both ways:

  staged 0: each phase copies its weights after the barrier (chunk by chunk, consumed as they land);
  staged 1: each phase's weights were issued two phases earlier, right after this program's last use of the buffer.

The activations are fixed inputs (not the previous phase's output) and the outputs fp32 partials: the timing
structure of the layer's projection phases, not its arithmetic. Reference: the layer kernel's projection phases
(`tools/bench_kernels.py --only layer`, "per phase" 1, 3, 5, 6: ~25 us of the 30). Prints us per layer for both
and writes JSON.

    python tools/bench_staged_weights.py --layers 12 --out staged.json        # on the GPU machine
    python tools/bench_staged_weights.py --compile-only                      # here: compiles for sm_90, no GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the experimental stack kernel's building blocks: its weight copies, projections and grid barrier
from engine.gluon_layer import BN, GROUP_CHUNKS, KC, SPLITS, _issue, _project, _release, _store_tile, _sync  # noqa: E402

BM = 32  # activation rows (22 padded)
H, QKV, F = 1024, 2560, 4096  # the DiT's shapes (VoxCPM2), split SPLITS ways along K for o and down
# per phase: (weight rows, weight K, units, chunks per unit, commit groups per unit, gated)
VARIANTS = ((0, 0), (1, 0), (0, 1), (1, 1))  # (staged, light phases)
PHASES = ((QKV, H, QKV // BN, H // KC, 4, False), (H, 2 * H, H // BN * SPLITS, 2 * H // SPLITS // KC, 2, False),
          (2 * F, H, F // BN, 2 * H // KC, 8, True), (H, F, H // BN * SPLITS, F // SPLITS // KC, 4, False))


@gluon.jit
def _light_phase(src_ptr, dst_ptr, sync_ptr, target, pid, UNITS: gl.constexpr, H: gl.constexpr):
    # a phase without weights (a norm's or the attention's stand-in): a barrier, then UNITS programs each read a row
    # of H activations (written by other programs: L2) and write it elsewhere
    _sync(sync_ptr, target)
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
    cols = gl.arange(0, H, layout=layout)
    if pid < UNITS:
        x = gl.load(src_ptr + pid * H + cols, cache_modifier=".cg")
        gl.store(dst_ptr + pid * H + cols, x + 1)


@gluon.jit
def _compute(buf, act_ptr, out_ptr, unit, UNITS: gl.constexpr, K: gl.constexpr, NCH: gl.constexpr,
             NEWER: gl.constexpr, SPLIT: gl.constexpr, GATED: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
             KC: gl.constexpr, GROUP_CHUNKS: gl.constexpr, SPLITS: gl.constexpr):
    # the unit's product (gate + up where gated) as fp32 (BM, BN) at out_ptr + unit * BN * BM
    acc, acc_up = _project(buf, act_ptr, unit, BM, K, NCH, NEWER, SPLIT, GATED, BN, BM, KC, GROUP_CHUNKS, SPLITS)
    if unit < UNITS:
        _store_tile(out_ptr + unit * BN * BM, acc + acc_up, BM, BN, 0, BN, BM)


@gluon.jit
def _phase(buf, w_ptr, a_ptr, out_ptr, w_later_ptr, light_ptr, sync_ptr, bar, pid, nprog, U: gl.constexpr,
           R: gl.constexpr, K: gl.constexpr, C: gl.constexpr, SPLIT: gl.constexpr, GATED: gl.constexpr,
           U_LATER: gl.constexpr, R_LATER: gl.constexpr, K_LATER: gl.constexpr, C_LATER: gl.constexpr,
           SPLIT_LATER: gl.constexpr, GATED_LATER: gl.constexpr, NEWER: gl.constexpr, LIGHT_UNITS: gl.constexpr,
           STAGED: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, KC: gl.constexpr, GROUP_CHUNKS: gl.constexpr,
           SPLITS: gl.constexpr):
    # One projection phase (after a light phase with LIGHT_UNITS > 0), barriers counted on from `bar` (returned).
    # Not staged: its weights (w) copied after the barrier. Staged: they were issued two phases earlier, NEWER groups
    # have been committed since, and the buffer takes the weights two phases on (w_later) once this phase is done.
    if LIGHT_UNITS > 0:
        bar += 1
        _light_phase(light_ptr, light_ptr + 32 * 1024, sync_ptr, bar * nprog, pid, LIGHT_UNITS, 1024)
    bar += 1
    _sync(sync_ptr, bar * nprog)
    if not STAGED:
        _issue(buf, w_ptr, pid, True, U, R, K, C, SPLIT, GATED, BN, KC, GROUP_CHUNKS, SPLITS)
    _compute(buf, a_ptr, out_ptr, pid, U, K, C, NEWER if STAGED else 0, SPLIT, GATED, BN, BM, KC, GROUP_CHUNKS,
             SPLITS)
    if STAGED:  # every warp done reading the buffer before it is overwritten
        gl.thread_barrier()
        _issue(buf, w_later_ptr, pid, True, U_LATER, R_LATER, K_LATER, C_LATER, SPLIT_LATER, GATED_LATER, BN, KC,
               GROUP_CHUNKS, SPLITS)
    return bar


@gluon.jit
def _chain_kernel(w0, w1, w2, w3, a0, a1, a2, a3, out_ptr, light_ptr, sync_ptr, layers, STAGED: gl.constexpr,
                  LIGHT: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, KC: gl.constexpr,
                  GROUP_CHUNKS: gl.constexpr, SPLITS: gl.constexpr):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    # q/k/v and gate/up (phases 0 and 2) in one buffer, o and down (1 and 3) in the other
    buf_a = gl.allocate_shared_memory(gl.bfloat16, [32, BN, KC], smem_layout)
    buf_b = gl.allocate_shared_memory(gl.bfloat16, [16, BN, KC], smem_layout)
    # (rows, K, units, chunks, groups, split, gated) of the four phases (the module's PHASES)
    R0: gl.constexpr = 2560
    K0: gl.constexpr = 1024
    U0: gl.constexpr = 80
    C0: gl.constexpr = 16
    G0: gl.constexpr = 4
    R1: gl.constexpr = 1024
    K1: gl.constexpr = 2048
    U1: gl.constexpr = 128
    C1: gl.constexpr = 8
    G1: gl.constexpr = 2
    R2: gl.constexpr = 8192
    K2: gl.constexpr = 1024
    U2: gl.constexpr = 128
    C2: gl.constexpr = 32
    G2: gl.constexpr = 8
    R3: gl.constexpr = 1024
    K3: gl.constexpr = 4096
    U3: gl.constexpr = 128
    C3: gl.constexpr = 16
    G3: gl.constexpr = 4
    S0: gl.constexpr = R0 * K0
    S1: gl.constexpr = R1 * K1
    S2: gl.constexpr = R2 * K2
    S3: gl.constexpr = R3 * K3
    out1 = out_ptr + U0 * BN * BM
    out2 = out1 + U1 * BN * BM
    out3 = out2 + U2 * BN * BM
    if STAGED:
        _issue(buf_a, w0, pid, True, U0, R0, K0, C0, False, False, BN, KC, GROUP_CHUNKS, SPLITS)
        _issue(buf_b, w1, pid, True, U1, R1, K1, C1, True, False, BN, KC, GROUP_CHUNKS, SPLITS)
    bar = 0
    for layer in range(layers):
        nxt = (layer + 1) % layers  # the last layer issues the first's again: the group counts stay static
        # q/k/v after the input norm, then o after the attention, gate/up after the norm, down (light: the three
        # weightless phases' stand-ins, 22 rows or 32 (sequence, head) pairs)
        bar = _phase(buf_a, w0 + layer * S0, a0, out_ptr, w2 + layer * S2, light_ptr, sync_ptr, bar, pid, nprog,
                     U0, R0, K0, C0, False, False, U2, R2, K2, C2, False, True, G1, 22 * LIGHT, STAGED, BN, BM, KC,
                     GROUP_CHUNKS, SPLITS)
        bar = _phase(buf_b, w1 + layer * S1, a1, out1, w3 + layer * S3, light_ptr, sync_ptr, bar, pid, nprog,
                     U1, R1, K1, C1, True, False, U3, R3, K3, C3, True, False, G2, 32 * LIGHT, STAGED, BN, BM, KC,
                     GROUP_CHUNKS, SPLITS)
        bar = _phase(buf_a, w2 + layer * S2, a2, out2, w0 + nxt * S0, light_ptr, sync_ptr, bar, pid, nprog,
                     U2, R2, K2, C2, False, True, U0, R0, K0, C0, False, False, G3, 22 * LIGHT, STAGED, BN, BM, KC,
                     GROUP_CHUNKS, SPLITS)
        bar = _phase(buf_b, w3 + layer * S3, a3, out3, w1 + nxt * S1, light_ptr, sync_ptr, bar, pid, nprog,
                     U3, R3, K3, C3, True, False, U1, R1, K1, C1, True, False, G0, 0, STAGED, BN, BM, KC,
                     GROUP_CHUNKS, SPLITS)
    async_copy.wait_group(0)
    _release(sync_ptr, nprog)


def compile_only() -> dict[tuple[int, int], tuple[int, int, int]]:
    """Compile every variant for sm_90 (no GPU needed): {(staged, light): (shared memory bytes, cp.async and mma
    instructions in the PTX)}."""
    compiled = {}
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    names = _chain_kernel.arg_names
    sig = {n: ("*bf16" if n[0] in "wa" and len(n) == 2 or n == "light_ptr" else "*fp32" if n == "out_ptr"
               else "*i32" if n == "sync_ptr" else "i32" if n == "layers" else "constexpr") for n in names}
    for staged, light in VARIANTS:
        constexprs = {(names.index(k),): v for k, v in dict(STAGED=staged, LIGHT=light, BN=BN, BM=BM, KC=KC,
                                                                   GROUP_CHUNKS=GROUP_CHUNKS, SPLITS=SPLITS).items()}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
        t0 = time.perf_counter()
        kernel = triton.compile(GluonASTSource(_chain_kernel, sig, constexprs, attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = kernel.asm["ptx"]
        print(f"staged {staged} light {light}: compiled in {time.perf_counter() - t0:.1f} s, shared "
              f"{kernel.metadata.shared} B, cp.async {ptx.count('cp.async.c')}, mma {ptx.count('mma.sync')}",
              flush=True)
        compiled[(staged, light)] = (kernel.metadata.shared, ptx.count("cp.async.c"), ptx.count("mma.sync"))
    return compiled


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.compile_only:
        compile_only()
        return
    import torch

    from tools.profile_step import graph_ms
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    weights = [torch.randn(a.layers, rows, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
               for rows, k, *_ in PHASES]
    acts = [torch.zeros(BM, k, device=dev, dtype=torch.bfloat16) for _, k, *_ in PHASES]
    for act in acts:
        act[:22].normal_()
    out = torch.empty(sum(units for _, _, units, *_ in PHASES) * BN * BM, device=dev, dtype=torch.float32)
    light = torch.randn(2 * 32 * 1024, device=dev, dtype=torch.bfloat16)
    sync = torch.zeros(2, device=dev, dtype=torch.int32)
    result: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                    "triton": triton.__version__, "layers": a.layers, "programs": sms,
                    "weight_mb_per_layer": sum(w[0].numel() * 2 for w in weights) / 2**20,
                    "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    outputs = {}
    for staged, with_light in VARIANTS:
        def run(staged: int = staged, with_light: int = with_light) -> None:
            _chain_kernel[(sms,)](*weights, *acts, out, light, sync, a.layers, STAGED=staged, LIGHT=with_light,
                                  BN=BN, BM=BM, KC=KC, GROUP_CHUNKS=GROUP_CHUNKS, SPLITS=SPLITS,
                                  num_warps=4)
        run()
        torch.cuda.synchronize()
        outputs[(staged, with_light)] = out.clone()
        us = 1000 * graph_ms(run, reps=a.reps) / a.layers
        label = f"staged{staged}_light{with_light}"
        result[f"{label}_us_per_layer"] = round(us, 2)
        print(f"{label}: {us:.2f} us per layer (4 projection phases{', 3 light ones' if with_light else ''})",
              flush=True)
    # the same products both ways (the last layer's), and against torch for the q/k/v phase's first unit
    result["outputs_equal"] = all(torch.equal(outputs[VARIANTS[0]], o) for o in outputs.values())
    ref = (weights[0][-1][:BN].float() @ acts[0].float().T)  # (BN, BM); stored per unit as (BM, BN)
    result["qkv_unit0_max_abs_err"] = float((outputs[(1, 1)][: BN * BM].view(BM, BN).T - ref).abs().max())
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
