"""The ``kvfabric`` command line: serve the node daemon, inspect it, run the demo.

Start-up cost is part of the interface: ``kvfabric --help``, ``status`` and ``lookup`` are
run by people and scripts many times a day. Only argparse and the subcommand modules' parser
code load here; each subcommand imports what it needs (numpy, the client, the store, the
HTTP server, redis) inside its ``run`` (tests/unit/test_cli_startup.py holds this).
"""

from __future__ import annotations

import argparse
import sys

from kvfabric.commands import COMMANDS, HelpFormatter

DESCRIPTION = """\
kvfabric: a tiered KV-cache fabric for LLM inference. One daemon per node keeps KV cache in
DRAM, CXL memory and SSD; engines on the node store and reuse prompts' KV through it.

first steps:
  kvfabric demo                      store a prompt's KV through every tier (no daemon needed)
  kvfabric serve                     run the daemon on the embedded defaults
  kvfabric put ...                   store a prompt's KV in the running daemon
  kvfabric status                    its tiers, hit rates and counters
  kvfabric lookup ...                how much of a prompt it holds

`kvfabric COMMAND --help` describes each command."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfabric", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging  # after parsing: --help and usage errors never pay for it

    # `serve` reconfigures logging from its config's log_level once that is loaded.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
