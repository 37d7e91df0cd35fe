"""docs/options.md is generated from the option table (tools/options_doc.py, `make docs`): the
committed page must be exactly what the table generates, so that a new or changed option
cannot leave the documentation behind."""

from __future__ import annotations

import runpy
from pathlib import Path

from llama_grpc_server.config.options import OPTIONS, RENAMED

ROOT = Path(__file__).resolve().parents[3]
OPTIONS_DOC = runpy.run_path(str(ROOT / "tools" / "options_doc.py"), run_name="options_doc")
render, main = OPTIONS_DOC["render"], OPTIONS_DOC["main"]


def test_docs_options_md_is_what_the_option_table_generates() -> None:
    """Run `make docs` and commit docs/options.md when this fails."""
    committed = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert committed == render()


def test_the_page_names_every_option_its_key_env_var_and_old_names() -> None:
    page = render()
    for opt in OPTIONS:
        assert f"`{opt.flag}" in page
        assert f"`{opt.name}`" in page
        assert f"`LLAMA_GRPC_{opt.name.upper()}`" in page
        if opt.kind is bool:
            assert f"`--no-{opt.flag[2:]}`" in page
    for old in RENAMED:
        assert f"`--{old.replace('_', '-')}`" in page


def test_check_mode_fails_on_a_stale_page(tmp_path: Path) -> None:
    """--check fails on a page that differs; writing it makes the check pass."""
    page = tmp_path / "options.md"
    page.write_text("old\n", encoding="utf-8")
    assert main(["--check", "--output", str(page)]) == 1
    assert main(["--output", str(page)]) == 0
    assert main(["--check", "--output", str(page)]) == 0
