"""Severities, their order and the exit code they map to: 0 ok / info, 1 warn, 2 error."""

from __future__ import annotations

import dataclasses

import pytest

from kvfabric.doctor.result import EXIT_CODES, CheckResult, Severity, exit_code, worst


def _result(severity: Severity) -> CheckResult:
    return CheckResult(f"x.{severity.value}", severity, "found")


@pytest.mark.parametrize(
    ("severity", "code"),
    [(Severity.OK, 0), (Severity.INFO, 0), (Severity.WARN, 1), (Severity.ERROR, 2)],
)
def test_each_severity_maps_to_its_documented_exit_code(severity: Severity, code: int) -> None:
    assert severity.exit_code == code == EXIT_CODES[severity]
    assert exit_code([_result(severity)]) == code


def test_the_worst_finding_decides_whatever_the_order() -> None:
    mixed = [_result(s) for s in (Severity.INFO, Severity.ERROR, Severity.OK, Severity.WARN)]
    assert worst(mixed) is Severity.ERROR
    assert exit_code(mixed) == 2
    assert worst(mixed[:1] + mixed[2:]) is Severity.WARN
    assert exit_code([_result(Severity.OK), _result(Severity.INFO)]) == 0


def test_no_finding_is_ok() -> None:
    assert worst([]) is Severity.OK
    assert exit_code([]) == 0


def test_a_result_is_frozen_and_serialises_its_values() -> None:
    result = CheckResult("disk.speed", Severity.WARN, "slow", "faster disk", (("read_mb_s", 9.5),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.severity = Severity.OK  # type: ignore[misc]
    assert result.as_dict() == {
        "name": "disk.speed",
        "severity": "warn",
        "message": "slow",
        "fix": "faster disk",
        "values": {"read_mb_s": 9.5},
    }
