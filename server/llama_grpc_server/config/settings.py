"""Frozen settings. config/loading.py builds them from argv, LLAMA_GRPC_* env and an optional
TOML file. The defaults here are the only ones: config/options.py reads each option's default
off the field it sets."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from llama_grpc_server.core.requests.request import SamplingParams
from llama_grpc_server.core.scheduling.tenants import TenantLimits

AUTO: Literal["auto"] = "auto"
# Layers to offload: a number (-1 = all), or "auto": all when the build and a GPU allow, else 0
# (resolved when the model loads: engine/offload.py).
GpuLayers = int | Literal["auto"]


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """A --lora entry: an adapter to load at start, for `model` ("" = the default model)."""

    name: str
    path: str
    scale: float = 1.0  # the scale of a request naming it without one
    model: str = ""


def parse_lora(entry: str) -> LoraSpec:
    """`[MODEL/]NAME=PATH[:SCALE]` as a LoraSpec; ValueError says what is wrong."""
    head, sep, rest = entry.partition("=")
    if not sep or not rest:
        raise ValueError("expected [MODEL/]NAME=PATH[:SCALE]")
    model, _, name = head.rpartition("/")
    path, scale = rest, 1.0
    stem, colon, tail = rest.rpartition(":")
    if colon and stem:
        try:
            scale = float(tail)
        except ValueError:
            pass  # a path with a colon in it, and no scale
        else:
            path = stem
    if not name:
        raise ValueError("the adapter needs a name: NAME=PATH")
    return LoraSpec(name, path, scale, model)


def parse_engine_lora(entry: str) -> tuple[str, float | None]:
    """`NAME[:SCALE]` of --engine-lora as (name, scale or None for the adapter's default);
    ValueError says what is wrong."""
    name, colon, tail = entry.partition(":")
    if not name:
        raise ValueError("expected NAME[:SCALE]")
    if not colon:
        return name, None
    try:
        return name, float(tail)
    except ValueError:
        raise ValueError(f"the scale {tail!r} is not a number") from None


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """Which GGUF to load and how; model_path "" means the embedded Gemma 3 270M."""

    model_path: str = ""
    model_name: str = ""
    n_ctx: int = 8192
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = 0  # 0 = every CPU this process may run on (resolved when the model loads)
    n_threads_batch: int = 0  # 0 = n_threads
    n_gpu_layers: GpuLayers = 0
    flash_attn: bool = True
    # A greedy answer that depends on its own tokens alone: not on the requests decoded beside
    # it, the chunks its prompt was fed in, its prefix's cache state or the thread count
    # (engine/llama.py: BATCH_INVARIANT_*; its cost: bench/batch_invariant.py).
    batch_invariant: bool = False
    chat_template: str = ""  # a built-in for messages ("gemma", "chatml"); "" = the model's own
    loras: tuple[LoraSpec, ...] = ()  # LoRA adapters loaded at start (--lora)
    # NAME[:SCALE] (--engine-lora): the --lora adapter every vLLM engine-protocol request applies,
    # the replica then being model `<model_name>+NAME` to the gateway; "" = none
    engine_lora: str = ""
    # A GGUF path or a model name (--draft-model): a draft model for speculative decoding,
    # loaded beside the default model (engine/draft.py); "" = none
    draft_model: str = ""

    def threads(self, cpus: int | None = None) -> tuple[int, int]:
        """(generation, prompt) threads with the 0 defaults resolved; cpus defaults to
        num_cpus()."""
        generation = self.n_threads or (cpus if cpus is not None else num_cpus())
        return generation, self.n_threads_batch or generation


def num_cpus() -> int:
    """CPUs this process may run on (respects affinity / container cpusets where the OS has it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


RAM_TIER_AUTO = -1
RAM_TIER_AUTO_CAP_MB = 8192  # llama-server's --cache-ram default
RAM_TIER_AUTO_SHARE = 4  # auto: a quarter of the memory available at start, at most the cap


def ram_tier_mb(configured: int, available_bytes: int | None = None, engines: int = 1) -> int:
    """One engine's RAM tier in MiB: as configured, or for auto (-1) a quarter of the memory
    available at start (available_bytes, default: available_memory_bytes()) shared among the
    `engines` that may be resident at once (PoolSettings.resident_engines), at most 8 GiB.
    Before the share, every resident model took its own quarter: four resident models could fill
    the machine with KV snapshots."""
    if configured != RAM_TIER_AUTO:
        return configured
    available = available_memory_bytes() if available_bytes is None else available_bytes
    share = available // RAM_TIER_AUTO_SHARE // max(1, engines)
    return min(RAM_TIER_AUTO_CAP_MB, share // (1024 * 1024))


def available_memory_bytes() -> int:
    """Memory available to new allocations without swapping (Linux MemAvailable; elsewhere the
    free physical pages); 0 if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    n_parallel: int = 4
    # prompt tokens one slot may take in a pass; 0 = the whole pass (n_batch): prompts take the
    # budget shortest remaining first (core.scheduling.strategies._prefill_order)
    chunk_size: int = 0
    # decode_maximal: while slots generate, a pass carrying prompt tokens lasts about this many
    # decode-only passes at most (2: the running streams' ITL at most ~2x during a prefill;
    # more: prompts in larger, cheaper chunks, sooner first tokens, longer gaps meanwhile);
    # 0 (the default): no bound (core.scheduling.strategies.DEFAULT_PREFILL_STALL).
    prefill_stall: float = 0.0
    max_queue: int = 64
    batch_strategy: str = "decode_maximal"
    # When the engine is idle, a request waits until arrivals pause this long (5x at most)
    # before the first forward pass, so a burst starts as one batch (loop.EngineLoop).
    admission_window_ms: float = 2.0
    cache_prompt: bool = True
    prompt_cache_ram_mb: int = -1  # RAM tier; -1 = auto (ram_tier_mb), 0 = off
    kv_cache_dir: str = ""  # the disk tier (kv_disk.py); "" = off
    kv_cache_disk_mb: int = 4096
    session_idle_s: float = 30.0
    # An idle session's history is kept over other caches this long (core.kv.prefix_cache).
    session_live_s: float = 600.0
    response_cache_mb: int = 0  # exact response cache (core.response_cache); 0 = off
    default_max_tokens: int = 256
    # thinking tokens before the end of thinking is forced (core.reasoning.budget); -1: no limit
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""
    # Prompt-lookup speculative decoding (core.speculation.speculator) of requests that do not
    # choose: "off", "auto" (when the measured costs say it pays) or "on"; and its defaults.
    speculative: str = "off"
    draft_max: int = 16
    ngram_min: int = 2
    ngram_max: int = 4
    # Pad a decode-only pass with up to 3 rows that are never sampled when the measured costs
    # say the larger batch is cheaper (core.speculation.drafts.Drafts._pad): llama.cpp's CPU output
    # matmul makes some row counts dearer than larger ones. Was pad_odd_ticks (still read,
    # deprecated).
    pad_decode_batches: bool = True
    # Publish and deliver a tick's events while the next forward pass runs on a GPU
    # (loop.EngineLoop._tick): "on", "off", or "auto" = on when the model's layers are offloaded
    # to a GPU (a CPU build or --n-gpu-layers 0: off).
    overlap_decode: str = "auto"
    # Back-pressure (core.scheduling.backpressure.BackPressure.behind): a request stops decoding
    # while its caller has this many generated tokens unread (0 = unbounded), and is ended with
    # RESOURCE_EXHAUSTED (STALLED_READER) when the caller then reads nothing for
    # stalled_reader_s (0 = never).
    stream_buffer_tokens: int = 256
    stalled_reader_s: float = 60.0
    # A tick running longer than this (seconds) means the engine hung (watchdog.py): health
    # NOT_SERVING, every caller UNAVAILABLE, exit. "auto": each tick's bound follows its forward
    # pass at the measured cost of a token, starting from the warm-up's measured prefill cost
    # and n_batch (watchdog.PassBounds); 0 = off.
    watchdog_s: float | Literal["auto"] = AUTO
    max_stop_strings: int = 16
    max_stop_length: int = 256
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant_limits: Mapping[str, TenantLimits] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0
    # auto: console lines when the log stream (stderr) is a terminal, else JSON lines
    log_format: str = "auto"
    log_level: str = "info"
    log_payloads: bool = False  # request/response messages in the logs (debugging only)
    grace_s: float = 10.0
    # On SIGTERM, health turns NOT_SERVING this long before new calls are refused (a proxy's
    # health interval or more: it stops routing here first).
    drain_delay_s: float = 0.0
    keep_alive_on_engine_error: bool = False  # else exit EXIT_ENGINE_FAILED after grace_s
    max_message_bytes: int = 16 * 1024 * 1024
    tls_cert: str = ""  # PEM certificate chain: serve TLS (with tls_key)
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM CA: clients must present a certificate it signed (mTLS)
    auth_tokens_file: str = ""  # TOML of tokens/identities -> tenant + role (see auth.py)
    # Accept bearer tokens on a plaintext listener that is not loopback (auth.py): else refused
    allow_insecure_tokens: bool = False
    reflection: bool = True
    otlp_endpoint: str = ""  # OTLP/HTTP traces URL ("" = tracing off); see observability/tracing.py


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """The models served besides the default one (ModelSettings.model_path) and how many may be
    resident at once (models.ModelPool). Every model is loaded with the same ModelSettings and
    SchedulerSettings; each resident one has its own engine (context, slots, thread)."""

    models: tuple[tuple[str, str], ...] = ()  # (name, path) of the other models, in order
    models_dir: str = ""  # --models-dir: `models` were partly found there; rescanned for new ones
    # At most this many engines at once (0 = no limit). 1 by default: a server configured with
    # several models never holds more than one model's memory unless told it may.
    max_loaded_models: int = 1
    max_loaded_bytes: int = 0  # sum of the resident models' file sizes (0 = no limit)

    def resident_engines(self) -> int:
        """How many engines may be resident at once: max_loaded_models, or with no limit every
        model configured (the default one and `models`; a --models-dir file found later is not
        counted)."""
        return self.max_loaded_models or 1 + len(self.models)


@dataclass(frozen=True, slots=True)
class Settings:
    model: ModelSettings = field(default_factory=ModelSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
