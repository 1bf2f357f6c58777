"""A page one SGLang engine stored on its node is found and loaded by an engine on another
node: the backend asks the global index (a real redis-server) and has its daemon pull."""

from __future__ import annotations

import time
from typing import Any

from cluster_nodes import cluster_node

GEOMETRY = {"layer_num": 3, "head_num": 2, "head_dim": 96, "page_size": 4}


TIERS = (
    "store.tiers.dram.capacity=16MiB",
    "store.tiers.dram.page_size=4KiB",
    "store.tiers.ssd.capacity=32MiB",
)


def node_settings(redis_url: str, node_id: str) -> list[str]:
    return cluster_node(redis_url, node_id, transport="socket", tiers=TIERS)


def test_a_second_node_pulls_pages_through_the_global_index(
    redis_server: Any, start_daemon: Any, make_backend: Any, make_pool: Any, page_keys: Any
) -> None:
    a = start_daemon(*node_settings(redis_server.url, "node-a"))
    b = start_daemon(*node_settings(redis_server.url, "node-b"))
    source = make_pool(layout="page_first", **GEOMETRY)
    source.fill_random(11)
    keys = page_keys(list(range(5 * 4)), 4)
    prefill = make_backend(source, a.socket, cache_salt="t1")
    assert prefill.batch_set_v1(keys, source.host_indices([0, 1, 2, 3, 4])) == [True] * 5

    target = make_pool(layout="layer_first", **GEOMETRY)
    decode = make_backend(target, b.socket, cache_salt="t1")
    other_tenant = make_backend(
        make_pool(layout="layer_first", **GEOMETRY), b.socket, cache_salt="t2"
    )
    deadline = time.monotonic() + 10  # the index learns of node a's pages asynchronously
    while (hit := decode.batch_exists(keys)) < 5:
        assert time.monotonic() < deadline, f"node b sees {hit} of 5 pages"
        time.sleep(0.1)
    assert decode.get_stats().totals["pulled_pages"] == 5
    assert decode.batch_get_v1(keys, target.host_indices([5, 6, 7, 8, 9])) == [True] * 5
    # different host layouts on the two nodes: compare the pages in canonical order
    from kvfabric_connectors.sglang.layout import PageLayout

    src, dst = PageLayout.of_pool(source, False), PageLayout.of_pool(target, False)
    for page in range(5):
        assert src.canonical(source.get_data_page(page * 4, flat=False)).equal(
            dst.canonical(target.get_data_page((page + 5) * 4, flat=False))
        )
    assert other_tenant.batch_exists(keys) == 0

    b.kill()  # node b gone: node a's engine is unaffected, node b's engine misses
    assert decode.batch_exists(keys) == 0
    assert prefill.batch_exists(keys) == 5
