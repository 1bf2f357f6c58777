"""config_value models: dataclass semantics, unknown keys by dotted key, one error type, renames."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from pydantic import ValidationError

from kvfabric.config_model import apply_renames, config_value, key_path, parse_config
from kvfabric.config_types import ByteSize, PositiveInt
from kvfabric.errors import ConfigError


@config_value
class Inner:
    size: ByteSize
    count: PositiveInt = 1


@config_value
class Outer:
    inner: tuple[Inner, ...] = ()
    name: str = "x"


def test_a_model_is_a_frozen_dataclass_that_validates_however_it_is_built() -> None:
    inner = Inner("4KiB")  # type: ignore[arg-type]
    assert inner == Inner(4096) and dataclasses.asdict(inner) == {"size": 4096, "count": 1}
    assert dataclasses.replace(inner, count=3).count == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        inner.count = 2  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"^count: must be a positive integer, got 0$"):
        dataclasses.replace(inner, count=0)  # replace validates too
    with pytest.raises(ConfigError, match=r"^size: cannot parse size 'lots'"):
        Inner("lots")  # type: ignore[arg-type]  # a positional argument is named by its field


def test_problems_are_keyed_by_their_dotted_path_and_all_reported() -> None:
    with pytest.raises(ConfigError) as failed:
        parse_config(Outer, {"inner": [{"size": 1}, {"size": 0, "count": True}], "bogus": 1}, "top")
    assert not isinstance(failed.value, ValidationError)  # never pydantic's own error
    assert str(failed.value) == "top.bogus: unknown key (allowed: inner, name)"
    with pytest.raises(ConfigError) as failed:
        parse_config(Outer, {"inner": [{"size": 1}, {"size": 0, "count": True, "typo": 2}]})
    assert str(failed.value) == "inner[1].typo: unknown key (allowed: count, size)"
    with pytest.raises(ConfigError) as failed:
        parse_config(Outer, {"inner": [{"size": 1}, {"size": 0, "count": True}]})
    assert str(failed.value) == (
        "inner[1].size: must be positive, got 0; "
        "inner[1].count: must be a positive integer, got True"
    )
    with pytest.raises(ConfigError, match=r"^inner\[0\]: must be a mapping$"):
        parse_config(Outer, {"inner": ["4KiB"]})
    with pytest.raises(ConfigError, match=r"^inner\[0\]\.size: required$"):
        parse_config(Outer, {"inner": [{}]})


def test_key_path_spells_indexes_in_brackets() -> None:
    assert key_path(("store", "tiers", 1, "capacity")) == "store.tiers[1].capacity"
    assert key_path(()) == ""


def test_a_renamed_key_warns_and_is_honoured() -> None:
    data = {"limits": {"threads": 8, "other": 1}}
    with pytest.warns(DeprecationWarning, match="'limits.threads' is deprecated.*'limits.workers'"):
        moved = apply_renames(data, {"limits.threads": "limits.workers"})
    assert moved == {"limits": {"other": 1, "workers": 8}}
    assert data == {"limits": {"threads": 8, "other": 1}}  # the input is not changed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # absent: no warning
        assert apply_renames({"a": 1}, {"limits.threads": "limits.workers"}) == {"a": 1}


def test_a_renamed_key_set_under_both_names_is_an_error() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="keep only b.new"):
        apply_renames({"b": {"old": 1, "new": 2}}, {"b.old": "b.new"})
