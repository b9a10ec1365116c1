"""The start-up LoRA adapter (NANOVLLM_LORA_URI), as a local path for the engine:

- a path or `file://`: its directory or weights file, used where it is;
- `https://` (or `http://`, for a server inside the cluster): the URL of its weights file;
- `s3://bucket/key`: the key of its weights file in an S3-compatible store (boto3's credential chain;
  NANOVLLM_S3_ENDPOINT_URL for MinIO, Ceph and the like);
- `hf://owner/repo@revision?path=dir/or/file`: a file or step directory of a hub repository (NANOVLLM_HF_ENDPOINT for
  a mirror or a private hub; the revision defaults to main).

Downloads land in the cache dir under a name derived from the URI and the expected digest, atomically (a partial
download never passes for the file; a second start finds it there), with lora_config.json fetched from beside the
weights when there is one.
The weights are checked against NANOVLLM_LORA_SHA256 when that is set: a cached copy that does not match is fetched
again, and a download that does not match stops start-up, naming both digests.

An API caller's URI (POST /loras, a registration shared through Redis) is fetched within `FetchLimits`: an http(s)
URL only under NANOVLLM_LORA_URL_PREFIXES (redirects too: the service must not be a way into the network it sits in),
at most NANOVLLM_LORA_MAX_BYTES within NANOVLLM_LORA_FETCH_TIMEOUT_S, on threads of its own (`fetch_in_background`)."""

from __future__ import annotations

import asyncio
import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urljoin, urlparse

import httpx

from engine.io.lora import CONFIG_FILE, CONFIG_MAX_BYTES, WEIGHT_FILES, sha256_of, weights_file

log = logging.getLogger(__name__)
SCHEMES = ("file", "https", "http", "s3", "hf")
MAX_REDIRECTS = 5
# downloads wait on one another here, never on the threads the event loop lends its other blocking calls (the voice
# store's, /info's): six slow adapter servers held all of those
_FETCHES = ThreadPoolExecutor(2, thread_name_prefix="voxcpm-adapter-fetch")
# other replicas' registrations, downloaded in the background: their slow sources never hold a caller's fetch
_BACKGROUND_FETCHES = ThreadPoolExecutor(2, thread_name_prefix="voxcpm-adapter-sync")


class AdapterSourceError(ValueError):
    """The adapter cannot be fetched or is not the one expected: `detail` says which and why, about the adapter's
    URI (`field` "uri") or its digest ("sha256"); str() names them as the start-up settings do, `for_fields` as
    another caller names them (POST /loras: lora_uri, sha256)."""

    SETTINGS = {"uri": "NANOVLLM_LORA_URI", "sha256": "NANOVLLM_LORA_SHA256"}

    def __init__(self, detail: str, field: str = "uri") -> None:
        super().__init__(detail)
        self.detail, self.field = detail, field

    def for_fields(self, names: dict[str, str]) -> str:
        return f"{names[self.field]}: {self.detail}"

    def __str__(self) -> str:
        return self.for_fields(self.SETTINGS)


class NotThere(AdapterSourceError):
    """The source answered that the file does not exist (lora_config.json is optional)."""


@dataclass(frozen=True)
class Endpoints:
    """Where the non-HTTP schemes are served from (None: the library's default)."""

    s3_endpoint_url: str | None = None
    hf_endpoint: str | None = None
    hf_token: str | None = None


@dataclass(frozen=True)
class FetchLimits:
    """What a download may be: from under one of `url_prefixes` when it is an http(s) URL (None: anywhere, the
    operator's own start-up adapter), at most `max_bytes` a file, done within `timeout_s`."""

    url_prefixes: tuple[str, ...] | None = None
    max_bytes: int = 2**30
    timeout_s: float = 600.0

    def refusal(self, url: str) -> str | None:
        """Why an http(s) URL may not be fetched (None: it may)."""
        if self.url_prefixes is None:
            return None
        path = urlparse(url).path
        if any(seg in (".", "..") for seg in unquote(path).split("/")) or re.search(r"%2f|%5c|\\", path, re.I):
            # what the check reads must be what is fetched: a client resolves "/adapters/../internal" first
            return f"{url} holds a dot segment or an encoded slash"
        if any(_under(url, prefix) for prefix in self.url_prefixes):
            return None
        if not self.url_prefixes:
            return "http(s) adapters are not accepted here (NANOVLLM_LORA_URL_PREFIXES is unset); give s3:// or hf://"
        return f"{url} is not under NANOVLLM_LORA_URL_PREFIXES"


def _under(url: str, prefix: str) -> bool:
    """`url` is `prefix` or below it: the same scheme and host (a look-alike host such as prefix.host.example is
    another), its path the prefix's or under it."""
    u, p = urlparse(url), urlparse(prefix)
    if (u.scheme.lower(), u.netloc.lower()) != (p.scheme.lower(), p.netloc.lower()) or u.username or u.password:
        return False
    base = p.path if p.path.endswith("/") else p.path + "/"
    return u.path == p.path or u.path.startswith(base)


def uri_scheme(uri: str) -> str:
    return urlparse(uri).scheme or "file"


def local_refusal(lora_dir: Path | None, uri: str) -> str | None:
    """Why a local adapter (a path or file://) may not be read (None: it may, or the URI is not local): only from
    inside NANOVLLM_LORA_DIR, so that no API caller, nor another replica's registration, makes the service read any
    file."""
    if uri_scheme(uri) != "file":
        return None
    parsed = urlparse(uri)
    path = Path(unquote(parsed.path) if parsed.scheme else uri).expanduser()
    if lora_dir is None:
        return ("local adapters are not accepted here (NANOVLLM_LORA_DIR is unset); give an https://, s3:// or "
                "hf:// URI")
    if not path.resolve().is_relative_to(Path(lora_dir).expanduser().resolve()):
        return f"{path} is outside NANOVLLM_LORA_DIR"
    return None


def unsupported_scheme(scheme: str) -> str:
    """Why a URI of this scheme cannot be fetched (without the field's name)."""
    return f"{scheme}:// is not supported (use a path, file://, https://, s3:// or hf://)"


def _atomic(target: Path, write: Callable[[Path], None]) -> None:
    """`write(part)` into a temporary file beside `target`, renamed into place once complete. The file is this
    writer's own: API processes fetching one adapter at once each wrote into one shared ".part" file."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    part = Path(name)
    try:
        write(part)
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)


def _http_get(url: str, target: Path, limits: FetchLimits, max_bytes: int) -> None:
    """GET `url` into `target`: redirects followed only where `limits` allow, at most `max_bytes`, within the time."""
    deadline = time.monotonic() + limits.timeout_s

    def write(part: Path) -> None:
        here = url
        try:
            timeout = httpx.Timeout(30.0, read=min(60.0, limits.timeout_s))
            with httpx.Client(timeout=timeout, follow_redirects=False) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    with client.stream("GET", here) as r:
                        if r.is_redirect and "location" in r.headers:
                            here = urljoin(here, r.headers["location"])
                            refusal = limits.refusal(here)
                            if refusal is not None:
                                raise AdapterSourceError(f"{url} redirects to {here!r}: {refusal}")
                            continue
                        if r.status_code == 404:
                            raise NotThere(f"{url} answered 404")
                        if r.status_code != 200:
                            raise AdapterSourceError(f"{url} answered {r.status_code}")
                        _copy_within(r, part, url, max_bytes, deadline, limits.timeout_s)
                        return
                raise AdapterSourceError(f"{url} redirects more than {MAX_REDIRECTS} times")
        except httpx.HTTPError as e:
            raise AdapterSourceError(f"could not download {url}: {e}") from e

    _atomic(target, write)


def _copy_within(r: httpx.Response, part: Path, url: str, max_bytes: int, deadline: float, timeout_s: float) -> None:
    """The response's body into `part`, refused past `max_bytes` (declared or sent) or past the deadline."""
    declared = int(r.headers.get("content-length") or 0)
    if declared > max_bytes:
        raise AdapterSourceError(f"{url} is {declared} bytes, more than NANOVLLM_LORA_MAX_BYTES ({max_bytes})")
    written = 0
    with open(part, "wb") as f:
        for chunk in r.iter_bytes():  # as each read arrives: the deadline is checked at least every read timeout
            written += len(chunk)
            if written > max_bytes:
                raise AdapterSourceError(f"{url} is more than NANOVLLM_LORA_MAX_BYTES ({max_bytes} bytes)")
            if time.monotonic() > deadline:
                raise AdapterSourceError(f"{url} took more than NANOVLLM_LORA_FETCH_TIMEOUT_S ({timeout_s:g} s)")
            f.write(chunk)


def _s3_get(bucket: str, key: str, target: Path, endpoints: Endpoints, max_bytes: int) -> None:
    import boto3
    import botocore.exceptions

    client = boto3.client("s3", endpoint_url=endpoints.s3_endpoint_url)

    def write(part: Path) -> None:
        try:
            client.download_file(bucket, key, str(part))
        except botocore.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchKey", "NotFound"):
                raise NotThere(f"s3://{bucket}/{key} does not exist") from e
            raise AdapterSourceError(f"could not download s3://{bucket}/{key}: {e}") from e
        except botocore.exceptions.BotoCoreError as e:  # no credentials, endpoint unreachable, ...
            raise AdapterSourceError(f"could not download s3://{bucket}/{key}: {e}") from e
        _refuse_larger(part, f"s3://{bucket}/{key}", max_bytes)

    _atomic(target, write)


def _refuse_larger(file: Path, name: str, max_bytes: int) -> None:
    if file.stat().st_size > max_bytes:
        raise AdapterSourceError(f"{name} is {file.stat().st_size} bytes, more than NANOVLLM_LORA_MAX_BYTES "
                                 f"({max_bytes})")


def _hf_get(repo: str, revision: str, filename: str, target: Path, endpoints: Endpoints, max_bytes: int) -> None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    def write(part: Path) -> None:
        try:
            # The hub library's own cache (beside ours) resumes an interrupted download.
            got = hf_hub_download(repo, filename, revision=revision, endpoint=endpoints.hf_endpoint,
                                  token=endpoints.hf_token, cache_dir=target.parent / "hub")
        except EntryNotFoundError as e:
            raise NotThere(f"hf://{repo}@{revision} has no {filename}") from e
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
            raise AdapterSourceError(f"could not download {filename} of hf://{repo}@{revision}: "
                                     f"{type(e).__name__}: {e}") from e
        _refuse_larger(Path(got), f"{filename} of hf://{repo}@{revision}", max_bytes)
        shutil.copyfile(got, part)

    _atomic(target, write)


def _remote(uri: str, endpoints: Endpoints, limits: FetchLimits) -> tuple[list[str], Callable[[str, Path, int], None]]:
    """For a remote URI: the weights file names to try (in order) and a fetch(name, target, max_bytes) of a file
    beside them."""
    parsed = urlparse(uri)
    scheme = parsed.scheme
    if scheme in ("http", "https", "s3"):
        path = unquote(parsed.path)
        name = Path(path).name
        if not name.endswith((".safetensors", ".ckpt", ".pth")):
            raise AdapterSourceError(f"{uri} should name the adapter's weights file "
                                     "(lora_weights.safetensors or .ckpt); its lora_config.json is fetched beside it")
        base = path.rsplit("/", 1)[0]
        if scheme == "s3":
            if not parsed.netloc or not path.strip("/"):
                raise AdapterSourceError(f"{uri} is not s3://bucket/key")
            return [name], lambda n, t, most: _s3_get(parsed.netloc, f"{base}/{n}".lstrip("/"), t, endpoints, most)
        refusal = limits.refusal(uri)
        if refusal is not None:
            raise AdapterSourceError(refusal)
        root = f"{parsed.scheme}://{parsed.netloc}{base}"
        return [name], lambda n, t, most: _http_get(f"{root}/{n}", t, limits, most)
    # hf://owner/repo@revision?path=dir-or-file
    repo, _, revision = (parsed.netloc + parsed.path).partition("@")
    revision = revision or "main"
    inner = parse_qs(parsed.query).get("path", [""])[0].strip("/")
    if repo.count("/") != 1 or not all(repo.split("/")) or ".." in (*repo.split("/"), *inner.split("/")):
        raise AdapterSourceError(f"{uri} is not hf://owner/repo[@revision][?path=...] (without '..')")
    if inner.endswith((".safetensors", ".ckpt", ".pth")):
        names, base = [Path(inner).name], inner.rsplit("/", 1)[0] if "/" in inner else ""
    else:
        names, base = list(WEIGHT_FILES), inner
    return names, lambda n, t, most: _hf_get(repo, revision, f"{base}/{n}".lstrip("/"), t, endpoints, most)


async def fetch_in_background(uri: str, cache_dir: Path, sha256: str | None, endpoints: Endpoints,
                              limits: FetchLimits, background: bool = False) -> Path:
    """`fetch_adapter` on the downloads' own threads (`background`: those of other replicas' registrations)."""
    call = functools.partial(fetch_adapter, uri, cache_dir, sha256, endpoints, limits)
    return await asyncio.get_running_loop().run_in_executor(_BACKGROUND_FETCHES if background else _FETCHES, call)


def fetch_adapter(uri: str, cache_dir: Path, sha256: str | None = None, endpoints: Endpoints | None = None,
                  limits: FetchLimits | None = None) -> Path:
    """A local path to the adapter `uri` names (its directory or weights file), its weights' SHA-256 checked."""
    endpoints, limits = endpoints or Endpoints(), limits or FetchLimits()
    scheme = uri_scheme(uri)
    if scheme not in SCHEMES:
        raise AdapterSourceError(unsupported_scheme(scheme))
    if scheme == "file":
        parsed = urlparse(uri)
        local = Path(unquote(parsed.path) if parsed.scheme else uri).expanduser()
        try:
            file = weights_file(local)
        except ValueError as e:
            raise AdapterSourceError(f"{e}") from e
        _check_digest(file, sha256)
    else:
        names, fetch = _remote(uri, endpoints, limits)
        # One directory per URI and digest: a URI registered again with a new digest is fetched beside the old copy,
        # which the leases and API processes holding the old registration go on reading.
        key = uri if not sha256 else f"{uri}\nsha256={sha256.lower()}"
        local = cache_dir / "lora" / hashlib.sha256(key.encode()).hexdigest()[:16]
        local.parent.mkdir(parents=True, exist_ok=True)
        # one download of a copy at a time over the processes sharing the cache (each API process of a replica
        # syncing took its own): the others wait here, then find it
        with open(local.with_name(local.name + ".lock"), "w") as claim:
            fcntl.flock(claim, fcntl.LOCK_EX)
            local.mkdir(exist_ok=True)
            file = next((local / n for n in names if (local / n).exists()), None)
            if file is not None and sha256 and sha256_of(file) != sha256.lower():
                file.unlink()  # a stale or damaged copy: fetch it again
                file = None
            if file is None:
                log.info("downloading the LoRA adapter %r", uri)  # as a literal: a caller's URI may hold line breaks
                try:
                    file = _download(names, fetch, local, limits)
                    _check_digest(file, sha256)
                except AdapterSourceError:  # refused (a limit, the digest): nothing of it stays on disk
                    shutil.rmtree(local, ignore_errors=True)
                    Path(claim.name).unlink(missing_ok=True)
                    raise
    return local if local.is_dir() else file


def _download(names: list[str], fetch: Callable[[str, Path, int], None], local: Path, limits: FetchLimits) -> Path:
    """The weights (the first of `names` the source has) and the config beside them into `local`."""
    for i, name in enumerate(names):
        try:
            fetch(name, local / name, limits.max_bytes)
        except NotThere:
            if i + 1 < len(names):
                continue  # the next weights format
            raise
        break
    try:
        fetch(CONFIG_FILE, local / CONFIG_FILE, CONFIG_MAX_BYTES)
    except NotThere as e:  # the official loader's default config then applies
        log.warning("no %s beside the adapter (%s)", CONFIG_FILE, e)
    return local / name


def _check_digest(file: Path, sha256: str | None) -> None:
    if sha256:
        got = sha256_of(file)
        if got != sha256.lower():
            raise AdapterSourceError(f"{file} has SHA-256 {got}, expected {sha256.lower()}", "sha256")
