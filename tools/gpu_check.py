"""GPU check: the engine on CUDA vs the CPU/torch path on a tiny checkpoint, and eager step timings on a
full-size random VoxCPM2. Prints a table and writes JSON (--out).

    python tools/gpu_check.py --out gpu_check.json

First version (eager torch path only); CUDA graphs and Triton kernels will be compared here too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams, load_model  # noqa: E402
from engine.random_checkpoint import make_random_checkpoint  # noqa: E402


def tiny_cpu_vs_cuda(tmp: Path) -> dict:
    path = make_random_checkpoint(tmp / "tiny", "tiny-voxcpm2", stop="never", config_overrides={"dtype": "float32"})
    out = {}
    for dev in ("cpu", "cuda"):
        eng = LLMEngine(load_model(path, dev), EngineConfig(max_num_seqs=2, max_model_len=256), device=dev)
        out[dev] = eng.generate("GPU check sentence.", SamplingParams(seed=3, max_generate_length=8))
    err = float(np.abs(out["cpu"] - out["cuda"]).max() / np.abs(out["cpu"]).max())
    return {"tiny_fp32_cuda_vs_cpu_max_rel_err": err}


def full_timing(tmp: Path, concs: list[int], patches: int) -> dict:
    t = time.perf_counter()
    path = make_random_checkpoint(tmp / "full", "full-voxcpm2", stop="never")
    made = time.perf_counter() - t
    t = time.perf_counter()
    model = load_model(path, "cuda", max_positions=1024)
    loaded = time.perf_counter() - t
    res = {"make_s": made, "load_s": loaded, "runs": []}
    for c in concs:
        eng = LLMEngine(model, EngineConfig(max_num_seqs=c, max_model_len=1024), device="cuda")
        for _warmup_then_measured in range(2):
            for i in range(c):
                eng.add_request("Streaming speech synthesis has to start talking almost at once.",
                                SamplingParams(seed=i, max_generate_length=patches))
            torch.cuda.synchronize()
            t0, steps, first = time.perf_counter(), 0, None
            while eng.has_unfinished():
                eng.step()
                steps += 1
                first = first or time.perf_counter() - t0
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        audio_s = c * patches * 0.16
        row = {"c": c, "steps": steps, "wall_s": wall, "ms_per_step": 1000 * wall / steps,
               "first_step_s": first, "rtf": wall / (patches * 0.16), "audio_s_per_s": audio_s / wall}
        print(json.dumps(row), flush=True)
        res["runs"].append(row)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--conc", default="1,8")
    ap.add_argument("--patches", type=int, default=30)
    a = ap.parse_args()
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print(json.dumps(info), flush=True)
    with tempfile.TemporaryDirectory() as d:
        info.update(tiny_cpu_vs_cuda(Path(d)))
        print(json.dumps(info), flush=True)
        info.update(full_timing(Path(d), [int(x) for x in a.conc.split(",")], a.patches))
    if a.out:
        Path(a.out).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
