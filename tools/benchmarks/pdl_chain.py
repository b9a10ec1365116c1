"""Decode chains of a few rows on the engine's own kernels, each way the engine can run them (engine/pdl.py).

`--stack lm` (default): the LMs' layers without attention, LM shapes of the checkpoint's config, every layer its own
weights (they stream from HBM, as in a step): q/k/v -> o (of the normed rows) -> add + RMSNorm -> gate/up + SiLU ->
down -> add + RMSNorm, through `engine.ops` exactly as `MiniCPM`'s layers call it. Ways: cuBLAS and the skinny
gate/up kernel (the engine before the GEMV chain of `bc6e1e7`), and at one row the GEMV with plain launches and
chained by PDL.

`--stack dit` / `--stack locenc`: the real local stack (`MiniCPM` with random weights of the config's shapes, its
dense attention with the rotary embedding), `--seqs` sequences of `--seq-len` tokens (the DiT at B=1: 2 x 11, at B=8
16 x 11). Ways: the cooperative layer kernel (`engine.triton_layer`, up to its 64 rows) and the layers as separate
kernels (cuBLAS GEMMs, the Triton attention and element-wise kernels).

Microseconds per layer from CUDA-graph replays; every way's output is compared with the first one's (bf16 rounding
and summation order differ between them) and, for the chained way, with the same kernels' plain launches (equal).

    python tools/bench.py pdl-chain --model /tmp/full --rows 1,2,8 --out pdl_chain.json
    python tools/bench.py pdl-chain --model /tmp/full --stack dit --seqs 2,16,32 --seq-len 11
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine import options
from engine.config import TransformerConfig, VoxCPMConfig
from engine.models.minicpm import MiniCPM, fuse_projections, rotary_table
from engine.ops import linear, norm
from tools.benchmarks.harness import subcommand_parser
from tools.profiling.step import graph_ms

# way -> the engine options set for it; None for gemv_max_rows means "the rows measured"
LM_WAYS: dict[str, dict[str, object]] = {
    "cublas+skinny": {"pdl": True, "gemv_max_rows": 0},
    "gemv": {"pdl": False, "gemv_max_rows": None},
    "gemv+pdl": {"pdl": True, "gemv_max_rows": None},
}
STACK_WAYS: dict[str, dict[str, object]] = {
    "layer kernel": {},
    "separate kernels": {"layer_kernel": "off"},
}
# a chained way and the same kernels launched plainly: their outputs must be equal
PLAIN_OF = {"gemv+pdl": "gemv"}


@contextlib.contextmanager
def patched(way: dict[str, object], rows: int) -> Iterator[None]:
    with options.override(**{name: rows if value is None else value for name, value in way.items()}):
        yield


def measure(label: str, ways: dict[str, list[tuple[object, str, object]]], rows: int, layers: int,
            run: Callable[[], torch.Tensor], results: list[dict]) -> None:
    outs: dict[str, torch.Tensor] = {}
    for way, patches in ways.items():
        with patched(patches, rows):
            outs[way] = run().float().clone()
            us = 1000 * graph_ms(run, reps=20) / layers
        first = next(iter(outs.values()))
        err = (outs[way] - first).abs().max().item()
        print(f"{label} {way}: {us:.2f} us per layer (max |diff| vs {next(iter(outs))}: {err:.3g})", flush=True)
        results.append(dict(case=label, rows=rows, way=way, us_per_layer=round(us, 3), max_abs_diff=err))
    for chained, plain in PLAIN_OF.items():
        if chained in outs and plain in outs:
            same = torch.equal(outs[chained], outs[plain])
            print(f"{label}: {chained} and {plain} outputs identical: {same}", flush=True)
            results.append(dict(case=label, rows=rows, identical=[chained, plain], equal=same))


def lm_chain(cfg: TransformerConfig, rows_list: list[int], layers_n: int, results: list[dict]) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    nqkv, f = q + 2 * cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    if q != h:
        raise SystemExit("the o projection reads the normed rows in place of the attention output: needs q == hidden")

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev) * k ** -0.5).to(dt)

    layers = [dict(qkv=weight(nqkv, h), o=weight(h, q), gate_up=weight(2 * f, h), down=weight(h, f),
                   norm1=torch.rand(h, device=dev).to(dt) + 0.5, norm2=torch.rand(h, device=dev).to(dt) + 0.5)
              for _ in range(layers_n)]
    for rows in rows_list:
        x0 = torch.randn(rows, h, device=dev, dtype=dt)

        def chain(x0: torch.Tensor = x0) -> torch.Tensor:
            x = x0
            normed = norm.rms_norm(x, layers[0]["norm1"], 1e-5)
            for lw in layers:
                linear.linear(normed, lw["qkv"])
                x, normed = norm.add_rms_norm(x, linear.residual_linear(normed, lw["o"]), None, lw["norm2"], 1e-5)
                gated = linear.silu_gate_linear(normed, lw["gate_up"])
                x, normed = norm.add_rms_norm(x, linear.residual_linear(gated, lw["down"]), None, lw["norm1"], 1e-5)
            return normed

        ways = {w: p for w, p in LM_WAYS.items() if rows == 1 or not w.startswith("gemv")}
        measure(f"lm rows={rows}", ways, rows, layers_n, chain, results)


def local_stack(cfg: TransformerConfig, seqs_list: list[int], seq_len: int, label: str, results: list[dict]) -> None:
    dev = torch.device("cuda")
    with torch.device(dev):
        stack = MiniCPM(cfg).to(torch.bfloat16).eval()
    for p in stack.parameters():  # random weights of the init's scale; the norms near one
        with torch.no_grad():
            p.copy_(torch.rand_like(p) + 0.5 if p.dim() == 1 else torch.randn_like(p) * p.shape[-1] ** -0.5)
    fuse_projections(stack)
    rope = rotary_table(cfg, seq_len, dev)
    for seqs in seqs_list:
        x0 = torch.randn(seqs, seq_len, cfg.hidden_size, device=dev, dtype=torch.bfloat16)

        @torch.inference_mode()
        def run(x0: torch.Tensor = x0) -> torch.Tensor:
            return stack.forward_local(x0, rope)

        fits = seqs * seq_len <= options.current().layer_max_rows
        ways = {w: p for w, p in STACK_WAYS.items() if fits or w != "layer kernel"}
        measure(f"{label} {seqs}x{seq_len}", ways, seqs * seq_len, cfg.num_hidden_layers, run, results)


def main(argv: list[str]) -> None:
    ap = subcommand_parser("pdl-chain", __doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory or preset JSON "
                    "(engine/io/presets); config only")
    ap.add_argument("--stack", choices=("lm", "dit", "locenc"), default="lm")
    ap.add_argument("--rows", default="1", help="lm: activation rows")
    ap.add_argument("--layers", type=int, default=28, help="lm: layers")
    ap.add_argument("--seqs", default="2", help="dit/locenc: sequences (the DiT has two per request: CFG)")
    ap.add_argument("--seq-len", type=int, default=11, help="dit/locenc: tokens per sequence")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    src = Path(args.model)
    cfg = VoxCPMConfig.from_dir(src) if src.is_dir() else VoxCPMConfig.from_dict(json.loads(src.read_text()))
    torch.manual_seed(0)
    results: list[dict] = []
    if args.stack == "lm":
        lm_chain(cfg.lm, [int(r) for r in args.rows.split(",")], args.layers, results)
    else:
        local_stack(cfg.dit if args.stack == "dit" else cfg.encoder, [int(s) for s in args.seqs.split(",")],
                    args.seq_len, args.stack, results)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  stack=args.stack, results=results), indent=1))
