"""A node's KV event stream names the chunks other nodes hold, with their ownership.

Why: a node can pull any chunk another live node holds, so a router that reads its stream
(vllm-router ``kv_aware``) should credit its engine for those, as external blocks: a
``BlockStored`` with ``ownership`` ``kvfabric:<owner>`` and ``locality`` ``REMOTE``. A
router removes such a claim only on a ``BlockRemoved`` with the same ownership and medium
(``AllBlocksCleared`` does not), so a removal that names another ownership leaves the
router crediting a chunk nobody holds.

Real parts only: three ``kvfabric serve`` processes on one real redis-server (the global
index and its event stream), chunks put with their token ids through a client, the streams
read by a subscriber that behaves like vllm-router (tests/support/kv_event_stream.py, every
payload decoded by vLLM's ``msgspec.msgpack.Decoder(KVEventBatch)``). Block hashes are
recomputed from the documented rule (``xxh3_64(key || u32le(j))``). Negative controls: a
node's own chunks are not named as remote; with ``kv_events.remote=false`` none are.
"""

from __future__ import annotations

import time

import xxhash
from cluster_nodes import cluster_node, put_random_chain
from kv_event_stream import EventFollower
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvfabric.client import Client
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=32)
NS = Namespace("remote-events-model", SPEC)
BLOCK = 16
SEEN_S = 20.0
STREAM = (
    "kv_events.endpoint=tcp://127.0.0.1:*",
    "kv_events.replay_endpoint=tcp://127.0.0.1:*",
    f"kv_events.block_size={BLOCK}",
)


def hashes_of(key: bytes) -> list[int]:
    return [
        xxhash.xxh3_64_intdigest(key + j.to_bytes(4, "little"))
        for j in range(SPEC.chunk_tokens // BLOCK)
    ]


def follow(daemon) -> EventFollower:  # type: ignore[no-untyped-def]
    return EventFollower(
        daemon.info["kv_events_endpoint"], daemon.info["kv_events_replay_endpoint"]
    )


def live(follower: EventFollower, daemon) -> None:  # type: ignore[no-untyped-def]
    """Until the subscription is live: ZMQ drops what a PUB sends before a SUB joined, and
    the follower (like the router) replays only once a live batch shows a gap, so a node
    whose only batches went out before that would never be heard. A marker chunk of the
    node's own now and then until one is seen."""
    deadline = time.monotonic() + SEEN_S
    first = 900_000
    while True:
        keys, _ = put_random_chain(daemon.socket, NS, 1, first_token=first)
        marker = {(h, "CPU") for h in hashes_of(keys[0])}
        if follower.pump(0.2) and marker <= follower.state.held:
            return
        assert time.monotonic() < deadline, "the stream never went live"
        first += SPEC.chunk_tokens


def test_other_nodes_chunks_are_announced_with_their_ownership_and_removed_alike(
    redis_server, start_daemon
) -> None:
    a = start_daemon(*cluster_node(redis_server.url, "node-a"))
    b = start_daemon(*cluster_node(redis_server.url, "node-b", *STREAM))
    quiet = start_daemon(
        *cluster_node(redis_server.url, "node-q", *STREAM, "kv_events.remote=false")
    )
    with follow(b) as on_b, follow(quiet) as on_quiet:
        live(on_b, b)
        keys, _ = put_random_chain(a.socket, NS, 3)
        mine, _ = put_random_chain(b.socket, NS, 1, first_token=10_000)
        theirs = {(h, "CPU", "kvfabric:node-a") for key in keys for h in hashes_of(key)}
        own = {(h, "CPU") for h in hashes_of(mine[0])}
        # b's own chunk and a's arrive on two paths (b's store, the cluster's stream): either
        # may come first
        state = on_b.wait_until(lambda s: theirs <= s.owned and own <= s.held, SEEN_S)
        assert state.owned == theirs  # and nothing else: b's own chunk is not remote
        stored = [e for e in on_b.events if isinstance(e, BlockStored) and e.ownership]
        assert {e.locality for e in stored} == {"REMOTE"}
        assert [t for e in stored for t in e.token_ids] == list(range(3 * SPEC.chunk_tokens))
        assert stored[0].parent_block_hash is None
        assert stored[1].parent_block_hash == hashes_of(keys[0])[-1]

        with Client(a.socket) as client:
            assert client.delete(NS, keys[2])
        gone = {(h, "CPU", "kvfabric:node-a") for h in hashes_of(keys[2])}
        state = on_b.wait_until(lambda s: not gone & s.owned, SEEN_S)
        assert state.owned == theirs - gone
        (removal,) = [e for e in on_b.events if isinstance(e, BlockRemoved)]
        assert (removal.ownership, removal.medium, removal.locality) == (
            "kvfabric:node-a",
            "CPU",
            "REMOTE",
        )
        assert removal.block_hashes == hashes_of(keys[2])

        # negative control: the node configured without remote chunks names its own only
        own_q, _ = put_random_chain(quiet.socket, NS, 1, first_token=20_000)
        seen = on_quiet.wait_until(
            lambda s: {(h, "CPU") for h in hashes_of(own_q[0])} <= s.held, SEEN_S
        )
        on_quiet.pump(1.0)
        assert seen.owned == set()
        assert not any(getattr(e, "ownership", None) for e in on_quiet.events)
        # ...while b names the quiet node's chunk as the quiet node's
        on_b.wait_until(
            lambda s: {(h, "CPU", "kvfabric:node-q") for h in hashes_of(own_q[0])} <= s.owned,
            SEEN_S,
        )
