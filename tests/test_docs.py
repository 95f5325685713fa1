"""The README's alert table is generated from the engine's own vocabulary: it cannot drift."""

from __future__ import annotations

from conftest import ROOT

from gradwatch.diagnose import KINDS, kinds_table


def test_readme_lists_every_alert_kind_as_the_engine_defines_it() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert kinds_table() in readme, "regenerate the table: python -c 'from gradwatch.diagnose import kinds_table; print(kinds_table())'"
    for kind in KINDS:
        assert f"`{kind}`" in readme
