"""API keys and CORS over real HTTP: with keys set every route but /health, /ready and
/metrics needs one (Bearer or X-API-Key, from the variable or the file), a wrong or missing one is 401; /metrics can be
protected too; CORS headers only for the configured origins."""

from __future__ import annotations

import httpx
import pytest

from tests.service_harness import TLS, live_server


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc-auth")
    keys_file = tmp / "keys"
    keys_file.write_text("# rotated monthly\nk-from-file\n")
    with live_server(checkpoint_factory, tmp, api_keys="k1, k2", api_keys_file=keys_file, protect_metrics=True,
                     cors_origins="https://app.example", max_request_bytes=4096, admin_api_keys="admin1") as s:
        yield s


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/generate", {"target_text": "Keyed.", "max_generate_length": 1, "response_format": "pcm"}),
    ("POST", "/v1/audio/speech", {"model": "tts-1", "input": "Keyed.", "max_generate_length": 1,
                                  "response_format": "pcm"}),
    ("GET", "/prompts", None), ("GET", "/loras", None), ("GET", "/v1/models", None), ("GET", "/info", None),
    ("GET", "/metrics", None)])
def test_keyed_routes(server, method, path, body):
    def call(headers: dict) -> httpx.Response:
        return httpx.request(method, server.url + path, json=body, headers=headers, timeout=60, verify=TLS)

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}, {"X-API-Key": "k3"}):
        r = call(headers)
        assert r.status_code == 401, (headers, r.status_code)
        message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["detail"]
        assert r.headers["www-authenticate"] == "Bearer" and "API key" in message
    for headers in ({"Authorization": "Bearer k1"}, {"authorization": "bearer k2"}, {"X-API-Key": "k-from-file"}):
        assert call(headers).status_code == 200, headers


def test_only_an_admin_key_changes_the_adapters(server):
    """With NANOVLLM_ADMIN_API_KEYS, registering and removing adapters (which change what every client is served, and
    fetch files) needs one of them: 403 with another valid key (any key could); an admin key is an API key too."""
    body = {"lora_name": "voice", "lora_uri": "https://adapters.example/voice/lora_weights.safetensors"}
    for key, expected in (("k1", 403), ("k-from-file", 403), ("admin1", 400)):  # 400: this service runs no slots
        headers = {"Authorization": f"Bearer {key}"}
        posted = httpx.post(server.url + "/loras", json=body, headers=headers, timeout=60, verify=TLS)
        deleted = httpx.delete(server.url + "/loras/voice", headers=headers, timeout=60, verify=TLS)
        assert posted.status_code == expected, (key, posted.text)
        assert (deleted.status_code == 403) == (expected == 403), (key, deleted.text)
        if expected == 403:
            assert "NANOVLLM_ADMIN_API_KEYS" in posted.json()["detail"], posted.text
    assert httpx.get(server.url + "/loras", headers={"X-API-Key": "admin1"}, verify=TLS).status_code == 200


@pytest.mark.parametrize("path", ["/generate", "/v1/audio/speech", "/add_prompt"])
def test_a_keyed_route_refuses_before_reading_the_body(server, path):
    """No key: 401 whatever the body (broken JSON, a form, none), not the body's 422: the body is never parsed for an
    anonymous client."""
    for kwargs in ({"content": b'{"input":', "headers": {"content-type": "application/json"}},
                   {"data": {"input": "Hi."}}, {}):
        r = httpx.post(server.url + path, verify=TLS, timeout=60, **kwargs)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (kwargs, r.text)
        message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["detail"]
        assert message.startswith("authorization: a valid API key is required")


def test_probes_stay_open(server):
    assert httpx.get(server.url + "/health", verify=TLS).status_code == 200
    assert httpx.get(server.url + "/ready", verify=TLS).status_code == 200


def test_cors_only_for_the_configured_origin(server):
    ok = httpx.options(server.url + "/generate", headers={"Origin": "https://app.example",
                                                          "Access-Control-Request-Method": "POST"})
    assert ok.headers.get("access-control-allow-origin") == "https://app.example"
    other = httpx.options(server.url + "/generate", headers={"Origin": "https://evil.example",
                                                             "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    # a body over the limit: its 413 carries the CORS headers too (a browser saw a network error, not the 413)
    big = httpx.post(server.url + "/generate", content=b"x" * 5000, verify=TLS,
                     headers={"Origin": "https://app.example", "content-type": "application/json",
                              "Authorization": "Bearer k1"})
    assert big.status_code == 413 and big.headers.get("access-control-allow-origin") == "https://app.example"
    exposed = ok.headers.get("access-control-expose-headers", "") or httpx.get(
        server.url + "/health", headers={"Origin": "https://app.example"}).headers["access-control-expose-headers"]
    assert {"X-Segment-Timings", "Retry-After"} <= {h.strip() for h in exposed.split(",")}


@pytest.mark.parametrize("value, file_text, message", [
    (" , ", None, "NANOVLLM_API_KEYS: Value error, holds no key (only commas and spaces)"),
    (None, "# rotated monthly\n\n", "NANOVLLM_API_KEYS_FILE: Value error, "),
])
def test_key_settings_that_hold_no_key_are_refused(tmp_path, value, file_text, message):
    """NANOVLLM_API_KEYS set to commas, or a keys file of comments (a secret mount that did not fill): refused at
    start-up naming the setting (the service ran with every route open and said nothing)."""
    from pydantic import ValidationError

    from service.settings import Settings, describe_error
    keys_file = None
    if file_text is not None:
        keys_file = tmp_path / "keys"
        keys_file.write_text(file_text)
    with pytest.raises(ValidationError) as refused:
        Settings(api_keys=value, api_keys_file=keys_file)
    said = describe_error(refused.value)
    assert message in said and ("every route would be open" in said or "unset" in said), said
    assert Settings(api_keys="").api_key_list() == []  # empty: no keys, as unset


def test_keyed_websocket(server):
    """/v1/audio/speech/stream: no key or a wrong one is an error and close 1008; a key in the headers or, for
    browsers (which cannot set headers on a WebSocket), as the subprotocol bearer.<key> opens the session."""
    import contextlib
    import json

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    session = [{"type": "session.config", "max_generate_length": 1}, {"type": "input.text", "text": "Keyed."},
               {"type": "input.done"}]

    def run(**kwargs) -> tuple[list[str], int, str | None]:
        with connect(url, open_timeout=60, **kwargs) as ws:
            with contextlib.suppress(ConnectionClosed):  # a refused session may be closed before all is sent
                for m in session:
                    ws.send(json.dumps(m))
            types = []
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    msg = ws.recv(timeout=60)
                    if isinstance(msg, str):
                        types.append(json.loads(msg)["type"] + ":" + json.loads(msg).get("message", ""))
            return types, closed.value.rcvd.code, ws.subprotocol

    for kwargs in ({}, {"additional_headers": {"Authorization": "Bearer wrong"}},
                   {"subprotocols": ["voxcpm", "bearer.k3"]}):
        types, code, _ = run(**kwargs)
        assert code == 1008 and types == ["error:authorization: a valid API key is required (Authorization: Bearer "
                                          "<key>, or the subprotocol bearer.<key>)"], (kwargs, types)
    for kwargs in ({"additional_headers": {"Authorization": "Bearer k1"}}, {"additional_headers": {"X-API-Key": "k2"}},
                   {"subprotocols": ["voxcpm", "bearer.k-from-file"]}, {"subprotocols": ["bearer.k1"]}):
        types, code, protocol = run(**kwargs)
        assert code == 1000 and types[-1] == "session.done:", (kwargs, types)
        # "voxcpm" where offered; never the key (the answer echoed a lone bearer.<key> in the handshake)
        assert protocol == ("voxcpm" if "voxcpm" in kwargs.get("subprotocols", []) else None), (kwargs, protocol)
