"""In-process period per step (ms) at c=1 and c=8 under the environment this process was started with.

    TORCH_BLAS_PREFER_CUBLASLT=1 python tools/experiments/blas_knobs.py CKPT "label"   (GPU, one process per setting)
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tools.benchlib import TEXT  # noqa: E402


def period(eng: LLMEngine, c: int, patches: int = 40) -> float:
    for i in range(c):
        eng.add_request(TEXT, SamplingParams(seed=i, max_generate_length=patches))
    t = []
    while eng.has_unfinished():
        if any(e.audio is not None for e in eng.step()):
            t.append(time.perf_counter())
    t = t[5:-3]
    return 1000 * (t[-1] - t[0]) / (len(t) - 1)


eng = LLMEngine(sys.argv[1], EngineConfig(max_num_seqs=16, max_model_len=1024, num_kv_blocks=1100), device="cuda")
row = {"env": sys.argv[2], "blas": str(torch.backends.cuda.preferred_blas_library())}
for c in (1, 8, 16):
    period(eng, c)
    row[f"c{c}"] = round(min(period(eng, c) for _ in range(2)), 3)
print(json.dumps(row), flush=True)
