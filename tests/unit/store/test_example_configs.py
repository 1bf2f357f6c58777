"""The example configs in configs/ stay valid as the code changes, and start where they say.

Every config goes through ``kvfabric serve --check`` on this machine (the checks serve runs
before building anything: token and secret files, capacities against RAM and free disk,
directories, ports). Its files and ports are moved to temporary ones, since /etc, /run and
/var/lib are not the test's to write and port 8790 may be a developer's own daemon; the
capacities are the config's own. A config whose first line says ``# Big node:`` is sized for
a bigger machine: where it does not fit, ``--check`` must refuse it with the capacity message.
Every other config fits a small machine (:data:`SMALL_RAM`, :data:`SMALL_DISK`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvfabric.preflight import memory_info
from kvfabric.store import StoreConfig
from kvfabric.store.config import GiB, parse_size
from kvfabric.tiers.base import TierKind

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
EXAMPLES = sorted(CONFIGS.glob("*.yaml"))
SMALL_RAM = 8 * GiB  # memory tiers of a config that does not say it is for a big node
SMALL_DISK = 64 * GiB


def _clean_env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")} | extra


def _check(
    config: Path, *settings: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "kvfabric.cli", "serve", "--config", str(config), "--check"]
    for item in settings:
        args += ["--set", item]
    return subprocess.run(
        args, capture_output=True, text=True, timeout=120, check=False, env=env or _clean_env()
    )


def _relocated(raw: dict, tmp: Path) -> list[str]:
    """--set items moving the config's files, sockets and ports to ``tmp`` / free ports."""
    token, secret = tmp / "admin-token", tmp / "cluster-secret"
    token.write_text("t" * 43 + "\n")
    secret.write_text("s" * 43 + "\n")
    settings = [
        f"store.data_dir={tmp / 'data'}",
        f"socket_path={tmp / 'kvfabric.sock'}",
        "http.port=0",
    ]
    if (raw.get("tcp") or {}).get("port") is not None:
        settings.append("tcp.port=0")
    if (raw.get("auth") or {}).get("token_file"):
        settings.append(f"auth.token_file={token}")
    if (raw.get("cluster") or {}).get("secret_file"):
        settings.append(f"cluster.secret_file={secret}")
    return settings


def _needs(raw: dict) -> tuple[int, int, int]:
    """(memory tiers, prefaulted memory tiers, ssd) bytes the config asks for."""
    tiers = (raw.get("store") or {}).get("tiers") or []
    memory = [t for t in tiers if t["kind"] in ("dram", "cxl")]
    return (
        sum(parse_size(t["capacity"]) for t in memory),
        sum(parse_size(t["capacity"]) for t in memory if t.get("prefault")),
        sum(parse_size(t["capacity"]) for t in tiers if t["kind"] == "ssd"),
    )


def test_there_are_examples_and_a_dev_config() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"dev.yaml", "single-node.yaml", "cluster-redis.yaml"} <= names


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_serve_check_or_is_a_big_node(config: Path, tmp_path: Path) -> None:
    """Regression: on the old code there was no --check, and a 2 TiB SSD tier or 128 GiB of
    prefaulted DRAM on a 64 GiB machine was accepted until the store failed or the OOM killer
    came."""
    text = config.read_text()
    raw = yaml.safe_load(text) or {}
    memory, prefaulted, ssd = _needs(raw)
    big = text.startswith("# Big node:")
    if not big:
        assert memory <= SMALL_RAM and ssd <= SMALL_DISK, (
            f"{config.name} asks for more than a small machine has: mark it '# Big node:'"
        )
    assert '"$(hostname)"' not in text  # two daemons on one host would share the id
    machine = memory_info()
    free = shutil.disk_usage(tmp_path).free
    fits = memory <= machine.total and prefaulted <= machine.available and ssd <= free
    done = _check(config, *_relocated(raw, tmp_path))
    if fits:
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("kvfabric serve --check: the daemon would start with")
    else:
        assert big, f"{config.name} does not fit this machine: {done.stderr}"
        assert done.returncode == 2
        assert "store.allow_overcommit: true" in done.stderr
        assert "more than the" in done.stderr or "free" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_dev_config_checks_verbatim_once_the_token_is_made(tmp_path: Path) -> None:
    """configs/dev.yaml as its comment says, in a fresh home: refused (no token file, said
    how to make one), then `kvfabric token new` and it passes, with auth on."""
    home = tmp_path / "home"
    home.mkdir()
    env = _clean_env(HOME=str(home))
    before = _check(CONFIGS / "dev.yaml", "http.port=0", env=env)
    assert before.returncode == 2
    assert "auth.token_file" in before.stderr and "kvfabric token new" in before.stderr
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfabric.cli",
            "token",
            "new",
            str(home / ".local/share/kvfabric/admin-token"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    after = _check(CONFIGS / "dev.yaml", "http.port=0", env=env)
    assert after.returncode == 0, after.stderr
    assert "auth         on" in after.stdout
    assert str(home / ".local/share/kvfabric/kvfabric.sock") in after.stdout
    assert "/etc/" not in after.stdout and "/run/" not in after.stdout


def test_store_tiers_example_parses() -> None:
    raw = yaml.safe_load((CONFIGS / "store-tiers.yaml").read_text())
    config = StoreConfig.from_dict(raw["store"])
    assert [t.kind for t in config.tiers] == [TierKind.DRAM, TierKind.CXL, TierKind.SSD]
    assert config.tiers[2].capacity == 32 * GiB
    assert config.allow_overcommit is False
