"""The ``kvfabric`` command line: serve the node daemon, inspect it, run the demo.

Start-up cost is part of the interface: ``kvfabric --help``, ``status`` and ``lookup`` are
run by people and scripts many times a day. Only argparse and the subcommand modules' parser
code load here; each subcommand imports what it needs (numpy, the client, the store, the
HTTP server, redis) inside its ``run`` (tests/unit/test_cli_startup.py holds this).
"""

from __future__ import annotations

import argparse
import sys

from kvfabric import __version__
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
    parser.add_argument(
        "--version", action="version", version=f"kvfabric {__version__}", help="print it and exit"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),  # kvfabric.logfmt.FORMATS, without importing logging here
        default=None,
        help="log lines as text (default) or one JSON object per line with time, level, "
        "logger, message and the request's id, op, namespace and tenant; for serve it "
        "overrides the config's log_format",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging  # after parsing: --help and usage errors never pay for it

    from kvfabric.logfmt import configure

    # `serve` reconfigures logging from its config's log_level and log_format once loaded.
    configure(
        logging.DEBUG if args.verbose else logging.WARNING,
        args.log_format or "text",
        text_format="%(levelname)s %(name)s: %(message)s",
        force=False,  # called in process (tests), it leaves the caller's logging alone
    )
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
