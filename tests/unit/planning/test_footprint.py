"""An engine's footprint: its processes' CPU over its busiest one's, read from /proc."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvfabric.planning.footprint import snapshot, threads_between


def test_the_footprint_is_all_cpu_over_each_groups_busiest_process() -> None:
    before = {10: {11: 1.0, 12: 5.0}, 20: {21: 0.0}}
    after = {10: {11: 2.0, 12: 9.0, 13: 0.5}, 20: {21: 2.0, 22: 1.0}}
    # group 10: 1 + 4 + 0.5 over 4; group 20: 2 + 1 over 2 -> 8.5 / 6
    assert threads_between(before, after) == pytest.approx(8.5 / 6)
    assert threads_between(after, after) is None  # nothing ran: nothing measured
    assert threads_between({}, {30: {}}) is None


def test_a_snapshot_reads_the_cpu_of_every_process_of_a_group() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not snapshot([busy.pid])[busy.pid].get(busy.pid):
            assert time.monotonic() < deadline, "the spinning child used no CPU"
            time.sleep(0.05)
        first = snapshot([busy.pid])
        time.sleep(0.3)
        second = snapshot([busy.pid, 2**22 + 7])  # a group no process is in: empty
        assert second[2**22 + 7] == {}
        assert second[busy.pid][busy.pid] > first[busy.pid][busy.pid]
        assert threads_between(first, second) == pytest.approx(1.0)  # one process
    finally:
        busy.kill()
        busy.wait()
