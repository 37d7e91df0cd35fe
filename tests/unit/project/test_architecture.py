"""docs/ARCHITECTURE.md is a map a newcomer reads in one sitting (at most MAX_LINES lines; how
each part works belongs to the topic pages), and its module table names every module of the
server package, and only modules that exist: a module added, moved or removed without the page
changing fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SERVER = ROOT / "server" / "llama_grpc_server"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
TABLE_HEADER = "| module | concept |"
MAX_LINES = 250


def server_modules() -> set[str]:
    """Each module as its path relative to the package (`rpc/v1/convert.py`); a package's
    __init__.py is described by the package tree instead."""
    return {
        path.relative_to(SERVER).as_posix()
        for path in SERVER.rglob("*.py")
        if path.name != "__init__.py"
    }


def server_packages() -> set[str]:
    return {
        path.parent.relative_to(SERVER).as_posix() + "/"
        for path in SERVER.rglob("__init__.py")
        if path.parent != SERVER
    }


def as_path(name: str) -> str:
    """`rpc/v1/convert.py`, `rpc.v1.convert` or `llama_grpc_server.rpc.v1.convert` ->
    `rpc/v1/convert.py`."""
    if name.endswith(".py"):
        return name
    return name.removeprefix("llama_grpc_server.").replace(".", "/") + ".py"


def table_names(text: str) -> list[str]:
    """The modules named in the first column of the module table, as paths."""
    lines = text.splitlines()
    start = lines.index(TABLE_HEADER) + 2
    names: list[str] = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names += [as_path(name) for name in re.findall(r"`([^`]+)`", line.split(" | ")[0])]
    return names


def test_the_map_is_short() -> None:
    lines = len(ARCHITECTURE.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{lines} lines: move how things work to the topic pages"


def suggested_row(module: str) -> str:
    """A table row for a module the table lacks, its concept the docstring's first sentence, so
    the failure message can be pasted into the table (and the concept then shortened)."""
    doc = ast.get_docstring(ast.parse((SERVER / module).read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n")[0].split()).partition(". ")[0].removesuffix(".")
    return f"| `{module}` | {first} |"


def test_the_module_table_names_every_server_module() -> None:
    named = set(table_names(ARCHITECTURE.read_text(encoding="utf-8")))
    missing = sorted(server_modules() - named)
    assert missing == [], "rows to add:\n" + "\n".join(suggested_row(m) for m in missing)


def test_the_module_table_names_no_module_that_does_not_exist() -> None:
    names = table_names(ARCHITECTURE.read_text(encoding="utf-8"))
    assert sorted(set(names) - server_modules()) == []
    assert len(names) == len(set(names)), "a module is named twice"


def test_the_package_tree_names_every_package() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    tree = text[text.index("server/llama_grpc_server/\n") : text.index("deploy/ ")]
    assert listed_packages(tree) == server_packages()


def listed_packages(tree: str) -> set[str]:
    """The packages of the tree, nested by four spaces a level (`core/kv/`)."""
    listed: set[str] = set()
    parents: list[str] = []
    for indent, name in re.findall(r"^((?:    )+)([a-z_][a-z0-9_]*/)", tree, re.MULTILINE):
        depth = len(indent) // 4 - 1
        parents[depth:] = [name]
        listed.add("".join(parents))
    return listed


def test_the_tree_reader_nests_packages_by_indentation() -> None:
    tree = "    core/    x\n        kv/    y\n    rpc/    z\n        v1/    v\n        a.py  w\n"
    assert listed_packages(tree) == {"core/", "core/kv/", "rpc/", "rpc/v1/"}


def test_a_suggested_row_is_a_table_row_of_the_module() -> None:
    row = suggested_row("watchdog.py")
    assert row.startswith("| `watchdog.py` | ") and table_names(f"{TABLE_HEADER}\n|-|\n{row}")


def test_the_table_reader_sees_dotted_names_and_stops_at_the_table_end() -> None:
    rows = "| `a/b.py`, `llama_grpc_server.c.d` | x |\n\n| `e.py` | y |"
    text = f"{TABLE_HEADER}\n| --- | --- |\n{rows}"
    assert table_names(text) == ["a/b.py", "c/d.py"]


# the unit tests' rooms: the server's packages, the client, and what lies outside the packages
UNIT_ROOMS = {
    "bench",
    "client",
    "config",
    "core",
    "deploy",
    "engine",
    "models",
    "observability",
    "project",
    "rpc",
}


def test_unit_tests_are_grouped_like_the_code() -> None:
    unit = ROOT / "tests" / "unit"
    assert sorted(p.name for p in unit.glob("test_*.py")) == []  # none left in the flat room
    rooms = {p.parent.name for p in unit.glob("*/test_*.py")}
    assert rooms == UNIT_ROOMS
    server = {p.name for p in (ROOT / "server" / "llama_grpc_server").iterdir() if p.is_dir()}
    assert UNIT_ROOMS - {"bench", "client", "deploy", "project"} <= server
