"""``kvfabric serve``: run the node daemon on a config file, the environment and flags.

The named flags are shorthands for ``--set KEY=VALUE`` and, like it, apply in the order
given (the last one for a key wins); together they override ``KVFABRIC_*`` variables, which
override the file, which overrides the embedded defaults (see :mod:`kvfabric.config`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfabric.commands.common import EXIT_UNAVAILABLE, EXIT_USAGE, add_command, fail
from kvfabric.errors import ConfigError, KVFabricError

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing at start-up
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

# (flag, dotted key, the value is a string): strings are passed quoted so that YAML scalar
# parsing cannot turn a node id "007" or a directory named "null" into a number or None.
SHORTHANDS: tuple[tuple[str, str, bool], ...] = (
    ("--data-dir", "store.data_dir", True),
    ("--socket", "socket_path", True),
    ("--http-host", "http.host", True),
    ("--http-port", "http.port", False),  # an int, or null to disable HTTP
    ("--tcp-port", "tcp.port", False),
    ("--auth-token-file", "auth.token_file", True),
    ("--node-id", "node_id", True),
    ("--log-level", "log_level", True),
    ("--log-format", "log_format", True),  # text | json; `kvfabric --log-format` overrides it
)


class _Override(argparse.Action):
    """Appends ``key=value`` to ``args.overrides``, keeping command-line order."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        key: str | None = None,
        quoted: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.key, self.quoted = key, quoted

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        import json

        value = str(values)
        item = (
            value
            if self.key is None
            else f"{self.key}={json.dumps(value) if self.quoted else value}"
        )
        namespace.overrides = [*(namespace.overrides or []), item]


class _Insecure(argparse.Action):
    """``--insecure``: ``--set security.allow_insecure=true``, in command-line order."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        namespace.overrides = [*(namespace.overrides or []), "security.allow_insecure=true"]


DESCRIPTION = """\
Run the node daemon until SIGTERM / SIGINT (Ctrl-C). Settings come from, highest first: these
flags (in the order given), KVFABRIC_* environment variables, the --config file, the embedded
defaults (DRAM 1 GiB + SSD 8 GiB under ./kvfabric-data, the socket
./kvfabric-data/kvfabric.sock, HTTP on 127.0.0.1:8790, no authentication).

Before building anything it checks the config: token and secret files, TLS certificates, the
bind rule, memory tiers against physical RAM and SSD tiers against free disk
(store.allow_overcommit: true to start anyway), the data dir, socket and ports. --check runs
these checks alone.

examples:
  kvfabric serve
  kvfabric token new ~/.local/share/kvfabric/admin-token
  kvfabric serve --config configs/dev.yaml --check
  kvfabric serve --config configs/dev.yaml"""


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--set`` and their shorthands: how ``serve`` and every command that
    reads the daemon's config as ``serve`` would (``doctor``) take it."""
    parser.add_argument(
        "--config", type=Path, default=None, metavar="FILE", help="YAML config file"
    )
    parser.add_argument(
        "--set",
        action=_Override,
        dest="overrides",
        metavar="KEY=VALUE",
        help="override one setting by its dotted path, e.g. "
        "store.tiers.dram.capacity=4GiB (repeatable)",
    )
    for flag, key, quoted in SHORTHANDS:
        parser.add_argument(
            flag,
            action=_Override,
            dest="overrides",
            key=key,
            quoted=quoted,
            metavar=key.rsplit(".", 1)[-1].upper(),
            help=f"= --set {key}=...",
        )


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        commands,
        "serve",
        help="run the node daemon until SIGTERM / SIGINT",
        description=DESCRIPTION,
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--insecure",
        action=_Insecure,
        dest="overrides",
        help="= --set security.allow_insecure=true: listen beyond loopback "
        "without authentication (logged as a WARNING; see the README's "
        "Security section)",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="write JSON {pid, node_id, socket, tcp_port, http_port} here once serving",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config as YAML (tokens redacted) and exit; "
        "exits 2 after it if serve would refuse the config (as --check, "
        "without probing the socket and ports)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="run every check serve runs before serving (credentials, "
        "capacities, directories, socket, ports), print what the daemon "
        "would use and exit: 0 if it would start, 2 if not",
    )
    parser.set_defaults(handler=run, overrides=[])


def run(args: argparse.Namespace) -> int:
    from kvfabric.commands.config_yaml import config_yaml
    from kvfabric.config import load_config
    from kvfabric.preflight import preflight

    try:
        config = load_config(args.config, overrides=args.overrides)
        if args.print_config:
            sys.stdout.write(config_yaml(config))
            sys.stdout.flush()
        # before the store is built: a missing token or secret file, a tier larger than
        # the machine, a busy port fail here with every reason at once
        checked = preflight(config, probe=not args.print_config)
    except ConfigError as exc:
        return fail("serve", str(exc), EXIT_USAGE)
    if args.print_config:
        return 0
    if args.check:
        print(
            "\n".join(
                [
                    "kvfabric serve --check: the daemon would start with",
                    *(f"  {line}" for line in checked.lines),
                    *(f"WARNING: {warning}" for warning in (*checked.warnings, *checked.insecure)),
                ]
            )
        )
        return 0
    import logging

    from kvfabric.logfmt import configure

    level = logging.DEBUG if args.verbose else getattr(logging, config.log_level.upper())
    configure(level, getattr(args, "log_format", None) or config.log_format)
    for warning in checked.warnings:  # the daemon logs the insecure planes itself
        logging.getLogger("kvfabric.preflight").warning("%s", warning)
    from kvfabric.server.daemon import run as run_daemon  # uvicorn and the store: only here

    try:
        return run_daemon(config, ready_file=args.ready_file)
    except ConfigError as exc:  # raised while opening the store (tier setup)
        return fail("serve", str(exc), EXIT_USAGE)
    except KVFabricError as exc:  # e.g. another daemon already serves the socket
        return fail("serve", str(exc), EXIT_UNAVAILABLE)
