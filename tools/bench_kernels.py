"""Micro-benchmarks of kernels over their launch parameters: the local modules' dense attention at the DiT's and
LocEnc's decode shapes (query heads per program, warps), and the VAE upsampler kernel against cuDNN per decoder
stage (precision, tiles): which setting each batch size should use.
Times come from CUDA events over CUDA-graph replays (launch cost excluded, as inside the captured step).

    python tools/bench_kernels.py --model /tmp/full --batch 1,8,64,128 --out kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import triton_kernels  # noqa: E402
from engine.config import VoxCPMConfig  # noqa: E402
from engine.models.minicpm import rotary_table  # noqa: E402


def replay_us(fn, reps: int = 50) -> float:
    """Mean microseconds of `fn` captured in a CUDA graph and replayed `reps` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps


def conv_transpose_cat(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                       stride: int) -> torch.Tensor:
    """The module's cuDNN path: context concatenated, full transposed conv (its kept slice is a view)."""
    return torch.nn.functional.conv_transpose1d(torch.cat([state, x], -1), w, bias, stride)


def conv_transpose_rows(cfg: VoxCPMConfig, batches: list[int], dev: torch.device) -> list[dict]:
    """The VAE decoder's upsamplers at one patch per stream: cuDNN (benchmark mode, what the module runs) vs the
    Triton kernel over its precision and tiles."""
    from engine.models.audio_vae import AudioVAEConfig

    vae = AudioVAEConfig.from_dict(cfg.audio_vae, version=cfg.version)
    torch.backends.cudnn.benchmark = True
    frames, rows = cfg.patch_size, []
    for b in batches:
        n = frames
        for i, stride in enumerate(vae.decoder_rates):
            c_in, c_out = vae.decoder_dim // 2**i, vae.decoder_dim // 2 ** (i + 1)
            w = torch.randn(c_in, c_out, 2 * stride, device=dev) * c_in**-0.5
            bias = torch.randn(c_out, device=dev)
            x = torch.randn(b, c_in, n, device=dev)
            state = torch.randn(b, c_in, 1, device=dev)
            w_kio = w.permute(2, 0, 1).contiguous()
            row = {"module": f"ConvT{i} {c_in}->{c_out} x{stride}", "batch": b, "frames": n}
            cudnn = partial(conv_transpose_cat, x, state, w, bias, stride)
            row["cudnn_us"] = round(replay_us(cudnn), 1)
            for tf32 in (True, False):
                for tiles in (None, (64, 64, 32, 4), (128, 64, 32, 4), (64, 128, 32, 4), (64, 64, 64, 4),
                              (128, 128, 32, 8)):
                    if tiles is not None and (tiles[0] > max(16, c_out) * 2 or tiles[2] > c_in):
                        continue
                    us = replay_us(partial(triton_kernels.causal_conv_transpose, x, state, w_kio, bias, stride, tf32,
                                           tiles))
                    row[f"triton_{'tf32' if tf32 else 'ieee'}_{tiles or 'default'}_us"] = round(us, 1)
            best = min((v, k) for k, v in row.items() if k.startswith("triton"))
            print(f"{row['module']} B={b}: cuDNN {row['cudnn_us']} us, Triton best {best[0]} us ({best[1]})",
                  flush=True)
            rows.append(row)
            n *= stride
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="checkpoint directory (only its config is read)")
    ap.add_argument("--batch", default="1,8,64,128")
    ap.add_argument("--parts", default="attention,conv_transpose")
    ap.add_argument("--out")
    a = ap.parse_args()
    parts = a.parts.split(",")
    cfg = VoxCPMConfig.from_dir(a.model)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    modules = [("DiT", cfg.dit, 2 * cfg.patch_size + 1 + 2, 2), ("LocEnc", cfg.encoder, cfg.patch_size + 1, 1)]
    for name, tcfg, seq_len, per_request in modules if "attention" in parts else []:
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
                         "num_warps": 4, "us": round(auto, 2)})
    if "conv_transpose" in parts:
        rows += conv_transpose_rows(cfg, [int(x) for x in a.batch.split(",")], dev)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
