"""Capacity planner benchmark: the simulator against a real CPU cluster, its speed, the
advisor's ratios, layer-wise overlap and the 10,000-node index plan.

Validation (real parts: two vLLM CPU OpenAI servers of the tests' random-weight tiny Llama
built locally, each with KVFabricConnector on a node daemon of its own, behind ``kvfabric
gateway`` with ``GATEWAY_MAX_RUNNING`` slots per engine and no node ids, so every request
runs on one engine; each engine's compute thread on a core of its own):
``kvfabric.planning.validate`` warms both engines, calibrates engine 0
(``kvfabric.planning.calibrate``: prefill time by prompt length, decode step by batch) while
engine 1 idles (after a first mix through the gateway: engines on a small CPU host keep
getting faster over their first minute), measures the engines' footprint over that mix and
the calibration (``kvfabric.planning.footprint``: the cores a served engine keeps busy, API
server and engine core beside the model runner; ``calibrated_profile.threads``), sends a
request mix (Poisson at ``LOAD`` of what
the calibrated engines serve, prompts of 32..512 random tokens, 8..48 output tokens,
streamed, ``ignore_eos``) through the gateway, and simulates the same requests on the same
cluster (both engines on one host of this machine's cores); every request, measured and
simulated, goes to ``validation.json`` in the work directory (``--keep`` keeps it):

- ``sim_vs_measured_ttft_p50_error`` / ``..._ttft_p99_error`` / ``..._tpot_p50_error``:
  ``|simulated - measured| / measured`` (targets <= 0.25 on p50 TTFT and TPOT).

The model (``configs/plan/example.yaml``: its classes' speeds and prices are inputs, not
measurements):

- ``sim_events_per_s``: simpy events the simulator schedules per second of wall time on the
  example's long-output workload, ``EVENT_REQUESTS`` requests (target >= 100k);
- ``simulated_overlap_landed_fraction``: the seed's setting, a push P/D cluster of the
  example's newest class serving its long-prompt workload (32 layers, 100 Gb/s): over the
  pushed hand-offs, the mean share of a prompt's KV on the decode node when its prefill ended
  (target >= 0.95, the seeds' claim);
- ``advisor_ratio_long_prompt`` / ``advisor_ratio_long_output``: prefill engines per decode
  engine the advisor recommends for each mix; ``advisor_ratio_long_prompt_over_long_output``
  (target > 1: prompt-heavy ingress needs more prefill);
- ``plan_10k_redis_shards``: Redis Cluster shards the global index needs at 10,000 nodes
  (``kvfabric.planning.scale_inputs.REFERENCE_10K``) with per-operation costs measured here
  on a real ``redis-server`` (``kvfabric.planning.opcosts``), with what binds and the first
  component to saturate (``plan_10k_first_saturating``, ``..._at_nodes``).

Every timeout derives from the measured start of the slowest engine. Run (about four
minutes on a quiet 2-core machine, engine starts included)::

    python benchmarks/plan_bench.py --quick --json
"""

from __future__ import annotations

# isort: off
# _common goes first: it caps the numeric libraries' thread pools before numpy loads.
from _common import host_cpu
from _runner import Benchmark, Outcome, model_dir_option, run_benchmark
from child_process import free_port
from daemon_process import DaemonProcess
from engine_jobs import kvfabric_connector, load_model_builder
from gateway_process import GatewayProcess
from redis_process import RedisServer
from vllm_served import ServedEngine
import router_bench as rb
# isort: on

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvfabric.planning import studies
from kvfabric.planning.inputs import load_plan_inputs
from kvfabric.planning.opcosts import measure_opcosts
from kvfabric.planning.scale import plan_scale
from kvfabric.planning.scale_inputs import REFERENCE_10K
from kvfabric.planning.validate import validate
from kvfabric.sched.model import Role
from kvfabric.sim.cluster import ClusterSpec, EngineSpec, simulate
from kvfabric.sim.workload import Phase, Workload, generate

EXAMPLE = Path(__file__).resolve().parents[1] / "configs" / "plan" / "example.yaml"
GATEWAY_MAX_RUNNING = 4
LOAD = 0.5
EVENT_REQUESTS = 3000
VALIDATION_REQUESTS = {True: 100, False: 300}  # by --quick

TARGETS: dict[str, tuple[str, float]] = {
    "sim_vs_measured_ttft_p50_error": ("<=", 0.25),
    "sim_vs_measured_tpot_p50_error": ("<=", 0.25),
    "sim_events_per_s": (">=", 100_000),
    "simulated_overlap_landed_fraction": (">=", 0.95),
    "advisor_ratio_long_prompt_over_long_output": (">=", 1.0001),
}
FIGURES = [
    ("sim_vs_measured_ttft_p50_error", "TTFT p50, |sim - measured| / measured"),
    ("sim_vs_measured_ttft_p99_error", "TTFT p99, |sim - measured| / measured"),
    ("sim_vs_measured_tpot_p50_error", "TPOT p50, |sim - measured| / measured"),
    ("measured_ttft_p50_s", "measured TTFT p50, s"),
    ("simulated_ttft_p50_s", "simulated TTFT p50, s"),
    ("measured_tpot_p50_s", "measured TPOT p50, s"),
    ("simulated_tpot_p50_s", "simulated TPOT p50, s"),
    ("sim_events_per_s", "simulator events per wall second"),
    ("simulated_overlap_landed_fraction", "KV landed at prefill end, pushed hand-offs"),
    ("advisor_ratio_long_prompt", "advised prefill:decode, long prompts"),
    ("advisor_ratio_long_output", "advised prefill:decode, long outputs"),
    ("advisor_ratio_long_prompt_over_long_output", "the two ratios' quotient"),
    ("plan_10k_redis_shards", "Redis shards for the index at 10,000 nodes"),
]


def model_figures(figures: dict[str, Any]) -> None:
    inputs = load_plan_inputs(EXAMPLE)
    profiles, link = inputs.profiles(), inputs.link_value()
    ratios = {}
    for name in ("long-prompt", "long-output"):
        advice = inputs.advise(inputs.workloads[name].ingress())
        key = name.replace("-", "_")
        ratios[key] = advice.ratio
        figures[f"advisor_ratio_{key}"] = round(advice.ratio, 3)
        figures[f"advisor_{key}"] = (
            f"{advice.prefill_engines} {advice.prefill_class} : "
            f"{advice.decode_engines} {advice.decode_class}"
            + ("" if advice.met else f" (not met: {advice.why})")
        )
        if name == "long-prompt":  # the seed's setting: push P/D, layer by layer
            top = inputs.roles.prefill[0]
            engines = tuple(
                EngineSpec(f"p{i}", top, Role.PREFILL) for i in range(advice.prefill_engines)
            ) + tuple(EngineSpec(f"d{i}", top, Role.DECODE) for i in range(advice.decode_engines))
            cluster = ClusterSpec(engines, profiles, link, layers=inputs.model.layers)
            w = inputs.workloads[name].ingress()
            phase = Phase(w.rate_rps, studies.STUDY_REQUESTS / w.rate_rps, w.prompt, w.output)
            result = simulate(cluster, generate(Workload((phase,)), 0))
            figures["simulated_overlap_landed_fraction"] = round(
                studies.simulated_landed_fraction(result), 4
            )
    figures["advisor_ratio_long_prompt_over_long_output"] = round(
        ratios["long_prompt"] / ratios["long_output"], 3
    )
    w = inputs.workloads["long-output"].ingress()
    phase = Phase(w.rate_rps, EVENT_REQUESTS / w.rate_rps, w.prompt, w.output)
    requests = generate(Workload((phase,)), 1)
    cluster = ClusterSpec(
        (
            EngineSpec("p0", "tier1", Role.PREFILL),
            *tuple(EngineSpec(f"d{i}", "tier2", Role.DECODE) for i in range(4)),
        ),
        profiles,
        link,
        layers=inputs.model.layers,
    )
    result = simulate(cluster, requests)
    figures["sim_events_per_s"] = round(result.events_per_s)
    figures["sim_events"] = result.events


def scale_figures(root: Path, figures: dict[str, Any], children: list) -> None:
    redis = RedisServer(root).start()
    children.append(redis)
    costs = measure_opcosts(redis.url)
    plan = plan_scale(REFERENCE_10K, costs)
    figures.update(
        plan_10k_redis_shards=plan.shards,
        plan_10k_shards_bound_by=plan.shards_bound_by,
        plan_10k_shards_by_memory=plan.shards_by_memory,
        plan_10k_first_saturating=plan.first_saturating,
        plan_10k_first_saturation_at_nodes=plan.first_saturation_nodes,
        plan_10k_feasible=not plan.blocked_by,
        plan_10k_index_gib=round(plan.memory_bytes / (1 << 30), 1),
        plan_10k_lookups_per_s=round(plan.lookups_per_s),
        plan_10k_kv_events_per_s=round(plan.kv_events_per_s),
    )


def engine_cores() -> list[dict[str, str]]:
    """Each engine's compute thread on a core of its own where the host has two (vLLM's
    automatic binding puts every engine's on the same core: they would halve each other)."""
    if (os.cpu_count() or 1) < 2:
        return [{}, {}]
    return [{"VLLM_CPU_OMP_THREADS_BIND": str(i)} for i in range(2)]


def validation_figures(
    args: argparse.Namespace, root: Path, figures: dict[str, Any], children: list
) -> None:
    builder = load_model_builder()
    model = builder.build_tiny_llama(args.model_dir or root / "model", **rb.MODEL)
    daemons = []
    for i in range(2):
        daemon = DaemonProcess(root / f"node-{i}", [*rb.DAEMON, f"node_id=node-{i}"]).start()
        children.append(daemon)
        daemons.append(daemon)
    served = [ServedEngine(f"engine-{i}", root / "served", free_port()) for i in range(2)]
    children += served
    engines, start_s = rb.start_engines(
        [
            lambda e=e, d=d, core=core: e.start(
                model, rb.SERVED_NAME, kvfabric_connector(d.socket), env_extra=core
            )
            for e, d, core in zip(served, daemons, engine_cores(), strict=True)
        ]
    )
    figures["engine_start_s"] = round(start_s, 1)
    timeout = 4 * start_s
    config = {
        "model": rb.SERVED_NAME,
        "classes": {"cpu": {"prefill_tps": 5000, "decode_tps": 50}},
        "engines": [
            {
                "id": e.name,
                "url": e.url,
                "role": "both",
                "hardware_class": "cpu",
                "max_running": GATEWAY_MAX_RUNNING,
            }
            for e in engines
        ],
        "deadlines": {"request_s": timeout},
    }
    gateway = GatewayProcess("plan-gateway", root / "served", config)
    children.append(gateway)
    gateway.start().wait_ready(timeout)
    found = validate(
        [e.url for e in engines],
        gateway.url,
        rb.SERVED_NAME,
        vocab=rb.MODEL["vocab"],
        max_running=GATEWAY_MAX_RUNNING,
        host_cores=float(os.cpu_count() or 1),
        load=LOAD,
        count=VALIDATION_REQUESTS[bool(args.quick)],
        timeout_s=timeout,
        process_groups=[e.pid for e in engines],
    )
    simulated = found.run().requests
    (root / "validation.json").write_text(
        json.dumps(
            [
                {
                    "arrival_s": r.arrival_s,
                    "prompt": r.prompt_tokens,
                    "output": r.output_tokens,
                    "ttft_s": m[0],
                    "tpot_s": m[1],
                    "sim_ttft_s": sim.ttft_s,
                    "sim_tpot_s": sim.tpot_s,
                    "engine": sim.prefill_engine,
                }
                for r, m, sim in zip(found.drawn, found.samples, simulated, strict=True)
            ],
            indent=1,
        )
    )
    figures.update(
        sim_vs_measured_ttft_p50_error=round(found.error("ttft_p50_s"), 3),
        sim_vs_measured_ttft_p99_error=round(found.error("ttft_p99_s"), 3),
        sim_vs_measured_tpot_p50_error=round(found.error("tpot_p50_s"), 3),
        measured_ttft_p50_s=round(found.measured.ttft_p50_s, 4),
        simulated_ttft_p50_s=round(found.simulated.ttft_p50_s, 4),
        measured_ttft_p99_s=round(found.measured.ttft_p99_s, 4),
        simulated_ttft_p99_s=round(found.simulated.ttft_p99_s, 4),
        measured_tpot_p50_s=round(found.measured.tpot_p50_s, 4),
        simulated_tpot_p50_s=round(found.simulated.tpot_p50_s, 4),
        validation_rate_rps=round(found.rate_rps, 2),
        validation_requests=len(found.drawn),
        calibrated_profile={
            k: (round(v, 7) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in vars(found.profile).items()
        },
    )


def measure_all(args: argparse.Namespace, root: Path) -> Outcome:
    figures: dict[str, Any] = {"host_cpu": host_cpu()}
    children: list = []
    try:
        started = time.perf_counter()
        model_figures(figures)
        figures["model_s"] = round(time.perf_counter() - started, 1)
        scale_figures(root, figures, children)
        validation_figures(args, root, figures, children)
    finally:
        for child in reversed(children):
            child.kill()
    return Outcome(figures)


BENCH = Benchmark(
    __doc__,
    "kvfabric-plan-bench-",
    TARGETS,
    FIGURES,
    quick_help=f"{VALIDATION_REQUESTS[True]} validation requests (else "
    f"{VALIDATION_REQUESTS[False]})",
    add_arguments=model_dir_option,
    keep_option=True,
)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(BENCH, measure_all, argv)


if __name__ == "__main__":
    sys.exit(main())
