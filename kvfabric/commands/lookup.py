"""``kvfabric lookup``: how much of a prompt's KV the node holds, and in which tiers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kvfabric.commands.common import (EXIT_USAGE, add_socket_arg, add_token_arg, connect,
                                      daemon_error, fail)
from kvfabric.commands.tokens import parse_tokens, read_tokens_file
from kvfabric.errors import KVFabricError
from kvfabric.lookup import LookupResult
from kvfabric.spec import DEFAULT_CHUNK_TOKENS, AttentionKind, KVSpec, Namespace


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("lookup", help="how much of a prompt the daemon holds")
    model = parser.add_argument_group("namespace (as the engine's connector configures it)")
    model.add_argument("--model", required=True, help="model id")
    model.add_argument("--layers", type=int, required=True)
    model.add_argument("--kv-heads", type=int, required=True)
    model.add_argument("--head-dim", type=int, required=True)
    model.add_argument("--dtype", default="bfloat16")
    model.add_argument("--kind", default="mha", choices=[k.value for k in AttentionKind])
    model.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    model.add_argument("--tenant", default="", help="tenant salt ('' for none)")
    model.add_argument("--lora", default="", help="LoRA adapter id ('' for the base model)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens-file", type=Path, metavar="FILE",
                        help="JSON list, .npy array, or whitespace / comma separated ints")
    prompt.add_argument("--tokens", metavar='"1 2 3 ..."', help="the token ids inline")
    add_socket_arg(parser)
    add_token_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        ns = namespace_of(args)
        tokens = read_tokens_file(args.tokens_file) if args.tokens_file else \
            parse_tokens(args.tokens)
    except ValueError as exc:  # SpecError, or JSON that does not parse
        return fail("lookup", str(exc), EXIT_USAGE)
    try:
        with connect(args) as client:
            result = client.lookup(ns, tokens=tokens)
    except KVFabricError as exc:
        return daemon_error("lookup", exc)
    print(json.dumps(as_json(result, tokens, ns)) if args.json else render(result, tokens, ns))
    return 0


def namespace_of(args: argparse.Namespace) -> Namespace:
    spec = KVSpec(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                  dtype=args.dtype, kind=args.kind, chunk_tokens=args.chunk_tokens)
    return Namespace(args.model, spec, tenant_salt=args.tenant, lora_id=args.lora)


def as_json(result: LookupResult, tokens: np.ndarray, ns: Namespace) -> dict[str, object]:
    return {"matched_tokens": result.matched_tokens, "total_tokens": int(tokens.size),
            "matched_chunks": result.matched_chunks,
            "requested_chunks": result.requested_chunks,
            "chunk_tokens": ns.spec.chunk_tokens, "tiers": dict(result.tier_tokens)}


def render(result: LookupResult, tokens: np.ndarray, ns: Namespace) -> str:
    share = result.matched_tokens / tokens.size if tokens.size else 0.0
    lines = [(f"matched {result.matched_tokens} / {tokens.size} tokens ({share:.1%}); "
              f"{result.matched_chunks} / {result.requested_chunks} full chunks of "
              f"{ns.spec.chunk_tokens} tokens")]
    lines += [f"  {tier:10} {count:>10} tokens" for tier, count in result.tier_tokens.items()]
    return "\n".join(lines)
