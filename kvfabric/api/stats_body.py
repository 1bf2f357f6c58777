"""The ``GET /v1/stats`` response, derived from the store's stats snapshots.

:mod:`kvfabric.store.stats` defines the fields once (names, types, defaults, descriptions);
the body models here are built from those dataclasses, so a field added to the store shows
in the HTTP API (and its schema) with nothing to repeat. What the API adds is named here
only: the snapshots' derived properties it lists (``utilisation``, ``hit_rate``,
``evictions``), where it lists them, and one rename (a namespace's ``model_id`` is
``model``).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, Field, create_model

from kvfabric.store.stats import NamespaceStats, StoreStats, TierStats

DEGRADED = (
    "tiers a disk fault (full disk, quota, I/O error) degraded: they serve what "
    "they hold but take no new objects until the fault clears"
)


class StatsBody(BaseModel):
    """A body derived from a stats dataclass (see :func:`derived_body`)."""

    source_names: ClassVar[dict[str, str]] = {}  # body field -> attribute of the snapshot

    @classmethod
    def of(cls, snapshot: object) -> typing.Self:
        return cls(**{name: getattr(snapshot, attr) for name, attr in cls.source_names.items()})


def derived_body(
    name: str,
    source: type,
    *,
    skip: tuple[str, ...] = (),
    rename: Mapping[str, str] | None = None,
    properties: Mapping[str, str] | None = None,
) -> type[StatsBody]:
    """The model ``name`` with the fields of the dataclass ``source`` (less ``skip``,
    ``rename``: field -> body name) and its read-only ``properties`` (property -> the field
    it follows)."""
    rename, properties = rename or {}, properties or {}
    hints = typing.get_type_hints(source)
    fields: dict[str, Any] = {}
    names: dict[str, str] = {}

    def add(attr: str, kind: object, default: Any) -> None:
        body_name = rename.get(attr, attr)
        fields[body_name] = (kind, default)
        names[body_name] = attr

    for f in dataclasses.fields(source):
        if f.name in skip:
            continue
        description = f.metadata.get("description")
        if f.default_factory is not dataclasses.MISSING:
            add(
                f.name,
                hints[f.name],
                Field(default_factory=f.default_factory, description=description),
            )
        elif f.default is not dataclasses.MISSING:
            add(f.name, hints[f.name], Field(f.default, description=description))
        else:
            add(f.name, hints[f.name], Field(description=description))
        for prop, after in properties.items():
            if after == f.name:
                getter = getattr(source, prop).fget
                add(prop, typing.get_type_hints(getter)["return"], ...)
    model = create_model(name, __base__=StatsBody, **fields)
    model.source_names = names
    return model


TierStatsBody = derived_body("TierStatsBody", TierStats, properties={"utilisation": "used_bytes"})
TotalsBody = derived_body(
    "TotalsBody",
    StoreStats,
    skip=("tiers", "namespaces"),
    properties={"hit_rate": "peer_hit_tokens", "evictions": "deletes"},
)
NamespaceStatsBody = derived_body(
    "NamespaceStatsBody", NamespaceStats, rename={"model_id": "model"}
)

StatsResponse = create_model(
    "StatsResponse",
    node_id=(str, ...),
    uptime_s=(float, ...),
    ready=(bool, ...),
    sessions=(int, ...),
    tiers=(list[TierStatsBody], ...),  # type: ignore[valid-type]
    totals=(TotalsBody, ...),
    namespaces=(list[NamespaceStatsBody], ...),  # type: ignore[valid-type]
    warnings=(
        list[str],
        Field(
            default_factory=list,
            description="planes listening beyond "
            "loopback without authentication (security.allow_insecure)",
        ),
    ),
    degraded=(list[str], Field(default_factory=list, description=DEGRADED)),
)


def stats_response(snapshot: StoreStats, **node: Any) -> BaseModel:
    """The response for ``snapshot``; ``node``: node_id, uptime_s, ready, sessions, warnings."""
    return StatsResponse(
        tiers=[TierStatsBody.of(tier) for tier in snapshot.tiers],
        totals=TotalsBody.of(snapshot),
        namespaces=[NamespaceStatsBody.of(ns) for ns in snapshot.namespaces],
        degraded=list(snapshot.degraded_tiers),
        **node,
    )
