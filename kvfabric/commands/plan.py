"""``kvfabric plan``: the capacity planner (:mod:`kvfabric.planning`, :mod:`kvfabric.sim`)."""

from __future__ import annotations

import argparse

from kvfabric.commands.common import add_command, fail
from kvfabric.errors import KVFabricError

DESCRIPTION = """\
Size a cluster with kvfabric's simulator (its own scheduling policies, engines modelled per
hardware class from measured step times).

  report      run every study on an input file: monolithic vs disaggregated, layer-wise
              overlap, tiered vs one class in price per million tokens, the P:D advice as an
              ingress mix shifts; writes report.md, report.json and PNG plots
  advise      the cheapest prefill:decode composition meeting the input file's objectives
              for one of its workloads (or a rate and mean lengths given here)
  calibrate   measure a running vLLM server's prefill and decode step times: the class
              profile the input file takes
  scale       the global index, Redis Cluster and KV-event path at up to 10,000 nodes

examples:
  kvfabric plan report --inputs configs/plan/example.yaml --out plan-report
  kvfabric plan advise --inputs configs/plan/example.yaml --workload long-prompt
  kvfabric plan calibrate --url http://127.0.0.1:8000 --model my-model --vocab 32000 \\
      --class cpu --cost-per-hour 0.9
  kvfabric plan scale --nodes 10000"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        commands,
        "plan",
        help="capacity planner: simulate, advise P:D, scale",
        description=DESCRIPTION,
    )
    sub = parser.add_subparsers(dest="plan_command", required=True, metavar="WHAT")

    report = sub.add_parser("report", help="every study, as tables and plots")
    report.add_argument("--inputs", required=True, metavar="FILE")
    report.add_argument("--out", required=True, metavar="DIR")
    report.add_argument("--seed", type=int, default=0)
    report.set_defaults(handler=_report)

    advise = sub.add_parser("advise", help="the cheapest P:D composition meeting the objectives")
    advise.add_argument("--inputs", required=True, metavar="FILE")
    advise.add_argument("--workload", help="a workload of the file")
    advise.add_argument("--rate", type=float, help="requests per second (instead of --workload)")
    advise.add_argument("--prompt-mean", type=float, help="mean prompt tokens (lognormal)")
    advise.add_argument("--output-mean", type=float, help="mean output tokens (lognormal)")
    advise.add_argument("--seed", type=int, default=0)
    advise.add_argument("--json", action="store_true", help="one JSON object")
    advise.set_defaults(handler=_advise)

    cal = sub.add_parser("calibrate", help="measure an engine's step-time profile")
    cal.add_argument("--url", required=True, help="the vLLM OpenAI server")
    cal.add_argument("--model", required=True, help="the model name it serves")
    cal.add_argument("--vocab", type=int, required=True, help="its vocabulary size")
    cal.add_argument("--class", dest="cls", required=True, help="the hardware class's name")
    cal.add_argument("--cost-per-hour", type=float, default=0.0)
    cal.set_defaults(handler=_calibrate)

    scale = sub.add_parser("scale", help="index, Redis Cluster and event path at scale")
    scale.add_argument(
        "--redis-url",
        required=True,
        help="a redis-server of your own to measure the index's per-operation costs on "
        "(its keys go under a fresh prefix and are deleted after)",
    )
    scale.add_argument("--nodes", type=int, default=10_000)
    scale.set_defaults(handler=_scale)


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvfabric.planning.inputs import load_plan_inputs

    try:
        from kvfabric.planning.report import ReportSettings, markdown, write_report
    except ModuleNotFoundError as exc:  # matplotlib: the `plan` extra
        why = f"{exc.name} is missing: pip install 'kvfabric[plan]' for the report's plots"
        return fail("plan report", why, 2)
    try:
        inputs = load_plan_inputs(args.inputs)
        data = write_report(inputs, Path(args.out), ReportSettings(seed=args.seed))
    except (KVFabricError, KeyError, ValueError) as exc:
        return fail("plan report", str(exc), 2)
    print(markdown(data))
    print(f"written to {args.out}: report.md, report.json, " + ", ".join(data["plots"]))  # type: ignore[arg-type]
    return 0


def _advise(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from kvfabric.planning.advisor import Ingress
    from kvfabric.planning.inputs import load_plan_inputs
    from kvfabric.sim.workload import Lengths

    try:
        inputs = load_plan_inputs(args.inputs)
        if args.workload:
            ingress = inputs.workloads[args.workload].ingress()
        elif args.rate and args.prompt_mean and args.output_mean:
            ingress = Ingress(
                args.rate,
                Lengths("lognormal", args.prompt_mean, 0.5),
                Lengths("lognormal", args.output_mean, 0.5),
            )
        else:
            return fail(
                "plan advise",
                "give --workload, or --rate, --prompt-mean and --output-mean",
                2,
            )
        advice = inputs.advise(ingress, seed=args.seed)
    except KeyError as exc:
        return fail("plan advise", f"no workload {exc} in {args.inputs}", 2)
    except (KVFabricError, ValueError) as exc:
        return fail("plan advise", str(exc), 2)
    summary = advice.simulated
    if args.json:
        out = dataclasses.asdict(advice)
        out["ratio"] = advice.ratio
        print(json.dumps(out, default=str))
        return 0 if advice.met else 1
    print(
        f"{advice.prefill_engines} x {advice.prefill_class} prefill : "
        f"{advice.decode_engines} x {advice.decode_class} decode "
        f"({advice.cost_per_hour:.2f} per hour)"
        + ("" if advice.met else f"; objectives NOT met: {advice.why}")
    )
    if summary is not None:
        print(
            f"simulated: TTFT p99 {summary.ttft_p99_s:.3f} s, TPOT p50 "
            f"{summary.tpot_p50_s * 1e3:.1f} ms, {summary.cost_per_million_tokens:.3f} per "
            "million tokens"
        )
    return 0 if advice.met else 1


def _calibrate(args: argparse.Namespace) -> int:
    from kvfabric.planning.calibrate import CalibrationError, calibrate

    try:
        found = calibrate(
            args.url, args.model, args.cls, vocab=args.vocab, cost_per_hour=args.cost_per_hour
        )
    except CalibrationError as exc:
        return fail("plan calibrate", str(exc), 1)
    p = found.profile
    print(f"classes:\n  {args.cls}:")
    for key in ("prefill_base_s", "prefill_s_per_token", "decode_base_s", "decode_s_per_seq"):
        print(f"    {key}: {getattr(p, key):.6g}")
    print(f"    cost_per_hour: {p.cost_per_hour:g}")
    return 0


def _scale(args: argparse.Namespace) -> int:
    import dataclasses

    from kvfabric.planning.opcosts import measure_opcosts
    from kvfabric.planning.scale import plan_scale, saturation_curve
    from kvfabric.planning.scale_inputs import REFERENCE_10K
    from kvfabric.planning.scale_report import render_curve, render_table

    try:
        costs = measure_opcosts(args.redis_url)
    except KVFabricError as exc:
        return fail("plan scale", str(exc), 2)
    inputs = dataclasses.replace(REFERENCE_10K, nodes=args.nodes)
    print(render_table(plan_scale(inputs, costs)))
    print()
    counts = sorted({10, 100, 1000, 10_000, args.nodes})
    print(render_curve(saturation_curve(inputs, costs, counts)))
    return 0
