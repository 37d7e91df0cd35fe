"""The option table of `llama-grpc serve`: each setting's flag, env var, TOML key, type, check
and help, in one place. Defaults are read off the settings dataclasses (config/settings.py), so
a default exists once; config/loading.py reads the sources, tools/options_doc.py writes
docs/options.md from this table."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llama_grpc_server.config.settings import (
    AUTO,
    ModelSettings,
    PoolSettings,
    SchedulerSettings,
    ServerSettings,
    parse_engine_lora,
    parse_lora,
)
from llama_grpc_server.core import adapters
from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES
from llama_grpc_server.core.requests.request import (
    MAX_DRAFT_TOKENS,
    MAX_NGRAM,
    SamplingParams,
    SpeculativeMode,
)
from llama_grpc_server.core.scheduling.strategies import load_strategy
from llama_grpc_server.models import catalog

PROG = "llama-grpc serve"
ENV_PREFIX = "LLAMA_GRPC_"
CONFIG_ENV = "LLAMA_GRPC_CONFIG"
# Not serve options: the config file and the client's target. (LLAMA_GRPC_MODELS_DIR is both
# `llama-grpc models`' directory and serve's --models-dir.)
CLIENT_ENV = frozenset({CONFIG_ENV, "LLAMA_GRPC_TARGET"})
LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
SPECULATIVE_MODES = tuple(mode.value for mode in SpeculativeMode)
OVERLAP_MODES = ("auto", "on", "off")

Value = str | int | float | bool | tuple[str, ...] | None
Check = Callable[[Value], str | None]  # the problem with a value, or None when it is fine


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


def zero_or(check: Check) -> Check:
    """`check`, but 0 is fine too (an option whose 0 means off)."""

    def either(v: Value) -> str | None:
        problem = None if v == 0 else check(v)
        return None if problem is None else f"must be 0 or {problem.removeprefix('must be ')}"

    return either


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


def _lora_entries(v: Value) -> str | None:
    """Each --lora entry parses, names an adapter well and points at a file."""
    for entry in v if isinstance(v, tuple) else ((str(v),) if v else ()):
        try:
            spec = parse_lora(entry)
        except ValueError as exc:
            return f"{entry!r}: {exc}"
        if not adapters.NAME.fullmatch(spec.name):
            return f"{entry!r}: an adapter name is 1-64 letters, digits, '.', '_' or '-'"
        if not Path(spec.path).is_file():
            return f"{entry!r}: no such file"
        if not math.isfinite(spec.scale) or abs(spec.scale) > adapters.MAX_SCALE:
            return f"{entry!r}: the scale must be within [-16, 16]"
    return None


def _engine_lora(v: Value) -> str | None:
    """--engine-lora: an adapter name and, if given, a scale that is not the base model's 0."""
    if not v:
        return None
    try:
        name, scale = parse_engine_lora(str(v))
    except ValueError as exc:
        return str(exc)
    if not adapters.NAME.fullmatch(name):
        return "an adapter name is 1-64 letters, digits, '.', '_' or '-'"
    if scale is not None and not (math.isfinite(scale) and 0 < abs(scale) <= adapters.MAX_SCALE):
        return "the scale must be within [-16, 16] and not 0 (0 is the base model)"
    return None


def _draft_model(v: Value) -> str | None:
    """--draft-model: a file, or a name (resolved when the engine is built)."""
    entry = str(v or "")
    if not entry:
        return None
    if catalog.looks_like_path(entry):
        return None if Path(entry).expanduser().is_file() else "no such file"
    return _name_problem(entry)


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
        """The default of the config/settings.py field this option sets."""
        section, field = self.target.split(".")
        value: Value = getattr(_DEFAULTS[section], field)
        return value


OPTIONS: tuple[Option, ...] = (
    Option("model", str, "model.model_path",
           "a GGUF file, NAME=PATH, or a model name of --models-dir; repeat it to serve several "
           "models (requests pick one by name): the first is the default (default: embedded "
           "Gemma 3 270M)", _model_entries, "[NAME=]PATH", repeat=True),
    Option("lora", str, "model.loras",
           "a LoRA adapter GGUF that requests may apply by NAME (params.lora), loaded at start "
           "and checked against its model; SCALE is the scale of a request naming no scale "
           "(default 1); MODEL/ loads it for another served model; repeat it for several",
           _lora_entries, "[MODEL/]NAME=PATH[:SCALE]", repeat=True),
    Option("engine_lora", str, "model.engine_lora",
           "apply the default model's --lora adapter NAME (at SCALE, default its own) to every "
           "request of the vLLM engine protocol, which has no LoRA field: the replica tells the "
           "gateway (GetModelInfo) it serves model MODEL+NAME, so SMG routes that name to it; "
           "v1 requests are unchanged", _engine_lora, "NAME[:SCALE]"),
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
    Option("batch_invariant", bool, "model.batch_invariant",
           "batch-invariant CPU numerics: a greedy answer no longer depends on the requests "
           "decoded beside it, the chunks its prompt is fed in, its prefix's cache state or the "
           "thread count (no repacked weights, no tiled matmul, micro-batches of 32, never a "
           "one-row micro-batch); measured on the embedded model: 1.3-1.5x the CPU per prompt "
           "token, 1.06-1.2x per token of one stream, ~1.05x of 4 (docs/batch-invariance.md). "
           "Tokens placed in KV cells freed below a stream's earlier ones (another request's "
           "cells removed while it runs) can still change it"),
    Option("chunk_size", int, "scheduler.chunk_size",
           "prompt tokens one slot may take in a pass (0 = the whole pass, --n-batch: prompts "
           "take the pass shortest remaining first, the oldest among equals)", at_least(0)),
    Option("prefill_stall", float, "scheduler.prefill_stall",
           "decode_maximal: while slots generate, a pass carrying prompt tokens lasts about this "
           "many decode-only passes at most (2: streams' inter-token gaps at most ~2x while a "
           "prompt arrives; larger: prompts in bigger, cheaper chunks and sooner first tokens, "
           "longer gaps meanwhile; 0: no bound, the most tokens per second)",
           zero_or(between(1.25, 64)), "X"),
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
    Option("log_format", str, "server.log_format",
           "auto (human-readable lines when the log stream, stderr, is a terminal, else JSON "
           "lines) | json | console", one_of(*LOG_FORMATS), "FORMAT"),
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
           "after --grace-s (auto = 10x the tick's forward pass at the measured cost of a "
           "token, at least 5; before a pass of its kind is timed, 10x a whole --n-batch of "
           "prompt tokens at the warm-up's cost, at least 30; 0 = off)", or_auto(at_least(0)),
           "S|auto", auto=True),
    Option("cache_prompt", bool, "scheduler.cache_prompt", "reuse KV of a cached prefix"),
    Option("pad_decode_batches", bool, "scheduler.pad_decode_batches",
           "pad a decode-only pass with up to 3 rows that are never sampled when the measured "
           "costs say the larger batch is cheaper (llama.cpp's CPU output matmul makes some row "
           "counts dearer than larger ones; was --pad-odd-ticks)"),
    Option("overlap_decode", str, "scheduler.overlap_decode",
           "deliver each tick's tokens while the next forward pass runs on the GPU: on | off | "
           "auto (on when layers are offloaded to a GPU)", one_of(*OVERLAP_MODES), "MODE"),
    Option("prompt_cache_ram_mb", int, "scheduler.prompt_cache_ram_mb",
           "RAM tier: MiB of saved slot caches kept after eviction, per loaded model (-1 = auto: "
           "a quarter of the memory available at start shared among the models that may be "
           "resident at once, at most 8192 each; 0 = off)", at_least(-1)),
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
    Option("reasoning_budget", int, "scheduler.reasoning_budget",
           "thinking tokens a thinking model may write before the end of its thinking is forced "
           "(requests may set their own): -1 no limit, 0 no thinking", at_least(-1)),
    Option("reasoning_budget_message", str, "scheduler.reasoning_budget_message",
           "text forced before the end of a thinking section the budget cut short (e.g. "
           "\"Time is up: answering now.\")"),
    Option("speculative", str, "scheduler.speculative",
           "speculative decoding of requests that do not choose: off | auto (draft when the "
           "measured tick costs and the request's acceptance say it pays: by prompt lookup, or by "
           "the --draft-model) | on (draft every tick: with the --draft-model, else by lookup)",
           one_of(*SPECULATIVE_MODES), "MODE"),
    Option("draft_model", str, "model.draft_model",
           "a draft model for speculative decoding of the default model (a GGUF file or a model "
           "name: --models-dir's or a trained one): its own context beside the target's, its "
           "vocabulary checked at start; with it --speculative on drafts with it, auto picks "
           "per request between it, prompt lookup and nothing from measured acceptance and costs",
           _draft_model, "PATH|NAME"),
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
# Old names of renamed options (flag, env var and config key), still read: each use gives one
# deprecation line (config/loading.py) so that existing deployments keep starting.
RENAMED: dict[str, str] = {"pad_odd_ticks": "pad_decode_batches"}
PATH_OPTIONS = (
    "model",
    "models_dir",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "auth_tokens_file",
    "kv_cache_dir",
)
