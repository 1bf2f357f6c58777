"""``kvfabric put``: store a prompt's KV in a running daemon, so ``status`` and ``lookup``
show hits without an engine.

The KV is synthetic (zeros of the namespace's geometry): this is for trying the fabric out,
warming a node for a test, or checking a deployment end to end; engines store real KV through
their connectors. Every chunk of the prompt is stored, the partial last one included, as a
prefill would; chunks the node already holds are left as they are (a second run stores
nothing), so the command can be repeated.
"""

from __future__ import annotations

import argparse
import time

from kvfabric.commands.common import EXIT_USAGE, connect, daemon_error, fail
from kvfabric.commands.lookup import add_prompt_command, prompt_of
from kvfabric.errors import KVFabricError

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing at start-up
if TYPE_CHECKING:
    import numpy as np

    from kvfabric.client import Client
    from kvfabric.spec import Namespace

BATCH_CHUNKS = 8  # chunks reserved at once: a long prompt never holds much of a tier

DESCRIPTION = """\
Store a prompt's KV (synthetic: zeros of the namespace's geometry) in the running daemon, every
chunk of the prompt including the partial last one, as a prefill would; chunks it already holds
are kept. Then `kvfabric lookup` with the same flags finds the prompt and `kvfabric status`
counts the hit. Engines store real KV through their connectors.

example:
  python3 -c 'import json; print(json.dumps(list(range(1000))))' > prompt.json
  kvfabric put    --model M --layers 32 --kv-heads 8 --head-dim 128 --tokens-file prompt.json
  kvfabric lookup --model M --layers 32 --kv-heads 8 --head-dim 128 --tokens-file prompt.json
  kvfabric status"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_prompt_command(
        commands, "put", "store a prompt's (synthetic) KV in the daemon", DESCRIPTION, run
    )


def run(args: argparse.Namespace) -> int:
    try:
        ns, tokens = prompt_of(args)
    except ValueError as exc:  # SpecError, or JSON that does not parse
        return fail("put", str(exc), EXIT_USAGE)
    if tokens.size == 0:
        return fail("put", "the prompt has no tokens", EXIT_USAGE)
    started = time.perf_counter()
    try:
        with connect(args) as client:
            stored, present, nbytes = put_prompt(client, ns, tokens)
    except KVFabricError as exc:
        return daemon_error("put", exc)
    took_s = time.perf_counter() - started
    if args.json:
        import json

        print(
            json.dumps(
                {
                    "stored_chunks": stored,
                    "already_stored_chunks": present,
                    "stored_bytes": nbytes,
                    "total_tokens": int(tokens.size),
                    "chunk_tokens": ns.spec.chunk_tokens,
                    "seconds": round(took_s, 3),
                }
            )
        )
    else:
        print(
            f"stored {stored} chunks ({nbytes / 2**20:.1f} MiB) of {tokens.size} tokens in "
            f"{took_s * 1e3:.0f} ms; {present} chunks were stored already"
        )
    return 0


def put_prompt(client: Client, ns: Namespace, tokens: np.ndarray) -> tuple[int, int, int]:
    """Store every chunk of ``tokens`` the node lacks: (stored, already there, bytes)."""
    import numpy as np

    from kvfabric.hashing import chunk_hashes
    from kvfabric.spec import ChunkLayout

    refs = chunk_hashes(ns, tokens)  # the partial last chunk included
    stored = present = nbytes = 0
    for first in range(0, len(refs), BATCH_CHUNKS):
        batch = refs[first : first + BATCH_CHUNKS]
        payloads = [
            np.zeros(ChunkLayout(ns.spec, ref.num_tokens).nbytes, np.uint8) for ref in batch
        ]
        step = ns.spec.chunk_tokens  # each chunk's own tokens go with it (the node keeps them)
        own = [tokens[j * step : j * step + ref.num_tokens] for j, ref in enumerate(batch, first)]
        done = client.put_many(ns, batch, payloads, tokens=own)  # False: the node held it already
        stored += sum(done)
        present += len(done) - sum(done)
        nbytes += sum(p.nbytes for p, new in zip(payloads, done) if new)
    return stored, present, nbytes
