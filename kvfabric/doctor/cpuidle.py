"""CPU idle check: what an idle CPU does, which every control round trip pays to wake it.

Contract: :func:`read_idle` reads the node's cpuidle settings from sysfs (never raising: a
missing file reads as unknown); :func:`check_idle` returns one ``cpu.idle`` result from them,
never raising for what it finds.

Why: an engine's request to the daemon wakes the daemon's CPU, and the reply wakes the
engine's. On a virtual machine whose guest halts an idle vCPU at once (the ``haltpoll``
cpuidle driver with ``guest_halt_poll_ns`` = 0), each wake-up is a trip through the
hypervisor. Measured on a 2-vCPU KVM guest (Intel Xeon, ``benchmarks/daemon_bench.py``'s
client and daemon): a ``ping`` round trip 104-131 us at 0, 50 us at 50000 ns, 28-51 us at
200000 (the kernel's default); a 512-chunk ``lookup`` 213-240, 193 and 147-150 us. Polling
costs an idle vCPU up to that window of spinning after each wake-up, shrunk when polls do not
pay off (``guest_halt_poll_allow_shrink``); on bare metal the CPU's own C-states play this
part and are the BIOS's and the kernel's business (info only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfabric.doctor.result import CheckResult, Severity

CPUIDLE = Path("/sys/devices/system/cpu/cpuidle")
HALTPOLL = Path("/sys/module/haltpoll/parameters")
RECOMMENDED_POLL_NS = 200_000  # the kernel's own default: 50 us still left a lookup at 193 us


@dataclass(frozen=True)
class IdleSettings:
    """``driver`` / ``governor``: cpuidle's current ones ("" where sysfs has none);
    ``guest_halt_poll_ns``: the haltpoll window, None when the module is not loaded."""

    driver: str
    governor: str
    guest_halt_poll_ns: int | None

    @property
    def halts_at_once(self) -> bool:
        """A virtual machine's guest that halts an idle vCPU without polling first."""
        return self.driver == "haltpoll" and self.guest_halt_poll_ns == 0

    def summary(self) -> str:
        """One line for benchmark JSON: the driver, and the poll window where it has one."""
        if not self.driver:
            return "no cpuidle driver"
        poll = (
            ""
            if self.guest_halt_poll_ns is None
            else f", guest_halt_poll_ns={self.guest_halt_poll_ns}"
        )
        return f"{self.driver} (governor {self.governor or 'unknown'}){poll}"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def read_idle(cpuidle: Path = CPUIDLE, haltpoll: Path = HALTPOLL) -> IdleSettings:
    poll = _read(haltpoll / "guest_halt_poll_ns")
    return IdleSettings(
        driver=_read(cpuidle / "current_driver"),
        governor=_read(cpuidle / "current_governor"),
        guest_halt_poll_ns=int(poll) if poll.isdigit() else None,
    )


def check_idle(settings: IdleSettings | None = None) -> CheckResult:
    found = settings or read_idle()
    values: tuple[tuple[str, int | str], ...] = (
        ("driver", found.driver),
        ("governor", found.governor),
        (
            "guest_halt_poll_ns",
            -1 if found.guest_halt_poll_ns is None else found.guest_halt_poll_ns,
        ),
    )
    if found.halts_at_once:
        return CheckResult(
            "cpu.idle",
            Severity.WARN,
            "this virtual machine halts an idle vCPU without polling (cpuidle haltpoll, "
            "guest_halt_poll_ns=0): every request to the daemon and every reply wakes a vCPU "
            "through the hypervisor (a ping costs about twice, a 512-chunk lookup about 1.5x, "
            "what it does with polling)",
            f"echo {RECOMMENDED_POLL_NS} > {HALTPOLL}/guest_halt_poll_ns (as root; to keep it, "
            f"boot with haltpoll.guest_halt_poll_ns={RECOMMENDED_POLL_NS})",
            values,
        )
    if found.driver == "haltpoll" and found.guest_halt_poll_ns is not None:
        return CheckResult(
            "cpu.idle",
            Severity.OK,
            f"idle vCPUs poll up to {found.guest_halt_poll_ns} ns before halting",
            values=values,
        )
    return CheckResult(
        "cpu.idle",
        Severity.INFO,
        f"cpuidle: {found.summary()}; wake-up latency is the CPU's C-states' (bare metal) "
        "or the hypervisor's",
        values=values,
    )
