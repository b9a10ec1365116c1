"""The start-up LoRA adapter through the service: fetched from a real HTTP server into the cache dir, its SHA-256
checked, merged into every worker's weights; the audio changes with it, and a path to the same adapter gives the
same audio. A digest that does not match, an unsupported scheme or an adapter without merging stop start-up."""

from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from engine.io.checkpoint import load_model
from engine.io.lora import LoRAConfig, random_adapter, sha256_of
from service.lora_source import AdapterSourceError, fetch_adapter
from tests.service_harness import LiveServer, service_settings

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
        with httpx.Client(base_url=server.url, timeout=120) as c:
            r = c.post("/generate", json=BODY)
            assert r.status_code == 200, r.text
            return r.content, c.get("/info").json()["lora"]
    finally:
        server.stop()


def test_adapter_from_https_is_merged_and_changes_the_audio(adapter, file_server, checkpoint_factory, tmp_path):
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    digest = sha256_of(adapter / "lora_weights.safetensors")
    url = f"{file_server}/{adapter.name}/lora_weights.safetensors"
    adapted, info = generate(ckpt, tmp_path / "a", lora_uri=url, lora_sha256=digest, lora_merge=True, lora_id="voice")
    assert info["enabled"] and info["merged_layers"] > 0 and info["id"] == "voice" and info["sha256"] == digest
    cached = list((tmp_path / "a" / "lora").glob("*/lora_weights.safetensors"))
    assert len(cached) == 1 and (cached[0].parent / "lora_config.json").is_file()  # the config came along
    plain, info = generate(ckpt, tmp_path / "b")
    assert not info["enabled"] and plain != adapted
    by_path, _ = generate(ckpt, tmp_path / "c", lora_uri=f"file://{adapter}", lora_merge=True)
    assert by_path == adapted


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
    ({"lora_uri": "s3://bucket/adapter/lora_weights.safetensors", "lora_merge": True}, "s3:// is not supported"),
    ({"lora_uri": "/adapters/voice"}, "set NANOVLLM_LORA_MERGE=true"),
    ({"lora_uri": "/adapters/voice", "lora_merge": True, "lora_sha256": "abc"}, "64 hexadecimal digits"),
])
def test_bad_adapter_settings_are_refused(fields, message, tmp_path):
    with pytest.raises(ValidationError, match=message):
        service_settings(tmp_path, tmp_path, **fields)
