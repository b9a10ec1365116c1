"""Runtime LoRA adapters (`engine/runner/lora.py`): registered by name, chosen per request, resident in a bounded
number of slots. The runtime path equals the official package running the same adapter (unmerged); requests with
different adapters, ranks and none in one batch each equal their solo output; slots are reused least recently used
first; unregistering lets running requests finish; an adapter's prompts never share KV with another's."""

from __future__ import annotations

import dataclasses
import random
import re
import shutil
import time

import pytest
import torch

from engine.errors import RequestError
from engine.io.checkpoint import load_model
from engine.io.lora import LoRAConfig, LoRAError, random_adapter, read_adapter
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.minicpm import fuse_projections
from engine.options import EngineOptions
from engine.sequence import SamplingParams, Status
from tests.conftest import check_parity
from tests.official import injected_noise, make_noise
from tests.test_io_lora import EVERY_GROUP, PATCHES, official_with_adapter

TEXT = "An adapted voice speaks."
LONG = ("An adapted voice reads a longer passage, long enough that its prompt fills several key-value blocks, "
        "which the prefix cache then keeps and finds again for the next request with the same text.")


def patches_of(engine: LLMEngine, requests: list[dict]) -> list[torch.Tensor]:
    """Run requests (add_request keywords) together; each one's patches, stacked."""
    ids = [engine.add_request(**r) for r in requests]
    out: dict[int, list[torch.Tensor]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for e in engine.step():
            if e.seq_id in out:
                assert e.error is None, e.error
                out[e.seq_id].append(e.patch)
    return [torch.stack(out[i]) for i in ids]


def adapter_for(model, path, seed: int, **config):
    targets = LoRAConfig(**{**EVERY_GROUP, **config})
    if model.config.architecture != "voxcpm2":  # no fusion projection in VoxCPM1
        targets = dataclasses.replace(targets, target_proj_modules=targets.target_proj_modules[:3])
    return random_adapter(model.backbone, path, targets, seed=seed)


@pytest.mark.parametrize("preset", ["tiny-voxcpm2", "tiny-voxcpm1.5", "tiny-voxcpm0.5b"])
def test_runtime_adapter_equals_the_official_lora(preset, checkpoint_factory, tmp_path):
    ckpt = checkpoint_factory(preset, stop="never")
    model = load_model(ckpt)
    adapter_dir = adapter_for(model, tmp_path / "adapter", seed=3, alpha=6)  # scale 1.5: not a power of two
    noises = make_noise(PATCHES, model.config.feat_dim, model.config.patch_size, seed=5)
    params = SamplingParams(max_generate_length=PATCHES, min_len=2, seed=0)
    off = official_with_adapter(ckpt, adapter_dir, model.config.architecture)
    with injected_noise(noises):
        _, _, ref = off.generate_with_prompt_cache(target_text=TEXT, prompt_cache=None, min_len=2, max_len=PATCHES,
                                                   inference_timesteps=10, cfg_value=2.0, retry_badcase=False)
    # A request alone runs on the weights with its adapter merged; with merged steps off, the terms are added (the
    # CPU's exact mode keeps them off: batch_invariant=False to have them here).
    for merged_steps in (True, False):
        engine = LLMEngine(load_model(ckpt), EngineConfig(max_num_seqs=2, max_model_len=256, max_loras=2,
                                                          max_lora_rank=8,
                                                          options=EngineOptions(lora_merged_steps=merged_steps,
                                                                                batch_invariant=False)))
        engine.register_lora("voice", str(adapter_dir))
        [ours] = patches_of(engine, [dict(target_text=TEXT, params=params, injected_noise=noises, lora_name="voice")])
        path = "merged steps" if merged_steps else "terms"
        check_parity(f"{preset} runtime LoRA (every target group, {path}) latents", ours, ref[-len(ours):], 1e-4)
        assert engine.runner.lora.rewrites == (1 if merged_steps else 0)


def test_merged_steps_follow_the_slots_and_restore_the_base(checkpoint_factory, tmp_path):
    """One slot, two adapters in turn, then none: each request alone runs on the weights with its adapter merged,
    equal to the same request with the terms added (merged steps off); loading another adapter into the merged slot
    makes the next step rewrite the weights; afterwards the weights are the base ones bit for bit."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    model = load_model(ckpt)
    paths = {n: adapter_for(model, tmp_path / n, seed=40 + i, r=4, alpha=8) for i, n in enumerate(("a", "c"))}

    def engine(merged_steps: bool) -> LLMEngine:
        e = LLMEngine(load_model(ckpt), EngineConfig(max_num_seqs=2, max_model_len=256, max_loras=1,
                                                     max_lora_rank=4,
                                                     options=EngineOptions(lora_merged_steps=merged_steps,
                                                                           batch_invariant=False)))
        for name, path in paths.items():
            e.register_lora(name, str(path))
        return e

    merged, terms = engine(True), engine(False)
    base = {n: layer.weight.detach().clone() for n, layer in merged.runner.lora.layers.items()}
    noises = make_noise(PATCHES, model.config.feat_dim, model.config.patch_size, seed=8)
    for name in ("a", "c", None, "a"):  # c evicts a from the one slot merged with a; a evicts c again
        request = dict(target_text=TEXT, params=SamplingParams(max_generate_length=PATCHES, seed=1),
                       injected_noise=noises, lora_name=name)
        check_parity(f"adapter {name}: merged steps vs terms", patches_of(merged, [request])[0],
                     patches_of(terms, [request])[0], 1e-5)
        assert merged.runner.lora.merged == (-1 if name is None else 0)
    assert merged.runner.lora.rewrites == 4 and terms.runner.lora.rewrites == 0
    merged.runner.lora.merge(-1)
    for n, layer in merged.runner.lora.layers.items():
        assert torch.equal(layer.weight, base[n]), n


def test_mixed_batch_each_equals_its_solo_output(checkpoint_factory, tmp_path):
    """Two adapters of different ranks and no adapter, in one batch, all with the same prompt text, in an engine whose
    prefix cache holds that prompt's blocks from an earlier request of the first adapter: each request's patches
    equal those of the same request alone in a fresh engine (they would not if one adapter's request reused another's
    cached KV)."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    model = load_model(ckpt)
    adapters = {"a": adapter_for(model, tmp_path / "a", seed=11, r=4, alpha=8),
                "b": adapter_for(model, tmp_path / "b", seed=12, r=8, alpha=4)}
    config = EngineConfig(max_num_seqs=4, max_model_len=256, max_loras=2, max_lora_rank=8)

    def engine() -> LLMEngine:
        e = LLMEngine(load_model(ckpt), config)
        for name, path in adapters.items():
            e.register_lora(name, str(path))
        return e

    noises = [make_noise(PATCHES, model.config.feat_dim, model.config.patch_size, seed=s) for s in (1, 2, 3)]
    requests = [dict(target_text=LONG, params=SamplingParams(max_generate_length=PATCHES, seed=i),
                     injected_noise=noises[i], lora_name=name) for i, name in enumerate(("a", None, "b"))]
    solo = [patches_of(engine(), [r])[0] for r in requests]
    shared = engine()
    patches_of(shared, [{**requests[0], "params": SamplingParams(max_generate_length=2, seed=9),
                         "injected_noise": None}])
    assert len(shared.blocks.cached) >= 2, "the prompt left no full blocks in the prefix cache"
    together = patches_of(shared, requests)
    for name, alone, mixed in zip(("a", "none", "b"), solo, together, strict=True):
        check_parity(f"adapter {name}: in a mixed batch vs alone", mixed, alone, 1e-5)
    # the CUDA layout of the projections (q/k/v as one fused weight, the LoRA term added to its output), on the CPU
    fused = engine()
    fuse_projections(fused.model.backbone)
    for name, alone, got in zip(("a", "none", "b"), solo, patches_of(fused, requests), strict=True):
        check_parity(f"adapter {name}: fused q/k/v projection vs alone", got, alone, 1e-5)
    assert (solo[0] - solo[1]).abs().max() > 1e-3 and (solo[2] - solo[1]).abs().max() > 1e-3
    assert (solo[0] - solo[2]).abs().max() > 1e-3


def test_slots_reused_least_recently_used_and_unregister_waits(checkpoint_factory, tmp_path):
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    model = load_model(ckpt)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=256, max_loras=2, max_lora_rank=8))
    for i, name in enumerate(("a", "b", "c")):
        engine.register_lora(name, str(adapter_for(model, tmp_path / name, seed=20 + i)))
    params = SamplingParams(max_generate_length=2, seed=0)
    patches_of(engine, [dict(target_text=TEXT, params=params, lora_name="a")])
    patches_of(engine, [dict(target_text=TEXT, params=params, lora_name="b")])
    patches_of(engine, [dict(target_text=TEXT, params=params, lora_name="a")])  # a used after b
    patches_of(engine, [dict(target_text=TEXT, params=params, lora_name="c")])  # evicts b, the least recent
    resident = {d.name: d.resident for d in engine.list_loras()}
    assert resident == {"a": True, "b": False, "c": True}

    # both slots held by running requests: a request of a third adapter waits in the queue, and starts when a slot
    # frees; a request of an adapter unregistered while it waits fails, naming the field
    def fresh_engine() -> LLMEngine:
        return LLMEngine(load_model(ckpt), EngineConfig(max_num_seqs=4, max_model_len=256, max_loras=2,
                                                        max_lora_rank=8))

    held = [engine.add_request(TEXT, params, lora_name=n) for n in ("a", "c")]
    engine.step()
    waiting = engine.add_request(TEXT, SamplingParams(max_generate_length=3, seed=5), lora_name="b")
    engine.register_lora("d", str(adapter_for(model, tmp_path / "d", seed=24)))
    doomed = engine.add_request(TEXT, params, lora_name="d")
    engine.unregister_lora("d")
    events: dict[int, list] = {}
    for e in engine.step():
        events.setdefault(e.seq_id, []).append(e)
    assert engine.sequences[waiting].lora_slot == -1 and engine.sequences[waiting].status == Status.WAITING
    assert events[doomed][-1].finish_reason == "error" and "lora_name: no adapter named 'd'" in events[doomed][-1].error
    assert events[doomed][-1].error_kind == "lora_not_found"  # a 404 over HTTP, as when it is named unregistered
    # unregistering a held adapter lets its request finish; its slot frees after it, and the name is free at once:
    # registered again it is another adapter (it needs a slot of its own: its request waits for the old one's)
    engine.unregister_lora("a")
    assert [d.name for d in engine.list_loras()] == ["b", "c"]
    with pytest.raises(RequestError, match="lora_name: no adapter named 'a'"):
        engine.add_request(TEXT, params, lora_name="a")
    new_a = adapter_for(model, tmp_path / "a2", seed=30)
    engine.register_lora("a", str(new_a))
    while engine.has_unfinished():
        for e in engine.step():
            events.setdefault(e.seq_id, []).append(e)
            assert e.error is None, e.error
    assert all(i not in engine.sequences for i in held)
    late = torch.stack([e.patch for e in events[waiting]])
    alone = fresh_engine()
    alone.register_lora("b", str(tmp_path / "b"))
    check_parity("adapter b after waiting for a slot vs alone", late, patches_of(alone, [dict(
        target_text=TEXT, params=SamplingParams(max_generate_length=3, seed=5), lora_name="b")])[0], 1e-5)
    assert not engine.runner.lora.retiring  # the old a's slot is free again
    request = dict(target_text=TEXT, params=params, lora_name="a")
    fresh = fresh_engine()
    fresh.register_lora("a", str(new_a))
    check_parity("adapter a registered again vs in a fresh engine", patches_of(engine, [request])[0],
                 patches_of(fresh, [request])[0], 1e-5)


def test_an_adapter_leased_for_a_long_text_speaks_it_to_its_end(checkpoint_factory, tmp_path):
    """A long text's lease: unregistered meanwhile, and the name even registered again as another adapter, the
    requests carrying the lease still get the leased adapter (the same audio as before), every other request the name's
    new adapter (or a 404 while none); the old adapter's slot frees when its leases end (a client going away ends its
    own)."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    model = load_model(ckpt)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=256, max_loras=2, max_lora_rank=8))
    engine.register_lora("a", str(adapter_for(model, tmp_path / "a", seed=20)))
    params = SamplingParams(max_generate_length=2, seed=3)
    leased = dict(target_text=TEXT, params=params, lora_name="a", continuation=True, lora_lease=(1, "long-1"))
    plain = dict(target_text=TEXT, params=params, lora_name="a")
    old = patches_of(engine, [plain])[0]
    shutil.rmtree(tmp_path / "a")  # the file gone (an operator's clean-up): the held adapter is leased all the same
    engine.lease_lora(1, "long-1", "a", str(tmp_path / "a"))
    engine.lease_lora(2, "long-2", "a")
    engine.lease_lora(2, "long-3", "nobody")  # no such adapter: nothing leased
    engine.unregister_lora("a")
    assert engine.list_loras() == []
    with pytest.raises(RequestError, match="lora_name: no adapter named 'a'"):
        engine.add_request(**plain)
    with pytest.raises(RequestError, match="lora_name: no adapter named 'a'"):  # another client's lease: not its
        engine.add_request(**{**leased, "lora_lease": (3, "long-1")})
    check_parity("a leased adapter, unregistered, vs before", patches_of(engine, [leased])[0], old, 1e-5)
    engine.register_lora("a", str(adapter_for(model, tmp_path / "a2", seed=21)))
    new, again = patches_of(engine, [plain, leased])  # together: the two adapters of one name in two slots
    check_parity("a leased adapter, its name registered again, vs before", again, old, 1e-5)
    assert (new - old).abs().max() > 1e-3
    slots = engine.runner.lora
    assert len(slots.resident) == 2 and not slots.free_slots
    engine.lease_lora(1, "long-1", None)
    assert len(slots.resident) == 2  # client 2 still leases the old adapter
    engine.end_lora_leases(2)  # client 2 went away
    assert len(slots.resident) == 1 and len(slots.free_slots) == 1 and not slots.leases
    check_parity("the lease ended: the name's adapter", patches_of(engine, [leased])[0], new, 1e-5)


@pytest.mark.parametrize("slot_wait_s", [0.0, 1.0])
def test_a_request_waiting_for_a_slot_is_not_starved_by_the_resident_adapters_stream(checkpoint_factory, tmp_path,
                                                                                    slot_wait_s):
    """One slot, adapter a's requests arriving as fast as they finish: a request of adapter b, behind two running a's,
    starts once they are done (with lora_slot_wait_s 0 the a's that came after it wait behind it at once), then the
    later a's run. With a wait of 1 s, later a's start before it for that long, then it starts all the same."""
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=256, max_loras=1, max_lora_rank=8,
                                           lora_slot_wait_s=slot_wait_s))
    for i, name in enumerate(("a", "b")):
        engine.register_lora(name, str(adapter_for(model, tmp_path / name, seed=50 + i, r=4, alpha=8)))
    params = SamplingParams(max_generate_length=3, seed=0)
    for _ in range(2):
        engine.add_request(TEXT, params, lora_name="a")
        engine.step()  # staggered: one of them is always running
    waiter = engine.add_request(TEXT, params, lora_name="b")
    later: set[int] = set()  # the a's added after it
    passed: set[int] = set()  # of those, the ones that made a patch before it did
    started_at, steps, deadline = None, 0, time.monotonic() + 60
    while (steps < 60 or slot_wait_s) and started_at is None and time.monotonic() < deadline:
        for e in engine.step():
            if e.finished and e.seq_id != waiter:
                later.add(engine.add_request(TEXT, params, lora_name="a"))  # another a for each that ends
            if e.seq_id == waiter:
                started_at = steps
            elif e.seq_id in later:
                passed.add(e.seq_id)
        steps += 1
    assert started_at is not None, steps
    if slot_wait_s:
        assert passed, later  # a later a started before it (the first one ahead ends within 3 patches)
    else:
        assert started_at <= 8 and not passed, (started_at, passed)  # the two a's ahead of it: 3 patches each
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free == len(engine.blocks.blocks) and not any(
        h.refs for h in engine.runner.lora.resident.values())


def test_a_continuation_admitted_ahead_of_the_waiter_keeps_its_clock(checkpoint_factory, tmp_path):
    """A long text's next segment of the resident adapter is queued ahead of a request waiting for a slot and takes
    the slot's adapter at once; the waiter's clock runs on (it restarted at each such admission, so a stream of them
    kept the busy slot from ever draining for it)."""
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=256, max_loras=1, max_lora_rank=8,
                                           lora_slot_wait_s=60.0))
    for i, name in enumerate(("a", "b")):
        engine.register_lora(name, str(adapter_for(model, tmp_path / name, seed=70 + i, r=4, alpha=8)))
    params = SamplingParams(max_generate_length=20, seed=0)
    engine.add_request(TEXT, params, lora_name="a")
    engine.step()
    waiter = engine.add_request(TEXT, params, lora_name="b")
    engine.step()
    lora = engine.runner.lora
    assert lora.waiter == waiter and lora.waiter_since is not None
    since = lora.waiter_since
    following = engine.add_request(TEXT, params, lora_name="a", continuation=True)
    engine.step()
    assert engine.sequences[following] in engine.scheduler.running  # ahead of the waiter, on the resident slot
    assert lora.waiter == waiter and lora.waiter_since == since
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free == len(engine.blocks.blocks)


def test_a_burst_of_more_adapters_than_slots_runs_what_fits_at_once(checkpoint_factory, tmp_path):
    """16 requests over 4 adapters in turn, 2 slots: the first round starts all 8 of the two adapters it loads (the
    requests behind the first waiting one pass it: its wait is younger than lora_slot_wait_s), and the rest start
    when those end. The burst takes two requests' lengths, not eight (one request an adapter at a time)."""
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=16, max_model_len=256, max_loras=2, max_lora_rank=8,
                                           lora_slot_wait_s=60.0))  # (the default 0.5 s is plenty; this is sure)
    for i, name in enumerate("abcd"):
        engine.register_lora(name, str(adapter_for(model, tmp_path / name, seed=60 + i, r=4, alpha=8)))
    patches = 5
    ids = [engine.add_request(TEXT, SamplingParams(max_generate_length=patches, seed=i), lora_name="abcd"[i % 4])
           for i in range(16)]
    running, steps = [], 0
    while engine.has_unfinished() and steps < 100:
        events = engine.step()
        assert all(e.error is None for e in events)
        running.append(len(engine.scheduler.running))
        steps += 1
    assert running[0] == 8, running  # a and b: every one of their requests
    assert not engine.has_unfinished() and steps <= 2 * (patches + 2), running
    assert all(i not in engine.sequences for i in ids)
    assert engine.blocks.num_free == len(engine.blocks.blocks) and not any(
        h.refs for h in engine.runner.lora.resident.values())


def test_a_waiter_that_leaves_unserved_takes_its_clock_along(checkpoint_factory, tmp_path):
    """Two slots held by a and b; a request of c waits past lora_slot_wait_s, then is aborted. A request of d waiting
    next starts its own wait: the a's and b's behind it start (no slot is closed at once for it)."""
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=8, max_model_len=256, max_loras=2, max_lora_rank=8,
                                           lora_slot_wait_s=0.3))
    for i, name in enumerate("abcd"):
        engine.register_lora(name, str(adapter_for(model, tmp_path / name, seed=80 + i, r=4, alpha=8)))
    long = SamplingParams(max_generate_length=30, seed=0)
    for name in "ab":
        engine.add_request(TEXT, long, lora_name=name)
    engine.step()
    gone = engine.add_request(TEXT, long, lora_name="c")
    engine.step()  # c waits
    time.sleep(0.4)
    engine.abort(gone)
    engine.add_request(TEXT, long, lora_name="d")
    behind = [engine.add_request(TEXT, long, lora_name=n) for n in "abab"]
    engine.step()
    assert all(engine.sequences[i].status == Status.RUNNING for i in behind)
    assert engine.runner.lora.draining is None
    for i in list(engine.sequences):
        engine.abort(i)
    assert engine.blocks.num_free == len(engine.blocks.blocks)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_over_more_adapters_than_slots_finishes_every_request(checkpoint_factory, tmp_path, seed):
    """Random arrivals over 3 adapters and none, 1-2 slots, random lengths and aborts, slot waits of 0 and 20 ms:
    every request ends, once (an aborted one never again), and when idle every slot hold and KV block is free. (Its
    arrivals stop, so this checks leaks and liveness, not starvation: the tests above do.)"""
    rng = random.Random(seed)
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=6, max_model_len=256, max_loras=1 + seed % 2,
                                           max_lora_rank=8, lora_slot_wait_s=0.02 * (seed // 2)))
    for i, name in enumerate("abc"):
        engine.register_lora(name, str(adapter_for(model, tmp_path / name, seed=70 + i, r=4, alpha=8)))
    live: set[int] = set()
    ended: list[int] = []
    added = steps = 0
    while (added < 40 or live) and steps < 1500:
        for _ in range(rng.choice((0, 0, 1, 2)) if added < 40 else 0):
            name = rng.choice(("a", "a", "a", "b", "c", None))  # a's stream is the busiest
            params = SamplingParams(max_generate_length=rng.randint(1, 4), seed=added)
            live.add(engine.add_request(TEXT, params, lora_name=name))
            added += 1
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
            ended.append(victim)
        for e in engine.step():
            assert e.error is None, e.error
            assert e.seq_id in live, e.seq_id  # no event after a request's end or abort
            if e.finished:
                live.discard(e.seq_id)
                ended.append(e.seq_id)
        steps += 1
    assert not live and not engine.has_unfinished(), (steps, sorted(live))
    assert len(ended) == len(set(ended)) == added
    assert engine.blocks.num_free == len(engine.blocks.blocks)
    assert not any(h.refs for h in engine.runner.lora.resident.values()) and not engine.runner.lora.retiring


def test_bad_names_and_adapters_are_refused(checkpoint_factory, tmp_path):
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    plain = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256))
    with pytest.raises(RequestError, match=r"lora_name: this engine serves no runtime LoRA adapters \(max_loras=0\)"):
        plain.add_request(TEXT, lora_name="voice")
    engine = LLMEngine(load_model(checkpoint_factory("tiny-voxcpm2", stop="never")),
                       EngineConfig(max_num_seqs=2, max_model_len=256, max_loras=1, max_lora_rank=4))
    ok = adapter_for(model, tmp_path / "ok", seed=1)
    with pytest.raises(LoRAError, match="must be 1-64 letters"):
        engine.register_lora("../etc", str(ok))
    wide = adapter_for(model, tmp_path / "wide", seed=2, r=8)
    with pytest.raises(LoRAError, match="lora_config.r: 8 is above this engine's max_lora_rank 4"):
        engine.register_lora("wide", str(wide))
    mlp = random_adapter(model.backbone, tmp_path / "mlp", LoRAConfig(enable_lm=True, r=4, alpha=8,
                                                                   target_modules_lm=["gate_proj"]), seed=3)
    with pytest.raises(LoRAError, match="runtime adapters adapt q/k/v/o.*merge this adapter at start-up"):
        engine.register_lora("mlp", str(mlp))
    engine.register_lora("ok", str(ok))
    with pytest.raises(LoRAError, match="'ok' is registered already"):
        engine.register_lora("ok", str(ok))
    with pytest.raises(RequestError, match=r"lora_name: no adapter named 'other' \(registered: \['ok'\]\)"):
        engine.add_request(TEXT, lora_name="other")
    assert not engine.sequences and not engine.has_unfinished()  # nothing half-added


def test_an_adapter_that_overflows_once_scaled_or_fails_to_load_takes_no_slot(checkpoint_factory, tmp_path,
                                                                             monkeypatch):
    from engine.runner.lora import LoRASlots
    engine = LLMEngine(load_model(checkpoint_factory("tiny-voxcpm2", stop="never")),
                       EngineConfig(max_num_seqs=2, max_model_len=256, max_loras=1, max_lora_rank=4))
    slots = engine.runner.lora
    adapter = read_adapter(str(adapter_for(engine.model, tmp_path / "ok", seed=1)))
    huge = dataclasses.replace(adapter, config=dataclasses.replace(adapter.config, alpha=1e45))  # finite as a double
    scale = re.escape(f"{1e45 / adapter.config.r:g}")
    with pytest.raises(LoRAError, match=rf"lora_B: not finite once scaled by alpha / r = {scale} \(lora_config\)"):
        slots.register("huge", huge)
    slots.register("ok", adapter)
    free = list(slots.free_slots)
    monkeypatch.setattr(LoRASlots, "_load", lambda self, reg, slot: (_ for _ in ()).throw(RuntimeError("load")))
    with pytest.raises(RuntimeError, match="load"):
        slots.acquire(slots.resolve("ok"))
    assert sorted(slots.free_slots) == sorted(free) and not slots.resident  # the slot came back
    monkeypatch.undo()
    slot, _ = slots.acquire(slots.resolve("ok"))
    slots.release(slot)


def test_on_the_cpu_an_adapters_audio_does_not_depend_on_its_batch(checkpoint_factory, tmp_path):
    """The CPU's exact mode: a request of adapter a alone, beside one of adapter b (a step of mixed adapters adds
    their terms) and alone again are bit-equal (merged-adapter steps would round otherwise: they are off there)."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    model = load_model(ckpt)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256, max_loras=2, max_lora_rank=8))
    for name, seed in (("a", 21), ("b", 22)):
        engine.register_lora(name, str(adapter_for(model, tmp_path / name, seed=seed, r=4, alpha=8)))
    mine = dict(target_text=TEXT, params=SamplingParams(max_generate_length=3, seed=1), lora_name="a")
    other = dict(target_text=TEXT + " Another.", params=SamplingParams(max_generate_length=3, seed=2), lora_name="b")
    alone = patches_of(engine, [mine])[0]
    mixed = patches_of(engine, [mine, other])[0]
    again = patches_of(engine, [mine])[0]
    assert torch.equal(alone, mixed) and torch.equal(alone, again)


def test_pool_adapters_survive_a_worker_restart(checkpoint_factory, tmp_path):
    """Through the server pool: an adapter registered on the workers serves requests that name it, a restarted worker
    gets it again (the client replays its registrations and its leases), and unregistering it everywhere makes its name
    unknown, but to the requests of a long text leasing it until that lease ends, on a worker restarted since too."""
    import asyncio

    import numpy as np

    from engine import SynthesisRequest, VoxCPM
    from engine.errors import LoRANotFoundError

    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    model = load_model(ckpt)
    adapter, other = adapter_for(model, tmp_path / "voice", seed=5), adapter_for(model, tmp_path / "other", seed=6)

    async def scenario() -> None:
        pool = VoxCPM.from_pretrained(str(ckpt), max_num_seqs=2, max_model_len=256, max_loras=2, max_lora_rank=8)
        try:
            await pool.wait_for_ready(timeout=120)
            assert (await pool.register_lora("voice", str(adapter))).name == "voice"

            async def audio(lora_name: str | None) -> np.ndarray:
                return np.concatenate([c async for c in pool.generate(TEXT, max_generate_length=3, seed=2,
                                                                      lora_name=lora_name)])

            async def continued() -> np.ndarray:  # a long text's later segment
                request = SynthesisRequest(TEXT, params=SamplingParams(max_generate_length=3, seed=2),
                                           lora_name="voice", continuation=True, lora_lease="long-1")
                return np.concatenate([c async for c in pool.submit(request)])

            before, plain = await audio("voice"), await audio(None)
            assert np.abs(before - plain).max() > 1e-3
            pool.client.lease_lora("long-1", "voice")
            pool.kill_worker(0)
            async def noticed() -> None:
                while pool.healthy:
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(noticed(), 10)  # a hang guard: the client notices the death at once
            await pool.restart(timeout=120)
            assert [d.name for d in await pool.list_loras()] == ["voice"]
            np.testing.assert_allclose(await audio("voice"), before, atol=1e-5)
            await pool.unregister_lora("voice")
            with pytest.raises(LoRANotFoundError, match="lora_name: no adapter named 'voice'"):
                await audio("voice")
            np.testing.assert_allclose(await continued(), before, atol=1e-5)
            # its name registered again as another adapter, then the worker restarted: the new worker is given the
            # lease's adapter from where it was registered (it bound the lease to the name's new adapter: the text's
            # later segments spoke in another voice; with the name unregistered they failed)
            assert (await pool.register_lora("voice", str(other))).name == "voice"
            pool.kill_worker(0)
            await asyncio.wait_for(noticed(), 10)
            await pool.restart(timeout=120)
            np.testing.assert_allclose(await continued(), before, atol=1e-5)
            assert np.abs(await audio("voice") - before).max() > 1e-3  # the name's new adapter
            await pool.unregister_lora("voice")
            pool.client.lease_lora("long-1", None)
            with pytest.raises(LoRANotFoundError, match="lora_name: no adapter named 'voice'"):
                await continued()
            with pytest.raises(LoRANotFoundError):
                await pool.unregister_lora("voice")
        finally:
            await pool.stop()

    asyncio.run(scenario())


def test_graph_shaped_prefill_with_adapters_and_audio_rows_equals_eager(checkpoint_factory, tmp_path):
    """The prefill that CUDA graphs capture, with the adapters' terms (LocEnc on the packed audio rows with each
    row's adapter slot, the LMs over the padded token rows), gives the eager prefill's hidden states for one batch of
    two adapters and none, with prompt and reference audio."""
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=256, max_loras=2, max_lora_rank=8))
    for name, seed, rank in (("a", 11, 4), ("b", 12, 8)):
        engine.register_lora(name, str(adapter_for(model, tmp_path / name, seed=seed, r=rank, alpha=8)))
    clip = torch.randn(12, model.config.feat_dim, generator=torch.Generator().manual_seed(3))
    conditioning = [("a", dict(prompt_text="A prompt.", prompt_latents=clip)), (None, dict(ref_latents=clip)),
                    ("b", {}), ("b", dict(ref_latents=clip))]
    for i, (name, kwargs) in enumerate(conditioning):
        engine.add_request(TEXT, SamplingParams(max_generate_length=2, seed=i), lora_name=name, **kwargs)
    seqs = engine.scheduler.schedule().prefill
    x = engine.runner.prefill_inputs(seqs)
    assert len(seqs) == 4 and x.audio_mask.any() and len({s.lora_slot for s in seqs}) == 3
    with torch.inference_mode():
        eager = engine.runner.prefill_eager(x, terms=True)
        buffered = engine.runner.prefill_buffered(x, terms=True)
        plain = engine.runner.prefill_eager(x, terms=False)
    for a, b in zip(eager, buffered, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert (eager[0] - plain[0]).abs().max() > 1e-3  # the adapters' terms are in it
