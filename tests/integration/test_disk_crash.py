"""SIGKILL crash test of the SSD tier.

A child process (disk_crash_child.py) writes to a DiskTier and acknowledges each write
once its future completes; the parent kills it with SIGKILL at a random moment, reopens
the directory and checks: every acknowledged (and not deleted) key is recovered and reads
back byte-exact; deleted keys are never served; anything else that is recovered is either
byte-exact or refused with CorruptRecordError. The directory accumulates across rounds, so
each child restarts over the torn tails its predecessors left.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import kvfabric.tiers.disk as disk_pkg
from kvfabric.errors import CorruptRecordError
from kvfabric.tiers.disk import DiskTier, DiskTierStats, RecoveredRecord

CHILD = Path(__file__).with_name("disk_crash_child.py")
REPO_ROOT = Path(disk_pkg.__file__).resolve().parents[3]
ROUNDS = 25


def _load_child() -> ModuleType:
    spec = importlib.util.spec_from_file_location("disk_crash_child", CHILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child = _load_child()


@dataclass
class Ledger:
    """What the parent knows from the children's acknowledgements."""

    live: set[bytes] = field(default_factory=set)  # must be recovered, byte-exact
    maybe: set[bytes] = field(default_factory=set)  # a delete was started: either way is fine
    gone: set[bytes] = field(default_factory=set)  # deleted: must never be served
    acked_total: int = 0


def run_child(
    directory: Path, seed: int, delay: float, ledger: Ledger, kill_at_acks: int = 0
) -> None:
    """Run one child until SIGKILL (after ``delay`` s past READY, or ``kill_at_acks`` acks)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), str(seed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(60, proc.kill)  # a hung child must not hang the test
    killer = threading.Timer(delay, proc.kill)
    watchdog.start()
    acks = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            kind, _, arg = line.rstrip("\n").partition(" ")
            if not line.endswith("\n"):
                continue  # cannot happen for one short write(), but never trust a cut line
            if kind == "READY":
                killer.start()
            elif kind == "W":
                ledger.live.add(bytes.fromhex(arg))
                acks += 1
                if acks == kill_at_acks:
                    proc.kill()
            elif kind == "d":
                key = bytes.fromhex(arg)
                ledger.live.discard(key)
                ledger.maybe.add(key)
            elif kind == "D":
                key = bytes.fromhex(arg)
                ledger.maybe.discard(key)
                ledger.gone.add(key)
    finally:
        killer.cancel()
        watchdog.cancel()
        proc.kill()
        _, stderr = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"child exited {proc.returncode}:\n{stderr}"
    ledger.acked_total += acks


def read_payload(tier: DiskTier, rec: RecoveredRecord) -> bytes:
    out = np.empty(rec.extent.payload_len, dtype=np.uint8)
    half = len(out) // 2
    tier.read_into(rec.extent, [out[:half], out[half:]], key=rec.key)
    return out.tobytes()


def verify(directory: Path, ledger: Ledger) -> DiskTierStats:
    """Reopen, scan and check every promise; recovered valid extras join ``live``."""
    tier: DiskTier = child.open_tier(str(directory))
    try:
        found = {r.key: r for r in tier.scan()}
        missing = ledger.live - found.keys()
        assert not missing, f"{len(missing)} acknowledged keys lost"
        resurrected = ledger.gone & found.keys()
        assert not resurrected, f"{len(resurrected)} deleted keys came back"
        for key, rec in found.items():
            try:
                data = read_payload(tier, rec)
            except CorruptRecordError:
                assert key not in ledger.live, "an acknowledged record was corrupt"
                continue
            assert rec.meta == b"crash-test"
            assert data == child.payload_for(key), "wrong bytes served"
            if key not in ledger.maybe:
                ledger.live.add(key)  # durable now: later rounds must keep it
        return tier.stats()
    finally:
        tier.close()


def test_sigkill_rounds_never_lose_acknowledged_writes(tmp_path: Path) -> None:
    rng = random.Random(20240611)
    ledger = Ledger()
    directory = tmp_path / "ssd"
    for round_no in range(ROUNDS):
        run_child(
            directory, seed=rng.randrange(1 << 30), delay=rng.uniform(0.0, 0.5), ledger=ledger
        )
        stats = verify(directory, ledger)
        assert stats.records_live >= len(ledger.live), f"round {round_no}"
    assert ledger.acked_total > 0 and ledger.live


def test_damage_after_a_crash_is_counted_and_never_served(tmp_path: Path) -> None:
    ledger = Ledger()
    directory = tmp_path / "ssd"
    run_child(directory, seed=1, delay=30.0, ledger=ledger, kill_at_acks=40)
    verify(directory, ledger)
    tier: DiskTier = child.open_tier(str(directory))
    recs = [r for r in tier.scan() if r.key in ledger.live]
    tier.close()
    # Damage: flip one payload byte of one record, cut the last record of the newest segment.
    last = max(recs, key=lambda r: (r.extent.segment_id, r.extent.offset))
    flipped = next(r for r in recs if r.extent.payload_len > 0 and r is not last)
    with open(directory / f"seg-{flipped.extent.segment_id:08d}.kvf", "r+b") as f:
        f.seek(flipped.extent.payload_offset + flipped.extent.payload_len // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    cut = (
        last.extent.payload_offset + last.extent.payload_len // 2
        if last.extent.payload_len > 1
        else last.extent.offset + 100
    )
    os.truncate(directory / f"seg-{last.extent.segment_id:08d}.kvf", cut)

    tier = child.open_tier(str(directory))
    try:
        found = {r.key: r for r in tier.scan()}
        assert last.key not in found
        assert tier.stats().torn_records >= 1
        corrupt_before = tier.stats().corrupt_records
        with pytest.raises(CorruptRecordError, match="checksum"):
            read_payload(tier, found[flipped.key])
        assert tier.stats().corrupt_records == corrupt_before + 1
        for key in ledger.live - {last.key, flipped.key}:
            assert read_payload(tier, found[key]) == child.payload_for(key)
    finally:
        tier.close()
    ledger.live -= {last.key, flipped.key}
    ledger.gone |= {last.key, flipped.key}  # refused once: must stay refused
    verify(directory, ledger)
    # A child restarts over the damaged directory and keeps every promise.
    run_child(directory, seed=2, delay=0.3, ledger=ledger)
    verify(directory, ledger)
