"""The offline model catalog: which GGUF files a name means. Pure Python (no llama.cpp), so
`llama-grpc models list` and a future `serve --model NAME` resolve names the same way.

A catalog is the embedded default model, plus, with a models directory (--models-dir or
LLAMA_GRPC_MODELS_DIR): every *.gguf in it (name = file stem) and the entries of its
catalog.toml, which `llama-grpc models add` writes:

    [models.my-model]
    path = "/abs/path/to/my-model.gguf"

`add` edits catalog.toml with tomlkit, so a user's comments, ordering and keys or tables it
does not know survive. When two sources give the same name, the first wins: embedded, then
catalog.toml, then files.
A name none of them gives may be a trained model of models/trained.py: `lookup` fetches it into
the per-machine cache on first use (models/assemble.py); `list_models` leaves them out."""

from __future__ import annotations

import os
import re
import tempfile
import tomllib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import tomlkit
from tomlkit.items import InlineTable

from llama_grpc_server.models import assemble, trained
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME, default_model_path
from llama_grpc_server.models.gguf_header import read_header

MODELS_DIR_ENV = "LLAMA_GRPC_MODELS_DIR"
CATALOG_FILE = "catalog.toml"
SUFFIX = ".gguf"
EMBEDDED, CATALOG, DIRECTORY, PATH = "embedded", "catalog", "directory", "path"
TRAINED = "trained"
# the first line of a catalog.toml `add` creates
_HEADER = "Written by `llama-grpc models add`: model name -> GGUF file."
# A name never looks like a path or a NAME=PATH pair, so `resolve` can tell them apart.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class CatalogError(Exception):
    """An unknown name, a bad catalog file or directory, or a refused `add`."""


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    path: Path
    source: str  # EMBEDDED, CATALOG, DIRECTORY, TRAINED, or PATH (given as a path, not a name)


def models_dir_from(
    given: str | os.PathLike[str] | None, environ: Mapping[str, str]
) -> Path | None:
    """--models-dir when given, else $LLAMA_GRPC_MODELS_DIR, else None (embedded model only)."""
    raw = given if given is not None else environ.get(MODELS_DIR_ENV) or None
    return Path(raw).expanduser() if raw is not None else None


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name) or name.endswith(SUFFIX):
        raise CatalogError(
            f"invalid model name {name!r}: letters, digits, '.', '_' and '-', starting with a "
            f"letter or digit, not ending in {SUFFIX}"
        )


def read_catalog(models_dir: Path) -> dict[str, Path]:
    """catalog.toml's entries (name -> path; relative paths are relative to the directory);
    {} when there is no catalog file."""
    path = models_dir / CATALOG_FILE
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CatalogError(f"{path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CatalogError(f"{path}: invalid TOML: {exc}") from None
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise CatalogError(f"{path}: [models] must be a table")
    out: dict[str, Path] = {}
    for name, entry in models.items():
        model_path = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(model_path, str) or not model_path:
            raise CatalogError(f'{path}: [models.{name}] needs path = "..."')
        out[name] = models_dir / Path(model_path).expanduser()
    return out


def list_models(models_dir: Path | None) -> list[ModelEntry]:
    """Every model a name can resolve to: embedded first, then catalog.toml, then *.gguf files
    (each group sorted by name). CatalogError when models_dir is not a directory."""
    entries = [ModelEntry(DEFAULT_MODEL_NAME, default_model_path(), EMBEDDED)]
    if models_dir is None:
        return entries
    if not models_dir.is_dir():
        raise CatalogError(f"models directory {models_dir}: no such directory")
    seen = {DEFAULT_MODEL_NAME}
    files = {p.stem: p for p in models_dir.glob("*" + SUFFIX) if p.is_file()}
    for source, found in ((CATALOG, read_catalog(models_dir)), (DIRECTORY, files)):
        for name in sorted(found):
            if name not in seen:
                seen.add(name)
                entries.append(ModelEntry(name, found[name], source))
    return entries


def looks_like_path(name_or_path: str) -> bool:
    return os.sep in name_or_path or "/" in name_or_path or name_or_path.endswith(SUFFIX)


def lookup(name_or_path: str, models_dir: Path | None) -> ModelEntry:
    """The entry a name (from list_models, else a trained model's, fetched first if need be)
    or a path means; a path is anything with a slash or ending in .gguf, must exist, and comes
    back as source PATH named by its stem. CatalogError lists the known names for an unknown
    one, and says why a trained model could not be fetched."""
    if looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise CatalogError(f"{path}: no such file")
        return ModelEntry(path.stem, path, PATH)
    entries = list_models(models_dir)
    for entry in entries:
        if entry.name == name_or_path:
            return entry
    model = trained.find(name_or_path)
    if model is not None:
        return ModelEntry(model.name, fetch_trained(model), TRAINED)
    known = ", ".join(entry.name for entry in entries)
    where = (
        f"models directory {models_dir}"
        if models_dir
        else f"no models directory: give --models-dir or set {MODELS_DIR_ENV}"
    )
    raise CatalogError(
        f"unknown model {name_or_path!r} ({where}); available: {known}; or a trained model, "
        f"fetched on first use: {', '.join(trained.names())}"
    )


def fetch_trained(model: trained.TrainedModel) -> Path:
    """The trained model's file in the per-machine cache, downloaded and assembled the first
    time (progress on stderr); CatalogError when it cannot be."""
    try:
        return assemble.fetch(model)
    except assemble.FetchError as exc:  # names the model
        raise CatalogError(str(exc)) from None
    except OSError as exc:
        raise CatalogError(f"{model.name}: cannot fetch it: {exc}") from None


def resolve(name_or_path: str, models_dir: Path | None) -> Path:
    """The GGUF file a name or a path means (see lookup)."""
    return lookup(name_or_path, models_dir).path


def add(name: str, path: Path, models_dir: Path, *, force: bool = False) -> Path:
    """Record name -> absolute path in models_dir/catalog.toml (created with the directory if
    needed) and return the path. The file must be GGUF (its header is read: GGUFError
    otherwise). A name already taken is refused unless force; the embedded name never."""
    check_name(name)
    path = path.expanduser().resolve()
    read_header(path)
    if name == DEFAULT_MODEL_NAME:
        raise CatalogError(f"{name!r} is the embedded model's name; choose another")
    models_dir.mkdir(parents=True, exist_ok=True)
    taken = {entry.name: entry for entry in list_models(models_dir)}
    if name in taken and not force and taken[name].path.resolve() != path:
        raise CatalogError(
            f"{name!r} already names {taken[name].path} ({taken[name].source}); "
            "use --force to replace it"
        )
    document = _load_document(models_dir)
    _set_path(document, name, path)
    write_catalog(models_dir, document)
    return path


def _load_document(models_dir: Path) -> tomlkit.TOMLDocument:
    """catalog.toml as tomlkit's document (comments and layout included; read_catalog has
    already checked it), or a new one that says who wrote it."""
    try:
        return tomlkit.parse((models_dir / CATALOG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        document = tomlkit.document()
        document.add(tomlkit.comment(_HEADER))
        document.add(tomlkit.nl())
        return document


def _set_path(document: tomlkit.TOMLDocument, name: str, path: Path) -> None:
    """[models.NAME] path = PATH: an entry already there keeps its other keys and its place, a
    new one goes after the last models entry (as [models.NAME], or into `models = {...}` when
    that is written inline)."""
    if "models" not in document:
        document["models"] = tomlkit.table(is_super_table=True)
    models = document["models"]  # a Table, an InlineTable, or tomlkit's proxy of a split one
    assert isinstance(models, MutableMapping)  # read_catalog refused anything else
    entry = models.get(name)
    if isinstance(entry, MutableMapping):
        entry["path"] = str(path)
        return
    if isinstance(models, InlineTable):
        models[name] = tomlkit.inline_table()
        models[name]["path"] = str(path)
        return
    new = tomlkit.table()
    new["path"] = str(path)
    new.add(tomlkit.nl())  # a blank line before whatever table follows
    models[name] = new


def write_catalog(models_dir: Path, document: tomlkit.TOMLDocument) -> None:
    """Write catalog.toml atomically (a temporary file in the same directory, then os.replace),
    so a reader never sees half a file and a crash keeps the old one."""
    fd, tmp = tempfile.mkstemp(prefix=".catalog-", suffix=".toml.tmp", dir=models_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tomlkit.dumps(document))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, models_dir / CATALOG_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
