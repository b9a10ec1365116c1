"""What a burst costs a worker's host before its first audio: reading the requests, admitting them, the first step.

    python tools/bench.py intake --model CKPT --burst 256 --device cuda --out intake.json
    python tools/bench.py intake --model CKPT --burst 256 --distinct     # each request its own text

A real `Worker` over a real engine is handed one `MessageBatch` of --burst `Generate` messages, pickled as a client
sends them (the protocol's text, tokenized by the client as `engine.serving.stream` does). Timed per round: the intake
(unpickling the batch and `Worker.handle` of each request: their prompts, params, sequences), the admission step (the
first `engine.step()`: schedule, block hashes, the prefill's inputs and launch, the first decode's launch) and the
step after it (the prefill's and first decode's end, synchronised). The rounds' medians, the first round (warm-up)
left out. The benchmark's bursts share one text, so their prompts share prefix-cache blocks; --distinct numbers each
request's text, as a burst of different users' texts would be. On the GPU when there is one, with a worker's own
settings: one torch thread, the start-up heap frozen.
"""

from __future__ import annotations

import json
import statistics
import time
from multiprocessing import Pipe
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.serving import protocol as p
from engine.serving.collector import freeze_startup_heap
from engine.serving.reports import SendWaits
from engine.serving.stream import text_ids_many
from engine.serving.worker import ClientLink, Worker
from tools.benchmarks.harness import TEXT, device_doc, subcommand_parser, write_json

PATCHES = 5  # each request's patches: enough for the admission and first decode, short between rounds


def burst_blob(engine: LLMEngine, n: int, tag: str, distinct: bool) -> bytes:
    """n Generate messages as one pickled MessageBatch, their texts tokenized as a client does."""
    requests = [p.SynthesisRequest(f"{i}. {TEXT}" if distinct else TEXT,
                                   params=SamplingParams(max_generate_length=PATCHES)) for i in range(n)]
    for request, ids in zip(requests, text_ids_many(engine.model.tokenizer, requests), strict=True):
        request.text_ids = ids
    batch = p.MessageBatch([p.Generate(f"{tag}-{i}", r) for i, r in enumerate(requests)])
    return bytes(ForkingPickler.dumps(batch))


def one_round(worker: Worker, link: ClientLink, blob: bytes) -> dict[str, float]:
    engine = worker.engine
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    messages = p.unbatched(ForkingPickler.loads(blob))
    for msg in messages:
        worker.handle(link, msg)
    t1 = time.perf_counter()
    if len(link.requests) != len(messages):  # a refused request answers on the link: this burst is not the one timed
        raise RuntimeError(f"the worker took {len(link.requests)} of the burst's {len(messages)} requests")
    engine.step()
    t2 = time.perf_counter()
    engine.step()
    sync()
    t3 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    link.requests.clear()  # the engine was stepped here, not through Worker.step, which forgets finished requests
    worker.owner.clear()
    return {"intake_ms": 1000 * (t1 - t0), "admission_step_ms": 1000 * (t2 - t1), "next_step_ms": 1000 * (t3 - t2)}


def main(argv: list[str]) -> dict[str, Any]:
    ap = subcommand_parser("intake", __doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--burst", type=int, default=256, help="requests in the burst (also the engine's max_num_seqs)")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds, after one warm-up round")
    ap.add_argument("--distinct", action="store_true", help="each request its own (numbered) text")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON of other EngineConfig fields")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    kwargs = json.loads(a.engine_kwargs)
    device, doc = device_doc("bench_intake", "intake", argv, model=a.model, burst=a.burst, rounds=a.rounds,
                             distinct=a.distinct, engine_kwargs=kwargs)
    gpu = device == "cuda"
    if gpu:
        torch.set_num_threads(1)  # as a GPU worker runs (engine.serving.worker_startup)
    config = EngineConfig(max_num_seqs=a.burst, max_model_len=1024, **kwargs,
                          **({"gpu_memory_utilization": 0.8} if gpu else {}))
    engine = LLMEngine(a.model, config, device=device)
    if gpu:
        freeze_startup_heap()
    worker = Worker(engine)
    mine, theirs = Pipe()  # the worker's link to a client that never reads: nothing is sent while all goes well
    link = ClientLink(mine, 1, SendWaits())
    rounds = [one_round(worker, link, burst_blob(engine, a.burst, f"r{i}", a.distinct)) for i in range(a.rounds + 1)]
    link.close()
    theirs.close()
    doc["rounds"] = [{k: round(v, 2) for k, v in r.items()} for r in rounds]
    for key in rounds[0]:
        doc[f"{key}_median"] = round(statistics.median(r[key] for r in rounds[1:]), 2)
        print(f"{key}: median {doc[f'{key}_median']:.2f} (warm-up {rounds[0][key]:.2f})", flush=True)
    write_json(a.out, doc)
    return doc
