"""The CPU runtime on tiny checkpoints: batching does not change a seeded request's audio, and KV
blocks are never leaked (finish, abort, rejection, preemption)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from engine.io.checkpoint import load_model
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import SamplingParams
from tests.conftest import clip_latents


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))


def _requests(model):
    clip = clip_latents(model, 3, seed=1)
    return [
        dict(target_text="Zero shot request.", params=SamplingParams(seed=1, max_generate_length=5)),
        dict(target_text="(whispering) Designed voice.", params=SamplingParams(seed=2, max_generate_length=7)),
        dict(target_text="Continue this.", prompt_text="A prompt.", prompt_latents=clip,
             params=SamplingParams(seed=3, max_generate_length=6, cfg_value=1.5)),
        dict(target_text="Reference voice.", ref_latents=clip,
             params=SamplingParams(seed=4, max_generate_length=4, temperature=0.7)),
    ]


def _run_all(engine: LLMEngine, reqs: list[dict]) -> dict[int, np.ndarray]:
    audio = engine.generate_all(reqs)
    assert engine.blocks.num_free == len(engine.blocks.blocks), "KV blocks leaked"
    return dict(enumerate(audio))


def test_concurrent_mixed_modes_equal_alone(model):
    reqs = _requests(model)
    together = _run_all(LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=256, block_size=4)), reqs)
    for n, r in enumerate(reqs):
        alone = _run_all(LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, block_size=4)), [r])[0]
        assert together[n].shape == alone.shape
        np.testing.assert_array_equal(together[n], alone)


def test_continuations_admitted_together_equal_alone(model):
    """Prompt contexts of one length are decoded into the new VAE streams in one batched pass."""
    reqs = [dict(target_text=f"Continue number {i}.", prompt_text="A prompt.",
                 prompt_latents=clip_latents(model, 3, seed=i), params=SamplingParams(seed=i, max_generate_length=4))
            for i in range(3)]
    # max_num_seqs 12, 3-patch contexts: one chunk of 3 padded to 4 rows (the padding row decodes into the scratch slot)
    together = _run_all(LLMEngine(model, EngineConfig(max_num_seqs=12, max_model_len=256, block_size=4)), reqs)
    for n, r in enumerate(reqs):
        alone = _run_all(LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, block_size=4)), [r])[0]
        np.testing.assert_array_equal(together[n], alone)


def test_seed_reproducible_and_temperature_zero_deterministic(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256))
    a = engine.generate("Same seed.", SamplingParams(seed=7, max_generate_length=4))
    b = engine.generate("Same seed.", SamplingParams(seed=7, max_generate_length=4))
    c = engine.generate("Same seed.", SamplingParams(seed=8, max_generate_length=4))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3
    high = engine.generate("Same seed.", SamplingParams(seed=7 + 2**32, max_generate_length=4))
    assert np.abs(a - high).max() > 1e-3  # the generator's 32 bits: the high half is folded in, not dropped
    biggest = engine.generate("Same seed.", SamplingParams(seed=2**64 - 1, max_generate_length=4))
    assert np.isfinite(biggest).all()
    d = engine.generate("No noise.", SamplingParams(seed=1, temperature=0.0, max_generate_length=4))
    e = engine.generate("No noise.", SamplingParams(seed=2, temperature=0.0, max_generate_length=4))
    np.testing.assert_array_equal(d, e)


def test_noise_seeds_below_2_to_the_32_are_their_own():
    """Seeds the generator took whole before the fold keep their noise (and so their audio)."""
    from engine.llm_engine import noise_seed
    assert [noise_seed(s) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]
    assert noise_seed(7 + 2**32) != noise_seed(7) and 0 <= noise_seed(2**64 - 1) < 2**32
    assert 0 <= noise_seed(None) < 2**32


def test_abort_frees_blocks(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256, block_size=4))
    total = engine.blocks.num_free
    seq_id = engine.add_request("This request is cancelled.", SamplingParams(max_generate_length=20))
    engine.step()
    engine.step()
    assert engine.blocks.num_free < total
    engine.abort(seq_id)
    assert engine.blocks.num_free == total and not engine.has_unfinished()


def test_request_that_never_fits_is_rejected_with_reason(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=32, block_size=4))
    seq_id = engine.add_request("word " * 40, SamplingParams(max_generate_length=50))
    events = engine.step()
    assert [(e.seq_id, e.finished) for e in events] == [(seq_id, True)]
    assert "max_model_len=32" in events[0].error
    assert engine.blocks.num_free == len(engine.blocks.blocks)


def test_a_failed_step_keeps_its_refusals_and_its_queue(model, monkeypatch):
    """A step whose prefill raises: the requests it refused before failing keep their own reasons (`after_failed_step`:
    they were lost, and the worker failed them as the step), the one it was starting ends with "error" and its blocks
    are free, and one still queued (no seat) stays queued and is served by the next steps."""
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=32, block_size=4))
    refused = engine.add_request("word " * 40, SamplingParams(max_generate_length=50))
    started = engine.add_request("Hello there.", SamplingParams(max_generate_length=2, seed=1))
    queued = engine.add_request("Then me.", SamplingParams(max_generate_length=2, seed=2))
    prefill = engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda seqs: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    (event,), still_queued = engine.after_failed_step()
    assert event.seq_id == refused and event.finish_reason == "error" and "max_model_len=32" in event.error
    assert engine.after_failed_step() == ([], {queued}) and started not in engine.sequences
    assert still_queued == {queued} and [s.seq_id for s in engine.scheduler.waiting] == [queued]
    monkeypatch.setattr(engine.runner, "prefill", prefill)
    patches = []
    while engine.has_unfinished():
        patches += [e for e in engine.step() if e.seq_id == queued and e.patch is not None]
    assert len(patches) == 2 and engine.blocks.num_free == len(engine.blocks.blocks)


def test_an_over_long_prompt_names_its_longest_part(model):
    """The part to shorten (the target text, or the voice's transcript, prompt audio or reference audio) starts the
    message by its request field, and each part's tokens follow."""
    cfg = model.config
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=48, block_size=4))

    def frames(patches: int) -> torch.Tensor:
        return torch.zeros(patches * cfg.patch_size, cfg.feat_dim)

    cases = {"target_text": dict(target_text="word " * 60),
             "prompt_text": dict(target_text="Hi.", prompt_text="word " * 60, prompt_latents=frames(2)),
             "prompt_latents": dict(target_text="Hi.", prompt_text="Hi.", prompt_latents=frames(60)),
             "ref_latents": dict(target_text="Hi.", ref_latents=frames(60))}
    for field, request in cases.items():
        seq_id = engine.add_request(**request, params=SamplingParams(max_generate_length=4))
        (event,) = [e for e in engine.step() if e.seq_id == seq_id]
        assert event.finished and event.error.startswith(f"{field}: the prompt (text and voice) is "), event.error
        assert "max_model_len=48" in event.error
        if field == "ref_latents":
            assert re.search(r"\(\d+ of text, \d+ of voice: 60 of reference audio\)", event.error), event.error
    assert engine.blocks.num_free == len(engine.blocks.blocks)


def test_request_exactly_filling_max_model_len_is_admitted(model):
    """A prompt plus max_generate_length that fills max_model_len exactly fits (and runs to its length); one patch
    more never fits and is refused naming the field."""
    text = "Fills the context, with words enough to let it run on."
    probe = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=64, block_size=4))
    seq = probe.sequences[probe.add_request(text, SamplingParams(max_generate_length=1))]
    room = 64 - seq.num_prompt_tokens
    assert 0 < room <= seq.prompt.target_tokens * 6  # the official cap does not shorten it below the room
    probe.abort(seq.seq_id)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=64, block_size=4))
    fits = engine.add_request(text, SamplingParams(seed=1, max_generate_length=room))
    over = engine.add_request(text, SamplingParams(seed=1, max_generate_length=room + 1))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    ends = {e.seq_id: e for e in events if e.finished}
    assert ends[fits].error is None and ends[fits].finish_reason == "length"
    assert sum(1 for e in events if e.seq_id == fits) == room
    assert ends[over].error is not None and ends[over].error.startswith("max_generate_length:")
    assert engine.blocks.num_free == len(engine.blocks.blocks)


def test_preemption_recomputes_and_keeps_audio_identical(model):
    """A KV cache too small for all streams at once: streams get preempted and recomputed from
    prompt + generated patches; each still produces the audio it produces alone (same seed)."""
    reqs = [dict(target_text=f"Stream number {i} speaks.", params=SamplingParams(seed=10 + i, max_generate_length=12))
            for i in range(3)]
    small = LLMEngine(model, EngineConfig(max_num_seqs=3, max_model_len=64, block_size=4, num_kv_blocks=12))
    together = _run_all(small, reqs)
    assert small.scheduler.num_preemptions > 0
    assert small.blocks.num_free == 12
    for n, r in enumerate(reqs):
        alone = _run_all(LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=64, block_size=4)), [r])[0]
        assert together[n].shape == alone.shape
        np.testing.assert_array_equal(together[n], alone)


def test_graph_shaped_prefill_equals_eager_prefill(model):
    """The prefill that CUDA graphs capture (static buffers padded to a token bucket, the audio rows' patches packed
    and padded to a row bucket for LocEnc, per-token attention without host-side lengths) gives the eager prefill's
    hidden states, also when a sequence reuses prefix-cached blocks, and for text alone (no LocEnc: its packed rows
    are left as they were). Run eagerly here; the GPU check replays it."""
    engine = LLMEngine(model, EngineConfig(max_num_seqs=5, max_model_len=256, block_size=4))
    reqs = _requests(model)
    for r in reqs:
        engine.add_request(r["target_text"], r["params"], **{k: v for k, v in r.items()
                                                            if k not in ("target_text", "params")})
    engine.step()  # prefill (eager) + first patch: the blocks of these prompts are now in the prefix cache
    again = engine.add_request(reqs[2]["target_text"], SamplingParams(seed=9, max_generate_length=3),
                               prompt_text=reqs[2]["prompt_text"], prompt_latents=reqs[2]["prompt_latents"])
    sched = engine.scheduler.schedule()
    seqs = sched.prefill
    assert [s.seq_id for s in seqs] == [again] and seqs[0].num_cached_tokens > 0
    runner = engine.runner
    x = runner.prefill_inputs(seqs)
    with torch.inference_mode():
        eager = runner.prefill_eager(x)
        buffered = runner.prefill_buffered(x)
    for a, b in zip(eager, buffered, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # A multi-sequence prefill without cached blocks, through a fresh engine.
    fresh = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=256, block_size=4))
    for r in reqs:
        fresh.add_request(r["target_text"], r["params"], **{k: v for k, v in r.items()
                                                            if k not in ("target_text", "params")})
    seqs = fresh.scheduler.schedule().prefill
    assert len(seqs) == 4
    x = fresh.runner.prefill_inputs(seqs)
    with torch.inference_mode():
        eager = fresh.runner.prefill_eager(x)
        buffered = fresh.runner.prefill_buffered(x)
    for a, b in zip(eager, buffered, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # Text alone after it: stale audio embeddings in the buffers must not leak into its rows.
    for seq in seqs:
        fresh.abort(seq.seq_id)
    for r in reqs[:2]:
        fresh.add_request(r["target_text"] + " Again.", r["params"])
    seqs = fresh.scheduler.schedule().prefill
    x = fresh.runner.prefill_inputs(seqs)
    assert len(seqs) == 2 and not x.audio_mask.any()
    buffers = fresh.runner.prefill_buffers
    packed = buffers.inputs.audio_feats.clone()
    buffers.audio_embed.fill_(float("nan"))  # what LocEnc left there is never read at a text row
    with torch.inference_mode():
        eager = fresh.runner.prefill_eager(x)
        buffered = fresh.runner.prefill_buffered(x)
    for a, b in zip(eager, buffered, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert torch.equal(buffers.inputs.audio_feats, packed)


def test_request_needing_every_kv_block_is_admitted(model):
    """A request whose prompt and patches fill exactly the whole cache fits (never_fits lets it in), so it
    must be admitted once the cache is empty instead of waiting forever at the head of the queue."""
    probe = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, block_size=64))
    seq = probe.sequences[probe.add_request("Fills the cache.", SamplingParams(seed=1, max_generate_length=2))]
    blocks = probe.blocks.blocks_needed(seq.num_prompt_tokens + seq.max_patches)
    assert blocks == probe.blocks.blocks_needed(seq.num_prompt_tokens)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, block_size=64, num_kv_blocks=blocks))
    seq_id = engine.add_request("Fills the cache.", SamplingParams(seed=1, max_generate_length=2))
    finished = []
    for _ in range(20):
        finished += [e for e in engine.step() if e.finished]
        if not engine.has_unfinished():
            break
    assert [(e.seq_id, e.error) for e in finished] == [(seq_id, None)]
    assert engine.blocks.num_free == blocks


def test_failed_prefill_does_not_poison_the_prefix_cache(model, monkeypatch):
    """Blocks are entered in the prefix cache when allocated, before the prefill computes them: a step
    that fails must not leave their hashes behind for the next request with the same prompt."""
    r = _requests(model)[2]  # continuation prompt: several full blocks
    kw = dict(prompt_text=r["prompt_text"], prompt_latents=r["prompt_latents"])
    alone = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256, block_size=4)).generate(
        r["target_text"], SamplingParams(seed=3, max_generate_length=4), **kw)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256, block_size=4))
    real_prefill = engine.runner.prefill

    def failing_prefill(seqs):
        raise RuntimeError("injected: out of memory in prefill")

    monkeypatch.setattr(engine.runner, "prefill", failing_prefill)
    seq_id = engine.add_request(r["target_text"], SamplingParams(seed=3, max_generate_length=4), **kw)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.abort(seq_id)  # what the worker does for every request after a failed step
    assert engine.blocks.num_free == len(engine.blocks.blocks) and len(engine.runner.free_slots) == 2
    monkeypatch.setattr(engine.runner, "prefill", real_prefill)
    again = engine.generate(r["target_text"], SamplingParams(seed=3, max_generate_length=4), **kw)
    np.testing.assert_array_equal(again, alone)


def test_recycled_prefix_cache_block_never_serves_stale_kv(model):
    """A freed block keeps its hash (a later identical prompt reuses its KV) only until it is taken for other
    tokens. A cache that holds one request: a second, different prompt of the same size rewrites every block of
    the first; the first prompt again must then be computed afresh and sound as it did, not reuse the new KV."""
    r = _requests(model)[2]  # continuation prompt: several full blocks
    params = SamplingParams(seed=3, max_generate_length=4)
    first = dict(prompt_text=r["prompt_text"], prompt_latents=r["prompt_latents"])
    other = dict(prompt_text="B prompt.",
                 prompt_latents=clip_latents(model, 3, seed=99))  # differs from the first token
    probe = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, block_size=4))
    seq = probe.sequences[probe.add_request(r["target_text"], params, **first)]
    needed = probe.blocks.blocks_needed(seq.num_prompt_tokens + seq.max_patches)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, block_size=4, num_kv_blocks=needed))
    before = engine.generate(r["target_text"], params, **first)
    engine.generate(r["target_text"], params, **other)  # takes, and overwrites, every block
    seq_id = engine.add_request(r["target_text"], params, **first)
    seq = engine.sequences[seq_id]
    chunks = [e.audio for e in engine.step() if e.seq_id == seq_id]
    assert seq.num_cached_tokens == 0, "a block rewritten for another prompt was served from the prefix cache"
    while engine.has_unfinished():
        chunks += [e.audio for e in engine.step() if e.seq_id == seq_id]
    recomputed = np.concatenate(chunks)
    np.testing.assert_array_equal(recomputed, before)
    again = engine.generate(r["target_text"], params, **first)  # now a legitimate hit on its own blocks
    np.testing.assert_array_equal(again, before)


def test_sampling_params_validate_checks_every_field_and_names_it():
    """validate() walks SAMPLING_LIMITS: each field of SamplingParams has its bound there, and a value out of it, or of
    the wrong type, is refused naming that field."""
    import dataclasses

    from engine.vocabulary import SAMPLING_LIMITS

    assert list(SAMPLING_LIMITS) == [f.name for f in dataclasses.fields(SamplingParams)]
    SamplingParams().validate()
    for name, bound in SAMPLING_LIMITS.items():
        for value in (bound.low - 1, bound.high + 1, "1", True, float("nan")):
            with pytest.raises(ValueError, match=f"^{name}: must be"):
                SamplingParams(**{name: value}).validate()


def test_free_list_stays_bounded_under_prefix_cache_hits():
    """Cache hits take blocks from the middle of the free list (lazily); its queue must not grow without
    bound, and every block stays allocatable exactly once."""
    from engine.block_manager import BlockManager
    from engine.prompt import Prompt
    from engine.sequence import Sequence

    blocks = BlockManager(num_blocks=8, block_size=4)
    prompt = Prompt(token_ids=list(range(9)), feats=torch.zeros(9, 4, 64), audio_mask=torch.zeros(9, dtype=torch.bool),
                    target_tokens=9, context=torch.zeros(0, 4, 64))
    for _ in range(100):  # the same prompt again and again: its two full blocks are hits from the free list
        seq = Sequence(prompt=prompt, params=SamplingParams(), max_patches=1)
        blocks.allocate(seq)
        blocks.free(seq)
    assert len(blocks.free_queue) <= 2 * len(blocks.blocks) + 3
    assert blocks.num_free == 8
    taken = {blocks._take().block_id for _ in range(8)}
    assert taken == set(range(8)) and blocks.num_free == 0


def test_a_reused_prefix_is_freed_last_so_it_outlives_colder_blocks():
    """A prefix served from the cache and freed again goes to the back of the free list: new allocations take the
    blocks freed before it (a stale entry of its earlier free must not put it first), and it is found a third time."""
    from engine.block_manager import BlockManager
    from engine.prompt import Prompt
    from engine.sequence import Sequence

    def sequence(ids: list[int]) -> Sequence:
        n = len(ids)
        return Sequence(prompt=Prompt(token_ids=ids, feats=torch.zeros(n, 4, 64), target_tokens=n,
                                      audio_mask=torch.zeros(n, dtype=torch.bool), context=torch.zeros(0, 4, 64)),
                        params=SamplingParams(), max_patches=1)

    blocks = BlockManager(num_blocks=6, block_size=4)
    hot = list(range(100, 109))  # two full blocks and a partial one
    hits = []
    for _ in range(2):
        seq = sequence(hot)
        blocks.allocate(seq)
        hits.append(seq.num_cached_tokens)
        blocks.free(seq)
    assert hits == [0, 8]  # the second time from the cache: taken from the middle of the free list, freed again
    others = [sequence(list(range(200, 212))), sequence(list(range(300, 303)))]  # four blocks: all but hot's two
    for seq in others:
        blocks.allocate(seq)
    for seq in others:
        blocks.free(seq)
    again = sequence(hot)
    blocks.allocate(again)
    assert again.num_cached_tokens == 8


def _run_events(engine: LLMEngine, reqs: list[dict], late: tuple[dict, ...] = (), abort_after: int | None = None
                ) -> tuple[dict[int, np.ndarray], dict[int, str | None]]:
    """Run to completion; `late` requests join after two steps; request 0 is aborted after `abort_after`
    of its chunks (and must get no event after that). Returns audio and finish reason by request number
    (reqs, then late)."""
    def add(r: dict) -> int:
        return engine.add_request(r["target_text"], r["params"])

    ids = [add(r) for r in reqs]
    chunks: dict[int, list[np.ndarray]] = {}
    reasons: dict[int, str | None] = {}
    steps = 0
    while engine.has_unfinished() or (steps < 2 and late):
        if steps == 2:
            ids += [add(r) for r in late]
        for ev in engine.step():
            assert ev.error is None, ev.error
            assert reasons.get(ev.seq_id) != "aborted", "an event after the abort"
            chunks.setdefault(ev.seq_id, []).append(ev.audio)
            if ev.finished:
                reasons[ev.seq_id] = ev.finish_reason
        if abort_after is not None and len(chunks.get(ids[0], [])) == abort_after and ids[0] not in reasons:
            engine.abort(ids[0])
            reasons[ids[0]] = "aborted"
        steps += 1
    return ({n: np.concatenate(chunks[i]) for n, i in enumerate(ids) if i in chunks},
            {n: reasons.get(i) for n, i in enumerate(ids)})


def test_pipelined_decode_equals_plain_and_frees_everything(checkpoint_factory):
    # Stop head fires as soon as min_len allows: requests end by stop (one patch computed ahead is dropped)
    # or by length, at different steps; one joins late (the pipeline yields to the scheduler), one is aborted.
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="always"))
    reqs = [dict(target_text=f"Request number {i}.", params=SamplingParams(seed=i, max_generate_length=n, min_len=m))
            for i, (n, m) in enumerate(((9, 9), (6, 1), (4, 3), (8, 5)))]
    late = (dict(target_text="A late request.", params=SamplingParams(seed=9, max_generate_length=5, min_len=2)),)

    def run(pipeline: bool, abort_after: int | None = None) -> tuple[dict, dict, LLMEngine]:
        engine = LLMEngine(model, EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4,
                                               pipeline_decode=pipeline))
        launch, aheads = engine.runner.launch_decode, []

        def counting_launch(seqs, blocks, ahead=0):
            aheads.append(ahead)
            return launch(seqs, blocks, ahead)

        engine.runner.launch_decode = counting_launch
        audio, reasons = _run_events(engine, reqs, late, abort_after)
        assert (1 in aheads) == pipeline  # steps really were launched ahead (or never, unpipelined)
        engine.step()  # reads a step still in flight for stopped sequences, if any
        assert engine.in_flight is None
        assert engine.blocks.num_free == len(engine.blocks.blocks)
        assert sorted(engine.runner.free_slots) == list(range(8))
        return audio, reasons, engine

    plain_audio, plain_reasons, _ = run(False)
    piped_audio, piped_reasons, _ = run(True)
    assert set(plain_reasons.values()) >= {"stop", "length"}
    assert piped_reasons == plain_reasons
    for n, audio in plain_audio.items():  # batch composition may differ by a step: equal up to fp32 rounding
        assert piped_audio[n].shape == audio.shape
        np.testing.assert_array_equal(piped_audio[n], audio)
    aborted_audio, aborted_reasons, _ = run(True, abort_after=2)
    assert len(aborted_audio[0]) == 2 * len(plain_audio[0]) // 9  # 2 of its 9 patches, nothing after the abort
    assert {n: r for n, r in aborted_reasons.items() if n} == {n: r for n, r in plain_reasons.items() if n}
    for n, audio in plain_audio.items():
        if n:
            np.testing.assert_array_equal(aborted_audio[n], audio)


def test_failed_pipelined_step_ends_what_was_running(model, monkeypatch):
    # A launched step may have moved device state past what the host counted: after a failure nothing that
    # was running may continue (it would skip a patch), everything is freed, and new requests still work.
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256, block_size=4, pipeline_decode=True))
    ids = [engine.add_request(f"Request {i}.", SamplingParams(seed=i, max_generate_length=8)) for i in range(2)]
    for _ in range(3):
        engine.step()
    assert engine.in_flight is not None
    real_collect = engine.runner.collect_decode

    def failing_collect(step):
        raise RuntimeError("injected: device error surfacing at the sync")

    monkeypatch.setattr(engine.runner, "collect_decode", failing_collect)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.in_flight is None and not engine.has_unfinished()
    assert all(i not in engine.sequences for i in ids)
    assert engine.blocks.num_free == len(engine.blocks.blocks) and len(engine.runner.free_slots) == 2
    monkeypatch.setattr(engine.runner, "collect_decode", real_collect)
    alone = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256, block_size=4)).generate(
        "After the failure.", SamplingParams(seed=5, max_generate_length=4))
    again = engine.generate("After the failure.", SamplingParams(seed=5, max_generate_length=4))
    np.testing.assert_array_equal(again, alone)


def test_residual_split_rule_and_eager_partials() -> None:
    """The split-K rule splits only measured-faster shapes; the eager add + norm sums partials like the kernel (in split
    order, rounded to the stream's dtype before the add); the slices' views multiply to the whole product."""
    from engine.ops import linear, norm

    assert linear.residual_splits(176, 512, 1024) == 1  # short K
    assert linear.residual_splits(176, 2048, 1024) == 2 and linear.residual_splits(176, 4096, 1024) == 4
    assert linear.residual_splits(8, 6144, 2048) == 2  # an LM decode's down projection: wide output, 2 slices
    assert linear.residual_splits(704, 4096, 1024) == 2 and linear.residual_splits(704, 2048, 1024) == 1
    assert linear.residual_splits(1408, 4096, 1024) == 1 and linear.residual_splits(4096, 2048, 2048) == 1
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    parts = torch.randn(2, 3, 5, 32)
    w = torch.rand(32, dtype=torch.bfloat16) + 0.5
    stream, normed = norm.add_rms_norm(x, parts, 0.5, w, 1e-5)
    want = x + (parts[0] + parts[1]).to(torch.bfloat16) * 0.5
    assert torch.equal(stream, want)
    variance = want.float().pow(2).mean(-1, keepdim=True)
    assert torch.equal(normed, (want * torch.rsqrt(variance + 1e-5)).to(torch.bfloat16) * w)
    g = torch.Generator().manual_seed(3)
    for rows, k_dim, n, splits in ((40, 64, 32, 2), (3, 128, 48, 4), (1, 96, 16, 3)):
        x = torch.randn(rows, 2 * k_dim, generator=g)[:, ::2]  # a strided activation, made contiguous first
        weight = torch.randn(n, k_dim, generator=g)
        x_slices, w_slices = linear.split_k_views(x.contiguous(), weight, splits)
        assert x_slices.shape == (splits, rows, k_dim // splits) and w_slices.shape == (splits, k_dim // splits, n)
        assert torch.allclose(torch.bmm(x_slices, w_slices).sum(0), x @ weight.T, atol=1e-5, rtol=1e-5)


def test_step_inputs_layouts_are_aligned_disjoint_and_padded():
    """A decode step's inputs are views of one byte buffer, laid out per row count: every input 16-byte aligned (the
    kernels reading them compile to the same variants as for separate tensors), no two overlapping, all inside the
    buffer; padding rows point at the scratch rows."""
    from engine.runner.buffers import DecodeBuffers

    buf = DecodeBuffers(rows=9, table_width=5, feat_dim=6, patch=3, samples=10, scratch_seq_slot=9,
                        scratch_kv_slot=77, dtype=torch.float32, device=torch.device("cpu"))
    base, end = buf.inputs.data_ptr(), buf.inputs.data_ptr() + buf.inputs.numel()
    for rows in (1, 2, 4, 9):
        inputs = buf.step_inputs(rows)
        assert buf.step_inputs(rows) is inputs
        spans = []
        for name, dtype in DecodeBuffers.FIELDS:
            t = getattr(inputs, name)
            assert t.dtype == dtype and t.shape[0] == rows and t.is_contiguous(), name
            assert (t.data_ptr() - base) % 16 == 0, f"{name} not 16-byte aligned at {rows} rows"
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
        assert spans[-1][1] <= base + buf.input_bytes(rows) <= end
        assert inputs.block_tables.shape == (rows, 5) and inputs.noise.shape == (rows, 6, 3)
        inputs.slot_index[:] = 3
        inputs.noise[:] = 1.0
        inputs.fill_padding(9, 77, start=1)
        assert inputs.slot_index.tolist() == [3] + [9] * (rows - 1)
        assert inputs.slot_mapping[1:].eq(77).all() and inputs.context_lens[1:].eq(1).all()
        assert inputs.noise[0].eq(1.0).all() and inputs.noise[1:].eq(0.0).all()
    buf.reset_inputs(4)
    assert buf.step_inputs(4).slot_index.tolist() == [9] * 4


def test_coalescing_window_gathers_arrivals_at_an_idle_engine(checkpoint_factory):
    """A request reaching an idle engine waits out the window; one arriving inside it extends it (up to the cap);
    once it closes, one step admits them all. A busy engine admits at its next step, without a window."""
    from engine.scheduler import COALESCE_CAP

    engine = LLMEngine(str(checkpoint_factory("tiny-voxcpm2", stop="never")),
                       EngineConfig(max_num_seqs=4, max_model_len=256, coalesce_ms=1000))  # a second: no race
    sched = engine.scheduler
    a = engine.sequences[engine.add_request("First.", SamplingParams(seed=1, max_generate_length=3))]
    assert sched.window_left(now=a.arrival) == pytest.approx(1.0)
    assert not engine.has_work() and 0.0 < engine.idle_wait() <= 1.0
    b = engine.sequences[engine.add_request("Second.", SamplingParams(seed=2, max_generate_length=3))]
    a.arrival = b.arrival - 0.8  # a arrived 0.8 s before b: the window runs 1 s from b
    assert sched.window_left(now=b.arrival + 0.25) == pytest.approx(0.75)
    a.arrival -= 100.0  # a long-held first arrival: the cap closes the window
    assert sched.window_left() == 0.0 and engine.has_work()
    assert a.arrival + COALESCE_CAP * sched.coalesce_s < b.arrival
    engine.step()
    assert len(sched.running) == 2 and not sched.waiting  # admitted together
    c = engine.sequences[engine.add_request("Third.", SamplingParams(seed=3, max_generate_length=3))]
    assert sched.window_left() == 0.0 and engine.has_work()  # busy: no window
    while engine.has_unfinished():
        engine.step()
    assert c.status.name == "FINISHED" and engine.blocks.num_free == len(engine.blocks.blocks)


def test_a_continuation_is_queued_before_new_requests_and_skips_the_window(checkpoint_factory):
    """A long text's next segment (`continuation`) waits behind the preempted streams and the continuations before it,
    ahead of new requests, and an idle engine admits it without the coalescing window."""
    engine = LLMEngine(str(checkpoint_factory("tiny-voxcpm2", stop="never")),
                       EngineConfig(max_num_seqs=1, max_model_len=256, coalesce_ms=1000))
    sched = engine.scheduler

    def add(text: str, continuation: bool = False) -> int:
        return engine.add_request(text, SamplingParams(seed=1, max_generate_length=3), continuation=continuation)

    new1, new2 = add("New one."), add("New two.")
    cont1 = add("Next segment.", continuation=True)
    cont2 = add("Another next segment.", continuation=True)
    new3 = add("New three.")
    assert [s.seq_id for s in sched.waiting] == [cont1, cont2, new1, new2, new3]
    assert sched.window_left() == 0.0 and engine.has_work()  # a continuation at the head starts at once
    engine.step()
    assert [s.seq_id for s in sched.running] == [cont1]
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free == len(engine.blocks.blocks)


def test_a_request_waiting_for_kv_blocks_does_not_stop_the_pipeline(model):
    """While a request waits for KV blocks that only a finishing stream frees, the engine does not re-try its
    admission every step: the scheduler says nothing can be admitted, so the pipelined engine keeps launching the
    next decode ahead. It is admitted once a stream finishes, and every request's audio is what it is alone."""
    reqs = [dict(target_text=f"Stream {i} speaks.", params=SamplingParams(seed=20 + i, max_generate_length=n))
            for i, n in enumerate((4, 10, 6))]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=3, max_model_len=64, block_size=4, num_kv_blocks=10,
                                           pipeline_decode=True))
    launch, aheads = engine.runner.launch_decode, []

    def counting_launch(seqs, blocks, ahead=0):
        aheads.append((ahead, len(engine.scheduler.waiting)))
        return launch(seqs, blocks, ahead)

    engine.runner.launch_decode = counting_launch
    ids = [engine.add_request(**r) for r in reqs]
    chunks: dict[int, list[np.ndarray]] = {i: [] for i in ids}
    stalled_steps = 0
    while engine.has_unfinished():
        for ev in engine.step():
            chunks[ev.seq_id].append(ev.audio)
        s = engine.scheduler
        if s.waiting and s.running and not s.can_admit:  # nothing changed since the round that left it waiting
            stalled_steps += 1
    assert stalled_steps >= 3, "no step left the third request waiting, nothing to admit (or the cache is too big)"
    assert any(ahead == 1 and waiting for ahead, waiting in aheads)  # launched ahead while it waited
    engine.step()
    assert engine.in_flight is None and engine.blocks.num_free == 10 and engine.scheduler.num_preemptions == 0
    for i, r in zip(ids, reqs, strict=True):
        alone = _run_all(LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=64, block_size=4)), [r])[0]
        got = np.concatenate(chunks[i])
        assert got.shape == alone.shape
        np.testing.assert_array_equal(got, alone)


def test_a_stalled_admission_is_not_retried_by_the_plain_loop_either(model):
    """Unpipelined, every step schedules: while nothing changed, the round that left a request waiting for blocks is
    not run again (its admission is looked at once per change), and the request still starts when a stream ends."""
    reqs = [dict(target_text=f"Stream {i} speaks.", params=SamplingParams(seed=20 + i, max_generate_length=n))
            for i, n in enumerate((4, 10, 6))]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=3, max_model_len=64, block_size=4, num_kv_blocks=10))
    looked = []
    never_fits = engine.scheduler.never_fits

    def counting(seq):
        looked.append(seq.seq_id)
        return never_fits(seq)

    engine.scheduler.never_fits = counting
    ids = [engine.add_request(**r) for r in reqs]
    while engine.has_unfinished():
        engine.step()
    third = looked.count(ids[2])
    assert 2 <= third <= 3, looked  # tried with the first two, then once more after the first finished
    assert engine.blocks.num_free == 10 and engine.scheduler.num_preemptions == 0


def test_a_burst_onto_running_streams_is_admitted_within_the_running_budget(model):
    """While a stream runs, a step prefills at most `running_prefill_tokens` (the first prompt of a round goes in
    whatever its length): a burst is admitted over several steps, the running stream gets its chunk every step, and
    every request's audio is what it is alone. Without the budget the burst is admitted in one step."""
    first = dict(target_text="The stream that runs first.", params=SamplingParams(seed=30, max_generate_length=12))
    burst = [dict(target_text=f"Arrival number {i}.", params=SamplingParams(seed=31 + i, max_generate_length=4))
             for i in range(3)]
    alone = [_run_all(LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, block_size=4)), [r])[0]
             for r in (first, *burst)]
    for budget, most_per_step in ((1, 1), (None, 3)):
        engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=256, block_size=4,
                                               running_prefill_tokens=budget, pipeline_decode=False))
        sched = engine.scheduler
        running_id = engine.add_request(**first)
        chunks: dict[int, list[np.ndarray]] = {running_id: [ev.audio for ev in engine.step()]}
        ids = [engine.add_request(**r) for r in burst]
        chunks.update({i: [] for i in ids})
        admitted_per_step = []
        while engine.has_unfinished():
            before = len(sched.waiting)
            events = engine.step()
            admitted_per_step.append(before - len(sched.waiting))
            if running_id in engine.sequences or any(ev.seq_id == running_id for ev in events):
                assert any(ev.seq_id == running_id for ev in events), "the running stream missed a step"
            for ev in events:
                chunks[ev.seq_id].append(ev.audio)
        assert max(admitted_per_step) == most_per_step and sum(admitted_per_step) == len(burst)
        assert engine.blocks.num_free == len(engine.blocks.blocks)
        for i, audio in zip([running_id, *ids], alone, strict=True):
            np.testing.assert_array_equal(np.concatenate(chunks[i]), audio)


def test_a_round_stopped_by_the_budget_admits_more_next_step_beside_a_held_request(model):
    """A request held for what only it needs (an adapter slot) keeps its place; when the round stopped for this step's
    budget, not for blocks or slots, the requests behind it are admitted at the next steps, not only once a stream
    ends."""
    engine = LLMEngine(model, EngineConfig(max_num_seqs=6, max_model_len=256, block_size=4, running_prefill_tokens=1,
                                           pipeline_decode=False))
    sched = engine.scheduler
    engine.add_request("The stream that runs first.", SamplingParams(seed=40, max_generate_length=20))
    engine.step()
    held = engine.sequences[engine.add_request("Held for its slot.", SamplingParams(seed=41, max_generate_length=2))]
    sched.admit = lambda seq, behind: seq is not held  # as `LLMEngine._admit` answers while every slot is taken
    arrivals = [engine.sequences[engine.add_request(f"Arrival number {i}.",
                                                    SamplingParams(seed=42 + i, max_generate_length=2))]
                for i in range(3)]
    for step in range(3):
        engine.step()
        assert all(seq.status.name != "WAITING" for seq in arrivals[:step + 1]), f"step {step}"
    assert list(sched.waiting) == [held] and len(sched.running) >= 2
    sched.admit = None  # its slot is free: it starts too
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free == len(engine.blocks.blocks)
