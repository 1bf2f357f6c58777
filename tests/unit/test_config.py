"""load_config: file < environment < overrides, variable naming, validation, example configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.config import DEFAULT_HTTP_PORT, load_config
from kvfabric.config_layers import RENAMED_KEYS
from kvfabric.errors import ConfigError
from kvfabric.store.config import GiB, MiB
from kvfabric.tiers.base import TierKind

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvfabric.yaml"
    path.write_text(text)
    return path


def test_defaults_are_dram_and_ssd_under_the_local_data_dir() -> None:
    config = load_config(env={})
    assert [(t.kind, t.capacity) for t in config.store.tiers] == [
        (TierKind.DRAM, 1 * GiB),
        (TierKind.SSD, 8 * GiB),
    ]
    assert config.store.data_dir == "./kvfabric-data"
    assert Path(config.socket_path) == Path("kvfabric-data/kvfabric.sock")
    assert (config.http.host, config.http.port) == ("127.0.0.1", DEFAULT_HTTP_PORT)
    assert config.tcp.port is None and not config.auth.enabled


def test_precedence_overrides_beat_env_beat_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "node_id: from-file\nlog_level: debug\nhttp: {port: 1111}\ntcp: {port: 4444}\n"
    )
    env = {"KVFABRIC_NODE_ID": "from-env", "KVFABRIC_HTTP__PORT": "2222"}
    config = load_config(path, env=env, overrides=["http.port=3333"])
    assert config.http.port == 3333  # all three set it: the override wins
    assert config.node_id == "from-env"  # file and env: env wins
    assert config.log_level == "debug" and config.tcp.port == 4444  # file only


def test_socket_path_follows_the_data_dir_unless_set(tmp_path: Path) -> None:
    assert load_config(env={}, overrides=[f"store.data_dir={tmp_path}"]).socket_path == str(
        tmp_path / "kvfabric.sock"
    )
    assert (
        load_config(
            env={}, overrides=[f"store.data_dir={tmp_path}", "socket_path=/run/x.sock"]
        ).socket_path
        == "/run/x.sock"
    )


def test_env_names_tiers_by_name_with_double_underscores(tmp_path: Path) -> None:
    env = {
        "KVFABRIC_STORE__TIERS__DRAM__CAPACITY": "4GiB",
        "KVFABRIC_STORE__TIERS__SSD__WRITERS": "3",
        "KVFABRIC_STORE__DATA_DIR": str(tmp_path),
        "KVFABRIC_LIMITS__REQUEST_THREADS": "8",
        "UNRELATED": "ignored",
    }
    config = load_config(env=env)
    assert config.store.tiers[0].capacity == 4 * GiB
    assert config.store.tiers[1].writers == 3 and config.store.tiers[1].capacity == 8 * GiB
    assert config.store.data_dir == str(tmp_path)
    assert config.limits.request_threads == 8


def test_env_adds_a_tier_to_a_file_list_and_changes_one_by_name(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "store:\n  tiers:\n    - {kind: dram, capacity: 1GiB}\n    - {kind: ssd, capacity: 2GiB}\n",
    )
    config = load_config(
        path,
        env={"KVFABRIC_STORE__TIERS__SSD__CAPACITY": "5GiB"},
        overrides=["store.tiers.dram.page_size=1MiB"],
    )
    assert [(t.name, t.capacity) for t in config.store.tiers] == [("dram", GiB), ("ssd", 5 * GiB)]
    assert config.store.tiers[0].page_size == MiB


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["bogus=1"], "bogus: unknown key"),
        (["http.bogus=1"], "http.bogus: unknown key"),
        (["store.bogus=1"], "store.bogus: unknown key"),
        (["store.tiers.dram.path=x"], "store.tiers[0].path: unknown key"),
        (["store.tiers.dram=1"], "store.tiers.<name>.<key>"),
        (["http.port=65536"], "port: must be an integer"),
        (["http.port=-1"], "port: must be an integer"),
        (["tcp.port=eighty"], "port: must be an integer"),
        (["http.port=true"], "port: must be an integer"),
        (["store.tiers.dram.capacity=lots"], "cannot parse size"),
        (["store.tiers.dram.capacity=0"], "must be positive"),
        (["store.tiers.ssd.segment_bytes=1XB"], "cannot parse size"),
        (["log_level=chatty"], "log_level"),
        (["limits.max_sessions=0"], "limits.max_sessions"),
        (["node_id=5"], "node_id: must be a string"),
        (["novalue"], "key=value"),
        (["cluster.index=zookeeper"], "cluster.index: must be one of"),
        (["cluster.index=redis"], "cluster.redis_url: must be a redis:// URL"),
        (["cluster.index=redis", "cluster.redis_url=http://h:6379"], "redis:// URL"),
        (["cluster.index=redis", "cluster.redis_url=redis://h:port/0"], "invalid port"),
        (["cluster.lease_ttl_s=0"], "cluster.lease_ttl_s: must be a positive number"),
        (["cluster.heartbeat_s=true"], "cluster.heartbeat_s: must be a positive number"),
        (["cluster.heartbeat_s=10", "cluster.lease_ttl_s=5"], "heartbeat_s: must be shorter"),
        (["cluster.hardware_class=5"], "cluster.hardware_class: must be a string"),
        (["cluster.bogus=1"], "cluster.bogus: unknown key"),
    ],
)
def test_bad_settings_raise_config_error_naming_the_key(overrides: list[str], message: str) -> None:
    pattern = message.replace(".", r"\.").replace("[", r"\[").replace("<", ".")
    with pytest.raises(ConfigError, match=pattern):
        load_config(env={}, overrides=overrides)


def test_bad_env_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="port"):
        load_config(env={"KVFABRIC_HTTP__PORT": "99999"})


@pytest.mark.parametrize(
    "text, message",
    [
        ("- a list\n", "mapping at the top level"),
        ("http: [1, 2]\n", "http: must be a mapping"),
        ("store: {tiers: {dram: 1GiB}}\n", "store.tiers.dram: must be a mapping"),
        ("store: {tiers: [1GiB]}\n", "store.tiers[0]: must be a mapping"),
        ("key: [unclosed\n", "cannot read config"),
    ],
)
def test_bad_files_raise_config_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        load_config(_write(tmp_path, text), env={})


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml", env={})


def test_values_are_yaml_scalars() -> None:
    config = load_config(
        env={
            "KVFABRIC_HTTP__PORT": "null",
            "KVFABRIC_STORE__PROMOTE_ON_HIT": "false",
            "KVFABRIC_STORE__HIGH_WATERMARK": "0.9",
        },
        overrides=["tcp.port=0", "store.tiers.dram.prefault=yes", "node_id=node a=b"],
    )
    assert config.http.port is None  # null disables HTTP
    assert config.tcp.port == 0  # an int: pick a free port
    assert config.store.promote_on_hit is False and config.store.high_watermark == 0.9
    assert config.store.tiers[0].prefault is True
    assert config.node_id == "node a=b"  # split at the first '=' only


def test_quoted_values_stay_strings() -> None:
    assert load_config(env={}, overrides=['node_id="007"']).node_id == "007"


def test_token_file_is_read_lazily_and_errors_clearly(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert load_config(env={}, overrides=[f"auth.token_file={token}"]).auth.admin_token == "s3cret"
    missing = load_config(env={}, overrides=[f"auth.token_file={tmp_path / 'absent'}"])
    with pytest.raises(ConfigError, match="auth.token_file"):
        _ = missing.auth.admin_token


def test_device_tier_is_refused_by_the_daemon_config(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "store:\n  tiers:\n    - {kind: device, capacity: 1GiB}\n"
        "    - {kind: ssd, capacity: 2GiB}\n",
    )
    with pytest.raises(ConfigError, match="device tier"):
        load_config(path, env={})


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_loads(path: Path) -> None:
    config = load_config(path, env={})
    assert config.store.tiers[0].kind in (TierKind.DRAM, TierKind.CXL)
    assert config.store.tiers[-1].kind is TierKind.SSD


def test_example_configs_exist() -> None:
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {
        "single-node.yaml",
        "decode-cpu.yaml",
        "cluster-redis.yaml",
        "cxl-tier.yaml",
        "store-tiers.yaml",
    } <= names


def test_cxl_example_binds_the_cxl_tier_to_a_numa_node() -> None:
    tiers = load_config(CONFIGS / "cxl-tier.yaml", env={}).store.tiers
    assert [t.kind for t in tiers] == [TierKind.DRAM, TierKind.CXL, TierKind.SSD]
    assert tiers[1].numa_node is not None


def test_decode_cpu_example_has_no_device_tier_and_a_large_dram_tier() -> None:
    config = load_config(CONFIGS / "decode-cpu.yaml", env={})
    assert all(t.kind is not TierKind.DEVICE for t in config.store.tiers)
    assert config.store.tiers[0].capacity > load_config(env={}).store.tiers[0].capacity


def test_client_side_variables_are_not_daemon_settings() -> None:
    config = load_config(
        env={
            "KVFABRIC_TOKEN": "t",
            "KVFABRIC_PYTHON": "/usr/bin/python3",
            "KVFABRIC_HTTP__PORT": "9001",
        }
    )
    assert config.http.port == 9001 and config.auth.token is None


def test_cluster_defaults_to_the_embedded_index() -> None:
    cluster = load_config(env={}).cluster
    assert (
        cluster.index,
        cluster.redis_url,
        cluster.lease_ttl_s,
        cluster.heartbeat_s,
        cluster.hardware_class,
        cluster.advertise,
    ) == ("embedded", None, 10, 2, "generic", "")


def test_cluster_settings_by_dotted_path_env_and_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "cluster: {index: redis, redis_url: 'redis://r:6379/0'}\n")
    config = load_config(
        path,
        env={"KVFABRIC_CLUSTER__LEASE_TTL_S": "4", "KVFABRIC_CLUSTER__HARDWARE_CLASS": "h100"},
        overrides=["cluster.heartbeat_s=0.5", "cluster.advertise=10.0.0.7:8791"],
    )
    cluster = config.cluster
    assert (cluster.index, cluster.redis_url) == ("redis", "redis://r:6379/0")
    assert (cluster.lease_ttl_s, cluster.heartbeat_s) == (4, 0.5)
    assert (cluster.hardware_class, cluster.advertise) == ("h100", "10.0.0.7:8791")


def test_a_redis_password_never_reaches_errors_or_the_redacted_url() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            env={},
            overrides=["cluster.index=redis", "cluster.redis_url=rediss://:hunter2@h:6379/0"],
        )
    assert "hunter2" not in str(info.value)
    config = load_config(
        env={}, overrides=["cluster.index=redis", "cluster.redis_url=redis://u:hunter2@h:6379/0"]
    )
    assert config.cluster.redis_url_redacted == "redis://h:6379/0"


def test_cluster_example_uses_the_redis_index() -> None:
    cluster = load_config(CONFIGS / "cluster-redis.yaml", env={}).cluster
    assert cluster.index == "redis" and cluster.redis_url.startswith("redis://")
    assert cluster.heartbeat_s < cluster.lease_ttl_s


def test_prefill_and_decode_examples_share_one_cluster_with_distinct_roles() -> None:
    prefill = load_config(CONFIGS / "prefill-node.yaml", env={})
    decode = load_config(CONFIGS / "decode-node.yaml", env={})
    assert prefill.cluster.redis_url == decode.cluster.redis_url
    assert prefill.cluster.secret_file == decode.cluster.secret_file is not None
    assert prefill.node_id != decode.node_id
    assert prefill.cluster.hardware_class != decode.cluster.hardware_class
    assert prefill.tcp.port and decode.tcp.port  # peers reach both


def test_control_plane_limits_have_bounded_defaults_and_take_settings() -> None:
    """Regression: on the old code the control socket had none of these settings (no hello
    deadline, no idle timeout, no pre-hello frame limit, no per-peer caps, backlog 100)."""
    limits = load_config(env={}).limits
    assert limits.control_hello_timeout_s == 5.0
    assert limits.control_idle_timeout_s == 300.0
    assert limits.control_hello_max_bytes == 64 << 10
    assert limits.control_max_pending == 256 and limits.control_max_pending_per_peer == 64
    assert limits.control_max_sessions_per_peer == 512
    assert limits.control_listen_backlog == 1024
    limits = load_config(
        env={"KVFABRIC_LIMITS__CONTROL_IDLE_TIMEOUT_S": "0"},
        overrides=["limits.control_hello_timeout_s=0.5", "limits.control_hello_max_bytes=4096"],
    ).limits
    assert (
        limits.control_idle_timeout_s,
        limits.control_hello_timeout_s,
        limits.control_hello_max_bytes,
    ) == (0, 0.5, 4096)


@pytest.mark.parametrize(
    "setting, message",
    [
        ("limits.control_hello_timeout_s=0", "control_hello_timeout_s: must be a positive"),
        ("limits.control_hello_timeout_s=soon", "control_hello_timeout_s: must be a positive"),
        ("limits.control_idle_timeout_s=-1", "control_idle_timeout_s: must be a non-negative"),
        ("limits.control_hello_max_bytes=100", "control_hello_max_bytes: must be an integer in"),
        ("limits.control_hello_max_bytes=16MiB", "control_hello_max_bytes: must be an integer in"),
        (
            "limits.control_hello_max_bytes=9000000",
            "control_hello_max_bytes: must be an integer in",
        ),
        ("limits.control_max_pending=0", "control_max_pending: must be a positive"),
        ("limits.control_max_pending_per_peer=true", "control_max_pending_per_peer: must be a"),
        ("limits.control_max_sessions_per_peer=-3", "control_max_sessions_per_peer: must be a"),
        ("limits.control_listen_backlog=1.5", "control_listen_backlog: must be a positive"),
    ],
)
def test_bad_control_plane_limits_are_refused(setting: str, message: str) -> None:
    """Regression: on the old code these keys did not exist (refused as unknown, with
    another message)."""
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides=[setting])


def test_store_quotas_can_be_set_per_tenant_from_flags(tmp_path: Path) -> None:
    config = load_config(
        env={},
        overrides=[
            f"store.data_dir={tmp_path}",
            "store.quotas.team-a.dram=1GiB",
            "store.quotas.*.reservations=8",
        ],
    )
    quota = config.store.quota_for("team-a")
    assert quota is not None and quota.tiers == {"dram": 1 << 30} and quota.reservations == 8


def test_a_leading_tilde_in_path_settings_is_the_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """configs/dev.yaml keeps everything under ~/.local/share/kvfabric: `~` must not become a
    directory named '~' in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = _write(
        tmp_path,
        "socket_path: ~/k.sock\nauth: {token_file: ~/t}\n"
        "store: {data_dir: ~/data}\ncluster: {secret_file: ~/s}\n",
    )
    config = load_config(path, env={}, overrides=["security.tls_cert_file=~/c.pem"])
    assert config.socket_path == str(tmp_path / "k.sock")
    assert config.store.data_dir == str(tmp_path / "data")
    assert config.auth.token_file == str(tmp_path / "t")
    assert config.cluster.secret_file == str(tmp_path / "s")
    assert config.security.tls_cert_file == str(tmp_path / "c.pem")
    assert load_config(env={}, overrides=["store.data_dir=a~b"]).store.data_dir == "a~b"


def test_a_renamed_key_warns_and_is_honoured_from_file_env_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename table is empty today (no key was renamed yet): a test-only entry."""
    monkeypatch.setitem(RENAMED_KEYS, "limits.threads", "limits.request_threads")
    path = _write(tmp_path, "limits: {threads: 3}\n")
    with pytest.warns(DeprecationWarning, match="'limits.threads' is deprecated"):
        assert load_config(path, env={}).limits.request_threads == 3
    with pytest.warns(DeprecationWarning):
        config = load_config(env={"KVFABRIC_LIMITS__THREADS": "5"})
    assert config.limits.request_threads == 5
    with pytest.warns(DeprecationWarning):
        assert load_config(env={}, overrides=["limits.threads=7"]).limits.request_threads == 7
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="keep only"):
        load_config(path, env={}, overrides=["limits.request_threads=2"])


def test_every_problem_is_one_config_error_keyed_by_its_dotted_path(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "http: {port: 99999}\nstore:\n  tiers:\n    - {kind: dram, capacity: 1GiB}\n"
        "    - {kind: ssd, capacity: lots, bogus: 1}\n",
    )
    with pytest.raises(ConfigError) as failed:
        load_config(path, env={})
    assert str(failed.value) == (
        "http.port: must be an integer in [0, 65535] or null, got 99999; "
        "store.tiers[1].bogus: unknown key (allowed: capacity, format, fsync, kind, name, "
        "path, segment_bytes, writers)"
    )
