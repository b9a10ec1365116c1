"""The VAE decoder's dtype (`vae_dtype`): what bfloat16 or float16 changes in the audio, and what it saves a step.

    python tools/bench.py vae-dtype --model CKPT --dtype bfloat16 --requests 16 --patches 100 --out vae_dtype.json

--requests seeded requests of different texts run together through an engine with the float32 decoder, then through
one with the --dtype decoder, on the same device (the GPU when there is one). The patches are the same (the VAE's
output never feeds back: checked); per request the SNR of the audio against float32's (dB) and the largest sample
difference. Then the VAE decode of a step's patches alone, for each batch of --batch, in both engines: its graph
(where the engine runs the VAE behind the step) or the eager decode, mean ms over --repeats after a warm-up.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.io.checkpoint import load_model
from tools.benchmarks.harness import TEXT, device_doc, positive_ints, subcommand_parser, write_json


def generate(engine: LLMEngine, n: int, patches: int) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """n seeded requests of different texts together; each one's audio and its patches stacked."""
    ids = [engine.add_request(f"Number {i}. {TEXT}", SamplingParams(seed=i, max_generate_length=patches))
           for i in range(n)]
    events = engine.run_to_completion(ids)
    return ([np.concatenate([ev.audio for ev in events[i]]) for i in ids],
            [torch.stack([ev.patch for ev in events[i]]) for i in ids])


def vae_ms(engine: LLMEngine, batch: int, repeats: int) -> tuple[float, str]:
    """Mean ms of one VAE decode of `batch` streams' patches, as the engine runs it at that batch."""
    runner = engine.runner
    graph = runner.vae_stream.graphs.get(batch)
    run = graph.replay if graph is not None else (lambda: runner._vae_forward(batch))
    if runner.device.type != "cuda":
        t = time.perf_counter()
        for _ in range(repeats):
            run()
        return 1000 * (time.perf_counter() - t) / repeats, "cpu eager"
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats, "graph" if graph is not None else "eager"


def main(argv: list[str]) -> dict[str, Any]:
    ap = subcommand_parser("vae-dtype", __doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory (official VoxCPM layout)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--patches", type=int, default=100)
    ap.add_argument("--batch", type=positive_ints, default=positive_ints("1,128,256"),
                    help="batches of the VAE timing (the engine's max_num_seqs is the largest)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", help="write the results JSON here")
    a = ap.parse_args(argv)
    device, doc = device_doc("vae_dtype", "vae-dtype", argv, dtype=a.dtype, requests=a.requests, patches=a.patches)
    runs = {}
    for vae_dtype in (None, a.dtype):
        # The first engine stays on the device beside the second: it sizes its KV within 0.3 of the memory, the
        # second within 0.75 less what is in use then (each engine's own KV sizing runs its kernels before capture).
        engine = LLMEngine(load_model(a.model, device), EngineConfig(
            max_num_seqs=max(max(a.batch), a.requests), max_model_len=1024,
            gpu_memory_utilization=0.75 if runs else 0.3, vae_dtype=vae_dtype), device=device)
        audio, patches = generate(engine, a.requests, a.patches)
        timing = {str(b): vae_ms(engine, b, a.repeats) for b in a.batch}
        runs[vae_dtype or "float32"] = (audio, patches, timing)
    (ref, ref_patches, ref_ms), (got, got_patches, got_ms) = runs["float32"], runs[a.dtype]
    snr, peak = [], []
    for r, g in zip(ref, got, strict=True):
        err = g.astype(np.float64) - r
        snr.append(float(10 * np.log10(np.sum(r.astype(np.float64) ** 2) / max(np.sum(err**2), 1e-30))))
        peak.append(float(np.abs(err).max()))
    doc.update(
        patches_equal=all(torch.equal(x, y) for x, y in zip(ref_patches, got_patches, strict=True)),
        snr_db_min=min(snr), snr_db_mean=float(np.mean(snr)), max_abs_diff=max(peak),
        audio_peak=float(max(np.abs(r).max() for r in ref)), snr_db=snr,
        vae_ms={b: {"float32": ref_ms[b][0], a.dtype: got_ms[b][0], "how": got_ms[b][1],
                    "ratio": got_ms[b][0] / ref_ms[b][0]} for b in ref_ms})
    write_json(a.out, doc)
    print(f"patches equal: {doc['patches_equal']}; SNR vs float32: min {doc['snr_db_min']:.1f} dB, mean "
          f"{doc['snr_db_mean']:.1f} dB; largest sample difference {doc['max_abs_diff']:.2e} "
          f"(peak {doc['audio_peak']:.2f})")
    for b, t in doc["vae_ms"].items():
        print(f"VAE at B={b} ({t['how']}): float32 {t['float32']:.2f} ms, {a.dtype} {t[a.dtype]:.2f} ms "
              f"({t['ratio']:.2f}x)")
    return doc
