"""The exact response cache (--response-cache-mb): the whole result of a finished request, kept
for a later request whose output is a pure function of the same inputs, so it is answered
without the scheduler. Pure Python: the key, the byte-bounded LRU and its counters.

A request is cacheable when its output depends on nothing but its inputs: greedy (temperature
0) or an explicit seed, and no time_limit_ms (where a time limit cuts the output depends on the
load); the caller did not opt out (cache_response false); and it does not resume a cut answer
(see UNKEYED's "resumed"). Its key is the sha256 of the
model's identity (the GGUF file's sha256) and a canonical text of every request field that can
change the output (KEYED below; UNKEYED says why each other field cannot). The tenant-scoped
cache_scope and the tenant are keyed: tenants and scopes never share an entry.

Only results that finished normally are stored (EOS, a stop string or token, max_tokens, the
context length), never an error, a cancellation or a partial result. Bytes are an estimate of
the memory an entry takes (Python objects included); an entry over the whole budget is not
stored. Thread-safe: the event loop uses it, a /metrics scrape reads its counters."""

from __future__ import annotations

import array
import enum
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llama_grpc_server.core.adapters import AdapterRef
from llama_grpc_server.core.reasoning.budget import ReasoningParams
from llama_grpc_server.core.requests.request import (
    Constraint,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputParams,
    SamplingParams,
    StoppingParams,
    TokenDelta,
    TokenLogprob,
)

KEY_VERSION = 1  # part of every key: bump it when the canonical form changes

# The fields of each request value that go into the key, in order. Nested values are keyed
# field by field with their own entry here. Written out: a field added to one of these types
# fails tests/unit/core/test_response_cache.py until it is listed here or in UNKEYED.
KEYED: Mapping[type, tuple[str, ...]] = {
    GenerationRequest: (
        "prompt_tokens",
        "sampling",
        "stopping",
        "output",
        "constraint",
        "num_truncated",  # reported in usage; the prompt after truncation is keyed too
        "cache_scope",  # tenant-scoped (auth.scoped_cache_scope)
        "tenant",
        "reasoning",
        "adapters",  # in cache_scope as well (core.adapters.scoped)
    ),
    AdapterRef: ("digest", "scale"),  # the name is a label: equal files compute alike
    SamplingParams: (  # all of them, even those a greedy sampler ignores: simply safe
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seed",
        "repeat_penalty",
        "frequency_penalty",
        "presence_penalty",
        "penalty_last_n",
        "logit_bias",
    ),
    StoppingParams: (
        "max_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "time_limit_ms",  # always None in a cacheable request
        "max_tokens_is_default",
        "min_tokens",
    ),
    OutputParams: ("logprobs", "top_logprobs", "shown_specials"),
    # field: where an error points, kept to be simple; triggers: when a lazy grammar applies
    Constraint: ("gbnf", "root", "field", "triggers", "starts"),
    ReasoningParams: (
        "opener",
        "closer",
        "opened",
        "budget",
        "forced_end_ids",
        "forced_empty_ids",
    ),
}
# The request fields left out of the key, and why none of them changes the output.
UNKEYED: Mapping[type, Mapping[str, str]] = {
    GenerationRequest: {
        "request_id": "names one call",
        "session_id": "chooses a slot, not the output",
        "cache_prompt": "where prompt KV comes from, not what is computed",
        "deadline": "when to give up; a request that gives up is not stored",
        "priority": "queue order",
        "cache_response": "the opt-out itself, checked before any lookup",
        "speculative": "how tokens are verified, not which: exact-match verification keeps "
        "the tokens the request's sampler picks without drafts (rounding aside, as batching)",
        "embedding": "an embedding request is never cacheable (GenerationRequest sets "
        "cache_response false for it)",
        "resumed": "a resumed answer is never cacheable (is_cacheable): its entry would serve "
        "only the same cut again, which a caller hardly ever sends twice, and a stream cut "
        "was cancelled, so the whole answer is not stored to cut a resume's tail from",
    },
    AdapterRef: {"name": "a label: the file (its digest) and the scale compute the output"},
}
# Finish reasons of a complete result. TIME_LIMIT never occurs (such requests are not cacheable).
# EMBEDDED neither (embedding requests are not cacheable).
STORED_REASONS: frozenset[FinishReason] = frozenset(FinishReason) - {
    FinishReason.TIME_LIMIT,
    FinishReason.EMBEDDED,
}

# Estimated bytes (CPython objects on 64-bit): an entry with its key and bookkeeping, a delta
# (object, tuples, str), each token id, each logprob and each top alternative; plus text bytes.
# Checked with tracemalloc: within 10 % of what entries of 48-256 tokens take (with and without
# top logprobs).
ENTRY_OVERHEAD_BYTES = 600
DELTA_OVERHEAD_BYTES = 160
TOKEN_ID_BYTES = 36
LOGPROB_OVERHEAD_BYTES = 200
TOP_LOGPROB_OVERHEAD_BYTES = 150


def is_cacheable(request: GenerationRequest) -> bool:
    """Its output is a pure function of its inputs, and the caller allows caching it."""
    sampling = request.sampling
    return (
        request.cache_response
        and not request.resumed
        and request.stopping.time_limit_ms is None
        and (sampling.is_greedy or sampling.seed is not None)
    )


def response_key(model_id: str, request: GenerationRequest) -> bytes:
    """sha256 of the model identity and every output-changing field of the request."""
    text = repr((KEY_VERSION, model_id, _canonical(request)))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def _canonical(value: object) -> object:
    """Plain nested tuples with a deterministic repr: request values by their KEYED fields,
    sets sorted, enums by value, sequences of ints by digest. A value of any other type raises
    TypeError: a new nested type must be given its KEYED entry."""
    names = KEYED.get(type(value))
    if names is not None:
        return (type(value).__name__, *((n, _canonical(getattr(value, n))) for n in names))
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, str | int | float):
        return value
    if isinstance(value, frozenset | set):
        return _canonical(tuple(sorted(value)))
    if isinstance(value, tuple | list):
        try:  # token ids (thousands): their digest, far faster than their repr
            ints = array.array("q", value)  # TypeError for anything but ints (and bools,
        except TypeError:  # which no request value holds in a sequence)
            return tuple(_canonical(v) for v in value)
        # bytes occur nowhere else in a request: this stands for a sequence of ints only
        return b"ints:" + hashlib.sha256(ints.tobytes()).digest()
    raise TypeError(f"no canonical form for {type(value).__name__}: add it to KEYED")


@dataclass(frozen=True, slots=True)
class CachedResponse:
    """A stored result: the deltas as they were sent, and the Finished event."""

    deltas: tuple[TokenDelta, ...]
    finished: Finished
    size_bytes: int


@dataclass(frozen=True, slots=True)
class ResponseCacheStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass(frozen=True, slots=True)
class Freed:
    """What a clear() dropped."""

    entries: int = 0
    bytes: int = 0


def entry_size(deltas: Sequence[TokenDelta], finished: Finished) -> int:
    """Estimated bytes of a stored result (see the constants above)."""
    size = ENTRY_OVERHEAD_BYTES + len(finished.matched_stop.encode())
    for delta in deltas:
        size += (
            DELTA_OVERHEAD_BYTES + len(delta.text.encode()) + TOKEN_ID_BYTES * len(delta.token_ids)
        )
        size += sum(_logprob_size(lp) for lp in delta.logprobs)
    return size


def _logprob_size(value: TokenLogprob) -> int:
    tops = sum(TOP_LOGPROB_OVERHEAD_BYTES + len(t.token.encode()) for t in value.top)
    return LOGPROB_OVERHEAD_BYTES + len(value.token.encode()) + tops


class ResponseCache:
    """Byte-bounded LRU of stored results by key, with hit/miss/eviction counters."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, CachedResponse] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> CachedResponse | None:
        """The stored result (now the most recently used; counted as a hit), or None."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self._hits += 1
            return found

    def count_miss(self) -> None:
        """A generation request went to the engine instead (cacheable or not)."""
        with self._lock:
            self._misses += 1

    def put(self, key: bytes, deltas: Sequence[TokenDelta], finished: Finished) -> bool:
        """Store a complete result, evicting the least recently used entries to make room.
        False (nothing stored) for an incomplete result or one bigger than the whole budget."""
        if finished.reason not in STORED_REASONS:
            return False
        entry = CachedResponse(tuple(deltas), finished, entry_size(deltas, finished))
        if entry.size_bytes > self.capacity_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)  # two identical requests that both missed
            if old is not None:
                self._bytes -= old.size_bytes
            while self._entries and self._bytes + entry.size_bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.size_bytes
                self._evictions += 1
            self._entries[key] = entry
            self._bytes += entry.size_bytes
        return True

    def clear(self) -> Freed:
        """Drop every entry (counters stay: they are cumulative)."""
        with self._lock:
            freed = Freed(len(self._entries), self._bytes)
            self._entries.clear()
            self._bytes = 0
        return freed

    def stats(self) -> ResponseCacheStats:
        with self._lock:
            return ResponseCacheStats(
                len(self._entries), self._bytes, self._hits, self._misses, self._evictions
            )
