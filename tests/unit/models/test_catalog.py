"""catalog: names -> GGUF files (embedded, catalog.toml, *.gguf in the models directory), and
`add` writing catalog.toml atomically. The embedded model is a tiny fake here."""

from __future__ import annotations

from pathlib import Path

import pytest

from llama_grpc_server.models import catalog
from llama_grpc_server.models.catalog import CatalogError, ModelEntry
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME
from llama_grpc_server.models.gguf_header import GGUFError
from tests.support.gguf_files import write_model


@pytest.fixture(autouse=True)
def embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = write_model(tmp_path / "embedded" / "gemma.gguf", "gemma3")
    monkeypatch.setattr(catalog, "default_model_path", lambda: path)
    return path


@pytest.fixture
def models(tmp_path: Path) -> Path:
    directory = tmp_path / "models"
    write_model(directory / "b-model.gguf")
    write_model(directory / "a-model.gguf")
    (directory / "notes.txt").write_text("not a model")
    (directory / "sub.gguf").mkdir()  # a directory named like a model is not one
    return directory


def names(entries: list[ModelEntry]) -> list[tuple[str, str]]:
    return [(e.name, e.source) for e in entries]


def test_without_a_directory_only_the_embedded_model(embedded: Path) -> None:
    assert catalog.list_models(None) == [ModelEntry(DEFAULT_MODEL_NAME, embedded, "embedded")]


def test_directory_files_by_stem_after_the_embedded_model(models: Path) -> None:
    assert names(catalog.list_models(models)) == [
        (DEFAULT_MODEL_NAME, "embedded"), ("a-model", "directory"), ("b-model", "directory"),
    ]  # fmt: skip


def test_models_dir_from_flag_then_env() -> None:
    env = {catalog.MODELS_DIR_ENV: "/from/env"}
    assert catalog.models_dir_from("/flag", env) == Path("/flag")
    assert catalog.models_dir_from(None, env) == Path("/from/env")
    assert catalog.models_dir_from(None, {catalog.MODELS_DIR_ENV: ""}) is None
    assert catalog.models_dir_from("~/m", {}) == Path.home() / "m"


def test_add_then_resolve_by_name(
    tmp_path: Path, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """add records the absolute path; the name resolves to it and lists before the files."""
    elsewhere = write_model(tmp_path / "elsewhere" / "x.gguf")
    monkeypatch.chdir(tmp_path)
    assert catalog.add("mine", Path("elsewhere/x.gguf"), models) == elsewhere
    assert catalog.resolve("mine", models) == elsewhere
    assert names(catalog.list_models(models))[1] == ("mine", "catalog")
    text = (models / catalog.CATALOG_FILE).read_text()
    assert f'path = "{elsewhere}"' in text
    assert not [p for p in models.iterdir() if p.name.startswith(".catalog-")]  # no temp left


def test_add_creates_the_directory(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m.gguf")
    catalog.add("m1", model, tmp_path / "new" / "dir")
    assert catalog.resolve("m1", tmp_path / "new" / "dir") == model


def test_add_refuses_a_taken_name_unless_forced(tmp_path: Path, models: Path) -> None:
    other = write_model(tmp_path / "other.gguf")
    with pytest.raises(CatalogError, match=r"already names .*a-model\.gguf.*--force"):
        catalog.add("a-model", other, models)
    catalog.add("a-model", models / "a-model.gguf", models)  # the same file again: fine
    catalog.add("a-model", other, models, force=True)
    assert catalog.resolve("a-model", models) == other  # the catalog shadows the file
    catalog.add("a-model", models / "a-model.gguf", models, force=True)
    assert catalog.resolve("a-model", models) == models / "a-model.gguf"
    assert names(catalog.list_models(models)).count(("a-model", "catalog")) == 1


def test_add_refuses_the_embedded_name_bad_names_and_non_gguf(tmp_path: Path, models: Path) -> None:
    model = models / "a-model.gguf"
    with pytest.raises(CatalogError, match="embedded"):
        catalog.add(DEFAULT_MODEL_NAME, model, models, force=True)
    for bad in ("", "-x", "a/b", "a=b", "x.gguf", "sp ace"):
        with pytest.raises(CatalogError, match="invalid model name"):
            catalog.add(bad, model, models)
    with pytest.raises(GGUFError, match=r"notes\.txt"):
        catalog.add("notes", models / "notes.txt", models)
    assert not (models / catalog.CATALOG_FILE).exists()


def test_names_with_toml_specials_round_trip(tmp_path: Path, models: Path) -> None:
    """Paths with quotes, backslashes and control characters survive the TOML file."""
    odd = write_model(tmp_path / 'we"ird\\di\tr' / "m.gguf")
    catalog.add("odd.name_1", odd, models)
    assert catalog.read_catalog(models) == {"odd.name_1": odd}


def test_add_keeps_comments_order_and_unknown_keys(tmp_path: Path, models: Path) -> None:
    """`add` edits a hand-written catalog.toml in place: its comments, its order, a key the
    catalog does not know and a table it does not know survive adding a name and replacing
    another's path (--force); only the path line changes."""
    path = models / catalog.CATALOG_FILE
    text = (
        "# my models, hand-kept\n"
        "\n"
        "[models.zeta]  # the big one\n"
        'path = "a-model.gguf"\n'
        'note = "keep me"  # an unknown key\n'
        "\n"
        "[mirrors]  # an unknown table\n"
        'url = "https://example.invalid"\n'
        "\n"
        "[models.alpha]\n"
        'path = "b-model.gguf"\n'
    )
    path.write_text(text)
    other = write_model(tmp_path / "other.gguf")
    catalog.add("mid", other, models)
    catalog.add("zeta", other, models, force=True)
    written = path.read_text()
    assert written == text.replace('path = "a-model.gguf"', f'path = "{other}"').replace(
        "\n[mirrors]", f'\n[models.mid]\npath = "{other}"\n\n[mirrors]'
    )
    assert catalog.read_catalog(models) == {
        "zeta": other, "mid": other, "alpha": models / "b-model.gguf",
    }  # fmt: skip


def test_write_failure_keeps_the_old_catalog(models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    catalog.add("first", models / "a-model.gguf", models)
    before = (models / catalog.CATALOG_FILE).read_text()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(catalog.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        catalog.add("second", models / "b-model.gguf", models)
    assert (models / catalog.CATALOG_FILE).read_text() == before
    assert sorted(p.name for p in models.iterdir() if p.name.startswith(".")) == []


def test_hand_written_catalog_relative_paths_and_errors(models: Path) -> None:
    """Relative paths are relative to the directory; a broken catalog names the file."""
    path = models / catalog.CATALOG_FILE
    path.write_text('[models.rel]\npath = "a-model.gguf"\n')
    assert catalog.resolve("rel", models) == models / "a-model.gguf"
    for text, expected in (
        ("[models\n", "invalid TOML"),
        ('models = "x"\n', "must be a table"),
        ("[models.x]\nfile = 1\n", 'needs path = "..."'),
    ):
        path.write_text(text)
        with pytest.raises(CatalogError, match=expected) as caught:
            catalog.list_models(models)
        assert str(path) in str(caught.value)


def test_resolve_paths_and_unknown_names(tmp_path: Path, models: Path) -> None:
    """Anything with a slash or ending in .gguf is a path; an unknown name lists the known."""
    assert catalog.resolve(str(models / "a-model.gguf"), None) == models / "a-model.gguf"
    entry = catalog.lookup(str(models / "b-model.gguf"), None)
    assert (entry.name, entry.source) == ("b-model", "path")
    with pytest.raises(CatalogError, match="no such file"):
        catalog.resolve("missing.gguf", models)
    with pytest.raises(CatalogError) as caught:
        catalog.resolve("nope", models)
    assert f"available: {DEFAULT_MODEL_NAME}, a-model, b-model" in str(caught.value)
    with pytest.raises(CatalogError, match=catalog.MODELS_DIR_ENV):
        catalog.resolve("a-model", None)
    with pytest.raises(CatalogError, match="no such directory"):
        catalog.list_models(tmp_path / "absent")
