"""The planner's input file: the example loads, mistakes are named by their key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvfabric.errors import ConfigError
from kvfabric.planning.inputs import load_plan_inputs

EXAMPLE = Path(__file__).resolve().parents[3] / "configs" / "plan" / "example.yaml"


def test_the_example_loads_with_the_models_kv_size() -> None:
    inputs = load_plan_inputs(EXAMPLE)
    assert inputs.model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert set(inputs.profiles()) == {"tier1", "tier2", "cpu"}
    assert inputs.link_value().kv_bytes_per_token == 131072
    assert inputs.workloads["long-prompt"].ingress().prompt.expected() == 6000


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda d: d["roles"]["decode"].append("tpu"), "roles.decode"),
        (lambda d: d["classes"]["cpu"].update(decode_base_s=-1), "classes.cpu"),
        (lambda d: d["workloads"]["long-prompt"].update(rate_rps=0), "workloads.long-prompt"),
        (lambda d: d["workloads"]["long-output"]["prompt"].update(kind="zipf"), "kind"),
        (lambda d: d.update(bogus=1), "bogus"),
    ],
)
def test_a_mistake_is_reported_under_its_key(tmp_path: Path, change, key: str) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    change(data)
    bad = tmp_path / "plan.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_plan_inputs(bad)
