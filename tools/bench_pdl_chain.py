"""The LMs' one-row decode chain on the engine's own kernels, three ways (engine/pdl.py): the projections on cuBLAS and
the skinny gate/up kernel (`VOXCPM_GEMV_MAX_ROWS=0`, the engine before the GEMV), on the GEMV kernel with plain
launches (`VOXCPM_PDL=0`), and on the GEMV kernel chained by programmatic dependent launch (the default).

Per layer, LM shapes of the checkpoint's config, every layer its own weights (they stream from HBM, as in a step):
q/k/v -> o (of the normed rows: no attention) -> add + RMSNorm -> gate/up + SiLU -> down -> add + RMSNorm, through
`engine.fused` exactly as `MiniCPM`'s layers call it. Microseconds per layer from CUDA-graph replays; the outputs of
the three must agree within bf16 rounding (the GEMV sums in another order than cuBLAS) and the two GEMV ways exactly.

    python tools/bench_pdl_chain.py --model /tmp/full --rows 1,2 --out pdl_chain.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import fused, pdl  # noqa: E402
from engine.config import VoxCPMConfig  # noqa: E402
from tools.profile_step import graph_ms  # noqa: E402

WAYS = {"cublas+skinny": (True, 0), "gemv": (False, None), "gemv+pdl": (True, None)}  # (pdl.ENABLED, GEMV_MAX_ROWS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="checkpoint directory or preset JSON (engine/presets); config only")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--out")
    args = ap.parse_args()
    src = Path(args.model)
    cfg = (VoxCPMConfig.from_dir(src) if src.is_dir() else VoxCPMConfig.from_dict(json.loads(src.read_text()))).lm
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    nqkv, f = q + 2 * cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    if q != h:
        raise SystemExit("the o projection reads the normed rows in place of the attention output: needs q == hidden")
    torch.manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev) * k ** -0.5).to(dt)

    layers = [dict(qkv=weight(nqkv, h), o=weight(h, q), gate_up=weight(2 * f, h), down=weight(h, f),
                   norm1=torch.rand(h, device=dev).to(dt) + 0.5, norm2=torch.rand(h, device=dev).to(dt) + 0.5)
              for _ in range(args.layers)]
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x0 = torch.randn(rows, h, device=dev, dtype=dt)

        def chain(x0: torch.Tensor = x0) -> torch.Tensor:
            x = x0
            normed = fused.rms_norm(x, layers[0]["norm1"], 1e-5)
            for lw in layers:
                fused.linear(normed, lw["qkv"])
                x, normed = fused.add_rms_norm(x, fused.residual_linear(normed, lw["o"]), None, lw["norm2"], 1e-5)
                gated = fused.silu_gate_linear(normed, lw["gate_up"])
                x, normed = fused.add_rms_norm(x, fused.residual_linear(gated, lw["down"]), None, lw["norm1"], 1e-5)
            return normed

        outs = {}
        for way, (enabled, max_rows) in WAYS.items():
            with mock.patch.object(pdl, "ENABLED", enabled), \
                    mock.patch.object(pdl, "GEMV_MAX_ROWS", max(rows, 1) if max_rows is None else max_rows):
                outs[way] = chain().float()
                us = 1000 * graph_ms(chain, reps=20) / args.layers
            err = (outs[way] - outs["cublas+skinny"]).abs().max().item()
            print(f"rows={rows} {way}: {us:.2f} us per layer (max |diff| vs cublas+skinny {err:.3g})", flush=True)
            results.append(dict(rows=rows, way=way, us_per_layer=round(us, 3), max_abs_diff=err))
        same = torch.equal(outs["gemv"], outs["gemv+pdl"])
        print(f"rows={rows}: gemv and gemv+pdl outputs identical: {same}", flush=True)
        results.append(dict(rows=rows, gemv_pdl_identical=same))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  layers=args.layers, results=results), indent=1))


if __name__ == "__main__":
    main()
