"""The start-up LoRA adapter (NANOVLLM_LORA_URI): a local path (`file://` or plain) used where it is, or an `https://`
URL of its weights file downloaded into the cache dir (atomically: a partial download never passes for the file; a
second start finds it there), checked against NANOVLLM_LORA_SHA256 when that is set."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from engine.io.lora import CONFIG_FILE, sha256_of, weights_file

log = logging.getLogger(__name__)
SCHEMES = ("file", "https", "http")  # http: for a server inside the cluster (and the tests); settings check it too
DOWNLOAD_TIMEOUT = httpx.Timeout(30.0, read=300.0)


class AdapterSourceError(ValueError):
    """The adapter cannot be fetched or is not the one expected; the message says which and why."""


def _download(url: str, target: Path) -> None:
    """`url` to `target` through a temporary file renamed into place once complete."""
    part = target.with_name(target.name + ".part")
    try:
        with httpx.stream("GET", url, timeout=DOWNLOAD_TIMEOUT, follow_redirects=True) as r:
            if r.status_code != 200:
                raise AdapterSourceError(f"NANOVLLM_LORA_URI: {url} answered {r.status_code}")
            with open(part, "wb") as f:
                for chunk in r.iter_bytes(1 << 20):
                    f.write(chunk)
        os.replace(part, target)
    except httpx.HTTPError as e:
        raise AdapterSourceError(f"NANOVLLM_LORA_URI: could not download {url}: {e}") from e
    finally:
        part.unlink(missing_ok=True)


def uri_scheme(uri: str) -> str:
    return urlparse(uri).scheme or "file"


def unsupported_scheme(scheme: str) -> str:
    return f"NANOVLLM_LORA_URI: {scheme}:// is not supported (use file://, a path or https://)"


def fetch_adapter(uri: str, cache_dir: Path, sha256: str | None = None) -> Path:
    """A local path to the adapter `uri` names (its directory or weights file), its weights' SHA-256 checked."""
    parsed = urlparse(uri)
    scheme = uri_scheme(uri)
    if scheme not in SCHEMES:
        raise AdapterSourceError(unsupported_scheme(scheme))
    if scheme == "file":
        local = Path(unquote(parsed.path) if parsed.scheme else uri).expanduser()
        try:
            file = weights_file(local)
        except ValueError as e:
            raise AdapterSourceError(f"NANOVLLM_LORA_URI: {e}") from e
    else:
        name = Path(unquote(parsed.path)).name
        if not name.endswith((".safetensors", ".ckpt", ".pth")):
            raise AdapterSourceError(f"NANOVLLM_LORA_URI: {uri} should name the adapter's weights file "
                                     "(lora_weights.safetensors or .ckpt); its lora_config.json is fetched beside it")
        local = cache_dir / "lora" / hashlib.sha256(uri.encode()).hexdigest()[:16]
        local.mkdir(parents=True, exist_ok=True)
        file = local / name
        if file.exists() and sha256:
            if sha256_of(file) == sha256.lower():
                return local  # the cached copy, already checked
            file.unlink()  # a stale or damaged copy: fetch it again
        if not file.exists():
            log.info("downloading the LoRA adapter %s", uri)
            _download(uri, file)
            config_url = uri.rsplit("/", 1)[0] + "/" + CONFIG_FILE
            try:
                _download(config_url, local / CONFIG_FILE)
            except AdapterSourceError as e:  # the official loader's default config then applies
                log.warning("no %s beside the adapter (%s)", CONFIG_FILE, e)
    if sha256:
        got = sha256_of(file)
        if got != sha256.lower():
            raise AdapterSourceError(f"NANOVLLM_LORA_SHA256: {file} has SHA-256 {got}, expected {sha256.lower()}")
    return local if local.is_dir() else file
