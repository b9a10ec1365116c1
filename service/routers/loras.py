"""Runtime LoRA adapters: POST /loras registers one on every worker (fetched first, like the start-up adapter), GET
/loras lists them, DELETE /loras/{lora_name} unregisters one (requests using it finish with it). Requests choose one
with `lora_name` (or the OpenAI route's `model`)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from urllib.parse import unquote, urlparse

from fastapi import APIRouter, HTTPException

from engine import LoRANotFoundError, PoolError
from service.deps import LoadedState
from service.engine_setup import source_endpoints
from service.errors import http_error
from service.lora_source import AdapterSourceError, fetch_adapter, uri_scheme
from service.schemas import Deleted, LoRAInfo, LoRAList, RegisterLoRARequest
from service.settings import Settings
from service.shared_adapters import sync_adapters
from service.voice_store import VoiceStoreUnavailable

router = APIRouter(tags=["loras"])


def _local_allowed(settings: Settings, uri: str) -> None:
    """A local adapter only from inside NANOVLLM_LORA_DIR: an API caller must not make the service read any file."""
    parsed = urlparse(uri)
    path = Path(unquote(parsed.path) if parsed.scheme else uri).expanduser()
    root = settings.lora_dir
    if root is None:
        raise HTTPException(400, "lora_uri: local adapters are not accepted here (NANOVLLM_LORA_DIR is unset); give "
                                 "an https://, s3:// or hf:// URI")
    if not path.resolve().is_relative_to(Path(root).expanduser().resolve()):
        raise HTTPException(400, f"lora_uri: {path} is outside NANOVLLM_LORA_DIR")


@router.post("/loras", response_model=LoRAInfo)
async def register_lora(req: RegisterLoRARequest, state: LoadedState) -> LoRAInfo:
    s = state.settings
    if not state.model.max_loras:
        raise HTTPException(400, "lora_name: this service runs no runtime LoRA adapters (NANOVLLM_MAX_LORAS=0)")
    if uri_scheme(req.lora_uri) == "file":
        _local_allowed(s, req.lora_uri)
    try:
        local = await asyncio.to_thread(fetch_adapter, req.lora_uri, s.cache_path, req.sha256, source_endpoints(s))
    except AdapterSourceError as e:
        raise HTTPException(400, e.for_fields({"uri": "lora_uri", "sha256": "sha256"})) from e
    await sync_adapters(state)  # the store answers before anything changes
    try:
        described = LoRAInfo.model_validate(await state.pool.register_lora(req.lora_name, str(local)))
    except PoolError as e:
        raise http_error(e) from e
    if state.shared_adapters is not None:
        try:
            await state.shared_adapters.add(req.lora_name, req.lora_uri, req.sha256)
        except VoiceStoreUnavailable:  # not shared: not registered anywhere
            with contextlib.suppress(PoolError):
                await state.pool.unregister_lora(req.lora_name)
            raise
    return described


@router.get("/loras", response_model=LoRAList)
async def list_loras(state: LoadedState) -> LoRAList:
    await sync_adapters(state)
    try:
        return LoRAList(loras=[LoRAInfo.model_validate(a) for a in await state.pool.list_loras()])
    except PoolError as e:
        raise http_error(e) from e


@router.delete("/loras/{lora_name}", response_model=Deleted)
async def unregister_lora(lora_name: str, state: LoadedState) -> Deleted:
    shared = state.shared_adapters is not None and await state.shared_adapters.remove(lora_name)
    try:
        await state.pool.unregister_lora(lora_name)
    except LoRANotFoundError as e:
        if not shared:  # registered on another replica, not taken here yet: removed all the same
            raise http_error(e) from e
    except PoolError as e:
        raise http_error(e) from e
    return Deleted(deleted=lora_name)
