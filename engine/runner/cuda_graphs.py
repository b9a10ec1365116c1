"""The CUDA graphs of a runner's steps: the decode step per batch bucket, the VAE decode per bucket that runs behind
its step, the prefill per token bucket and its LocEnc per audio-row bucket, each with and without the runtime adapters'
terms; their capture at start-up (each kind's body run eagerly once first) and its timings.

The bodies captured are the runner's (`DecodeStep.forward`, `DecodeStep.vae_forward`, `PrefillStep.forward`,
`PrefillStep.encode_forward`); this module only captures them and keeps the graphs, which the runner then picks by
bucket and replays.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.runner.buffers import DecodeBuffers, graph_buckets
from engine.runner.lora import LoRASlots
from engine.runner.vae_stream import VaeStream

CUDA_LOADS_IN_CAPTURE = 12030  # the driver version (12.3) from which a kernel first launched inside a capture loads


def driver_loads_in_capture() -> bool:
    """Whether this CUDA driver loads a kernel's module when the kernel is first launched inside a stream capture
    (12.3 on; an older one fails the capture): then a graph's buckets need no eager run each, one per kind does."""
    try:
        version = ctypes.c_int()
        found = ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0
    except OSError:  # no NVIDIA driver (ROCm)
        return False
    return found and version.value >= CUDA_LOADS_IN_CAPTURE


class StepGraphs:
    """The captured graphs by bucket: decode steps by batch, prefills by token count, the prefill's LocEnc by audio
    rows; with runtime LoRA adapters, the same buckets once more with their terms (steps of mixed adapters)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.decode: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill: dict[int, torch.cuda.CUDAGraph] = {}
        self.decode_terms: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_terms: dict[int, torch.cuda.CUDAGraph] = {}
        self.encode: dict[int, torch.cuda.CUDAGraph] = {}
        self.encode_terms: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_times: dict[str, tuple[float, float]] = {}  # graph -> (warm-up s, capture s): start-up cost

    def clear(self) -> None:
        """Forget the graphs (the buffers they address were replaced)."""
        for graphs in (self.decode, self.prefill, self.decode_terms, self.prefill_terms, self.encode,
                       self.encode_terms):
            graphs.clear()

    def capture(self, buffers: DecodeBuffers, vae_stream: VaeStream, lora: LoRASlots | None, max_num_seqs: int,
                table_width: int, backend: str, prefill_bucket_sizes: list[int],
                decode_forward: Callable[[int, int, bool, bool], None], vae_forward: Callable[[int], None],
                prefill_forward: Callable[[int, bool], None], encode_forward: Callable[[int, bool], None]) -> float:
        """Capture the decode step for every bucket (largest first, sharing one memory pool), then the prefill's
        token buckets and its LocEnc's row buckets (unless the attention backend is "torch"); the seconds it took."""
        t0 = time.perf_counter()
        pool = None
        vae_pool = None  # its own pool: a VAE graph runs while the next step's graph does
        # Kinds of graph whose body has run eagerly once (None: every bucket's body runs once before its capture).
        warmed: set[str] | None = set() if driver_loads_in_capture() else None
        modes = (False, True) if lora is not None else (False,)  # with runtime adapters: without and with terms
        for batch in reversed(graph_buckets(max_num_seqs)):
            # The warm-up runs the step on this layout's inputs: padding, not bytes of another layout (they share them).
            buffers.reset_inputs(batch)
            vae_inside = not vae_stream.overlaps(batch)
            for terms in modes:
                graphs, kind = (self.decode_terms, "decode+lora") if terms else (self.decode, "decode")
                graphs[batch] = graph = self._capture(kind + "+vae" * vae_inside, f"B={batch}", decode_forward,
                                                      batch, table_width, vae_inside, terms, pool=pool,
                                                      warmed=warmed)
                pool = graph.pool()
            if not vae_inside:
                vae_stream.graphs[batch] = vae_graph = self._capture(
                    "vae", f"B={batch}", vae_forward, batch, pool=vae_pool, stream=vae_stream.stream,
                    warmed=warmed)
                vae_pool = vae_graph.pool()
        if lora is not None:
            lora.capture_merges()
        if backend != "torch":  # graphed prefill needs the per-token (Triton) attention path
            for tokens in reversed(prefill_bucket_sizes):
                for terms in modes:
                    graphs, kind = (self.prefill_terms, "prefill+lora") if terms else (self.prefill,
                                                                                       "prefill")
                    graphs[tokens] = self._capture(kind, f"T={tokens}", prefill_forward, tokens, terms,
                                                   pool=pool, warmed=warmed)
                    graphs, kind = (self.encode_terms, "encode+lora") if terms else (self.encode, "encode")
                    graphs[tokens] = self._capture(kind, f"A={tokens}", encode_forward, tokens, terms,
                                                   pool=pool, warmed=warmed)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _capture(self, kind: str, label: str, body: Callable[..., None], *args: int | bool, pool: Any,
                 stream: torch.cuda.Stream | None = None, warmed: set[str] | None = None) -> torch.cuda.CUDAGraph:
        """Capture `body` (on `stream` when given, where it is then replayed), after running it once eagerly unless
        a graph of its `kind` has (`warmed`): what cannot happen inside a capture (a library's first use; before CUDA
        12.3, a kernel's first launch) happens then. Both times go to capture_times (0 s: no eager run)."""
        warm_s = 0.0
        if warmed is None or kind not in warmed:
            t0 = time.perf_counter()
            body(*args)
            torch.cuda.synchronize(self.device)
            warm_s = time.perf_counter() - t0
            if warmed is not None:
                warmed.add(kind)
        t1 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            body(*args)
        torch.cuda.synchronize(self.device)
        self.capture_times[f"{kind} {label}"] = (warm_s, time.perf_counter() - t1)
        return graph

    @staticmethod
    def replay_or_run(graphs: dict[int, torch.cuda.CUDAGraph], bucket: int, body: Callable[[int, bool], None],
                      terms: bool) -> None:
        """Replay the bucket's graph, or run its body eagerly where none was captured (the CPU, enforce_eager)."""
        graph = graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            body(bucket, terms)

    def decode_bucket(self, batch: int) -> int | None:
        """The smallest batch bucket with a graph that holds `batch` rows (None: none does, the step runs eagerly)."""
        return next((g for g in sorted(self.decode) if g >= batch), None)

    def decode_graphs(self, terms: bool) -> dict[int, torch.cuda.CUDAGraph]:
        return self.decode_terms if terms else self.decode

    def prefill_graphs(self, terms: bool) -> dict[int, torch.cuda.CUDAGraph]:
        return self.prefill_terms if terms else self.prefill

    def encode_graphs(self, terms: bool) -> dict[int, torch.cuda.CUDAGraph]:
        return self.encode_terms if terms else self.encode
