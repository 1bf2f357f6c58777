"""The ``kvfabric`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfabric", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="store KV through every tier and read it back")
    demo.add_argument("--data-dir", type=Path, default=None,
                      help="keep the store here (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from kvfabric.demo import run_demo

        result = run_demo(args.data_dir)
        print("demo OK" if result.ok else "demo FAILED")
        return 0 if result.ok else 1
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
