"""docs/protocol.md is what :mod:`kvfabric.protocol.doc` generates from the op table, the
limits and the error kinds: a change to any of them without regenerating the page fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvfabric.protocol import doc
from kvfabric.protocol.messages import MAX_KEYS, Op
from kvfabric.protocol.ops import OPS

PAGE = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"


def test_the_committed_page_is_what_the_generator_prints() -> None:
    assert PAGE.read_text() == doc.render(), (
        f"docs/protocol.md is stale: regenerate it with `{doc.REGENERATE}`"
    )


def test_the_module_prints_the_page() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.protocol.doc"], capture_output=True, text=True, check=True
    ).stdout
    assert out == doc.render()


def test_every_op_and_field_has_its_place() -> None:
    page = doc.render()
    for spec in OPS:
        section = page.split(f"\n### {spec.op.value}\n", 1)[1].split("\n### ", 1)[0]
        for field in spec.fields:
            assert f"| `{field.name}` |" in section, (spec.op.value, field.name)
    assert f"| {MAX_KEYS} |" in page
    assert page.count("\n### ") == len(Op)


def test_a_changed_table_changes_the_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the staleness check above would see an edit to the table."""
    before = doc.render()
    monkeypatch.setattr(doc, "OPS", OPS[:-1])
    assert doc.render() != before
