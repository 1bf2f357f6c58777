"""How many cores a running engine keeps busy: its ``threads`` in the simulator.

A vLLM server is several processes: the API server (HTTP, tokenizing, streaming), the engine
core (scheduling) and the model runner (the forward passes; on the CPU one OpenMP thread per
core it is bound to). While it serves, all of them burn CPU, so on a small host two engines
slow each other down before their model runners alone fill the cores (measured on 2 vCPUs:
37.6 core-s model runners, 11.5 engine cores, plus the API servers, over a validation run).

:func:`snapshot` reads each process's CPU time from ``/proc`` for the process groups of the
engines (a served engine runs in a group of its own); :func:`threads_between` is the engines'
whole CPU over the CPU of each one's busiest process (its model runner) across a window: the
cores it keeps busy per core of compute. Linux only: elsewhere, or for processes gone,
``threads_between`` answers ``None`` and the caller keeps its default.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

PROC = Path("/proc")

Snapshot = Mapping[int, Mapping[int, float]]  # process group -> pid -> CPU seconds


def snapshot(groups: Iterable[int]) -> Snapshot:
    """CPU seconds (user + system) of every live process in ``groups``, by group and pid."""
    wanted = set(groups)
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[int, dict[int, float]] = {g: {} for g in wanted}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        group = int(fields[2])
        if group in wanted:
            found[group][int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / tick
    return found


def threads_between(before: Snapshot, after: Snapshot) -> float | None:
    """The groups' CPU over their busiest processes' CPU between two snapshots; None when
    no process of them used CPU in between (nothing measured)."""
    total = busiest = 0.0
    for group, pids in after.items():
        used = [cpu - before.get(group, {}).get(pid, 0.0) for pid, cpu in pids.items()]
        if used:
            total += sum(used)
            busiest += max(used)
    if busiest <= 0:
        return None
    return total / busiest
