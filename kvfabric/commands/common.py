"""What the client-side subcommands share: where the daemon is, its token, error exits."""

from __future__ import annotations

import argparse
import os
import sys

from kvfabric.client import Client
from kvfabric.client.client import default_address
from kvfabric.errors import KVFabricError, UnavailableError

EXIT_UNAVAILABLE = 1  # the daemon is unreachable or refused the request
EXIT_USAGE = 2  # bad flags, config or input: the same code argparse uses

TOKEN_ENV = "KVFABRIC_TOKEN"
CONNECT_TIMEOUT_S = 10.0


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
    parser.add_argument("--token", default=None,
                        help=f"bearer token of the daemon (default: ${TOKEN_ENV})")


def add_socket_arg(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    parser.add_argument("--socket", default=None, metavar="PATH",
                        help="the daemon's Unix socket (default: $KVFABRIC_SOCKET_PATH or "
                             "./kvfabric-data/kvfabric.sock)")


def token_of(args: argparse.Namespace) -> str | None:
    return args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None


def connect(args: argparse.Namespace) -> Client:
    """A session on ``--socket``; a one-shot tool fails at once instead of reconnecting."""
    return Client(args.socket or default_address(), token=token_of(args),
                  timeout=CONNECT_TIMEOUT_S, reconnect=False)


