"""The connector's settings: ``kv_connector_extra_config`` of vLLM's ``KVTransferConfig``.

Every key is optional; unknown keys are an error (a typo must not silently fall back to a
default). Environment variables give the node-level defaults a DaemonSet sets once per node.

==================  =========================================  =============================
key                 meaning                                    default
==================  =========================================  =============================
socket_path         the node daemon's Unix socket              ``$KVFABRIC_SOCKET_PATH``
token               the daemon's auth token                    ``$KVFABRIC_TOKEN``
model_id            namespace model id (same on every engine   the served model name
                    that may share KV)
chunk_tokens        tokens per kvfabric chunk (independent of  256
                    the engine block size)
load_timeout_s      deadline of one request's load (pull or    10
                    wait for a push included)
save_timeout_s      deadline of one step's saves               10
push_to             node id every prefill pushes to            none (per request:
                                                               ``kv_transfer_params``)
push_targets        decode engine ``host:port`` -> node id:    none (no push unless asked)
                    push to the decode engine a router named
                    in the request id (:mod:`.handoff`)
expect_timeout_s    how long a consumer waits for KV a         5
                    producer announced (``kv_transfer_params``)
kv_dtype            the fabric's storage dtype (bfloat16,      the engine's KV dtype
                    float16, float32, or float8_e4m3fn alias
                    fp8 / float8_e4m3: e4m3 with per-head
                    scales), converted at the edge when the
                    engine's differs (fp8: quantized at save,
                    dequantized at load)
reserve_cpu         keep the core vLLM's CPU executor reserves false: an engine with the
                    for any connector (the engine's OpenMP     connector keeps the thread
                    team is then one core smaller per rank)    layout it has without one
                                                               (:mod:`.cpu_threads`)
==================  =========================================  =============================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

from kvfabric.spec import DEFAULT_CHUNK_TOKENS, KVDtype
from kvfabric_connectors.settings import positive_seconds, refuse_unknown, with_daemon_defaults


@dataclass(frozen=True)
class ConnectorSettings:
    socket_path: str
    token: str | None
    model_id: str | None = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    load_timeout_s: float = 10.0
    save_timeout_s: float = 10.0
    push_to: str | None = None
    push_targets: Mapping[str, str] | None = None
    expect_timeout_s: float = 5.0
    kv_dtype: str | None = None
    reserve_cpu: bool = False  # read by the vLLM plugin in .cpu_threads, before any connector

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        values = dict(extra or {})
        refuse_unknown(values, [f.name for f in fields(cls)], what="kvfabric connector")
        settings = cls(**with_daemon_defaults(values))
        if (
            isinstance(settings.chunk_tokens, bool)
            or not isinstance(settings.chunk_tokens, int)
            or settings.chunk_tokens <= 0
        ):
            raise ValueError("chunk_tokens must be a positive integer")
        if settings.kv_dtype is not None:  # one spelling per dtype: the namespace's
            settings = replace(settings, kv_dtype=KVDtype.parse(settings.kv_dtype).value)
        if settings.push_targets is not None:
            targets = settings.push_targets
            if not isinstance(targets, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) and k and v for k, v in targets.items()
            ):
                raise ValueError("push_targets must map decode host:port strings to node ids")
            settings = replace(settings, push_targets=MappingProxyType(dict(targets)))
        if not isinstance(settings.reserve_cpu, bool):
            raise ValueError("reserve_cpu must be true or false")
        for name in ("load_timeout_s", "save_timeout_s", "expect_timeout_s"):
            positive_seconds(name, getattr(settings, name))
        return settings
