"""`voxcpm-serve`: the service (the supervisor, its engine workers and API processes), configured from
NANOVLLM_* environment variables."""

from __future__ import annotations

import asyncio
import logging
import sys

from pydantic import ValidationError

from service.settings import Settings, describe_error


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings()
    except ValidationError as e:
        print(describe_error(e), file=sys.stderr)
        sys.exit(2)
    from service.supervisor import Supervisor  # after validation: a config error should not wait for imports

    sys.exit(asyncio.run(Supervisor(settings).run()))


if __name__ == "__main__":
    main()
