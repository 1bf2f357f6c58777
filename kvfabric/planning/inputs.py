"""The capacity planner's input file (``kvfabric plan ... --inputs plan.yaml``).

One YAML file, validated like every kvfabric configuration (:mod:`kvfabric.config_model`:
unknown keys refused by name, each problem as ``<dotted.key>: <what is wrong>``):

* ``model``: layers, KV heads, head size and bytes per element: the KV of one token is
  ``2 x layers x kv_heads x head_dim x dtype_bytes`` bytes (K and V);
* ``link``: the bandwidth between nodes and a hand-off's fixed cost;
* ``classes``: per hardware class, the step-time model (:class:`~kvfabric.sim.engine.EngineProfile`:
  measured with ``kvfabric plan calibrate`` or taken from a datasheet) and a price per hour;
* ``roles``: which classes may prefill and which may decode;
* ``objectives``: p99 TTFT and p50 TPOT, in seconds;
* ``workloads``: named ingress mixes (rate, prompt and output length distributions).

The example in ``configs/plan/example.yaml`` documents each key; its classes' speeds and
prices are inputs to reason with, not measurements.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvfabric.config_model import KeyProblems, config_value, parse_config, read_yaml_mapping
from kvfabric.config_types import Number, PositiveInt, Seconds, Share, Text
from kvfabric.planning.advisor import Advice, Ingress, Objectives, advise
from kvfabric.sched.model import Link
from kvfabric.sim.engine import EngineProfile
from kvfabric.sim.workload import LENGTH_KINDS, Lengths


@config_value
class ModelShape:
    layers: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    dtype_bytes: PositiveInt = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@config_value
class LinkInput:
    bytes_per_s: Number
    handoff_fixed_s: Seconds = 0.002
    # what the planner assumes lands while a pushing prefill computes (the simulator then
    # streams layer by layer and finds out)
    overlap: Share = 0.95


@config_value
class ClassInput:
    prefill_base_s: Number
    prefill_s_per_token: Number
    decode_base_s: Number
    decode_s_per_seq: Number
    cost_per_hour: Number = 0.0
    max_seqs: PositiveInt = 256
    max_batch_tokens: PositiveInt = 8192

    def profile(self, name: str) -> EngineProfile:
        try:
            return EngineProfile(
                name,
                self.prefill_base_s,
                self.prefill_s_per_token,
                self.decode_base_s,
                self.decode_s_per_seq,
                self.cost_per_hour,
                self.max_batch_tokens,
                self.max_seqs,
            )
        except ValueError as exc:
            raise KeyProblems([("", str(exc))]) from None


@config_value
class LengthsInput:
    kind: Text = "fixed"
    mean: Number = 0.0
    sigma: Number = 0.0
    low: int = 0
    high: int = 0

    def lengths(self) -> Lengths:
        if self.kind not in LENGTH_KINDS or self.kind == "empirical":
            allowed = ", ".join(k for k in LENGTH_KINDS if k != "empirical")
            raise KeyProblems([("kind", f"must be one of {allowed}")])
        return Lengths(self.kind, self.mean, self.sigma, self.low, self.high)


@config_value
class WorkloadInput:
    rate_rps: Number
    prompt: LengthsInput
    output: LengthsInput

    def ingress(self) -> Ingress:
        return Ingress(self.rate_rps, self.prompt.lengths(), self.output.lengths())


@config_value
class RolesInput:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]


@config_value
class ObjectivesInput:
    ttft_p99_s: Seconds
    tpot_p50_s: Seconds


@config_value
class PlanInputs:
    model: ModelShape
    link: LinkInput
    classes: dict[str, ClassInput]
    roles: RolesInput
    objectives: ObjectivesInput
    workloads: dict[str, WorkloadInput] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = [
            (f"roles.{role}", f"{name!r} is not in classes")
            for role in ("prefill", "decode")
            for name in getattr(self.roles, role)
            if name not in self.classes
        ]
        problems += [
            (f"classes.{name}.{key}", "must be >= 0")
            for name, c in self.classes.items()
            for key in ("prefill_base_s", "prefill_s_per_token", "decode_base_s")
            if getattr(c, key) < 0
        ]
        problems += [
            (f"workloads.{name}.rate_rps", "must be > 0")
            for name, w in self.workloads.items()
            if not w.rate_rps > 0
        ]
        problems += [
            (f"workloads.{name}.{part}.kind", f"must be one of {LENGTH_KINDS}")
            for name, w in self.workloads.items()
            for part in ("prompt", "output")
            if getattr(w, part).kind not in LENGTH_KINDS
        ]
        if problems:
            raise KeyProblems(problems)

    def profiles(self) -> dict[str, EngineProfile]:
        return {name: c.profile(name) for name, c in self.classes.items()}

    def link_value(self) -> Link:
        return Link(self.link.bytes_per_s, self.model.kv_bytes_per_token, self.link.overlap)

    def objectives_value(self) -> Objectives:
        return Objectives(self.objectives.ttft_p99_s, self.objectives.tpot_p50_s)

    def advise(self, ingress: Ingress, *, requests: int = 600, seed: int = 0) -> Advice:
        """The advisor over this file's classes, roles, objectives, link and model."""
        return advise(
            ingress,
            self.profiles(),
            self.roles.prefill,
            self.roles.decode,
            self.objectives_value(),
            self.link_value(),
            layers=self.model.layers,
            requests=requests,
            seed=seed,
        )


def load_plan_inputs(path: str | Path) -> PlanInputs:
    return parse_config(PlanInputs, read_yaml_mapping(path, "plan inputs"))
