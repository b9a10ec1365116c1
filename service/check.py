"""`voxcpm-serve check`: load the configured model on the configured devices as the service would (same settings,
checkpoint, adapter, kernel cache and tokenizer), generate one patch, print one JSON line and exit 0; or print one
JSON line saying what failed and exit 1. For image smoke tests and init containers: it needs no free port and
leaves nothing running."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from service.settings import Settings

CHECK_TEXT = "Check."
GENERATE_TIMEOUT_S = 300  # one patch: generous against a hang, never a timing assertion


def run_check(settings: Settings) -> dict[str, Any]:
    """Load, generate one patch, stop; the facts as a dict. Raises whatever made it fail."""
    from engine import VoxCPM
    from engine.io.tokenizer import TextTokenizer
    from engine.serving.pool import checked_model_path
    from service import engine_setup

    t0 = time.monotonic()
    model_path, demo = engine_setup.model_checkpoint(settings)
    model_path = checked_model_path(model_path)
    tokenizer = TextTokenizer.from_dir(model_path)
    lora_path = engine_setup.adapter_path(settings)
    engine_setup.prepare_kernel_cache(settings)
    arguments = engine_setup.engine_arguments(settings, demo, lora_path)
    pool = VoxCPM.from_pretrained(model_path, encoder_threads=1, tokenizer=tokenizer, **arguments)
    try:
        pool.wait_for_ready(settings.ready_timeout_s)
        info = pool.model_info()
        load_s = time.monotonic() - t0
        t1 = time.monotonic()
        stream = pool.generate(CHECK_TEXT, max_generate_length=1, min_len=1, seed=0)
        samples = 0
        deadline = time.monotonic() + GENERATE_TIMEOUT_S
        for chunk in stream:
            samples += len(chunk)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no end of a one-patch generation after {GENERATE_TIMEOUT_S} s")
        if samples == 0:
            raise RuntimeError("the generation produced no audio")
        return {"status": "ok", "model_path": model_path, "random_weights": demo, "devices": pool.worker_devices,
                "sample_rate": info.sample_rate, "samples": samples, "load_s": round(load_s, 2),
                "generate_s": round(time.monotonic() - t1, 2)}
    finally:
        pool.stop()


def main(argv: Sequence[str]) -> int:
    """`voxcpm-serve check [flags]`: the service's flags and NANOVLLM_* variables; exit 0 ok, 1 failed, 2 bad
    configuration (as the service)."""
    from service.main import load_settings

    settings = load_settings(argv)
    try:
        report = run_check(settings)
    except Exception as e:  # any failure is the answer: say what it was
        print(json.dumps({"status": "failed", "detail": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
