"""A real daemon publishes its inventory as vLLM KV events (``kv_events``,
:mod:`kvfabric.kvevents`), and what a router or an engine connector reads is right.

Why: a KV-aware router (vllm-router ``kv_aware``) credits a worker with the prompt blocks its
node's stream announces; a wrong token id, medium or parent, a removal that is never
announced, a replay that does not bring a late router up to date, or a tenant's prompts on
an unauthenticated socket, each misroutes requests or leaks prompts. So every payload here
is decoded by vLLM's own ``msgspec.msgpack.Decoder(KVEventBatch)`` (the contract), read the
way vllm-router 0.1.17 reads it (tests/support/kv_event_stream.py: topic ``""``, gaps filled
by its replay protocol, a restart forgets the source), and block hashes are recomputed here
from the documented rule (``xxh3_64(key || u32le(j))``), not with the daemon's code.

Real parts only: ``kvfabric serve`` processes with authentication on (an admin and two
tenant tokens), a DRAM tier of a few chunks over an SSD tier (so writes demote), clients
over the Unix socket, the admin HTTP API, ZMQ sockets. Negative controls: a chunk written
without token ids is not announced; a tenant's namespace is not on the stream unless
``kv_events.tenants`` lists it; another tenant may not poll a namespace; a non-loopback
stream is refused without ``security.allow_insecure``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import xxhash
from kv_event_stream import BlockState, EventFollower, replay
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvfabric.client import Client
from kvfabric.errors import ForbiddenError, ProtocolError, UnsupportedError
from kvfabric.hashing import ChunkRef, chunk_hashes
from kvfabric.spec import KVSpec, Namespace

ADMIN = "admin-kv-events"
TOKEN_A, TOKEN_B = "tok-a", "tok-b"
# 128 KiB chunks of 32 tokens: two engine blocks each; a 1 MiB DRAM tier holds 8 of them
SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", chunk_tokens=32)
BLOCK = 16
NS = Namespace("events-model", SPEC)  # no tenant salt: on the stream
NS_A = Namespace("events-model", SPEC, tenant_salt="team-a")
NS_B = Namespace("events-model", SPEC, tenant_salt="team-b")
SETTINGS = [
    "store.tiers.dram.capacity=1MiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=64MiB",
    f"auth.token={ADMIN}",
    f"auth.tenants.{TOKEN_A}=team-a",
    f"auth.tenants.{TOKEN_B}=team-b",
    "kv_events.endpoint=tcp://127.0.0.1:*",  # ZMQ picks the port; the ready file says which
    "kv_events.replay_endpoint=tcp://127.0.0.1:*",
    f"kv_events.block_size={BLOCK}",
]
SEEN_S = 20.0  # the stream follows the change log within 50 ms; generous for a loaded host
EXIT_USAGE = 2


@pytest.fixture(scope="module")
def node(start_module_daemon):
    return start_module_daemon("events-node", *SETTINGS)


@pytest.fixture(scope="module")
def listed(start_module_daemon):
    """The same node, but its stream also names tenant team-a's namespaces, and its DRAM
    tier is large enough that nothing written here is demoted."""
    return start_module_daemon(
        "events-listed", *SETTINGS, "kv_events.tenants=team-a", "store.tiers.dram.capacity=16MiB"
    )


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch) -> None:
    monkeypatch.delenv("KVFABRIC_TOKEN", raising=False)  # the client would pick it up


def follow(daemon) -> EventFollower:
    info = daemon.info
    assert info["kv_events_endpoint"].startswith("tcp://127.0.0.1:"), info
    return EventFollower(info["kv_events_endpoint"], info["kv_events_replay_endpoint"])


def prompt(first: int, chunks: int) -> list[int]:
    return list(range(first, first + chunks * SPEC.chunk_tokens))


def hashes_of(key: bytes, num_tokens: int = SPEC.chunk_tokens) -> list[int]:
    """The documented block ids of a chunk: ``xxh3_64(key || u32le(j))``, whole blocks."""
    return [
        xxhash.xxh3_64_intdigest(key + j.to_bytes(4, "little")) for j in range(num_tokens // BLOCK)
    ]


def put_prompt(
    client: Client, ns: Namespace, tokens: list[int], *, with_tokens: bool = True
) -> list[ChunkRef]:
    refs = chunk_hashes(ns, tokens)
    start = 0
    for ref in refs:
        ids = np.asarray(tokens[start : start + ref.num_tokens], dtype="<i4")
        start += ref.num_tokens
        data = np.zeros(SPEC.layout(ref.num_tokens).nbytes, np.uint8)
        assert client.put(
            ns,
            ref.key,
            data,
            parent=ref.parent,
            num_tokens=ref.num_tokens,
            tokens=ids.tobytes() if with_tokens else None,
        )
    return refs


def blocks_of(refs: list[ChunkRef]) -> list[int]:
    return [h for ref in refs for h in hashes_of(ref.key, ref.num_tokens)]


def held_in(state: BlockState, blocks: list[int], medium: str) -> bool:
    return all((b, medium) in state.held for b in blocks)


def admin_evict(daemon, tier: str | None = None) -> int:
    response = httpx.post(
        f"{daemon.http_url}/v1/admin/evict",
        json={"tier": tier},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    response.raise_for_status()
    return int(response.json()["evicted"])


# ---------------------------------------------------------------------- the PUB stream


def test_stored_chunks_are_published_with_their_token_ids(node) -> None:
    tokens = prompt(1000, 3)
    with follow(node) as sub, Client(node.socket, token=ADMIN) as client:
        refs = put_prompt(client, NS, tokens)
        anonymous = put_prompt(client, NS, prompt(5000, 1), with_tokens=False)
        marker = put_prompt(client, NS, prompt(6000, 1))  # written after the anonymous one
        blocks = blocks_of(refs)
        state = sub.wait_until(lambda s: held_in(s, blocks + blocks_of(marker), "CPU"), SEEN_S)
        mine = [e for e in sub.events if isinstance(e, BlockStored) and e.block_hashes[0] in blocks]
    assert len(mine) == 3  # one event per chunk, two whole blocks each
    for event, ref, start in zip(mine, refs, range(0, len(tokens), SPEC.chunk_tokens), strict=True):
        assert event.block_hashes == hashes_of(ref.key)
        assert event.token_ids == tokens[start : start + SPEC.chunk_tokens]
        assert event.block_size == BLOCK and event.medium == "CPU"
        assert event.lora_name is None and event.lora_id is None
    # the chain: the root chunk has no parent, each next chunk's first block hangs under
    # the previous chunk's last block (what a router's radix tree anchors on)
    assert mine[0].parent_block_hash is None
    assert [e.parent_block_hash for e in mine[1:]] == [e.block_hashes[-1] for e in mine[:-1]]
    assert [state.tokens[b] for b in blocks] == [
        tokens[i : i + BLOCK] for i in range(0, len(tokens), BLOCK)
    ]
    # negative control: a chunk without token ids cannot be announced (consumers hash ids)
    assert not any(state.media(b) for b in blocks_of(anonymous))


def test_a_demotion_to_ssd_and_a_removal_are_published(node) -> None:
    with follow(node) as sub, Client(node.socket, token=ADMIN) as client:
        refs = put_prompt(client, NS, prompt(10_000, 4))
        blocks = blocks_of(refs)
        sub.wait_until(lambda s: held_in(s, blocks, "CPU"), SEEN_S)
        # the DRAM tier holds 8 chunks: 12 more push the older ones down to the SSD
        put_prompt(client, NS, prompt(20_000, 12))
        state = sub.wait_until(
            lambda s: (
                held_in(s, blocks, "STORAGE") and not any((b, "CPU") in s.held for b in blocks)
            ),
            SEEN_S,
        )
        assert client.lookup(NS, keys=[r.key for r in refs]).tier_tokens == {
            "ssd": 4 * SPEC.chunk_tokens
        }  # the store agrees
        moved_out = [
            e for e in sub.events if isinstance(e, BlockRemoved) and e.block_hashes[0] in blocks
        ]
        assert {e.medium for e in moved_out} == {"CPU"}
        # a delete: the chunk's blocks are gone from the medium it was announced in
        last = refs[-1]
        assert client.delete(NS, last.key)
        state = sub.wait_until(lambda s: not s.media(hashes_of(last.key)[0]), SEEN_S)
        assert held_in(state, blocks_of(refs[:-1]), "STORAGE")  # the rest stays
        # an admin eviction of the SSD tier: everything there is gone, announced as such
        assert admin_evict(node, "ssd") >= 3
        state = sub.wait_until(lambda s: not any(s.media(b) for b in blocks), SEEN_S)
        removed = [
            e
            for e in sub.events
            if isinstance(e, BlockRemoved) and e.medium == "STORAGE" and e.block_hashes[0] in blocks
        ]
        assert len(removed) == 4  # the delete and three evictions
        assert client.contains(NS, [r.key for r in refs]) == [False] * 4


def test_a_late_subscriber_replays_from_zero_and_learns_the_inventory(
    start_daemon, tmp_path: Path
) -> None:
    """A router that starts after the chunks were written (here: after a daemon restart,
    which recovers them from the SSD) asks for a replay from 0 and gets a clear and then the
    inventory, with nothing published live since."""
    data_dir = tmp_path / "late"
    daemon = start_daemon(*SETTINGS, data_dir=data_dir)
    with Client(daemon.socket, token=ADMIN) as client:
        refs = put_prompt(client, NS, prompt(30_000, 3))
        gone = put_prompt(client, NS, prompt(40_000, 1))
        assert client.delete(NS, gone[0].key)
    assert daemon.stop() == 0  # persists the DRAM chunks to the SSD
    daemon = start_daemon(*SETTINGS, data_dir=data_dir)
    batches = replay(daemon.info["kv_events_replay_endpoint"], 0)
    assert batches and batches[0][0] == 0
    events = [e for _, batch in batches for e in batch.events]
    assert isinstance(events[0], AllBlocksCleared)
    state = BlockState()
    for event in events:
        state.apply(event)
    blocks = blocks_of(refs)
    assert state.held == {(b, "STORAGE") for b in blocks}  # exactly the inventory
    # the chain survives the restart: each chunk's first block still hangs under the last
    # block of the chunk before it
    per_chunk = SPEC.chunk_tokens // BLOCK
    assert [state.parent[b] for b in blocks[::per_chunk]] == [
        None,
        *blocks[per_chunk - 1 :: per_chunk][:-1],
    ]
    assert not state.media(blocks_of(gone)[0])  # negative control: deleted before the stop
    # a replay from beyond what was published answers just the end marker
    assert replay(daemon.info["kv_events_replay_endpoint"], batches[-1][0] + 1) == []


def test_tenant_namespaces_are_on_the_stream_only_when_listed(node, listed) -> None:
    seen: dict[str, BlockState] = {}
    for name, daemon in (("node", node), ("listed", listed)):
        with (
            follow(daemon) as sub,
            Client(daemon.socket, token=TOKEN_A) as a,
            Client(daemon.socket, token=TOKEN_B) as b,
            Client(daemon.socket, token=ADMIN) as admin,
        ):
            refs_a = put_prompt(a, NS_A, prompt(50_000, 2))
            refs_b = put_prompt(b, NS_B, prompt(50_000, 2))
            marker = blocks_of(put_prompt(admin, NS, prompt(60_000, 1)))
            # the stream is ordered: once the later marker is seen, the earlier ones were
            seen[name] = sub.wait_until(lambda s, m=marker: held_in(s, m, "CPU"), SEEN_S)
            blocks_a, blocks_b = blocks_of(refs_a), blocks_of(refs_b)
    assert not any(seen["node"].media(b) for b in blocks_a + blocks_b)
    assert held_in(seen["listed"], blocks_a, "CPU")  # the control: listed, so published
    assert not any(seen["listed"].media(b) for b in blocks_b)  # team-b is not listed


# ---------------------------------------------------------------------- the kv_events op


def test_the_kv_events_op_answers_a_snapshot_then_changes_to_its_tenant_only(listed) -> None:
    """Through the node whose DRAM holds everything: no demotion interleaves its events."""
    ns = Namespace("op-model", SPEC, tenant_salt="team-a")  # a namespace of its own
    with Client(listed.socket, token=TOKEN_A) as a, Client(listed.socket, token=TOKEN_B) as b:
        first = put_prompt(a, ns, prompt(70_000, 2))
        reply = a.kv_events(ns, -1, BLOCK)
        assert reply["snapshot"] is True and not reply["truncated"]
        events = [msgspec.convert(e, AllBlocksCleared | BlockStored) for e in reply["events"]]
        assert isinstance(events[0], AllBlocksCleared)
        assert [e.block_hashes for e in events[1:]] == [hashes_of(r.key) for r in first]
        assert [e.medium for e in events[1:]] == ["CPU", "CPU"]
        # the next poll answers only what changed since
        assert a.kv_events(ns, reply["next"], BLOCK)["events"] == []
        more = put_prompt(a, ns, prompt(80_000, 1))
        assert a.delete(ns, first[0].key)
        later = a.kv_events(ns, reply["next"], BLOCK)
        assert later["snapshot"] is False and later["next"] > reply["next"]
        assert [(e["type"], e["block_hashes"]) for e in later["events"]] == [
            ("BlockStored", hashes_of(more[0].key)),
            ("BlockRemoved", hashes_of(first[0].key)),
        ]
        # the engine's block size decides the blocks: one 32-token block per chunk
        assert [e["block_hashes"] for e in a.kv_events(ns, -1, 32)["events"][1:]] == [
            hashes_of(first[1].key)[:1],
            hashes_of(more[0].key)[:1],
        ]
        with pytest.raises(ProtocolError, match="not a multiple"):
            a.kv_events(ns, -1, 12)
        # another tenant may not read it; the namespace check is the daemon's
        with pytest.raises(ForbiddenError):
            b.kv_events(ns, -1, BLOCK)
        theirs = b.kv_events(Namespace("op-model", SPEC, tenant_salt="team-b"), -1, BLOCK)
        assert [e["type"] for e in theirs["events"]] == ["AllBlocksCleared"]  # nothing of a's


# ---------------------------------------------------------------------- the bind rule


def serve(tmp_path: Path, *settings: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "kvfabric.cli", "serve", "--data-dir", str(tmp_path)]
    args += ["--http-port", "0"]
    for item in settings:
        args += ["--set", item]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def intended(ns: Namespace, tokens: list[int]) -> list[tuple[ChunkRef, bytes]]:
    refs, start, out = chunk_hashes(ns, tokens), 0, []
    for ref in refs:
        out.append((ref, np.asarray(tokens[start : start + ref.num_tokens], "<i4").tobytes()))
        start += ref.num_tokens
    return out


def live(sub: EventFollower, client: Client) -> None:
    """Until the subscription is live (ZMQ drops what a PUB sends before a SUB joined, and
    the follower, like the router, replays only once a live batch shows a gap): a marker
    chunk now and then until one is seen."""
    deadline = time.monotonic() + SEEN_S
    for first in range(70_000, 80_000, SPEC.chunk_tokens):
        marker = blocks_of(put_prompt(client, NS, prompt(first, 1)))
        if sub.pump(0.2) and held_in(sub.state, marker, "CPU"):
            return
        assert time.monotonic() < deadline, "the stream never went live"


def test_an_admitted_prompt_is_announced_before_it_is_written(start_daemon) -> None:
    """An engine's scheduler announces the chunks it will compute (``intend``): a router
    hears of them before the step that computes them reserves them; those never written are
    withdrawn after ``kv_events.intent_ttl_s``, a written one stays."""
    daemon = start_daemon(*SETTINGS, "kv_events.intent_ttl_s=3")
    tokens = prompt(40_000, 3)
    chunks = intended(NS, tokens)
    blocks = blocks_of([ref for ref, _ in chunks])
    with follow(daemon) as sub, Client(daemon.socket, token=ADMIN) as client:
        live(sub, client)
        assert client.intend(NS, chunks) == 3
        assert client.intend(NS, chunks) == 0  # already announced
        state = sub.wait_until(lambda s: held_in(s, blocks, "CPU"), SEEN_S)
        assert [state.tokens[b] for b in blocks] == [
            tokens[i : i + BLOCK] for i in range(0, len(tokens), BLOCK)
        ]
        assert client.lookup(NS, keys=[r.key for r, _ in chunks]).matched_chunks == 0  # no data
        put_prompt(client, NS, tokens[: SPEC.chunk_tokens])  # the engine wrote chunk 0 only
        written, never = blocks[:2], blocks[2:]
        state = sub.wait_until(lambda s: not any(s.media(b) for b in never), SEEN_S)
        assert held_in(state, written, "CPU")
        # negative control: token ids that are not the chunk's own are refused, none announced
        (ref, _), (_, other) = intended(NS, prompt(50_000, 1))[0], chunks[1]
        with pytest.raises(ProtocolError, match="do not hash"):
            client.intend(NS, [(ref, other)])


def test_intend_is_refused_where_no_events_are_published(start_daemon) -> None:
    daemon = start_daemon("store.tiers.dram.capacity=1MiB")
    with Client(daemon.socket) as client, pytest.raises(UnsupportedError):
        client.intend(NS, intended(NS, prompt(0, 1)))


@pytest.mark.parametrize("auth", [(), (f"auth.token={ADMIN}",)], ids=["no-auth", "auth"])
def test_a_non_loopback_stream_is_refused_without_allow_insecure(
    tmp_path: Path, auth: tuple[str, ...]
) -> None:
    """ZMQ has no tokens: even with authentication on, anyone who reaches the port reads
    prompts' token ids."""
    proc = serve(tmp_path, *auth, "kv_events.endpoint=tcp://0.0.0.0:*")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_USAGE, out
    assert "KV events on tcp://0.0.0.0:*" in out and "security.allow_insecure" in out


def test_allow_insecure_lets_a_non_loopback_stream_start(start_daemon) -> None:
    """The control: the same setting with ``security.allow_insecure`` binds (0.0.0.0 is
    fine in a test: it connects over loopback) and says so."""
    daemon = start_daemon("kv_events.endpoint=tcp://0.0.0.0:*", "security.allow_insecure=true")
    assert daemon.info["kv_events_endpoint"].startswith("tcp://0.0.0.0:")
    assert "INSECURE: KV events on tcp://0.0.0.0:*" in daemon.read_log()
