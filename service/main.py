"""`voxcpm-serve`: the service (the supervisor, its engine workers and API processes).

Every setting is a NANOVLLM_* environment variable and a flag of the same name (`--serverpool-max-num-seqs`), with a
few short ones (`--model`, `--devices`); a flag wins over the variable, the variable over the default. `--help` lists
them all with their variables and defaults; an unknown flag or a bad value exits 2 naming it.

`voxcpm-serve check [flags]` loads the configured model, generates one patch, prints one JSON line and exits 0, or
prints what failed and exits 1 (image smoke tests, init containers)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from engine.options import EngineOptions
from service.settings import Settings, describe_error, unknown_variables

SHORT_FLAGS = {"model_path": "--model", "serverpool_devices": "--devices"}  # besides --model-path, --serverpool-devices


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="voxcpm-serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"voxcpm-serve {version()}")
    for name, field in Settings.model_fields.items():
        default = field.default if field.default is not None else "unset"
        names = [flag(name)] + ([SHORT_FLAGS[name]] if name in SHORT_FLAGS else [])
        ap.add_argument(*names, dest=name, metavar="VALUE", default=argparse.SUPPRESS,
                        help=f"{field.description or ''} [env NANOVLLM_{name.upper()}; default {default}]")
    return ap


def version() -> str:
    try:
        return importlib.metadata.version("voxcpm-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    """Flags over NANOVLLM_* variables over defaults; exits 2 naming a bad flag or value (and 0 after --help)."""
    flags = vars(parser().parse_args(argv))
    try:
        settings = Settings(**flags)
    except ValidationError as e:
        print(describe_error(e, flags=set(flags)), file=sys.stderr)
        sys.exit(2)
    try:
        EngineOptions.from_env()  # the engine switches: checked now, read again where the engine config is made
    except ValueError as e:
        print(f"invalid configuration:\n  {e}", file=sys.stderr)
        sys.exit(2)
    for name in unknown_variables():
        logging.getLogger("service").warning("%s names no setting and is ignored (`voxcpm-serve --help` lists them)",
                                             name)
    return settings


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["check"]:
        from service.check import main as check

        sys.exit(check(argv[1:]))
    settings = load_settings(argv)
    from service.supervisor import Supervisor  # after validation: a config error should not wait for imports

    sys.exit(asyncio.run(Supervisor(settings).run()))


if __name__ == "__main__":
    main()
