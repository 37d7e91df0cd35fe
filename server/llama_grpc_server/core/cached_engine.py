"""ResponseCachingEngine: an EngineApi in front of the real one (rpc.plumbing.wiring wraps the
engine with it when --response-cache-mb is set), so the servicer stays unaware of the response
cache.

A cacheable request (core.response_cache.is_cacheable) arrives fully validated and tokenized;
submit() looks it up. A hit is a ReplayStream of the stored deltas, exactly as the original's
stream delivered them (the same chunking), then its Finished event with usage.cached_response
set: it never reaches the scheduler, so no queue, tenant quota or slot applies to it and the
engine's counters (requests_started, tokens) do not move. A miss goes to the engine through a
RecordingStream, which stores the result once it has finished normally. Hits are served only
while the engine runs: a failed or stopped engine refuses every request alike."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from llama_grpc_server.core.adapters import AdapterCatalog, AdapterEntry
from llama_grpc_server.core.api import (
    CacheCleared,
    EngineApi,
    ModelInfo,
    RequestStream,
    StatsSnapshot,
)
from llama_grpc_server.core.kv.events import KvEventLog
from llama_grpc_server.core.requests.chat import ChatMessage
from llama_grpc_server.core.requests.request import (
    Event,
    Finished,
    GenerationRequest,
    Timings,
    TokenDelta,
)
from llama_grpc_server.core.response_cache import (
    CachedResponse,
    ResponseCache,
    is_cacheable,
    response_key,
)
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.core.stats import RUNNING
from llama_grpc_server.core.tools.types import ToolSpec
from llama_grpc_server.errors import ServiceError


def _ms(start_ns: int, end_ns: int) -> float:
    return max(0.0, (end_ns - start_ns) / 1e6)


def replayed(finished: Finished, arrival_ns: int, first_ns: int, end_ns: int) -> Finished:
    """The stored Finished as a hit reports it: cached_response, every prompt token cached (none
    was computed), no draft verified, no slot, and the replay's own timings (no queue, no
    prefill)."""
    usage = dataclasses.replace(
        finished.usage,
        cached_prompt_tokens=finished.usage.prompt_tokens,
        cached_response=True,
        draft_tokens=0,
        accepted_draft_tokens=0,
    )
    timings = Timings(
        queue_ms=0.0,
        ttft_ms=_ms(arrival_ns, first_ns),
        prefill_ms=0.0,
        decode_ms=_ms(first_ns, end_ns),
        total_ms=_ms(arrival_ns, end_ns),
    )
    return dataclasses.replace(finished, usage=usage, timings=timings, slot_id=-1)


class ReplayStream:
    """A stored result as a RequestStream. Nothing runs, so cancel() has nothing to stop."""

    def __init__(self, entry: CachedResponse, arrival_ns: int) -> None:
        self._entry = entry
        self._arrival_ns = arrival_ns

    async def __aiter__(self) -> AsyncIterator[Event]:
        first_ns = 0
        for delta in self._entry.deltas:
            first_ns = first_ns or time.perf_counter_ns()
            yield delta
        end_ns = time.perf_counter_ns()
        yield replayed(self._entry.finished, self._arrival_ns, first_ns or end_ns, end_ns)

    def cancel(self, *, deadline_exceeded: bool = False) -> None:
        return


class RecordingStream:
    """The engine's stream, passed through; a normal finish stores what went by."""

    def __init__(self, inner: RequestStream, cache: ResponseCache, key: bytes) -> None:
        self._inner = inner
        self._cache = cache
        self._key = key

    async def __aiter__(self) -> AsyncIterator[Event]:
        deltas: list[TokenDelta] = []
        async for event in self._inner:
            if isinstance(event, TokenDelta):
                deltas.append(event)
            elif isinstance(event, Finished):
                self._cache.put(self._key, deltas, event)
            yield event

    def cancel(self, *, deadline_exceeded: bool = False) -> None:
        self._inner.cancel(deadline_exceeded=deadline_exceeded)


class ResponseCachingEngine:
    """`engine` behind a ResponseCache; `model_id` (the GGUF file's sha256) is in every key.
    Everything but submit, stats and clear_cache is the engine's own."""

    def __init__(self, engine: EngineApi, cache: ResponseCache, model_id: str) -> None:
        self.engine = engine
        self.cache = cache
        self.model_id = model_id

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    def submit(self, request: GenerationRequest) -> RequestStream:
        arrival_ns = time.perf_counter_ns()
        key = response_key(self.model_id, request) if is_cacheable(request) else None
        if key is not None and self.engine.stats().engine_state == RUNNING:
            found = self.cache.get(key)
            if found is not None:
                return ReplayStream(found, arrival_ns)
        stream = self.engine.submit(request)  # raises when refused: neither a hit nor a miss
        self.cache.count_miss()
        return stream if key is None else RecordingStream(stream, self.cache, key)

    def stats(self) -> StatsSnapshot:
        cached = self.cache.stats()
        return dataclasses.replace(
            self.engine.stats(),
            response_cache_entries=cached.entries,
            response_cache_bytes=cached.bytes,
            response_cache_hits=cached.hits,
            response_cache_misses=cached.misses,
            response_cache_evictions=cached.evictions,
        )

    @property
    def kv_events(self) -> KvEventLog:
        return self.engine.kv_events

    async def clear_cache(self) -> CacheCleared:
        """The engine's caches first: if that fails (a dead engine), nothing is cleared here
        either, and no hit is served anyway."""
        cleared = await self.engine.clear_cache()
        freed = self.cache.clear()
        return dataclasses.replace(
            cleared, freed_response_entries=freed.entries, freed_response_bytes=freed.bytes
        )

    @property
    def adapters(self) -> AdapterCatalog:
        return self.engine.adapters

    async def load_adapter(self, name: str, path: str, default_scale: float) -> AdapterEntry:
        return await self.engine.load_adapter(name, path, default_scale)

    async def unload_adapter(self, name: str) -> int:
        return await self.engine.unload_adapter(name)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.engine.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, token_ids: Sequence[int], *, render_special: bool) -> str:
        return self.engine.detokenize(token_ids, render_special=render_special)

    def token_piece(self, token_id: int) -> str:
        return self.engine.token_piece(token_id)

    def check_grammar(self, gbnf: str, root: str) -> None:
        self.engine.check_grammar(gbnf, root)

    def json_schema_to_grammar(self, schema: str) -> str:
        return self.engine.json_schema_to_grammar(schema)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        template: str,
        tools: Sequence[ToolSpec] = (),
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        return self.engine.render_chat(messages, template, tools, variables)

    def tool_format(self, template: str) -> str:
        return self.engine.tool_format(template)

    def reasoning_format(self, template: str) -> str:
        return self.engine.reasoning_format(template)

    def end_all(self, error: ServiceError) -> None:
        self.engine.end_all(error)

    def set_tenant_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        self.engine.set_tenant_limits(limits)

    def on_failure(self, listener: Callable[[str], None]) -> None:
        self.engine.on_failure(listener)

    def close(self) -> None:
        self.engine.close()
