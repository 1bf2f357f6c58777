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
save_timeout_s      deadline of one push of a step's chunks    10
                    (it follows the step's layers, so it must
                    outlast the step's forward pass: raise it
                    where one step computes longer)
rpc_timeout_s       longest one round trip on the engine's     2
                    path may take: a lookup while scheduling,
                    a save's reserve or commit in the forward
                    pass; past it the request is a miss or the
                    step's saves are dropped, and the
                    connector leaves the daemon alone for 2 s,
                    doubling while it keeps timing out
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
kv_events_poll_s    how often the fabric's blocks are asked    0.25
                    for, for the engine's KV events
                    (``--kv-events-config``: :mod:`.events`)
reserve_cpu         keep the core vLLM's CPU executor reserves false: an engine with the
                    for any connector (the engine's OpenMP     connector keeps the thread
                    team is then one core smaller per rank)    layout it has without one
                                                               (:mod:`.cpu_threads`)
==================  =========================================  =============================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import PlainValidator

from kvfabric.config_model import config_value
from kvfabric.config_types import Flag, OptionalText, PositiveInt, Seconds, Text, optional
from kvfabric.errors import ConfigError, SpecError
from kvfabric.spec import DEFAULT_CHUNK_TOKENS, KVDtype
from kvfabric_connectors.settings import daemon_socket, daemon_token, parse_settings

# Old key -> new key: a renamed setting keeps working (with a DeprecationWarning) a release.
RENAMED_KEYS: dict[str, str] = {}


def _kv_dtype(value: object) -> str:
    """One spelling per dtype: the namespace's."""
    try:
        return KVDtype.parse(value if isinstance(value, (str, KVDtype)) else str(value)).value
    except SpecError as exc:
        raise ConfigError(str(exc)) from None


def _push_targets(value: object) -> Mapping[str, str]:
    """Decode engine ``host:port`` -> node id, both non-empty strings; read-only."""
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and k and v for k, v in value.items()
    ):
        raise ConfigError("must map decode host:port strings to node ids")
    return MappingProxyType(dict(value))


@config_value
class ConnectorSettings:
    socket_path: Text = field(default_factory=daemon_socket)
    token: OptionalText = field(default_factory=daemon_token)
    model_id: OptionalText = None
    chunk_tokens: PositiveInt = DEFAULT_CHUNK_TOKENS
    load_timeout_s: Seconds = 10.0
    save_timeout_s: Seconds = 10.0
    rpc_timeout_s: Seconds = 2.0
    push_to: OptionalText = None
    push_targets: Annotated[Mapping[str, str] | None, PlainValidator(optional(_push_targets))] = (
        None
    )
    expect_timeout_s: Seconds = 5.0
    kv_dtype: Annotated[str | None, PlainValidator(optional(_kv_dtype))] = None
    kv_events_poll_s: Seconds = 0.25
    reserve_cpu: Flag = False  # read by the vLLM plugin in .cpu_threads, before any connector

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        return parse_settings(
            cls, extra or {}, where="kv_connector_extra_config", renames=RENAMED_KEYS
        )
