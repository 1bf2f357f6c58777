"""The ``kvfabric`` command line without a daemon: parsing, config, errors, tokens, tables."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvfabric.cli import build_parser, main
from kvfabric.commands.config_yaml import REDACTED
from kvfabric.commands.serve import SHORTHANDS
from kvfabric.commands.stats_table import from_store_stats, render, tenant_hit_rates
from kvfabric.commands.tokens import parse_tokens, read_tokens_file
from kvfabric.config import load_config
from kvfabric.errors import ConfigError, SpecError
from kvfabric.store.config import GiB, Quota
from kvfabric.store.stats import NamespaceStats, StoreStats, TierStats

LOOKUP_NS = ["--model", "m", "--layers", "2", "--kv-heads", "2", "--head-dim", "16"]


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any KVFABRIC_* setting of the caller's shell, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    return env | extra


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env or _clean_env(),
    )


@pytest.fixture(autouse=True)
def _no_kvfabric_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVFABRIC_")]:
        monkeypatch.delenv(name)


# ---------------------------------------------------------------- parsing


def test_every_command_is_registered() -> None:
    parser = build_parser()
    for argv in (
        ["serve"],
        ["status"],
        ["lookup", *LOOKUP_NS, "--tokens", "1"],
        ["demo", "--data-dir", "x"],
    ):
        assert parser.parse_args(argv).command == argv[0]


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2


def test_shorthands_and_set_keep_command_line_order() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--set",
            "http.port=1",
            "--http-port",
            "0",
            "--data-dir",
            "/d",
            "--set",
            "log_level=debug",
        ]
    )
    assert args.overrides == [
        "http.port=1",
        "http.port=0",
        'store.data_dir="/d"',
        "log_level=debug",
    ]
    assert load_config(env={}, overrides=args.overrides).http.port == 0  # the last one wins


def test_serve_without_arguments_has_no_overrides() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.overrides == [] and args.config is None and args.ready_file is None


@pytest.mark.parametrize("flag, key, quoted", SHORTHANDS, ids=[s[0] for s in SHORTHANDS])
def test_each_shorthand_sets_its_key(flag: str, key: str, quoted: bool) -> None:
    value = {
        "--http-port": "0",
        "--tcp-port": "9001",
        "--log-level": "debug",
        "--log-format": "json",
    }.get(flag, "007")
    config = load_config(
        env={}, overrides=build_parser().parse_args(["serve", flag, value]).overrides
    )
    node: object = config
    for part in key.split("."):
        node = getattr(node, part)
    # String settings stay strings even when they look like numbers.
    assert node == (value if quoted else int(value))


def test_log_format_is_text_or_json() -> None:
    assert load_config(env={}).log_format == "text"
    assert load_config(env={"KVFABRIC_LOG_FORMAT": "json"}).log_format == "json"
    with pytest.raises(ConfigError, match="log_format: must be text or json"):
        load_config(env={}, overrides=["log_format=yaml"])
    # the command line's own flag takes the same two values
    assert build_parser().parse_args(["--log-format", "json", "serve"]).log_format == "json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-format", "yaml", "serve"])


def test_port_shorthand_accepts_null_to_disable_http() -> None:
    overrides = build_parser().parse_args(["serve", "--http-port", "null"]).overrides
    assert load_config(env={}, overrides=overrides).http.port is None


# ---------------------------------------------------------------- --print-config


def test_print_config_precedence_file_env_flags_end_to_end(tmp_path: Path) -> None:
    config_file = tmp_path / "kvfabric.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "node_id": "from-file",
                "log_level": "warning",
                "http": {"port": 1111},
                "tcp": {"port": 4444},
                "auth": {"token": "file-secret", "tenants": {"tenant-secret": "team-a"}},
                "store": {
                    "data_dir": str(tmp_path / "data"),
                    "tiers": [
                        {"kind": "dram", "capacity": "2GiB"},
                        {"kind": "ssd", "capacity": "3GiB"},
                    ],
                },
            }
        )
    )
    env = _clean_env(
        KVFABRIC_NODE_ID="from-env",
        KVFABRIC_HTTP__PORT="2222",
        KVFABRIC_STORE__TIERS__SSD__CAPACITY="5GiB",
        KVFABRIC_TOKEN="client-token",
        KVFABRIC_PYTHON="python3",
    )
    out = _cli(
        "serve",
        "--config",
        str(config_file),
        "--http-port",
        "3333",
        "--node-id",
        "flag",
        "--print-config",
        env=env,
    )
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["node_id"] == "flag"  # file < env < flag
    assert printed["http"]["port"] == 3333  # file < env < flag
    assert printed["tcp"]["port"] == 4444  # file only
    assert printed["log_level"] == "warning"
    assert [(t["name"], t["capacity"]) for t in printed["store"]["tiers"]] == [
        ("dram", "2GiB"),
        ("ssd", "5GiB"),
    ]  # env changed one tier by name
    assert "secret" not in out.stdout
    assert printed["auth"]["token"] == REDACTED
    assert list(printed["auth"]["tenants"].values()) == ["team-a"]
    # What it prints is a config the daemon reads back as the same settings.
    reread = tmp_path / "printed.yaml"
    reread.write_text(out.stdout)
    expected = load_config(
        config_file,
        env={
            k: v
            for k, v in env.items()
            if k.startswith("KVFABRIC_") and k not in ("KVFABRIC_TOKEN", "KVFABRIC_PYTHON")
        },
        overrides=["http.port=3333", "node_id=flag"],
    )
    assert dataclasses.replace(load_config(reread, env={}), auth=expected.auth) == expected


def test_print_config_of_the_defaults_round_trips(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["serve", "--print-config"]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    assert load_config(printed, env={}) == load_config(env={})
    assert load_config(printed, env={}).store.tiers[0].capacity == 1 * GiB


def test_print_config_with_quotas_round_trips(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Regression: on the old code --print-config crashed (a Quota is no YAML) whenever
    ``store.quotas`` was set, e.g. by configs/store-tiers.yaml."""
    argv = [
        "--set",
        "store.quotas.team-a.ssd=25%",
        "--set",
        "store.quotas.team-a.dram=3MiB",
        "--set",
        "store.quotas.*.reservations=8",
    ]
    assert main(["serve", *argv, "--print-config"]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    expected = load_config(env={}, overrides=[a for a in argv if a != "--set"])
    assert load_config(printed, env={}).store.quotas == expected.store.quotas
    assert expected.store.quota_for("team-a") == Quota(
        tiers={"ssd": 0.25, "dram": 3 << 20}, reservations=8
    )


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--http-port", "99999"], "port"),
        (["--set", "bogus=1"], "bogus: unknown key"),
        (["--set", "store.tiers.dram.capacity=lots"], "cannot parse size"),
        (["--log-level", "chatty"], "log_level"),
        (["--config", "/nonexistent/kvfabric.yaml"], "cannot read config"),
        (["--set", "novalue"], "key=value"),
    ],
)
def test_config_errors_exit_2_with_one_line(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv, "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfabric serve: ") and words in lines[0]


def test_config_error_in_a_subprocess_has_no_traceback(tmp_path: Path) -> None:
    out = _cli("serve", "--data-dir", str(tmp_path), "--tcp-port", "70000")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "port" in out.stderr


def test_unreadable_token_file_exits_2_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["serve", "--data-dir", str(tmp_path), "--auth-token-file", str(tmp_path / "absent")])
        == 2
    )
    assert "auth.token_file" in capsys.readouterr().err
    assert not (tmp_path / "kvfabric.sock").exists()


# ---------------------------------------------------------------- unreachable daemon


def test_status_on_a_dead_socket_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--socket", str(tmp_path / "none.sock")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvfabric status: cannot reach the kvfabric daemon at")
    assert "kvfabric serve" in err and len(err.splitlines()) == 1


def test_status_socket_default_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVFABRIC_SOCKET_PATH", str(tmp_path / "env.sock"))
    assert main(["status"]) == 1
    assert str(tmp_path / "env.sock") in capsys.readouterr().err


def test_status_on_a_dead_url_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["status", "--url", f"http://127.0.0.1:{port}"]) == 1
    assert "cannot reach the kvfabric daemon at http://127.0.0.1" in capsys.readouterr().err


def test_status_takes_socket_or_url_not_both() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["status", "--socket", "s", "--url", "http://h:1"])


def test_lookup_on_a_dead_socket_exits_1(tmp_path: Path) -> None:
    out = _cli("lookup", *LOOKUP_NS, "--tokens", "1 2 3", "--socket", str(tmp_path / "none"))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("kvfabric lookup: cannot reach the kvfabric daemon")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--tokens", "1 two 3"], "not a token id: 'two'"),
        (["--tokens", "[1, true]"], "integers only"),
        (["--tokens", "[1, 2"], "Expecting"),
        (["--tokens", "99999999999"], "int32"),
        (["--tokens-file", "/nonexistent/prompt.json"], "tokens file"),
    ],
)
def test_lookup_bad_tokens_exit_2(
    argv: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["lookup", *LOOKUP_NS, *argv, "--socket", str(tmp_path / "s")]) == 2
    assert words in capsys.readouterr().err


def test_lookup_bad_spec_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "lookup",
                "--model",
                "m",
                "--layers",
                "0",
                "--kv-heads",
                "2",
                "--head-dim",
                "16",
                "--tokens",
                "1",
                "--socket",
                str(tmp_path / "s"),
            ]
        )
        == 2
    )
    assert "num_layers must be positive" in capsys.readouterr().err


def test_lookup_needs_tokens() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["lookup", *LOOKUP_NS])


# ---------------------------------------------------------------- token files


@pytest.mark.parametrize(
    "name, content",
    [
        ("prompt.json", "[1, 2, 3, 40000]"),
        ("prompt.txt", "1 2\n3\t40000\n"),
        ("prompt.csv", "1,2, 3,\n40000"),
        ("prompt", "[1,2,3,40000]"),  # JSON recognised by content, not by name
    ],
)
def test_tokens_file_text_formats(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    tokens = read_tokens_file(path)
    assert tokens.dtype == np.int32 and tokens.tolist() == [1, 2, 3, 40000]


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16])
def test_tokens_file_npy(tmp_path: Path, dtype: type) -> None:
    path = tmp_path / "prompt.npy"
    np.save(path, np.arange(10, dtype=dtype))
    assert read_tokens_file(path).tolist() == list(range(10))


@pytest.mark.parametrize("array", [np.zeros(3, dtype=np.float32), np.zeros((2, 2), np.int32)])
def test_tokens_file_npy_must_be_1d_ints(tmp_path: Path, array: np.ndarray) -> None:
    path = tmp_path / "prompt.npy"
    np.save(path, array)
    with pytest.raises(SpecError, match="tokens file"):
        read_tokens_file(path)


def test_empty_tokens_parse_to_an_empty_prompt() -> None:
    assert parse_tokens("  \n").size == 0


# ---------------------------------------------------------------- status table


def _stats() -> StoreStats:
    tier = {"hit_chunks": 0, "bytes_in": 0, "bytes_out": 0}
    return StoreStats(
        tiers=(
            TierStats(
                "dram",
                "dram",
                1 << 30,
                1 << 28,
                7,
                hit_tokens=512,
                evictions=0,
                promotions=1,
                demotions=2,
                **tier,
            ),
            TierStats(
                "ssd",
                "ssd",
                8 << 30,
                0,
                0,
                hit_tokens=256,
                evictions=3,
                promotions=0,
                demotions=0,
                **tier,
            ),
        ),
        objects=7,
        lookups=4,
        lookup_tokens=1024,
        hit_tokens=768,
        miss_tokens=256,
        puts=7,
        gets=2,
        deletes=0,
        expired_leases=1,
        aborted_writes=0,
        namespaces=(
            NamespaceStats("m1", "team-a", 2, 512, 512),
            NamespaceStats("m2", "team-a", 1, 256, 0),
            NamespaceStats("m1", "", 1, 256, 256),
        ),
    )


def _socket_stats() -> dict[str, object]:
    # What the control socket sends: asdict, tuples as lists after msgpack.
    return json.loads(json.dumps(dataclasses.asdict(_stats())))


def test_socket_stats_take_the_http_shape() -> None:
    from kvfabric.api.stats_body import NamespaceStatsBody, TierStatsBody, TotalsBody

    doc = from_store_stats(_socket_stats(), node_id="n1")
    assert set(doc["tiers"][0]) == set(TierStatsBody.model_fields)
    assert set(doc["totals"]) == set(TotalsBody.model_fields)
    assert set(doc["namespaces"][0]) == set(NamespaceStatsBody.model_fields)
    assert doc["totals"]["hit_rate"] == 0.75 and doc["totals"]["evictions"] == 3
    assert doc["tiers"][0]["utilisation"] == 0.25


def test_tenant_hit_rates_sum_over_models() -> None:
    doc = from_store_stats(_socket_stats(), node_id="n1")
    assert tenant_hit_rates(doc["namespaces"]) == {"": (1, 1.0), "team-a": (3, 512 / 768)}


def test_status_table() -> None:
    text = render(from_store_stats(_socket_stats(), node_id="n1"))
    assert text.splitlines()[0] == "kvfabric node n1"
    header = next(line for line in text.splitlines() if line.startswith("tier"))
    for column in (
        "kind",
        "capacity",
        "used%",
        "objects",
        "hit tok",
        "evicted",
        "promoted",
        "demoted",
    ):
        assert column in header
    dram = next(line for line in text.splitlines() if line.startswith("dram"))
    assert dram.split() == [
        "dram",
        "dram",
        "1.0",
        "GiB",
        "256.0",
        "MiB",
        "25.0%",
        "7",
        "512",
        "0",
        "1",
        "2",
    ]
    assert "token hit rate 75.0% (768 of 1024 tokens looked up, 4 lookups)" in text
    assert "expired leases 1" in text and "puts 7" in text and "gets 2" in text
    assert any(line.split() == ["team-a", "3", "66.7%"] for line in text.splitlines())
    assert any(line.split() == ["(none)", "1", "100.0%"] for line in text.splitlines())
