"""GPU check: the CUDA-graph and Triton paths against the eager torch path (and the CPU), on a tiny fp32
and a full-size bf16 random VoxCPM2 checkpoint; then decode-step timings, graphs vs eager.
Prints a table and writes JSON.

    python tools/gpu_check.py --out gpu_check.json [--full /tmp/full] [--conc 1,8,32,64] [--patches 30]

Compared runs use the same seeded requests (three at once, different modes), so any difference comes
from the kernels: rel err = max |a - b| / max |b| over the whole waveforms.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, LoadedModel, SamplingParams, load_model  # noqa: E402
from engine.io.random_checkpoint import make_random_checkpoint  # noqa: E402
from engine.options import EngineOptions  # noqa: E402

TEXT = "Streaming speech synthesis has to start talking almost at once and keep ahead of the listener."


def requests(model: LoadedModel, patches: int, stagger: int = 0) -> list[dict]:
    """Three requests (zero-shot, continuation, reference voice) of `patches` patches, the i-th `stagger` * i fewer
    (so the running batch shrinks step by step through the graph buckets)."""
    cfg = model.config
    g = torch.Generator().manual_seed(5)
    prompt = torch.randn(cfg.patch_size * 3, cfg.feat_dim, generator=g)
    return [
        dict(target_text=TEXT, params=SamplingParams(seed=1, max_generate_length=patches)),
        dict(target_text="Continue this voice.", prompt_text="A prompt.", prompt_latents=prompt,
             params=SamplingParams(seed=2, max_generate_length=patches - stagger, cfg_value=1.5)),
        dict(target_text="A referenced voice.", ref_latents=prompt,
             params=SamplingParams(seed=3, max_generate_length=patches - 2 * stagger, temperature=0.7)),
    ]


def run(engine: LLMEngine, reqs: list[dict]) -> list[np.ndarray]:
    audio = engine.generate_all(reqs)
    assert engine.blocks.num_free == len(engine.blocks.blocks), "KV blocks leaked"
    return audio


def rel_err(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a, b, strict=True))


# The kernels a small check would not reach (taken from many rows only): a variant each, forced on
FORCED_ON: dict[str, dict[str, object]] = {
    "graph triton, gated GEMM": {"gated_gemm_min_rows": 1},  # the DiT's gate/up from its first row (16-bit weights)
}


def variants(model: LoadedModel, device: str, reqs: list[dict], max_model_len: int, pipelined: bool = False,
             forced_on: tuple[str, ...] = ()) -> dict[str, list[np.ndarray]]:
    out = {}
    runs = [("eager torch", "torch", True, False, "32"), ("eager triton", "triton", True, False, "32"),
            ("graph triton", "triton", False, False, "32"), ("graph torch", "torch", False, False, "32")]
    if pipelined:  # the next step launched before the previous one is read: same numbers expected
        runs.append(("graph triton, pipelined", "triton", False, True, "32"))
        # every bucket's VAE as its own graph behind the step (the default from batch 32 on), and buckets 4 and 8
        # behind, 1 and 2 inside: finishing requests move the batch across (VAE states handed over in order)
        runs.append(("graph triton, pipelined, VAE behind the step", "triton", False, True, "1"))
        runs.append(("graph triton, pipelined, VAE behind from bucket 4", "triton", False, True, "4"))
    for run_args in runs:
        out.update(_variant(model, device, reqs, max_model_len, *run_args))
    if pipelined:  # the outputs copied after the whole step, not once the VAE inside it is done (the default)
        out.update(_variant(model, device, reqs, max_model_len, "graph triton, pipelined, outputs at the step's end",
                            "triton", False, True, "32", early_outputs=False))
    for name in forced_on:
        out.update(_variant(model, device, reqs, max_model_len, name, "triton", False, False, "32",
                            **FORCED_ON[name]))
    return out


def _variant(model: LoadedModel, device: str, reqs: list[dict], max_model_len: int, name: str, backend: str,
             eager: bool, pipeline: bool, overlap_min_batch: str, **options: object) -> dict[str, list[np.ndarray]]:
    out = {}
    opts = dataclasses.replace(EngineOptions.from_env(), vae_overlap_min_batch=int(overlap_min_batch), **options)
    eng = LLMEngine(model, EngineConfig(max_num_seqs=8, max_model_len=max_model_len, num_kv_blocks=512,
                                        enforce_eager=eager, attention_backend=backend,
                                        pipeline_decode=pipeline, options=opts), device=device)
    out[name] = run(eng, reqs)
    if name == "graph triton":  # each request alone in the same graph engine: batching must not matter
        out["graph triton, alone"] = [run(eng, [r])[0] for r in reqs]
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


def check_tiny(tmp: Path, table: list[tuple[str, float, float]]) -> None:
    path = make_random_checkpoint(tmp / "tiny", "tiny-voxcpm2", stop="never", config_overrides={"dtype": "float32"})
    # Exact fp32 on the GPU: no TF32 in matmuls or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu_model = load_model(path, "cpu")
    reqs = requests(cpu_model, 12, stagger=3)
    cpu = run(LLMEngine(cpu_model, EngineConfig(max_num_seqs=8, max_model_len=512)), reqs)
    # fp32 weights get no interleaved copy: the gated GEMM's variant does not run here
    gpu = variants(load_model(path, "cuda"), "cuda", reqs, 512, pipelined=True)
    for name, wav in gpu.items():
        table.append((f"tiny fp32: {name} vs CPU eager", rel_err(wav, cpu), 1e-4))
    table.append(("tiny fp32: graph triton vs eager torch (GPU)", rel_err(gpu["graph triton"], gpu["eager torch"]),
                  1e-4))
    table.append(("tiny fp32: graph triton pipelined vs not",
                  rel_err(gpu["graph triton, pipelined"], gpu["graph triton"]), 1e-6))
    table.append(("tiny fp32: VAE behind the step vs inside it",
                  rel_err(gpu["graph triton, pipelined, VAE behind the step"], gpu["graph triton, pipelined"]), 1e-6))
    table.append(("tiny fp32: VAE behind from bucket 4 vs inside",
                  rel_err(gpu["graph triton, pipelined, VAE behind from bucket 4"], gpu["graph triton, pipelined"]),
                  1e-6))
    table.append(("tiny fp32: outputs at the step's end vs early",
                  rel_err(gpu["graph triton, pipelined, outputs at the step's end"], gpu["graph triton, pipelined"]),
                  1e-6))
    table.append(("tiny fp32: graph triton batched vs alone", rel_err(gpu["graph triton"], gpu["graph triton, alone"]),
                  1e-4))


def check_full(path: Path, table: list[tuple[str, float, float]]) -> LoadedModel:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = load_model(path, "cuda", max_positions=1024)
    # One patch: kernels differ, the autoregressive loop has not amplified anything yet.
    first = variants(model, "cuda", requests(model, 1), 1024, forced_on=tuple(FORCED_ON))
    table.append(("full bf16, 1 patch: eager triton vs eager torch",
                  rel_err(first["eager triton"], first["eager torch"]), 2e-2))
    table.append(("full bf16, 1 patch: graph triton vs eager torch",
                  rel_err(first["graph triton"], first["eager torch"]), 2e-2))
    table.append(("full bf16, 1 patch: graph triton batched vs alone",
                  rel_err(first["graph triton"], first["graph triton, alone"]), 2e-2))
    for name in FORCED_ON:  # e.g. "full bf16, 1 patch: gated GEMM vs eager torch"
        table.append((f"full bf16, 1 patch: {name.removeprefix('graph triton, ')} vs eager torch",
                      rel_err(first[name], first["eager torch"]), 2e-2))
    return model


def step_ms(engine: LLMEngine, c: int, patches: int) -> float:
    """Mean wall ms per decode step with c streams of `patches` patches running: the time between the first and the
    last engine.step() that delivered patches, over the steps in between. (Pipelined, each such call returns when
    the step before the one it launched is done, so consecutive returns are one device step apart; counting every
    call against the time after the first made the mean 1/patches too low, as this tool did before 2026-11-22.)"""
    for i in range(c):
        engine.add_request(TEXT, SamplingParams(seed=i, max_generate_length=patches))
    delivered = []
    while engine.has_unfinished():
        if engine.step():
            delivered.append(time.perf_counter())
    return 1000 * (delivered[-1] - delivered[0]) / (len(delivered) - 1)


def timings(model: LoadedModel, concs: list[int], patches: int, modes: list[str]) -> list[dict]:
    rows = []
    for eager in [m == "eager" for m in modes]:
        eng = LLMEngine(model, EngineConfig(max_num_seqs=max(concs), max_model_len=1024, enforce_eager=eager,
                                            gpu_memory_utilization=0.8), device="cuda")
        patch_s = eng.runner.samples_per_patch / eng.sample_rate
        for c in concs:
            step_ms(eng, c, patches)  # warm-up round
            ms = step_ms(eng, c, patches)
            row = {"mode": "eager" if eager else "graphs", "c": c, "ms_per_step": ms,
                   "rtf": ms / 1000 / patch_s, "audio_s_per_s": c * patch_s / (ms / 1000),
                   "startup_s": eng.startup_s, "kv_blocks": len(eng.blocks.blocks), "backend": eng.runner.backend}
            print(json.dumps(row), flush=True)
            rows.append(row)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--full", help="full-size checkpoint dir (made there if missing)")
    ap.add_argument("--conc", default="1,8,32,64")
    ap.add_argument("--patches", type=int, default=30)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--timing-modes", default="eager,graphs")
    a = ap.parse_args()
    info: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv)}
    print(json.dumps(info), flush=True)
    table: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory() as d:
        check_tiny(Path(d), table)
        full = Path(a.full) if a.full else Path(d) / "full"
        if not (full / "config.json").exists():
            t = time.perf_counter()
            make_random_checkpoint(full, "full-voxcpm2", stop="never")
            info["make_full_s"] = time.perf_counter() - t
        model = check_full(full, table)
        if not a.skip_timing:
            info["timings"] = timings(model, [int(x) for x in a.conc.split(",")], a.patches,
                                      a.timing_modes.split(","))
    info["checks"] = [{"check": n, "rel_err": e, "bound": b, "ok": e <= b} for n, e, b in table]
    print(f"\n{'check':58s} {'rel err':>9s} {'bound':>7s}")
    for n, e, b in table:
        print(f"{n:58s} {e:9.2e} {b:7.0e} {'ok' if e <= b else 'FAIL'}")
    for r in info.get("timings", []):
        print(f"{r['mode']:7s} c={r['c']:<3d} {r['ms_per_step']:7.2f} ms/step  RTF {r['rtf']:.3f}  "
              f"{r['audio_s_per_s']:7.1f} audio-s/s")
    if a.out:
        Path(a.out).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
