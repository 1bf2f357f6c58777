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
expect_timeout_s    how long a consumer waits for KV a         5
                    producer announced (``kv_transfer_params``)
kv_dtype            the fabric's storage dtype (bfloat16,      the engine's KV dtype
                    float16, float32), converted at the edge
                    when the engine's differs
==================  =========================================  =============================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from kvfabric.client.client import default_address
from kvfabric.spec import DEFAULT_CHUNK_TOKENS


@dataclass(frozen=True)
class ConnectorSettings:
    socket_path: str
    token: str | None
    model_id: str | None = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    load_timeout_s: float = 10.0
    save_timeout_s: float = 10.0
    push_to: str | None = None
    expect_timeout_s: float = 5.0
    kv_dtype: str | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kvfabric connector setting(s) {unknown}; "
                             f"known: {sorted(known)}")
        extra.setdefault("socket_path", default_address())
        extra.setdefault("token", os.environ.get("KVFABRIC_TOKEN"))
        settings = cls(**extra)
        for name in ("chunk_tokens",):
            if not isinstance(getattr(settings, name), int) or getattr(settings, name) <= 0:
                raise ValueError(f"{name} must be a positive integer")
        if settings.kv_dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(f"kv_dtype must be bfloat16, float16 or float32, "
                             f"got {settings.kv_dtype!r}")
        for name in ("load_timeout_s", "save_timeout_s", "expect_timeout_s"):
            if not isinstance(getattr(settings, name), (int, float)) or \
                    getattr(settings, name) <= 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        return settings
