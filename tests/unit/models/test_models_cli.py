"""`llama-grpc models list | info | verify | add` on tiny fake GGUF files: output, exit codes,
and the dispatch from the client CLI. The success path of verify loads a real model: see
tests/model/test_models.py."""

from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path

import pytest

from llama_grpc import cli as client_cli
from llama_grpc_server.models import catalog
from llama_grpc_server.models import cli as models_cli
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME
from tests.support.gguf_files import write_model

pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture(autouse=True)
def embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = write_model(tmp_path / "embedded" / "gemma.gguf", "gemma3", ctx=32768)
    monkeypatch.setattr(catalog, "default_model_path", lambda: path)
    monkeypatch.delenv(catalog.MODELS_DIR_ENV, raising=False)
    return path


@pytest.fixture
def models(tmp_path: Path) -> Path:
    write_model(tmp_path / "models" / "qwen.gguf", "qwen2", file_type=7, template="{{ x }}")
    return tmp_path / "models"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = models_cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_list_table(models: Path, embedded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "list", "--models-dir", str(models))
    assert status == 0
    header, first, second = out.splitlines()
    assert header.split() == ["NAME", "SIZE", "ARCH", "PARAMS", "QUANT", "CTX", "CHAT", "PATH"]
    assert first.split() == [DEFAULT_MODEL_NAME, "0", "MB", "gemma3", "40", "Q4_K_M", "32768",
                             "no", str(embedded)]  # fmt: skip
    assert second.split()[0] == "qwen" and second.split()[3:8] == ["qwen2", "40", "Q8_0", "4096",
                                                                   "yes"]  # fmt: skip


def test_list_json_and_the_env_directory(
    models: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(models))
    status, out, _ = run(capsys, "list", "--json")
    assert status == 0
    records = json.loads(out)
    assert [r["name"] for r in records] == [DEFAULT_MODEL_NAME, "qwen"]
    assert records[1] | {"size_bytes": 0} == {
        "name": "qwen", "path": str(models / "qwen.gguf"), "source": "directory",
        "size_bytes": 0, "architecture": "qwen2", "model_name": "Tiny qwen2", "n_params": 40,
        "size_label": "40", "quantization": "Q8_0", "file_type": 7, "context_length": 4096,
        "has_chat_template": True, "gguf_version": 3, "tensor_count": 2,
    }  # fmt: skip


def test_list_reports_unreadable_files_and_exits_1(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (models / "broken.gguf").write_bytes(b"nope")
    status, out, err = run(capsys, "list", "--models-dir", str(models))
    assert status == 1
    assert "broken" in out and "qwen" in out
    assert err == f"error: {models / 'broken.gguf'}: not a GGUF file (bad magic)\n"


def test_info_prints_fields_and_metadata(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "info", "qwen", "--models-dir", str(models))
    assert status == 0
    assert "quantization       Q8_0" in out
    assert "tokenizer.ggml.tokens    [100 x string]" in out
    assert 'tokenizer.chat_template  "{{ x }}"' in out
    status, out, _ = run(capsys, "info", str(models / "qwen.gguf"), "--json")
    data = json.loads(out)
    assert (data["name"], data["source"]) == ("qwen", "path")
    assert data["metadata"]["tokenizer.ggml.tokens"] == {"array_of": "string", "length": 100}


def test_unknown_name_lists_the_available(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "info", "nope", "--models-dir", str(models))
    assert status == 1
    assert f"available: {DEFAULT_MODEL_NAME}, qwen" in err


def test_add_then_list(tmp_path: Path, models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = write_model(tmp_path / "elsewhere" / "o.gguf", "phi3")
    status, out, _ = run(capsys, "add", "phi", str(other), "--models-dir", str(models))
    assert (status, out) == (0, f"phi -> {other} ({models / 'catalog.toml'})\n")
    status, out, _ = run(capsys, "list", "--models-dir", str(models), "--json")
    assert [(r["name"], r["source"]) for r in json.loads(out)] == [
        (DEFAULT_MODEL_NAME, "embedded"), ("phi", "catalog"), ("qwen", "directory"),
    ]  # fmt: skip
    status, _, err = run(capsys, "add", "phi", str(models / "qwen.gguf"), "--models-dir",
                         str(models))  # fmt: skip
    assert status == 1 and "--force" in err
    assert run(capsys, "add", "phi", str(models / "qwen.gguf"), "--models-dir", str(models),
               "--force")[0] == 0  # fmt: skip


def test_add_needs_a_directory_and_a_gguf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run(capsys, "add", "x", str(tmp_path / "embedded" / "gemma.gguf"))
    assert status == 1 and catalog.MODELS_DIR_ENV in err
    (tmp_path / "t.txt").write_text("text")
    status, _, err = run(capsys, "add", "x", str(tmp_path / "t.txt"), "--models-dir", str(tmp_path))
    assert status == 1 and "not a GGUF file" in err


def test_verify_refuses_a_wrong_sha256_before_loading(
    embedded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    digest = hashlib.sha256(embedded.read_bytes()).hexdigest()
    status, out, err = run(capsys, "verify", DEFAULT_MODEL_NAME, "--sha256", "0" * 64)
    assert status == 1
    assert err == f"error: sha256 mismatch: the file is {digest}, expected {'0' * 64}\n"
    assert "load:" not in out


def test_verify_reports_a_load_failure(embedded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fake has a header but no tensor data: llama.cpp refuses it, verify exits 1."""
    digest = hashlib.sha256(embedded.read_bytes()).hexdigest()
    status, out, err = run(capsys, "verify", str(embedded), "--sha256", digest.upper())
    assert status == 1
    assert f"sha256:  {digest} (matches)" in out
    assert err.splitlines()[-1] == f"error: verify failed: llama.cpp could not load {embedded}"


def test_verify_rejects_a_malformed_sha256(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        models_cli.main(["verify", "x", "--sha256", "abc"])
    assert caught.value.code == 2
    assert "expected 64 hex digits" in capsys.readouterr().err


def test_client_cli_hands_models_to_the_server_package(monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[list[str]] = []
    fake = types.ModuleType("llama_grpc_server.models.cli")
    fake.main = lambda argv: received.append(argv) or 5  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_grpc_server.models.cli", fake)
    assert client_cli.main(["models", "list", "--json"]) == 5
    assert received == [["list", "--json"]]


def test_client_cli_models_without_the_server_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "llama_grpc_server.models.cli", None)
    assert client_cli.main(["models", "list"]) == 2
    assert capsys.readouterr().err.startswith("llama-grpc models needs the server extra")
