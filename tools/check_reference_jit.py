"""Whether reference uploads of lengths never seen before JIT-compile kernels in a started worker: an engine on the
GPU starts (its kernel manifest precompiled), runs the worker's warm-up, then encodes clips of random lengths as
prompt and as reference; each clip's Triton compiles are counted (a compile in a serving worker stalls every stream).

    TRITON_CACHE_DIR=$(mktemp -d) python tools/check_reference_jit.py --model /tmp/full --clips 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.io.audio import encode_latents  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.serving.worker_startup import warm_up  # noqa: E402
from engine.startup import kernel_cache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--clips", type=int, default=16)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    engine = LLMEngine(a.model, EngineConfig(max_num_seqs=8, max_model_len=1024), device="cuda")
    print(json.dumps({"startup_s": round(engine.startup_s, 1), "kernels": engine.startup_phases["kernels"],
                      "warm_up": warm_up(engine)}), flush=True)
    vae, patch = engine.model.vae, engine.model.config.patch_size
    rng = np.random.default_rng(a.seed)
    compiled = 0
    for _ in range(a.clips):
        seconds = float(rng.uniform(0.6, 25.0))
        mark = kernel_cache.RECORDER.mark()
        t0 = time.perf_counter()
        for padding in ("left", "right"):  # a continuation prompt, a reference
            clip = (rng.standard_normal(int(seconds * vae.sample_rate)) * 0.1).astype(np.float32)
            encode_latents(vae, clip, vae.sample_rate, patch, padding)
        torch.cuda.synchronize()
        since = kernel_cache.RECORDER.since(mark)
        compiled += since["jit_compiled"]
        print(json.dumps({"seconds": round(seconds, 2), "encode_s": round(time.perf_counter() - t0, 3),
                          "jit_compiled": since["jit_compiled"], "names": since["jit_compiled_names"]}), flush=True)
    print(json.dumps({"clips": a.clips, "jit_compiled": compiled}))


if __name__ == "__main__":
    main()
