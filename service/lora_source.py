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
again, and a download that does not match stops start-up, naming both digests."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import httpx

from engine.io.lora import CONFIG_FILE, WEIGHT_FILES, sha256_of, weights_file

log = logging.getLogger(__name__)
SCHEMES = ("file", "https", "http", "s3", "hf")
DOWNLOAD_TIMEOUT = httpx.Timeout(30.0, read=300.0)


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


def _http_get(url: str, target: Path) -> None:
    def write(part: Path) -> None:
        try:
            with httpx.stream("GET", url, timeout=DOWNLOAD_TIMEOUT, follow_redirects=True) as r:
                if r.status_code == 404:
                    raise NotThere(f"{url} answered 404")
                if r.status_code != 200:
                    raise AdapterSourceError(f"{url} answered {r.status_code}")
                with open(part, "wb") as f:
                    for chunk in r.iter_bytes(1 << 20):
                        f.write(chunk)
        except httpx.HTTPError as e:
            raise AdapterSourceError(f"could not download {url}: {e}") from e

    _atomic(target, write)


def _s3_get(bucket: str, key: str, target: Path, endpoints: Endpoints) -> None:
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

    _atomic(target, write)


def _hf_get(repo: str, revision: str, filename: str, target: Path, endpoints: Endpoints) -> None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    def write(part: Path) -> None:
        try:
            # The hub library's own cache (beside ours) resumes an interrupted download.
            got = hf_hub_download(repo, filename, revision=revision, endpoint=endpoints.hf_endpoint,
                                  token=endpoints.hf_token, cache_dir=target.parent / "hub")
        except EntryNotFoundError as e:
            raise NotThere(f"hf://{repo}@{revision} has no {filename}") from e
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
            raise AdapterSourceError(f"could not download {filename} of hf://{repo}@{revision}: "
                                     f"{type(e).__name__}: {e}") from e
        shutil.copyfile(got, part)

    _atomic(target, write)


def _remote(uri: str, endpoints: Endpoints) -> tuple[list[str], Callable[[str, Path], None]]:
    """For a remote URI: the weights file names to try (in order) and a fetch(name, target) of a file beside them."""
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
            return [name], lambda n, t: _s3_get(parsed.netloc, f"{base}/{n}".lstrip("/"), t, endpoints)
        root = f"{parsed.scheme}://{parsed.netloc}{base}"
        return [name], lambda n, t: _http_get(f"{root}/{n}", t)
    # hf://owner/repo@revision?path=dir-or-file
    repo, _, revision = (parsed.netloc + parsed.path).partition("@")
    revision = revision or "main"
    inner = parse_qs(parsed.query).get("path", [""])[0].strip("/")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise AdapterSourceError(f"{uri} is not hf://owner/repo[@revision][?path=...]")
    if inner.endswith((".safetensors", ".ckpt", ".pth")):
        names, base = [Path(inner).name], inner.rsplit("/", 1)[0] if "/" in inner else ""
    else:
        names, base = list(WEIGHT_FILES), inner
    return names, lambda n, t: _hf_get(repo, revision, f"{base}/{n}".lstrip("/"), t, endpoints)


def fetch_adapter(uri: str, cache_dir: Path, sha256: str | None = None, endpoints: Endpoints | None = None) -> Path:
    """A local path to the adapter `uri` names (its directory or weights file), its weights' SHA-256 checked."""
    endpoints = endpoints or Endpoints()
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
    else:
        names, fetch = _remote(uri, endpoints)
        # One directory per URI and digest: a URI registered again with a new digest is fetched beside the old copy,
        # which the leases and API processes holding the old registration go on reading.
        key = uri if not sha256 else f"{uri}\nsha256={sha256.lower()}"
        local = cache_dir / "lora" / hashlib.sha256(key.encode()).hexdigest()[:16]
        local.mkdir(parents=True, exist_ok=True)
        file = next((local / n for n in names if (local / n).exists()), None)
        if file is not None and sha256 and sha256_of(file) != sha256.lower():
            file.unlink()  # a stale or damaged copy: fetch it again
            file = None
        if file is None:
            log.info("downloading the LoRA adapter %s", uri)
            for i, name in enumerate(names):
                try:
                    fetch(name, local / name)
                except NotThere:
                    if i + 1 < len(names):
                        continue  # the next weights format
                    raise
                file = local / name
                break
            assert file is not None
            try:
                fetch(CONFIG_FILE, local / CONFIG_FILE)
            except NotThere as e:  # the official loader's default config then applies
                log.warning("no %s beside the adapter (%s)", CONFIG_FILE, e)
    if sha256:
        got = sha256_of(file)
        if got != sha256.lower():
            raise AdapterSourceError(f"{file} has SHA-256 {got}, expected {sha256.lower()}", "sha256")
    return local if local.is_dir() else file
