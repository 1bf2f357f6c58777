"""The README's first command: `kvfabric demo` runs on embedded defaults and succeeds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_stores_through_every_tier_and_survives_restart(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "demo", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "read back 24/24 chunks byte-exact" in text
    for tier in ("device", "dram", "cxl", "ssd"):
        assert f"{tier}=" in text  # the lookup found part of the prompt in every tier
    assert "demo OK" in text
    assert list((tmp_path / "ssd").glob("seg-*.kvf"))
