"""``kvfabric plan report``: every study of :mod:`kvfabric.planning.studies` on one input file,
written as tables (``report.md``, ``report.json``) and plots (PNG) into a directory.

Which classes play which part: the first of ``roles.prefill`` is the newest class; the
tiered cluster decodes interactive requests on the second of ``roles.decode`` and the batch
share on the last (a CPU class). The mono/disaggregated study runs every workload; the
tiered study and the shifting ingress use the workloads named in :class:`ReportSettings`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvfabric.planning import figures, studies
from kvfabric.planning.inputs import PlanInputs

OVERLAP_LAYERS = (16, 32, 80)
OVERLAP_GBPS = (10, 25, 50, 100, 200, 400)


@dataclass(frozen=True)
class ReportSettings:
    overlap_prompt_tokens: int = 8192
    tiered_workload: str = "long-output"
    batch_share: float = 0.5
    batch_tpot_p50_s: float = 0.25
    shift: tuple[str, str] = ("long-prompt", "long-output")
    shift_each_s: float = 120.0
    shift_window_s: float = 30.0
    seed: int = 0


def write_report(inputs: PlanInputs, out: Path, settings: ReportSettings) -> dict[str, object]:
    """Run the studies, write the files; returns what report.json holds."""
    out.mkdir(parents=True, exist_ok=True)
    seed = settings.seed
    layouts = [r for w in inputs.workloads for r in studies.mono_vs_disagg(inputs, w, seed)]
    grid = studies.overlap_grid(
        inputs,
        settings.overlap_prompt_tokens,
        OVERLAP_LAYERS,
        [g * 1e9 / 8 for g in OVERLAP_GBPS],
    )
    roles = inputs.roles
    tiers = (roles.prefill[0], roles.decode[min(1, len(roles.decode) - 1)], roles.decode[-1])
    prices = studies.tiered_vs_flat(
        inputs,
        settings.tiered_workload,
        tiers,
        settings.batch_share,
        settings.batch_tpot_p50_s,
        seed,
    )
    first, then = settings.shift
    shifting = studies.shifting_ingress(inputs, first, then, settings.shift_each_s, seed)
    windows = studies.rebalance(inputs, shifting, settings.shift_window_s, seed)
    plots = [
        figures.layouts(layouts, out / "mono_vs_disagg.png"),
        figures.overlap(grid, settings.overlap_prompt_tokens, out / "overlap.png"),
        figures.prices(prices, out / "tiered_vs_flat.png"),
        figures.rebalancing(windows, out / "rebalance.png"),
    ]
    data: dict[str, object] = {
        "mono_vs_disagg": [dataclasses.asdict(r) for r in layouts],
        "overlap": [dataclasses.asdict(r) for r in grid],
        "tiered_vs_flat": [dataclasses.asdict(r) for r in prices],
        "rebalance": [
            {
                "start_s": w.start_s,
                "rate_rps": w.rate_rps,
                "prompt_mean": w.prompt_mean,
                "output_mean": w.output_mean,
                "prefill": f"{w.advice.prefill_engines} {w.advice.prefill_class}",
                "decode": f"{w.advice.decode_engines} {w.advice.decode_class}",
                "met": w.advice.met,
            }
            for w in windows
        ],
        "plots": [p.name for p in plots],
    }
    (out / "report.json").write_text(json.dumps(_finite(data), indent=2) + "\n")
    (out / "report.md").write_text(markdown(data))
    return data


def markdown(data: dict[str, object]) -> str:
    """The report's tables as markdown."""
    parts = []
    for title, key in (
        ("Monolithic vs disaggregated (same engines)", "mono_vs_disagg"),
        ("Layer-wise overlap (KV landed when prefill ends)", "overlap"),
        ("Tiered vs one class, same objectives", "tiered_vs_flat"),
        ("P:D advice per window of a shifting ingress", "rebalance"),
    ):
        rows = data[key]
        assert isinstance(rows, list)
        parts.append(f"## {title}\n\n{table(rows)}")
    return "\n\n".join(parts) + "\n"


def table(rows: list[dict[str, object]]) -> str:
    if not rows:
        return "(none)"
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(r[k]) for k in head) + " |" for r in rows]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _finite(value: object) -> object:
    """JSON has no NaN: undefined figures (a TPOT of one-token outputs) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
