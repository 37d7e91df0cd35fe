"""pyproject.toml's lower bounds are versions the committed generated code imports with.

llm_service_pb2_grpc.py raises on a grpcio older than GRPC_GENERATED_VERSION, and
llm_service_pb2.py asks the protobuf runtime to refuse anything older than the protobuf it was
generated with; a user installing the declared minimum must not hit either. The generators are
pinned exactly so that `make proto-check` stays byte-identical. `make check-min-deps` installs
the minimum for real; this test keeps the numbers honest on every run.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
GENERATED = ROOT / "client" / "llama_grpc" / "v1"


def _min_deps() -> ModuleType:
    spec = importlib.util.spec_from_file_location("min_deps", ROOT / "tools" / "min_deps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MIN_DEPS = _min_deps()
PROJECT = MIN_DEPS.pyproject(ROOT)
RUNTIME = MIN_DEPS.requirements(PROJECT["project"]["dependencies"])
SERVER = MIN_DEPS.requirements(PROJECT["project"]["optional-dependencies"]["server"])
DEV = MIN_DEPS.requirements(PROJECT["dependency-groups"]["dev"])


def _grpc_generated_version() -> str:
    text = (GENERATED / "llm_service_pb2_grpc.py").read_text()
    match = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", text, re.MULTILINE)
    assert match, "GRPC_GENERATED_VERSION not found"
    return match.group(1)


def _protobuf_generated_version() -> str:
    text = (GENERATED / "llm_service_pb2.py").read_text()
    call = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
        r"\s*(\d+),\s*(\d+),\s*(\d+),\s*'([^']*)',",
        text,
    )
    assert call, "ValidateProtobufRuntimeVersion call not found"
    version = ".".join(call.group(1, 2, 3)) + call.group(4)
    header = re.search(r"^# Protobuf Python Version: (\S+)$", text, re.MULTILINE)
    assert header and header.group(1) == version
    return version


GRPC_GENERATED = _grpc_generated_version()
PROTOBUF_GENERATED = _protobuf_generated_version()


def _lower_bound(specs: dict[str, str], name: str) -> str:
    assert ">=" in specs, f"{name} declares no lower bound: {specs}"
    bound: str = specs[">="]
    return bound


def test_the_generated_versions_are_read() -> None:
    """Guard the regexes: both versions look like versions."""
    assert MIN_DEPS.release(GRPC_GENERATED) >= (1, 0)
    assert MIN_DEPS.release(PROTOBUF_GENERATED) >= (3, 0)


@pytest.mark.parametrize(
    ("group", "name"),
    [
        ("runtime", "grpcio"),
        ("runtime", "grpcio-status"),
        ("server", "grpcio-health-checking"),
        ("server", "grpcio-reflection"),
    ],
)
def test_grpc_lower_bounds_reach_the_generated_version(group: str, name: str) -> None:
    """grpcio and its companions (released in lockstep) start at GRPC_GENERATED_VERSION."""
    specs = (RUNTIME if group == "runtime" else SERVER)[name]
    bound = _lower_bound(specs, name)
    assert MIN_DEPS.release(bound) >= MIN_DEPS.release(GRPC_GENERATED), (name, bound)


def test_protobuf_lower_bound_reaches_the_gencode_version() -> None:
    bound = _lower_bound(RUNTIME["protobuf"], "protobuf")
    assert MIN_DEPS.release(bound) >= MIN_DEPS.release(PROTOBUF_GENERATED), bound


def test_generators_are_pinned_exactly() -> None:
    """grpcio-tools is the one that wrote GRPC_GENERATED_VERSION; mypy-protobuf the .pyi."""
    assert set(DEV["grpcio-tools"]) == {"=="}
    assert MIN_DEPS.release(DEV["grpcio-tools"]["=="]) == MIN_DEPS.release(GRPC_GENERATED)
    assert set(DEV["mypy-protobuf"]) == {"=="}


def test_min_deps_pins_are_the_client_lower_bounds() -> None:
    """What `make check-min-deps` installs: every client dependency at its lower bound."""
    pins = MIN_DEPS.lowest_pins(ROOT)
    assert pins == [f"{name}=={_lower_bound(specs, name)}" for name, specs in RUNTIME.items()]
    assert {pin.split("==")[0] for pin in pins} == {"grpcio", "protobuf", "grpcio-status"}


def test_the_vllm_protocol_stubs_are_pinned_and_within_the_bounds() -> None:
    """smg-grpc-proto (the vLLM engine protocol's generated modules) is pinned exactly in the
    server extra, and the grpcio and protobuf it was generated with are not newer than the
    lowest versions the project allows (its stubs refuse an older runtime)."""
    import smg_grpc_proto
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    pin = SERVER["smg-grpc-proto"]
    assert set(pin) == {"=="}
    assert pin["=="] == smg_grpc_proto.__version__
    grpc_text = Path(vllm_engine_pb2_grpc.__file__).read_text()
    grpc_version = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", grpc_text, re.MULTILINE)
    assert grpc_version is not None
    grpc_bound = _lower_bound(RUNTIME["grpcio"], "grpcio")
    assert MIN_DEPS.release(grpc_version.group(1)) <= MIN_DEPS.release(grpc_bound)
    pb_text = Path(vllm_engine_pb2.__file__).read_text()
    header = re.search(r"^# Protobuf Python Version: (\S+)$", pb_text, re.MULTILINE)
    assert header is not None
    protobuf_bound = _lower_bound(RUNTIME["protobuf"], "protobuf")
    assert MIN_DEPS.release(header.group(1)) <= MIN_DEPS.release(protobuf_bound)
