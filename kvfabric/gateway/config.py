"""The gateway's configuration (``kvfabric gateway --config gateway.yaml``).

One YAML file, validated like the daemon's (:mod:`kvfabric.config_model`: unknown keys are
refused by name, every problem reported as ``<dotted.key>: <what is wrong>``). The reference
with every key and its default is the README's "Gateway configuration" section; the sections:

* ``engines``: each vLLM OpenAI server the gateway may send a phase to: its ``id``, ``url``,
  ``role`` (prefill, decode or both), the fabric ``node_id`` of the daemon beside it, its
  ``hardware_class`` (or, left out, its node's ``cluster.hardware_class`` from the fabric's
  node registry), ``max_running`` (requests the gateway keeps in flight there; more wait
  in the gateway's fair queue) and ``push`` (a prefill engine pushes its KV to the decode
  node instead of the decode engine pulling it);
* ``classes``: per hardware class the prior prefill / decode rates (tokens per second, refined
  by measurement) and the price per hour;
* ``fabric``: the daemon HTTP API that answers cluster lookups and the model's KV spec, so the
  gateway hashes prompts into the same chunk keys as the engines' connectors;
* ``link``, ``tenants``, ``deadlines``;
* ``advisor`` (optional): the objectives the P:D advice for the observed ingress sizes for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import PlainValidator

from kvfabric.config_model import KeyProblems, config_value, parse_config, read_yaml_mapping
from kvfabric.config_types import (
    Flag,
    NonNegativeInt,
    Number,
    OptionalText,
    PositiveInt,
    Seconds,
    Share,
    Text,
    one_of,
)
from kvfabric.errors import ConfigError
from kvfabric.sched.model import Priority, Role
from kvfabric.spec import DEFAULT_CHUNK_TOKENS, KVSpec

_NEEDS_REGISTRY = (
    "required unless the engine has a node_id and the gateway a fabric (whose node registry "
    "then says it)"
)
RoleName = Annotated[str, PlainValidator(one_of(*(r.value for r in Role)))]
PriorityName = Annotated[str, PlainValidator(one_of(*(p.value for p in Priority)))]


@config_value
class EngineConfig:
    id: Text
    url: Text
    hardware_class: OptionalText = None  # None: its node's class in the fabric's registry
    role: RoleName = "both"
    node_id: Text = ""  # the fabric node beside the engine; "" = none (no holdings)
    max_running: PositiveInt = 8
    push: Flag = False  # as a prefill engine: push KV to the decode node (else it pulls)

    @property
    def role_value(self) -> Role:
        return Role(self.role)


@config_value
class ClassConfig:
    prefill_tps: Number
    decode_tps: Number
    cost_per_hour: Number = 0.0
    # the advisor's decode model: what each further stream in a batch adds to a decode step,
    # as a share of one stream's step (memory-bound decode: a few percent)
    decode_batch_cost: Share = 0.02

    def __post_init__(self) -> None:
        problems = [
            (name, "must be > 0")
            for name in ("prefill_tps", "decode_tps")
            if not getattr(self, name) > 0
        ]
        if self.cost_per_hour < 0:
            problems.append(("cost_per_hour", "must be >= 0"))
        if problems:
            raise KeyProblems(problems)


@config_value
class FabricConfig:
    """A daemon's HTTP API for cluster lookups and the model's KV spec (what the engines'
    connectors derive: layers, KV heads, head size, dtype, ``chunk_tokens``)."""

    url: Text
    num_layers: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    dtype: Text = "bfloat16"
    kind: Text = "mha"
    chunk_tokens: PositiveInt = DEFAULT_CHUNK_TOKENS
    model_id: OptionalText = None  # the connectors' model id; default: the gateway's model
    token: OptionalText = None  # bearer token when the daemon's auth is on

    def spec(self) -> KVSpec:
        try:
            return KVSpec(
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.dtype,  # type: ignore[arg-type]  # KVSpec parses names and aliases
                self.kind,  # type: ignore[arg-type]
                self.chunk_tokens,
            )
        except ValueError as exc:
            raise ConfigError(f"fabric: {exc}") from None


@config_value
class LinkConfig:
    bytes_per_s: Number = 1.0e9
    overlap: Share = 0.95
    handoff_fixed_s: Number = 0.005


@config_value
class ApiKeyConfig:
    tenant: Text
    priority: PriorityName = "interactive"  # the highest class the key may ask for


@config_value
class TenantsConfig:
    weights: dict[str, Number] = dataclasses.field(default_factory=dict)
    max_queued_tokens: PositiveInt = 65536
    # per engine, slots above max_running that only a tenant below its weighted share of
    # the engines' slots may take (a light tenant does not wait behind a flood); 0: none
    isolation_slots: NonNegativeInt = 2
    api_keys: dict[str, ApiKeyConfig] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [(f"weights.{t}", "must be > 0") for t, w in self.weights.items() if not w > 0]
        if bad:
            raise KeyProblems(bad)


@config_value
class DeadlinesConfig:
    request_s: Seconds = 300.0  # a request's whole life in the gateway, queue included
    connect_s: Seconds = 5.0
    health_interval_s: Seconds = 1.0


@config_value
class AdvisorConfig:
    """The P:D advice for the ingress the gateway sees (``GET /v1/advice``): the objectives
    it sizes for and the window of finished requests it reads."""

    ttft_p99_s: Seconds
    tpot_p50_s: Seconds
    window_s: Seconds = 300.0
    interval_s: Seconds = 60.0
    min_requests: PositiveInt = 20


@config_value
class GatewayConfig:
    model: Text
    engines: tuple[EngineConfig, ...]
    classes: dict[str, ClassConfig]
    host: Text = "127.0.0.1"
    port: PositiveInt = 8090
    fabric: FabricConfig | None = None
    link: LinkConfig = dataclasses.field(default_factory=LinkConfig)
    tenants: TenantsConfig = dataclasses.field(default_factory=TenantsConfig)
    deadlines: DeadlinesConfig = dataclasses.field(default_factory=DeadlinesConfig)
    advisor: AdvisorConfig | None = None

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        if not self.engines:
            problems.append(("engines", "at least one engine"))
        seen: set[str] = set()
        for i, engine in enumerate(self.engines):
            if engine.id in seen:
                problems.append((f"engines[{i}].id", f"{engine.id!r} is declared twice"))
            seen.add(engine.id)
            if engine.hardware_class is None:
                if not engine.node_id or self.fabric is None:
                    problems.append(
                        (
                            f"engines[{i}].hardware_class",
                            _NEEDS_REGISTRY,
                        )
                    )
            elif engine.hardware_class not in self.classes:
                known = ", ".join(sorted(self.classes)) or "none"
                problems.append(
                    (
                        f"engines[{i}].hardware_class",
                        f"{engine.hardware_class!r} is not in classes (declared: {known})",
                    )
                )
        if problems:
            raise KeyProblems(problems)


def load_gateway_config(
    path: str | Path, overrides: Mapping[str, Any] | None = None
) -> GatewayConfig:
    """The file at ``path`` (YAML), top-level keys in ``overrides`` replacing its own."""
    data = read_yaml_mapping(path, "gateway config")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return parse_config(GatewayConfig, data)
