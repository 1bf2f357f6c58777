"""``kvfabric demo``: the store on its own, through every tier (see :mod:`kvfabric.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvfabric.commands.common import add_command

DESCRIPTION = """\
Run the tiered store on its own (no daemon, no external service): write a synthetic prompt's
KV layer by layer into the fastest tier, let capacity pressure push it down through every tier
kind (device, DRAM, CXL, SSD), find it again with a prefix lookup, read it back byte-exact, and
restart the store to show the SSD part survives. The device tier needs torch
(pip install -e '.[device]'); without it the demo says so and runs the others."""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        commands,
        "demo",
        help="store KV through every tier and read it back",
        description=DESCRIPTION,
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="keep the store here (default: a temporary directory, removed)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvfabric.demo import run_demo  # numpy and the store load only for this command

    result = run_demo(args.data_dir)
    print("demo OK" if result.ok else "demo FAILED")
    return 0 if result.ok else 1
