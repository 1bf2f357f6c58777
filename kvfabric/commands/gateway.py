"""``kvfabric gateway``: the OpenAI-compatible front door that places each phase by cost
(:mod:`kvfabric.gateway`)."""

from __future__ import annotations

import argparse

from kvfabric.commands.common import add_command
from kvfabric.errors import KVFabricError

DESCRIPTION = """\
Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models) in front of
vLLM engines that run kvfabric's connector. Per request it asks the fabric which nodes hold
the prompt's prefix, plans which engine prefills and which decodes (hardware-class cost,
load, transfer), queues tenants fairly by token budget and explains any plan at /v1/plan.

examples:
  kvfabric gateway --config gateway.yaml
  kvfabric gateway --config gateway.yaml --port 9000
  kvfabric gateway --config gateway.yaml --check     validate the file and exit"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        commands,
        "gateway",
        help="OpenAI-compatible front door: phase placement by cost, tenant fair queues",
        description=DESCRIPTION,
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="the gateway's YAML file")
    parser.add_argument("--host", default=None, help="listen address (default: the file's host)")
    parser.add_argument("--port", type=int, default=None, help="port (default: the file's port)")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import logging
    import sys

    from kvfabric.gateway.config import load_gateway_config

    try:
        config = load_gateway_config(args.config, {"host": args.host, "port": args.port})
    except KVFabricError as exc:
        print(f"kvfabric gateway: {exc}", file=sys.stderr)
        return 2
    if args.check:
        engines = ", ".join(f"{e.id} ({e.role}, {e.hardware_class})" for e in config.engines)
        print(f"{args.config}: ok; model {config.model}; engines {engines}")
        return 0
    import uvicorn

    from kvfabric.gateway.app import Gateway

    logging.getLogger("kvfabric").setLevel(logging.INFO)
    uvicorn.run(
        Gateway(config).app(),
        host=config.host,
        port=config.port,
        log_level="warning",
        log_config=None,  # its lines go through the CLI's handler (--log-format)
        timeout_keep_alive=30,
        loop="auto",  # uvloop where installed (a dependency of kvfabric on CPython)
        http="auto",  # httptools where installed
        access_log=False,
    )
    return 0
