"""The real server pool (worker processes, pipes, routing) on tiny checkpoints, on the CPU."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import multiprocessing
import multiprocessing.connection
import shutil
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from engine import (
    AsyncVoxCPMServerPool,
    CheckpointError,
    EngineConfig,
    LLMEngine,
    PoolStoppedError,
    PromptNotFoundError,
    RequestError,
    SamplingParams,
    SyncVoxCPMServerPool,
    VoxCPM,
    WorkerDiedError,
    load_model,
)
from engine.io.tokenizer import TextTokenizer
from tests.service_harness import wav_bytes

if TYPE_CHECKING:
    from engine.serving.reports import WorkerStats
    from engine.serving.worker import ClientLink, Worker

HANG_GUARD_S = 10  # a killed worker's callers fail at once; this only catches a hang


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-voxcpm2", stop="never")


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "pipelined"])
def pool(checkpoint, request):
    """The pool's tests run on both decode loops: plain (the CPU default) and pipelined (the CUDA default)."""
    p = VoxCPM.from_pretrained(str(checkpoint), max_num_seqs=4, max_model_len=256, block_size=4,
                               pipeline_decode=request.param)
    assert isinstance(p, SyncVoxCPMServerPool)
    p.wait_for_ready(timeout=120)
    assert p.get_model_info()["pipelined_decode"] is request.param
    yield p
    p.stop()


def _free_blocks_restored(pool) -> None:
    deadline = time.monotonic() + 30  # a hang guard: freeing is immediate
    while True:
        s = pool.stats()[0]
        if s.free_blocks == s.total_blocks and s.running == s.waiting == 0:
            assert s.free_slots == 4
            snap = pool.snapshot()[0]  # what the worker last reported with its events, no round trip
            assert snap["alive"] == 1 and snap["total_blocks"] == s.total_blocks
            return
        assert time.monotonic() < deadline, f"blocks not freed: {s}"
        time.sleep(0.05)


def test_the_worker_froze_its_start_up_heap_and_counts_its_collector_passes(pool):
    """A worker's start-up objects (torch, the model's modules, the tokenizer) are out of its garbage collector once
    it is ready (engine.serving.collector); the passes that still run are counted with their time."""
    for _ in pool.generate("Anything at all.", max_generate_length=2):
        pass
    s = pool.stats()[0]
    assert s.gc_frozen_objects > 50_000
    assert 0 <= s.gc_longest_s <= s.gc_seconds < 60 and (s.gc_collections > 0) == (s.gc_seconds > 0)


def test_collector_pauses_count_each_pass_until_closed():
    from engine.serving.collector import CollectorPauses

    pauses = CollectorPauses()
    try:
        gc.collect()
        assert pauses.collections >= 1 and 0 < pauses.longest_s <= pauses.seconds
    finally:
        pauses.close()
    counted = pauses.collections
    gc.collect()
    assert pauses.collections == counted


def test_ctrl_c_in_next_then_leaving_the_with_block_aborts_the_request(pool):
    """KeyboardInterrupt inside next() (where a reader spends its time: waiting for the next chunk) marked the stream
    ended without an abort, so leaving the `with` block left the request running to its cap for nobody. The
    interrupt now aborts it, its pending step too (a next() after it would race that step for the chunks)."""
    import _thread

    with pytest.raises(KeyboardInterrupt), pool.generate("A long one, read until the interrupt comes.",
                                                         max_generate_length=200) as stream:
        threading.Timer(0.3, _thread.interrupt_main).start()  # 200 patches: seconds on a CPU
        for _ in stream:
            pass
    assert stream.finish_reason == "aborted"
    with pytest.raises(StopIteration):  # ended: a next() after catching the interrupt neither hangs nor reads on
        next(stream)
    _free_blocks_restored(pool)


def test_a_stuck_worker_is_not_ready_and_waiting_for_the_load_still_returns(pool):
    """A worker marked stuck (its stats call unanswered): the pool is not ready, but waiting for the workers' load
    (wait_for_ready, model_info) returns at once; with "stuck" inside the client's `ready` that wait spun on the event
    loop without yielding, so nothing (not the worker's next message, not a timeout) could end it."""
    link = pool.pool.client.links[0]
    link.answering = False
    try:
        assert not pool.ready and pool.pool.client.stuck == [0]
        pool._submit(pool.pool.wait_for_ready(timeout=5)).result(30)
        assert pool._submit(pool.pool.model_info()).result(30).feat_dim == 64
    finally:
        link.answering = True
    assert pool.ready


def test_model_info(pool):
    info = pool.get_model_info()
    assert info["sample_rate"] == 48000 and info["channels"] == 1
    assert info["feat_dim"] == 64 and info["patch_size"] == 4
    assert info["attention_backend"] == "torch" and info["cuda_graphs"] == 0 and info["devices"] == ["cpu"]


@pytest.mark.parametrize("client_tokenizes", [False, True], ids=["worker-tokenizes", "client-tokenizes"])
def test_concurrent_mixed_modes_equal_alone(pool, checkpoint, client_tokenizes):
    """Requests of every mode at once through the pool give exactly the audio each gives alone, whether the worker
    tokenizes their text or the client does (the pool's default, as in the service's API processes: TextIds sent
    with the request)."""
    default = pool.pool.client.tokenizer
    assert default is not None  # the pool loaded the checkpoint's tokenizer
    lat = pool.encode_latents(wav_bytes(1.0), "wav")
    ref = pool.encode_latents(wav_bytes(1.2, seed=1), "wav", padding="right")
    prompt_id = pool.add_prompt(wav_bytes(1.0), "wav", "A stored prompt.")
    reqs = [
        dict(target_text="Zero shot through the pool.", seed=1, max_generate_length=6),
        dict(target_text="(calm voice) Designed.", seed=2, max_generate_length=5, cfg_value=1.5),
        dict(target_text="Continue.", prompt_latents=lat, prompt_text="A stored prompt.", seed=3,
             max_generate_length=4),
        dict(target_text="With a reference.", ref_audio_latents=ref, seed=4, max_generate_length=5, temperature=0.5),
        dict(target_text="Continue.", prompt_id=prompt_id, seed=3, max_generate_length=4),
    ]

    sent: list[object] = []  # each request as it went to the worker: with the client's TextIds or without

    async def run_all() -> list[np.ndarray]:
        inner: AsyncVoxCPMServerPool = pool.pool

        async def one(r: dict) -> np.ndarray:
            stream = inner.generate(**r)
            audio = np.concatenate([c async for c in stream])
            sent.append(stream.request)
            return audio

        return await asyncio.gather(*(one(r) for r in reqs))

    pool.pool.client.tokenizer = TextTokenizer.from_dir(checkpoint) if client_tokenizes else None
    try:
        together = asyncio.run_coroutine_threadsafe(run_all(), pool._loop).result(120)
    finally:
        pool.pool.client.tokenizer = default
    # the client tokenized every request but the registered prompt's (its transcript is the worker's)
    assert [r.text_ids is not None for r in sent] == [client_tokenizes and r.prompt_id is None for r in sent]
    # The stored prompt is the same clip and text as the inline latents: same audio (up to summation
    # order: the second one reuses the first one's prompt blocks from the prefix cache).
    np.testing.assert_array_equal(together[2], together[4])
    model = load_model(checkpoint)
    feat_dim = model.config.feat_dim
    for r, got in zip(reqs, together, strict=True):
        engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, block_size=4))
        kw = {}
        if "prompt_latents" in r or "prompt_id" in r:
            kw = dict(prompt_text="A stored prompt.",
                      prompt_latents=torch.from_numpy(np.frombuffer(lat, np.float32).reshape(-1, feat_dim).copy()))
        if "ref_audio_latents" in r:
            kw["ref_latents"] = torch.from_numpy(np.frombuffer(ref, np.float32).reshape(-1, feat_dim).copy())
        params = SamplingParams(**{k: r[k] for k in ("seed", "max_generate_length", "cfg_value", "temperature")
                                   if k in r})
        alone = engine.generate(r["target_text"], params, **kw)
        assert got.shape == alone.shape
        np.testing.assert_array_equal(got, alone)
    pool.remove_prompt(prompt_id)
    _free_blocks_restored(pool)


def test_breaking_out_cancels_and_frees_blocks(pool):
    """The worker aborts the request (it does not run it to its end): its blocks are free after far fewer steps
    than the ~200 patches it had left."""
    it = pool.generate("A long request that the caller abandons.", max_generate_length=200, seed=5)
    for i, chunk in enumerate(it):
        assert chunk.dtype == np.float32 and chunk.ndim == 1
        if i == 2:
            break
    steps_at_break = pool.stats()[0].steps
    it.close()
    _free_blocks_restored(pool)
    assert pool.stats()[0].steps - steps_at_break < 100


def test_leaving_an_async_with_block_cancels_the_request(pool):
    """The async pool's stream as `async with`: leaving the block (a `break` out of its loop) aborts the request, as
    the sync stream's `with` does (a `break` alone left it running to its cap while the stream lived)."""
    async def scenario() -> None:
        async with pool.pool.generate("A long request that the caller abandons.", max_generate_length=200,
                                      seed=6) as stream:
            async for _ in stream:
                break
        assert stream.finish_reason == "aborted"

    steps = pool.stats()[0].steps
    asyncio.run_coroutine_threadsafe(scenario(), pool._loop).result(120)
    _free_blocks_restored(pool)
    assert pool.stats()[0].steps - steps < 100


def test_bad_requests_fail_alone_and_the_worker_keeps_serving(pool):
    async def scenario() -> tuple[list[BaseException | None], int]:
        inner: AsyncVoxCPMServerPool = pool.pool

        async def good() -> int:
            return len([c async for c in inner.generate("A healthy request.", max_generate_length=6, seed=1)])

        async def bad(**kw: object) -> BaseException | None:
            try:
                async for _ in inner.generate(**kw):  # type: ignore[arg-type]
                    pass
            except Exception as e:
                return e
            return None

        task = asyncio.create_task(good())
        errors = await asyncio.gather(
            bad(target_text="x", prompt_id="missing"),
            bad(target_text="word " * 400),  # longer than max_model_len
            bad(target_text="x", prompt_latents=np.zeros((3, 64), np.float32), prompt_text="p"),  # not whole patches
            bad(target_text="x", prompt_latents=np.zeros((4, 7), np.float32), prompt_text="p"),  # wrong feat_dim
            bad(target_text="x", prompt_latents=b"\x00" * 10, prompt_text="p"),
            bad(target_text="   "),
            bad(target_text="x", temperature=-1.0),
            bad(target_text="x", cfg_value="high"),
            bad(target_text="x", seed=2**64),  # must fail alone, not the step of everyone else
        )
        return errors, await task

    errors, good_chunks = asyncio.run_coroutine_threadsafe(scenario(), pool._loop).result(120)
    assert good_chunks == 6
    assert isinstance(errors[0], PromptNotFoundError)
    assert all(isinstance(e, RequestError) for e in errors), errors
    messages = [str(e) for e in errors]
    assert "max_model_len=256" in messages[1]
    assert "patch_size=4" in messages[2] and "(frames, 64)" in messages[3]
    assert "4 * feat_dim" in messages[4] and "target_text" in messages[5]
    assert "temperature" in messages[6] and "seed" in messages[8]
    with pytest.raises(RequestError, match="could not decode audio"):
        pool.encode_latents(b"not audio at all", "wav")
    with pytest.raises(PromptNotFoundError):
        pool.remove_prompt("never-added")
    _free_blocks_restored(pool)


def test_same_prompt_twice_is_one_id(pool):
    a = pool.add_prompt(wav_bytes(0.8, seed=3), "wav", "Same clip.")
    b = pool.add_prompt(wav_bytes(0.8, seed=3), "wav", "Same clip.")
    c = pool.add_prompt(wav_bytes(0.8, seed=3), "wav", "Other text.")
    assert a == b != c
    pool.remove_prompt(a)
    pool.remove_prompt(c)
    assert pool.pool.list_prompts() == []


def test_killed_worker_fails_callers_fast_and_restarts(checkpoint):
    async def scenario() -> None:
        pool = VoxCPM.from_pretrained(str(checkpoint), max_num_seqs=2, max_model_len=256)
        assert isinstance(pool, AsyncVoxCPMServerPool)
        await pool.wait_for_ready(timeout=120)
        gen = pool.generate("This stream is cut off by a crash.", max_generate_length=500, seed=1)
        await gen.__anext__()
        t0 = time.monotonic()
        pool.kill_worker(0)
        with pytest.raises(WorkerDiedError):
            async for _ in gen:
                pass
        assert time.monotonic() - t0 < HANG_GUARD_S
        assert not pool.healthy and not pool.ready
        with pytest.raises(WorkerDiedError):
            async for _ in pool.generate("No worker left."):
                pass
        # the calls that wait for the pool to be ready fail too (they waited for ever: nothing restarts it alone)
        for call in (pool.model_info(), pool.wait_for_ready(),
                     pool.add_prompt(latents=np.zeros((4, 64), np.float32), prompt_text="A prompt.")):
            with pytest.raises(WorkerDiedError, match="worker 0 .* exited; pool.restart"):
                await asyncio.wait_for(call, HANG_GUARD_S)
        await pool.restart(timeout=120)
        assert pool.healthy and pool.ready
        chunks = [c async for c in pool.generate("Back again.", max_generate_length=3, seed=2)]
        assert len(chunks) == 3
        await pool.stop()
        assert not pool.healthy

    asyncio.run(scenario())


def test_two_workers_route_by_load_and_survive_one_dying(checkpoint):
    """Two CPU workers: concurrent streams spread over both; one killed fails only its own streams, the other
    keeps serving; the restarted one gets the registered prompts again and gives the same audio for them."""
    async def scenario() -> None:
        pool = VoxCPM.from_pretrained(str(checkpoint), devices=["cpu", "cpu"], max_num_seqs=2, max_model_len=2048)
        assert isinstance(pool, AsyncVoxCPMServerPool)
        await pool.wait_for_ready(timeout=120)
        prompt_id = await pool.add_prompt(wav_bytes(0.8, seed=3), "wav", "A prompt.")

        async def voiced() -> tuple[int | None, np.ndarray]:
            gen = pool.generate("Same voice.", prompt_id=prompt_id, max_generate_length=3, seed=5)
            audio = np.concatenate([c async for c in gen])
            return gen.worker, audio

        _, before = await voiced()
        # Long enough (hundreds of patches: the official cap is 6 per text token) to run on while the test looks.
        long_text = "A long stream of words that keeps its worker busy while the test looks at it. " * 12
        first = pool.generate("First. " + long_text, max_generate_length=1500, seed=1)
        await first.__anext__()
        second = pool.generate("Second. " + long_text, max_generate_length=1500, seed=2)
        await second.__anext__()
        assert {first.worker, second.worker} == {0, 1}  # the least-loaded worker takes the next stream
        assert [s.running for s in await pool.stats()] == [1, 1]

        pool.kill_worker(first.worker)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError):
            async for _ in first:
                pass
        failed_after = time.monotonic() - t0
        assert failed_after < HANG_GUARD_S
        print(f"one of two workers killed: its stream failed {failed_after * 1000:.0f} ms later")
        for _ in range(3):  # the survivor's stream goes on, and new requests land on the survivor
            await second.__anext__()
        served = pool.generate("Served meanwhile.", max_generate_length=2, seed=3)
        assert len([c async for c in served]) == 2 and served.worker == second.worker

        await pool.restart(timeout=120)
        # the survivor is busy with `second`: the restarted worker is the least loaded and takes the prompt
        worker, after = await voiced()
        assert worker == first.worker
        np.testing.assert_array_equal(after, before)  # the prompt was replayed to it, identically
        await second.aclose()
        await pool.stop()

    asyncio.run(scenario())


def test_bad_configuration_is_refused_before_starting(tmp_path):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VoxCPM.from_pretrained("unused", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="lora_name"):
        VoxCPM.from_pretrained("unused", lora_name="../up")
    with pytest.raises(TypeError, match="max_num_seq\\b"):  # a misspelt field is named, never dropped
        VoxCPM.from_pretrained("unused", max_num_seq=8)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            VoxCPM.from_pretrained("unused", devices=[0])
    # a name (iterated, it was three workers c, p and u), and no device, before any worker starts
    with pytest.raises(TypeError, match="devices: a list of GPU indices or device names, got 'cpu'"):
        VoxCPM.from_pretrained("unused", devices="cpu")
    with pytest.raises(ValueError, match=r"devices: \['tpu'\] are no devices"):
        VoxCPM.from_pretrained("unused", devices=["tpu"])
    # a wrong type, named before any worker starts (each reached the workers, or spawned one that was left running)
    for kwargs, error, message in (({"inference_timesteps": 10.5}, TypeError, "inference_timesteps: int expected"),
                                   ({"max_num_seqs": "4"}, TypeError, "max_num_seqs: int expected"),
                                   ({"enforce_eager": "false"}, TypeError, "enforce_eager: bool expected"),
                                   ({"encoder_threads": "x"}, TypeError, "encoder_threads: int expected"),
                                   ({"transform_threads": 42}, TypeError, "transform_threads: a TransformThreads"),
                                   ({"queue_bound": -1}, ValueError, "queue_bound >= 0")):
        with pytest.raises(error, match=message):
            VoxCPM.from_pretrained("unused", **kwargs)
    with pytest.raises(CheckpointError, match="config.json"):
        VoxCPM.from_pretrained(str(tmp_path))


def test_a_checkpoint_without_a_tokenizer_leaves_no_worker_running(checkpoint, tmp_path):
    """The pool loads the tokenizer its client tokenizes with while its workers start: without one it fails, naming
    the file, and stops them, and the sync pool its loop thread (it was left running)."""
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(checkpoint, broken)
    (broken / "tokenizer.json").unlink()
    before = set(multiprocessing.active_children())
    loops = {t for t in threading.enumerate() if t.name == "voxcpm-pool-loop"}
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        VoxCPM.from_pretrained(str(broken), devices=["cpu"], max_num_seqs=1, max_model_len=256)
    assert set(multiprocessing.active_children()) <= before
    assert {t for t in threading.enumerate() if t.name == "voxcpm-pool-loop"} <= loops


def test_bad_prompt_latents_fail_the_caller_not_the_worker(pool):
    """add_prompt(latents=...) with latents the worker cannot use is the caller's error: it must not kill
    the worker (nor be replayed to a restarted one)."""
    nan = np.zeros((4, 64), np.float32)
    nan[1, 3] = np.nan
    for text, rule in ((None, "target_text: must be a string, got NoneType"), (b"x", "target_text: must be a string")):
        with pytest.raises(RequestError, match=rule):  # an engine error naming nothing, from the worker
            pool.generate(text)
    with pytest.raises(RequestError, match="transform: must be callable"):
        pool.generate("Hi.", transform="x")
    for bad, rule in ((b"\x00" * 10, "positive multiple"), (np.zeros((4, 7), np.float32), "shaped"),
                      (np.zeros((0, 64), np.float32), "shaped"), (np.zeros((3, 64), np.float32), "multiple of patch"),
                      (nan, "NaN")):  # the last two were registered, and every generation with them failed
        with pytest.raises(RequestError, match=rule):
            pool.add_prompt(latents=bad, prompt_text="Bad latents.")
    with pytest.raises(RequestError, match="prompt_text: must be a non-empty string"):
        pool.add_prompt(latents=np.zeros((4, 64), np.float32), prompt_text=None)
    assert pool.pool.list_prompts() == []
    assert pool.healthy
    assert len(list(pool.generate("Still serving.", max_generate_length=2, seed=1))) == 2
    _free_blocks_restored(pool)


def test_sync_iterator_closed_from_another_thread(pool):
    """A consumer thread blocked in next() and another thread closing the iterator: the consumer's loop
    ends with finish_reason "aborted" already set (it read None there: the loop ended before the reason was set),
    the request is aborted and its blocks are freed."""
    for trial in range(3):
        it = pool.generate("A stream closed by someone else.", max_generate_length=2000, seed=6 + trial)
        first = threading.Event()
        got: list[object] = []

        def consume() -> None:
            try:
                for _ in it:  # noqa: B023 (this trial's iterator: the thread is joined below)
                    first.set()  # noqa: B023
                got.append(("done", it.finish_reason))  # noqa: B023
            except BaseException as e:  # noqa: BLE001
                got.append(e)  # noqa: B023

        t = threading.Thread(target=consume)
        t.start()
        assert first.wait(60)
        it.close()
        t.join(60)
        assert not t.is_alive() and got == [("done", "aborted")], got
        _free_blocks_restored(pool)


def test_sync_stop_wakes_a_consumer_in_another_thread(checkpoint):
    """stop() while another thread waits for the next chunk: that thread gets PoolStoppedError (not a
    hang, not 'event loop is closed')."""
    p = VoxCPM.from_pretrained(str(checkpoint), max_num_seqs=2, max_model_len=256)
    p.wait_for_ready(timeout=120)
    first = threading.Event()
    got: list[object] = []

    def consume() -> None:
        try:
            for _ in p.generate("A stream the pool stops under.", max_generate_length=2000, seed=1):
                first.set()
            got.append("done")
        except BaseException as e:  # noqa: BLE001
            got.append(e)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    assert first.wait(60)
    p.stop()
    t.join(60)
    assert not t.is_alive(), "consumer still waiting after stop()"
    assert len(got) == 1 and isinstance(got[0], PoolStoppedError), got
    with pytest.raises(PoolStoppedError):
        next(iter(p.generate("After stop.")))
    # a stream between two next() calls when the pool stopped: the next one raises, and it says it was aborted
    q = VoxCPM.from_pretrained(str(checkpoint), max_num_seqs=2, max_model_len=256)
    idle = q.generate("A stream the pool stops between chunks.", max_generate_length=2000, seed=2)
    next(idle)
    q.stop()
    with pytest.raises(PoolStoppedError):
        next(idle)
    assert idle.finish_reason == "aborted"


def test_sync_pool_stops_from_many_threads_and_as_a_with_block(checkpoint):
    """stop() from three threads at once: each returns once the pool is stopped, none fails (one got 'event loop is
    closed', one returned before the workers stopped); the pool as a `with` block stops on leaving it."""
    with VoxCPM.from_pretrained(str(checkpoint), max_num_seqs=2, max_model_len=256) as p:
        p.wait_for_ready(timeout=120)
        workers = [w.process for w in p.pool.processes]
        outcomes: list[object] = []

        def stop() -> None:
            try:
                p.stop()
                outcomes.append(all(not w.is_alive() for w in workers))
            except BaseException as e:  # noqa: BLE001
                outcomes.append(e)

        threads = [threading.Thread(target=stop) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert outcomes == [True, True, True], outcomes
    with VoxCPM.from_pretrained(str(checkpoint), max_num_seqs=2, max_model_len=256) as p:
        workers = [w.process for w in p.pool.processes]
    assert all(not w.is_alive() for w in workers)
    with pytest.raises(PoolStoppedError):
        p.model_info()


def _worker_on_a_pipe(engine: LLMEngine) -> tuple[Worker, ClientLink, multiprocessing.connection.Connection]:
    """A worker of `engine` in this process with one client connection, a pipe: (worker, its link, the client's end,
    whose Ready has been read)."""
    from engine.serving import protocol as msgs
    from engine.serving.worker import Worker

    client_end, worker_end = multiprocessing.Pipe()
    worker = Worker(engine)
    worker.acceptor.attach(worker_end)
    worker._take_new_links()
    link = next(iter(worker.links.values()))
    assert client_end.poll(10) and isinstance(client_end.recv(), msgs.Ready)
    return worker, link, client_end


def test_a_loop_turns_requests_reach_the_worker_as_one_message_and_start_in_one_step(checkpoint):
    """What one turn of the client's event loop sends (a burst's requests: their streams resume together after their
    tokenization) goes to the worker as one MessageBatch, in order, a send from another thread during that turn
    included; the worker unpacks it and starts every request in its next step (one admission round). The client half
    shows the batching; the worker half only that a batch is read whole (separate messages waiting on the pipe would
    be read in the same round too)."""
    from engine.serving import protocol as msgs
    from engine.serving.client import EngineClient
    from engine.serving.worker_link import WorkerLink

    params = SamplingParams(max_generate_length=3, seed=1)
    burst = [msgs.Generate(f"r{i}", msgs.SynthesisRequest(f"Request number {i}.", params=params)) for i in range(3)]

    async def client_side(conn: multiprocessing.connection.Connection,
                          worker_end: multiprocessing.connection.Connection) -> list[object]:
        """The sends, and what the worker's end of the pipe reads, message by message, before the link closes."""
        client = EngineClient([], b"test")
        link = WorkerLink(client, 0, "the test's pipe")
        link.attach(conn)

        async def read() -> object:
            assert await asyncio.to_thread(worker_end.poll, HANG_GUARD_S)
            return worker_end.recv()

        try:
            for msg in burst:  # one turn
                link.send(msg)
            got = [await read()]
            late = msgs.Generate("r3", msgs.SynthesisRequest("One more.", params=params))
            link.send(late)
            other = threading.Thread(target=link.send, args=(msgs.Abort("r3"),))  # joins the pending turn, after it
            other.start()
            other.join()
            got.append(await read())
            await asyncio.to_thread(link.send, msgs.Abort("r9"))  # no turn pending: straight to the sender
            got.append(await read())
            assert not worker_end.poll(0.05)  # each message once
            return got
        finally:
            client.closed = True
            link.close_connection()
            client.encoders.stop()

    ours, theirs = multiprocessing.Pipe()
    got = asyncio.run(client_side(ours, theirs))
    assert [type(m).__name__ for m in got] == ["MessageBatch", "MessageBatch", "Abort"]
    assert got[0].messages == burst
    assert [type(m).__name__ for m in got[1].messages] == ["Generate", "Abort"]
    assert got[1].messages[1].request_id == "r3" and got[2].request_id == "r9"

    engine = LLMEngine(str(checkpoint), EngineConfig(max_num_seqs=4, max_model_len=128))
    worker, link, client_end = _worker_on_a_pipe(engine)
    try:
        client_end.send(got[0])
        assert link.conn.poll(10)
        worker._read(link)
        assert len(engine.scheduler.waiting) == 3 and set(link.requests) == {"r0", "r1", "r2"}
        worker.step()
        assert client_end.poll(10)
        first = client_end.recv()
        assert isinstance(first, msgs.StepEvents)
        assert sorted(ev.request_id for ev in first.events if ev.audio is not None) == ["r0", "r1", "r2"]
        assert not engine.scheduler.waiting
    finally:
        worker.close()


def test_the_worker_counts_how_long_its_messages_wait_to_be_written(checkpoint):
    """WorkerStats' messages_sent / send_seconds: each message written to a client counts, with the time from its
    queueing to its write; messages the client does not read for a while (a full pipe) wait that long."""
    from engine.serving import protocol as msgs

    engine = LLMEngine(str(checkpoint), EngineConfig(max_num_seqs=2, max_model_len=128))
    worker, link, client = _worker_on_a_pipe(engine)

    def counted(messages: int) -> WorkerStats:
        deadline = time.monotonic() + HANG_GUARD_S  # the sender counts a message once its write has returned
        while (s := worker.stats()).messages_sent < messages:
            assert time.monotonic() < deadline, s
            time.sleep(0.01)
        return s

    try:
        request = msgs.SynthesisRequest("Hi.", params=SamplingParams(max_generate_length=2))
        worker.handle(link, msgs.Generate("r1", request))
        worker.step()
        assert client.poll(10) and isinstance(client.recv(), msgs.StepEvents)
        assert counted(2).messages_sent == 2  # Ready, the step's events
        before = worker.stats().send_seconds
        big = msgs.StepEvents([msgs.AudioEvent("x", np.zeros(4 << 20, np.float32), False, None)], worker.load())
        link.send(big)
        link.send(big)  # 16 MB each, far more than the pipe holds: both wait for the client to read
        time.sleep(0.5)
        client.recv()
        client.recv()
        s = counted(4)
        assert s.messages_sent == 4 and s.send_seconds - before >= 0.9
    finally:
        worker.close()


@pytest.mark.parametrize("device_lost", [False, True], ids=["step-error", "device-lost"])
def test_failed_step_fails_running_requests_and_a_lost_device_ends_the_worker(checkpoint, monkeypatch,
                                                                              device_lost):
    """A step that raises fails the running requests at once (a request still queued stays queued: it was failed with
    them); the worker keeps serving unless its device no longer runs work (a sticky CUDA error, e.g. a layer kernel's
    trap): then it ends, so the pool restarts it."""

    from engine.serving import protocol as msgs
    from engine.serving.worker import DeviceLostError

    engine = LLMEngine(str(checkpoint), EngineConfig(max_num_seqs=2, max_model_len=128))
    worker, link, client = _worker_on_a_pipe(engine)
    try:
        request = msgs.SynthesisRequest("Hello there.", params=SamplingParams(max_generate_length=4))
        worker.handle(link, msgs.Generate("r1", request))
        worker.step()  # a real step: the request holds KV blocks and a slot now
        assert client.poll(10)
        first = client.recv()
        assert isinstance(first, msgs.StepEvents) and first.events[0].request_id == "r1"  # its first audio
        assert first.events[0].audio is not None and not first.events[0].finished
        assert engine.blocks.num_free < len(engine.blocks.blocks)
        worker.handle(link, msgs.Generate("r2", request))  # queued behind the failing step: not failed with it
        real_step = engine.step
        monkeypatch.setattr(engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("CUDA error: test")))
        monkeypatch.setattr(worker, "_device_usable", lambda: not device_lost)
        if device_lost:
            with pytest.raises(DeviceLostError):
                worker.step()
        else:
            worker.step()
        assert client.poll(10)
        failed = client.recv()
        assert isinstance(failed, msgs.StepEvents)
        ev = failed.events[0]
        assert ev.request_id == "r1" and ev.finished and ev.finish_reason == "error" and ev.error.kind == "engine"
        assert "CUDA error: test" in ev.error.message
        assert engine.blocks.num_free == len(engine.blocks.blocks)  # the failed request's blocks are back
        assert len(failed.events) == 1 and list(link.requests) == ["r2"]
        if not device_lost:  # the worker goes on: the queued request is served
            monkeypatch.setattr(engine, "step", real_step)
            while engine.has_unfinished():
                worker.step()
            events = []
            while client.poll(1):
                events += [e for e in client.recv().events if e.request_id == "r2"]
            assert events[-1].finished and events[-1].finish_reason != "error", events[-1]
        assert not worker.owner or device_lost
    finally:
        worker.close()


def test_load_table_is_shared_by_the_processes_that_route(tmp_path):
    """Routers in different processes see one in-flight count per worker: each writes its own row, all read the
    column sums; a dead router's row is cleared."""
    import multiprocessing

    from engine.serving.routing import LoadTable

    path = tmp_path / "load"
    LoadTable.create(path, rows=2, workers=2)
    mine = LoadTable(2, path, row=0)
    mine.add(0, 3)
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_route_elsewhere, args=(path,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert mine.loads().tolist() == [3, 5]  # the other process's 5 requests on worker 1, seen here
    LoadTable.clear_row(path, 1, 2)  # that process died: its requests are gone
    assert mine.loads().tolist() == [3, 0]
    mine.add(0, -3)
    assert mine.loads().tolist() == [0, 0]
    mine.close()


def _route_elsewhere(path) -> None:
    from engine.serving.routing import LoadTable

    other = LoadTable(2, path, row=1)
    assert other.loads().tolist() == [3, 0]
    other.add(1, 5)
    other.close()


class _PreparedTransform:
    """A transform with set-up work: records what ran on which thread, in order."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, []

    def prepare(self) -> None:
        self.calls.append(("prepare", threading.current_thread().name))
        if self.fail:
            raise RuntimeError("no encoder today")

    def __call__(self, chunk: np.ndarray, last: bool) -> int:
        self.calls.append(("chunk", threading.current_thread().name))
        return len(chunk)


def test_a_transforms_prepare_runs_once_on_an_encoder_thread_before_its_first_chunk(pool):
    async def run(transform: _PreparedTransform) -> list[int]:
        return [n async for n in pool.pool.generate("Prepared first.", max_generate_length=5, seed=2,
                                                    transform=transform)]

    ok = _PreparedTransform()
    sizes = asyncio.run_coroutine_threadsafe(run(ok), pool._loop).result(120)
    assert sizes and all(n > 0 for n in sizes)
    assert [kind for kind, _ in ok.calls] == ["prepare"] + ["chunk"] * len(sizes)
    assert all(thread.startswith("voxcpm-encoder-") for _, thread in ok.calls)

    failing = _PreparedTransform(fail=True)  # fails the stream as an encoding failure, frees the engine
    with pytest.raises(Exception, match="encoding the audio failed: RuntimeError: no encoder today"):
        asyncio.run_coroutine_threadsafe(run(failing), pool._loop).result(120)
    assert failing.calls[0][0] == "prepare"
    _free_blocks_restored(pool)


class _WholeFile:
    """A transform that, like a whole-file encoder, gives something only at the last chunk (the samples seen)."""

    def __init__(self) -> None:
        self.samples = 0

    def __call__(self, chunk: np.ndarray, last: bool) -> int | None:
        self.samples += len(chunk)
        return self.samples if last else None


def test_the_encoder_pools_observer_sees_each_chunk_and_the_one_that_made_the_first_bytes(pool):
    encoders = pool.pool.client.encoders
    seen: list[tuple[bool, float, float]] = []

    async def run(transform: object) -> list[int]:
        return [n async for n in pool.pool.generate("Observed.", max_generate_length=4, seed=3,
                                                    transform=transform)]

    def broken(first: bool, wait_s: float, cpu_s: float) -> None:
        raise RuntimeError("metrics down")

    try:
        encoders.observer = lambda first, wait_s, cpu_s: seen.append((first, wait_s, cpu_s))
        whole = asyncio.run_coroutine_threadsafe(run(_WholeFile()), pool._loop).result(120)
        assert len(whole) == 1 and whole[0] > 0  # one value, made by the last chunk
        assert len(seen) >= 2 and all(wait >= 0 and cpu >= 0 for _, wait, cpu in seen)
        assert [first for first, _, _ in seen] == [False] * (len(seen) - 1) + [True]
        seen.clear()
        streamed = asyncio.run_coroutine_threadsafe(run(_PreparedTransform()), pool._loop).result(120)
        assert [first for first, _, _ in seen] == [True] + [False] * (len(seen) - 1) and len(seen) == len(streamed)
        # an observer that fails is told once and switched off; the stream is not affected
        encoders.observer = broken
        again = asyncio.run_coroutine_threadsafe(run(_PreparedTransform()), pool._loop).result(120)
        assert again == streamed and encoders.observer is None
    finally:
        encoders.observer = None
    _free_blocks_restored(pool)


def test_text_ids_are_the_workers_own_tokens_and_bad_ones_fail_the_request_alone(pool, checkpoint, monkeypatch):
    """The client's tokenization (engine.serving.stream.text_ids) gives the prompt the worker builds from the text, for
    zero-shot and continuation requests; a registered prompt's transcript is left to the worker. Ids that are not
    this model's fail that request as a request error, and the worker keeps serving."""
    from engine.prompt import build_prompt
    from engine.serving import protocol as msgs
    from engine.serving.stream import TOKENIZE_INLINE_CHARS, TextIdsBatcher, text_ids

    model = load_model(checkpoint)
    tok, cfg = model.tokenizer, model.config
    latents = torch.zeros(2 * cfg.patch_size, cfg.feat_dim)
    for text, prompt_text, prompt in (("Tokenized  by\nthe client.", "", None), ("Continue.", "A prompt.", latents)):
        request = msgs.SynthesisRequest(text, prompt_text, None if prompt is None else prompt.numpy())
        ids = text_ids(tok, request)
        assert ids is not None and (ids.text is None) == (prompt is None)
        worker_side = build_prompt(tok, cfg, text, prompt_text, prompt)
        client_side = build_prompt(tok, cfg, text, prompt_text, prompt, text_ids=ids)
        assert client_side.token_ids == worker_side.token_ids and client_side.target_tokens == worker_side.target_tokens
        assert torch.equal(client_side.feats, worker_side.feats)
        assert torch.equal(client_side.audio_mask, worker_side.audio_mask)
    assert text_ids(tok, msgs.SynthesisRequest("Stored.", prompt_id="p1")) is None
    # One short text alone is tokenized on the loop; a long one, or several started in one turn of the loop (a burst),
    # on a thread, in one call into the backend; each to the ids it has alone.
    calls: list[tuple[threading.Thread, int]] = []
    encode_many = tok.encode_many

    def recording_encode_many(texts: list[str]) -> list:
        calls.append((threading.current_thread(), len(texts)))
        return encode_many(texts)

    async def tokenize_together(requests: list[msgs.SynthesisRequest]) -> list:
        batcher = TextIdsBatcher()
        return await asyncio.gather(*(batcher.text_ids(tok, r) for r in requests))

    long_text = ("Long text. " * 400)[:TOKENIZE_INLINE_CHARS + 1]
    burst = [msgs.SynthesisRequest("First of a burst."), msgs.SynthesisRequest("Stored.", prompt_id="p1"),
             msgs.SynthesisRequest("Continue.", "A prompt.", latents.numpy()), msgs.SynthesisRequest("Third.")]
    for requests, texts, on_loop in (([msgs.SynthesisRequest(long_text[:TOKENIZE_INLINE_CHARS])], 1, True),
                                     ([msgs.SynthesisRequest(long_text)], 1, False), (burst, 4, False)):
        expected = [text_ids(tok, r) for r in requests]
        calls.clear()
        with monkeypatch.context() as patch:
            patch.setattr(tok, "encode_many", recording_encode_many)
            assert asyncio.run(tokenize_together(requests)) == expected
        assert [(thread is threading.main_thread(), n) for thread, n in calls] == [(on_loop, texts)]

    def failing_encode_many(texts: list[str]) -> list:
        raise RuntimeError("a tokenizer bug")

    # A tokenizer that fails leaves the text to the worker (None), on the loop and on a thread: no stream waits forever.
    with monkeypatch.context() as patch:
        patch.setattr(tok, "encode_many", failing_encode_many)
        for requests in ([msgs.SynthesisRequest("Alone.")], burst):
            assert asyncio.run(asyncio.wait_for(tokenize_together(requests), 10)) == [None] * len(requests)
    # what the client cannot tokenize is left to the worker, which refuses it as it always did
    assert text_ids(tok, msgs.SynthesisRequest(" \n ")) is None
    assert text_ids(tok, msgs.SynthesisRequest("Continue.", None, latents.numpy())) is None  # type: ignore[arg-type]

    async def bad(ids: msgs.TextIds) -> None:
        request = msgs.SynthesisRequest("Not these ids.", params=SamplingParams(max_generate_length=2), text_ids=ids)
        [_ async for _ in pool.pool.client.generate(request)]

    for ids in (msgs.TextIds([cfg.lm.vocab_size + 5]), msgs.TextIds([-1]), msgs.TextIds([1.5]),  # type: ignore[list-item]
                msgs.TextIds([1, True]), msgs.TextIds([1, 2], [3])):  # out of range, negative, not an int, a bool; a
        # prompt's ids without a prompt
        with pytest.raises(RequestError, match="text_ids: not this request's text"):
            asyncio.run_coroutine_threadsafe(bad(ids), pool._loop).result(60)
    assert list(pool.generate("Still serving.", max_generate_length=2, seed=1))

    async def stopped_while_tokenizing(how: str) -> tuple[str | None, list[int], int | None]:
        """A long text's stream whose caller goes away (its task cancelled) or closes it while a thread tokenizes
        it: aborted, never sent, never counted."""
        client = pool.pool.client
        default, client.tokenizer = client.tokenizer, tok
        try:
            stream = client.generate(msgs.SynthesisRequest(f"{how.title()} before it is sent. " * 200))
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)  # the stream starts and awaits its tokenizing thread
            if how == "cancel":
                first.cancel()
            else:
                stream.close()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await first
            return stream.finish_reason, client.load.loads().tolist(), stream.worker
        finally:
            client.tokenizer = default

    for how in ("cancel", "close"):
        outcome = asyncio.run_coroutine_threadsafe(stopped_while_tokenizing(how), pool._loop).result(60)
        assert outcome == ("aborted", [0], None), how  # the worker never counted it
    _free_blocks_restored(pool)


def test_a_worker_stopped_during_its_start_up_exits_at_once(checkpoint, capfd, caplog):
    """Start-up takes seconds (imports, load, graphs, warm-up), longer on a busy machine: a Stop that arrives meanwhile
    interrupts it (the worker used to finish starting first, and a stop past the owner's timeout killed it). Sent at
    once here, the Stop is in the pipe before the worker's start-up begins."""
    from engine.options import EngineOptions
    from engine.serving.processes import WorkerSet
    from engine.serving.voxcpm import engine_config

    config = engine_config(max_num_seqs=2, max_model_len=256, options=EngineOptions(log_level="INFO"))
    workers = WorkerSet(str(checkpoint), ["cpu"], config, warmup=True)
    worker = workers.processes[0]
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="engine.serving.processes"):
        workers.stop(timeout=60)  # a hang guard: the worker exits by itself
    assert worker.exitcode == 0 and "did not stop" not in caplog.text
    assert "stopped during start-up" in capfd.readouterr().err, f"took {time.monotonic() - t0:.1f} s"


def test_clips_are_encoded_between_steps_one_at_a_time(pool):
    """Encodes sent at once while a stream runs: the worker encodes one between two steps (the stream's chunks arrive
    between their replies) and answers a stats call sent after them first (it encoded every clip it had read before
    its next step: a burst of uploads stalled every stream, and the stats calls queued behind them marked it stuck)."""
    from engine.serving import protocol as msgs

    clips = [wav_bytes(2.0, seed=i) for i in range(4)]
    arrivals: list[str] = []

    async def scenario() -> None:
        client = pool.pool.client
        request = msgs.SynthesisRequest("A stream running while clips are encoded.",
                                     params=SamplingParams(max_generate_length=200, seed=1))
        async with client.generate(request) as stream:
            await anext(stream)

            async def encode(clip: bytes) -> None:
                await client.encode_latents(clip, "wav", "left")
                arrivals.append("encode")

            async def stats() -> None:
                await client.stats()
                arrivals.append("stats")

            async def chunks() -> None:
                async for _ in stream:
                    arrivals.append("chunk")

            reading = asyncio.create_task(chunks())
            await asyncio.sleep(0)
            await asyncio.gather(*(encode(c) for c in clips), stats())
            reading.cancel()

    asyncio.run_coroutine_threadsafe(scenario(), pool._loop).result(120)
    encodes = [i for i, a in enumerate(arrivals) if a == "encode"]
    assert len(encodes) == 4 and arrivals.index("stats") < encodes[-1], arrivals
    assert all("chunk" in arrivals[a + 1:b] for a, b in itertools.pairwise(encodes)), arrivals
    _free_blocks_restored(pool)


def test_a_stuck_worker_is_pinged_once_until_it_answers(pool):
    """The watchdog's pings of a worker that reads nothing (stopped): one stays outstanding, however often the owner
    asks (each was sent: after a few hundred the full pipe blocked the owner's loop, the supervisor's, for good);
    once it reads again it answers and the silence ends. Silence counts from a ping's sending, never from an answer
    long ago (a healthy worker not asked for a while is not silent)."""
    import psutil

    worker = pool.pool.workers.processes[0]
    process = psutil.Process(worker.process.pid)
    process.suspend()
    try:
        asking = threading.Thread(target=lambda: [worker.ping() for _ in range(2000)], daemon=True)
        asking.start()
        asking.join(HANG_GUARD_S)
        assert not asking.is_alive(), "pinging a stopped worker blocked"
    finally:
        process.resume()
    deadline = time.monotonic() + HANG_GUARD_S  # a hang guard: it answers at its next loop turn
    while worker.pinged_at is not None:
        assert time.monotonic() < deadline, "the worker never answered its ping"
        time.sleep(0.05)
    time.sleep(1.5)  # not asked meanwhile
    assert worker.ping() < 1.0  # a new ping: its silence starts now (not at the worker's last answer)


def test_a_pong_that_comes_while_the_ping_is_sent_is_no_crash():
    """The Pong may come (its watcher thread clears the outstanding ping) before `ping()` returns: the silence is then
    ~0 (it read the cleared time: a TypeError that ended the supervisor under load)."""
    from engine.serving.processes import WorkerProcess

    worker = WorkerProcess.__new__(WorkerProcess)  # its process and threads are not what this is about

    class AnsweredAtOnce:
        def send(self, msg: object) -> None:
            worker.pinged_at = None  # what the watcher thread does on the Pong

    worker.control, worker.exited, worker.pingable, worker.pinged_at = AnsweredAtOnce(), threading.Event(), True, None
    assert 0 <= worker.ping() < 1.0
