"""Bringing the pool up and keeping it up, in the background so /health answers while the model loads:
wait for the workers, warm up through the normal request path, report ready; afterwards restart a
worker that died (not ready meanwhile)."""

from __future__ import annotations

import asyncio
import io
import logging

import numpy as np
import soundfile as sf

from service.state import ServiceState

log = logging.getLogger(__name__)
SUPERVISE_EVERY_S = 1.0


def tone_wav(seconds: float, sample_rate: int) -> bytes:
    """A short synthetic clip for the warm-up (no asset to ship)."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    x = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def _run(state: ServiceState, **kwargs) -> int:
    n = 0
    async for chunk in state.pool.generate(max_generate_length=2, seed=0, **kwargs):
        n += len(chunk)
    return n


async def warm_up(state: ServiceState) -> None:
    """Zero-shot, then the clip in both roles (HiFi) where the model takes a reference (VoxCPM2): the
    first requests compile/allocate what later ones reuse. Runs after the workers are ready, one
    request at a time, through pool.generate like any request."""
    await _run(state, target_text="Warm-up.")
    clip = tone_wav(1.0, int(state.info["encoder_sample_rate"]))
    prompt = await state.pool.encode_latents(clip, "wav", padding="left")
    ref = None
    if state.info.get("architecture") == "voxcpm2":
        ref = await state.pool.encode_latents(clip, "wav", padding="right")
    await _run(state, target_text="Warm-up.", prompt_latents=prompt, prompt_text="A tone.", ref_audio_latents=ref)


async def bring_up(state: ServiceState) -> None:
    s = state.settings
    try:
        await state.pool.wait_for_ready(s.ready_timeout_s)
        state.info = await state.pool.get_model_info()
        log.info("model loaded: %s", {k: state.info.get(k) for k in ("architecture", "sample_rate", "device")})
        if s.warmup:
            await warm_up(state)
            log.info("warm-up done")
    except asyncio.CancelledError:
        raise
    except Exception as e:
        state.failure = f"start-up failed: {type(e).__name__}: {e}"
        log.exception("start-up failed; /health and /ready report 503")
        return
    state.warm = True
    log.info("ready")
    await supervise(state)


async def supervise(state: ServiceState) -> None:
    while True:
        await asyncio.sleep(SUPERVISE_EVERY_S)
        if state.pool.healthy or not state.settings.restart_dead_workers:
            continue
        state.warm = False
        log.error("a worker died: restarting it (not ready until it is warm again)")
        try:
            await state.pool.restart(state.settings.ready_timeout_s)
            if state.settings.warmup:
                await warm_up(state)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("worker restart failed; retrying")
            continue
        state.warm = True
        log.info("worker restarted; ready")
