"""What a burst costs a worker's host before its first audio: reading the requests, admitting them, the first step.

    python tools/bench.py intake --model CKPT --burst 256 --out intake.json
    python tools/bench.py intake --model CKPT --burst 256 --distinct     # each request its own text

A real `Worker` over a real engine is handed one `MessageBatch` of --burst `Generate` messages, pickled as a client
sends them (the protocol's text, tokenized by the client as `engine.serving.stream` does), and a client thread reads
what it sends back. Timed per round: the intake (unpickling the batch and `Worker.handle` of each request: their
prompts, params, sequences), the admission step (the first `Worker.step()`: schedule, block hashes, the prefill's
inputs and launch, the first decode's launch) and the step after it (the prefill's and first decode's end,
synchronised, its events routed to the client). The rounds' medians, the first round (warm-up) left out; a round in
which any request fails stops the benchmark. The benchmark's bursts share one text, so their prompts share
prefix-cache blocks; --distinct numbers each request's text, as a burst of different users' texts would be. On the
GPU when there is one, with a worker's own settings: one torch thread, the start-up heap frozen.
"""

from __future__ import annotations

import json
import queue
import statistics
import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.serving import protocol as p
from engine.serving.collector import freeze_startup_heap
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


def read_events(conn: Connection, finished: queue.SimpleQueue[p.AudioEvent]) -> None:
    """The client's side: read the worker's messages until it closes, handing on each request's last event."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if isinstance(msg, p.StepEvents):
            for ev in msg.events:
                if ev.finished:
                    finished.put(ev)


def one_round(worker: Worker, link: ClientLink, blob: bytes, finished: queue.SimpleQueue[p.AudioEvent]
              ) -> dict[str, float]:
    sync = torch.cuda.synchronize if worker.engine.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    messages = p.unbatched(ForkingPickler.loads(blob))
    for msg in messages:
        worker.handle(link, msg)
    t1 = time.perf_counter()
    worker.step()
    t2 = time.perf_counter()
    worker.step()
    sync()
    t3 = time.perf_counter()
    while worker.engine.has_work():
        worker.step()
    last = [finished.get(timeout=60) for _ in messages]  # every request ends with one finished event, read
    failed = [ev for ev in last if ev.finish_reason == "error"]
    if failed:  # a refused or failed request: this burst is not the one meant to be timed
        raise RuntimeError(f"{len(failed)} of the burst's requests failed, e.g. {failed[0].error}")
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
    mine, theirs = Pipe()
    worker.acceptor.attach(mine)  # connected as a client's socket is: the worker's link, its sender, Ready sent
    worker._take_new_links()
    (link,) = worker.links.values()
    finished: queue.SimpleQueue[p.AudioEvent] = queue.SimpleQueue()
    reader = threading.Thread(target=read_events, args=(theirs, finished), name="intake-client", daemon=True)
    reader.start()
    rounds = [one_round(worker, link, burst_blob(engine, a.burst, f"r{i}", a.distinct), finished)
              for i in range(a.rounds + 1)]
    worker.close(goodbye=None)
    reader.join(timeout=10)
    theirs.close()
    doc["rounds"] = [{k: round(v, 2) for k, v in r.items()} for r in rounds]
    for key in rounds[0]:
        doc[f"{key}_median"] = round(statistics.median(r[key] for r in rounds[1:]), 2)
        print(f"{key}: median {doc[f'{key}_median']:.2f} (warm-up {rounds[0][key]:.2f})", flush=True)
    write_json(a.out, doc)
    return doc
