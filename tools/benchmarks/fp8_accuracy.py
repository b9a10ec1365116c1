"""How far FP8 weights (EngineConfig.quantization = "fp8") move the model, layer by layer and end to end:

    python tools/bench.py fp8-accuracy --model CKPT --requests 64 --patches 20 --out fp8_accuracy.json

- layers: an eager unquantised engine runs the requests' prefill and --decode-steps decode steps; every projection
  call of at least --min-rows rows (default: EngineOptions.fp8_min_rows, the calls the option applies to) is also
  computed by the FP8 GEMM (`fp8.fp8_linear` where the device has it, else its dequantised eager reference) and in
  fp32. Per stack (base LM, residual LM, LocEnc, DiT) and projection (qkv, o, gate_up, down): the FP8 output's
  relative error against the unquantised (the model's dtype: bf16 on a GPU) one, Frobenius over every call and the
  largest of the calls' max |diff| / max |bf16|, beside the bf16 output's own error against fp32 (its floor).
- end to end: the same seeded requests (different texts, batched together, or --max-num-seqs at a time: 1 measures
  the one-row paths, the GEMV on e4m3 weights) through an unquantised engine and an FP8 one (CUDA graphs where the
  device has them), one after the other in this process: per request the first patch's
  relative error (Frobenius), the mean of its patches' relative errors over the patches both engines made, and the
  patch where each stopped (the stop head's, counted from 1; null: none within --patches); the share of requests
  whose stop agrees. The stop comparison needs a checkpoint whose stop head fires (`make_random_checkpoint.py`
  without --never-stop; with --always-stop every request stops at once, which compares nothing).
- the floor (`reference_floor`): the same comparison between two unquantised runs that differ only in their batching
  (the other run decodes the requests one at a time, or all together where the first did one at a time), whose
  numbers differ by the kernels' tiling alone. How far that alone moves the patches and the stops says how sensitive
  the checkpoint is: a random checkpoint's trajectories can diverge from any rounding difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from engine.engine_config import EngineConfig
from engine.io.checkpoint import load_model
from engine.llm_engine import LLMEngine
from engine.models import minicpm
from engine.models.minicpm import fuse_projections
from engine.ops import fp8
from engine.ops import linear as linear_ops
from engine.options import EngineOptions, current
from engine.sequence import SamplingParams
from tools.benchmarks.harness import TEXT, command_line, subcommand_parser, torch_facts, write_json

KINDS = ("qkv", "o", "gate_up", "down")


def request_texts(n: int) -> list[str]:
    """n different texts: the protocol paragraph's sentences in turn, each with its request's own number."""
    sentences = [s.strip() + "." for s in TEXT.split(".") if s.strip()]
    return [f"Number {i + 1}. {sentences[i % len(sentences)]}" for i in range(n)]


def stacks(backbone: torch.nn.Module) -> dict[str, minicpm.MiniCPM]:
    return {"base_lm": backbone.base_lm, "residual_lm": backbone.residual_lm, "locenc": backbone.feat_encoder.encoder,
            "dit": backbone.feat_decoder.estimator.decoder}


class LayerErrors:
    """Per (stack, kind): the FP8 GEMM's and bf16's outputs of each observed call against each other and fp32."""

    def __init__(self, backbone: torch.nn.Module, min_rows: int, gemm: bool) -> None:
        self.names: dict[int, tuple[str, str]] = {}
        for stack_name, stack in stacks(backbone).items():
            for layer in stack.layers:
                a, m = layer.self_attn, layer.mlp
                for kind, weight in zip(KINDS, (a.qkv_weight, a.o_proj.weight, m.gate_up_weight, m.down_proj.weight),
                                        strict=True):
                    self.names[id(weight)] = (stack_name, kind)
        self.min_rows, self.gemm = min_rows, gemm
        self.companions: dict[int, fp8.Fp8Weight] = {}
        self.sums: dict[tuple[str, str], dict[str, float]] = {}

    def observe(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        key, k_dim = self.names.get(id(weight)), x.shape[-1]
        rows = x.numel() // k_dim
        if key is None or rows < self.min_rows:
            return
        if id(weight) not in self.companions:
            self.companions[id(weight)] = fp8.quantize_weight(weight)
        x2 = x.reshape(-1, k_dim)
        exact = x2.float() @ weight.float().t()
        plain = F.linear(x2, weight).float()
        quantised = (fp8.fp8_linear if self.gemm else fp8.fp8_linear_reference)(x2, self.companions[id(weight)])
        diff = quantised.float() - plain
        s = self.sums.setdefault(key, {"calls": 0, "rows_min": math.inf, "rows_max": 0, "diff2": 0.0, "plain2": 0.0,
                                       "floor2": 0.0, "exact2": 0.0, "max_rel": 0.0})
        s["calls"] += 1
        s["rows_min"], s["rows_max"] = min(s["rows_min"], rows), max(s["rows_max"], rows)
        s["diff2"] += float(diff.square().sum())
        s["plain2"] += float(plain.square().sum())
        s["floor2"] += float((plain - exact).square().sum())
        s["exact2"] += float(exact.square().sum())
        s["max_rel"] = max(s["max_rel"], float(diff.abs().max() / plain.abs().max().clamp_min(1e-30)))

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for (stack_name, kind), s in sorted(self.sums.items()):
            out.append({"stack": stack_name, "kind": kind, "calls": s["calls"], "rows_min": s["rows_min"],
                        "rows_max": s["rows_max"],
                        "fp8_rel_err_vs_bf16": math.sqrt(s["diff2"] / max(s["plain2"], 1e-30)),
                        "fp8_max_rel_err_vs_bf16": s["max_rel"],
                        "bf16_rel_err_vs_fp32": math.sqrt(s["floor2"] / max(s["exact2"], 1e-30))})
        return out

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """The projection entry points of the stacks, each observing its call before it runs."""
        def spy(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(x: torch.Tensor, weight: torch.Tensor) -> Any:
                self.observe(x, weight)
                return original(x, weight)
            return call

        patched = [(linear_ops, "linear"), (linear_ops, "silu_gate_linear"), (minicpm, "residual_linear")]
        originals = [getattr(owner, name) for owner, name in patched]
        for (owner, name), original in zip(patched, originals, strict=True):
            setattr(owner, name, spy(original))
        try:
            yield
        finally:
            for (owner, name), original in zip(patched, originals, strict=True):
                setattr(owner, name, original)


def engine_for(a: Any, quantization: str | None, eager: bool = False, fused: bool = False,
               options: EngineOptions | None = None, max_num_seqs: int | None = None) -> LLMEngine:
    model = load_model(a.model, a.device)
    if fused:  # every projection through the fused weights' entry points (the runner fuses only on CUDA)
        fuse_projections(model.backbone)
    config = EngineConfig(max_num_seqs=max_num_seqs or a.max_num_seqs or a.requests, max_model_len=a.max_model_len,
                          enforce_eager=eager, gpu_memory_utilization=a.gpu_memory_utilization,
                          quantization=quantization,
                          **({"options": options} if options is not None else {}))
    return LLMEngine(model, config, a.device)


def free_device() -> None:
    """The memory of an engine just dropped back to the device, for the next engine's KV sizing."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def params(a: Any, i: int) -> SamplingParams:
    return SamplingParams(seed=i, max_generate_length=a.patches, min_len=a.min_len)


@torch.no_grad()  # not inference mode: the weights loaded inside must stay normal tensors
def layer_errors(a: Any) -> tuple[list[dict[str, Any]], bool]:
    """The layers' part, from one prefill and a few decode steps of an eager unquantised engine (the layer kernel off,
    so that the DiT's and LocEnc's projections run through the observed entry points at any row count)."""
    engine = engine_for(a, None, eager=True, fused=True,
                        options=dataclasses.replace(EngineOptions.from_env(), layer_kernel="off"))
    gemm = fp8.gemm_supported(engine.device, engine.runner.dtype)
    errors = LayerErrors(engine.model.backbone, a.min_rows, gemm)
    for i, text in enumerate(request_texts(a.requests)):
        engine.add_request(text, params(a, i))
    with errors.watching():
        for _ in range(1 + a.decode_steps):
            if engine.has_unfinished():
                engine.step()
    del engine, errors.companions
    free_device()
    return errors.rows(), gemm


@torch.no_grad()  # not inference mode: the weights loaded inside must stay normal tensors
def generate(a: Any, quantization: str | None, max_num_seqs: int | None = None) -> list[dict[str, Any]]:
    """Each request's patches (float32, CPU), how it finished, and where it stopped (max_num_seqs: decoded together,
    default --max-num-seqs)."""
    engine = engine_for(a, quantization, max_num_seqs=max_num_seqs)
    ids = [engine.add_request(text, params(a, i)) for i, text in enumerate(request_texts(a.requests))]
    events = engine.run_to_completion(ids)
    out = {i: {"patches": [ev.patch.float().cpu() for ev in events[i]], "finish_reason": events[i][-1].finish_reason}
           for i in ids}
    del engine
    free_device()
    for r in out.values():
        r["stop_patch"] = len(r["patches"]) if r["finish_reason"] == "stop" else None
    return [out[i] for i in ids]


def relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "p50": statistics.median(ordered),
            "p95": ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)], "max": ordered[-1]}


def compare(plain: list[dict[str, Any]], other: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Each request of `other` against the same request of `plain` (the unquantised run); `name` labels other's
    stop patches."""
    per_request = []
    for i, (p, q) in enumerate(zip(plain, other, strict=True)):
        both = min(len(p["patches"]), len(q["patches"]))
        per_request.append({
            "request": i, "first_patch_rel_err": relative(q["patches"][0], p["patches"][0]),
            "mean_patch_rel_err": statistics.fmean(relative(q["patches"][j], p["patches"][j]) for j in range(both)),
            "patches_compared": both, "stop_patch_bf16": p["stop_patch"], f"stop_patch_{name}": q["stop_patch"]})
    agree = [r["stop_patch_bf16"] == r[f"stop_patch_{name}"] for r in per_request]
    return {"first_patch_rel_err": summary([r["first_patch_rel_err"] for r in per_request]),
            "mean_patch_rel_err": summary([r["mean_patch_rel_err"] for r in per_request]),
            "stop_agree_share": sum(agree) / len(agree),
            "stopped_bf16": sum(r["stop_patch_bf16"] is not None for r in per_request),
            f"stopped_{name}": sum(r[f"stop_patch_{name}"] is not None for r in per_request),
            "per_request": per_request}


def end_to_end(a: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """FP8 against the unquantised run, and the floor: another unquantised run batched otherwise against it."""
    together = a.max_num_seqs or a.requests
    other_batching = 1 if together > 1 else a.requests
    plain = generate(a, None)
    floor = compare(plain, generate(a, None, max_num_seqs=other_batching), "other_batching")
    floor["max_num_seqs"] = {"first": together, "other": other_batching}
    return compare(plain, generate(a, "fp8"), "fp8"), floor


def main(argv: list[str]) -> dict[str, Any]:
    ap = subcommand_parser("fp8-accuracy", __doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="e.g. cuda:0 or cpu")
    ap.add_argument("--requests", type=int, default=64, help="seeded requests, each with its own text, batched")
    ap.add_argument("--patches", type=int, default=20, help="patches per request at most (max_generate_length)")
    ap.add_argument("--min-len", type=int, default=SamplingParams.min_len,
                    help="patches before the stop head may end a request")
    ap.add_argument("--decode-steps", type=int, default=3, help="decode steps observed after the prefill (layers)")
    ap.add_argument("--min-rows", type=int, default=current().fp8_min_rows,
                    help="smallest call observed (rows); default the rows from which the FP8 GEMM runs")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="requests decoded together end to end (default: all of them; 1: each alone)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.requests < 1 or a.patches < 1 or a.min_rows < 1 or (a.max_num_seqs is not None and a.max_num_seqs < 1):
        ap.error("--requests, --patches, --min-rows and --max-num-seqs must be positive")
    t0 = time.perf_counter()
    device = torch.device(a.device)
    layers, gemm = layer_errors(a)
    e2e, floor = end_to_end(a)
    doc = {"tool": "fp8_accuracy", "command": " ".join(["python", *command_line("fp8-accuracy", argv)]),
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": a.model, "device": a.device,
           "requests": a.requests, "patches": a.patches, "min_len": a.min_len, "decode_steps": a.decode_steps,
           "min_rows": a.min_rows, "max_num_seqs": a.max_num_seqs or a.requests, "fp8_gemm": gemm, "layers": layers,
           "end_to_end": e2e, "reference_floor": floor,
           **torch_facts((device.index or 0) if device.type == "cuda" else None, touch_cuda=True),
           "seconds": round(time.perf_counter() - t0, 1)}
    for r in layers:
        print(f"{r['stack']:>11s} {r['kind']:>7s}  calls {r['calls']:4d}  rows {r['rows_min']}-{r['rows_max']}  "
              f"fp8 vs bf16 {r['fp8_rel_err_vs_bf16']:.2e} (max {r['fp8_max_rel_err_vs_bf16']:.2e})  "
              f"bf16 vs fp32 {r['bf16_rel_err_vs_fp32']:.2e}")
    print(f"fp8: first patch rel err {e2e['first_patch_rel_err']}\nmean patch rel err {e2e['mean_patch_rel_err']}\n"
          f"stop agrees for {e2e['stop_agree_share']:.1%} (stopped: bf16 {e2e['stopped_bf16']}, fp8 "
          f"{e2e['stopped_fp8']} of {a.requests})")
    print(f"floor, bf16 decoded {floor['max_num_seqs']['other']} at a time against {floor['max_num_seqs']['first']}: "
          f"first patch rel err {floor['first_patch_rel_err']}\nmean patch rel err {floor['mean_patch_rel_err']}\n"
          f"stop agrees for {floor['stop_agree_share']:.1%}")
    write_json(a.out, doc)
    return doc
