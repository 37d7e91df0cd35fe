"""Architecture boundaries: core/ is pure, only engine/ imports llama_cpp."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server" / "llama_grpc_server"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_imports_neither_llama_cpp_nor_grpc() -> None:
    """core/ never imports llama_cpp or grpc."""
    files = list((SERVER / "core").glob("*.py"))
    assert files
    for path in files:
        bad = imported_modules(path) & {"llama_cpp", "grpc", "numpy"}
        assert not bad, f"{path.name} imports {bad}"


def test_only_engine_imports_llama_cpp() -> None:
    """Outside engine/, no server module imports llama_cpp."""
    for path in SERVER.rglob("*.py"):
        if "engine" in path.relative_to(SERVER).parts:
            continue
        assert "llama_cpp" not in imported_modules(path), path
