"""Errors the server pool raises to its callers. A worker reports an error as (kind, message) and the
pool raises the class of that kind, so callers can tell their own mistakes from server trouble."""

from __future__ import annotations


class CheckpointError(ValueError):
    """The directory is not a loadable VoxCPM checkpoint; the message says what is wrong."""


class PoolError(RuntimeError):
    """Base of every error the pool raises."""

    kind = "internal"


class RequestError(PoolError, ValueError):
    """The request itself is invalid (bad field, text too long, bad latents); other requests are unaffected."""

    kind = "request"


class PromptNotFoundError(RequestError, KeyError):
    """The prompt_id is not registered."""

    kind = "prompt_not_found"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class LoRANotFoundError(RequestError, KeyError):
    """A request or call named a LoRA adapter that is not registered."""

    kind = "lora_not_found"

    def __str__(self) -> str:  # KeyError's repr-quoting off
        return str(self.args[0]) if self.args else ""


class EngineError(PoolError):
    """The engine failed while running the request (a bug or out of memory); the worker keeps serving."""

    kind = "engine"


class OverloadedError(PoolError):
    """Every worker already holds as many requests as it runs plus its queue, or this one waited in the queue
    longer than its deadline: try again later (the service answers 503 with Retry-After)."""

    kind = "overloaded"


class WorkerDiedError(PoolError):
    """The worker process serving the request exited; the pool is unhealthy until restarted."""

    kind = "worker_died"


class PoolStoppedError(PoolError):
    """The pool was stopped (or is not started)."""

    kind = "stopped"


ERROR_KINDS: dict[str, type[PoolError]] = {cls.kind: cls for cls in
                                          (PoolError, RequestError, PromptNotFoundError, LoRANotFoundError, EngineError,
                                           OverloadedError, WorkerDiedError, PoolStoppedError)}


def error_from(kind: str, message: str) -> PoolError:
    return ERROR_KINDS.get(kind, PoolError)(message)
