"""How a doctor run is printed: a plain-text table, or one JSON object.

Contract: :func:`render_table` returns the table as text (one row per check: severity, name,
what was found, wrapped; the fix on its own ``fix:`` line below; then a summary line with the
worst severity and the exit code); :func:`as_json` returns the ``--json`` document::

    {"node_id": ..., "config": FILE or null, "worst": "ok"|"info"|"warn"|"error",
     "exit_code": 0|1|2, "counts": {"ok": n, ...},
     "checks": [{"name", "severity", "message", "fix", "values": {...}}, ...]}

Plain text on purpose: no table library is a dependency of kvfabric, and the output is read
in terminals, CI logs and tickets alike.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from kvfabric.doctor.result import CheckResult, Severity, worst

WIDTH = 100
HEADER = ("SEVERITY", "CHECK", "FINDING")


def counts(results: Sequence[CheckResult]) -> dict[str, int]:
    return {s.value: sum(r.severity is s for r in results) for s in Severity}


def summary(results: Sequence[CheckResult]) -> str:
    bad = worst(results)
    tally = ", ".join(f"{n} {name}" for name, n in counts(results).items() if n)
    return f"{len(results)} checks: {tally}; worst {bad.value} (exit {bad.exit_code})"


def render_table(results: Sequence[CheckResult], *, title: str = "", width: int = WIDTH) -> str:
    name_width = max([len(HEADER[1]), *(len(r.name) for r in results)])
    indent = " " * (len(HEADER[0]) + 2 + name_width + 2)
    text_width = max(40, width - len(indent))
    lines = [title] if title else []
    lines.append(f"{HEADER[0]:{len(HEADER[0])}}  {HEADER[1]:{name_width}}  {HEADER[2]}")
    for result in results:
        wrapped = textwrap.wrap(result.message, text_width) or [""]
        lines.append(
            f"{result.severity.value:{len(HEADER[0])}}  {result.name:{name_width}}  {wrapped[0]}"
        )
        lines += [indent + line for line in wrapped[1:]]
        if result.fix:
            lines += [
                indent + line
                for line in textwrap.wrap(
                    f"fix: {result.fix}", text_width, subsequent_indent="     "
                )
            ]
    lines.append(summary(results))
    return "\n".join(lines)


def as_json(
    results: Sequence[CheckResult], *, node_id: str = "", config: str | None = None
) -> dict[str, object]:
    bad = worst(results)
    return {
        "node_id": node_id,
        "config": config,
        "worst": bad.value,
        "exit_code": bad.exit_code,
        "counts": counts(results),
        "checks": [r.as_dict() for r in results],
    }
