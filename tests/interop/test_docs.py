"""docs/interop.md lists every key the key maps read, generated from them: a change to a map fails here
until the page is regenerated (python -m memfit.interop.docs docs/interop.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.interop import TOOLS
from memfit.interop.docs import key_table, render_document

DOC = Path(__file__).resolve().parents[2] / "docs" / "interop.md"


def test_the_key_tables_are_the_key_maps():
    text = DOC.read_text()
    assert render_document(text, TOOLS) == text, (
        "docs/interop.md is out of date: python -m memfit.interop.docs docs/interop.md"
    )


@pytest.mark.parametrize("keymap", TOOLS, ids=lambda k: k.tool)
def test_every_tool_and_every_key_it_reads_is_on_the_page(keymap):
    text = DOC.read_text()
    assert f"<!-- keys: {keymap.tool} -->" in text
    for key in keymap.memory_keys:
        assert f"`{key}`" in key_table(keymap)


def test_a_stale_table_is_replaced():
    stale = "intro\n<!-- keys: axolotl -->\n| old | table |\n<!-- /keys -->\nend\n"
    fresh = render_document(stale, TOOLS)
    assert "| old | table |" not in fresh and "`micro_batch_size`" in fresh and fresh.endswith("<!-- /keys -->\nend\n")
