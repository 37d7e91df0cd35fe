"""SchedulerLimits: what the scheduler runs with, resolved against the loaded model (config.py's
SchedulerSettings are what the operator asked for; engine/build.py resolves them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from llama_grpc_server.core.requests.request import SpeculativeConfig
from llama_grpc_server.core.scheduling.strategies import DEFAULT_PREFILL_STALL
from llama_grpc_server.core.scheduling.tenants import TenantLimits


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """The scheduler's limits (module docstring)."""

    n_parallel: int
    n_ctx: int
    n_batch: int
    chunk_size: int = 512
    max_queue: int = 64
    supports_partial_removal: bool = True
    ram_cache_bytes: int = 0  # 0 = no RAM tier
    ram_min_tokens: int = 64  # smaller caches are not worth saving
    session_idle_s: float = 0.0  # an idle session's cache goes to the disk tier after this
    session_live_s: float = 0.0  # a session's idle history is kept over others' this long (0: ever)
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)  # others: TenantLimits()
    # Speculative decoding for requests that do not choose (core.speculation.speculator).
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # A decode-only pass takes up to 3 rows more, never sampled, where the measured costs say
    # the larger batch is cheaper (core.speculation.drafts.Drafts._pad).
    pad_decode_batches: bool = True
    # the model's BOS when it adds one: KV events also announce each sequence without it, as a
    # router that leaves it out of its ids chunks them (core.kv.events.KvEventPublisher)
    kv_events_bos: int | None = None
    # Back-pressure (core.scheduling.backpressure): a request whose reader has this many tokens
    # unread is not planned until it reads (0 = unbounded); one that reads nothing for
    # stalled_reader_s meanwhile is ended with StalledReader (0 = never).
    stream_buffer_tokens: int = 0
    stalled_reader_s: float = 0.0
    # An encoder-only model (its architecture, e.g. "bert"; "" for a generation model): it
    # takes embedding requests only, each input whole in one pass of up to n_batch tokens
    # (core.requests.embedding.share_whole), and refuses generation (refuse_generation).
    encoder: str = ""
    # While slots generate, a pass with prompt tokens lasts about this many decode-only passes
    # at most (core.scheduling.strategies.TickCosts.prefill_allowance).
    prefill_stall: float = DEFAULT_PREFILL_STALL
