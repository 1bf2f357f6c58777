"""Counters that tell the truth about a pull (issue 12): a decode node whose vLLM connector
finds a prompt on another node counts it as a hit from ``peer`` (not a miss), pulls it
without a single ``not_found`` get, and counts the pull; the owner counts what it served.
Two real daemons on one real redis-server; the connector's own scheduler and worker code
drive the decode node, as vLLM would."""

from __future__ import annotations

import time

import httpx
import numpy as np
import torch
from cluster_nodes import cluster_node
from scrape import sample, scrape
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.request import Request

from kvfabric.client import Client
from kvfabric.client.objects import RemoteReader
from kvfabric.hashing import chunk_hashes
from kvfabric.protocol.messages import encode_namespace
from kvfabric.spec import KVSpec
from kvfabric_connectors.vllm.namespace import Namespaces, RankShare
from kvfabric_connectors.vllm.scheduler import SchedulerSide
from kvfabric_connectors.vllm.settings import ConnectorSettings
from kvfabric_connectors.vllm.worker import WorkerSide, _Item, _LayerLoad

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
NAMESPACES = Namespaces("pull-counters-model", SPEC)
PROMPT = list(range(500, 572))  # 72 tokens: four full chunks and a partial one of 8


def node(redis_url: str, node_id: str) -> list[str]:
    return cluster_node(redis_url, node_id, transport="socket")


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        return (self._ids,)


def _empty_step() -> SchedulerOutput:
    return SchedulerOutput([], CachedRequestData.make_empty(), {}, 0, {}, {}, set(), [])


def _total(samples: dict, name: str, **labels: str) -> float:
    """Over every series of ``name`` with these labels (whatever the tenant label)."""
    return sum(
        value
        for (sample_name, series), value in samples.items()
        if sample_name == name and set(labels.items()) <= series
    )


def _wait_until_indexed(socket: str, keys: list[bytes]) -> None:
    """Until the decode node's global index lists the whole prompt on another node."""
    deadline = time.monotonic() + 10
    with Client(socket) as client:
        while client.lookup(
            NAMESPACES.get("", ""), keys=keys, scope="cluster"
        ).cluster_chunks != len(keys):
            assert time.monotonic() < deadline, "the owner's chunks never reached the index"
            time.sleep(0.05)


def test_a_pulled_prompt_is_a_peer_hit_and_a_pull_never_a_miss_or_an_error(
    redis_server, start_daemon
) -> None:
    """Regression: on the old code the decode node counted the 72-token prompt as 80 looked-up
    tokens (the partial chunk as a full one), all of them missed, one not_found get error
    per chunk, and no pull; the owner counted nothing it served."""
    owner = start_daemon(*node(redis_server.url, "prefill-node"))
    decode = start_daemon(*node(redis_server.url, "decode-node"))
    ns = NAMESPACES.get("", "")
    refs = chunk_hashes(ns, PROMPT)
    with Client(owner.socket) as client:
        client.put_many(
            ns, refs, [np.full(SPEC.layout(r.num_tokens).nbytes, 7, np.uint8) for r in refs]
        )
    keys = [ref.key for ref in refs]
    _wait_until_indexed(decode.socket, keys)
    # a router's cluster lookup over HTTP counts the same way (by keys: full chunks)
    routed = scrape(decode.http_url)
    body = {
        "namespace": encode_namespace(ns),
        "chunk_hashes": [k.hex() for k in keys],
        "scope": "cluster",
    }
    response = httpx.post(decode.http_url + "/v1/lookup", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["matched_chunks"] == 0
    before = scrape(decode.http_url)
    assert (
        _total(before, "kvfabric_hit_tokens_total", tier="peer")
        - _total(routed, "kvfabric_hit_tokens_total", tier="peer")
        == 80
    )
    with Client(decode.socket) as client:
        peer_hits_before = client.stats()["peer_hit_tokens"]

    settings = ConnectorSettings.from_extra_config({"socket_path": decode.socket})
    sched = SchedulerSide(settings, NAMESPACES, loads=True, saves=False)
    worker = WorkerSide(
        settings, NAMESPACES, 16, torch.bfloat16, share=RankShare(None, saves=True, pushes=True)
    )
    try:
        req = Request("pd", PROMPT, SamplingParams(max_tokens=1), None)
        assert sched.get_num_new_matched_tokens(req, 0) == (71, True)  # only a peer has it
        sched.update_state_after_alloc(req, _Blocks([1, 2, 3, 4, 5]), 71)
        (transfer,) = sched.build_connector_meta(_empty_step()).loads
        assert transfer.background
        load = _LayerLoad(
            worker,
            [_Item(transfer, chunk, torch.tensor(transfer.block_ids)) for chunk in transfer.chunks],
            worker._background_link,
        )
        load._pin()  # what the background load does before copying
        assert not load.failed
        assert all(isinstance(item.handle, RemoteReader) for item in load.items)
        load._release()
    finally:
        sched.close()
        worker.close()

    after = scrape(decode.http_url)

    def grew(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert grew("kvfabric_lookup_tokens_total") == 72
    assert grew("kvfabric_hit_tokens_total", tier="peer") == 72
    assert grew("kvfabric_miss_tokens_total") == 0
    assert grew("kvfabric_engine_hit_tokens_total", engine="vllm") == 72
    assert grew("kvfabric_pull_chunks_total", outcome="pulled") == 5
    assert grew("kvfabric_pull_tokens_total") == 72
    assert grew("kvfabric_store_errors_total", op="get", kind="not_found") == 0
    assert (
        sum(
            value
            for (name, labels), value in after.items()
            if name == "kvfabric_request_errors_total"
        )
        == 0
    )
    served = scrape(owner.http_url)
    assert sample(served, "kvfabric_peer_served_chunks_total") == 5
    assert sample(served, "kvfabric_peer_served_tokens_total") == 72
    with Client(decode.socket) as client:  # what `kvfabric status` prints
        assert client.stats()["peer_hit_tokens"] - peer_hits_before == 72
