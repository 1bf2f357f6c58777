"""The capacity plan's plots (matplotlib, PNG, no screen needed): one function per study of
:mod:`kvfabric.planning.studies`, each writing one file and returning its path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in CI

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from kvfabric.planning.studies import LayoutRow, OverlapRow, PriceRow, WindowAdvice


def layouts(rows: Sequence[LayoutRow], path: Path) -> Path:
    """Monolithic against disaggregated: TTFT / TPOT p99 and utilisation per workload."""
    workloads = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels: list[tuple[str, Callable[[LayoutRow], float] | None]] = [
        ("TTFT p99 (s)", lambda r: r.ttft_p99_s),
        ("TPOT p99 (ms)", lambda r: r.tpot_p99_s * 1e3),
        ("utilisation (prefill | decode)", None),
    ]
    for ax, (title, get) in zip(axes, panels, strict=True):
        for i, w in enumerate(workloads):
            mine = [r for r in rows if r.workload == w]
            for j, r in enumerate(mine):
                x = i * 3 + j
                if get is None:
                    ax.bar(x - 0.2, r.prefill_utilisation, 0.4, color="tab:blue")
                    ax.bar(x + 0.2, r.decode_utilisation, 0.4, color="tab:orange")
                else:
                    ax.bar(x, get(r), 0.6, color="tab:gray" if j == 0 else "tab:green")
                ax.text(x, 0, r.layout.split()[0][:4], ha="center", va="bottom", fontsize=7)
        ax.set_xticks([i * 3 + 0.5 for i in range(len(workloads))], workloads)
        ax.set_title(title)
    fig.suptitle("monolithic vs disaggregated, same engines")
    return _save(fig, path)


def overlap(rows: Sequence[OverlapRow], prompt_tokens: int, path: Path) -> Path:
    """Share of KV landed at prefill end against link bandwidth, one line per layer count."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for layers in sorted({r.layers for r in rows}):
        mine = sorted((r for r in rows if r.layers == layers), key=lambda r: r.bytes_per_s)
        ax.plot(
            [r.bytes_per_s * 8 / 1e9 for r in mine],
            [r.landed_fraction for r in mine],
            marker="o",
            label=f"{layers} layers",
        )
    ax.axhline(0.95, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("link, Gb/s")
    ax.set_ylabel("KV landed when prefill ends")
    ax.set_title(f"layer-wise streaming, {prompt_tokens}-token prompt")
    ax.legend()
    return _save(fig, path)


def prices(rows: Sequence[PriceRow], path: Path) -> Path:
    """Price per million tokens of each cluster sized to the same objectives."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([r.cluster for r in rows], [r.cost_per_million_tokens for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(i, r.cost_per_million_tokens, r.composition, ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("price per million tokens")
    ax.set_title("same objectives: tiered vs one class")
    return _save(fig, path)


def rebalancing(windows: Sequence[WindowAdvice], path: Path) -> Path:
    """Advised prefill and decode engines per window of a shifting ingress."""
    fig, ax = plt.subplots(figsize=(7, 4))
    starts = [w.start_s for w in windows]
    ax.step(starts, [w.advice.prefill_engines for w in windows], where="post", label="prefill")
    ax.step(starts, [w.advice.decode_engines for w in windows], where="post", label="decode")
    ax.set_xlabel("window start, s")
    ax.set_ylabel("engines advised")
    ax.set_title("the P:D advice follows the ingress mix")
    ax.legend()
    return _save(fig, path)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
