"""``kvfabric demo``: the store on its own, through every tier (see :mod:`kvfabric.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("demo", help="store KV through every tier and read it back")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="keep the store here (default: a temporary directory, removed)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvfabric.demo import run_demo  # numpy and the store load only for this command

    result = run_demo(args.data_dir)
    print("demo OK" if result.ok else "demo FAILED")
    return 0 if result.ok else 1
