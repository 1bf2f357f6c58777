"""The connector's ``kv_dtype``: every spelling of a storage dtype kvfabric knows, fp8
included, becomes the namespace's one name (so a producer saying ``float8_e4m3`` and a
consumer saying ``fp8`` address the same chunks); anything else is refused."""

from __future__ import annotations

import pytest

from kvfabric_connectors.vllm.settings import ConnectorSettings


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("float8_e4m3", "float8_e4m3fn"),
        ("fp8", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("bf16", "bfloat16"),
        ("float32", "float32"),
        (None, None),
    ],
)
def test_kv_dtype_names_are_normalized(given: str | None, stored: str | None) -> None:
    settings = ConnectorSettings.from_extra_config(
        {"socket_path": "/tmp/x.sock", "kv_dtype": given}
    )
    assert settings.kv_dtype == stored


@pytest.mark.parametrize("bad", ["int8", "float8_e5m2", 8])
def test_unknown_kv_dtypes_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="KV dtype"):
        ConnectorSettings.from_extra_config({"socket_path": "/tmp/x.sock", "kv_dtype": bad})
