"""The ``kvfabric`` command line: serve the node daemon, inspect it, run the demo."""

from __future__ import annotations

import argparse
import logging
import sys

from kvfabric.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfabric", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `serve` reconfigures logging from its config's log_level once that is loaded.
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
