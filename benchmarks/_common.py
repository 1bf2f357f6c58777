"""Helpers shared by the kvfabric benchmarks: thread limits, timing, percentiles, inputs,
and the cleanup of child processes. Arguments, the table, the JSON object and the targets
are :mod:`_runner`'s.

Import this module before numpy (or anything that imports numpy): it caps the OpenMP / BLAS
thread pools at one thread, which those libraries only read when they load.

Process helpers: this module puts ``tests/support`` on ``sys.path`` (the one place that
does), so a benchmark starts its daemons and redis-servers with the helpers the tests use
(``daemon_process.DaemonProcess``, ``redis_process.RedisServer``, ``engine_jobs``): each
child in a process group of its own that dies with the benchmark even if it is killed
outright (``PR_SET_PDEATHSIG``).

Child processes: a benchmark run as a script (``python benchmarks/x.py``) gets, from this
module's import, handlers that turn SIGTERM and SIGHUP into ``SystemExit`` (its ``finally``
blocks then kill what they started) and an exit hook that kills every descendant still
running (engines, daemons, redis-servers, however they were started: they are found by
parent pid in /proc, their process groups included). :func:`install_cleanup` does the same
for any other script.
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

# Single-threaded numeric libraries: the benchmark machines have few, shared cores, and a
# thread pool spinning next to the code under test skews every figure.
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

# The process helpers shared with the tests (not part of the installed package).
SUPPORT = Path(__file__).resolve().parents[1] / "tests" / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

import numpy as np  # noqa: E402  (after the thread caps above, which numpy reads on import)


def limit_torch_threads() -> None:
    """Give torch one intra-op thread if something imported it (never imports it itself)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


class Timer:
    """Wall time of a block: ``with Timer() as t: ...`` then ``t.seconds``."""

    seconds: float = 0.0

    def __enter__(self) -> Self:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


def measure(fn: Callable[[int], object], repeat: int) -> list[float]:
    """Seconds taken by each call ``fn(0)``, ..., ``fn(repeat - 1)``.

    The cyclic garbage collector is off while sampling (as in ``timeit``), so a collection
    triggered by earlier allocations is not charged to whichever call happens to run into it.
    """
    samples: list[float] = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(repeat):
            start = time.perf_counter()
            fn(i)
            samples.append(time.perf_counter() - start)
    finally:
        if was_enabled:
            gc.enable()
    return samples


def measure_pairs(
    pairs: Sequence[tuple[Callable[[int], object], Callable[[int], object]]],
    repeat: int,
    *,
    flip: bool = False,
) -> list[tuple[float, float]]:
    """Median seconds per call of each ``(baseline, subject)`` pair, measured back to back.

    Pairs run in order (a later pair may read what an earlier one wrote). Within a pair the
    baseline goes first unless ``flip``: alternate it between rounds so that neither side
    always runs right after the other has warmed (or dirtied) a cache.
    """
    out: list[tuple[float, float]] = []
    for baseline, subject in pairs:
        if flip:
            subject_s = median(measure(subject, repeat))
            baseline_s = median(measure(baseline, repeat))
        else:
            baseline_s = median(measure(baseline, repeat))
            subject_s = median(measure(subject, repeat))
        out.append((baseline_s, subject_s))
    return out


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated like ``numpy.percentile``."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(samples: Sequence[float]) -> float:
    return percentile(samples, 50)


# -- child processes ---------------------------------------------------------------------

_cleanup_installed = False


def descendants(pid: int | None = None) -> list[int]:
    """Every live descendant of ``pid`` (default: this process), by parent pid in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                ppid = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [os.getpid() if pid is None else pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_descendants() -> int:
    """SIGKILL every descendant and the process groups they lead; returns how many."""
    found = descendants()
    own_group = os.getpgrp()
    for pid in found:
        try:
            group = os.getpgid(pid)
            if group == pid and group != own_group:  # a child in a session of its own
                os.killpg(group, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in found:  # reap our direct children so none lingers as a zombie
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    return len(found)


def _exit_on_signal(number: int, _frame: object) -> None:
    raise SystemExit(128 + number)  # unwinds through the callers' finally blocks


def install_cleanup() -> None:
    """SIGTERM / SIGHUP end the run through ``finally`` blocks, and whatever is still
    running when the interpreter exits is killed (see the module docstring). Idempotent;
    call from the main thread."""
    global _cleanup_installed
    if _cleanup_installed:
        return
    _cleanup_installed = True
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, _exit_on_signal)
    atexit.register(kill_descendants)


def _run_as_a_benchmark() -> bool:
    """Whether the running script is a file of this directory (not pytest, not ``-c``)."""
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else None
    return (
        main is not None
        and main.is_file()
        and main.resolve().parent == Path(__file__).resolve().parent
    )


if _run_as_a_benchmark():
    install_cleanup()


def tokens(count: int, seed: int, vocab: int = 128_000) -> np.ndarray:
    """A reproducible prompt of ``count`` token ids (int32, as connectors keep them)."""
    return np.random.default_rng(seed).integers(0, vocab, count, dtype=np.int32)


def touched(nbytes: int) -> np.ndarray:
    """A buffer whose pages are faulted in now, like a pre-faulted arena."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)
    return buf


def memfd_pages(arena_bytes: int) -> str:
    """What pages a daemon's arena of ``arena_bytes`` gets here (its tiers' default
    ``huge_pages: auto`` takes reserved huge pages when enough are free), with the kernel's
    shared-memory settings: copies against ``memcpy`` depend on it."""
    from kvfabric.memory import pagesize

    if 0 < arena_bytes <= pagesize.hugetlb_free_bytes():
        return f"2 MiB (reserved huge pages, {pagesize.hugetlb_free_bytes() >> 20} MiB free)"
    return pagesize.describe().summary()


def cpu_idle() -> str:
    """What an idle CPU does here (``kvfabric doctor``'s ``cpu.idle``): every socket round
    trip pays its wake-up, which a virtual machine's guest without halt polling makes a trip
    through the hypervisor."""
    from kvfabric.doctor.cpuidle import read_idle

    return read_idle().summary()


def host_cpu() -> str:
    """The host's CPU model and whether it has AMX (vLLM CPU's kernels, and so its
    numerics and speed, differ with it): figures name the host they came from."""
    model, amx = "unknown", False
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                amx = amx or "amx_tile" in line.split()
    except OSError:
        pass
    return f"{model} (AMX: {'yes' if amx else 'no'})"
