"""``kvfabric doctor``: check this node for what the daemon needs; say what is wrong and how
to fix it (see :mod:`kvfabric.doctor`).

It takes the config exactly as ``serve`` does (``--config``, ``KVFABRIC_*``, ``--set`` and
serve's shorthand flags), so the checks judge what that daemon would ask for. A config that
does not load is itself the one ``error`` finding. Exit status: the worst finding's
(:mod:`kvfabric.doctor.result`): 0 ok / info, 1 warn, 2 error.
"""

from __future__ import annotations

import argparse

from kvfabric.commands.common import add_command
from kvfabric.commands.serve import add_config_arguments

DEFAULT_SSD_TEST = "64MiB"

DESCRIPTION = """\
Check this node for what the daemon needs and print, per finding, what is wrong and how to fix
it: /dev/shm and memfd sealing, reserved and transparent huge pages against the tiers, NUMA
nodes against a cxl tier's numa_node, the memory tiers against RAM, RLIMIT_NOFILE and
RLIMIT_MEMLOCK, the SSD tier against free disk plus a timed write and read in its directory,
Redis reachability, latency and clock skew (redis index), NIXL / UCX, the socket's directory
and path, and the HTTP and TCP ports. Takes the config as `kvfabric serve` does.

exit status: 0 every finding ok or info, 1 the worst is a warning, 2 an error (also a config
that does not load).

examples:
  kvfabric doctor
  kvfabric doctor --config configs/dev.yaml --json
  kvfabric doctor --set store.tiers.dram.capacity=64GiB --ssd-test-size 0"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        commands,
        "doctor",
        help="check this node for what the daemon needs, and how to fix it",
        description=DESCRIPTION,
    )
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--ssd-test-size",
        default=DEFAULT_SSD_TEST,
        metavar="SIZE",
        help=f"the timed file written and read in the SSD tier's directory "
        f"(default {DEFAULT_SSD_TEST}; 0 skips the measurement)",
    )
    parser.set_defaults(handler=run, overrides=[])


def run(args: argparse.Namespace) -> int:
    import json
    import socket

    from kvfabric.commands.common import EXIT_USAGE, fail
    from kvfabric.config import load_config
    from kvfabric.config_types import size_bytes
    from kvfabric.doctor.report import as_json, render_table
    from kvfabric.doctor.result import CheckResult, Severity, exit_code
    from kvfabric.errors import ConfigError

    try:
        ssd_bytes = size_bytes(args.ssd_test_size, zero=True)
    except ConfigError as exc:
        return fail("doctor", f"--ssd-test-size: {exc}", EXIT_USAGE)
    node_id = socket.gethostname()
    try:
        config = load_config(args.config, overrides=args.overrides)
    except ConfigError as exc:
        results = [
            CheckResult(
                "config",
                Severity.ERROR,
                f"the config does not load: {exc}",
                "fix the setting named above; `kvfabric serve --print-config` with the same "
                "flags shows the effective config",
            )
        ]
    else:
        from kvfabric.doctor.checks import Options, run_checks

        node_id = config.node_id
        results = run_checks(config, Options(ssd_test_bytes=ssd_bytes))
    source = str(args.config) if args.config is not None else None
    if args.json:
        print(json.dumps(as_json(results, node_id=node_id, config=source), indent=2))
    else:
        title = f"kvfabric doctor: node {node_id}, config {source or '(embedded defaults)'}"
        print(render_table(results, title=title))
    return exit_code(results)
