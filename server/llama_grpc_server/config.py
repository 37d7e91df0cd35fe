"""Frozen settings. cli.py builds them from argv, LLAMA_GRPC_* env and an optional TOML file."""

from __future__ import annotations

from dataclasses import dataclass, field

from llama_grpc_server.core.request import SamplingParams


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """Which GGUF to load and how; model_path "" means the embedded Gemma 3 270M."""

    model_path: str = ""
    model_name: str = ""
    n_ctx: int = 8192
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = 2
    n_threads_batch: int = 2
    n_gpu_layers: int = 0
    flash_attn: bool = True
    chat_template: str = ""  # a built-in for messages ("gemma", "chatml"); "" = the model's own


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    n_parallel: int = 4
    chunk_size: int = 512
    max_queue: int = 64
    batch_strategy: str = "decode_maximal"
    cache_prompt: bool = True
    prompt_cache_ram_mb: int = 0
    default_max_tokens: int = 256
    max_stop_strings: int = 16
    max_stop_length: int = 256
    default_sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0
    log_format: str = "json"
    log_level: str = "info"
    log_payloads: bool = False  # request/response messages in the logs (debugging only)
    grace_s: float = 10.0
    keep_alive_on_engine_error: bool = False  # else exit EXIT_ENGINE_FAILED after grace_s
    max_message_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Settings:
    model: ModelSettings = field(default_factory=ModelSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
