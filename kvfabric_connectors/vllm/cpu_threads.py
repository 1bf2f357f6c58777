"""vLLM general plugin: a KVFabricConnector must not change a CPU engine's thread layout.

Why: vLLM's CPU executor (``vllm.utils.ompmultiprocessing.OMPProcessManager``, vLLM 0.32)
reserves one more core per local rank whenever *any* KV connector is configured ("reserve at
one more core for nixl_connector under p/d case"): the engine's OpenMP team shrinks by one
core per rank. A smaller team reduces in another order, so an engine with a connector that
loads nothing computes different bf16 logits (measured on an AMD EPYC host, two-process
engine: 5 of 48 greedy outputs differed, logprobs by up to 0.12; a no-op connector does
exactly the same, so the cause is vLLM's, not the connector's work) and runs its kernels on
fewer cores. KVFabricConnector needs no core of its own: saves run inline in the forward pass
(``save_kv_layer``), a load thread copies while the engine waits for that layer anyway, and
the push / pull threads wait on the daemon's socket. So for an engine whose connector is
KVFabricConnector this plugin makes the manager reserve what it reserves without a
connector. An explicit ``VLLM_CPU_NUM_OF_RESERVED_CPU`` always wins, and so does
``kv_connector_extra_config: {"reserve_cpu": true}`` (vLLM's own reservation kept).

Who calls what: vLLM runs every ``vllm.general_plugins`` entry point (``register`` here,
declared in pyproject.toml) in each of its processes before it builds an executor; the
engine-core process builds the manager. ``register`` is idempotent and does nothing on a vLLM
without that manager (other versions, GPU builds where it is never used).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
CONNECTOR_NAME = "KVFabricConnector"
MODULE_PREFIX = "kvfabric_connectors"
_PATCHED = "_kvfabric_thread_layout"


def uses_kvfabric_alone(kv_transfer_config: Any) -> bool:
    """True if the engine's only connector is KVFabricConnector and it did not ask for vLLM's
    reserved core (``reserve_cpu``)."""
    if kv_transfer_config is None:
        return False
    name = getattr(kv_transfer_config, "kv_connector", None)
    module = getattr(kv_transfer_config, "kv_connector_module_path", None) or ""
    if name != CONNECTOR_NAME or (module and not module.startswith(MODULE_PREFIX)):
        return False
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return not bool(extra.get("reserve_cpu", False))


def cores_reserved_without_connector(local_world_size: int, arch_reserves_per_rank: bool) -> int:
    """What vLLM reserves for an engine without a connector: one core per local rank on x86,
    ARM and RISC-V (the scheduler process), one elsewhere."""
    return local_world_size if arch_reserves_per_rank else 1


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _wrap(
    init: Callable[..., None], arch_reserves_per_rank: Callable[[], bool]
) -> Callable[..., None]:
    def __init__(self: Any, config: Any) -> None:
        if RESERVED_CPU_ENV in os.environ or not uses_kvfabric_alone(
            getattr(config, "kv_transfer_config", None)
        ):
            init(self, config)
            return
        reserve = cores_reserved_without_connector(
            int(config.parallel_config.local_world_size), arch_reserves_per_rank()
        )
        # vLLM's own knob, set only while the manager reads it: the engine's OpenMP team
        # is the one it would have without a connector
        with _env(RESERVED_CPU_ENV, str(reserve)):
            init(self, config)

    setattr(__init__, _PATCHED, True)
    return __init__


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    try:
        from vllm.platforms import CpuArchEnum, current_platform
        from vllm.utils import ompmultiprocessing
    except ImportError:  # a vLLM without the CPU executor's manager: nothing to correct
        return
    manager = getattr(ompmultiprocessing, "OMPProcessManager", None)
    if manager is None or getattr(manager.__init__, _PATCHED, False):
        return

    def arch_reserves_per_rank() -> bool:
        return current_platform.get_cpu_architecture() in (
            CpuArchEnum.X86,
            CpuArchEnum.ARM,
            CpuArchEnum.RISCV,
        )

    manager.__init__ = _wrap(manager.__init__, arch_reserves_per_rank)
    log.debug("kvfabric: CPU engines with KVFabricConnector keep their thread layout")
