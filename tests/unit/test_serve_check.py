"""``kvfabric serve --check`` / the preflight serve runs, ``--print-config`` exit codes, and
``kvfabric token new``: on real files, directories, ports and this machine's memory."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvfabric.cli import main
from kvfabric.config import load_config
from kvfabric.errors import ConfigError
from kvfabric.preflight import memory_info, preflight


@pytest.fixture(autouse=True)
def _no_kvfabric_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVFABRIC_")]:
        monkeypatch.delenv(name)


def _config(tmp_path: Path, *settings: str):
    return load_config(
        env={}, overrides=[f"store.data_dir={tmp_path / 'data'}", "http.port=0", *settings]
    )


def _token(path: Path) -> Path:
    assert main(["token", "new", str(path)]) == 0
    return path


# ---------------------------------------------------------------- token new


def test_token_new_writes_a_0600_file_and_says_how_to_use_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "new" / "dir" / "admin-token"
    assert main(["token", "new", str(path)]) == 0
    out = capsys.readouterr().out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text().strip()
    assert len(token) >= 40 and "\n" not in token
    assert f"auth.token_file: {path}" in out and "export KVFABRIC_TOKEN=" in out
    assert "cluster.secret_file" in out
    _token(tmp_path / "other")
    assert (tmp_path / "other").read_text() != path.read_text()  # random, not derived


def test_token_new_keeps_an_existing_file_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _token(tmp_path / "admin-token")
    first = path.read_text()
    assert main(["token", "new", str(path)]) == 2
    assert "exists" in capsys.readouterr().err and path.read_text() == first
    path.chmod(0o644)
    assert main(["token", "new", str(path), "--force"]) == 0
    assert path.read_text() != first and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin-token"]  # no temp left


def test_a_new_token_file_serves_as_token_and_as_cluster_secret(tmp_path: Path) -> None:
    token, secret = _token(tmp_path / "t"), _token(tmp_path / "s")
    config = _config(tmp_path, f"auth.token_file={token}", f"cluster.secret_file={secret}")
    assert config.auth.admin_token == token.read_text().strip()
    assert config.cluster.secret() == secret.read_bytes().strip()
    assert preflight(config).lines


# ---------------------------------------------------------------- credentials


def test_missing_token_and_secret_files_are_all_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as failed:
        preflight(
            _config(
                tmp_path,
                f"auth.token_file={tmp_path / 'no-token'}",
                f"cluster.secret_file={tmp_path / 'no-secret'}",
            )
        )
    message = str(failed.value)
    assert message.startswith("2 problems:")
    assert "auth.token_file" in message and "cluster.secret_file" in message
    assert message.count("kvfabric token new FILE") == 2


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    """Regression: on the old code an empty token file turned authentication off silently."""
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        preflight(_config(tmp_path, f"auth.token_file={empty}"))


def test_missing_secret_file_fails_before_the_store_is_built(tmp_path: Path, redis_server) -> None:
    """Regression: on the old code serve built the store (and its SSD directory) and only
    then read cluster.secret_file."""
    data = tmp_path / "data"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfabric.cli",
            "serve",
            "--set",
            f"store.data_dir={data}",
            "--set",
            "http.port=0",
            "--set",
            "tcp.port=0",
            "--set",
            "cluster.index=redis",
            "--set",
            f"cluster.redis_url={redis_server.url}",
            "--set",
            f"cluster.secret_file={tmp_path / 'absent'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")},
    )
    assert done.returncode == 2
    assert "cluster.secret_file" in done.stderr and "Traceback" not in done.stderr
    assert not data.exists()


# ---------------------------------------------------------------- capacities


def test_memory_tiers_beyond_physical_ram_are_refused_unless_overcommit(tmp_path: Path) -> None:
    """Regression: on the old code a memory tier larger than the machine was accepted."""
    settings = (
        f"store.tiers.dram.capacity={memory_info().total * 2}",
        "store.tiers.ssd.capacity=64MiB",
    )
    with pytest.raises(
        ConfigError,
        match=r"the memory tiers \(dram .*\) need .* more than the "
        r".* of (physical RAM|the cgroup's memory.max)",
    ):
        preflight(_config(tmp_path, *settings))
    checked = preflight(_config(tmp_path, *settings, "store.allow_overcommit=true"))
    assert any("store.allow_overcommit is set" in w for w in checked.warnings)


def test_prefault_beyond_available_memory_is_refused(tmp_path: Path) -> None:
    info = memory_info()
    if info.available >= info.total:
        pytest.skip("all memory is available here: prefault cannot exceed it within RAM")
    size = (info.available + info.total) // 2 // (1 << 20) << 20
    with pytest.raises(ConfigError, match="prefaulted memory tiers need"):
        preflight(
            _config(
                tmp_path,
                f"store.tiers.dram.capacity={size}",
                "store.tiers.dram.prefault=true",
                "store.tiers.ssd.capacity=64MiB",
            )
        )


def test_an_ssd_tier_beyond_the_free_disk_is_refused(tmp_path: Path) -> None:
    """Regression: on the old code a 2 TiB SSD tier was accepted with 64 GiB free."""
    with pytest.raises(ConfigError, match=r"ssd tier 'ssd' asks for 1024\.0 TiB, but .* free"):
        preflight(_config(tmp_path, "store.tiers.ssd.capacity=1024TiB"))
    checked = preflight(
        _config(tmp_path, "store.tiers.ssd.capacity=1024TiB", "store.allow_overcommit=true")
    )
    assert len(checked.warnings) == 1


def test_what_the_ssd_directory_holds_counts_as_room(tmp_path: Path) -> None:
    """A restart with a full SSD tier must not be refused for the space its own data takes."""
    ssd = tmp_path / "data" / "ssd"
    ssd.mkdir(parents=True)
    (ssd / "segment-0").write_bytes(b"\0" * (1 << 20))
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    capacity = free + (1 << 19)  # more than free, less than free + what it holds
    preflight(_config(tmp_path, f"store.tiers.ssd.capacity={capacity}"))


# ---------------------------------------------------------------- places


def test_a_busy_port_and_a_live_socket_are_reported(tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "live.sock"))
    live.listen()
    try:
        config = _config(
            tmp_path,
            f"http.port={listener.getsockname()[1]}",
            f"socket_path={tmp_path / 'live.sock'}",
        )
        with pytest.raises(ConfigError) as failed:
            preflight(config)
        assert "cannot be bound: in use" in str(failed.value)
        assert "another daemon is already serving" in str(failed.value)
        preflight(config, probe=False)  # --print-config: the config itself is fine
    finally:
        listener.close()
        live.close()


def test_an_unwritable_data_dir_is_reported(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="store.data_dir .* is not a directory"):
        preflight(
            load_config(env={}, overrides=[f"store.data_dir={blocker / 'data'}", "http.port=0"])
        )


# ---------------------------------------------------------------- the command


def test_check_prints_what_the_daemon_would_use_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = _token(tmp_path / "admin-token")
    capsys.readouterr()
    data = tmp_path / "data"
    assert (
        main(
            [
                "serve",
                "--check",
                "--data-dir",
                str(data),
                "--http-port",
                "0",
                "--auth-token-file",
                str(token),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("kvfabric serve --check: the daemon would start with")
    assert "auth         on" in out and "memory tiers dram 1.0 GiB" in out
    assert "ssd tier 8.0 GiB" in out
    assert not data.exists()  # checked, not created


def test_print_config_fails_for_a_config_serve_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: on the old code --print-config returned 0 for a missing token file that
    serve then refused."""
    assert (
        main(
            [
                "serve",
                "--print-config",
                "--data-dir",
                str(tmp_path / "data"),
                "--auth-token-file",
                str(tmp_path / "absent"),
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert "token_file:" in captured.out  # the YAML still comes out, for debugging
    assert "auth.token_file" in captured.err and "kvfabric token new" in captured.err
