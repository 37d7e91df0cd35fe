"""The lowest client dependency versions pyproject.toml declares, and a smoke test for them.

    python tools/min_deps.py pins            # "grpcio==1.85.1 protobuf==7.35.1 ..." from >= bounds
    python -I tools/min_deps.py smoke PINS   # in a venv holding exactly PINS + the client package

`make check-min-deps` creates a throwaway venv outside the checkout, installs the pins and the
client package (no [server] extra) and runs `smoke` there: the committed generated code must
import, and a Client must make calls, with the oldest versions pip may pick for a user.
Standard library only for `pins`; `smoke` needs only the client's own dependencies.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from concurrent import futures
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*?)\s*(?:;.*)?$")


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version, trailing zeros dropped: "1.70" == "1.70.0"."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    parts = [int(p) for p in match.group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def requirements(entries: list[str]) -> dict[str, dict[str, str]]:
    """PEP 508 strings without URLs -> {normalized name: {operator: version}}."""
    out: dict[str, dict[str, str]] = {}
    for entry in entries:
        match = _REQUIREMENT.match(entry)
        if match is None:
            raise ValueError(f"unparsed requirement: {entry!r}")
        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        specs: dict[str, str] = {}
        for spec in filter(None, (s.strip() for s in match.group(2).split(","))):
            op = re.match(r"(===|==|>=|<=|~=|!=|<|>)\s*(.+)", spec)
            if op is None:
                raise ValueError(f"unparsed specifier {spec!r} in {entry!r}")
            specs[op.group(1)] = op.group(2).strip()
        out[name] = specs
    return out


def pyproject(root: Path = ROOT) -> dict[str, Any]:
    with (root / "pyproject.toml").open("rb") as f:
        data: dict[str, Any] = tomllib.load(f)
    return data


def lowest_pins(root: Path = ROOT) -> list[str]:
    """name==lower-bound for every runtime dependency of the client ([project].dependencies)."""
    pins = []
    for name, specs in requirements(pyproject(root)["project"]["dependencies"]).items():
        if ">=" not in specs and "==" not in specs:
            raise SystemExit(f"client dependency {name} declares no lower bound")
        pins.append(f"{name}=={specs.get('==', specs.get('>='))}")
    return pins


def smoke(pins: list[str]) -> None:
    """Installed versions are the pins; the server extra is absent; stubs import; a Client calls
    a real grpc server on 127.0.0.1 and maps its rich error status to the typed error."""
    for pin in pins:
        name, version = pin.split("==")
        installed = importlib.metadata.version(name)
        if release(installed) != release(version):
            raise SystemExit(f"{name} {installed} installed, expected {version}")
    assert importlib.util.find_spec("llama_cpp") is None, "the server extra is installed"

    import grpc
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2
    from grpc_status import rpc_status

    import llama_grpc
    from llama_grpc import Client, InvalidArgumentError
    from llama_grpc.v1 import llm_service_pb2 as pb
    from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

    assert ROOT not in Path(llama_grpc.__file__).resolve().parents, "imported the checkout"

    class Servicer(pb_grpc.LlmServiceServicer):
        def Tokenize(self, request: Any, context: Any) -> Any:
            return pb.TokenizeResponse(token_ids=[len(request.text), 7])

        def Detokenize(self, request: Any, context: Any) -> Any:
            info = any_pb2.Any()
            info.Pack(error_details_pb2.ErrorInfo(reason="INVALID_ARGUMENT", domain="llama-grpc"))
            status = status_pb2.Status(code=3, message="bad ids", details=[info])
            context.abort_with_status(rpc_status.to_status(status))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_LlmServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", timeout=10) as client:
            assert client.tokenize("abc") == [3, 7]
            failure: Exception | None = None
            try:
                client.detokenize([1])
            except InvalidArgumentError as error:
                failure = error
    finally:
        server.stop(None)
    assert isinstance(failure, InvalidArgumentError), failure
    assert failure.message == "bad ids", failure
    names = [pin.split("==")[0] for pin in pins]
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in names)
    print(f"min-deps smoke passed: {versions}, llama_grpc from {Path(llama_grpc.__file__).parent}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["pins"]:
        print(" ".join(lowest_pins()))
        return 0
    if argv[:1] == ["smoke"] and len(argv) > 1:
        smoke(argv[1:])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
