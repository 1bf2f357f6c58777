"""Subcommands of the ``kvfabric`` command line, one module each.

Every module has ``add_parser(commands)``, which registers its subparser and sets the
``handler`` default to its ``run(args) -> exit code``.
"""

from __future__ import annotations

from kvfabric.commands import demo, lookup, serve, status

COMMANDS = (serve, status, lookup, demo)
