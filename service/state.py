"""What the lifespan owns and the routes share: the pool, the model's metadata, the voice store, the metrics,
and whether the service is ready (loaded, warm, every worker connected)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine import AsyncVoxCPMServerPool
from engine.serving.reports import WorkerInfo
from engine.vocabulary import AdapterInfo
from service.metrics import Metrics
from service.normalize_process import NormalizeProcess
from service.settings import Settings
from service.voice_store import VoiceStore

if TYPE_CHECKING:
    from service.lora_registry import LoRARegistrations
    from service.shared_adapters import SharedAdapters


@dataclass
class ServiceState:
    settings: Settings
    pool: AsyncVoxCPMServerPool
    store: VoiceStore
    metrics: Metrics
    model_path: str
    model_id: str  # the name /v1/models reports
    demo: bool = False  # serving the embedded random-weight checkpoint
    owns_workers: bool = True  # False in an API process of the supervisor's: it restarts the workers
    reports_startup: bool = True  # logs the start-up's phases when ready (of the supervisor's API processes, the first)
    info: WorkerInfo | None = None  # pool.model_info(), once loaded
    failure: str | None = None  # start-up failed for good: liveness reports it
    draining: bool = False  # shutting down: not ready, new generations refused, responses in flight finish
    api_keys: list[bytes] = field(default_factory=list)  # none: no key needed
    admin_keys: list[bytes] = field(default_factory=list)  # none: any API key may change the adapters
    shared_adapters: SharedAdapters | None = None  # the runtime adapters' registrations in Redis (NANOVLLM_REDIS_URL)
    lora_registrations: LoRARegistrations | None = None  # the adapters registered here (every API process's)
    normalizer: NormalizeProcess = field(default_factory=NormalizeProcess)  # `normalize: true`, off this process's GIL

    @property
    def loaded(self) -> bool:
        return self.info is not None

    @property
    def model(self) -> WorkerInfo:
        """The model facts, for routes that depend on `LoadedState` (the model is loaded by then)."""
        if self.info is None:
            raise RuntimeError("the model is not loaded yet")
        return self.info

    @property
    def ready(self) -> bool:
        """Every worker is connected and has reported ready (its model loaded and warmed up)."""
        return self.loaded and self.pool.ready and not self.draining

    def adapter_changes(self) -> contextlib.AbstractAsyncContextManager[None]:
        """A change of the runtime adapters alone over every API process (`LoRARegistrations.changing`)."""
        registrations = self.lora_registrations
        return registrations.changing() if registrations is not None else contextlib.nullcontext()

    async def runtime_adapters(self) -> list[AdapterInfo]:
        """The runtime LoRA adapters the workers hold (none before the model is loaded, or with none enabled);
        PoolError while no worker answers."""
        if self.info is None or not self.info.max_loras:
            return []
        return await self.pool.list_loras()

    @property
    def sample_rate(self) -> int:
        return self.model.sample_rate

    @property
    def feat_dim(self) -> int:
        return self.model.feat_dim

    @property
    def frame_bytes(self) -> int:
        """Bytes of one latent frame as voices carry them: float32 (feat_dim,)."""
        return 4 * self.model.feat_dim
