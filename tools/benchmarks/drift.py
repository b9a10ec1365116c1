"""Voice drift across a long text's segments, for each rule of which audio conditions the later segments:

    python tools/bench.py drift --model CKPT --segments 8 --patches 20 --out drift.json

- first:    the first segment's own latents and text are every later segment's continuation prompt (the default)
- previous: each segment continues from the segment before it
- none:     every segment zero-shot, alone (the baseline: no shared voice at all)

Each segment's latents (frames x feat_dim) are summarised by their per-channel mean and standard deviation; its drift
is the distance of those from the first segment's, relative to the size of the first's:
|mean_i - mean_0| / |std_0| + |std_i - std_0| / |std_0|. A rule that keeps one voice keeps it low; one whose errors
accumulate grows it with the segment index. Segments are generated in order, one at a time, in this process's pool.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from engine import SamplingParams, SynthesisRequest, VoxCPM
from service.segmenter import split_text
from tools.benchmarks.harness import command_line, subcommand_parser, write_json

TEXT = ("The morning train left the station on time, and the passengers settled in for the long ride north. "
        "Outside, the fields gave way to low hills, then to forests still white with the night's frost. "
        "A child near the window counted the bridges aloud, losing track somewhere after twenty. "
        "By noon the conductor had passed twice, checking tickets and answering the same questions with patience. "
        "Someone in the back played a quiet melody on a harmonica, and nobody asked them to stop. "
        "When the sun finally broke through the clouds, the whole carriage seemed to sigh at once. "
        "The old man across the aisle folded his newspaper and closed his eyes, smiling at nothing in particular. "
        "Hours later, the lights of the city appeared on the horizon, small and steady, like a promise kept. ")
RULES = ("first", "previous", "none")


def drift(latents: np.ndarray, reference: np.ndarray) -> float:
    """The distance of one segment's latent statistics from the reference segment's (see the module docstring)."""
    m0, s0 = reference.mean(0), reference.std(0)
    scale = float(np.linalg.norm(s0)) or 1.0
    return float(np.linalg.norm(latents.mean(0) - m0) / scale + np.linalg.norm(latents.std(0) - s0) / scale)


async def run_rule(pool: Any, rule: str, texts: list[str], params: SamplingParams) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for i, text in enumerate(texts):
        prompt_latents, prompt_text = None, ""
        if i and rule == "first":
            prompt_latents, prompt_text = out[0], texts[0]
        elif i and rule == "previous":
            prompt_latents, prompt_text = out[-1], texts[i - 1]
        stream = pool.submit(SynthesisRequest(text, prompt_text, prompt_latents, None, None, params,
                                              return_latents=True))
        async for _ in stream:
            pass
        out.append(np.concatenate(stream.latents).astype(np.float32))
    return out


async def measure(a: Any) -> dict[str, Any]:
    texts = [s.text for s in split_text((TEXT * 50), a.segment_chars)][:a.segments]
    pool = VoxCPM.from_pretrained(a.model, devices=[a.device] if a.device else None, max_num_seqs=2,
                                  max_model_len=a.max_model_len, max_num_batched_tokens=a.max_model_len)
    try:
        await pool.wait_for_ready()
        params = SamplingParams(max_generate_length=a.patches, seed=a.seed, min_len=a.patches)
        rows = []
        for rule in RULES:
            t0 = time.perf_counter()
            latents = await run_rule(pool, rule, texts, params)
            drifts = [drift(x, latents[0]) for x in latents]
            rows.append({"rule": rule, "drift": [round(d, 4) for d in drifts],
                         "mean_drift_after_first": round(float(np.mean(drifts[1:])), 4) if len(drifts) > 1 else 0.0,
                         "seconds": round(time.perf_counter() - t0, 2)})
        return {"segments": len(texts), "patches": a.patches, "seed": a.seed, "results": rows}
    finally:
        await pool.stop()


def main(argv: list[str]) -> dict[str, Any]:
    ap = subcommand_parser("drift", __doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--device", default=None, help="e.g. cpu or cuda:0 (default: every GPU, else the CPU)")
    ap.add_argument("--segments", type=int, default=8, help="segments of the built-in text to generate")
    ap.add_argument("--segment-chars", type=int, default=250, help="the segmenter's size (NANOVLLM_SEGMENT_CHARS)")
    ap.add_argument("--patches", type=int, default=20, help="patches per segment (min_len = max_generate_length)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    doc = {"command": " ".join(command_line("drift", argv)), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                       time.gmtime()),
           **asyncio.run(measure(a))}
    for r in doc["results"]:
        print(f"{r['rule']:>9s}  mean drift {r['mean_drift_after_first']:.4f}  per segment {r['drift']}")
    write_json(a.out, doc)
    return doc
