"""Experiment: do independent groups of sequences, stepped on separate CUDA streams by separate engines ("lanes"),
deliver patches faster than one engine stepping them all as one batch? Also checks the lanes' audio equals a
lone engine's (the per-lane kernel counters must not race).

    python tools/experiments/lanes.py CKPT OUT.json   (GPU; a full-size checkpoint)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams, triton_attention, triton_layer  # noqa: E402  # noqa: E402
from tools.benchlib import TEXT  # noqa: E402

CKPT = sys.argv[1]
OUT = sys.argv[2]
PATCHES = 40
results: dict = {"rows": []}


def new_engine() -> LLMEngine:
    # fresh counter sets, so each engine's graphs carry their own barrier / split counters
    triton_layer._sync = {}
    triton_attention._counters = {}
    return LLMEngine(CKPT, EngineConfig(max_num_seqs=16, max_model_len=1024, num_kv_blocks=1100), device="cuda")


def run_lanes(engines: list[LLMEngine], streams: list[torch.cuda.Stream], c_each: int, seed0: int = 0):
    ids = []
    for li, eng in enumerate(engines):
        ids.append([eng.add_request(TEXT, SamplingParams(seed=seed0 + li * 100 + i, max_generate_length=PATCHES))
                    for i in range(c_each)])
    times: list[list[float]] = [[] for _ in engines]
    audio: list[dict] = [{} for _ in engines]
    while any(e.has_unfinished() for e in engines):
        for li, (eng, s) in enumerate(zip(engines, streams, strict=True)):
            if not eng.has_unfinished():
                continue
            with torch.cuda.stream(s):
                ev = eng.step()
            if any(e.audio is not None for e in ev):
                times[li].append(time.perf_counter())
            for e in ev:
                if e.audio is not None:
                    audio[li].setdefault(e.seq_id, []).append(e.audio)
    # steady state: drop the first 5 and last 3 deliveries
    periods = []
    for t in times:
        t = t[5:-3]
        periods.append(1000 * (t[-1] - t[0]) / (len(t) - 1))
    wav = [[np.concatenate(audio[li][i]) for i in ids[li]] for li in range(len(engines))]
    return periods, wav


def main() -> None:
    engines = [new_engine()]
    streams = [torch.cuda.Stream()]
    solo = {}
    for c in (1, 2, 4, 8, 16):
        run_lanes(engines[:1], streams[:1], c)  # warm-up
        p, wav = run_lanes(engines[:1], streams[:1], c)
        solo[c] = wav[0]
        results["rows"].append({"lanes": 1, "c_each": c, "c": c, "period_ms": p})
        print(json.dumps(results["rows"][-1]), flush=True)
    for n in (2, 4):
        while len(engines) < n:
            engines.append(new_engine())
            streams.append(torch.cuda.Stream())
        for c_each in (1, 2, 4, 8):
            if n * c_each > 32:
                continue
            run_lanes(engines[:n], streams[:n], c_each)  # warm-up
            p, wav = run_lanes(engines[:n], streams[:n], c_each)
            # lane li's requests use seeds li*100+i: lane 0 must equal the lone engine's run of the same seeds
            ref = solo.get(c_each)
            err = None
            if ref is not None:
                # a length difference counts as a mismatch (the run of 2 x 4 crashed on one before this guard)
                err = max(float(np.abs(a - b).max()) if a.shape == b.shape else float('inf')
                          for a, b in zip(wav[0], ref, strict=True))
            results["rows"].append({"lanes": n, "c_each": c_each, "c": n * c_each, "period_ms": p,
                                    "lane0_vs_solo_max_abs": err})
            print(json.dumps(results["rows"][-1]), flush=True)
            Path(OUT).write_text(json.dumps(results, indent=1))
    Path(OUT).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
