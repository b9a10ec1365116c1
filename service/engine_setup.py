"""How the service sets up its engine, shared by the app (which may own its workers) and the supervisor (which
starts them before importing the web stack): the checkpoint, the engine arguments, the voice database's place,
and what an API process is given to reach workers started elsewhere."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.settings import Settings

if TYPE_CHECKING:
    from service.lora_source import Endpoints, FetchLimits

log = logging.getLogger(__name__)

# The supervisor's first word to its API processes when it stops: drain (not ready, new generations refused).
DRAIN_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class WorkerEndpoint:
    """What an API process of the supervisor's is given: the workers to connect to, and what it shares with the
    other API processes."""

    addresses: list[str]
    authkey: bytes
    model_path: str
    demo: bool
    voice_db: Path
    multiprocess_metrics: bool
    load_table: Path | None = None  # the in-flight table every API process routes by (engine.serving.routing)
    row: int = 0  # this API process's row in it
    responses_table: Path | None = None  # the API processes' open responses and sessions, which a drain waits for
    encoder_threads: int = 4  # each API process's (Settings.encoder_thread_count, decided by the supervisor)
    engine_log_level: int = logging.INFO  # the engine client's, as the workers' (VOXCPM_LOG_LEVEL)


def model_fingerprint(model_path: str) -> str:
    """Cached latents belong to one model: the store lives under a directory named after it."""
    config = Path(model_path, "config.json").read_bytes()
    return hashlib.blake2b(str(Path(model_path).resolve()).encode() + config, digest_size=8).hexdigest()


def voice_db_path(settings: Settings, model_path: str, scratch: Path) -> Path:
    """The voice database: under the cache dir (kept across restarts), or in `scratch` (gone at shutdown)."""
    if settings.voice_store == "memory":
        return scratch / "voices.db"
    return settings.cache_path / "voices" / model_fingerprint(model_path) / "voices.db"


def model_checkpoint(settings: Settings) -> tuple[str, bool]:
    """The checkpoint to serve and whether it is the embedded random-weight demo (made on first use)."""
    if settings.model_path is not None:
        return settings.model_path, False
    from service.demo import demo_checkpoint

    return str(demo_checkpoint(settings.cache_path)), True


def adapter_path(settings: Settings) -> str | None:
    """The start-up LoRA adapter as a local path (downloaded and checked first), or None without one. Blocking."""
    if not settings.lora_uri:
        return None
    from service.lora_source import fetch_adapter

    return str(fetch_adapter(settings.lora_uri, settings.cache_path, settings.lora_sha256, source_endpoints(settings),
                             fetch_limits(settings, callers=False)))


def fetch_limits(settings: Settings, callers: bool = True) -> FetchLimits:
    """What an adapter download may be: an API caller's only from NANOVLLM_LORA_URL_PREFIXES (the operator's own
    start-up adapter from anywhere)."""
    from service.lora_source import FetchLimits

    prefixes = tuple(p.strip() for p in settings.lora_url_prefixes.split(",") if p.strip()) if callers else None
    return FetchLimits(prefixes, settings.lora_max_bytes, settings.lora_fetch_timeout_s)


def source_endpoints(settings: Settings) -> Endpoints:
    """Where s3:// and hf:// adapter URIs are fetched from."""
    from service.lora_source import Endpoints

    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    return Endpoints(settings.s3_endpoint_url, settings.hf_endpoint, token)


def prepare_kernel_cache(settings: Settings) -> None:
    """Compiled Triton kernels persist in the cache dir: a restart on the same volume skips recompiling them. So does
    the CUDA driver's JIT cache (a few PTX-only library kernels compiled at the first KV sizing). Set, and seeded with
    the prebuilt kernels, before the workers are spawned (they inherit the variables)."""
    kernels = os.environ.setdefault("TRITON_CACHE_DIR", str(settings.cache_path / "kernels" / "triton"))
    os.environ.setdefault("CUDA_CACHE_PATH", str(settings.cache_path / "kernels" / "cuda"))
    if settings.prebuilt_kernels_dir is not None:
        from engine.startup.prebuilt import seed

        t0 = time.perf_counter()
        try:
            copied = seed(settings.prebuilt_kernels_dir.expanduser(), Path(kernels))
        except OSError as e:  # never fail a start over an optimisation: the kernels compile as on any empty cache
            log.warning("kernel cache not seeded from %s: %s", settings.prebuilt_kernels_dir, e)
            return
        log.info("kernel cache seeded with %d prebuilt entries in %.2f s", copied, time.perf_counter() - t0)


def engine_arguments(settings: Settings, demo: bool, lora_path: str | None = None) -> dict:
    """`VoxCPM.from_pretrained` keywords from the settings (the supervisor builds its workers from the same)."""
    devices = settings.device_list()
    if demo and devices is None:
        devices = ["cpu"]  # the demo checkpoint is tiny: no GPU needed
    return dict(devices=devices, warmup=settings.warmup, lora_path=lora_path, **settings.engine_fields())
