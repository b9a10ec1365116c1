"""Voice caches over HTTP: CRUD, content addressing, count/byte bounds with LRU eviction, persistence
across a service restart (disk store), and the store's own rules."""

from __future__ import annotations

import asyncio
import base64
import re

import httpx
import numpy as np
import pytest

from service.voice_store import SqliteVoiceStore, Voice, VoiceTooLargeError
from tests.service_harness import TLS, LiveServer, service_settings, wav_bytes


def clip(seed: int, seconds: float = 0.6) -> str:
    return base64.b64encode(wav_bytes(seconds, seed=seed)).decode()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("svc-voices")


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-voxcpm2", stop="never")


def test_crud_bounds_and_restart(checkpoint, cache_dir):
    settings = service_settings(checkpoint, cache_dir, voice_cache_max_entries=6, warmup=False)
    server = LiveServer(settings).start()
    try:
        with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
            lat = c.post("/encode_latents", json={"wav_base64": clip(0), "wav_format": "wav"}).json()
            assert lat["latents_dtype"] == "float32" and lat["feat_dim"] == 64 and lat["sample_rate"] == 48000
            frames = np.frombuffer(base64.b64decode(lat["prompt_latents_base64"]), np.float32).reshape(-1, 64)
            assert len(frames) % 4 == 0

            p1 = c.post("/add_prompt", json={"wav_base64": clip(1), "prompt_text": "One."}).json()
            assert c.post("/add_prompt", json={"wav_base64": clip(1), "prompt_text": "One."}).json() == p1
            p1b = c.post("/add_prompt", json={"wav_base64": clip(1), "prompt_text": "Other text."}).json()
            assert p1b["prompt_id"] != p1["prompt_id"]  # the transcript is part of the content
            ref = c.post("/add_reference", json={"wav_base64": clip(2)}).json()
            assert [v["id"] for v in c.get("/prompts").json()["voices"]] == [p1["prompt_id"], p1b["prompt_id"]]
            assert c.get("/references").json()["voices"][0]["ref_frames"] > 0

            # touch p1, fill the cache to 6 (add_hifi registers 3), then a 7th evicts the least recently used
            assert c.post("/generate_blocking_wav", json={"target_text": "x", "prompt_id": p1["prompt_id"],
                                                          "max_generate_length": 1}).status_code == 200
            hifi = c.post("/add_hifi", json={"wav_base64": clip(3), "prompt_text": "Three."}).json()
            p4 = c.post("/add_prompt", json={"wav_base64": clip(4), "prompt_text": "Four."}).json()
            listed = {v["id"] for k in ("prompts", "references", "hifi") for v in c.get(f"/{k}").json()["voices"]}
            assert listed == {p1["prompt_id"], ref["reference_id"], hifi["hifi_id"], hifi["prompt_id"],
                              hifi["reference_id"], p4["prompt_id"]}  # p1b evicted
            r = c.post("/generate", json={"target_text": "x", "prompt_id": p1b["prompt_id"]})
            assert r.status_code == 404 and "evicted" in r.json()["detail"]

            assert c.delete(f"/references/{ref['reference_id']}").json() == {"deleted": ref["reference_id"]}
            assert c.delete(f"/references/{ref['reference_id']}").status_code == 404
            assert c.delete(f"/prompts/{hifi['hifi_id']}").status_code == 404  # wrong kind
            assert c.post("/add_prompt", json={"wav_base64": clip(1), "prompt_text": " "}).status_code in (400, 422)
            r = c.post("/add_reference", json={"wav_base64": base64.b64encode(b"junk").decode()})
            assert r.status_code == 400 and "wav_base64" in r.json()["detail"]
            before = sorted(listed - {ref["reference_id"]})
    finally:
        server.stop()

    server = LiveServer(settings).start()  # same cache dir: the voices survive the restart
    try:
        with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
            after = sorted(v["id"] for k in ("prompts", "references", "hifi") for v in c.get(f"/{k}").json()["voices"])
            assert after == before
            r = c.post("/generate_blocking_wav", json={"target_text": "x", "hifi_id": hifi["hifi_id"],
                                                       "max_generate_length": 1})
            assert r.status_code == 200
            assert c.delete(f"/hifi/{hifi['hifi_id']}").status_code == 200
            assert c.get("/info").json()["voice_cache"]["hifi"] == 0
    finally:
        server.stop()


def test_a_hifi_voice_the_cache_cannot_hold_with_its_parts_is_refused_before_anything_is_evicted(checkpoint, tmp_path):
    """/add_hifi caches three voices (the HiFi one, its prompt and its reference): where the bounds cannot hold the
    three, it is a 413 naming wav_base64 before any is added (the last one evicted the first two, and the ids of those
    were answered as cached; a voice cached before went too)."""
    # a 0.6 s clip: 4 KiB of latents as a prompt, 4 KiB as a reference, 8 KiB as the HiFi voice
    settings = service_settings(checkpoint, tmp_path, voice_cache_max_bytes=10_000, warmup=False, voice_store="memory")
    server = LiveServer(settings).start()
    try:
        with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
            p1 = c.post("/add_prompt", json={"wav_base64": clip(1), "prompt_text": "One."}).json()["prompt_id"]
            r = c.post("/add_hifi", json={"wav_base64": clip(3), "prompt_text": "Three."})
            assert r.status_code == 413 and r.json()["detail"].startswith("wav_base64: the HiFi voice"), r.text
            assert re.search(r"3 voices of 163\d\d bytes in all exceed the cache size \(\d+ entries, 10000 bytes\)",
                             r.json()["detail"]), r.text
            listed = [v["id"] for k in ("prompts", "references", "hifi") for v in c.get(f"/{k}").json()["voices"]]
            assert listed == [p1]
    finally:
        server.stop()


def test_the_store_says_whether_voices_fit_together():
    store = SqliteVoiceStore.__new__(SqliteVoiceStore)
    store.max_entries, store.max_bytes = 3, 250
    store.check_holds([_voice(0), _voice(1)])
    with pytest.raises(VoiceTooLargeError, match="2 voices of 300 bytes in all exceed the cache size"):
        store.check_holds([_voice(0, 150), _voice(1, 150)])
    with pytest.raises(VoiceTooLargeError, match="4 voices"):
        store.check_holds([_voice(i, 10) for i in range(4)])


def _voice(i: int, n: int = 100) -> Voice:
    return Voice("reference", f"v{i}", ref_latents=bytes(n))


def test_store_byte_bound_and_lru_order(tmp_path):
    async def run() -> None:
        store = SqliteVoiceStore(tmp_path / "a.db", max_entries=100, max_bytes=250)
        for i in range(3):
            await store.put(_voice(i))
        assert [v.id for v in await store.list()] == ["v1", "v2"]  # 300 bytes > 250: v0 evicted
        await store.get("v1")  # touched: v2 is now the least recently used
        assert await store.put(_voice(3)) == ["v2"]
        with pytest.raises(VoiceTooLargeError):
            await store.put(_voice(9, n=1000))
        got = await store.get("v3")
        assert got is not None and got.ref_latents == bytes(100) and got.kind == "reference"
        assert await store.delete("v3") and not await store.delete("v3") and await store.get("v3") is None
        store.close()

        disk = SqliteVoiceStore(tmp_path / "b.db", max_entries=2, max_bytes=10_000)
        for i in range(3):
            await disk.put(_voice(i))
        assert [v.id for v in await disk.list()] == ["v1", "v2"]
        disk.close()
        again = SqliteVoiceStore(tmp_path / "b.db", max_entries=1, max_bytes=10_000)  # lower bound on reopen: trimmed
        assert [v.id for v in await again.list()] == ["v2"]
        again.close()

    asyncio.run(run())


def test_concurrent_puts_of_one_voice_count_once(tmp_path):
    """Two requests registering the same clip at once (both missed the cache) while the store is full:
    the entry and its bytes are counted once, or the byte bound would drift for good."""

    async def run() -> None:
        store = SqliteVoiceStore(tmp_path / "v.db", max_entries=2, max_bytes=10_000)
        for i in range(2):
            await store.put(_voice(i))
        await asyncio.gather(store.put(_voice(7)), store.put(_voice(7)))
        listed = await store.list()
        assert (await store.usage())["entries"] == len(listed) == 2
        assert (await store.usage())["bytes"] == sum(v.nbytes for v in listed)
        store.close()

    asyncio.run(run())


def test_store_is_shared_by_processes(tmp_path):
    """The service's API processes share one voice database: a voice put by one process is found, listed and
    counted by another, and an eviction made by one is seen by all (the bounds hold across them)."""
    import multiprocessing

    path = tmp_path / "shared.db"
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_put_voices, args=(path, [0, 1]))
    p.start()
    p.join(60)
    assert p.exitcode == 0

    async def run() -> None:
        store = SqliteVoiceStore(path, max_entries=2, max_bytes=10_000)
        assert {v.id for v in await store.list()} == {"v0", "v1"}
        assert (await store.get("v1")).ref_latents == bytes(100)
        assert await store.put(_voice(2)) == ["v0"]  # the least recently used, put by the other process
        assert (await store.usage())["entries"] == 2
        store.close()

    asyncio.run(run())


def _put_voices(path, ids: list[int]) -> None:
    async def run() -> None:
        store = SqliteVoiceStore(path, max_entries=2, max_bytes=10_000)
        for i in ids:
            await store.put(_voice(i))
        store.close()

    asyncio.run(run())


def test_a_prompt_that_could_never_be_used_is_not_cached(checkpoint, tmp_path):
    """A transcript (or clip) that alone fills max_model_len is refused at /add_prompt, /add_hifi and /add_reference,
    naming it (a HiFi voice counts its clip as prompt and as reference, with the reference's two marker tokens: 20 s
    fit as a prompt, not as HiFi); the refused voice is not listed, and one that fits is cached as before."""
    settings = service_settings(checkpoint, tmp_path, serverpool_max_model_len=256, warmup=False)
    server = LiveServer(settings).start()
    try:
        with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
            long_text = "word " * 400
            for route in ("/add_prompt", "/add_hifi"):
                r = c.post(route, json={"wav_base64": clip(5), "prompt_text": long_text})
                assert r.status_code == 422, r.text
                assert r.json()["detail"].startswith("prompt_text: the voice is "), r.text
                assert "within max_model_len=256" in r.json()["detail"]
            for route, seconds, counted in (
                    ("/add_hifi", 20, "125 of audio as the prompt, 125 of audio as the reference and its 2 marker"),
                    ("/add_reference", 41, "(257 of audio as the reference and its 2 marker tokens)")):
                r = c.post(route, json={"wav_base64": clip(8, seconds), "prompt_text": "A clip."})
                assert r.status_code == 422, r.text
                detail = r.json()["detail"]
                assert detail.startswith("wav_base64: the voice is ") and counted in detail, detail
                assert ("/add_prompt and /add_reference take the clip in one role" in detail) == (route == "/add_hifi")
            # the edge: a reference of 251 patches (+ its 2 markers) leaves one text token, the audio-start token and
            # one patch within 256; of 252 it does not (the engine refuses every use)
            fits, short = (c.post("/add_reference", json={"wav_base64": clip(9, sec)}) for sec in (40.16, 40.32))
            assert fits.status_code == 200, fits.text
            assert short.status_code == 422 and "(252 of audio as the reference" in short.text, short.text
            c.delete(f"/references/{fits.json()['reference_id']}")
            assert c.post("/add_prompt", json={"wav_base64": clip(8, 20), "prompt_text": "A clip."}).status_code == 200
            assert [c.get(f"/{kind}").json()["voices"] for kind in ("hifi", "references")] == [[], []]
    finally:
        server.stop()
