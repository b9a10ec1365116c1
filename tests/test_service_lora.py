"""The start-up LoRA adapter through the service: fetched from a real HTTP server, S3-compatible server (moto) or
hub-compatible server into the cache dir, its SHA-256 checked, merged into every worker's weights; the audio changes
with it, and a path to the same adapter gives the same audio. A digest that does not match, an unsupported scheme or
an adapter without merging stop start-up."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import re
import shutil
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from websockets.exceptions import ConnectionClosedOK
from websockets.sync.client import connect

from engine.io.checkpoint import load_model
from engine.io.lora import LoRAConfig, random_adapter, sha256_of
from service.engine_setup import adapter_path
from service.lora_source import AdapterSourceError, fetch_adapter
from tests.service_harness import TLS, LiveServer, service_settings
from tests.supervised import metric

BODY = {"target_text": "An adapted voice.", "max_generate_length": 3, "seed": 4, "response_format": "pcm"}


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def adapter(checkpoint_factory, tmp_path_factory) -> Path:
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    return random_adapter(model.backbone, tmp_path_factory.mktemp("adapter") / "voice", LoRAConfig(
        enable_lm=True, enable_dit=True, enable_proj=True, r=4, alpha=8), seed=7)


@pytest.fixture(scope="module")
def file_server(adapter):
    """A real HTTP server over the adapter's directory."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(adapter.parent)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def generate(checkpoint: Path, cache: Path, **lora: object) -> tuple[bytes, dict]:
    server = LiveServer(service_settings(checkpoint, cache, **lora)).start()
    try:
        with httpx.Client(verify=TLS, base_url=server.url, timeout=120) as c:
            r = c.post("/generate", json=BODY)
            assert r.status_code == 200, r.text
            return r.content, c.get("/info").json()["lora"]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def plain_server(adapter, checkpoint_factory, tmp_path_factory):
    """The base model without adapters (no start-up adapter, NANOVLLM_MAX_LORAS=0), for the base audio and the
    refusals of runtime adapters; its NANOVLLM_LORA_DIR holds the adapter, so a registration is refused for the
    missing slots, not for its path."""
    settings = service_settings(checkpoint_factory("tiny-voxcpm2", stop="never"), tmp_path_factory.mktemp("plain"),
                                lora_dir=adapter.parent)
    server = LiveServer(settings).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain_audio(plain_server) -> bytes:
    """BODY's audio from the base model."""
    with httpx.Client(verify=TLS, base_url=plain_server.url, timeout=120) as c:
        assert not c.get("/info").json()["lora"]["enabled"]
        r = c.post("/generate", json=BODY)
        assert r.status_code == 200, r.text
        return r.content


@pytest.fixture(scope="module")
def merged_audio(adapter, checkpoint_factory, tmp_path_factory) -> bytes:
    """BODY's audio from a service that merged the adapter at start-up, named by a file:// URI."""
    audio, info = generate(checkpoint_factory("tiny-voxcpm2", stop="never"), tmp_path_factory.mktemp("merged"),
                           lora_uri=f"file://{adapter}", lora_merge=True)
    assert info["enabled"] and info["merged_layers"] > 0
    return audio


def test_adapter_from_https_is_merged_and_changes_the_audio(adapter, file_server, checkpoint_factory, tmp_path,
                                                             plain_audio, merged_audio):
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    digest = sha256_of(adapter / "lora_weights.safetensors")
    url = f"{file_server}/{adapter.name}/lora_weights.safetensors"
    adapted, info = generate(ckpt, tmp_path / "a", lora_uri=url, lora_sha256=digest, lora_merge=True, lora_id="voice")
    assert info["enabled"] and info["merged_layers"] > 0 and info["id"] == "voice" and info["sha256"] == digest
    cached = list((tmp_path / "a" / "lora").glob("*/lora_weights.safetensors"))
    assert len(cached) == 1 and (cached[0].parent / "lora_config.json").is_file()  # the config came along
    assert plain_audio != adapted
    assert merged_audio == adapted  # a path to the same adapter: the same audio


def test_a_digest_that_does_not_match_stops_start_up(adapter, file_server, tmp_path):
    digest = sha256_of(adapter / "lora_weights.safetensors")
    wrong = "0" * 64
    with pytest.raises(AdapterSourceError, match=f"has SHA-256 {digest}, expected {wrong}"):
        fetch_adapter(str(adapter), tmp_path, wrong)
    url = f"{file_server}/{adapter.name}/lora_weights.safetensors"
    fetched = fetch_adapter(url, tmp_path, digest)
    (fetched / "lora_weights.safetensors").write_bytes(b"truncated")  # a damaged cached copy is fetched again
    assert sha256_of(fetch_adapter(url, tmp_path, digest) / "lora_weights.safetensors") == digest
    with pytest.raises(AdapterSourceError, match="answered 404"):
        fetch_adapter(f"{file_server}/missing/lora_weights.safetensors", tmp_path)


@pytest.mark.parametrize("fields,message", [
    ({"lora_uri": "gs://bucket/adapter/lora_weights.safetensors", "lora_merge": True}, "gs:// is not supported"),
    ({"lora_uri": "/adapters/voice", "lora_merge": False}, "set NANOVLLM_MAX_LORAS >= 1"),
    ({"lora_uri": "/adapters/voice", "lora_merge": True, "lora_id": "a b"}, "lora_id"),
    ({"lora_uri": "/adapters/voice", "lora_merge": True, "lora_sha256": "abc"}, "64 hexadecimal digits"),
])
def test_bad_adapter_settings_are_refused(fields, message, tmp_path):
    with pytest.raises(ValidationError, match=message):
        service_settings(tmp_path, tmp_path, **fields)


def serve(handler: type[BaseHTTPRequestHandler]):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def changing_weights_server(content: list[bytes], gets: list[str] | None = None) -> tuple[ThreadingHTTPServer, str]:
    """A real HTTP server whose weights file is content[0] (replaced by the test), sent in slow pieces so that fetches
    at once overlap; no lora_config.json beside it. `gets`: the paths asked, in order."""

    class Weights(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if gets is not None:
                gets.append(self.path)
            if not self.path.endswith(".safetensors"):
                self.send_error(404)
                return
            body = content[0]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(0, len(body), len(body) // 4 + 1):
                self.wfile.write(body[i:i + len(body) // 4 + 1])
                self.wfile.flush()
                time.sleep(0.05)

        def log_message(self, *args: object) -> None:
            pass

    return serve(Weights)


def test_a_uri_fetched_again_with_a_new_digest_leaves_the_old_copy_as_it_was(adapter, tmp_path):
    """The adapter behind one URL changes and is registered again with its new digest: the copy of the first
    registration, which leases and other API processes still read, keeps its weights (it was overwritten in place)."""
    first = (adapter / "lora_weights.safetensors").read_bytes()
    content = [first]
    server, url = changing_weights_server(content)
    try:
        uri = f"{url}/voices/lora_weights.safetensors"
        old = fetch_adapter(uri, tmp_path, hashlib.sha256(first).hexdigest())
        content[0] = first[:-8] + b"\x01" * 8
        new = fetch_adapter(uri, tmp_path, hashlib.sha256(content[0]).hexdigest())
        assert old != new
        assert (old / "lora_weights.safetensors").read_bytes() == first
        assert (new / "lora_weights.safetensors").read_bytes() == content[0]
    finally:
        server.shutdown()


def test_fetches_of_one_adapter_at_once_each_get_the_whole_file(adapter, tmp_path):
    """The API processes of a replica fetch a registration of another replica at once, into one cache: each wrote
    into one shared part file (interleaved bytes, or a rename of a part another had renamed already). One of them
    downloads it, the others wait and find it (each took its own download from the source)."""
    body = (adapter / "lora_weights.safetensors").read_bytes()
    digest = hashlib.sha256(body).hexdigest()
    gets: list[str] = []
    server, url = changing_weights_server([body], gets)
    results: list[object] = [None] * 6

    def fetch(i: int) -> None:
        try:
            results[i] = fetch_adapter(f"{url}/voices/lora_weights.safetensors", tmp_path, digest)
        except Exception as e:  # noqa: BLE001 - the test reports whatever a fetch raised
            results[i] = e

    try:
        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.shutdown()
    assert all(isinstance(r, Path) for r in results), results
    assert sha256_of(results[0] / "lora_weights.safetensors") == digest
    assert not list(results[0].glob("*.part"))  # no writer's temporary file is left behind
    assert sum(p.endswith(".safetensors") for p in gets) == 1, gets


def trickle_server(release: threading.Event, every_s: float = 0.2) -> tuple[ThreadingHTTPServer, str]:
    """A real HTTP server that promises a MiB and sends a byte every `every_s` until `release` is set."""

    class Trickle(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 20))
            self.end_headers()
            while not release.wait(every_s):
                self.wfile.write(b"\0")
                self.wfile.flush()

        def log_message(self, *args: object) -> None:
            pass

    return serve(Trickle)


def test_a_callers_download_stays_within_its_limits(adapter, tmp_path):
    """What an API caller names is fetched only from under NANOVLLM_LORA_URL_PREFIXES (a look-alike host or a redirect
    out of them is refused: POST /loras fetched 127.0.0.1, a redirect to it, 169.254.169.254), at most
    NANOVLLM_LORA_MAX_BYTES (declared or sent), and no '..' into a hub's paths (a 500)."""
    from service.lora_source import FetchLimits

    body = (adapter / "lora_weights.safetensors").read_bytes()
    inside, inside_url = serve(type("Inside", (BaseHTTPRequestHandler,), {
        "do_GET": lambda self: _answer(self, body), "log_message": lambda self, *a: None}))
    target = f"{inside_url}/voices/lora_weights.safetensors"
    outside, outside_url = serve(type("Outside", (BaseHTTPRequestHandler,), {
        "do_GET": lambda self: _answer(self, b"", location=target if "in" in self.path else
                                       f"{inside_url}/other/lora_weights.safetensors"),
        "log_message": lambda self, *a: None}))
    try:
        allowed = FetchLimits((f"{inside_url}/voices/",), max_bytes=len(body))
        assert sha256_of(fetch_adapter(target, tmp_path / "a", limits=allowed) / "lora_weights.safetensors") \
            == hashlib.sha256(body).hexdigest()
        for uri, message in [
            (f"{inside_url}/other/lora_weights.safetensors", "is not under NANOVLLM_LORA_URL_PREFIXES"),
            (f"{inside_url}/voices2/lora_weights.safetensors", "is not under"),  # a look-alike path
            (f"{outside_url}/out/lora_weights.safetensors", "is not under NANOVLLM_LORA_URL_PREFIXES"),
        ]:
            with pytest.raises(AdapterSourceError, match=message):
                fetch_adapter(uri, tmp_path / "b", limits=allowed)
        # a redirect from an allowed place out of the allowed ones is refused; within them it is followed
        both = FetchLimits((f"{inside_url}/voices/", f"{outside_url}/"), max_bytes=len(body))
        with pytest.raises(AdapterSourceError, match="redirects to .*/other/lora_weights.safetensors.*is not under"):
            fetch_adapter(f"{outside_url}/out/lora_weights.safetensors", tmp_path / "c", limits=both)
        assert (fetch_adapter(f"{outside_url}/in/lora_weights.safetensors", tmp_path / "d", limits=both)
                / "lora_weights.safetensors").read_bytes() == body
        with pytest.raises(AdapterSourceError, match="NANOVLLM_LORA_URL_PREFIXES is unset"):
            fetch_adapter(target, tmp_path / "e", limits=FetchLimits(()))
        with pytest.raises(AdapterSourceError, match=f"is {len(body)} bytes, more than NANOVLLM_LORA_MAX_BYTES"):
            fetch_adapter(target, tmp_path / "f", limits=FetchLimits(None, max_bytes=len(body) - 1))
        assert not list((tmp_path / "f").rglob("*.part"))
    finally:
        inside.shutdown()
        outside.shutdown()
    with pytest.raises(AdapterSourceError, match="without '..'"):
        fetch_adapter("hf://a/b?path=../../../../tmp/x", tmp_path / "g")
    good = FetchLimits(("https://good.example/adapters/",))  # a look-alike host, a user part: other hosts
    assert good.refusal("https://good.example/adapters/a/lora_weights.safetensors") is None
    for url in ("https://good.example.evil.net/adapters/x.safetensors", "https://x@good.example/adapters/x.safetensors",
                "http://good.example/adapters/x.safetensors",
                # dot segments and encoded slashes: a client resolves them before it asks (they passed the check)
                "https://good.example/adapters/../internal/x.safetensors",
                "https://good.example/adapters/%2e%2e/internal/x.safetensors",
                "https://good.example/adapters/..%2Fsecret/x.safetensors"):
        assert good.refusal(url) is not None, url


def test_a_refused_download_leaves_nothing_and_a_trickle_meets_its_deadline(adapter, tmp_path):
    """A download refused for its digest (or a limit) is removed: each wrong digest left its copy (the cache is one
    directory per digest); a source that sends a byte at a time is cut at NANOVLLM_LORA_FETCH_TIMEOUT_S (the
    deadline was checked once a MiB)."""
    from service.lora_source import FetchLimits

    body = (adapter / "lora_weights.safetensors").read_bytes()
    server, url = serve(type("Whole", (BaseHTTPRequestHandler,), {
        "do_GET": lambda self: _answer(self, body), "log_message": lambda self, *a: None}))
    release = threading.Event()
    trickle, trickle_url = trickle_server(release)
    try:
        for wrong in ("0" * 64, "1" * 64, "2" * 64):
            with pytest.raises(AdapterSourceError, match="has SHA-256"):
                fetch_adapter(f"{url}/v/lora_weights.safetensors", tmp_path, wrong)
        assert not [p for p in (tmp_path / "lora").rglob("*") if p.is_file()]
        started = time.monotonic()
        with pytest.raises(AdapterSourceError, match="took more than NANOVLLM_LORA_FETCH_TIMEOUT_S"):
            fetch_adapter(f"{trickle_url}/v/lora_weights.safetensors", tmp_path, limits=FetchLimits(timeout_s=1.0))
        assert time.monotonic() - started < 5
    finally:
        release.set()
        server.shutdown()
        trickle.shutdown()
        trickle.server_close()


def _answer(handler: BaseHTTPRequestHandler, body: bytes, location: str | None = None) -> None:
    if location is not None:
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
        return
    if not handler.path.endswith(".safetensors"):
        handler.send_error(404)
        return
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_slow_adapter_downloads_hold_none_of_the_other_routes(checkpoint_factory, tmp_path):
    """Adapter downloads run on threads of their own: as many slow sources as the event loop's default pool has
    threads (six here) held every voice-store call (/v1/audio/voices, a cached voice) until they ended."""
    import os

    release = threading.Event()
    trickle, url = trickle_server(release, every_s=0.5)
    settings = service_settings(checkpoint_factory("tiny-voxcpm2", stop="never"), tmp_path / "cache", max_loras=1,
                                max_lora_rank=8, lora_url_prefixes=f"{url}/")
    server = LiveServer(settings).start()
    slow = min(32, (os.cpu_count() or 1) + 4)  # the default pool's threads

    def register(i: int) -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{server.url}/loras", json={"lora_name": f"slow{i}",
                                                    "lora_uri": f"{url}/{i}/lora_weights.safetensors"},
                       verify=TLS, timeout=2)

    try:
        threads = [threading.Thread(target=register, args=(i,)) for i in range(slow)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        with httpx.Client(verify=TLS, base_url=server.url, timeout=15) as c:
            assert c.get("/v1/audio/voices").status_code == 200  # the voice store answers meanwhile
    finally:
        release.set()
        trickle.shutdown()
        trickle.server_close()  # the registrations still queued for a download thread are refused at once
        server.stop()


def test_an_adapter_config_larger_than_any_config_is_not_read(adapter, tmp_path):
    """lora_config.json is a few hundred bytes: a 3 GB one was read whole into the engine worker."""
    from engine.io.lora import CONFIG_MAX_BYTES, read_adapter

    copy = tmp_path / "big"
    shutil.copytree(adapter, copy)
    (copy / "lora_config.json").write_bytes(b" " * (CONFIG_MAX_BYTES + 1))
    with pytest.raises(ValueError, match="lora_config.json is .* bytes: more than an adapter's config"):
        read_adapter(copy)


def test_adapter_from_an_s3_compatible_server(adapter, tmp_path, monkeypatch):
    """s3://bucket/key through boto3 against moto's S3 server on loopback (the endpoint from the settings), the
    config fetched from beside the weights; a key that is not there is refused naming it."""
    import boto3
    from moto.server import ThreadedMotoServer

    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)  # moto takes any credentials; boto3 wants some
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="adapters")
        for name in ("lora_weights.safetensors", "lora_config.json"):
            s3.upload_file(str(adapter / name), "adapters", f"voices/step_0000100/{name}")
        digest = sha256_of(adapter / "lora_weights.safetensors")
        settings = service_settings(tmp_path, tmp_path / "cache", lora_merge=True, lora_sha256=digest,
                                    lora_uri="s3://adapters/voices/step_0000100/lora_weights.safetensors",
                                    s3_endpoint_url=endpoint)
        local = Path(adapter_path(settings))
        assert sha256_of(local / "lora_weights.safetensors") == digest
        assert (local / "lora_config.json").read_bytes() == (adapter / "lora_config.json").read_bytes()
        with pytest.raises(AdapterSourceError, match="s3://adapters/voices/nothing/lora_weights.safetensors does not"):
            fetch_adapter("s3://adapters/voices/nothing/lora_weights.safetensors", tmp_path / "c2",
                          endpoints=_endpoints(s3=endpoint))
    finally:
        server.stop()


def _endpoints(s3: str | None = None, hf: str | None = None):
    from service.lora_source import Endpoints

    return Endpoints(s3_endpoint_url=s3, hf_endpoint=hf)


def hub_handler(root: Path, commit: str) -> type[BaseHTTPRequestHandler]:
    """The hub's file API as huggingface_hub calls it: HEAD and GET /{owner}/{repo}/resolve/{revision}/{path} over the
    repositories under `root`, with the commit and ETag headers it requires; a missing file answers 404 with the
    hub's EntryNotFound code."""

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _file(self) -> Path | None:
            parts = self.path.split("?")[0].strip("/").split("/")
            if len(parts) < 5 or parts[2] != "resolve":
                return None
            file = root / parts[0] / parts[1] / "/".join(parts[4:])
            return file if file.is_file() else None

        def _head(self) -> bytes | None:
            file = self._file()
            if file is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Error-Message", "Entry not found")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            body = file.read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return body

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
            self._head()

        def do_GET(self) -> None:  # noqa: N802
            body = self._head()
            if body is not None:
                self.wfile.write(body)

    return Hub


def test_adapter_from_a_hub_compatible_server(adapter, tmp_path):
    """hf://owner/repo@revision?path=step-directory against a hub-compatible server on loopback (the endpoint from the
    settings): the weights and config of that directory; a file path works too; a directory without weights is
    refused naming it."""
    root = tmp_path / "hub"
    step = root / "acme" / "voices" / "step_0000100"
    step.mkdir(parents=True)
    for name in ("lora_weights.safetensors", "lora_config.json"):
        (step / name).write_bytes((adapter / name).read_bytes())
    server, endpoint = serve(hub_handler(root, "a" * 40))
    try:
        digest = sha256_of(adapter / "lora_weights.safetensors")
        settings = service_settings(tmp_path, tmp_path / "cache", lora_merge=True, lora_sha256=digest,
                                    lora_uri="hf://acme/voices@main?path=step_0000100", hf_endpoint=endpoint)
        local = Path(adapter_path(settings))
        assert sha256_of(local / "lora_weights.safetensors") == digest
        assert (local / "lora_config.json").read_bytes() == (adapter / "lora_config.json").read_bytes()
        as_file = fetch_adapter("hf://acme/voices?path=step_0000100/lora_weights.safetensors", tmp_path / "c2",
                                digest, _endpoints(hf=endpoint))
        assert sha256_of(as_file / "lora_weights.safetensors") == digest
        with pytest.raises(AdapterSourceError, match="has no step_0000200/lora_weights.ckpt"):
            fetch_adapter("hf://acme/voices@main?path=step_0000200", tmp_path / "c3", endpoints=_endpoints(hf=endpoint))
    finally:
        server.shutdown()


def test_runtime_adapters_over_http(adapter, file_server, checkpoint_factory, tmp_path):
    """POST /loras (a file inside NANOVLLM_LORA_DIR, or an https:// URL), GET /loras, lora_name on /generate and the
    OpenAI model field, DELETE; every refusal names its field; /loras needs the API key."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    settings = service_settings(ckpt, tmp_path / "cache", max_loras=2, max_lora_rank=8, lora_dir=adapter.parent,
                                api_keys="k1", lora_url_prefixes=f"{file_server}/{adapter.name}/")
    server = LiveServer(settings).start()
    auth = {"Authorization": "Bearer k1"}
    try:
        with httpx.Client(verify=TLS, base_url=server.url, timeout=120, headers=auth) as c:
            assert httpx.get(f"{server.url}/loras", verify=TLS).status_code == 401
            r = c.post("/loras", json={"lora_name": "voice", "lora_uri": f"file://{adapter}"})
            assert r.status_code == 200 and r.json()["name"] == "voice" and r.json()["layers"] > 0, r.text
            url = f"{file_server}/{adapter.name}/lora_weights.safetensors"
            digest = sha256_of(adapter / "lora_weights.safetensors")
            r = c.post("/loras", json={"lora_name": "voice.http", "lora_uri": url, "sha256": digest})
            assert r.status_code == 200, r.text
            assert {d["name"] for d in c.get("/loras").json()["loras"]} == {"voice", "voice.http"}

            adapted = c.post("/generate", json={**BODY, "lora_name": "voice"})
            again = c.post("/generate", json={**BODY, "lora_name": "voice.http"})  # the same weights
            plain = c.post("/generate", json=BODY)
            assert adapted.status_code == again.status_code == plain.status_code == 200
            pcm = {k: np.frombuffer(r.content, np.int16).astype(int) for k, r in
                   (("adapted", adapted), ("again", again), ("plain", plain))}
            # the same weights in another slot: the same audio up to float summation order (an LSB or two)
            assert np.abs(pcm["adapted"] - pcm["again"]).max() <= 4
            assert np.abs(pcm["adapted"] - pcm["plain"]).max() > 100
            speech = c.post("/v1/audio/speech", json={"model": "voice", "input": BODY["target_text"], "seed": 4,
                                                      "max_generate_length": 3, "response_format": "pcm",
                                                      "sample_rate": 48000})  # /generate's (the model's) rate
            assert speech.status_code == 200, speech.text
            assert np.abs(np.frombuffer(speech.content, np.int16).astype(int) - pcm["adapted"]).max() <= 4
            assert "voice" in [m["id"] for m in c.get("/v1/models").json()["data"]]
            info = c.get("/info").json()["lora"]["runtime"]
            assert info["max_loras"] == 2 and {a["name"] for a in info["adapters"]} == {"voice", "voice.http"}
            assert info["merged_steps"] is False  # the CPU's exact mode adds the terms (a GPU's default merges)
            metrics = {(m.name, tuple(sorted(m.labels.items()))): m.value
                       for f in text_string_to_metric_families(c.get("/metrics").text) for m in f.samples}
            assert metric(metrics, "voxcpm_lora_adapters_registered") == 2
            assert metric(metrics, "voxcpm_lora_adapters_resident") == 2  # both used, each in a slot
            assert metric(metrics, "voxcpm_lora_requests") == 0

            outside = tmp_path / "elsewhere"
            outside.mkdir()
            for body, status, message in [
                ({"lora_name": "x", "lora_uri": str(outside)}, 400, "lora_uri: .* is outside NANOVLLM_LORA_DIR"),
                ({"lora_name": "../x", "lora_uri": url}, 422, "lora_name"),
                ({"lora_name": "x", "lora_uri": url, "sha256": "0" * 64}, 400, f"sha256: .* has SHA-256 {digest}"),
                ({"lora_name": "voice", "lora_uri": f"{file_server}/{adapter.name}/missing/lora_weights.safetensors"},
                 400, "lora_uri: .* answered 404"),
                # only from under NANOVLLM_LORA_URL_PREFIXES: the service is no way into the network it sits in
                ({"lora_name": "x", "lora_uri": f"{file_server}/elsewhere/lora_weights.safetensors"}, 400,
                 "lora_uri: .* is not under NANOVLLM_LORA_URL_PREFIXES"),
                # a model's name: /v1 and live sessions would choose the model (it was registered, unreachable there)
                ({"lora_name": "tts-1", "lora_uri": url}, 409, "lora_name: 'tts-1' names this service's model"),
            ]:
                r = c.post("/loras", json=body)
                assert r.status_code == status and re.search(message, r.text), (body, r.status_code, r.text)
            r = c.post("/generate", json={**BODY, "lora_name": "nobody"})
            assert r.status_code == 404 and "lora_name: no adapter named 'nobody'" in r.text, r.text
            r = c.post("/v1/audio/speech", json={"model": "nobody", "input": "Hi."})
            assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text

            # a live session's adapter unregistered after its config: gone for new requests (its name free to register
            # again), but the session leases it and speaks its later segments with it to its end
            ws_url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
            with connect(ws_url, additional_headers=auth, open_timeout=60) as ws:
                ws.send(json.dumps({"type": "session.config", "model": "voice.http", "max_generate_length": 3}))
                ws.send(json.dumps({"type": "input.text", "text": "Hello there. "}))
                ws.send(json.dumps({"type": "flush"}))
                while not isinstance(msg := ws.recv(timeout=60), bytes):  # the first audio: the config was taken
                    assert json.loads(msg)["type"] != "error", msg
                assert c.delete("/loras/voice.http").status_code == 200
                r = c.post("/generate", json={**BODY, "lora_name": "voice.http"})
                assert r.status_code == 404 and "lora_name: no adapter named 'voice.http'" in r.text, r.text
                assert "voice.http" not in {d["name"] for d in c.get("/loras").json()["loras"]}
                r = c.post("/loras", json={"lora_name": "voice.http", "lora_uri": url, "sha256": digest})
                assert r.status_code == 200, r.text  # the name is free: registered again, another adapter
                ws.send(json.dumps({"type": "input.text", "text": "And more. "}))
                ws.send(json.dumps({"type": "input.done"}))
                received = []
                with pytest.raises(ConnectionClosedOK):
                    while True:
                        received.append(ws.recv(timeout=60))
                events = [json.loads(m) for m in received if isinstance(m, str)]
                kinds = [e["type"] for e in events]
                assert "error" not in kinds and kinds.count("audio.done") == 2, events  # both segments spoken
                assert kinds[-1] == "session.done" and events[-1]["segments"] == 2
                assert any(isinstance(m, bytes) for m in received)
            assert server.state.pool.client.lora_leases == {}  # the lease ended with the session
            assert c.delete("/loras/voice").json() == {"deleted": "voice"}
            r = c.post("/generate", json={**BODY, "lora_name": "voice"})
            assert r.status_code == 404 and "lora_name: no adapter named 'voice'" in r.text
            assert c.delete("/loras/voice").status_code == 404
    finally:
        server.stop()


def test_runtime_adapters_survive_a_restart_of_the_service(adapter, checkpoint_factory, tmp_path):
    """Registrations are kept beside the voice cache: the service started again on the same cache dir (new workers,
    a new API process) serves the adapter registered before, with the same audio; one unregistered stays gone."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    settings = service_settings(ckpt, tmp_path / "cache", max_loras=2, max_lora_rank=8, lora_dir=adapter.parent)

    def served(calls: Callable[[httpx.Client], bytes]) -> bytes:
        server = LiveServer(settings).start()
        try:
            with httpx.Client(verify=TLS, base_url=server.url, timeout=120) as c:
                return calls(c)
        finally:
            server.stop()

    def register(c: httpx.Client) -> bytes:
        for name in ("voice", "gone"):
            r = c.post("/loras", json={"lora_name": name, "lora_uri": f"file://{adapter}"})
            assert r.status_code == 200, r.text
        assert c.delete("/loras/gone").status_code == 200
        r = c.post("/generate", json={**BODY, "lora_name": "voice"})
        assert r.status_code == 200, r.text
        return r.content

    def after_restart(c: httpx.Client) -> bytes:
        assert [d["name"] for d in c.get("/loras").json()["loras"]] == ["voice"]
        r = c.post("/generate", json={**BODY, "lora_name": "gone"})
        assert r.status_code == 404 and "no adapter named 'gone'" in r.text
        r = c.post("/generate", json={**BODY, "lora_name": "voice"})
        assert r.status_code == 200, r.text
        plain = c.post("/generate", json=BODY)  # naming no adapter: the base model
        assert plain.status_code == 200 and plain.content != r.content  # the adapter changes the audio
        return r.content

    before = served(register)
    assert served(after_restart) == before


def test_loras_refused_without_runtime_slots(adapter, plain_server):
    with httpx.Client(verify=TLS, base_url=plain_server.url, timeout=120) as c:
        r = c.post("/loras", json={"lora_name": "voice", "lora_uri": str(adapter)})
        assert r.status_code == 400 and "NANOVLLM_MAX_LORAS=0" in r.text
        r = c.post("/generate", json={**BODY, "lora_name": "voice"})
        assert r.status_code == 400 and "lora_name: this engine serves no runtime LoRA adapters" in r.text


def test_the_seeds_adapter_variables_alone_serve_it_merged(adapter, checkpoint_factory, tmp_path, merged_audio):
    """Exactly the seed's adapter configuration (NANOVLLM_LORA_URI, NANOVLLM_LORA_ID, NANOVLLM_LORA_SHA256; nothing
    else about adapters) starts `voxcpm-serve` and serves the adapter, merged, to every request: the audio is the
    merged adapter's, bit for bit."""
    from tests.supervised import Service

    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    digest = sha256_of(adapter / "lora_weights.safetensors")
    service = Service(ckpt, tmp_path, api_processes=1, lora_uri=str(adapter), lora_id="house",
                      lora_sha256=digest)
    try:
        service.wait_all_ready()
        r, _ = service.ask("POST", "/generate", json=BODY)
        assert r.status_code == 200, r.text
        info = service.ask("GET", "/info")[0].json()["lora"]
        assert info["enabled"] and info["merged"] and info["merged_layers"] > 0 and info["id"] == "house"
        assert info["sha256"] == digest
    finally:
        service.stop()
    assert r.content == merged_audio


def test_start_up_adapter_served_at_run_time(adapter, checkpoint_factory, tmp_path, plain_audio):
    """NANOVLLM_LORA_URI with NANOVLLM_LORA_MERGE=false: the start-up adapter is the runtime adapter NANOVLLM_LORA_ID
    of every request that names none (the same audio as naming it), listed by /loras, not removable; the base model's
    audio differs."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    server = LiveServer(service_settings(ckpt, tmp_path / "a", lora_uri=str(adapter), lora_id="house",
                                         lora_merge=False, max_loras=2, max_lora_rank=8)).start()
    try:
        with httpx.Client(verify=TLS, base_url=server.url, timeout=120) as c:
            default = c.post("/generate", json=BODY)
            named = c.post("/generate", json={**BODY, "lora_name": "house"})
            assert default.status_code == named.status_code == 200 and default.content == named.content
            assert [d["name"] for d in c.get("/loras").json()["loras"]] == ["house"]
            info = c.get("/info").json()["lora"]
            assert info["enabled"] and not info["merged"] and info["merged_layers"] == 0
            r = c.delete("/loras/house")
            assert r.status_code == 400 and "lora_name: 'house' is the start-up adapter" in r.text
    finally:
        server.stop()
    assert plain_audio != default.content


def test_lora_registrations_are_shared_by_processes(tmp_path):
    """Two API processes' views of the registrations file: what one adds the other replays, a name removed by both
    at once is removed once, and the file keeps them for the next start."""
    from service.lora_registry import LoRARegistrations

    first, second = (LoRARegistrations(tmp_path / "loras.db") for _ in range(2))
    first["voice"] = "/cache/lora/a"
    second["other"] = "/cache/lora/b"
    first["voice"] = "/cache/lora/c"  # registered again: the new path, the same name
    assert dict(second.items()) == {"other": "/cache/lora/b", "voice": "/cache/lora/c"}
    assert first.pop("other", None) == "/cache/lora/b" and second.pop("other", None) is None
    with pytest.raises(KeyError):
        del second["other"]
    first.close()
    second.close()
    assert dict(LoRARegistrations(tmp_path / "loras.db").items()) == {"voice": "/cache/lora/c"}


def test_a_removal_during_a_registration_leaves_nothing_registered(adapter, checkpoint_factory, tmp_path):
    """POST /loras and DELETE of its name at once, many times: whichever comes first, the workers and the
    registrations agree at the end (a removal between a registration's two steps took the adapter from the workers
    and left it in the registrations, where a restarted worker was given it again)."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    settings = service_settings(ckpt, tmp_path / "cache", max_loras=2, max_lora_rank=8, lora_dir=adapter.parent)
    server = LiveServer(settings).start()
    try:
        async def race(client: httpx.AsyncClient, name: str) -> tuple[int, int]:
            posted, deleted = await asyncio.gather(
                client.post("/loras", json={"lora_name": name, "lora_uri": f"file://{adapter}"}),
                client.delete(f"/loras/{name}"))
            return posted.status_code, deleted.status_code

        async def rounds() -> list[tuple[int, int]]:
            async with httpx.AsyncClient(verify=TLS, base_url=server.url, timeout=120) as client:
                return [await race(client, f"race{i}") for i in range(20)]

        statuses = asyncio.run(rounds())
        assert all(posted == 200 and deleted in (200, 404) for posted, deleted in statuses), statuses
        with httpx.Client(verify=TLS, base_url=server.url, timeout=120) as c:
            held = {d["name"] for d in c.get("/loras").json()["loras"]}
        assert held == set(server.state.pool.client.loras), statuses
        assert held == {f"race{i}" for i, (_, deleted) in enumerate(statuses) if deleted == 404}
    finally:
        server.stop()


def test_one_registration_change_at_a_time_over_processes(tmp_path):
    """The registrations' lock is one for every process's view of the file: a second waits for the first."""
    from service.lora_registry import LoRARegistrations

    first, second = (LoRARegistrations(tmp_path / "loras.db") for _ in range(2))

    async def scenario() -> list[str]:
        order: list[str] = []

        async def change(view: LoRARegistrations, name: str) -> None:
            async with view.changing():
                order.append(f"{name} in")
                await asyncio.sleep(0.2)
                order.append(f"{name} out")

        await asyncio.gather(change(first, "a"), change(second, "b"))
        return order

    order = asyncio.run(scenario())
    assert order in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"]), order
    first.close()
    second.close()
