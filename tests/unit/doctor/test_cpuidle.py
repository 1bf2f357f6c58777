"""``cpu.idle``: what an idle CPU does, read from sysfs (fake directories laid out as the
kernel's, and this machine's own)."""

from __future__ import annotations

from pathlib import Path

from kvfabric.doctor import cpuidle
from kvfabric.doctor.result import Severity


def _sysfs(tmp_path: Path, driver: str | None, poll_ns: int | None) -> tuple[Path, Path]:
    idle, haltpoll = tmp_path / "cpuidle", tmp_path / "haltpoll"
    idle.mkdir()
    haltpoll.mkdir()
    if driver is not None:
        (idle / "current_driver").write_text(f"{driver}\n")
        (idle / "current_governor").write_text("menu\n" if driver != "haltpoll" else "haltpoll\n")
    if poll_ns is not None:
        (haltpoll / "guest_halt_poll_ns").write_text(f"{poll_ns}\n")
    return idle, haltpoll


def test_a_guest_that_halts_without_polling_is_a_warning_with_the_fix(tmp_path: Path) -> None:
    settings = cpuidle.read_idle(*_sysfs(tmp_path, "haltpoll", 0))
    assert settings.halts_at_once
    result = cpuidle.check_idle(settings)
    assert (result.name, result.severity) == ("cpu.idle", Severity.WARN)
    assert "guest_halt_poll_ns=0" in result.message
    assert f"echo {cpuidle.RECOMMENDED_POLL_NS} > " in result.fix
    assert dict(result.values)["guest_halt_poll_ns"] == 0


def test_a_guest_that_polls_is_fine(tmp_path: Path) -> None:
    result = cpuidle.check_idle(cpuidle.read_idle(*_sysfs(tmp_path, "haltpoll", 200_000)))
    assert result.severity is Severity.OK and "200000 ns" in result.message
    assert not result.fix


def test_bare_metal_drivers_and_missing_sysfs_are_information_only(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    metal = cpuidle.read_idle(*_sysfs(tmp_path / "a", "intel_idle", None))
    assert metal.guest_halt_poll_ns is None and not metal.halts_at_once
    assert cpuidle.check_idle(metal).severity is Severity.INFO
    assert metal.summary() == "intel_idle (governor menu)"
    nothing = cpuidle.read_idle(*_sysfs(tmp_path / "b", None, None))
    assert cpuidle.check_idle(nothing).severity is Severity.INFO
    assert nothing.summary() == "no cpuidle driver"


def test_this_machine_reads_without_raising() -> None:
    settings = cpuidle.read_idle()
    result = cpuidle.check_idle(settings)
    assert result.name == "cpu.idle"
    assert (result.severity is Severity.WARN) == settings.halts_at_once
    assert settings.summary()


def test_the_haltpoll_driver_without_its_module_parameters_is_not_called_fine(
    tmp_path: Path,
) -> None:
    """The poll window unknown (no ``haltpoll`` parameters in sysfs): information, not ok."""
    settings = cpuidle.read_idle(*_sysfs(tmp_path, "haltpoll", None))
    assert not settings.halts_at_once
    assert cpuidle.check_idle(settings).severity is Severity.INFO
