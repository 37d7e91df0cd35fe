"""Architecture boundaries: core/ is pure, only engine/ imports llama_cpp, only rpc/ speaks gRPC,
rpc/v1 and rpc/vllm never import each other (what both use is rpc/shared's), the client package
stands alone, and test tooling (llama_grpc_testkit) is never shipped code's."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SERVER = ROOT / "server" / "llama_grpc_server"
CLIENT = ROOT / "client" / "llama_grpc"
TESTKIT = ROOT / "testkit" / "llama_grpc_testkit"
GRPC = {"grpc", "grpc_health", "grpc_reflection", "grpc_status"}


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
    files = list((SERVER / "core").rglob("*.py"))
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


def test_only_rpc_imports_grpc_or_the_generated_stubs() -> None:
    """Outside rpc/, no server module imports grpc (or its health, reflection and status
    packages) or generated messages (llama_grpc.v1, the vLLM protocol's smg_grpc_proto); no
    entry module needs an exception."""
    checked = 0
    for path in SERVER.rglob("*.py"):
        if "rpc" in path.relative_to(SERVER).parts:
            continue
        checked += 1
        bad = imported_modules(path) & (GRPC | {"llama_grpc", "smg_grpc_proto"})
        assert not bad, f"{path.relative_to(SERVER)} imports {bad}"
    assert checked > 20


def test_client_never_imports_the_server_package() -> None:
    """No module of the client package imports llama_grpc_server."""
    files = [p for p in CLIENT.rglob("*.py") if "v1" not in p.relative_to(CLIENT).parts]
    assert len(files) >= 5
    for path in files:
        assert "llama_grpc_server" not in imported_modules(path), path


def test_neither_package_imports_the_testkit_and_the_testkit_imports_no_test() -> None:
    """The server and client packages never import llama_grpc_testkit (test tooling), and the
    testkit never imports the tests (the tests and bench/ import it, not the other way)."""
    shipped = [*SERVER.rglob("*.py"), *CLIENT.rglob("*.py")]
    for path in shipped:
        assert "llama_grpc_testkit" not in imported_modules(path), path
    tooling = list(TESTKIT.rglob("*.py"))
    assert len(tooling) >= 4
    for path in tooling:
        assert not imported_modules(path) & {"tests", "bench"}, path


def test_importing_the_client_loads_no_server_code() -> None:
    """`import llama_grpc` and its CLI in a fresh interpreter load no llama_grpc_server module
    (the CLI imports llama_grpc_server.cli by name only when `serve` runs)."""
    code = (
        "import sys, llama_grpc, llama_grpc.cli, llama_grpc.client, llama_grpc.errors; "
        "print(sorted(m for m in sys.modules if m.startswith('llama_grpc_server')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


RPC = SERVER / "rpc"


def imported_names(path: Path) -> set[str]:
    """Every module a file imports, in full (`from a.b import c` -> a.b and a.b.c)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def reaches(names: set[str], package: str) -> bool:
    return any(name == package or name.startswith(package + ".") for name in names)


def test_v1_and_vllm_never_import_each_other() -> None:
    """rpc/v1 and rpc/vllm are two protocols over the same engine: what they share lives in
    rpc/shared, so a change to one never breaks the other unseen."""
    pairs = (("v1", "llama_grpc_server.rpc.vllm"), ("vllm", "llama_grpc_server.rpc.v1"))
    for room, other in pairs:
        files = list((RPC / room).rglob("*.py"))
        assert len(files) >= 3, room
        for path in files:
            assert not reaches(imported_names(path), other), f"{path.relative_to(SERVER)}"


def test_vllm_never_imports_the_v1_protocol() -> None:
    """rpc/vllm never imports llama_grpc.v1's generated messages (nor the v1 client)."""
    for path in (RPC / "vllm").rglob("*.py"):
        assert not reaches(imported_names(path), "llama_grpc"), path.relative_to(SERVER)


def test_shared_belongs_to_neither_protocol() -> None:
    """rpc/shared (running a request, checked parameters, deadlines, tokenizing, thinking)
    imports neither protocol's room nor either protocol's generated messages."""
    files = list((RPC / "shared").rglob("*.py"))
    assert len(files) >= 3
    banned = (
        "llama_grpc",
        "smg_grpc_proto",
        "llama_grpc_server.rpc.v1",
        "llama_grpc_server.rpc.vllm",
    )
    for path in files:
        names = imported_names(path)
        bad = [package for package in banned if reaches(names, package)]
        assert not bad, f"{path.relative_to(SERVER)} imports {bad}"


def test_the_boundary_reader_sees_every_form_of_import(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import llama_grpc.v1.llm_service_pb2\n"
        "from llama_grpc_server.rpc import v1\n"
        "from llama_grpc_server.rpc.vllm.convert import loads\n"
    )
    names = imported_names(source)
    assert reaches(names, "llama_grpc")
    assert reaches(names, "llama_grpc_server.rpc.v1")
    assert reaches(names, "llama_grpc_server.rpc.vllm")
    assert not reaches(names, "llama_grpc_server.rpc.v")
