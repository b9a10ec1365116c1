"""What the lifespan owns and the routes share: the pool, the model's metadata, the voice store, the metrics,
and whether the service is ready (loaded, warm, every worker connected)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine import AsyncVoxCPMServerPool
from service.metrics import Metrics
from service.settings import Settings
from service.voice_store import VoiceStore


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
    info: dict[str, Any] = field(default_factory=dict)  # pool.get_model_info(), once loaded
    failure: str | None = None  # start-up failed for good: liveness reports it
    draining: bool = False  # shutting down: not ready, new generations refused, responses in flight finish
    api_keys: list[bytes] = field(default_factory=list)  # none: no key needed

    @property
    def loaded(self) -> bool:
        return bool(self.info)

    @property
    def ready(self) -> bool:
        """Every worker is connected and has reported ready (its model loaded and warmed up)."""
        return self.loaded and self.pool.ready and not self.draining

    async def runtime_adapters(self) -> list[dict[str, Any]]:
        """The runtime LoRA adapters the workers hold (none before the model is loaded, or with none enabled);
        PoolError while no worker answers."""
        if not (self.loaded and self.info.get("max_loras")):
            return []
        return await self.pool.list_loras()

    @property
    def sample_rate(self) -> int:
        return int(self.info["sample_rate"])

    @property
    def feat_dim(self) -> int:
        return int(self.info["feat_dim"])
