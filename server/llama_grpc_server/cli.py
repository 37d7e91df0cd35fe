"""`llama-grpc serve`: argv + LLAMA_GRPC_* env + a TOML config file -> frozen Settings -> serve().
The only reader of os.environ in the server; engine and rpc are imported lazily, after parsing."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import math
import os
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from llama_grpc_server import catalog, telemetry, tracing
from llama_grpc_server.auth import AuthFileError, load_auth_file, plaintext_tokens_problem
from llama_grpc_server.config import (
    AUTO,
    ModelSettings,
    PoolSettings,
    SchedulerSettings,
    ServerSettings,
    Settings,
)
from llama_grpc_server.core.api import EngineApi
from llama_grpc_server.core.chat import BUILTIN_TEMPLATES
from llama_grpc_server.core.request import (
    MAX_DRAFT_TOKENS,
    MAX_NGRAM,
    SamplingParams,
    SpeculativeMode,
)
from llama_grpc_server.core.strategies import load_strategy
from llama_grpc_server.core.tenants import TenantLimits
from llama_grpc_server.model_files import DEFAULT_MODEL_NAME
from llama_grpc_server.telemetry import configure_logging

PROG = "llama-grpc serve"
ENV_PREFIX = "LLAMA_GRPC_"
CONFIG_ENV = "LLAMA_GRPC_CONFIG"
# Not serve options: the config file and the client's target. (LLAMA_GRPC_MODELS_DIR is both
# `llama-grpc models`' directory and serve's --models-dir.)
CLIENT_ENV = frozenset({CONFIG_ENV, "LLAMA_GRPC_TARGET"})
LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
SPECULATIVE_MODES = tuple(mode.value for mode in SpeculativeMode)
OVERLAP_MODES = ("auto", "on", "off")

Value = str | int | float | bool | tuple[str, ...] | None
Check = Callable[[Value], str | None]  # the problem with a value, or None when it is fine


class ConfigError(Exception):
    """An option is unknown or invalid; the message names the option and where it came from."""


class HelpRequested(Exception):
    """-h/--help was given; `text` is the help to print."""

    def __init__(self, text: str) -> None:
        super().__init__("help requested")
        self.text = text


def at_least(low: float) -> Check:
    def check(v: Value) -> str | None:
        ok = v is None or (isinstance(v, int | float) and v >= low)
        return None if ok else f"must be >= {low:g}"

    return check


def between(low: float, high: float) -> Check:
    def check(v: Value) -> str | None:
        ok = v is None or (isinstance(v, int | float) and low <= v <= high)
        return None if ok else f"must be between {low:g} and {high:g}"

    return check


def one_of(*choices: str) -> Check:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def or_auto(check: Check) -> Check:
    """`check`, but the word auto is fine too (an option with auto=True)."""
    return lambda v: None if v == AUTO else check(v)


def _is_file(v: Value) -> str | None:
    return None if v == "" or Path(str(v)).is_file() else "no such file"


def _is_dir(v: Value) -> str | None:
    return None if v == "" or Path(str(v)).is_dir() else "no such directory"


def _model_entries(v: Value) -> str | None:
    """Each --model entry: NAME=PATH, a path to a file, or a model name (resolved later, with
    --models-dir)."""
    for entry in v if isinstance(v, tuple) else ((str(v),) if v else ()):
        name, sep, path = entry.partition("=")
        if not sep and (catalog.looks_like_path(entry) or Path(entry).is_file()):
            name, path = "", entry
        elif not sep:
            name, path = entry, ""
        problem = _name_problem(name) if name else None
        if problem is None and path and not Path(path).is_file():
            problem = "no such file"
        if problem is not None:
            return f"{entry!r}: {problem}"
    return None


def _name_problem(name: str) -> str | None:
    try:
        catalog.check_name(name)
    except catalog.CatalogError as exc:
        return str(exc)
    return None


def _non_empty(v: Value) -> str | None:
    return None if v else "must not be empty"


def _chat_template(v: Value) -> str | None:
    return None if v == "" else one_of(*BUILTIN_TEMPLATES)(v)


def _loads_strategy(v: Value) -> str | None:
    try:
        load_strategy(str(v))
    except Exception as exc:  # a module:attr strategy may raise anything on import
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


# Where each option's default comes from: the config dataclasses, so a default exists once.
_DEFAULTS: dict[str, object] = {
    "model": ModelSettings(),
    "scheduler": SchedulerSettings(),
    "server": ServerSettings(),
    "sampling": SamplingParams(),
    "pool": PoolSettings(),
}


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: flag --name-with-dashes, env LLAMA_GRPC_NAME, TOML key name."""

    name: str
    kind: type[str | int | float | bool]
    target: str  # "section.field"; section "sampling" is scheduler.default_sampling
    help: str
    check: Check | None = None
    metavar: str = ""
    auto: bool = False  # also takes the word "auto" (kept as the string "auto")
    # Given several times (flags), or as a TOML array; the value is then a tuple of strings
    # (env: one entry). _build turns it into its field(s).
    repeat: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def default(self) -> Value:
        """The default of the config.py field this option sets."""
        section, field = self.target.split(".")
        value: Value = getattr(_DEFAULTS[section], field)
        return value


OPTIONS: tuple[Option, ...] = (
    Option("model", str, "model.model_path",
           "a GGUF file, NAME=PATH, or a model name of --models-dir; repeat it to serve several "
           "models (requests pick one by name): the first is the default (default: embedded "
           "Gemma 3 270M)", _model_entries, "[NAME=]PATH", repeat=True),
    Option("model_name", str, "model.model_name",
           "name of the default model shown to clients (default: file stem)", metavar="NAME"),
    Option("models_dir", str, "pool.models_dir",
           "serve this directory's models too: its *.gguf files (named by file stem) and the "
           "names of its catalog.toml (llama-grpc models add); models added later are found "
           "without a restart", _is_dir, "DIR"),
    Option("max_loaded_models", int, "pool.max_loaded_models",
           "models resident at once: a request for another loads it, unloading the least "
           "recently used idle one (0 = no limit)", at_least(0), "N"),
    Option("max_loaded_bytes", int, "pool.max_loaded_bytes",
           "bound on the summed file sizes of the resident models (0 = no limit)",
           at_least(0), "BYTES"),
    Option("host", str, "server.host", "address to listen on", _non_empty, "HOST"),
    Option("port", int, "server.port", "gRPC port (0 = any free port)", between(0, 65535)),
    Option("n_ctx", int, "model.n_ctx", "KV cache tokens, shared by all slots", at_least(1)),
    Option("n_parallel", int, "scheduler.n_parallel", "slots decoded together",
           between(1, 256)),
    Option("n_batch", int, "model.n_batch", "tokens per forward pass (<= n_ctx)",
           at_least(1)),
    Option("n_ubatch", int, "model.n_ubatch", "physical micro-batch (<= n_batch)",
           at_least(1)),
    Option("chunk_size", int, "scheduler.chunk_size", "prompt tokens per slot per tick",
           at_least(1)),
    Option("threads", int, "model.n_threads", "generation threads (0 = all CPUs)", at_least(0)),
    Option("threads_batch", int, "model.n_threads_batch", "prompt threads (0 = --threads)",
           at_least(0)),
    Option("n_gpu_layers", int, "model.n_gpu_layers",
           "layers offloaded to the GPU (-1 = all; auto = all if this llama.cpp build has a GPU "
           "backend and the GPUs have room for the model, else 0)", or_auto(at_least(-1)),
           "N|auto", auto=True),
    Option("chat_template", str, "model.chat_template",
           "template for chat messages: " + " | ".join(BUILTIN_TEMPLATES)
           + " (default: the model's own, if it has one)", _chat_template, "NAME"),
    Option("max_queue", int, "scheduler.max_queue", "waiting requests (0 = unbounded)",
           at_least(0)),
    Option("admission_window_ms", float, "scheduler.admission_window_ms",
           "when idle, wait until arrivals pause this long (5x at most) so a burst starts as "
           "one batch (0 = off)", between(0, 1000), "MS"),
    Option("batch_strategy", str, "scheduler.batch_strategy",
           "decode_maximal | prefill_priority | balanced | module:attr", _loads_strategy, "NAME"),
    Option("metrics_port", int, "server.metrics_port", "Prometheus port (0 = off)",
           between(0, 65535)),
    Option("log_format", str, "server.log_format", " | ".join(LOG_FORMATS),
           one_of(*LOG_FORMATS), "FORMAT"),
    Option("log_level", str, "server.log_level", " | ".join(LOG_LEVELS),
           one_of(*LOG_LEVELS), "LEVEL"),
    Option("log_payloads", bool, "server.log_payloads",
           "log request and response messages (debugging: prompts and completions in logs)"),
    Option("tls_cert", str, "server.tls_cert", "PEM certificate chain: serve TLS (with --tls-key)",
           _is_file, "PATH"),
    Option("tls_key", str, "server.tls_key", "PEM private key of --tls-cert", _is_file, "PATH"),
    Option("tls_client_ca", str, "server.tls_client_ca",
           "PEM CA bundle: require client certificates signed by it (mTLS); the certificate's "
           "URI SAN (e.g. a SPIFFE id) or CN is the caller's identity", _is_file, "PATH"),
    Option("auth_tokens_file", str, "server.auth_tokens_file",
           "TOML file of bearer tokens / certificate subjects, each with a tenant and a role "
           "(user | admin), and per-tenant limits; reloaded on SIGHUP", _is_file, "PATH"),
    Option("allow_insecure_tokens", bool, "server.allow_insecure_tokens",
           "accept --auth-tokens-file on a plaintext (no TLS) listener that is not loopback; "
           "without it such a server refuses to start, since the bearer tokens would cross the "
           "network in clear (for TLS ended by a proxy in front)"),
    Option("reflection", bool, "server.reflection", "serve gRPC reflection (for grpcurl)"),
    Option("otlp_endpoint", str, "server.otlp_endpoint",
           "OpenTelemetry traces over OTLP/HTTP to this URL, e.g. http://collector:4318 (default: "
           "OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT if set, else tracing off)", metavar="URL"),
    Option("grace_s", float, "server.grace_s", "seconds to finish requests on shutdown",
           at_least(0)),
    Option("drain_delay_s", float, "server.drain_delay_s",
           "on SIGTERM, report NOT_SERVING this long before refusing new calls, so a proxy "
           "routes elsewhere first (>= its health-check interval)", at_least(0), "S"),
    Option("keep_alive_on_engine_error", bool, "server.keep_alive_on_engine_error",
           "if the engine thread dies, keep the process up (health NOT_SERVING) instead of "
           "exiting with code 70 after --grace-s"),
    Option("watchdog_s", float, "scheduler.watchdog_s",
           "a tick running longer than this means the engine hung: health NOT_SERVING, every "
           "caller UNAVAILABLE (reason ENGINE_HUNG), the engine thread's stack logged, exit 71 "
           "after --grace-s (auto = 10x a whole --n-batch of prompt tokens at the warm-up's "
           "measured cost, at least 30; 0 = off)", or_auto(at_least(0)), "S|auto", auto=True),
    Option("cache_prompt", bool, "scheduler.cache_prompt", "reuse KV of a cached prefix"),
    Option("pad_odd_ticks", bool, "scheduler.pad_odd_ticks",
           "add a row, never sampled, to a decode pass of an odd number of rows when the "
           "measured costs say it is cheaper (on CPUs where llama.cpp's output matmul is)"),
    Option("overlap_decode", str, "scheduler.overlap_decode",
           "deliver each tick's tokens while the next forward pass runs on the GPU: on | off | "
           "auto (on when layers are offloaded to a GPU)", one_of(*OVERLAP_MODES), "MODE"),
    Option("prompt_cache_ram_mb", int, "scheduler.prompt_cache_ram_mb",
           "RAM tier: MiB of saved slot caches kept after eviction, per loaded model (-1 = auto: "
           "a quarter of the memory available at start, at most 8192; 0 = off)", at_least(-1)),
    Option("kv_cache_dir", str, "scheduler.kv_cache_dir",
           "disk tier: save slot caches here (evicted ones, idle sessions, all idle ones at "
           "shutdown) and restore them by longest token prefix, also after a restart or from "
           "another replica sharing the directory (\"\" = off)", metavar="DIR"),
    Option("kv_cache_disk_mb", int, "scheduler.kv_cache_disk_mb",
           "disk tier: MiB the directory may hold; least recently used files go first",
           at_least(1)),
    Option("session_live_s", float, "scheduler.session_live_s",
           "an idle session's history keeps its slot over other requests this long: a new "
           "request takes a free slot and copies the shared prefix instead (0 = for ever)",
           at_least(0), "S"),
    Option("session_idle_s", float, "scheduler.session_idle_s",
           "disk tier: save an idle slot's cache after this many seconds without use "
           "(0 = only on eviction and shutdown)", at_least(0), "S"),
    Option("stream_buffer_tokens", int, "scheduler.stream_buffer_tokens",
           "back-pressure: a request stops decoding while its caller has this many generated "
           "tokens unread, and resumes when it reads (0 = unbounded)", at_least(0), "N"),
    Option("stalled_reader_s", float, "scheduler.stalled_reader_s",
           "back-pressure: end a request with RESOURCE_EXHAUSTED (STALLED_READER) when its "
           "caller reads nothing this long with the buffer full (0 = never)", at_least(0), "S"),
    Option("response_cache_mb", int, "scheduler.response_cache_mb",
           "exact response cache: MiB of whole results of greedy or seeded requests, replayed "
           "for identical ones without the engine (0 = off)", at_least(0)),
    Option("default_max_tokens", int, "scheduler.default_max_tokens",
           "max_tokens when a request sets none", at_least(1)),
    Option("speculative", str, "scheduler.speculative",
           "prompt-lookup speculative decoding of requests that do not choose: off | auto (draft "
           "when the measured tick costs and the request's acceptance say it pays) | on",
           one_of(*SPECULATIVE_MODES), "MODE"),
    Option("draft_max", int, "scheduler.draft_max",
           "speculative decoding: draft tokens per step at most", between(1, MAX_DRAFT_TOKENS)),
    Option("ngram_min", int, "scheduler.ngram_min",
           "speculative decoding: shortest suffix matched in the prompt and output",
           between(1, MAX_NGRAM)),
    Option("ngram_max", int, "scheduler.ngram_max",
           "speculative decoding: longest suffix matched (tried first)", between(1, MAX_NGRAM)),
    Option("temperature", float, "sampling.temperature", "default temperature (0 = greedy)",
           at_least(0)),
    Option("top_k", int, "sampling.top_k", "default top-k (0 = off)", at_least(0)),
    Option("top_p", float, "sampling.top_p", "default top-p (1 = off)", between(0, 1)),
    Option("min_p", float, "sampling.min_p", "default min-p (0 = off)", between(0, 1)),
    Option("repeat_penalty", float, "sampling.repeat_penalty",
           "default repetition penalty (1 = off)", between(0.01, 100)),
    Option("seed", int, "sampling.seed", "default seed (unset or -1: random per request)",
           between(-1, 2**32 - 1)),
)  # fmt: skip
BY_NAME: dict[str, Option] = {opt.name: opt for opt in OPTIONS}
PATH_OPTIONS = (
    "model",
    "models_dir",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "auth_tokens_file",
    "kv_cache_dir",
)

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
    if key in BY_NAME:
        return BY_NAME[key], False
    negated = BY_NAME.get(key.removeprefix("no_")) if key.startswith("no_") else None
    return (negated, True) if negated is not None and negated.kind is bool else None


def _read_layer(
    items: Mapping[str, object],
    spell: Callable[[str], str],
    label: Callable[[str], str],
    convert: Callable[[Option, Any], Value],
) -> dict[str, Resolved]:
    """Env vars (keyed by lower-cased suffix) or TOML keys -> typed values. spell(key) is the
    name as the user writes it, label(key) the source for messages."""
    out: dict[str, Resolved] = {}
    for key, raw in items.items():
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


def _env_layer(environ: Mapping[str, str]) -> dict[str, Resolved]:
    items = {
        name.removeprefix(ENV_PREFIX).lower(): text
        for name, text in environ.items()
        if name.startswith(ENV_PREFIX) and name not in CLIENT_ENV and text != ""
    }
    return _read_layer(items, _env_name, lambda key: f"env {_env_name(key)}", _from_text)


def _env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _file_layer(path: Path, via: str) -> dict[str, Resolved]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file {path} ({via}): {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} ({via}): invalid TOML: {exc}") from None
    layer = _read_layer(data, str, lambda key: f"config file {path}, key {key}", _from_toml)
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


def _flag_layer(args: argparse.Namespace) -> dict[str, Resolved]:
    out: dict[str, Resolved] = {}
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
    sections["model"] |= {"model_path": path, "model_name": name}
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


def load_settings(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Settings from defaults < config file < env < flags. Reads the config file and checks the
    model file exists; changes nothing. Raises ConfigError, or HelpRequested for -h/--help."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.help:
        raise HelpRequested(parser.format_help())
    values = {opt.name: Resolved(opt.default, "default") for opt in OPTIONS}
    config = _config_path(args, environ)
    if config is not None:
        values.update(_file_layer(*config))
    values.update(_env_layer(environ))
    values.update(_flag_layer(args))
    _fit_defaults(values)
    _check(values)
    settings = _build(values)
    endpoint = tracing.endpoint_from(settings.server.otlp_endpoint, environ)
    return dataclasses.replace(
        settings, server=dataclasses.replace(settings.server, otlp_endpoint=endpoint)
    )


def run(settings: Settings) -> int:
    """Load the default model inside serve() (so health can report NOT_SERVING meanwhile) and
    serve, the other models loading on demand; each engine's telemetry events feed Prometheus
    (--metrics-port) and, at debug, the logs, labelled with its model's name."""
    from llama_grpc_server.engine.build import build_engine
    from llama_grpc_server.metrics import Metrics
    from llama_grpc_server.models import ModelSpec, model_specs, settings_for
    from llama_grpc_server.rpc.server import serve
    from llama_grpc_server.watchdog import EXIT_ENGINE_HUNG

    debug_logs = settings.server.log_level == "debug"
    metrics = Metrics() if settings.server.metrics_port else None
    sinks: list[telemetry.EventSink] = [] if metrics is None else [metrics]
    if debug_logs:
        sinks.append(telemetry.LogSink())
    sink = telemetry.Sinks(*sinks) if sinks else None

    def build(spec: ModelSpec) -> EngineApi:
        events = telemetry.Telemetry(sink=sink, model=spec.name)
        return build_engine(
            settings_for(settings, spec),
            on_tick=events.on_tick,
            on_done=events.on_done,
            debug_logs=debug_logs,
        )

    default = model_specs(settings)[0]
    code = asyncio.run(
        serve(settings, lambda: build(default), model_factory=build, metrics=metrics)
    )
    if code == EXIT_ENGINE_HUNG:
        # A thread is stuck inside llama.cpp: the interpreter's shutdown could wait for it or
        # free the model under it. Nothing is left to clean up that the exit does not.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """`llama-grpc serve [options]`; returns the process exit code (2 for a bad option)."""
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv, os.environ)
    except HelpRequested as help_:
        print(help_.text, end="")
        return 0
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.server.log_format, settings.server.log_level)
    try:
        return run(settings)
    except KeyboardInterrupt:
        return 130
