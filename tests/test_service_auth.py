"""API keys and CORS over real HTTP (issue 25, security): with keys set every route but /health, /ready and
/metrics needs one (Bearer or X-API-Key, from the variable or the file), a wrong or missing one is 401; /metrics can be
protected too; CORS headers only for the configured origins."""

from __future__ import annotations

import httpx
import pytest

from tests.service_harness import live_server


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc-auth")
    keys_file = tmp / "keys"
    keys_file.write_text("# rotated monthly\nk-from-file\n")
    with live_server(checkpoint_factory, tmp, api_keys="k1, k2", api_keys_file=keys_file, protect_metrics=True,
                     cors_origins="https://app.example") as s:
        yield s


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/generate", {"target_text": "Keyed.", "max_generate_length": 1, "response_format": "pcm"}),
    ("POST", "/v1/audio/speech", {"model": "tts-1", "input": "Keyed.", "max_generate_length": 1,
                                  "response_format": "pcm"}),
    ("GET", "/prompts", None), ("GET", "/loras", None), ("GET", "/v1/models", None), ("GET", "/info", None),
    ("GET", "/metrics", None)])
def test_keyed_routes(server, method, path, body):
    def call(headers: dict) -> httpx.Response:
        return httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}, {"X-API-Key": "k3"}):
        r = call(headers)
        assert r.status_code == 401, (headers, r.status_code)
        message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["detail"]
        assert r.headers["www-authenticate"] == "Bearer" and "API key" in message
    for headers in ({"Authorization": "Bearer k1"}, {"authorization": "bearer k2"}, {"X-API-Key": "k-from-file"}):
        assert call(headers).status_code == 200, headers


def test_probes_stay_open(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200


def test_cors_only_for_the_configured_origin(server):
    ok = httpx.options(server.url + "/generate", headers={"Origin": "https://app.example",
                                                          "Access-Control-Request-Method": "POST"})
    assert ok.headers.get("access-control-allow-origin") == "https://app.example"
    other = httpx.options(server.url + "/generate", headers={"Origin": "https://evil.example",
                                                             "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
