"""Helpers shared by the kvfabric benchmarks: timing, percentiles, output, thread limits.

Import this module before numpy (or anything that imports numpy): it caps the OpenMP / BLAS
thread pools at one thread, which those libraries only read when they load. Benchmarks print
a table for people and, with ``--json``, exactly one JSON object on stdout (the table then
goes to stderr), so their output can be piped straight into a JSON parser.

Exit status: :func:`report` returns 1 when a target was missed (naming each on stderr) and 0
otherwise; every benchmark's ``main`` returns it, so a missed target fails a CI step.

Child processes: a benchmark run as a script (``python benchmarks/x.py``) gets, from this
module's import, handlers that turn SIGTERM and SIGHUP into ``SystemExit`` (its ``finally``
blocks then kill what they started) and an exit hook that kills every descendant still
running (engines, daemons, redis-servers, however they were started: they are found by
parent pid in /proc, their process groups included). The children this module starts also
die with it if it is killed outright (``PR_SET_PDEATHSIG``). :func:`install_cleanup` does the
same for any other script.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self, TextIO

# Single-threaded numeric libraries: the benchmark machines have few, shared cores, and a
# thread pool spinning next to the code under test skews every figure.
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

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


def print_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str], file: TextIO = sys.stdout
) -> None:
    """An aligned text table; floats get 4 significant digits, numbers align right."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    cells = [[cell(row.get(column)) for column in columns] for row in rows]
    widths = [
        max([len(column), *(len(line[i]) for line in cells)]) for i, column in enumerate(columns)
    ]
    numeric = [
        all(isinstance(row.get(column), (int, float)) or row.get(column) is None for row in rows)
        for column in columns
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ).rstrip()

    print(line(columns), file=file)
    print(line(["-" * w for w in widths]), file=file)
    for values in cells:
        print(line(values), file=file)


def emit_json(obj: Mapping[str, Any]) -> None:
    """Print ``obj`` as one JSON document on stdout."""
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def met(value: float | None, op: str, target: float) -> bool:
    """Whether ``value`` meets ``op target``; a figure that could not be measured does not."""
    if value is None:
        return False
    return value >= target if op == ">=" else value <= target


EXIT_MISSED = 1  # a benchmark's exit status when a target was missed


def missed_targets(
    figures: Mapping[str, float | None], targets: Mapping[str, tuple[str, float]]
) -> list[str]:
    """One line per missed target: ``name = value (target op bound)``."""
    return [
        f"{name} = {figures.get(name)} (target {op} {bound})"
        for name, (op, bound) in targets.items()
        if not met(figures.get(name), op, bound)
    ]


def report(
    figures: Mapping[str, float],
    targets: Mapping[str, tuple[str, float]],
    described: Sequence[tuple[str, str]],
    *,
    as_json: bool,
    quick: bool,
) -> int:
    """The table (stderr when JSON goes to stdout) and, with ``as_json``, one JSON object.

    Returns the exit status: :data:`EXIT_MISSED` when a target was missed (each one named on
    stderr, after the table), else 0."""
    verdicts = {name: met(figures.get(name), *target) for name, target in targets.items()}
    rows = [
        {
            "figure": name,
            "value": figures[name],
            "target": " ".join(map(str, targets[name])) if name in targets else "",
            "met": ("yes" if verdicts[name] else "NO") if name in targets else "",
            "what": what,
        }
        for name, what in described
    ]
    print_table(
        rows,
        ["figure", "value", "target", "met", "what"],
        file=sys.stderr if as_json else sys.stdout,
    )
    if as_json:
        emit_json(
            {
                **figures,
                "targets_met": verdicts,
                "all_targets_met": all(verdicts.values()),
                "quick": quick,
            }
        )
    missed = missed_targets(figures, targets)
    for line in missed:
        print(f"{Path(sys.argv[0]).name}: target missed: {line}", file=sys.stderr)
    sys.stderr.flush()
    return EXIT_MISSED if missed else 0


# -- child processes ---------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_cleanup_installed = False


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the benchmark dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the exit hook still covers orderly exits


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


@contextmanager
def daemon_process(
    data_dir: Path, *settings: str, ready_timeout_s: float = 60.0
) -> Iterator[dict[str, Any]]:
    """A ``kvfabric serve`` child process on ``data_dir`` (HTTP on a free loopback port);
    yields its ready file (socket, http_port, tcp_port, ...); killed when the block ends."""
    data_dir.mkdir(parents=True)
    ready = data_dir / "ready.json"
    args = [
        sys.executable,
        "-m",
        "kvfabric.cli",
        "serve",
        "--ready-file",
        str(ready),
        "--set",
        f"store.data_dir={data_dir}",
        "--set",
        "http.host=127.0.0.1",
        "--set",
        "http.port=0",
    ]
    for item in settings:
        args += ["--set", item]
    log_path = data_dir / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not come up:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.02)
        yield json.loads(ready.read_text())
    finally:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A private ``redis-server`` on a free loopback port, no persistence; yields its URL."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on PATH")
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 (prctl only, before exec)
    )
    try:
        client = redis.Redis(port=port, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.02)
        client.close()
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
