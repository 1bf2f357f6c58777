"""Every plugin's settings fail like the daemon's config: one ConfigError, ``<key>: <what>``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvfabric.config import load_config
from kvfabric.errors import ConfigError
from kvfabric_connectors.lmcache import settings as lmcache
from kvfabric_connectors.sglang import settings as sglang
from kvfabric_connectors.vllm import settings as vllm

LM = "remote_storage_plugin.kvfabric."


def daemon(key: str, value: Any) -> object:
    return load_config(env={}, overrides=[f"{key}={value}"])


def vllm_settings(key: str, value: Any) -> object:
    return vllm.ConnectorSettings.from_extra_config({"socket_path": "/s", key: value})


def sglang_settings(key: str, value: Any) -> object:
    return sglang.StorageSettings.from_extra_config({"socket_path": "/s", key: value})


def lmcache_settings(key: str, value: Any) -> object:
    return lmcache.PluginSettings.from_extra_config({LM + key: value}, "kvfabric")


@pytest.mark.parametrize(
    "build, key, value, message",
    [
        (daemon, "limits.request_threads", 0, "limits.request_threads: must be a positive"),
        (daemon, "http.bogus", 1, r"http.bogus: unknown key \(allowed: host, port\)"),
        (daemon, "store.tiers.dram.capacity", "lots", r"store.tiers\[0\].capacity: cannot"),
        (vllm_settings, "load_timeout_s", -1, "kv_connector_extra_config.load_timeout_s: must"),
        (vllm_settings, "bogus", 1, r"kv_connector_extra_config.bogus: unknown key \(allowed:"),
        (vllm_settings, "kv_dtype", "int8", "kv_connector_extra_config.kv_dtype: unknown KV"),
        (sglang_settings, "timeout_s", 0, "extra_config.timeout_s: must be a positive"),
        (sglang_settings, "bogus", 1, r"extra_config.bogus: unknown key \(allowed:"),
        (sglang_settings, "pull", "yes", "extra_config.pull: must be true or false"),
        (lmcache_settings, "threads", "1.5", LM + "threads: must be a whole number"),
        (lmcache_settings, "bogus", 1, LM + r"bogus: unknown key \(allowed:"),
        (lmcache_settings, "pull", "maybe", LM + "pull: must be true or false"),
    ],
)
def test_daemon_and_plugin_settings_fail_with_one_error_type_and_style(
    build: Callable[[str, Any], object], key: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{message}") as failed:
        build(key, value)
    assert isinstance(failed.value, ValueError)  # what engines' config code catches


@pytest.mark.parametrize(
    "module, build",
    [(vllm, vllm_settings), (sglang, sglang_settings), (lmcache, lmcache_settings)],
)
def test_a_renamed_plugin_key_warns_and_is_honoured(
    module: Any, build: Callable[[str, Any], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(module.RENAMED_KEYS, "model", "model_id")  # a test-only rename
    with pytest.warns(DeprecationWarning, match="'model' is deprecated"):
        assert build("model", "m").model_id == "m"


def test_plugin_settings_default_the_daemon_to_the_nodes_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVFABRIC_SOCKET_PATH", "/run/k.sock")
    monkeypatch.setenv("KVFABRIC_TOKEN", "t0k")
    for settings in (
        vllm.ConnectorSettings.from_extra_config(None),
        sglang.StorageSettings.from_extra_config({"backend_name": "kvfabric"}),
        lmcache.PluginSettings.from_extra_config({LM + "module_path": "m"}, "kvfabric"),
    ):
        assert (settings.socket_path, settings.token) == ("/run/k.sock", "t0k")
    explicit = vllm.ConnectorSettings.from_extra_config({"socket_path": "/s", "token": None})
    assert (explicit.socket_path, explicit.token) == ("/s", None)
