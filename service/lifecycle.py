"""Bringing the pool up and keeping it up, in the background so /health answers while the model loads: wait
for the workers (each warms itself up before it reports ready), read the model facts; afterwards, where this
process owns the workers, restart one that died (not ready meanwhile). In an API process of the supervisor's,
the supervisor restarts workers and the pool's connections come back by themselves."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from engine.serving.routing import LoadTable
from service.state import ServiceState

log = logging.getLogger(__name__)
SUPERVISE_EVERY_S = 1.0


# What the ready line reports: the model, then where the cold start went (the worker's phases, in order).
STARTUP_KEYS = ("architecture", "sample_rate", "devices", "process_import_s", "load_s", "precompile_wait_s", "kv_s",
                "graph_warmup_s", "graph_capture_s", "startup_s", "warmup_zeroshot_s", "warmup_encode_s",
                "warmup_hifi_s", "warmup_s", "spawn_to_ready_s")


async def bring_up(state: ServiceState) -> None:
    s = state.settings
    try:
        await state.pool.wait_for_ready(s.ready_timeout_s)
        state.info = await state.pool.model_info()
    except asyncio.CancelledError:
        raise
    except Exception as e:
        state.failure = f"start-up failed: {type(e).__name__}: {e}"
        log.exception("start-up failed; /health and /ready report 503")
        return
    facts = {**state.info.as_dict(), "devices": state.pool.worker_devices}
    phases = {k: round(v, 2) if isinstance(v, float) else v for k in STARTUP_KEYS if (v := facts.get(k)) is not None}
    log.log(logging.INFO if state.reports_startup else logging.DEBUG, "ready: %s", phases)
    await supervise(state)


def drain(state: ServiceState) -> None:
    """Shutting down: /ready 503 at once, new generations 503; what is in flight goes on."""
    if not state.draining:  # the supervisor logs how many responses and sessions are open over the API processes
        log.info("draining: not ready, refusing new generations; open responses and sessions go on")
    state.draining = True
    state.metrics.ready.set(0)


async def supervise(state: ServiceState) -> None:
    """Keep this process's readiness gauge current (with several API processes, /metrics reports the lowest of
    theirs, so each must refresh its own); restart dead workers where this process owns them."""
    while True:
        state.metrics.ready.set(1 if state.ready else 0)
        await asyncio.sleep(SUPERVISE_EVERY_S)
        if state.owns_workers and state.pool.workers is not None and state.settings.worker_stuck_timeout_s:
            state.pool.workers.kill_stuck(state.settings.worker_stuck_timeout_s)
        if state.pool.healthy or not state.owns_workers or not state.settings.restart_dead_workers:
            continue
        log.error("a worker died: restarting it (not ready until it is warm again)")
        try:
            await state.pool.restart(state.settings.ready_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("worker restart failed; retrying")
            continue
        log.info("worker restarted; ready")


class OpenResponses:
    """Counts this API process's open HTTP responses and WebSocket sessions in the supervisor's shared table, which
    its drain waits for: the engine's load leaves a response once its audio is made, before it is all written."""

    def __init__(self, app: Any, table: LoadTable) -> None:
        self.app, self.table = app, table

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        self.table.add(0, 1)
        try:
            await self.app(scope, receive, send)
        finally:
            self.table.add(0, -1)
