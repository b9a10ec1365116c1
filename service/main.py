"""`voxcpm-serve`: the service under uvicorn, configured from NANOVLLM_* environment variables."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError

from service.settings import Settings, describe_error


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings()
    except ValidationError as e:
        print(describe_error(e), file=sys.stderr)
        sys.exit(2)
    from service.app import create_app  # after validation: a config error should not wait for torch

    # one process: the pool and the caches live in it (scale with replicas, not uvicorn workers)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
