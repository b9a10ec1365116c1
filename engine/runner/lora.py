"""Runtime LoRA adapters: registered by name, resident in a bounded number of device slots, applied per request.

Every layer a runtime adapter may adapt (q/k/v/o of the base LM, the residual LM and the DiT's layers, and the four
projections between the modules: the official training's targets, minus the MLPs) gets one stacked pair of
`max_loras` slots of rank `max_lora_rank` (`engine.ops.lora`). A request names its adapter; admission makes it
resident (a free slot, else the least recently used slot no running request holds; with none, the request waits in
the scheduler's queue: `LLMEngine._admit`) and the request carries the slot index, like its KV slots: the step's
rows then select their own adapter, different adapters and none in one batch, inside the CUDA graphs captured once
at start-up. The LoRA context holds the mask of the rows the next layers see;
the backbone sets it around each module it calls (`VoxCPMBackbone.lora_rows`).

Registered adapters stay in host memory; a slot is (re)written on the engine's stream, so a step already queued
still reads what it was launched with. Unregistering a name lets the requests holding it finish; its slot is freed
after the last. A long text leases its adapter for its segments (`lease`): unregistered meanwhile (the name even
registered again, as another adapter), it still speaks that text's later segments to its end. A step whose rows carry
terms does not use the layer kernel that reads the weights only (the local modules' stack kernel; the per-layer path
adds the terms).

A step whose rows all use one adapter (or none) needs no terms: `merge` rewrites the adapted weights as base + that
adapter (from base copies kept on the device, so nothing drifts however often it switches), and the step runs the
plain graphs with every fused kernel, at the base model's speed. The rewrite is queued on the engine's stream between
steps, so a step always reads the weights it was launched with.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.errors import LoRANotFoundError, OverloadedError
from engine.io.lora import WEIGHT_FILES, LoRAAdapter, LoRAError, targets
from engine.ops import fp8
from engine.ops.lora import LoRAContext, LoRAStack, add_lora
from engine.vocabulary import LORA_NAME_PATTERN, AdapterInfo

log = logging.getLogger(__name__)

LAYER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LAYER_STACKS = ("base_lm.layers.", "residual_lm.layers.", "feat_decoder.estimator.decoder.layers.")
PROJECTIONS = ("enc_to_lm_proj", "lm_to_dit_proj", "res_to_dit_proj", "fusion_concat_proj")
NAME = re.compile(LORA_NAME_PATTERN)


def _projection_hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    return add_lora(module, args[0], out)


def adaptable_layers(backbone: nn.Module) -> dict[str, nn.Linear]:
    """The layers runtime adapters may adapt, by their path in the backbone (the adapters' key names)."""
    out = {}
    for name, module in backbone.named_modules():
        if isinstance(module, nn.Linear) and ((name.startswith(LAYER_STACKS) and name.rsplit(".", 1)[-1] in
                                               LAYER_TARGETS) or name in PROJECTIONS):
            out[name] = module
    return out


@dataclass
class Registered:
    name: str
    source: str
    rank: int
    generation: int  # a name registered again is another adapter: its prompts' KV is never shared with the old one's
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer -> (A [r, in], B * alpha / r [out, r]), host


@dataclass
class Resident:
    slot: int
    name: str
    refs: int = 0  # requests holding it
    last_used: float = field(default_factory=time.monotonic)


class LoRASlots:
    def __init__(self, backbone: nn.Module, family: str, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, merged_steps: bool, slot_wait_s: float) -> None:
        if getattr(backbone, "lora_context", None) is not None:
            raise ValueError("this model carries another engine's LoRA slots: load it again for a new engine")
        self.backbone, self.family = backbone, family
        self.max_loras, self.max_rank = max_loras, max_rank
        self.context = LoRAContext(torch.arange(max_loras, device=device).repeat_interleave(max_rank), max_rank)
        self.layers = adaptable_layers(backbone)
        columns = max_loras * max_rank
        elements = 0
        self.quantized: list[torch.Tensor] = []
        for name, layer in self.layers.items():
            if name.endswith(LAYER_TARGETS[:3]):
                continue  # below: q, k and v together
            layer.lora = LoRAStack(torch.zeros(columns, layer.in_features, dtype=dtype, device=device),
                                   torch.zeros(layer.out_features, columns, dtype=dtype, device=device), self.context)
            elements += columns * (layer.in_features + layer.out_features)
            if name in PROJECTIONS:
                layer.register_forward_hook(_projection_hook)
        for name, attention in backbone.named_modules():
            if not (name.startswith(LAYER_STACKS) and name.endswith(".self_attn")):
                continue
            # One term for q, k and v (`add_lora_qkv`): their A stacked, their B block-diagonal; each layer's
            # own slots are views of these (the off-diagonal blocks stay zero).
            qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
            outs = [lin.out_features for lin in qkv]
            a = torch.zeros(3 * columns, qkv[0].in_features, dtype=dtype, device=device)
            b = torch.zeros(sum(outs), 3 * columns, dtype=dtype, device=device)
            attention.qkv_lora = LoRAStack(a, b, self.context)
            # FP8 companions of the adapted weights follow each merge (`_rewrite`); the other weights never change.
            self.quantized += [w for w in (attention.qkv_weight, attention.o_proj.weight)
                               if fp8.companion_of(w) is not None]
            elements += a.numel() + b.numel()
            for i, lin in enumerate(qkv):
                start = sum(outs[:i])
                lin.lora = LoRAStack(a[i * columns:(i + 1) * columns],
                                     b[start:start + outs[i], i * columns:(i + 1) * columns], self.context)
        backbone.lora_context = self.context
        for stack in (backbone.base_lm, backbone.residual_lm, backbone.feat_decoder.estimator.decoder):
            stack.lora_context = self.context  # the stack kernel then steps aside for the per-layer path
        self.registered: dict[str, Registered] = {}
        # Long texts' leases: (client, lease) -> the adapter registered under the name when the lease began.
        self.leases: dict[tuple[int, str], Registered] = {}
        self.resident: dict[int, Resident] = {}  # by the adapter's generation (one name: several adapters over time)
        self.free_slots = list(range(max_loras - 1, -1, -1))
        # Slots of adapters unregistered while requests held them: freed after the last (the name is free at once).
        self.retiring: dict[int, Resident] = {}
        # The request at the queue's head waiting for a slot (its id; None: none waits), since when, and the adapter
        # (generation) whose slot then takes no new holds until it drains (`closed_to_new_holds`).
        self.slot_wait_s = slot_wait_s
        self.waiter: int | None = None
        self.waiter_since: float | None = None
        self.draining: int | None = None
        self._generations = itertools.count(1)
        # `merge`: the base weights of the adapted layers, and the slot merged into the live ones (-1: none; None:
        # unknown, after that slot was loaded again).
        self.base_weights = {n: layer.weight.detach().clone() for n, layer in self.layers.items()} \
            if merged_steps else None
        self.merged: int | None = -1
        self.rewrites = 0  # merges that rewrote the weights (info, metrics, tests)
        self.merge_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # slot -> its rewrite captured (`capture_merges`)
        size = torch.empty((), dtype=dtype).element_size()
        base = sum(w.numel() for w in self.base_weights.values()) if self.base_weights is not None else 0
        log.info("runtime LoRA: %d slots of rank <= %d over %d layers (%.0f MiB), base copies for merged steps "
                 "(%.0f MiB); a step of mixed adapters adds their terms on the per-layer path", max_loras, max_rank,
                 len(self.layers), elements * size / 2**20, base * size / 2**20)

    # --- merged steps -------------------------------------------------------------------------------------------
    @property
    def merges(self) -> bool:
        return self.base_weights is not None

    @torch.no_grad()
    def merge(self, slot: int) -> None:
        """Make the adapted layers' live weights base + the adapter in `slot` (-1: the base weights), queued on the
        current stream. Every fused copy reads them: the fused q/k/v, the stacks and the GEMVs are views of them."""
        if slot == self.merged:
            return
        if self.base_weights is None:  # never merged: the live weights stay the base (self.merged -1)
            raise RuntimeError("merged steps are off (VOXCPM_LORA_MERGED_STEPS=0)")
        graph = self.merge_graphs.get(slot)
        if graph is not None:
            graph.replay()
        else:
            self._rewrite(slot)
        self.merged = slot
        self.rewrites += 1

    def _rewrite(self, slot: int) -> None:
        assert self.base_weights is not None
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for name, layer in self.layers.items():
            base, stack = self.base_weights[name], layer.lora
            if slot < 0:
                layer.weight.data.copy_(base)
            else:  # base + B A, rounded once
                torch.addmm(base, stack.b[:, cols], stack.a[cols], out=layer.weight.data)
        for weight in self.quantized:
            fp8.requantize(weight)

    @torch.no_grad()
    def capture_merges(self) -> None:
        """Each slot's rewrite (and the base's) as a CUDA graph: ~200 small GEMMs launched from the host cost more
        than they take on the device (docs/history/lora.md, merged steps). The graphs read the slots' and the base
        copies' memory when replayed, so an adapter loaded later into a slot is what its graph merges."""
        if self.base_weights is None:
            return
        for slot in range(-1, self.max_loras):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # records only: the live weights stay as they are
                self._rewrite(slot)
            self.merge_graphs[slot] = graph

    # --- registry -----------------------------------------------------------------------------------------------
    def register(self, name: str, adapter: LoRAAdapter) -> AdapterInfo:
        if not NAME.fullmatch(name):
            raise LoRAError(f"lora_name: {name!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a "
                            "letter or digit")
        if name in self.registered:
            raise LoRAError(f"lora_name: an adapter named {name!r} is registered already (unregister it first)")
        self.registered[name] = self._prepared(name, adapter)
        log.info("registered LoRA adapter %r (%s): r=%d, %d layers", name, adapter.source, adapter.config.r,
                 len(adapter.pairs))
        return self.describe(name)

    def _prepared(self, name: str, adapter: LoRAAdapter) -> Registered:
        """`adapter` checked against this engine and scaled, as a new generation of `name`."""
        targets(adapter, self.backbone, self.family)  # every module exists here, with the adapter's shapes
        for module in adapter.pairs:
            if module not in self.layers:
                raise LoRAError(f"{module}.lora_A: runtime adapters adapt q/k/v/o of the LMs and the DiT and the "
                                f"projections between the modules, not {module!r} (merge this adapter at start-up "
                                "instead: NANOVLLM_LORA_MERGE)")
        if adapter.config.r > self.max_rank:
            raise LoRAError(f"lora_config.r: {adapter.config.r} is above this engine's max_lora_rank "
                            f"{self.max_rank}")
        scale = adapter.config.scale
        pairs = {m: (a.contiguous(), (b * scale).contiguous()) for m, (a, b) in adapter.pairs.items()}
        for module, (_, b) in pairs.items():  # finite weights may still overflow once scaled
            if not torch.isfinite(b).all():
                raise LoRAError(f"{module}.lora_B: not finite once scaled by alpha / r = {scale:g} (lora_config)")
        return Registered(name, adapter.source, adapter.config.r, next(self._generations), pairs)

    def unregister(self, name: str) -> None:
        if name not in self.registered:
            raise LoRANotFoundError(f"lora_name: no adapter named {name!r} (registered: {sorted(self.registered)})")
        del self.registered[name]
        self._retire_unreachable()

    def lease(self, key: tuple[int, str], name: str | None) -> None:
        """Lease `key` (a client's long text) binds the adapter registered as `name` now, for the requests that name
        it with the lease (its segments): unregistered meanwhile, or the name registered again, they still get it.
        `name` None: the lease ends (a name not registered: nothing to bind, its requests fail as unknown)."""
        if name is None:
            self.leases.pop(key, None)
            self._retire_unreachable()
        elif name in self.registered:
            self.leases[key] = self.registered[name]

    def holds(self, name: str, path: str) -> bool:
        """Whether `name` is registered from `path` (its weights file, or the directory holding it), by the record
        alone: a leased adapter's file may be gone from the disk since."""
        registered, where = self.registered.get(name), Path(path).expanduser()
        return registered is not None and (Path(registered.source) == where or (
            Path(registered.source).parent == where and Path(registered.source).name in WEIGHT_FILES))

    def lease_unregistered(self, key: tuple[int, str], name: str, adapter: LoRAAdapter) -> None:
        """Lease `key` binds `adapter` for the requests naming `name` with it, without registering it: a restarted
        worker given a long text's lease on an adapter unregistered (or its name registered again) since it began."""
        self.leases[key] = self._prepared(name, adapter)

    def end_leases(self, client: int) -> None:
        """A client went away: its leases end."""
        for key in [k for k in self.leases if k[0] == client]:
            del self.leases[key]
        self._retire_unreachable()

    def _retire_unreachable(self) -> None:
        """Adapters neither registered nor leased any more: their slots free now, or after their last request."""
        live = {r.generation for r in self.registered.values()} | {r.generation for r in self.leases.values()}
        for generation in [g for g in self.resident if g not in live]:
            held = self.resident.pop(generation)
            if held.refs == 0:
                self.free_slots.append(held.slot)
            else:
                self.retiring[held.slot] = held

    def describe(self, name: str) -> AdapterInfo:
        reg = self.registered[name]
        held = self.resident.get(reg.generation)
        return AdapterInfo(name, reg.source, reg.rank, len(reg.pairs), held is not None, held.slot if held else None,
                           held.refs if held else 0)

    def list(self) -> list[AdapterInfo]:
        return [self.describe(n) for n in sorted(self.registered)]

    # --- requests -----------------------------------------------------------------------------------------------
    def resolve(self, name: str, lease: tuple[int, str] | None = None) -> Registered:
        """The adapter a request naming `name` gets: its lease's, else the one registered under the name (a request
        naming an unknown one is refused; its slot comes at admission)."""
        leased = self.leases.get(lease) if lease is not None else None
        if leased is not None and leased.name == name:
            return leased
        if name not in self.registered:
            raise LoRANotFoundError(f"lora_name: no adapter named {name!r} (registered: {sorted(self.registered)})")
        return self.registered[name]

    def note_waiter(self, seq_id: int, at_head: bool) -> None:
        """Request `seq_id` found every slot held by running requests. At the queue's head (the round's first to ask
        for a slot) it is the waiter the others may pass for `slot_wait_s`: its wait starts now unless it is the one
        already waiting (a waiter that left unserved, aborted or its adapter unregistered, takes its clock along)."""
        if at_head and seq_id != self.waiter:
            self.waiter, self.waiter_since, self.draining = seq_id, time.monotonic(), None

    def note_served(self) -> None:
        """The round's first request to ask for a slot has it: no request waits for one now."""
        self.waiter = self.waiter_since = self.draining = None

    def closed_to_new_holds(self, reg: Registered) -> bool:
        """Whether a request of adapter `reg` behind the waiting one must wait too: once that one has waited
        `slot_wait_s`, the busy slot expected to drain first (the fewest holds; the least recently used of equals) takes
        no new holds, so that it frees for the waiting request however fast its adapter's requests arrive. Chooses
        (and logs) that slot the first time; none while a slot of an unregistered adapter is still to free itself."""
        if self.waiter_since is None or time.monotonic() - self.waiter_since < self.slot_wait_s or self.retiring:
            return False
        held = self.resident.get(self.draining) if self.draining is not None else None
        if held is None:  # none chosen yet, or the chosen one was unregistered
            busy = [(h.refs, h.last_used, g) for g, h in self.resident.items() if h.refs > 0]
            if not busy:
                return False
            self.draining = min(busy)[2]
            log.info("LoRA adapter %r takes no new requests until its slot drains (a request waits for a slot)",
                     self.resident[self.draining].name)
        return reg.generation == self.draining

    def acquire(self, reg: Registered) -> tuple[int, bytes]:
        """A request's hold on adapter `reg` (`resolve`): its slot (loaded now if it is not resident) and the salt of
        its prompts' prefix-cache hashes."""
        held = self.resident.get(reg.generation)
        if held is None:
            slot = self._free_slot()
            try:
                self._load(reg, slot)
            except BaseException:
                self.free_slots.append(slot)  # a failed load must not take the slot with it
                raise
            held = self.resident[reg.generation] = Resident(slot, reg.name)
        held.refs += 1
        held.last_used = time.monotonic()
        return held.slot, f"lora:{reg.name}:{reg.generation}".encode()

    def release(self, slot: int) -> None:
        """The end of a request's hold on the adapter in `slot` (resident, or retiring: unregistered meanwhile)."""
        held = next((h for h in self.resident.values() if h.slot == slot), None)
        if held is not None:
            held.refs -= 1
            return
        retired = self.retiring.get(slot)
        if retired is not None:
            retired.refs -= 1
            if retired.refs == 0:
                del self.retiring[slot]
                self.free_slots.append(slot)

    def _free_slot(self) -> int:
        """A slot for a new resident: a free one, else the least recently used one no request holds."""
        if not self.free_slots:
            idle = [(h.last_used, g) for g, h in self.resident.items() if h.refs == 0]
            if not idle:
                raise OverloadedError(f"lora_name: all {self.max_loras} adapter slots hold adapters of running "
                                      "requests (max_loras)")
            self._evict(min(idle)[1])
        return self.free_slots.pop()

    def _evict(self, generation: int) -> None:
        self.free_slots.append(self.resident.pop(generation).slot)

    @torch.no_grad()
    def _load(self, reg: Registered, slot: int) -> None:
        if slot == self.merged:
            self.merged = None  # the live weights hold the slot's previous adapter: the next `merge` rewrites them
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        live = slice(slot * self.max_rank, slot * self.max_rank + reg.rank)
        for name, layer in self.layers.items():
            stack: LoRAStack = layer.lora
            stack.a[cols].zero_()
            stack.b[:, cols].zero_()
            pair = reg.pairs.get(name)
            if pair is not None:
                stack.a[live].copy_(pair[0], non_blocking=True)
                stack.b[:, live].copy_(pair[1], non_blocking=True)
        log.info("LoRA adapter %r resident in slot %d", reg.name, slot)
