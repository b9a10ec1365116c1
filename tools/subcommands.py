"""What tools/bench.py and tools/profiler.py share: `SCRIPT SUBCOMMAND [flags]`, each subcommand a function of a module
in the script's package, imported only when it runs (some import torch), its flags parsed by its own parser."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

# subcommand -> ("module:function" in the package, what it does: the listing's line)
Table = dict[str, tuple[str, str]]


def run(prog: str, doc: str | None, package: str, subcommands: Table, argv: list[str]) -> Any:
    """Run the subcommand argv[0] with the flags after it; returns what its function returns."""
    width = max(map(len, subcommands)) + 2
    listing = "\n".join(f"  {name:{width}s}{summary}" for name, (_, summary) in subcommands.items())
    ap = argparse.ArgumentParser(prog=prog, description=doc, epilog=f"subcommands:\n{listing}",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("subcommand", choices=subcommands, metavar="SUBCOMMAND", help="one of those below")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="its flags (SUBCOMMAND --help lists them)")
    # Only the subcommand is parsed here: its flags, --help included, are its own parser's.
    command = ap.parse_args(argv[:1]).subcommand
    module, function = subcommands[command][0].split(":")
    return getattr(importlib.import_module(f"{package}.{module}"), function)(argv[1:])
