"""The LMCache plugin's key mapping, settings and adapter matching (real LMCache keys)."""

from __future__ import annotations

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat

from kvfabric.spec import MAX_HEAD_DIM
from kvfabric_connectors.lmcache import KVFabricConnectorAdapter
from kvfabric_connectors.lmcache.keys import chunk_key, layout_tag, namespace_for, opaque_spec
from kvfabric_connectors.lmcache.settings import PluginSettings

SHAPES = [torch.Size([2, 4, 256, 1024])]
LAYOUT = layout_tag(MemoryFormat.KV_2LTD, SHAPES, [torch.bfloat16])


def key(
    model: str = "m",
    worker: int = 0,
    world: int = 2,
    chunk: int = 7,
    dtype: torch.dtype = torch.bfloat16,
    tags: dict | None = None,
) -> CacheEngineKey:
    return CacheEngineKey(model, world, worker, chunk, dtype, request_configs=tags)


@pytest.mark.parametrize("token_bytes", [16_384, 2 * 32 * 1024 * 2, 2 * 61 * 576 * 2, 3, 1 << 20])
def test_the_opaque_spec_holds_exactly_the_chunk_bytes(token_bytes: int) -> None:
    spec = opaque_spec(token_bytes, 256)
    assert spec.head_dim <= MAX_HEAD_DIM
    assert spec.layout(256).nbytes == 256 * token_bytes
    assert spec.layout(5).nbytes == 5 * token_bytes  # an unfull chunk keeps its length


def test_a_token_size_that_no_spec_describes_is_refused() -> None:
    with pytest.raises(ValueError):
        opaque_spec(2 * 65_537, 256)  # 65537 is prime: no split fits the limits


def test_keys_differ_by_model_tenant_rank_dtype_tags_and_geometry() -> None:
    spec = opaque_spec(16_384, 256)
    ns = namespace_for("m", spec)
    base = chunk_key(ns, LAYOUT, key().to_string())
    assert len(base) == 16
    assert base == chunk_key(namespace_for("m", spec), LAYOUT, key().to_string())  # stable
    others = [
        chunk_key(namespace_for("other", spec), LAYOUT, key().to_string()),
        chunk_key(namespace_for("m", spec, tenant="t"), LAYOUT, key().to_string()),
        chunk_key(namespace_for("m", spec, lora_id="l"), LAYOUT, key().to_string()),
        chunk_key(namespace_for("m", opaque_spec(16_384, 128)), LAYOUT, key().to_string()),
        chunk_key(
            ns,
            layout_tag(MemoryFormat.KV_2LTD, [torch.Size([2, 8, 256, 512])], [torch.bfloat16]),
            key().to_string(),
        ),
        chunk_key(ns, LAYOUT, key(worker=1).to_string()),
        chunk_key(ns, LAYOUT, key(world=4).to_string()),
        chunk_key(ns, LAYOUT, key(chunk=8).to_string()),
        chunk_key(ns, LAYOUT, key(dtype=torch.float16).to_string()),
        chunk_key(ns, LAYOUT, key(tags={"lmcache.tag.user": "a"}).to_string()),
    ]
    assert len({base, *others}) == len(others) + 1


def test_the_namespace_model_id_marks_lmcache_traffic() -> None:
    spec = opaque_spec(1024, 16)
    assert namespace_for("llama", spec).model_id == "lmcache:llama"
    assert namespace_for("llama", spec, model_id="shared").model_id == "shared"


def test_settings_parse_strings_and_refuse_unknown_keys(monkeypatch) -> None:
    monkeypatch.setenv("KVFABRIC_SOCKET_PATH", "/run/kvf.sock")
    monkeypatch.delenv("KVFABRIC_TOKEN", raising=False)
    p = "remote_storage_plugin.kvfabric."
    settings = PluginSettings.from_extra_config(
        {
            p + "module_path": "kvfabric_connectors.lmcache",
            p + "class_name": "X",
            p + "tenant": "team-a",
            p + "pull": "false",
            p + "threads": "3",
            p + "timeout_s": "2.5",
            "remote_storage_plugin.other.tenant": "ignored",
            "save_chunk_meta": False,
        },
        "kvfabric",
    )
    assert (
        settings.socket_path,
        settings.token,
        settings.tenant,
        settings.pull,
        settings.threads,
        settings.timeout_s,
    ) == ("/run/kvf.sock", None, "team-a", False, 3, 2.5)
    with pytest.raises(ValueError, match="tenat"):
        PluginSettings.from_extra_config({p + "tenat": "x"}, "kvfabric")
    for bad in (
        {p + "pull": "maybe"},
        {p + "threads": "0"},
        {p + "threads": "1.5"},
        {p + "timeout_s": "-1"},
        {p + "socket_path": ""},
    ):
        with pytest.raises(ValueError):
            PluginSettings.from_extra_config(bad, "kvfabric")
    named = PluginSettings.from_extra_config(
        {"remote_storage_plugin.kvfabric.b.tenant": "t2"}, "kvfabric.b"
    )
    assert named.tenant == "t2"


def test_the_adapter_takes_kvfabric_plugin_urls_only() -> None:
    adapter = KVFabricConnectorAdapter()
    assert adapter.can_parse("plugin://kvfabric")
    assert adapter.can_parse("plugin://kvfabric.secondary")
    assert not adapter.can_parse("plugin://redis")
    assert not adapter.can_parse("plugin://kvfabricx")
    assert not adapter.can_parse("redis://127.0.0.1:6379")
