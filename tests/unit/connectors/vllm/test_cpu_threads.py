"""The vLLM plugin that keeps a CPU engine's thread layout when KVFabricConnector is its
connector (kvfabric_connectors.vllm.cpu_threads), on vLLM's real config and manager classes.
The end-to-end proof (bit-identical logprobs) is tests/e2e/vllm/test_vllm_neutrality.py."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig
from vllm.utils import ompmultiprocessing

from kvfabric_connectors.vllm import cpu_threads
from kvfabric_connectors.vllm.settings import ConnectorSettings


def kvfabric(**extra: object) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KVFabricConnector",
        kv_connector_module_path="kvfabric_connectors.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=dict(extra),
    )


def test_only_a_kvfabric_engine_is_corrected() -> None:
    assert cpu_threads.uses_kvfabric_alone(kvfabric())
    assert not cpu_threads.uses_kvfabric_alone(None)
    assert not cpu_threads.uses_kvfabric_alone(
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    )
    # a class of that name from another package is not ours
    assert not cpu_threads.uses_kvfabric_alone(
        KVTransferConfig(
            kv_connector="KVFabricConnector",
            kv_connector_module_path="elsewhere.connector",
            kv_role="kv_both",
        )
    )
    # the user asked for vLLM's reserved core
    assert not cpu_threads.uses_kvfabric_alone(kvfabric(reserve_cpu=True))


def test_reserve_cpu_is_a_known_connector_setting() -> None:
    assert (
        ConnectorSettings.from_extra_config({"socket_path": "/s", "reserve_cpu": True}).reserve_cpu
        is True
    )
    with pytest.raises(ValueError, match="reserve_cpu"):
        ConnectorSettings.from_extra_config({"socket_path": "/s", "reserve_cpu": "yes"})


def test_what_vllm_reserves_without_a_connector() -> None:
    assert cpu_threads.cores_reserved_without_connector(1, True) == 1
    assert cpu_threads.cores_reserved_without_connector(4, True) == 4
    assert cpu_threads.cores_reserved_without_connector(4, False) == 1


def test_the_plugin_is_declared_and_patches_vllms_manager_once() -> None:
    declared = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert declared.get("kvfabric_cpu_threads") == "kvfabric_connectors.vllm.cpu_threads:register"
    cpu_threads.register()
    init = ompmultiprocessing.OMPProcessManager.__init__
    assert getattr(init, cpu_threads._PATCHED)
    cpu_threads.register()  # vLLM loads plugins in every process, maybe more than once
    assert ompmultiprocessing.OMPProcessManager.__init__ is init


def test_the_wrapper_sets_vllms_knob_only_while_the_manager_reads_it(monkeypatch) -> None:
    """Regression: before the plugin an engine with the connector reserved one core more per
    rank than without (vLLM counts any kv_transfer_config), so its OpenMP team was smaller
    and its bf16 logits different."""
    monkeypatch.delenv(cpu_threads.RESERVED_CPU_ENV, raising=False)
    seen: list[str | None] = []

    def init(self: object, config: object) -> None:  # what vLLM's __init__ reads
        seen.append(os.environ.get(cpu_threads.RESERVED_CPU_ENV))

    class Parallel:
        local_world_size = 2

    class Config:
        parallel_config = Parallel()
        kv_transfer_config = kvfabric()

    wrapped = cpu_threads._wrap(init, lambda: True)
    wrapped(object(), Config())
    assert seen == ["2"] and cpu_threads.RESERVED_CPU_ENV not in os.environ
    Config.kv_transfer_config = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    wrapped(object(), Config())
    assert seen[-1] is None  # another connector: vLLM decides
    Config.kv_transfer_config = kvfabric()
    monkeypatch.setenv(cpu_threads.RESERVED_CPU_ENV, "3")
    wrapped(object(), Config())
    assert seen[-1] == "3"  # the user's explicit value wins
