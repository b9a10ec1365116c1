"""Service configuration from NANOVLLM_* environment variables (the seed fork's names), validated once
at start-up so a bad value fails fast with the variable named."""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.engine_config import EngineConfig
from engine.serving.devices import DEVICE_NAME

# lameenc accepts only the MPEG-1/2 layer III bitrates
MP3_BITRATES = (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)


# The engine's settings: NANOVLLM_<SETTING> sets EngineConfig's <field>, whose default, bounds and doc are the
# setting's (defined there once). The names are the seed's, its public contract: SERVERPOOL_ and the field for the
# pool's sizing, and the two it spelled otherwise (QUEUE_COALESCE_MS, LORA_ID).
ENGINE_SETTINGS: dict[str, str] = {
    "serverpool_max_num_seqs": "max_num_seqs",
    "serverpool_max_num_batched_tokens": "max_num_batched_tokens",
    "serverpool_running_prefill_tokens": "running_prefill_tokens",
    "serverpool_max_model_len": "max_model_len",
    "serverpool_gpu_memory_utilization": "gpu_memory_utilization",
    "serverpool_enforce_eager": "enforce_eager",
    "serverpool_inference_timesteps": "inference_timesteps",
    "serverpool_vae_dtype": "vae_dtype",
    "queue_coalesce_ms": "coalesce_ms",
    "queue_timeout_s": "queue_timeout_s",
    "lora_id": "lora_name",
    "lora_merge": "lora_merge",
    "max_loras": "max_loras",
    "max_lora_rank": "max_lora_rank",
    "lora_slot_wait_s": "lora_slot_wait_s",
    "quantization": "quantization",
}
# Where the service's default is not the library's, and why.
SERVICE_DEFAULTS: dict[str, Any] = {
    # Requests arriving together share one scheduling round (one batched prefill): docs/benchmarks.md, coalescing.
    "coalesce_ms": 5.0,
    # A request never waits for a seat longer than an HTTP client would: 503 + Retry-After instead.
    "queue_timeout_s": 30.0,
    # Unset: /info says no adapter id was given; the engine then names a runtime start-up adapter "default".
    "lora_name": None,
}


ANNOTATIONS = {"int": int, "float": float, "bool": bool, "str": str, "None": type(None)}  # of the engine settings


class BaseServiceSettings(BaseSettings):
    """The service's own settings; `Settings` adds the engine's (ENGINE_SETTINGS)."""

    # an empty variable is unset (NANOVLLM_LORA_DIR= read as the current directory, NANOVLLM_MODEL_PATH= as '.')
    model_config = SettingsConfigDict(env_prefix="NANOVLLM_", extra="ignore", env_ignore_empty=True)

    model_path: str | None = Field(None, description="Checkpoint directory or hub repo id; unset = embedded tiny "
                                                     "demo checkpoint with RANDOM weights (CPU).")
    serverpool_devices: str | None = Field(None, description="Comma list of GPU indices or device names; unset = "
                                                             "every GPU, else the CPU.")
    mp3_bitrate_kbps: int = Field(192, description="MP3 bitrate (kbit/s).")
    mp3_quality: int = Field(3, ge=0, le=7, description="LAME's quality setting (lameenc), LAME's own default 3; 2 "
                                                      "(near-best) about twice its CPU, 7 (fastest) half; 0 six times.")
    max_queued_requests: int | None = Field(None, ge=0, description="Requests each worker may hold waiting for a seat "
                                                                     "beyond the max_num_seqs it runs; more: 503 + "
                                                                     "Retry-After at once. Unset = max_num_seqs.")
    shutdown_grace_s: float = Field(30.0, ge=0, le=3600, description="On SIGTERM: /ready turns 503 and new requests "
                                                                       "get 503 at once; responses in flight get this "
                                                                       "long to finish before the processes stop.")
    api_processes: int = Field(0, ge=0, le=64, description="HTTP server processes in front of the engine workers "
                                                           "(each one encodes the audio of its own streams); 0 = "
                                                           "one per CPU core left to them, at most 16.")
    worker_cpus: int = Field(2, ge=0, le=64, description="CPU cores reserved for each engine worker (its host loop "
                                                         "drives the GPU); the API processes run on the others. 0, "
                                                         "or too few cores to leave two: no reservation.")
    encoder_threads: int = Field(0, ge=0, le=64, description="Audio-encoding threads per HTTP server process (on the "
                                                            "cores not reserved for the engine workers). 0 = one per "
                                                            "two seats the process serves on average (the engine "
                                                            "seats over the API processes), from 4 to 16.")
    cache_dir: Path = Field(Path("~/.cache/voxcpm-serve"), description="Voice store and demo checkpoint.")
    prebuilt_kernels_dir: Path | None = Field(None, description="GPU kernels compiled ahead (`python -m "
                                                                "engine.startup.prebuild --out DIR`, as the image "
                                                                "does): copied into the cache dir's kernel cache at "
                                                                "start where it lacks them, so a start on an empty "
                                                                "volume compiles none.")
    voice_store: Literal["disk", "memory"] = Field("disk", description="Where cached voices live.")
    voice_cache_max_entries: int = Field(1024, ge=3, description="Most cached voices (all kinds together; at least "
                                         "3: /add_hifi caches a prompt, a reference and their bundle).")
    voice_cache_max_bytes: int = Field(256 * 2**20, ge=1024, description="Most latent bytes cached.")
    redis_url: str | None = Field(None, pattern=r"^(redis|rediss|unix)://", description="A Redis (or Valkey) shared "
                                  "by every replica, e.g. redis://host:6379/0: the voices and the runtime LoRA "
                                  "adapters' registrations live there instead of the local SQLite store "
                                  "(NANOVLLM_VOICE_STORE is then unused).")
    redis_timeout_s: float = Field(0.5, gt=0, le=30, description="Longest wait for one Redis operation (connect or "
                                                                  "answer); a request needing the store gets 503 "
                                                                  "after at most about twice this.")
    lora_uri: str | None = Field(None, description="A LoRA adapter (official format) served by every request: a path "
                                                   "or file:// (its directory or weights file); https:// or "
                                                   "s3://bucket/key of its weights file (lora_config.json fetched "
                                                   "beside it); hf://owner/repo@revision?path=dir-or-file. Downloads "
                                                   "are cached under the cache dir.")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint for s3:// URIs (MinIO, Ceph, ...); "
                                                          "default AWS. Credentials: boto3's chain (AWS_* variables, "
                                                          "profile, instance role).")
    hf_endpoint: str | None = Field(None, description="Hub endpoint for hf:// URIs (a mirror or private hub); default "
                                                      "huggingface.co.")
    hf_token: SecretStr | None = Field(None, description="Token for private hf:// repositories.")
    lora_sha256: str | None = Field(None, description="SHA-256 of the adapter's weights file: start-up fails, naming "
                                                      "both digests, when it differs.")
    lora_dir: Path | None = Field(None, description="POST /loras may name local adapters (a path or file://) only "
                                                    "inside this directory; unset: remote URIs only.")
    lora_url_prefixes: str = Field("", description=(
        "Comma-separated URL prefixes (https://host/path/) that POST /loras may fetch http(s):// adapters from, "
        "redirects included; unset: none (s3:// and hf:// come from this service's endpoints). The service fetches "
        "nothing else a caller names: no host inside its network."))
    lora_max_bytes: int = Field(2**30, ge=2**20, description="Largest adapter weights file fetched (bytes).")
    lora_fetch_timeout_s: float = Field(600.0, gt=0, le=86400, description="Longest download of one adapter file.")
    body_timeout_s: float = Field(30.0, gt=0, le=3600, description=(
        "A request body whose next bytes take longer than this to arrive is refused (408): a slow upload held its "
        "connection for good."))
    max_request_bytes: int = Field(16 * 2**20, ge=1024, description="Largest request body accepted: 413 beyond it, "
                                                                    "found while reading, before all of it is in.")
    max_audio_seconds: float = Field(60.0, gt=0, le=3600, description="Longest uploaded clip (prompt or reference "
                                                                      "audio): 413 beyond it.")
    warmup: bool = Field(True, description="Run warm-up generations before reporting ready.")
    # Long-form text (docs/long-form.md): split into segments, each one generation, streamed as one audio stream.
    max_text_chars: int = Field(100_000, ge=1, le=10_000_000, description="Longest text a request may speak "
                                                                         "(characters): 422 naming the field beyond.")
    segment_chars: int = Field(250, ge=20, le=1000, description="Longest segment of a long text, in characters (a "
                                                                "CJK one counts 3): ~18 s of speech at 250; a text "
                                                                "that fits one segment is generated as it is.")
    segment_pause_ms: float = Field(200.0, ge=0, le=5000, description="Silence between two segments that end a "
                                                                      "sentence.")
    paragraph_pause_ms: float = Field(600.0, ge=0, le=10000, description="Silence between two segments a paragraph "
                                                                         "break (a blank line) separates.")
    segment_fade_ms: float = Field(10.0, ge=0, le=200, description="Fade in and out at each segment's edges, after "
                                                                   "their silence is trimmed (0: none, no trim).")
    badcase_ratio: float = Field(6.0, gt=0, le=6.0, description="A segment whose patches reach this many per text "
                                                                "token is a bad case (it never stopped) and is "
                                                                "generated again with the next seed; 6 = the "
                                                                "engine's length cap, as the official package.")
    badcase_tries: int = Field(3, ge=1, le=10, description="Generations a bad-case segment gets at most (the last "
                                                           "is kept).")
    # Live text over a WebSocket (/v1/audio/speech/stream; docs/http-api.md, Live text).
    ws_config_timeout_s: float = Field(10.0, gt=0, le=300, description="A WebSocket session's session.config must "
                                                                       "arrive within this long of the connection "
                                                                       "(else error, close 1008).")
    ws_idle_timeout_s: float = Field(30.0, gt=0, le=3600, description="A WebSocket session whose client sends "
                                                                      "nothing this long before input.done is ended "
                                                                      "(error, close 1008; its segments abort).")
    ws_max_message_bytes: int = Field(64 * 1024, ge=1024, le=16 * 2**20, description="Largest message a WebSocket "
                                                                                    "client may send (error, close "
                                                                                    "1009 beyond).")
    send_timeout_s: float = Field(60.0, gt=0, le=3600, description=(
        "A streamed response or live session whose client takes nothing this long (one write waits that long) is "
        "dropped: its connection closed, its generation aborted."))
    ready_timeout_s: float = Field(900, gt=0, description="Longest model load before start-up fails.")
    restart_dead_workers: bool = Field(True, description="Restart a worker that died (not ready meanwhile).")
    worker_stuck_timeout_s: float = Field(120.0, ge=0, le=3600, description=(
        "A worker whose loop answers no ping this long (a GPU call that never returns) is killed and restarted as "
        "one that died; 0: never (after 5 s it is reported: /ready 503)."))
    api_keys: str | None = Field(None, description="Comma-separated API keys: every route but /health, /ready, "
                                                   "/metrics, the playground page and the API's schema pages then "
                                                   "needs `Authorization: Bearer <key>` or `X-API-Key` (401 without).")
    api_keys_file: Path | None = Field(None, description="A file of API keys, one per line (# comments), besides "
                                                         "NANOVLLM_API_KEYS.")
    voice_aliases: str = Field("", description=(
        "Comma-separated name=voice pairs for /v1 and live sessions' `voice` (alloy=default,nova=<cached voice id>): "
        "OpenAI's built-in names, or any, as this service's voices; unset: none (an unknown name is a 400)."))
    admin_api_keys: str | None = Field(None, description=(
        "Comma-separated API keys that alone may register and remove LoRA adapters (POST, DELETE /loras: 403 with "
        "another key), which change what every client is served and fetch files; they are API keys too. Unset: any "
        "API key may. (Every key shares the cached voices: keys are one trust domain.)"))
    protect_metrics: bool = Field(False, description="/metrics needs an API key too (when keys are set).")
    cors_origins: str | None = Field(None, description="Comma-separated origins browsers may call from (`*` for "
                                                       "any); unset = no CORS headers.")
    playground: bool = Field(True, description="Serve the browser playground at / (a static page that calls the public "
                                               "API with the key its user types; the page itself holds no data).")
    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")

    @field_validator("mp3_bitrate_kbps")
    @classmethod
    def _bitrate(cls, v: int) -> int:
        if v not in MP3_BITRATES:
            raise ValueError(f"must be one of {MP3_BITRATES}")
        return v

    @field_validator("voice_aliases")
    @classmethod
    def _aliases(cls, v: str) -> str:
        for pair in (p for p in v.split(",") if p.strip()):
            name, eq, voice = pair.partition("=")
            if not eq or not name.strip() or not voice.strip():
                raise ValueError(f"{pair.strip()!r} is not name=voice (a cached voice's id, or default)")
        return v

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _keys(cls, v: str | None) -> str | None:
        if v and not keys_in_list(v):  # set to a value, yet no key: every route would be open
            raise ValueError("holds no key (only commas and spaces); leave it unset (or empty) for no keys")
        return v

    @field_validator("api_keys_file")
    @classmethod
    def _keys_file(cls, v: Path | None) -> Path | None:
        if v is None:
            return v
        if not v.expanduser().is_file():
            raise ValueError(f"{v} is not a readable file")
        if not keys_in_file(v):  # a secret mount that did not fill
            raise ValueError(f"{v} holds no key (only blank lines and # comments): every route would be open")
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None:
            from redis.connection import parse_url

            parse_url(v)  # a ValueError naming what is wrong (a port that is not a number, ...)
        return v

    @field_validator("serverpool_devices")
    @classmethod
    def _devices(cls, v: str | None) -> str | None:
        items = [d.strip() for d in (v or "").split(",") if d.strip()]
        if v is not None and not items:
            raise ValueError("must list at least one device, e.g. '0,1' or 'cpu'")
        if any(not (d.isdigit() or DEVICE_NAME.fullmatch(d)) for d in items):  # a worker was spawned, then failed
            raise ValueError("use GPU indices or device names (cuda, cuda:N, cpu), comma-separated")
        return v

    @model_validator(mode="after")
    def _token_budget(self) -> BaseServiceSettings:
        if self.serverpool_max_num_batched_tokens < self.serverpool_max_model_len:
            raise ValueError("NANOVLLM_SERVERPOOL_MAX_NUM_BATCHED_TOKENS must be >= NANOVLLM_SERVERPOOL_MAX_MODEL_LEN "
                             "(a preempted stream is recomputed in one prefill)")
        return self

    @field_validator("lora_sha256")
    @classmethod
    def _sha256(cls, v: str | None) -> str | None:
        if v is not None and (len(v) != 64 or any(c not in "0123456789abcdefABCDEF" for c in v)):
            raise ValueError("must be 64 hexadecimal digits")
        return v

    @model_validator(mode="after")
    def _lora(self) -> BaseServiceSettings:
        if self.lora_uri and not self.lora_merge and self.max_loras < 1:
            raise ValueError("NANOVLLM_LORA_URI with NANOVLLM_LORA_MERGE=false is served as a runtime adapter "
                             "(every request that names none uses it): set NANOVLLM_MAX_LORAS >= 1, or leave "
                             "NANOVLLM_LORA_MERGE unset to merge it into the weights")
        if self.lora_uri:
            from service.lora_source import SCHEMES, unsupported_scheme, uri_scheme

            if uri_scheme(self.lora_uri) not in SCHEMES:
                raise ValueError(f"NANOVLLM_LORA_URI: {unsupported_scheme(uri_scheme(self.lora_uri))}")
        return self

    def api_process_count(self, cores: int | None = None) -> int:
        """The API processes to start, given the cores left to them (default: every core of this process)."""
        if self.api_processes:
            return self.api_processes
        return max(1, min(16, cores if cores is not None else len(os.sched_getaffinity(0))))

    def encoder_thread_count(self, api_processes: int, workers: int) -> int:
        """Encoder threads per API process. Connections spread over the processes unevenly (the kernel hashes them),
        so a process may serve ~1.5x its share of streams; too few threads leave its streams behind while other
        processes idle, too many on a host that is short of cores cost more CPU per audio second; never fewer than 4
        (2 held MP3 c=64 to 311-366 audio-s/s where 4 gave 383-412 on 16-vCPU H200 hosts; measured:
        docs/history/serving.md, "Encoder threads by the seats")."""
        if self.encoder_threads:
            return self.encoder_threads
        seats = self.serverpool_max_num_seqs * max(1, workers)
        return max(4, min(16, seats // (2 * max(1, api_processes))))

    def api_key_list(self) -> list[str]:
        """The keys from NANOVLLM_API_KEYS, NANOVLLM_API_KEYS_FILE and NANOVLLM_ADMIN_API_KEYS (read once, at
        start-up)."""
        return (keys_in_list(self.api_keys or "") + (keys_in_file(self.api_keys_file) if self.api_keys_file else [])
                + self.admin_key_list())

    def voice_alias_map(self) -> dict[str, str]:
        """NANOVLLM_VOICE_ALIASES as {name: voice}."""
        pairs = [p.partition("=") for p in self.voice_aliases.split(",") if p.strip()]
        return {name.strip(): voice.strip() for name, _, voice in pairs}

    def admin_key_list(self) -> list[str]:
        return keys_in_list(self.admin_api_keys or "")

    @property
    def queue_bound(self) -> int:
        return self.serverpool_max_num_seqs if self.max_queued_requests is None else self.max_queued_requests

    def device_list(self) -> list[int | str] | None:
        if self.serverpool_devices is None:
            return None
        return [int(d) if d.strip().isdigit() else d.strip() for d in self.serverpool_devices.split(",") if d.strip()]

    @property
    def cache_path(self) -> Path:
        return self.cache_dir.expanduser()

    def engine_fields(self) -> dict[str, Any]:
        """The EngineConfig fields these settings set (an unset one: the config's default)."""
        values = {field: getattr(self, name) for name, field in ENGINE_SETTINGS.items()}
        return {field: value for field, value in values.items() if value is not None}


def keys_in_list(value: str) -> list[str]:
    """The keys of NANOVLLM_API_KEYS: comma-separated, blanks dropped."""
    return [k.strip() for k in value.split(",") if k.strip()]


def keys_in_file(path: Path) -> list[str]:
    """The keys of NANOVLLM_API_KEYS_FILE: one per line, blank lines and # comments dropped."""
    lines = (line.strip() for line in path.expanduser().read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def engine_setting(field_name: str) -> tuple[Any, Any]:
    """The (type, pydantic Field) of the setting that sets EngineConfig's `field_name`: its type, bounds and doc are
    the config's, its default the config's unless SERVICE_DEFAULTS says otherwise."""
    f = next(f for f in dataclasses.fields(EngineConfig) if f.name == field_name)
    meta = f.metadata
    kind = functools.reduce(operator.or_, (ANNOTATIONS[t] for t in f.type.split(" | ")))  # "float | None"
    if meta["choices"] is not None:  # a bad value is refused naming the allowed ones
        kind = Literal[meta["choices"]]
    default = SERVICE_DEFAULTS.get(field_name, f.default)
    if default is None:
        kind = kind | None
    bounds = {k: meta[k] for k in ("ge", "gt", "le", "pattern") if meta[k] is not None}
    return kind, Field(default, description=meta["doc"], **bounds)


Settings = create_model("Settings", __base__=BaseServiceSettings, __doc__="Every NANOVLLM_* setting of the service.",
                        **{name: engine_setting(field) for name, field in ENGINE_SETTINGS.items()})


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The NANOVLLM_* variables that name no setting: pydantic-settings ignores them, so a misspelt one would leave its
    setting at the default without a word (startup warns, as vLLM does for its own prefix)."""
    names = {f"NANOVLLM_{name.upper()}" for name in Settings.model_fields}  # any case, as pydantic-settings reads
    return sorted(v for v in (os.environ if environ is None else environ) if v.upper().startswith("NANOVLLM_")
                  and v.upper() not in names)


def describe_error(err: ValidationError, flags: set[str] | None = None) -> str:
    """One line per bad setting, named as the operator set it: the flag where one was given, else the variable."""
    lines = []
    for e in err.errors():
        field = "_".join(str(p) for p in e["loc"]) if e["loc"] else ""
        if not field:
            name = "configuration"
        elif flags and field in flags:
            name = "--" + field.replace("_", "-")
        else:
            name = f"NANOVLLM_{field.upper()}"
        lines.append(f"{name}: {e['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
