"""Subcommands of the ``kvfabric`` command line, one module each.

Every module has ``add_parser(commands)``, which registers its subparser and sets the
``handler`` default to its ``run(args) -> exit code``. At module level a command imports only
the standard library and light kvfabric modules (errors, :mod:`kvfabric.commands.common`):
anything heavy (numpy, the client, the store, the server) is imported inside ``run``, so that
``--help`` and the other commands start fast.
"""

from __future__ import annotations

from kvfabric.commands import (
    bench,
    demo,
    doctor,
    gateway,
    lookup,
    plan,
    put,
    serve,
    status,
    token_file,
)
from kvfabric.commands.common import HelpFormatter

COMMANDS = (serve, status, lookup, put, demo, doctor, gateway, plan, bench, token_file)

__all__ = ["COMMANDS", "HelpFormatter"]
