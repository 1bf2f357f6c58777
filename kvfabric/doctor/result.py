"""What a doctor check returns, and how severities become an exit code.

Contract: every check returns :class:`CheckResult` values (frozen); a check never raises for
what it finds on the node (a failed syscall, an unreachable server, a missing package are
results). :class:`Severity` orders them ``ok < info < warn < error``; :func:`worst` is the
highest of a run (``ok`` for none) and :func:`exit_code` maps it: 0 for ok / info, 1 for
warn, 2 for error (2 is also what ``kvfabric serve`` exits with on a config it refuses).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

Value = int | float | str


class Severity(enum.Enum):
    """How bad a finding is: ``ok`` as it should be; ``info`` worth knowing, nothing to do;
    ``warn`` the daemon runs, slower or less safe than it could; ``error`` the daemon will not
    start, or will fail under load."""

    OK = "ok"
    INFO = "info"
    WARN = "warn"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self]


_RANKS = {Severity.OK: 0, Severity.INFO: 1, Severity.WARN: 2, Severity.ERROR: 3}
EXIT_CODES = {Severity.OK: 0, Severity.INFO: 0, Severity.WARN: 1, Severity.ERROR: 2}


@dataclass(frozen=True)
class CheckResult:
    """One finding. ``name``: dotted, the concern first (``memory.thp``, ``disk.speed``);
    ``message``: what was found, with the figures; ``fix``: what to run or change (empty
    when there is nothing to do); ``values``: the measured figures, for ``--json``."""

    name: str
    severity: Severity
    message: str
    fix: str = ""
    values: tuple[tuple[str, Value], ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "severity": self.severity.value,
            "message": self.message,
            "fix": self.fix,
            "values": dict(self.values),
        }


def worst(results: Iterable[CheckResult]) -> Severity:
    return max((r.severity for r in results), key=lambda s: s.rank, default=Severity.OK)


def exit_code(results: Iterable[CheckResult]) -> int:
    return worst(results).exit_code
