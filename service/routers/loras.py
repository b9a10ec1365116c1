"""Runtime LoRA adapters: POST /loras registers one on every worker (fetched first, like the start-up adapter), GET
/loras lists them, DELETE /loras/{lora_name} unregisters one (generations using it finish with it; a long text or
live session leases it and speaks to its end with it). Requests choose one with `lora_name` (or the OpenAI route's
`model`)."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Depends, HTTPException

from engine import LoRANotFoundError, PoolError
from service.deps import LoadedState, require_admin_key
from service.engine_setup import fetch_limits, source_endpoints
from service.errors import http_error
from service.lora_source import AdapterSourceError, fetch_in_background, local_refusal
from service.routers.openai import model_ids
from service.schemas import Deleted, LoRAInfo, LoRAList, RegisterLoRARequest
from service.shared_adapters import sync_adapters
from service.voice_store import VoiceStoreUnavailable

router = APIRouter(tags=["loras"])


@router.post("/loras", response_model=LoRAInfo, dependencies=[Depends(require_admin_key)])
async def register_lora(req: RegisterLoRARequest, state: LoadedState) -> LoRAInfo:
    s = state.settings
    if not state.model.max_loras:
        raise HTTPException(400, "lora_name: this service runs no runtime LoRA adapters (NANOVLLM_MAX_LORAS=0)")
    if req.lora_name in model_ids(state):  # /v1 and live sessions would choose the model, never the adapter
        raise HTTPException(409, f"lora_name: {req.lora_name!r} names this service's model (GET /v1/models): "
                                 "choose another name for the adapter")
    refusal = local_refusal(s.lora_dir, req.lora_uri)
    if refusal is not None:
        raise HTTPException(400, f"lora_uri: {refusal}")
    # the store answers before anything changes (and before a download it would refuse)
    await sync_adapters(state, req.lora_name)
    shared = state.shared_adapters
    if shared is not None and shared.holds_other(req.lora_name, req.lora_uri, req.sha256):
        raise registered_already(req.lora_name)  # taken by the sync (not the engine's 400 of a name it holds)
    try:
        local = await fetch_in_background(req.lora_uri, s.cache_path, req.sha256, source_endpoints(s), fetch_limits(s))
    except AdapterSourceError as e:
        raise HTTPException(400, e.for_fields({"uri": "lora_uri", "sha256": "sha256"})) from e
    async with state.adapter_changes():
        try:
            described = LoRAInfo.model_validate(await state.pool.register_lora(req.lora_name, str(local)))
        except PoolError as e:
            if shared is not None and shared.holds_other(req.lora_name, req.lora_uri, req.sha256):
                raise registered_already(req.lora_name) from e  # another request's sync took it meanwhile
            raise http_error(e) from e
        if shared is not None:
            try:
                if not await shared.add(req.lora_name, req.lora_uri, req.sha256):
                    raise registered_already(req.lora_name)  # by another replica since the sync: the first stands
            except (VoiceStoreUnavailable, HTTPException):  # not shared: registered on no replica, this one included
                with contextlib.suppress(PoolError):
                    await state.pool.unregister_lora(req.lora_name)
                raise
    return described


def registered_already(lora_name: str) -> HTTPException:
    """The shared registration of the name, from another source, stands (registered just now or long ago)."""
    return HTTPException(409, f"lora_name: {lora_name!r} is registered already from another source (replicas share "
                              "their registrations); unregister it first")


@router.get("/loras", response_model=LoRAList)
async def list_loras(state: LoadedState) -> LoRAList:
    await sync_adapters(state)
    try:
        return LoRAList(loras=[LoRAInfo.model_validate(a) for a in await state.pool.list_loras()])
    except PoolError as e:
        raise http_error(e) from e


@router.delete("/loras/{lora_name}", response_model=Deleted, dependencies=[Depends(require_admin_key)])
async def unregister_lora(lora_name: str, state: LoadedState) -> Deleted:
    async with state.adapter_changes():
        shared = state.shared_adapters is not None and await state.shared_adapters.remove(lora_name)
        try:
            await state.pool.unregister_lora(lora_name)
        except LoRANotFoundError as e:
            if not shared:  # registered on another replica, not taken here yet: removed all the same
                raise http_error(e) from e
        except PoolError as e:
            raise http_error(e) from e
    return Deleted(deleted=lora_name)
