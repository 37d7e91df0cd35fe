"""Counters the scheduler keeps and the immutable StatsSnapshot built from them (published by
the engine thread on events and at most every 100 ms; GetStats and /metrics read that, with the
counters read live: live()), and a snapshot's aggregate Load, which every protocol reports."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llama_grpc_server.core.adapters import AdapterCounters, AdapterSet, AdapterUsage
from llama_grpc_server.core.api import DiskTierStats, SlotSnapshot, StatsSnapshot
from llama_grpc_server.core.kv.ram import RamTier
from llama_grpc_server.core.requests.request import Request
from llama_grpc_server.core.scheduling.slot import Slot


@dataclass(slots=True)
class Counters:
    """Cumulative since start."""

    started: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    deadline_exceeded: int = 0  # neither failed nor cancelled: the caller's deadline passed
    rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0
    ticks: int = 0
    batch_tokens: int = 0
    preemptions: int = 0
    # wall time inside llama_decode (a draft model's passes included)
    decode_ms: float = 0.0
    decode_cpu_ms: float = 0.0  # the engine thread's CPU time inside llama_decode
    finish_reasons: dict[str, int] = field(default_factory=dict)
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    spec_accepted_tokens: int = 0  # ... the sampler agreed with (and the request took)
    spec_ticks: int = 0  # forward passes with at least one draft
    # ... of them the draft model's (--draft-model), drafted and accepted
    spec_model_draft_tokens: int = 0
    spec_model_accepted_tokens: int = 0
    pad_rows: int = (
        0  # pad rows added to decode-only passes (core.speculation.drafts; not in GetStats)
    )
    reader_pauses: int = 0  # times a request stopped decoding for its slow reader
    reader_stalls: int = 0  # requests ended because their reader read nothing (StalledReader)
    adapters: dict[str, AdapterCounters] = field(default_factory=dict)  # by adapter name
    adapter_switches: int = 0  # passes whose adapter set differs from the pass before's

    @property
    def num_changes(self) -> int:
        """Requests admitted, ended or preempted so far: the EngineLoop publishes a snapshot at
        once when this moved, otherwise at most every PUBLISH_EVERY_S."""
        ended = self.finished + self.failed + self.cancelled + self.deadline_exceeded
        return self.started + ended + self.preemptions

    def count_cached(self, request: Request, num_cached: int) -> None:
        """Set a request's cached prompt tokens (a resumed preempted request counts no more).
        A resumed answer's prefix is its prompt and the resumed tokens; only the prompt's
        count (usage's cached_prompt_tokens is of the prompt, as prompt_tokens is)."""
        num_cached = min(num_cached, request.num_prompt)
        if request.num_preemptions == 0:
            self.cached_prompt_tokens += num_cached - request.num_cached_prompt
            request.num_cached_prompt = num_cached

    def count_adapters(
        self, adapters: AdapterSet, *, requests: int = 0, tokens: int = 0, passes: int = 0
    ) -> None:
        for adapter in adapters:
            counters = self.adapters.get(adapter.name)
            if counters is None:
                counters = self.adapters[adapter.name] = AdapterCounters()
            counters.requests += requests
            counters.generated_tokens += tokens
            counters.passes += passes

    def count_pass(self, num_tokens: int, num_spec: int, eval_ms: float, cpu_ms: float) -> None:
        """One forward pass of num_tokens rows, num_spec of them draft tokens (pads excluded)."""
        self.ticks += 1
        self.batch_tokens += num_tokens
        self.decode_ms += eval_ms
        self.decode_cpu_ms += cpu_ms
        if num_spec:
            self.spec_ticks += 1
            self.spec_draft_tokens += num_spec


def snapshot(  # noqa: PLR0917  # one call site, every argument a distinct fact
    slots: Sequence[Slot],
    queue_depth: int,
    counters: Counters,
    kv_cells_used: int,
    kv_cells_total: int,
    batch_strategy: str,
    ram: RamTier | None,
    uptime_s: float,
    disk: DiskTierStats | None = None,
) -> StatsSnapshot:
    slot_views = tuple(
        SlotSnapshot(
            s.slot_id,
            s.state,
            s.request.request_id if s.request is not None else "",
            s.num_kv_tokens,
            s.request.spec.tenant if s.request is not None else "",
            _unread(s.request),
        )
        for s in slots
    )
    states = [s.state for s in slot_views]
    return StatsSnapshot(
        n_parallel=len(slot_views),
        active_slots=sum(1 for st in states if st != "idle"),
        idle_slots=states.count("idle"),
        prefilling_slots=states.count("prefilling"),
        generating_slots=states.count("generating"),
        queue_depth=queue_depth,
        kv_cells_used=min(kv_cells_total, kv_cells_used),
        kv_cells_total=kv_cells_total,
        **_counted(counters),
        uptime_s=uptime_s,
        slots=slot_views,
        batch_strategy=batch_strategy,
        ram_cache_entries=ram.num_entries if ram is not None else 0,
        ram_cache_bytes=ram.num_bytes if ram is not None else 0,
        ram_cache_hits=ram.hits if ram is not None else 0,
        ram_cache_misses=ram.misses if ram is not None else 0,
        ram_cache_evictions=ram.evictions if ram is not None else 0,
        disk_cache=disk,
        paused_streams=sum(1 for s in slots if s.request is not None and s.request.paused_since_ns),
    )


def active_cells(snapshot: StatsSnapshot) -> int:
    """KV cells held by running requests: the cells no new request can take. The rest of
    kv_cells_used is prefixes kept in idle slots, which the scheduler reclaims when it needs
    the room (to the RAM tier or dropped); a router's "KV usage" means this part, as vLLM's
    does (its prefix-cached free blocks count as free). A prefix two running slots share is
    counted twice here (an overestimate, never more than kv_cells_used)."""
    held = sum(s.cached_tokens for s in snapshot.slots if s.state != "idle")
    return min(snapshot.kv_cells_used, held)


@dataclass(frozen=True, slots=True)
class Load:
    """A snapshot's aggregate load, the one value every protocol's load report is converted
    from (v1's WatchLoad and the vLLM engine protocol's GetLoads): no request ids, no tenants."""

    queue_depth: int
    active_slots: int  # requests running: prefilling or generating
    n_parallel: int
    kv_cells_used: int  # every cell in use, idle slots' kept prefixes included
    kv_cells_total: int
    active_cells: int  # the cells running requests hold (active_cells)
    prefix_cache_hit_rate: float
    engine_state: str
    serving: bool  # the engine runs and the server is not draining
    timestamp_unix_ms: int

    @property
    def kv_cache_usage(self) -> float:
        """The share of the KV cells in use, idle slots' kept prefixes included."""
        return self.kv_cells_used / self.kv_cells_total if self.kv_cells_total else 0.0


def load_of(snapshot: StatsSnapshot, *, is_draining: bool, unix_ms: int) -> Load:
    """The aggregate load of a snapshot (models/pool.ModelPool.load_snapshot's for the whole
    server) at `unix_ms`; serving means the engine runs and the server is not draining."""
    return Load(
        queue_depth=snapshot.queue_depth,
        active_slots=snapshot.active_slots,
        n_parallel=snapshot.n_parallel,
        kv_cells_used=snapshot.kv_cells_used,
        kv_cells_total=snapshot.kv_cells_total,
        active_cells=active_cells(snapshot),
        prefix_cache_hit_rate=snapshot.prefix_cache_hit_rate,
        engine_state=snapshot.engine_state,
        serving=snapshot.engine_state == "running" and not is_draining,
        timestamp_unix_ms=unix_ms,
    )


def live(published: StatsSnapshot, counters: Counters, kv_cells_used: int) -> StatsSnapshot:
    """`published` with the counters and the KV cells in use as they are now (EngineLoop.stats:
    the engine thread publishes whole snapshots only on events and every 100 ms). Each counter
    is one number written by the engine thread only: read from another thread it is whole,
    though two of them may be one tick apart."""
    used = min(published.kv_cells_total, kv_cells_used)
    return dataclasses.replace(published, **_counted(counters), kv_cells_used=used)


def _counted(c: Counters) -> dict[str, Any]:
    """The snapshot's fields that are the counters'."""
    return {
        "requests_started": c.started,
        "requests_finished": c.finished,
        "requests_failed": c.failed,
        "requests_cancelled": c.cancelled,
        "requests_rejected": c.rejected,
        "requests_deadline_exceeded": c.deadline_exceeded,
        "prompt_tokens": c.prompt_tokens,
        "generated_tokens": c.generated_tokens,
        "cached_prompt_tokens": c.cached_prompt_tokens,
        "prefix_cache_hit_rate": (
            c.cached_prompt_tokens / c.prompt_tokens if c.prompt_tokens else 0.0
        ),
        "ticks": c.ticks,
        "avg_batch_size": c.batch_tokens / c.ticks if c.ticks else 0.0,
        "preemptions": c.preemptions,
        "decode_seconds": c.decode_ms / 1000,
        "decode_cpu_seconds": c.decode_cpu_ms / 1000,
        "spec_draft_tokens": c.spec_draft_tokens,
        "spec_accepted_tokens": c.spec_accepted_tokens,
        "spec_acceptance_rate": (
            c.spec_accepted_tokens / c.spec_draft_tokens if c.spec_draft_tokens else 0.0
        ),
        "spec_ticks": c.spec_ticks,
        "spec_model_draft_tokens": c.spec_model_draft_tokens,
        "spec_model_accepted_tokens": c.spec_model_accepted_tokens,
        "stalled_readers": c.reader_stalls,
        "stream_pauses": c.reader_pauses,
        "adapters": tuple(
            AdapterUsage(name, a.requests, a.generated_tokens, a.passes)
            for name, a in sorted(c.adapters.items())
        ),
        "adapter_switches": c.adapter_switches,
    }


def _unread(request: Request | None) -> int:
    """Tokens sent to a request's stream that its reader has not taken yet."""
    if request is None or request.reader is None:
        return 0
    return max(0, request.num_sent - request.reader.num_read)


# Summed over engines by combined_load: the load figures a router reads (WatchLoad).
_LOAD_SUMS = ("n_parallel", "active_slots", "idle_slots", "prefilling_slots", "generating_slots",
              "queue_depth", "kv_cells_used", "kv_cells_total", "prompt_tokens",
              "cached_prompt_tokens")  # fmt: skip
RUNNING = "running"  # StatsSnapshot.engine_state of an engine that serves


def combined_load(snapshots: Sequence[StatsSnapshot]) -> StatsSnapshot:
    """The load of several engines (the resident models of one server) as one snapshot: slots,
    queue and KV cells summed, the prefix-cache hit rate over all their prompt tokens, and
    "running" when any engine runs (the server then takes requests; a model that is not
    resident loads on demand). One snapshot comes back as it is; none gives an idle, running
    server with no slots. Per-request and cumulative fields other than those are the first's."""
    if len(snapshots) == 1:
        return snapshots[0]
    if not snapshots:
        return dataclasses.replace(
            snapshot([], 0, Counters(), 0, 0, "", None, 0.0), engine_state=RUNNING
        )
    sums = {name: sum(getattr(s, name) for s in snapshots) for name in _LOAD_SUMS}
    prompt = sums["prompt_tokens"]
    states = [s.engine_state for s in snapshots]
    return dataclasses.replace(
        snapshots[0],
        **sums,
        prefix_cache_hit_rate=sums["cached_prompt_tokens"] / prompt if prompt else 0.0,
        engine_state=RUNNING if RUNNING in states else states[0],
    )
