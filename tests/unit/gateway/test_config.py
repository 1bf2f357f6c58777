"""The gateway's YAML: every problem named by its key; the README's example file loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.config_model import parse_config
from kvfabric.errors import ConfigError
from kvfabric.gateway.config import GatewayConfig, load_gateway_config

REPO = Path(__file__).resolve().parents[3]
MINIMAL = {
    "model": "tiny",
    "engines": [{"id": "a", "url": "http://127.0.0.1:8001", "hardware_class": "gpu"}],
    "classes": {"gpu": {"prefill_tps": 1000, "decode_tps": 20}},
}


def test_a_minimal_file_gets_the_documented_defaults() -> None:
    config = parse_config(GatewayConfig, MINIMAL)
    engine = config.engines[0]
    assert (engine.role, engine.max_running, engine.push, engine.node_id) == ("both", 8, False, "")
    assert (config.host, config.port, config.fabric) == ("127.0.0.1", 8090, None)
    assert config.tenants.max_queued_tokens == 65536 and config.deadlines.request_s == 300


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bogus": 1}, "bogus: unknown key"),
        ({"engines": []}, "engines: at least one engine"),
        (
            {"engines": [{"id": "a", "url": "u", "hardware_class": "tpu"}]},
            "engines[0].hardware_class: 'tpu' is not in classes (declared: gpu)",
        ),
        (
            {"engines": [{"id": "a", "url": "u", "hardware_class": "gpu", "role": "router"}]},
            "engines[0].role: must be one of ['prefill', 'decode', 'both']",
        ),
        (
            {"engines": [MINIMAL["engines"][0], MINIMAL["engines"][0]]},
            "engines[1].id: 'a' is declared twice",
        ),
        ({"classes": {"gpu": {"prefill_tps": 0, "decode_tps": 20}}}, "prefill_tps: must be > 0"),
        ({"tenants": {"weights": {"alice": -1}}}, "tenants.weights.alice: must be > 0"),
        ({"tenants": {"max_queued_tokens": 0}}, "tenants.max_queued_tokens"),
    ],
)
def test_a_wrong_file_is_refused_with_the_key_that_is_wrong(change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(GatewayConfig, {**MINIMAL, **change})
    assert message in str(refused.value)


def test_a_fabric_spec_the_fabric_cannot_hold_is_refused() -> None:
    fabric = {"url": "http://x", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    config = parse_config(GatewayConfig, {**MINIMAL, "fabric": {**fabric, "dtype": "int3"}})
    with pytest.raises(ConfigError, match="fabric: "):
        config.fabric.spec()  # type: ignore[union-attr]


def test_the_readme_example_config_loads(tmp_path: Path) -> None:
    config = load_gateway_config(REPO / "configs" / "gateway" / "heterogeneous.yaml")
    classes = {e.hardware_class for e in config.engines}
    assert {"prefill-gpu", "decode-gpu-older", "decode-cpu"} <= classes
    assert config.fabric is not None and config.fabric.spec().chunk_tokens > 0


def test_command_line_host_and_port_replace_the_files(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(
        "model: m\nengines: [{id: a, url: u, hardware_class: g}]\n"
        "classes: {g: {prefill_tps: 1, decode_tps: 1}}\nport: 1\n"
    )
    config = load_gateway_config(path, {"port": 9, "host": None})
    assert (config.port, config.host) == (9, "127.0.0.1")
    path.write_text("- not a mapping\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_gateway_config(path)
