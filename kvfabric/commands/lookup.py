"""``kvfabric lookup``: how much of a prompt's KV the node holds, and in which tiers.

The namespace and prompt flags (:func:`add_namespace_args`, :func:`add_prompt_args`) are
shared with ``kvfabric put``, which stores what ``lookup`` finds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from kvfabric.commands.common import (
    EXIT_USAGE,
    add_command,
    add_socket_arg,
    add_token_arg,
    connect,
    daemon_error,
    fail,
)
from kvfabric.errors import KVFabricError

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing at start-up
if TYPE_CHECKING:
    import numpy as np

    from kvfabric.lookup import LookupResult
    from kvfabric.spec import Namespace

# kvfabric.spec's AttentionKind values and DEFAULT_CHUNK_TOKENS, written out so that --help
# does not import numpy (tests/unit/test_cli_startup.py checks they agree)
ATTENTION_KINDS = ("mha", "mla")
DEFAULT_CHUNK_TOKENS = 256

DESCRIPTION = """Ask the daemon how much of a prompt's KV it holds: the longest stored prefix,
in tokens and whole chunks, and which tiers hold it. The namespace flags must match what the
engine's connector uses (model id, layers, KV heads, head dim, dtype), or nothing matches.

example:
  echo "[1, 2, 3, 4]" > prompt.json
  kvfabric lookup --model M --layers 32 --kv-heads 8 --head-dim 128 --tokens-file prompt.json"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_prompt_command(
        commands, "lookup", "how much of a prompt the daemon holds", DESCRIPTION, run
    )


def add_prompt_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    help: str,
    description: str,
    handler: Callable[[argparse.Namespace], int],
) -> None:
    """A subcommand about one prompt of one namespace at the node's daemon."""
    parser = add_command(commands, name, help=help, description=description)
    add_namespace_args(parser)
    add_prompt_args(parser)
    add_socket_arg(parser)
    add_token_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=handler)


def add_namespace_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("namespace (as the engine's connector configures it)")
    model.add_argument("--model", required=True, help="model id")
    model.add_argument("--layers", type=int, required=True)
    model.add_argument("--kv-heads", type=int, required=True)
    model.add_argument("--head-dim", type=int, required=True)
    model.add_argument("--dtype", default="bfloat16")
    model.add_argument("--kind", default="mha", choices=ATTENTION_KINDS)
    model.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    model.add_argument("--tenant", default="", help="tenant salt ('' for none)")
    model.add_argument("--lora", default="", help="LoRA adapter id ('' for the base model)")


def add_prompt_args(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--tokens-file",
        type=Path,
        metavar="FILE",
        help="JSON list, .npy array, or whitespace / comma separated ints",
    )
    prompt.add_argument("--tokens", metavar='"1 2 3 ..."', help="the token ids inline")


def prompt_of(args: argparse.Namespace) -> tuple[Namespace, np.ndarray]:
    """The namespace and token ids the flags name; ValueError (SpecError) when invalid."""
    from kvfabric.commands.tokens import parse_tokens, read_tokens_file

    tokens = read_tokens_file(args.tokens_file) if args.tokens_file else parse_tokens(args.tokens)
    return namespace_of(args), tokens


def run(args: argparse.Namespace) -> int:
    try:
        ns, tokens = prompt_of(args)
    except ValueError as exc:  # SpecError, or JSON that does not parse
        return fail("lookup", str(exc), EXIT_USAGE)
    try:
        with connect(args) as client:
            result = client.lookup(ns, tokens=tokens)
    except KVFabricError as exc:
        return daemon_error("lookup", exc)
    if args.json:
        import json

        print(json.dumps(as_json(result, tokens, ns)))
    else:
        print(render(result, tokens, ns))
    return 0


def namespace_of(args: argparse.Namespace) -> Namespace:
    from kvfabric.spec import KVSpec, Namespace

    spec = KVSpec(
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        kind=args.kind,
        chunk_tokens=args.chunk_tokens,
    )
    return Namespace(args.model, spec, tenant_salt=args.tenant, lora_id=args.lora)


def as_json(result: LookupResult, tokens: np.ndarray, ns: Namespace) -> dict[str, object]:
    return {
        "matched_tokens": result.matched_tokens,
        "total_tokens": int(tokens.size),
        "matched_chunks": result.matched_chunks,
        "requested_chunks": result.requested_chunks,
        "chunk_tokens": ns.spec.chunk_tokens,
        "tiers": dict(result.tier_tokens),
    }


def render(result: LookupResult, tokens: np.ndarray, ns: Namespace) -> str:
    share = result.matched_tokens / tokens.size if tokens.size else 0.0
    lines = [
        (
            f"matched {result.matched_tokens} / {tokens.size} tokens ({share:.1%}); "
            f"{result.matched_chunks} / {result.requested_chunks} full chunks of "
            f"{ns.spec.chunk_tokens} tokens"
        )
    ]
    lines += [f"  {tier:10} {count:>10} tokens" for tier, count in result.tier_tokens.items()]
    return "\n".join(lines)
