"""What the client-side subcommands share: where the daemon is, its token, error exits.

Light on purpose (the standard library and :mod:`kvfabric.errors`): every subcommand module
imports it at start-up; the client library loads in :func:`connect`.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvfabric.errors import KVFabricError, UnavailableError

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing at start-up
if TYPE_CHECKING:
    from kvfabric.client import Client

EXIT_UNAVAILABLE = 1  # the daemon is unreachable or refused the request
EXIT_USAGE = 2  # bad flags, config or input: the same code argparse uses

TOKEN_ENV = "KVFABRIC_TOKEN"
CONNECT_TIMEOUT_S = 10.0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks (example blocks); option help is wrapped."""


def add_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` shows ``description`` as written (plain text)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help, description=description, formatter_class=HelpFormatter
    )
    return parser


def fail(command: str, message: str, code: int) -> int:
    """Print one line to stderr (no traceback) and return ``code``."""
    print(f"kvfabric {command}: {message}", file=sys.stderr)
    return code


def daemon_error(command: str, exc: KVFabricError) -> int:
    """A failed request: one line, with a hint when nothing answered at all."""
    hint = " (is `kvfabric serve` running there?)" if isinstance(exc, UnavailableError) else ""
    return fail(command, f"{exc}{hint}", EXIT_UNAVAILABLE)


def add_token_arg(parser: argparse.ArgumentParser) -> None:
    # No default shown in --help: it would print the token from the environment.
    parser.add_argument(
        "--token", default=None, help=f"bearer token of the daemon (default: ${TOKEN_ENV})"
    )


def add_socket_arg(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    parser.add_argument(
        "--socket",
        default=None,
        metavar="PATH",
        help="the daemon's Unix socket (default: $KVFABRIC_SOCKET_PATH or "
        "./kvfabric-data/kvfabric.sock)",
    )


def token_of(args: argparse.Namespace) -> str | None:
    return args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None


def connect(args: argparse.Namespace) -> Client:
    """A session on ``--socket``; a one-shot tool fails at once instead of reconnecting."""
    from kvfabric.client import Client
    from kvfabric.client.client import default_address

    return Client(
        args.socket or default_address(),
        token=token_of(args),
        timeout=CONNECT_TIMEOUT_S,
        reconnect=False,
    )
