"""Settings from argv, LLAMA_GRPC_* env and a TOML config file: defaults < file < env < flags,
each value checked against the option table (config/options.py) and the relations between
options, then built into frozen Settings. Changes nothing; errors name the option and where
its value came from."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from llama_grpc_server.auth import AuthFileError, load_auth_file, plaintext_tokens_problem
from llama_grpc_server.config.options import (
    BY_NAME,
    CLIENT_ENV,
    CONFIG_ENV,
    ENV_PREFIX,
    OPTIONS,
    PATH_OPTIONS,
    PROG,
    RENAMED,
    Option,
    Value,
)
from llama_grpc_server.config.settings import (
    AUTO,
    ModelSettings,
    PoolSettings,
    SchedulerSettings,
    ServerSettings,
    Settings,
    parse_engine_lora,
    parse_lora,
)
from llama_grpc_server.core.requests.request import SamplingParams
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.models import catalog
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME
from llama_grpc_server.observability import tracing


class ConfigError(Exception):
    """An option is unknown or invalid; the message names the option and where it came from."""


class HelpRequested(Exception):
    """-h/--help was given; `text` is the help to print."""

    def __init__(self, text: str) -> None:
        super().__init__("help requested")
        self.text = text


EPILOG = f"""\
precedence, lowest first: defaults < TOML config file (--config PATH or {CONFIG_ENV})
  < environment variables < command-line flags.

environment: each option --some-name is also {ENV_PREFIX}SOME_NAME, e.g. {ENV_PREFIX}N_PARALLEL=8,
  {ENV_PREFIX}CACHE_PROMPT=false (or {ENV_PREFIX}NO_CACHE_PROMPT=1). Empty values count as unset;
  any other {ENV_PREFIX}* variable is an error.

config file: flat TOML keys named like the flags, with underscores (no [sections]); a relative
  relative file paths (model, tls_*, auth_tokens_file) are relative to the file:
    model = "models/my-model.gguf"
    n_ctx = 4096
    n_parallel = 8
    batch_strategy = "balanced"
    temperature = 0.7
    cache_prompt = false

invalid or unknown options stop the server at start with exit code 2."""


@dataclass(frozen=True, slots=True)
class Resolved:
    """A typed option value and where it came from (for error messages)."""

    value: Value
    source: str


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (command line)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Serve a local GGUF model over gRPC with continuous batching.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        allow_abbrev=False,
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    for old in RENAMED:  # still read, not shown
        parser.add_argument(
            f"--{_dashed(old)}",
            dest=old,
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
    parser.add_argument("--config", metavar="PATH", default=None, help="TOML config file")
    for opt in OPTIONS:
        default = "" if opt.default in (None, "") else f" (default: {opt.default})"
        kwargs: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS}
        if opt.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif opt.repeat:
            kwargs["action"] = "append"
            kwargs["metavar"] = opt.metavar
        else:
            kwargs["metavar"] = opt.metavar or opt.kind.__name__.upper()
        parser.add_argument(opt.flag, help=opt.help + default, **kwargs)
    return parser


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _from_text(opt: Option, text: str) -> Value:
    """An env var or flag string as the option's type; ValueError says what was expected."""
    if opt.repeat:
        return (text,)
    if opt.auto and text.strip().lower() == AUTO:
        return AUTO
    if opt.kind is bool:
        word = text.strip().lower()
        if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"expected true or false, got {text!r}")
        return word in ("1", "true", "yes", "on")
    if opt.kind is int:
        try:
            return int(text)
        except ValueError:
            expected = "an integer or auto" if opt.auto else "an integer"
            raise ValueError(f"expected {expected}, got {text!r}") from None
    if opt.kind is float:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise ValueError(f"expected a number, got {text!r}")
        return number
    return text


def _from_toml(opt: Option, raw: object) -> Value:
    """A TOML value as the option's type: no strings for numbers, ints are fine for floats."""
    if opt.repeat and isinstance(raw, list) and all(isinstance(item, str) for item in raw):
        return tuple(raw)
    if opt.repeat and isinstance(raw, str):
        return (raw,)
    if opt.auto and raw == AUTO:
        return AUTO
    same_boolness = isinstance(raw, bool) == (opt.kind is bool)
    if same_boolness and opt.kind is float and isinstance(raw, int | float) and math.isfinite(raw):
        return float(raw)
    if same_boolness and isinstance(raw, opt.kind):
        return raw
    hint = "; the config file takes flat keys, not [sections]" if isinstance(raw, dict) else ""
    got = _TOML_NAMES.get(type(raw), type(raw).__name__)
    expected = _KIND_NAMES[opt.kind] + (' or "auto"' if opt.auto else "")
    expected += " or an array of strings" if opt.repeat else ""
    raise ValueError(f"expected {expected}, got {got}{hint}")


_KIND_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
_TOML_NAMES = {dict: "a table", list: "an array", str: "a string", bool: "a boolean"}


def _lookup(key: str) -> tuple[Option, bool] | None:
    """The option a TOML key or lower-cased env suffix names; True for a no_<bool> negation."""
    key = _current(key)
    if key in BY_NAME:
        return BY_NAME[key], False
    negated = BY_NAME.get(key.removeprefix("no_")) if key.startswith("no_") else None
    return (negated, True) if negated is not None and negated.kind is bool else None


def _current(key: str) -> str:
    """A key (or no_key) with a renamed option's old name given its current name."""
    negation = "no_" if key.startswith("no_") else ""
    return negation + RENAMED.get(key.removeprefix(negation), key.removeprefix(negation))


def _read_layer(
    items: Mapping[str, object],
    spell: Callable[[str], str],
    label: Callable[[str], str],
    convert: Callable[[Option, Any], Value],
    notes: list[str],
) -> dict[str, Resolved]:
    """Env vars (keyed by lower-cased suffix) or TOML keys -> typed values. spell(key) is the
    name as the user writes it, label(key) the source for messages; a renamed option's old name
    adds a deprecation line to `notes`."""
    out: dict[str, Resolved] = {}
    for key, raw in items.items():
        if _current(key) != key and _lookup(key) is not None:
            notes.append(f"{label(key)} is deprecated: use {spell(_current(key))}")
        found = _lookup(key)
        if found is None:
            close = difflib.get_close_matches(key, BY_NAME, n=1)
            hint = f" (did you mean {spell(close[0])}?)" if close else ""
            raise ConfigError(f"unknown option: {label(key)}{hint}")
        opt, negated = found
        source = label(key)
        try:
            value = convert(opt, raw)
        except ValueError as exc:
            raise ConfigError(f"{opt.flag} ({source}): {exc}") from None
        out[opt.name] = Resolved(not value if negated else value, source)
    return out


def _env_layer(environ: Mapping[str, str], notes: list[str]) -> dict[str, Resolved]:
    items = {
        name.removeprefix(ENV_PREFIX).lower(): text
        for name, text in environ.items()
        if name.startswith(ENV_PREFIX) and name not in CLIENT_ENV and text != ""
    }
    return _read_layer(items, _env_name, lambda key: f"env {_env_name(key)}", _from_text, notes)


def _env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _file_layer(path: Path, via: str, notes: list[str]) -> dict[str, Resolved]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file {path} ({via}): {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} ({via}): invalid TOML: {exc}") from None
    label = f"config file {path}, key "
    layer = _read_layer(data, str, lambda key: label + key, _from_toml, notes)
    for name in PATH_OPTIONS:
        given = layer.get(name)
        if given is None or not given.value:
            continue
        # Relative to the file, so a config file and its files can move together.
        if isinstance(given.value, tuple):
            entries = tuple(_beside(path.parent, entry) for entry in given.value)
            layer[name] = Resolved(entries, given.source)
        else:
            layer[name] = Resolved(
                str(path.parent / Path(str(given.value)).expanduser()), given.source
            )
    return layer


def _beside(base: Path, entry: str) -> str:
    """A model entry of a config file with its path made relative to the file: NAME=PATH and
    paths are; a bare model name stays a name."""
    name, sep, model_path = entry.partition("=")
    if sep:
        return f"{name}={base / Path(model_path).expanduser()}"
    if catalog.looks_like_path(entry) or (base / entry).is_file():
        return str(base / Path(entry).expanduser())
    return entry


def _flag_layer(args: argparse.Namespace, notes: list[str]) -> dict[str, Resolved]:
    out: dict[str, Resolved] = {}
    for old, new in RENAMED.items():
        if old in vars(args):
            given = getattr(args, old)
            prefix = "--" if given else "--no-"
            notes.append(
                f"{prefix}{_dashed(old)} is deprecated: use {prefix}{_dashed(new)} (command line)"
            )
            if new not in vars(args):  # the current name wins when both are given
                setattr(args, new, given)
    for opt in OPTIONS:
        if opt.name not in vars(args):
            continue
        raw = getattr(args, opt.name)
        if opt.repeat:
            out[opt.name] = Resolved(tuple(raw), "command line")
            continue
        try:
            value = raw if opt.kind is bool else _from_text(opt, raw)
        except ValueError as exc:
            raise ConfigError(f"{opt.flag} (command line): {exc}") from None
        out[opt.name] = Resolved(value, "command line")
    return out


def _config_path(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[Path, str] | None:
    if args.config is not None:
        return Path(args.config).expanduser(), "--config"
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV]).expanduser(), f"env {CONFIG_ENV}"
    return None


def _fit_defaults(values: dict[str, Resolved]) -> None:
    """Shrink defaulted batch sizes to a smaller configured n_ctx / n_batch instead of failing."""
    for small, large in _AT_MOST:
        low, high = values[small], values[large]
        if low.source == "default" and isinstance(high.value, int):
            values[small] = Resolved(min(_int(low.value), high.value), "default")


def _int(value: Value) -> int:
    return value if isinstance(value, int) else 0


# (option, option it may not exceed)
_AT_MOST = (("n_batch", "n_ctx"), ("n_ubatch", "n_batch"), ("ngram_min", "ngram_max"))


def _check(values: Mapping[str, Resolved]) -> None:
    """Each option's own check, then the relations between options."""
    for opt in OPTIONS:
        got = values[opt.name]
        problem = opt.check(got.value) if opt.check else None
        if problem:  # a repeated option's problem names its entry
            given = opt.flag if opt.repeat else f"{opt.flag}={got.value!r}"
            raise ConfigError(f"{given} ({got.source}): {problem}")
    for small, large in _AT_MOST:
        low, high = values[small], values[large]
        if isinstance(low.value, int) and isinstance(high.value, int) and low.value > high.value:
            raise ConfigError(
                f"{BY_NAME[small].flag}={low.value} ({low.source}): must be <= "
                f"{BY_NAME[large].flag}={high.value} ({high.source})"
            )
    cert, key, client_ca = values["tls_cert"], values["tls_key"], values["tls_client_ca"]
    if bool(cert.value) != bool(key.value):
        given, missing = ("--tls-cert", "--tls-key") if cert.value else ("--tls-key", "--tls-cert")
        raise ConfigError(f"{given} needs {missing} too")
    if client_ca.value and not cert.value:
        raise ConfigError(f"--tls-client-ca ({client_ca.source}) needs --tls-cert and --tls-key")
    host, tokens, insecure = (
        values["host"],
        values["auth_tokens_file"],
        values["allow_insecure_tokens"],
    )
    problem = plaintext_tokens_problem(
        str(host.value),
        has_tls=bool(cert.value),
        has_tokens=bool(tokens.value),
        allow_insecure=bool(insecure.value),
    )
    if problem:
        raise ConfigError(f"{problem} (--host: {host.source}; --auth-tokens-file: {tokens.source})")
    port, metrics = values["port"], values["metrics_port"]
    if metrics.value and metrics.value == port.value:
        raise ConfigError(f"--metrics-port={metrics.value} ({metrics.source}): same as --port")


def _tenant_limits(values: Mapping[str, Resolved]) -> Mapping[str, TenantLimits]:
    """Read the tokens file now, so a broken one stops the server at start (exit code 2); its
    tenants' limits go to the scheduler (tokens are read again by the server, and on SIGHUP)."""
    given = values["auth_tokens_file"]
    if not given.value:
        return {}
    try:
        return load_auth_file(Path(str(given.value))).limits
    except AuthFileError as exc:
        raise ConfigError(f"--auth-tokens-file ({given.source}): {exc}") from None


def _build(values: Mapping[str, Resolved]) -> Settings:
    # Values are heterogeneous; the option table types them, so Any is confined to this dict.
    sections: dict[str, dict[str, Any]] = {
        "model": {},
        "scheduler": {},
        "server": {},
        "sampling": {},
        "pool": {},
    }
    for opt in OPTIONS:
        if not opt.repeat:
            section, field = opt.target.split(".")
            sections[section][field] = values[opt.name].value
    (name, path), others = _served_models(values)
    raw_loras = values["lora"].value
    loras = tuple(parse_lora(e) for e in raw_loras) if isinstance(raw_loras, tuple) else ()
    served = {name or _stem(path), *(n for n, _ in others)}
    for lora in loras:
        if lora.model and lora.model not in served:
            raise ConfigError(
                f"--lora {lora.model}/{lora.name} ({values['lora'].source}): no served model is "
                f"named {lora.model!r} (served: {', '.join(sorted(served))})"
            )
    engine_lora = values["engine_lora"]
    if engine_lora.value:
        default = name or _stem(path)
        adapter = parse_engine_lora(str(engine_lora.value))[0]
        own = sorted(lora.name for lora in loras if lora.model in ("", default))
        if adapter not in own:
            raise ConfigError(
                f"--engine-lora {engine_lora.value} ({engine_lora.source}): {adapter!r} is not a "
                f"--lora adapter of the default model {default!r} (its adapters: "
                f"{', '.join(own) or 'none'})"
            )
    sections["model"] |= {"model_path": path, "model_name": name, "loras": loras}
    sections["pool"]["models"] = others
    sampling = sections["sampling"]
    sampling["seed"] = None if sampling["seed"] == -1 else sampling["seed"]
    return Settings(
        model=ModelSettings(**sections["model"]),
        scheduler=SchedulerSettings(
            **sections["scheduler"],
            default_sampling=SamplingParams(**sampling),
            tenant_limits=_tenant_limits(values),
        ),
        server=ServerSettings(**sections["server"]),
        pool=PoolSettings(**sections["pool"]),
    )


NamedPath = tuple[str, str]  # (name, path); name "" = the file stem, path "" = embedded


def _served_models(values: Mapping[str, Resolved]) -> tuple[NamedPath, tuple[NamedPath, ...]]:
    """The default model ("" for the name given by --model-name or the file stem) and the
    others, named: the --model entries in order, then --models-dir's models (catalog.toml
    names, then *.gguf files by stem) under names not taken yet. The embedded model is served
    when no --model is given, or when one names it."""
    given, name_flag = values["model"], values["model_name"]
    raw = given.value
    entries = raw if isinstance(raw, tuple) else ((str(raw),) if raw else ())
    directory = values["models_dir"].value
    models_dir = Path(str(directory)) if directory else None
    try:
        named = [_named(entry, models_dir) for entry in entries]
        listed = catalog.list_models(models_dir)[1:] if models_dir else []
    except catalog.CatalogError as exc:
        raise ConfigError(f"--model ({given.source}): {exc}") from None
    default = named[0] if named else ("", "")
    if default[0] and name_flag.value and default[0] != name_flag.value:
        raise ConfigError(
            f"--model-name={name_flag.value!r} ({name_flag.source}): the default model is "
            f"already named {default[0]!r} by --model ({given.source})"
        )
    default_name = default[0] or str(name_flag.value or "")
    others = [(n or Path(p).stem, p) for n, p in named[1:]]
    taken = {default_name or _stem(default[1])}
    for model_name, _ in others:
        if model_name in taken:
            raise ConfigError(f"--model ({given.source}): two models are named {model_name!r}")
        taken.add(model_name)
    others += [(e.name, str(e.path)) for e in listed if e.name not in taken]
    return (default_name, default[1]), tuple(others)


def _named(entry: str, models_dir: Path | None) -> NamedPath:
    """One --model entry as (name, path): NAME=PATH, a path (name "": its stem), or a name
    looked up in the catalog (CatalogError lists the known names)."""
    name, sep, path = entry.partition("=")
    if sep:
        return name, path
    if catalog.looks_like_path(entry) or Path(entry).is_file():
        return "", entry
    found = catalog.lookup(entry, models_dir)
    return found.name, str(found.path)


def _stem(path: str) -> str:
    return Path(path).stem if path else DEFAULT_MODEL_NAME


def load_settings(
    argv: Sequence[str], environ: Mapping[str, str], notes: list[str] | None = None
) -> Settings:
    """Settings from defaults < config file < env < flags. Reads the config file and checks the
    model file exists; changes nothing. Raises ConfigError, or HelpRequested for -h/--help.
    A deprecated option name adds a line to `notes` (main logs them once logging is set up)."""
    notes = [] if notes is None else notes
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.help:
        raise HelpRequested(parser.format_help())
    values = {opt.name: Resolved(opt.default, "default") for opt in OPTIONS}
    config = _config_path(args, environ)
    if config is not None:
        values.update(_file_layer(*config, notes))
    values.update(_env_layer(environ, notes))
    values.update(_flag_layer(args, notes))
    _fit_defaults(values)
    _check(values)
    settings = _build(values)
    endpoint = tracing.endpoint_from(settings.server.otlp_endpoint, environ)
    return dataclasses.replace(
        settings, server=dataclasses.replace(settings.server, otlp_endpoint=endpoint)
    )
