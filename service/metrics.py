"""Prometheus metrics. One registry per app (tests run several apps in one process). HTTP metrics are
labelled by route template (`/prompts/{prompt_id}`), never the raw path, so ids cannot explode the series.
TTFB is measured from the request's arrival to the first audio byte handed to the server.

With several API processes the supervisor sets prometheus_client's multiprocess directory before they start:
each process writes its values there and any of them answers /metrics with the sum (counters, histograms,
requests in flight) or the most recent value (the engine's and the voice cache's gauges) over all of them."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from engine.serving.reports import WorkerStats
from service.voice_store import KINDS

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TTFB_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30)
ENCODER_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, multiprocess_mode: bool = False) -> None:
        self.multiprocess_mode = multiprocess_mode  # the supervisor set prometheus_client's directory for us
        r = self.registry = CollectorRegistry()
        self.requests = Counter("voxcpm_http_requests", "HTTP requests by route template and status",
                                ["method", "route", "status"], registry=r)
        self.latency = Histogram("voxcpm_http_request_duration_seconds", "Arrival to last response byte",
                                 ["method", "route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("voxcpm_time_to_first_audio_byte_seconds",
                              "Arrival to the first audio byte sent (true TTFB)", ["route"], buckets=TTFB_BUCKETS,
                              registry=r)
        self.audio_seconds = Counter("voxcpm_audio_generated_seconds", "Seconds of audio the model generated (before "
                                     "a speed change), counted when each generation ends", ["route"],
                                     registry=r)
        self.finished = Counter("voxcpm_generations_finished", "Generations by route and how they ended (stop head, "
                                "length cap, aborted, error)", ["route", "reason"], registry=r)
        self.segments_capped = Counter("voxcpm_segments_length_capped", "Long-form segments that reached their "
                                       "length cap (bad cases: regenerated with the next seed where asked)",
                                       ["route"], registry=r)
        self.overloaded = Counter("voxcpm_requests_overloaded", "Generation requests refused with 503 because every "
                                  "worker's queue was full or the request waited past the queue timeout", ["route"],
                                  registry=r)
        self.encoder_wait = Histogram("voxcpm_encoder_wait_seconds", "Time an audio chunk waited in its API process "
                                      "before an encoder thread took it (chunk=first: the one that made its stream's "
                                      "first bytes, a part of the time to first audio; next: a later one, which "
                                      "usually waits while its stream is ahead of its listener)", ["chunk"],
                                      buckets=ENCODER_WAIT_BUCKETS, registry=r)
        self._encoder_wait_first, self._encoder_wait_next = (self.encoder_wait.labels(c) for c in ("first", "next"))
        self.encoder_busy = Counter("voxcpm_encoder_busy_seconds", "CPU seconds encoder threads spent encoding audio "
                                    "(its rate is the cores encoding takes)", registry=r)
        self.in_flight = Gauge("voxcpm_http_requests_in_flight", "Requests being served", registry=r,
                               multiprocess_mode="livesum")
        latest: dict[str, Any] = {"registry": r, "multiprocess_mode": "mostrecent"}  # engine-wide, any process's scrape
        self.queue_depth = Gauge("voxcpm_queue_depth", "Requests waiting in the engines' queues (coalescing window "
                                 "included)", **latest)
        self.running = Gauge("voxcpm_running_sequences", "Sequences being decoded", **latest)
        self.kv_usage = Gauge("voxcpm_kv_cache_usage_ratio", "Share of KV blocks in use", ["worker"], **latest)
        self.kv_blocks_free = Gauge("voxcpm_kv_blocks_free", "KV cache blocks free (prefix-cached ones included)",
                                    ["worker"], **latest)
        self.kv_blocks_total = Gauge("voxcpm_kv_blocks_total", "KV cache blocks", ["worker"], **latest)
        self.slots_free = Gauge("voxcpm_sequence_slots_free", "Decode slots free (of max_num_seqs)", ["worker"],
                                **latest)
        self.step_seconds = Gauge("voxcpm_engine_step_seconds", "Mean engine step latency since the last scrape",
                                  ["worker"], **latest)
        self.steps = Gauge("voxcpm_engine_steps", "Engine steps since the worker started", ["worker"], **latest)
        self.send_seconds = Gauge("voxcpm_worker_send_seconds", "Mean time a worker's message to an API process "
                                  "waited from queued to written since the last scrape", ["worker"], **latest)
        self.gc_longest = Gauge("voxcpm_worker_gc_longest_seconds", "The longest pause of a worker process's garbage "
                                "collector since it started (its step loop waits for each)", ["worker"], **latest)
        self.preemptions = Gauge("voxcpm_engine_preemptions", "Preemptions since the worker started", ["worker"],
                                 **latest)
        self.workers_up = Gauge("voxcpm_workers_up", "Workers running and loaded", **latest)
        self.loras_registered = Gauge("voxcpm_lora_adapters_registered", "Runtime LoRA adapters registered",
                                      ["worker"], **latest)
        self.loras_resident = Gauge("voxcpm_lora_adapters_resident", "Runtime LoRA adapters in a GPU slot now",
                                    ["worker"], **latest)
        self.lora_requests = Gauge("voxcpm_lora_requests", "Requests using a runtime LoRA adapter now", ["worker"],
                                   **latest)
        self.ready = Gauge("voxcpm_ready", "1 when the service reports ready (every API process)", registry=r,
                           multiprocess_mode="livemin")
        self.cache_entries = Gauge("voxcpm_voice_cache_entries", "Cached voices", ["kind"], **latest)
        self.cache_bytes = Gauge("voxcpm_voice_cache_bytes", "Latent bytes in the voice cache", **latest)
        self.voice_store_up = Gauge("voxcpm_voice_store_up", "1 when the voice store answers (a shared Redis can be "
                                    "down while the service serves requests naming no voice)", registry=r,
                                    multiprocess_mode="livemin")
        self._last_steps: dict[str, tuple[int, float]] = {}
        self._last_sends: dict[str, tuple[int, float]] = {}

    def exposition(self) -> bytes:
        """The text format: this app's registry, or every API process's values in multiprocess mode."""
        if self.multiprocess_mode:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)

    def observe_pool(self, stats: list[WorkerStats | None], last: list[dict[str, int]]) -> None:
        """The workers' stats; `last`: what each last reported with its events and whether it is connected
        (`AsyncVoxCPMServerPool.snapshot`), for a worker that did not answer."""
        waiting = running = up = 0
        for i, s in enumerate(stats):
            w = str(i)
            if s is None:
                if last[i]["alive"]:  # stuck: what it last reported still waits on it (the demand is not 0)
                    running += last[i]["running"]
                    waiting += last[i]["waiting"]
                else:  # dead, restarting: no seat or block of it is free (its values were kept)
                    for gauge in (self.slots_free, self.kv_blocks_free, self.loras_resident, self.lora_requests):
                        gauge.labels(w).set(0)
                continue
            up += 1
            running += s.running
            waiting += s.waiting
            self.kv_usage.labels(w).set(1 - s.free_blocks / max(1, s.total_blocks))
            self.kv_blocks_free.labels(w).set(s.free_blocks)
            self.kv_blocks_total.labels(w).set(s.total_blocks)
            self.slots_free.labels(w).set(s.free_slots)
            self.steps.labels(w).set(s.steps)
            self.preemptions.labels(w).set(s.preemptions)
            self.loras_registered.labels(w).set(len(s.loras))
            self.loras_resident.labels(w).set(sum(a.resident for a in s.loras))
            self.lora_requests.labels(w).set(sum(a.requests for a in s.loras))
            self._mean_since_last(self.step_seconds, self._last_steps, w, s.steps, s.step_seconds)
            self._mean_since_last(self.send_seconds, self._last_sends, w, s.messages_sent, s.send_seconds)
            self.gc_longest.labels(w).set(s.gc_longest_s)
        self.running.set(running)
        self.queue_depth.set(waiting)
        self.workers_up.set(up)

    @staticmethod
    def _mean_since_last(gauge: Gauge, last: dict[str, tuple[int, float]], worker: str, count: int,
                         seconds: float) -> None:
        """Set a worker's gauge to the mean of what it summed (`seconds` over `count` events) since the last scrape."""
        n0, t0 = last.get(worker, (0, 0.0))
        if count < n0:  # the worker restarted
            n0, t0 = 0, 0.0
        if count > n0:
            gauge.labels(worker).set((seconds - t0) / (count - n0))
        last[worker] = (count, seconds)

    def observe_encoding(self, first: bool, wait_s: float, cpu_s: float) -> None:
        """One chunk through the engine client's encoder pool (called on its threads)."""
        (self._encoder_wait_first if first else self._encoder_wait_next).observe(wait_s)
        self.encoder_busy.inc(cpu_s)

    def observe_cache(self, usage: dict[str, int]) -> None:
        self.cache_bytes.set(usage["bytes"])
        for kind in KINDS:
            self.cache_entries.labels(kind).set(usage[kind])


class MetricsMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware): it must not buffer streams nor swallow client disconnects."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival = time.perf_counter()
        state = scope.setdefault("state", {})
        state["arrival"] = arrival
        status, first_byte_seen = 500, False

        async def send_wrapper(message: dict) -> None:
            nonlocal status, first_byte_seen
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and message.get("body") and not first_byte_seen:
                first_byte_seen = True
                if state.get("audio_route") and status == 200:  # set by routes that send audio
                    self.metrics.ttfb.labels(_template(scope)).observe(time.perf_counter() - arrival)
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.in_flight.dec()
            route, method = _template(scope), scope["method"]
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - arrival)


def _template(scope: dict) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"
