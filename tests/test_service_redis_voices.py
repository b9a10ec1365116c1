"""Voices shared by replicas through Redis (NANOVLLM_REDIS_URL): two real services on loopback, each with its own
engine worker on the tiny CPU checkpoint, sharing one real Redis-compatible server started here. Content-hash ids
agree across replicas, a voice added on one generates the same bytes on the other, deletes are honoured everywhere at
once, the bounds and the LRU order hold across replicas and under concurrent adds, an outage answers 503 naming the
store (requests without a voice keep working) and heals without a restart, and the voices survive restarting
everything."""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from engine.io.checkpoint import load_model
from engine.io.lora import LoRAConfig, random_adapter, sha256_of
from service.redis_store import RedisVoiceStore
from service.settings import Settings, describe_error
from service.voice_store import Voice, VoiceStoreUnavailable
from tests.redis_server import RedisServer, require_server_binary
from tests.service_harness import TLS, LiveServer, service_settings, wav_bytes

MAX_ENTRIES = 12
GEN = {"target_text": "Shared voices.", "max_generate_length": 2, "seed": 3, "response_format": "pcm"}


def clip(seed: int, seconds: float = 0.5) -> str:
    return base64.b64encode(wav_bytes(seconds, seed=seed)).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(require_server_binary(), tmp_path_factory.mktemp("redis")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-voxcpm2", stop="never")


@pytest.fixture(scope="module")
def adapter(checkpoint, tmp_path_factory) -> Path:
    model = load_model(checkpoint)
    return random_adapter(model.backbone, tmp_path_factory.mktemp("adapters") / "voice", LoRAConfig(
        enable_lm=True, enable_dit=True, enable_proj=True, r=4, alpha=8), seed=7)


class AdapterServer:
    """A real HTTP server of the adapter's files; with `trickle` set it sends them a byte at a time until `release`."""

    def __init__(self, adapter: Path) -> None:
        self.trickle, self.release = threading.Event(), threading.Event()
        outer = self

        class Files(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                file = adapter / self.path.rsplit("/", 1)[-1]
                if not file.is_file():
                    self.send_error(404)
                    return
                body = file.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                sent = 0
                while outer.trickle.is_set() and not outer.release.wait(0.2) and sent < len(body):
                    self.wfile.write(body[sent:sent + 1])
                    self.wfile.flush()
                    sent += 1
                self.wfile.write(body[sent:])

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Files)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture(scope="module")
def adapter_server(adapter):
    files = AdapterServer(adapter)
    yield files
    files.release.set()
    files.server.shutdown()


def start_replica(checkpoint, cache_dir, server: RedisServer, adapter: Path, adapter_url: str) -> LiveServer:
    settings = service_settings(checkpoint, cache_dir, redis_url=server.url, voice_cache_max_entries=MAX_ENTRIES,
                                warmup=False, max_loras=2, max_lora_rank=8, lora_dir=adapter.parent,
                                lora_url_prefixes=f"{adapter_url}/")
    return LiveServer(settings).start()


@pytest.fixture(scope="module")
def replicas(checkpoint, server, adapter, adapter_server, tmp_path_factory):
    """Two replicas: separate processes' worth of state (own engine, own cache dir), one Redis."""
    pair = [start_replica(checkpoint, tmp_path_factory.mktemp(f"replica-{n}"), server, adapter, adapter_server.url)
            for n in "ab"]
    yield pair
    for r in pair:
        r.stop()


@pytest.fixture
def clients(replicas, server):
    redis.Redis(port=server.port).flushdb()  # each test starts from no voices
    with httpx.Client(verify=TLS, base_url=replicas[0].url, timeout=60) as a, \
            httpx.Client(verify=TLS, base_url=replicas[1].url, timeout=60) as b:
        yield a, b


def listed(c: httpx.Client, kind: str) -> list[str]:
    r = c.get(f"/{kind}")
    assert r.status_code == 200, r.text
    return [v["id"] for v in r.json()["voices"]]


def pcm(c: httpx.Client, **voice: str) -> bytes:
    r = c.post("/generate_blocking", json={**GEN, **voice})
    assert r.status_code == 200, r.text
    assert r.content
    return r.content


def store_up(c: httpx.Client) -> float:
    for family in text_string_to_metric_families(c.get("/metrics").text):
        if family.name == "voxcpm_voice_store_up":
            return family.samples[0].value
    raise AssertionError("voxcpm_voice_store_up missing from /metrics")


def test_ids_and_audio_agree_across_replicas(clients):
    a, b = clients
    on_a = a.post("/add_hifi", json={"wav_base64": clip(1), "prompt_text": "One clip."}).json()
    assert set(listed(b, "hifi")) == {on_a["hifi_id"]}  # listed by the other replica at once
    assert set(listed(b, "prompts")) == {on_a["prompt_id"]} and set(listed(b, "references")) == {on_a["reference_id"]}
    on_b = b.post("/add_hifi", json={"wav_base64": clip(1), "prompt_text": "One clip."}).json()
    assert on_b == on_a  # the same clip: the same content-hash ids on every replica
    assert b.get("/info").json()["voice_cache"]["entries"] == 3
    for voice in ({"hifi_id": on_a["hifi_id"]}, {"prompt_id": on_a["prompt_id"], "ref_audio_id": on_a["reference_id"]}):
        assert pcm(a, **voice) == pcm(b, **voice)  # same seed, same voice: the same bytes from either replica
    r = b.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": on_a["hifi_id"],
                                         "response_format": "pcm"})
    assert r.status_code == 200 and r.content


def test_delete_on_one_replica_is_honoured_by_the_other_at_once(clients):
    a, b = clients
    rid = a.post("/add_reference", json={"wav_base64": clip(2)}).json()["reference_id"]
    pcm(b, ref_audio_id=rid)  # replica B now holds the latents in its local cache
    assert b.delete(f"/references/{rid}").json() == {"deleted": rid}
    r = a.post("/generate_blocking", json={**GEN, "ref_audio_id": rid})
    assert r.status_code == 404 and "ref_audio_id" in r.json()["detail"]
    r = b.post("/generate_blocking", json={**GEN, "ref_audio_id": rid})  # not served from B's local copy
    assert r.status_code == 404
    assert a.delete(f"/references/{rid}").status_code == 404
    assert listed(a, "references") == listed(b, "references") == []


def test_count_bound_and_lru_hold_across_replicas(clients):
    a, b = clients
    ids = [(a if i % 2 else b).post("/add_reference", json={"wav_base64": clip(100 + i)}).json()["reference_id"]
           for i in range(MAX_ENTRIES)]
    pcm(b, ref_audio_id=ids[0])  # used on B: the least recently used is now ids[1], added on A
    extra = a.post("/add_reference", json={"wav_base64": clip(200)}).json()["reference_id"]
    now = listed(b, "references")
    assert len(now) == MAX_ENTRIES and ids[1] not in now and ids[0] in now and now[-1] == extra
    assert now[:2] == [ids[2], ids[3]] and now[-2] == ids[0]  # least recently used first, the same order everywhere
    assert listed(a, "references") == now
    r = a.post("/generate_blocking", json={**GEN, "ref_audio_id": ids[1]})
    assert r.status_code == 404 and "evicted" in r.json()["detail"]


def test_concurrent_adds_on_two_replicas_leave_exactly_the_distinct_voices(clients, replicas):
    a, b = clients
    clips = [clip(300 + i % 10) for i in range(50)]  # 10 distinct clips, each added 5 times

    async def add_all() -> list[str]:
        async with httpx.AsyncClient(verify=TLS, timeout=120) as c:
            rs = await asyncio.gather(*(c.post(replicas[i % 2].url + "/add_reference", json={"wav_base64": w})
                                        for i, w in enumerate(clips)))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
        return [r.json()["reference_id"] for r in rs]

    ids = asyncio.run(add_all())
    distinct = set(ids)
    assert len(distinct) == 10
    assert sorted(listed(a, "references")) == sorted(listed(b, "references")) == sorted(distinct)
    cache = a.get("/info").json()["voice_cache"]
    assert cache["entries"] == cache["reference"] == 10
    assert cache["bytes"] == sum(v["nbytes"] for v in b.get("/references").json()["voices"])


def test_byte_and_count_bounds_across_store_handles(server):
    """Two replicas' store handles on one Redis, byte-bound: evictions follow the shared use order, whichever handle
    added or used a voice, and the bytes stay counted once under concurrent adds of the same voices."""

    async def run() -> None:
        one, two = (RedisVoiceStore(server.url, "bounds-test", 100, 250, 0.5) for _ in range(2))
        await one.redis.flushdb()
        for i in range(2):
            await (one, two)[i].put(Voice("reference", f"v{i}", ref_latents=bytes(100)))
        assert (await two.get("v0")) is not None  # used through the other handle
        assert await one.put(Voice("reference", "v2", ref_latents=bytes(100))) == ["v1"]  # 300 > 250 bytes
        assert [v.id for v in await two.list()] == ["v0", "v2"]
        await asyncio.gather(*((one, two)[i % 2].put(Voice("reference", f"w{i % 3}", ref_latents=bytes(60)))
                               for i in range(30)))
        usage = await two.usage()
        kept = await one.list()
        assert usage["bytes"] == sum(v.nbytes for v in kept) <= 250 and usage["entries"] == len(kept)
        assert {v.id for v in kept} >= {"w0", "w1", "w2"}
        small = RedisVoiceStore(server.url, "bounds-test", 2, 10_000, 0.5)  # a replica with a lower count bound
        await small.trim()
        assert len(await one.list()) == 2
        for s in (one, two, small):
            await s.aclose()

    asyncio.run(run())


def test_a_voice_deleted_while_it_is_read_is_read_or_unknown_and_a_malformed_one_unknown(server):
    """A read of a voice this handle holds locally, racing its delete (the copy dropped while the store answers), gets
    the voice or None, never a KeyError (a 500); an entry missing fields is unknown to reads and left out of lists."""

    async def run() -> None:
        store = RedisVoiceStore(server.url, "race-test", 100, 10**6, 0.5)
        await store.redis.flushdb()
        for i in range(50):
            voice = Voice("prompt", f"p{i}", "A prompt.", bytes(256))
            await store.put(voice)  # in the local copy too: the read asks the store only whether it is there
            read = asyncio.ensure_future(store.get(voice.id))
            await asyncio.sleep(0)  # the read is waiting for the store
            gone, got = await asyncio.gather(store.delete(voice.id), read)
            assert gone and got in (voice, None)
        await store.put(Voice("prompt", "bad", "A prompt.", bytes(256)))
        await store.put(Voice("prompt", "good", "A prompt.", bytes(256)))
        await store.redis.hdel(store.voice_prefix + "bad", "created")
        store._forget("bad")
        assert await store.get("bad") is None
        assert [v.id for v in await store.list()] == ["good"]
        await store.aclose()

    asyncio.run(run())


def test_outage_answers_503_and_heals_without_restart(clients, server):
    a, b = clients
    hid = a.post("/add_hifi", json={"wav_base64": clip(4), "prompt_text": "Four."}).json()["hifi_id"]
    expected = pcm(b, hifi_id=hid)
    server.pause()  # hung, not refused: every store call must be bounded by its timeout
    try:
        for c in (a, b):
            t0 = time.monotonic()
            r = c.post("/generate_blocking", json={**GEN, "hifi_id": hid})
            assert time.monotonic() - t0 < 2.0
            assert r.status_code == 503 and r.headers["Retry-After"]
            assert "voice store (redis://127.0.0.1:" in r.json()["detail"] and "unreachable" in r.json()["detail"]
            r = c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": hid})
            assert r.status_code == 503 and "voice store" in r.json()["error"]["message"]
            assert pcm(c)  # no voice: no store
            assert c.get("/ready").status_code == 200
            LiveServer.wait(lambda c=c: store_up(c) == 0, "the store's gauge never said down", 30)
            cache = c.get("/info").json()["voice_cache"]
            assert cache["backend"] == "redis" and cache["up"] is False
    finally:
        server.resume()
    t0 = time.monotonic()
    LiveServer.wait(lambda: all(c.post("/generate_blocking", json={**GEN, "hifi_id": hid}).status_code == 200
                                for c in (a, b)), "the replicas did not recover", 30)
    assert time.monotonic() - t0 < 5.0
    assert pcm(a, hifi_id=hid) == expected
    LiveServer.wait(lambda: store_up(a) == 1 and store_up(b) == 1, "the store's gauge never said up", 30)
    assert a.get("/info").json()["voice_cache"]["up"] is True


def test_a_full_server_still_serves_and_deletes_its_voices(clients, server):
    """A server at its maxmemory (noeviction) refuses writes: a voice is still read (its use not recorded) and
    deleted, its counts with it, and a delete that finds the voice gone is a 404."""
    a, b = clients
    pid = a.post("/add_prompt", json={"wav_base64": clip(11), "prompt_text": "Full."}).json()["prompt_id"]
    r = redis.Redis(port=server.port)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)  # full whatever its client buffers hold (1 KiB under its use was not, once)
    try:
        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
            r.set("probe", "x")  # full indeed
        assert pcm(b, prompt_id=pid)  # B has no copy of its own: read from the server
        assert a.delete(f"/prompts/{pid}").json() == {"deleted": pid}
    finally:
        r.config_set("maxmemory", 0)
    assert b.post("/generate_blocking", json={**GEN, "prompt_id": pid}).status_code == 404
    assert b.delete(f"/prompts/{pid}").status_code == 404
    (usage,) = r.keys("voxcpm:*:usage")
    assert {k: int(v) for k, v in r.hgetall(usage).items()} == {b"prompt": 0, b"bytes": 0}


def test_adapter_registered_on_one_replica_is_served_by_the_other(clients, adapter):
    a, b = clients
    base = pcm(b)
    r = a.post("/loras", json={"lora_name": "shared", "lora_uri": f"file://{adapter}"})
    assert r.status_code == 200, r.text
    adapted = pcm(b, lora_name="shared")  # B takes it from Redis before answering
    assert adapted != base and adapted == pcm(a, lora_name="shared")
    assert "shared" in [m["id"] for m in b.get("/v1/models").json()["data"]]
    assert b.delete("/loras/shared").json() == {"deleted": "shared"}
    r = a.post("/generate_blocking", json={**GEN, "lora_name": "shared"})  # A drops it before answering
    assert r.status_code == 404 and "lora_name" in r.text
    assert [d["name"] for d in a.get("/loras").json()["loras"]] == []
    assert a.delete("/loras/shared").status_code == 404


def test_a_slow_download_of_a_shared_adapter_holds_no_other_request(clients, adapter, adapter_server):
    """A replica takes another's registration from its source: a slow download held the sync, and with it every
    request of that replica involving adapters, for as long as it took. Now only a request naming that adapter waits
    for it (and is served); the others answer meanwhile without it."""
    a, b = clients
    assert a.post("/loras", json={"lora_name": "held", "lora_uri": f"file://{adapter}"}).status_code == 200
    assert pcm(b, lora_name="held")  # B holds it
    digest = sha256_of(adapter / "lora_weights.safetensors")
    url = f"{adapter_server.url}/slow/lora_weights.safetensors"
    r = a.post("/loras", json={"lora_name": "slow", "lora_uri": url, "sha256": digest})  # A's copy comes at once
    assert r.status_code == 200, r.text
    adapter_server.trickle.set()
    try:
        listed = b.get("/loras", timeout=10)  # B's copy trickles in meanwhile
        assert listed.status_code == 200 and "slow" not in [d["name"] for d in listed.json()["loras"]]

        def held(_: int) -> float:  # requests naming an adapter B holds: none waits on the download (each waited
            started = time.monotonic()  # on it again under the locks, one after another)
            r = b.post("/generate_blocking", json={**GEN, "lora_name": "held"}, timeout=30)
            assert r.status_code == 200, r.text
            return time.monotonic() - started

        with ThreadPoolExecutor(4) as pool:
            took = list(pool.map(held, range(4)))
        assert max(took) < 6, took
    finally:
        adapter_server.release.set()
        adapter_server.trickle.clear()
    assert pcm(b, lora_name="slow") == pcm(a, lora_name="slow")  # waited for its download, then served
    adapter_server.release.clear()


def test_a_second_api_process_takes_its_replicas_registration_as_it_is(replicas, clients, adapter, caplog):
    """Two API processes of one replica (one engine, one registrations table): an adapter registered through the first
    is taken as it is by the second's sync (it unregistered and registered it again on the shared workers, where a
    request naming it meanwhile got 404), and it serves it."""
    from service.engine_setup import WorkerEndpoint

    caplog.set_level(logging.INFO, logger="service.shared_adapters")
    a, _ = clients
    first = replicas[0].state
    registrations = first.lora_registrations
    assert registrations is not None and first.pool.workers is not None
    endpoint = WorkerEndpoint(first.pool.workers.addresses, first.pool.workers.authkey, first.model_path, demo=False,
                              voice_db=registrations.path.with_name("voices.db"), multiprocess_metrics=False)
    second = LiveServer(replicas[0].settings, endpoint).start()
    try:
        r = a.post("/loras", json={"lora_name": "one", "lora_uri": f"file://{adapter}"})
        assert r.status_code == 200, r.text
        with httpx.Client(verify=TLS, base_url=second.url, timeout=60) as c:
            assert [d["name"] for d in c.get("/loras").json()["loras"]] == ["one"]
            assert pcm(c, lora_name="one") == pcm(a, lora_name="one")
        assert "adapter one registered (from another replica)" not in caplog.text
    finally:
        second.stop()
        a.delete("/loras/one")


@pytest.fixture(scope="module")
def other_adapter(checkpoint, adapter) -> Path:
    """Another adapter beside the first (inside the replicas' NANOVLLM_LORA_DIR)."""
    return random_adapter(load_model(checkpoint).backbone, adapter.parent / "other", LoRAConfig(
        enable_lm=True, enable_dit=True, enable_proj=True, r=4, alpha=8), seed=8)


def test_a_name_registered_again_is_the_new_adapter_on_every_replica(clients, adapter, other_adapter):
    """A name unregistered and registered again from another source: the replica that served the old one serves
    the new one (it held the old registration under that name)."""
    a, b = clients
    assert a.post("/loras", json={"lora_name": "again", "lora_uri": f"file://{adapter}"}).status_code == 200
    old = pcm(b, lora_name="again")
    assert a.delete("/loras/again").status_code == 200
    r = a.post("/loras", json={"lora_name": "again", "lora_uri": f"file://{other_adapter}"})
    assert r.status_code == 200, r.text
    new = pcm(a, lora_name="again")
    assert new != old and pcm(b, lora_name="again") == new
    assert a.delete("/loras/again").status_code == 200


def registered_already(name: str) -> str:
    return (f"lora_name: {name!r} is registered already from another source (replicas share their registrations); "
            "unregister it first")


def test_one_name_registered_on_two_replicas_at_once_ends_as_one_adapter(clients, adapter, other_adapter):
    """Both replicas register one name from different sources at the same time: one answers 200, the other 409
    naming lora_name (whether its sync saw the first's registration or its own write came second), and both then
    serve the winner's adapter."""
    a, b = clients
    for attempt in range(3):
        name = f"race{attempt}"
        with ThreadPoolExecutor(2) as pool:
            ra, rb = pool.map(lambda c, path, n=name: c.post("/loras", json={"lora_name": n, "lora_uri": f"file://{path}"}),
                              (a, b), (adapter, other_adapter))
        assert sorted((ra.status_code, rb.status_code)) == [200, 409], (ra.text, rb.text)
        loser = ra if ra.status_code != 200 else rb
        assert loser.json()["detail"] == registered_already(name), loser.text
        assert pcm(a, lora_name=name) == pcm(b, lora_name=name)
        assert a.delete(f"/loras/{name}").status_code == 200


@pytest.mark.parametrize("taken", [True, False], ids=["taken-here", "not-taken-here"])
def test_a_name_registered_long_ago_on_another_replica_is_a_409(clients, replicas, server, adapter, other_adapter,
                                                                 taken):
    """A name another replica registered earlier from another source: 409 naming lora_name, whether this replica
    serves that registration (its workers took it) or could not take it (here: a path outside its
    NANOVLLM_LORA_DIR); its own adapter is served nowhere and the standing registration is untouched."""
    a, b = clients
    if taken:
        assert a.post("/loras", json={"lora_name": "old", "lora_uri": f"file://{adapter}"}).status_code == 200
        standing = pcm(a, lora_name="old")
        assert pcm(b, lora_name="old") == standing  # B holds A's adapter
    else:  # as a replica that mounts another directory would have written it
        redis.Redis(port=server.port).hset(replicas[1].state.shared_adapters.key, "old",
                                           '{"uri": "file:///elsewhere/old", "sha256": null}')
    r = b.post("/loras", json={"lora_name": "old", "lora_uri": f"file://{other_adapter}"})
    assert r.status_code == 409 and r.json()["detail"] == registered_already("old"), r.text
    if taken:
        assert pcm(b, lora_name="old") == standing
    else:
        assert b.post("/generate_blocking", json={**GEN, "lora_name": "old"}).status_code == 404
    assert b.delete("/loras/old").status_code == 200


def test_the_shared_registration_is_first_come(server):
    """Two replicas' writes of one name: the first stands; the same source again is accepted (idempotent), another is
    refused (the route's 409), and after a removal the name is free again."""
    from service.shared_adapters import SharedAdapters

    async def run() -> None:
        one, two = (SharedAdapters(RedisVoiceStore(server.url, "first-come", 10, 10_000, 0.5)) for _ in range(2))
        await one.store.redis.flushdb()
        assert await one.add("n", "file:///a", None) and await two.add("n", "file:///a", None)
        assert not await two.add("n", "file:///b", None) and await one.registered() == {
            "n": {"uri": "file:///a", "sha256": None}}
        assert await one.remove("n") and await two.add("n", "file:///b", None)

    asyncio.run(run())


def test_voices_survive_restarting_every_replica_and_the_server(clients, replicas, server, checkpoint, adapter,
                                                                adapter_server, tmp_path_factory):
    a, b = clients
    hid = a.post("/add_hifi", json={"wav_base64": clip(5), "prompt_text": "Five."}).json()["hifi_id"]
    expected = pcm(b, hifi_id=hid)
    before = {k: listed(a, k) for k in ("prompts", "references", "hifi")}
    for r in replicas:
        r.stop()
    server.stop()  # its append-only file keeps the voices
    server.start()
    again = start_replica(checkpoint, tmp_path_factory.mktemp("replica-c"), server, adapter, adapter_server.url)
    try:
        with httpx.Client(verify=TLS, base_url=again.url, timeout=60) as c:
            assert {k: listed(c, k) for k in before} == before
            assert pcm(c, hifi_id=hid) == expected
    finally:
        again.stop()


def test_unreachable_store_raises_its_typed_error_quickly():
    """Nothing listening: a store call fails fast with VoiceStoreUnavailable naming where it looked."""
    from tests.service_harness import free_port

    async def run() -> None:
        store = RedisVoiceStore(f"redis://:secret@127.0.0.1:{free_port()}/0", "none", 10, 10_000, 0.5)
        with pytest.raises(VoiceStoreUnavailable, match=r"voice store \(redis://127\.0\.0\.1:\d+/0\) unreachable"):
            await store.get("x")
        assert store.up is False and await store.check() is False
        await store.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("url", ["http://host:6379/0", "redis://host:port/0"])
def test_a_bad_redis_url_is_refused_naming_the_setting(url):
    with pytest.raises(ValidationError) as e:
        Settings(redis_url=url)
    assert "NANOVLLM_REDIS_URL" in describe_error(e.value)
