"""Scheduler side of the vLLM connector: lookups, load slices and save planning, against a
real daemon with vLLM's own Request and SchedulerOutput objects."""

from __future__ import annotations

import time

import numpy as np
import pytest
from scrape import sample, scrape
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvfabric.client import Client
from kvfabric.errors import TokenMismatchError
from kvfabric.hashing import chunk_hashes, verify_chunk_tokens
from kvfabric.spec import KVSpec
from kvfabric_connectors.vllm.metadata import ChunkSlice
from kvfabric_connectors.vllm.namespace import Namespaces
from kvfabric_connectors.vllm.scheduler import SchedulerSide
from kvfabric_connectors.vllm.settings import ConnectorSettings

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=16)
NAMESPACES = Namespaces("sched-model", SPEC)
PROMPT = list(range(1000, 1040))  # chunks of 16, 16 and a partial 8


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("sched", "store.tiers.dram.capacity=64MiB")


def side(socket: str, *, loads: bool = True, saves: bool = True, **extra) -> SchedulerSide:
    settings = ConnectorSettings.from_extra_config({"socket_path": socket, **extra})
    return SchedulerSide(settings, NAMESPACES, loads=loads, saves=saves)


def request(
    rid: str, tokens: list[int], *, salt: str | None = None, params: dict | None = None
) -> Request:
    extra = {"kv_transfer_params": params} if params else None
    return Request(
        rid, tokens, SamplingParams(max_tokens=1, extra_args=extra), None, cache_salt=salt
    )


def store(socket: str, tokens: list[int], salt: str = "", chunks: int | None = None) -> None:
    refs = chunk_hashes(NAMESPACES.get(salt, ""), tokens)[:chunks]
    with Client(socket) as client:
        client.put_many(
            NAMESPACES.get(salt, ""),
            refs,
            [np.zeros(SPEC.layout(r.num_tokens).nbytes, np.uint8) for r in refs],
        )


def step(
    new: list[tuple[str, list[int], list[int], int, int]] = (),
    cached: list[tuple[str, list[int] | None, int, int]] = (),
) -> SchedulerOutput:
    """new: (id, prompt, block ids, computed, scheduled); cached: (id, new block ids,
    computed, scheduled)."""
    news = [
        NewRequestData(rid, tokens, [], None, None, (list(blocks),), computed, None)
        for rid, tokens, blocks, computed, _ in new
    ]
    cached_data = CachedRequestData.make_empty()
    for rid, blocks, computed, _ in cached:
        cached_data.req_ids.append(rid)
        cached_data.new_block_ids.append(None if blocks is None else (list(blocks),))
        cached_data.num_computed_tokens.append(computed)
    scheduled = {r[0]: r[4] for r in new} | {r[0]: r[3] for r in cached}
    return SchedulerOutput(news, cached_data, scheduled, sum(scheduled.values()), {}, {}, set(), [])


def test_a_miss_is_zero_and_a_hit_counts_chunks_capped_one_short(daemon) -> None:
    sched = side(daemon.socket)
    prompt = [t + 1 for t in PROMPT]
    assert sched.get_num_new_matched_tokens(request("miss", prompt), 0) == (0, False)
    store(daemon.socket, prompt)
    assert sched.get_num_new_matched_tokens(request("hit", prompt), 0) == (39, False)
    # vLLM's own prefix hit comes first: only the rest is loaded
    assert sched.get_num_new_matched_tokens(request("hit2", prompt), 16) == (23, False)
    sched.close()


def test_load_slices_cover_exactly_the_tokens_to_load(daemon) -> None:
    prompt = [t + 2 for t in PROMPT]
    store(daemon.socket, prompt, chunks=2)  # two full chunks: 32 tokens
    sched = side(daemon.socket, saves=False)
    req = request("load", prompt)
    assert sched.get_num_new_matched_tokens(req, 16) == (16, False)
    sched.update_state_after_alloc(req, None, 16)
    meta = sched.build_connector_meta(step(new=[("load", prompt, [7, 8, 9], 32, 8)]))
    (load,) = meta.loads
    refs = chunk_hashes(NAMESPACES.get("", ""), prompt)
    assert load.block_ids == (7, 8, 9)
    assert load.chunks == (ChunkSlice(refs[1].key, refs[1].parent, 16, 16, 0, 16),)
    assert meta.saves == ()
    sched.close()


def test_a_failed_load_is_not_offered_again(daemon) -> None:
    """Regression (the soak's engine under chaos): a load failed (its chunks were lost
    before they could be copied), vLLM rescheduled the request to recompute and asked the
    connector again, and the connector offered the same cached hit: the load failed again,
    2,334 times in 46 s, until the request timed out. Now a failed load forgets the hit and
    the next offer asks the daemon (old code: (32, False) again)."""
    prompt = [t + 9 for t in PROMPT]
    store(daemon.socket, prompt, chunks=2)
    sched = side(daemon.socket, saves=False)
    req = request("lost", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (32, False)
    sched.update_state_after_alloc(req, None, 32)
    sched.build_connector_meta(step(new=[("lost", prompt, [7, 8, 9], 32, 8)]))
    with Client(daemon.socket) as client:  # the chunks go away before the load copies them
        for ref in chunk_hashes(NAMESPACES.get("", ""), prompt)[:2]:
            assert client.delete(NAMESPACES.get("", ""), ref.key)
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids={8}))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    # a failure in another request's blocks changes nothing here
    other = request("kept", [t + 10 for t in PROMPT])
    store(daemon.socket, [t + 10 for t in PROMPT], chunks=2)
    assert sched.get_num_new_matched_tokens(other, 0) == (32, False)
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids={99}))
    assert sched.get_num_new_matched_tokens(other, 0) == (32, False)
    sched.close()


def test_saves_follow_chunked_prefill_and_include_the_partial_last_chunk(daemon) -> None:
    prompt = [t + 3 for t in PROMPT]
    sched = side(daemon.socket, loads=False)
    req = request("save", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    refs = chunk_hashes(NAMESPACES.get("", ""), prompt)
    first = sched.build_connector_meta(step(new=[("save", prompt, [1, 2], 0, 20)]))
    assert [c.key for c in first.saves[0].chunks] == [refs[0].key]  # 16 of 20 done
    second = sched.build_connector_meta(step(cached=[("save", [3], 20, 20)]))
    (save,) = second.saves
    assert save.block_ids == (1, 2, 3)
    assert [(c.key, c.start, c.num_tokens) for c in save.chunks] == [
        (refs[1].key, 16, 16),
        (refs[2].key, 32, 8),
    ]
    # each save carries its chunk's own token ids: they hash to its key
    ns = NAMESPACES.get("", "")
    saved = [*first.saves[0].chunks, *save.chunks]
    for chunk in saved:
        assert chunk.tokens == np.array(prompt[chunk.start :][: chunk.num_tokens], "<i4").tobytes()
        verify_chunk_tokens(ns, chunk.key, chunk.parent, chunk.num_tokens, chunk.tokens)
    with pytest.raises(TokenMismatchError):  # negative control: another chunk's ids do not
        verify_chunk_tokens(ns, saved[1].key, saved[1].parent, 16, saved[0].tokens)
    assert sched.build_connector_meta(step(cached=[("save", None, 40, 1)])).saves == ()
    store(daemon.socket, prompt)  # what the worker side does with those saves
    finished, params = sched.request_finished(req)
    assert not finished and params == {"kvfabric": {"tokens": 40}}
    sched.close()


def test_a_producer_announces_only_the_tokens_the_fabric_holds(daemon) -> None:
    """Regression: on the old code a producer announced every prompt token whether or not
    its saves landed, so a consumer waited expect_timeout_s for KV never stored."""
    prompt = [t + 9 for t in PROMPT]
    sched = side(daemon.socket, loads=False)
    nothing = request("nothing", prompt)
    sched.get_num_new_matched_tokens(nothing, 0)
    assert sched.request_finished(nothing) == (False, None)  # no save landed
    store(daemon.socket, prompt, chunks=1)  # the first chunk only: 16 tokens
    some = request("some", prompt)
    sched.get_num_new_matched_tokens(some, 0)
    assert sched.request_finished(some) == (False, {"kvfabric": {"tokens": 16}})
    sched.close()


def test_a_producer_whose_daemon_refuses_its_token_announces_nothing(
    start_module_daemon, monkeypatch
) -> None:
    """The configs' example engine commands passed no token to a daemon with auth on.
    Regression: on the old code the producer still returned {"kvfabric": {"tokens": 40}}
    for KV it never stored; the link now also stays away after the refusal instead of
    trying a hello on every request."""
    monkeypatch.delenv("KVFABRIC_TOKEN", raising=False)
    guarded = start_module_daemon(
        "sched-auth", "store.tiers.dram.capacity=64MiB", "auth.token=admin-9d2f"
    )
    prompt = [t + 10 for t in PROMPT]
    with Client(guarded.socket, token="admin-9d2f") as client:  # held: still not announced
        refs = chunk_hashes(NAMESPACES.get("", ""), prompt)
        client.put_many(
            NAMESPACES.get("", ""),
            refs,
            [np.zeros(SPEC.layout(r.num_tokens).nbytes, np.uint8) for r in refs],
        )
    for n, extra in enumerate(({}, {"token": "wrong"}), start=1):
        sched = side(guarded.socket, **extra)
        for i in range(3):
            req = request(f"refused-{i}", prompt)
            assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
            assert sched.request_finished(req) == (False, None)
        sched.close()
        # one refused hello per engine, counted as a failed request; then it stays away
        refused = sample(
            scrape(guarded.http_url, "admin-9d2f"),
            "kvfabric_request_errors_total",
            plane="control",
            op="hello",
            kind="unauthorized",
        )
        assert refused == n
    sched = side(guarded.socket, token="admin-9d2f")  # the control: the right token
    req = request("admitted", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (39, False)
    assert sched.request_finished(req) == (False, {"kvfabric": {"tokens": 40}})
    sched.close()


def test_chunks_the_fabric_already_holds_are_not_saved_again(daemon) -> None:
    prompt = [t + 4 for t in PROMPT]
    store(daemon.socket, prompt, chunks=1)
    sched = side(daemon.socket)
    req = request("both", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
    sched.update_state_after_alloc(req, None, 16)
    meta = sched.build_connector_meta(step(new=[("both", prompt, [1, 2, 3], 16, 24)]))
    assert len(meta.loads[0].chunks) == 1
    assert [c.start for c in meta.saves[0].chunks] == [16, 32]
    sched.close()


def test_tenants_do_not_share_hits(daemon) -> None:
    prompt = [t + 5 for t in PROMPT]
    store(daemon.socket, prompt, salt="tenant-a")
    sched = side(daemon.socket)
    assert sched.get_num_new_matched_tokens(request("a", prompt, salt="tenant-a"), 0)[0] == 39
    assert sched.get_num_new_matched_tokens(request("b", prompt, salt="tenant-b"), 0)[0] == 0
    assert sched.get_num_new_matched_tokens(request("none", prompt), 0)[0] == 0
    sched.close()


def test_a_consumer_waits_for_announced_kv_then_gives_up(daemon) -> None:
    prompt = [t + 6 for t in PROMPT]
    sched = side(daemon.socket, saves=False, expect_timeout_s=0.5)
    req = request("wait", prompt, params={"kvfabric": {"tokens": 40}})
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # not there yet
    store(daemon.socket, prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (39, False)
    late = request("late", [t + 7 for t in PROMPT], params={"kvfabric": {"tokens": 40}})
    assert sched.get_num_new_matched_tokens(late, 0) == (None, False)
    time.sleep(0.6)
    assert sched.get_num_new_matched_tokens(late, 0) == (0, False)  # compute it instead
    sched.close()


def test_behind_vllm_router_the_producer_answers_in_vllm_s_pd_dialect(daemon) -> None:
    """vllm-router's PD mode (--kv-connector nixl) sends the prefill its nixl template and
    forwards the prefill's answer verbatim to the decode engine."""
    prompt = [t + 11 for t in PROMPT]
    router_id = "cmpl-___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_" + "ab" * 16 + "-0"
    nixl = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    producer = side(daemon.socket, loads=False, push_targets={"127.0.0.1:2": "decode-b"})
    prefill = request(router_id, prompt, params=nixl)
    producer.get_num_new_matched_tokens(prefill, 0)
    (save,) = producer.build_connector_meta(step(new=[(router_id, prompt, [1, 2, 3], 0, 40)])).saves
    assert save.push_to == "decode-b"  # the decode engine the router named, mapped to its node
    store(daemon.socket, prompt)
    _, params = producer.request_finished(prefill)
    assert params == {
        "kvfabric": {"tokens": 40},
        "do_remote_prefill": True,
        "do_remote_decode": False,
    }
    producer.close()
    consumer = side(daemon.socket, saves=False)
    assert consumer.get_num_new_matched_tokens(request("decode", prompt, params=params), 0) == (
        39,
        False,
    )
    # a proxy that sends only vLLM's key: the consumer still waits for the whole prompt
    missing = request("d2", [t + 12 for t in PROMPT], params={"do_remote_prefill": True})
    assert consumer.get_num_new_matched_tokens(missing, 0) == (None, False)
    consumer.close()


def test_without_a_daemon_every_request_is_a_quick_miss(tmp_path) -> None:
    sched = side(str(tmp_path / "absent.sock"))
    started = time.monotonic()
    for i in range(20):
        assert sched.get_num_new_matched_tokens(request(f"r{i}", PROMPT), 0) == (0, False)
    assert time.monotonic() - started < 5  # no per-request reconnect storm
    sched.close()


def test_settings_refuse_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValueError, match="kv_connector_extra_config.socket: unknown key"):
        ConnectorSettings.from_extra_config({"socket": "/tmp/x"})
    with pytest.raises(ValueError, match="chunk_tokens"):
        ConnectorSettings.from_extra_config({"chunk_tokens": 0})
    with pytest.raises(ValueError, match="load_timeout_s"):
        ConnectorSettings.from_extra_config({"load_timeout_s": -1})
    with pytest.raises(ValueError, match="push_targets"):
        ConnectorSettings.from_extra_config({"push_targets": {"127.0.0.1:2": 3}})


def test_hit_sources_split_a_hit_by_the_tier_that_held_it(daemon) -> None:
    prompt = [t + 8 for t in PROMPT]
    store(daemon.socket, prompt)
    sched = side(daemon.socket)
    req = request("sources", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (39, False)
    assert sched.hit_sources(req, 39) == {"host": 39}  # the daemon's DRAM tier
    assert sched.hit_sources(req, 0) == {}
    sched.close()


def test_an_admitted_prompt_s_chunks_are_announced_to_the_node_s_kv_events(
    start_daemon,
) -> None:
    """A saving engine's scheduler announces the chunks past the fabric's hit when it looks
    a prompt up, so a router reading the node's stream can send the prompt's repeats here
    before they are computed. Control: a daemon without a stream refuses ``intend`` once
    and is not asked again."""
    daemon = start_daemon("store.tiers.dram.capacity=64MiB", "kv_events.endpoint=tcp://127.0.0.1:*")
    ns = NAMESPACES.get("", "")
    prompt = [t + 7 for t in PROMPT]
    store(daemon.socket, prompt, chunks=1)  # the fabric holds chunk 0
    sched = side(daemon.socket)
    sched.get_num_new_matched_tokens(request("intend", prompt), 0)
    with Client(daemon.socket) as client:
        keys = [r.key for r in chunk_hashes(ns, prompt)]
        again = [
            (r, np.asarray(prompt[16 * i : 16 * i + r.num_tokens], "<i4").tobytes())
            for i, r in enumerate(chunk_hashes(ns, prompt))
        ]
        assert client.intend(ns, again[1:]) == 0  # chunks 1 and 2: announced already
        assert client.intend(ns, again[:1]) == 0  # chunk 0: held, never announced
        assert client.lookup(ns, keys=keys).matched_chunks == 1  # an intent holds no data
    plain = side(start_daemon("store.tiers.dram.capacity=64MiB").socket)
    plain.get_num_new_matched_tokens(request("no-events", prompt), 0)
    assert plain._intends is False
