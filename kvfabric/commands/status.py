"""``kvfabric status``: tiers, hit rates and counters of a running daemon.

From the control socket (``stats`` request: the store's snapshot as a mapping) or from the
HTTP API (``GET /v1/stats``); both are brought into the HTTP shape before printing, so
``--json`` prints the same document either way (over HTTP it also has the daemon's uptime,
readiness and session count).
"""

from __future__ import annotations

import argparse

from kvfabric.commands.common import (
    add_command,
    add_socket_arg,
    add_token_arg,
    connect,
    daemon_error,
    token_of,
)
from kvfabric.errors import KVFabricError, ProtocolError, UnavailableError, error_for_kind

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing at start-up
if TYPE_CHECKING:
    from typing import Any

HTTP_TIMEOUT_S = 10.0

DESCRIPTION = """\
Print a running daemon's tiers (capacity, use, objects), its token hit rate and counters, and
the hit rate per tenant. Asks the control socket by default, or the HTTP API with --url (which
adds the daemon's uptime, readiness and session count).

examples:
  kvfabric status
  kvfabric status --url http://127.0.0.1:8790 --json"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        commands,
        "status",
        help="tiers, hit rates and counters of a daemon",
        description=DESCRIPTION,
    )
    source = parser.add_mutually_exclusive_group()
    add_socket_arg(source)
    source.add_argument(
        "--url",
        default=None,
        metavar="http://HOST:PORT",
        help="ask the HTTP API instead of the socket",
    )
    add_token_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvfabric.commands.stats_table import render

    try:
        stats = _from_http(args.url, token_of(args)) if args.url else _from_socket(args)
    except KVFabricError as exc:
        return daemon_error("status", exc)
    if args.json:
        import json

        print(json.dumps(stats, indent=2))
    else:
        print(render(stats))
    return 0


def _from_socket(args: argparse.Namespace) -> dict[str, Any]:
    from kvfabric.commands.stats_table import from_store_stats

    with connect(args) as client:
        return from_store_stats(client.stats(), node_id=client.node_id)


def _from_http(url: str, token: str | None) -> dict[str, Any]:
    import json
    import urllib.error  # http.client and email: ~20 ms, only for --url
    import urllib.request

    request = urllib.request.Request(
        url.rstrip("/") + "/v1/stats", headers={"Accept": "application/json"}
    )
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return dict(json.load(response))
    except urllib.error.HTTPError as exc:  # before OSError: it is one
        raise _api_error(exc) from None
    except urllib.error.URLError as exc:
        raise UnavailableError(f"cannot reach the kvfabric daemon at {url}: {exc.reason}") from None
    except OSError as exc:  # reset or timed out mid-reply
        raise UnavailableError(f"lost the kvfabric daemon at {url}: {exc}") from None
    except ValueError:
        raise ProtocolError(f"{url} did not answer with kvfabric statistics") from None


def _api_error(exc: Any) -> KVFabricError:
    """The API's ``{"error": {"kind", "message"}}`` as the matching kvfabric error."""
    import json

    try:
        error = json.load(exc)["error"]
        return error_for_kind(str(error["kind"]), f"HTTP {exc.code}: {error['message']}")
    except (ValueError, KeyError, TypeError):
        return ProtocolError(f"HTTP {exc.code}: {exc.reason}")
