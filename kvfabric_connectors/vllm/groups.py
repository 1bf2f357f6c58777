"""Hybrid attention: how the engine's KV cache groups map onto canonical objects.

vLLM's hybrid KV cache manager (HMA, ``SupportsHMA``) gives each KV cache group a block
table of its own. A full-attention group keeps every block of a request; a sliding-window
group of window W frees the blocks that slid out of the window (their entries become the
null block) and hands them to other requests at once, so their contents are garbage from
then on. Contract of the connector with several groups (:class:`LayerPlan`):

* **Layer sets.** The model's attention layers split into sets: every full-attention layer
  (set 0 where the model has one), then the sliding-window layers of each window, smallest
  first. A chunk of a prompt is one object per set: the set's own namespace (model id
  tagged ``#full:<layers>`` or ``#swa<W>:<layers>``, a spec of ``len(layers)`` layers in
  ascending model-layer order), keyed by the same prompt hashing. A prefix that ends at a
  chunk boundary therefore names the same objects in every engine of the model, whatever
  its block size or grouping. An engine whose one group is full attention over every layer
  (a plain model, or HMA off) keeps the untagged namespace it always had.
* **Saves.** Full-attention objects are saved as before. A sliding-window object of a chunk
  is saved only when every block holding the chunk's tokens is still live in each group of
  the set in the step that completes it; a chunk that slid out of the window (chunked
  prefill, or tokens served from vLLM's own prefix cache) is absent, never read from freed
  blocks. So a sliding-window set holds only what a consumer can use: the window before a
  chunk boundary or the prompt's end, where consumers stop loading.
* **Loads.** A consumer that loads up to token ``p`` needs the full-attention objects of
  every chunk before ``p`` (a prefix, as before) and, per sliding-window set, the objects
  of the chunks covering ``[first_live(p), p)``: the tokens in the blocks vLLM keeps for
  the token at ``p`` (:func:`first_live_token`), no more. :func:`usable_stop` picks the
  largest such ``p`` the fabric can serve. Loads write into live blocks only (the request's
  own block table, null entries skipped), the whole of each, so vLLM's prefix cache never
  caches a half-written block. Sliding-window chunks are looked for on this node only
  (they are not a prefix, so the cluster's prefix lookup cannot count them): another
  node's full-attention chunks are pulled as before, its windows count once pushed here.
* **Failures.** vLLM maps a failed load back to its blocks only with one group; with several
  it takes failed requests (``failed_recving``) of asynchronous loads only. So with several
  groups every load is asynchronous, and a failed one is recomputed whole.
* **State groups** (Mamba, linear attention, ...) hold a recurrent state, not per-token KV:
  it cannot be rebuilt from chunks, and attention KV without it is useless. An engine with
  one (or with any other group kind it cannot move: chunked-local, sink, ...) moves nothing
  (:attr:`LayerPlan.inert`): it starts and serves, every request computes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerSet:
    """Attention layers of one kind, stored together as one object per chunk.

    ``layers``: model layer indices, ascending (object layer ``i`` is ``layers[i]``);
    ``window``: the sliding window in tokens, None for full attention; ``extra_retained``:
    tokens vLLM keeps below the window (multi-module speculative decoding)."""

    layers: tuple[int, ...]
    window: int | None = None
    extra_retained: int = 0

    def tag(self) -> str:
        """What the set's namespace adds to the model id."""
        kind = "full" if self.window is None else f"swa{self.window}"
        return f"#{kind}:{','.join(map(str, self.layers))}"


@dataclass(frozen=True)
class Placement:
    """Where one engine layer's KV goes: its set, its layer in the set's objects, its
    vLLM KV cache group (whose block table indexes its cache)."""

    layer_set: int
    object_layer: int
    group: int


@dataclass(frozen=True)
class LayerPlan:
    """The engine's KV cache groups as the connector moves them (module docstring)."""

    sets: tuple[LayerSet, ...]
    place: dict[str, Placement]  # engine layer name -> placement
    set_groups: tuple[tuple[int, ...], ...]  # per set: its vLLM group ids
    block_sizes: tuple[int, ...]  # per vLLM group
    num_groups: int
    unmovable: tuple[str, ...] = field(default=())  # spec kinds of groups it cannot move

    @property
    def inert(self) -> bool:
        """Some group cannot be rebuilt from chunks: the connector moves nothing."""
        return bool(self.unmovable)

    @property
    def legacy(self) -> bool:
        """One full-attention group: everything as without HMA (untagged namespace)."""
        return self.num_groups == 1 and len(self.sets) == 1 and self.sets[0].window is None

    @property
    def async_loads(self) -> bool:
        """Several groups: a failed load is reported per request, asynchronous loads only."""
        return self.num_groups > 1


def layer_plan(kv_cache_config: Any) -> LayerPlan | None:
    """The plan of vLLM's ``KVCacheConfig``; None without one (tests, old engines)."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return None
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    full: dict[str, int] = {}  # layer name -> group
    windows: dict[tuple[int, int], dict[str, int]] = {}
    unmovable: list[str] = []
    block_sizes: list[int] = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        block_sizes.append(int(spec.block_size))
        if not getattr(group, "enable_kv_transfer", True):
            continue  # a replica vLLM rebuilds from its source group after a load
        # exact types: subclasses (ring, sink, chunked-local...) free or reuse blocks their
        # own way, and state specs (Mamba) hold no per-token KV at all
        if type(spec) is SlidingWindowSpec:
            key = (int(spec.sliding_window), int(spec.extra_retained_tokens))
            windows.setdefault(key, {}).update(dict.fromkeys(group.layer_names, group_id))
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            full.update(dict.fromkeys(group.layer_names, group_id))
        else:
            unmovable.append(type(spec).__name__)
    members = ([(None, 0, full)] if full else []) + [
        (w, extra, names) for (w, extra), names in sorted(windows.items())
    ]
    sets: list[LayerSet] = []
    place: dict[str, Placement] = {}
    set_groups: list[tuple[int, ...]] = []
    for index, (window, extra, names) in enumerate(members):
        ordered = sorted(names, key=extract_layer_index)
        sets.append(LayerSet(tuple(extract_layer_index(n) for n in ordered), window, extra))
        set_groups.append(tuple(sorted(set(names.values()))))
        for j, name in enumerate(ordered):
            place[name] = Placement(index, j, names[name])
    plan = LayerPlan(
        tuple(sets),
        place,
        tuple(set_groups),
        tuple(block_sizes),
        len(kv_cache_config.kv_cache_groups),
        tuple(unmovable),
    )
    if plan.inert:
        log.warning(
            "kvfabric: KV cache groups of kind %s cannot be rebuilt from KV chunks "
            "(recurrent state, or blocks vLLM manages its own way); the connector loads "
            "and saves nothing for this model",
            ", ".join(sorted(set(unmovable))),
        )
    return plan


def first_live_token(p: int, layer_set: LayerSet, block_size: int) -> int:
    """The first token of the first block vLLM keeps in a sliding-window group once ``p``
    tokens are computed (its ``get_num_skipped_tokens``, rounded down to a block); 0 for
    full attention."""
    if layer_set.window is None:
        return 0
    skipped = max(0, p - layer_set.window + 1 - layer_set.extra_retained)
    return skipped // block_size * block_size


def usable_stop(
    cap: int,
    local: int,
    chunk_tokens: int,
    plan: LayerPlan,
    held: Sequence[Sequence[bool]],
) -> int:
    """The largest ``p`` in ``(local, cap]`` a consumer can load up to: ``cap`` itself or a
    chunk boundary, where every sliding-window set holds the chunks covering
    ``[max(local, first_live(p)), p)`` (``held[s][i]``: set ``s`` holds chunk ``i``; the
    full-attention prefix up to ``cap`` is the caller's). ``local`` when there is none."""
    candidates: list[int] = [cap, *range(cap // chunk_tokens * chunk_tokens, 0, -chunk_tokens)]
    for p in candidates:
        if p <= local:
            break
        if all(
            _covered(
                held[s] if s < len(held) else (),
                max(local, first_live_token(p, layer_set, _block(plan, s))),
                p,
                chunk_tokens,
            )
            for s, layer_set in enumerate(plan.sets)
            if layer_set.window is not None
        ):
            return p
    return local


def live_start(plan: LayerPlan, layer_set: int, groups: Sequence[Sequence[int]], null: int) -> int:
    """The first token every group of the set holds in a live block: the blocks before it
    are null entries (slid out of the window, freed)."""
    start = 0
    for group in plan.set_groups[layer_set]:
        blocks = groups[group]
        leading = next((i for i, b in enumerate(blocks) if b != null), len(blocks))
        start = max(start, leading * plan.block_sizes[group])
    return start


def all_live(
    plan: LayerPlan,
    layer_set: int,
    groups: Sequence[Sequence[int]],
    null: int,
    first: int,
    last: int,
) -> bool:
    """Whether tokens ``[first, last)`` are in live blocks of every group of the set."""
    for group in plan.set_groups[layer_set]:
        size = plan.block_sizes[group]
        blocks = groups[group][first // size : (last - 1) // size + 1]
        if len(blocks) < (last - 1) // size + 1 - first // size or null in blocks:
            return False
    return True


def _block(plan: LayerPlan, layer_set: int) -> int:
    return max(plan.block_sizes[g] for g in plan.set_groups[layer_set])


def _covered(held: Sequence[bool], first: int, last: int, chunk_tokens: int) -> bool:
    if first >= last:
        return True
    chunks = range(first // chunk_tokens, (last - 1) // chunk_tokens + 1)
    return all(i < len(held) and held[i] for i in chunks)
