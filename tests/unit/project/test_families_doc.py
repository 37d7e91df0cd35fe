"""docs/families.md's table is generated from llama_grpc_testkit.synth_gguf's FAMILIES (`python -m
llama_grpc_testkit.synth_gguf --families-table`): a family added or changed cannot leave the page
behind."""

from __future__ import annotations

from pathlib import Path

from llama_grpc_testkit import synth_gguf

ROOT = Path(__file__).resolve().parents[3]


def test_docs_families_md_holds_the_generated_table() -> None:
    """Paste `python -m llama_grpc_testkit.synth_gguf --families-table` into docs/families.md when
    this fails."""
    page = (ROOT / "docs" / "families.md").read_text(encoding="utf-8")
    assert synth_gguf.families_table() in page
    assert synth_gguf.doors_table() in page


def test_every_door_has_a_cell_and_limits_name_known_doors() -> None:
    """One column per door; a family's limits name doors that exist (Family.limit raises on
    another) and say ✔ or ✘ first."""
    header = synth_gguf.doors_table().splitlines()[0]
    assert all(title in header for title in synth_gguf.DOORS.values())
    for family in synth_gguf.FAMILIES.values():
        for door, text in family.limits:
            assert family.limit(door) == text
            assert text[0] in "✔✘", (family.name, door)


def test_every_family_row_names_its_end_of_turn_tokens() -> None:
    """Each row shows the end-of-turn texts, their pipes escaped (GitHub would split the cell)."""
    table = synth_gguf.families_table()
    for family in synth_gguf.FAMILIES.values():
        row = next(r for r in table.splitlines() if r.startswith(f"| `{family.name}` |"))
        for text in family.end_of_turn:
            assert f"`{text.replace('|', chr(92) + '|')}`" in row
