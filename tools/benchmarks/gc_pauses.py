"""What Python's garbage collector costs a serving process, before and after its start-up heap is frozen.

    python tools/bench.py gc --model CKPT --requests 16 --patches 20 --out gc.json

An engine is built in this process on the device (the GPU when there is one) and warmed up, as a worker is; then
--rounds rounds of --requests seeded requests run to completion, every collector pass timed by `gc.callbacks` (its
generation, its milliseconds), and one full collection forced and timed after them. Then the start-up heap is frozen
as the worker freezes it once ready (`engine.serving.collector.freeze_startup_heap`) and the same rounds run again.
The objects the collector tracks are counted at each point. In process the engine's loop makes few objects the
collector tracks (on a CPU no pass ran in 32 requests); a worker's messages to its clients make more (its passes and
the longest: `bench.py stream`'s worker_gc_* columns). An API process's heap is counted in a fresh process: the
service's imports, its app and the model's tokenizer (what a full collection there walks).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from typing import Any

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.io.checkpoint import load_model
from engine.serving.collector import CollectorPauses, freeze_startup_heap
from engine.serving.worker_startup import warm_up
from tools.benchmarks.harness import REPO, TEXT, device_doc, subcommand_parser, write_json


def timed_rounds(engine: LLMEngine, rounds: int, requests: int, patches: int) -> dict[str, Any]:
    """The collector's passes while `rounds` rounds of requests run (counted as the worker counts them), then a
    forced full collection's ms."""
    pauses = CollectorPauses()
    t0 = time.perf_counter()
    try:
        for r in range(rounds):
            params = [SamplingParams(seed=i, max_generate_length=patches) for i in range(requests)]
            ids = [engine.add_request(f"Round {r}, number {i}. {TEXT}", p) for i, p in enumerate(params)]
            engine.run_to_completion(ids)
    finally:
        pauses.close()
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    gc.collect()
    forced_ms = 1000 * (time.perf_counter() - t1)
    return {"wall_s": wall, "tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count(),
            "full_collection_forced_ms": forced_ms, "passes": pauses.collections,
            "passes_longest_ms": 1000 * pauses.longest_s, "passes_total_ms": 1000 * pauses.seconds}


API_PROCESS_PROBE = """
import gc, json, sys, time
from engine.io.tokenizer import TextTokenizer
from service.app import create_app
from service.settings import Settings
app, tokenizer = create_app(Settings()), TextTokenizer.from_dir(sys.argv[1])
t0 = time.perf_counter()
gc.collect()
print(json.dumps({"tracked_objects": len(gc.get_objects()), "full_collection_ms": 1000 * (time.perf_counter() - t0)}))
"""


def api_process_heap(model: str) -> dict[str, Any]:
    """In a fresh process: the objects an API process's collector tracks once started (the service's imports, its
    app, the tokenizer) and a full pass's ms."""
    done = subprocess.run([sys.executable, "-c", API_PROCESS_PROBE, model], capture_output=True, text=True, check=True,
                          cwd=REPO, timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> dict[str, Any]:
    ap = subcommand_parser("gc", __doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory (official VoxCPM layout)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--patches", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="write the results JSON here")
    a = ap.parse_args(argv)
    device, doc = device_doc("gc_pauses", "gc", argv, requests=a.requests, patches=a.patches, rounds=a.rounds)
    engine = LLMEngine(load_model(a.model, device), EngineConfig(max_num_seqs=a.requests, max_model_len=1024),
                       device=device)
    warm_up(engine)
    doc["as_started"] = timed_rounds(engine, a.rounds, a.requests, a.patches)
    doc["frozen_at_start"] = freeze_startup_heap()
    try:
        doc["frozen"] = timed_rounds(engine, a.rounds, a.requests, a.patches)
    finally:
        gc.unfreeze()  # this process is a benchmark (or a test), not a worker
    doc["api_process"] = api_process_heap(a.model)
    write_json(a.out, doc)
    for phase in ("as_started", "frozen"):
        d = doc[phase]
        print(f"{phase}: {d['tracked_objects']} objects tracked ({d['frozen_objects']} frozen); {d['passes']} passes, "
              f"the longest {d['passes_longest_ms']:.1f} ms; a forced full collection "
              f"{d['full_collection_forced_ms']:.1f} ms; rounds {d['wall_s']:.1f} s")
    print(f"an API process's heap: {doc['api_process']['tracked_objects']} objects tracked, a full collection "
          f"{doc['api_process']['full_collection_ms']:.1f} ms")
    return doc
