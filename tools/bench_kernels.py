"""Micro-benchmark of the local modules' dense attention kernel at the DiT's and LocEnc's decode shapes,
over its launch parameters (query heads per program, warps): which setting each batch size should use.
Times come from CUDA events over CUDA-graph replays (launch cost excluded, as inside the captured step).

    python tools/bench_kernels.py --model /tmp/full --batch 1,8,64,128 --out kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import triton_kernels  # noqa: E402
from engine.config import VoxCPMConfig  # noqa: E402
from engine.models.minicpm import rotary_table  # noqa: E402
from tools.profile_step import graph_ms  # noqa: E402


def replay_us(fn: Callable[[], object]) -> float:
    """Mean microseconds of `fn` captured in a CUDA graph and replayed."""
    return 1000 * graph_ms(fn, reps=50)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="checkpoint directory (only its config is read)")
    ap.add_argument("--batch", default="1,8,64,128")
    ap.add_argument("--out")
    a = ap.parse_args()
    cfg = VoxCPMConfig.from_dir(a.model)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, tcfg, seq_len, per_request in (("DiT", cfg.dit, 2 * cfg.patch_size + 1 + 2, 2),
                                             ("LocEnc", cfg.encoder, cfg.patch_size + 1, 1)):
        hq, hk, d = tcfg.num_attention_heads, tcfg.num_key_value_heads, tcfg.head_dim
        rope = rotary_table(tcfg, seq_len, dev)
        for b in (int(x) for x in a.batch.split(",")):
            n = b * per_request
            # q, k, v as views of one fused projection output, as the model hands them over
            qkv = torch.randn(n, seq_len, (hq + 2 * hk) * d, device=dev, dtype=dtype)
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q, k, v = q.view(n, seq_len, hq, d), k.view(n, seq_len, hk, d), v.view(n, seq_len, hk, d)
            group = hq // hk
            attend = partial(triton_kernels.dense_attention, q, k, v, rope[:, 0], rope[:, 1])
            for heads in (h for h in (1, 2, 4, 8, 16) if group % h == 0):
                for warps in (1, 2, 4, 8):
                    us = replay_us(partial(attend, heads_per_program=heads, num_warps=warps))
                    rows.append({"module": name, "batch": b, "sequences": n, "seq_len": seq_len,
                                 "heads_per_program": heads, "num_warps": warps, "us": round(us, 2)})
            best = min((r for r in rows if r["module"] == name and r["batch"] == b), key=lambda r: r["us"])
            auto = replay_us(attend)
            print(f"{name} B={b}: default {auto:.1f} us, best {best['us']:.1f} us at heads={best['heads_per_program']} "
                  f"warps={best['num_warps']}", flush=True)
            rows.append({"module": name, "batch": b, "sequences": n, "seq_len": seq_len, "heads_per_program": "default",
                         "num_warps": 2 if n * hq >= 256 else 4, "us": round(auto, 2)})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
