"""The exact response cache, pure: what it keys on (every request field is classified, and each
keyed one changes the key), what is cacheable, and the byte-bounded LRU with its counters."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from llama_grpc_server.core import response_cache as rc
from llama_grpc_server.core.adapters import AdapterRef
from llama_grpc_server.core.reasoning.budget import ReasoningParams
from llama_grpc_server.core.requests.request import (
    Constraint,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputParams,
    SamplingParams,
    SpeculativeMode,
    SpeculativeParams,
    StoppingParams,
    Timings,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)

MODEL = "ab" * 32
BASE = GenerationRequest(
    request_id="r1",
    prompt_tokens=(1, 500, 501, 502),
    sampling=SamplingParams(temperature=0.0, seed=7, logit_bias=((5, -1.5),)),
    stopping=StoppingParams(max_tokens=16, stop=("\n",), stop_token_ids=frozenset({9})),
    output=OutputParams(logprobs=True, top_logprobs=2),
    constraint=Constraint('root ::= "a"'),
    cache_scope="scope",
    tenant="team-a",
)
TIMINGS = Timings(1.0, 2.0, 1.0, 3.0, 5.0)


def finished(reason: FinishReason = FinishReason.EOS, stop: str = "") -> Finished:
    return Finished(reason, Usage(4, 2, 0), TIMINGS, seed=7, matched_stop=stop, slot_id=1)


def delta(text: str = "ab", logprobs: int = 0) -> TokenDelta:
    lps = tuple(
        TokenLogprob(600 + i, "x", -0.5, (TopLogprob(600 + i, "x", -0.5),)) for i in range(logprobs)
    )
    return TokenDelta(tuple(600 + i for i in range(max(1, logprobs))), text, lps)


# -- the key ---------------------------------------------------------------------------------------


def request_types() -> list[type]:
    return [
        GenerationRequest,
        SamplingParams,
        StoppingParams,
        OutputParams,
        Constraint,
        ReasoningParams,
        AdapterRef,
    ]


@pytest.mark.parametrize("cls", request_types(), ids=lambda c: c.__name__)
def test_every_request_field_is_keyed_or_said_why_not(cls: type) -> None:
    """A field added to a request value fails here until it is keyed or its irrelevance to the
    output is written down in UNKEYED."""
    names = {f.name for f in dataclasses.fields(cls)}
    keyed = set(rc.KEYED[cls])
    unkeyed = set(rc.UNKEYED.get(cls, {}))
    assert not keyed & unkeyed
    assert keyed | unkeyed == names


def test_every_dataclass_inside_a_request_has_its_key_fields() -> None:
    """A new nested value type needs its own KEYED entry (the key would raise without one),
    unless the whole field is unkeyed."""
    assert set(rc.KEYED) == set(request_types())
    unkeyed = rc.UNKEYED[GenerationRequest]
    for field in dataclasses.fields(GenerationRequest):
        value = getattr(BASE, field.name)
        if dataclasses.is_dataclass(value) and field.name not in unkeyed:
            assert type(value) in rc.KEYED, field.name

    @dataclasses.dataclass(frozen=True)
    class Unknown:
        x: int = 1

    with pytest.raises(TypeError, match="add it to KEYED"):
        rc.response_key(MODEL, dataclasses.replace(BASE, constraint=Unknown()))  # type: ignore[arg-type]


VARIATIONS: list[tuple[type | None, Any]] = [
    (bool, lambda v: not v),
    (int, lambda v: v + 1),
    (float, lambda v: v + 1),
    (str, lambda v: v + "x"),
    (frozenset, lambda v: v | {123}),
    (tuple, lambda v: (*v, v[-1]) if v else ("x",)),
    (type(None), lambda v: 3),
    (SpeculativeParams, lambda v: SpeculativeParams(SpeculativeMode.ON, 16, 1, 8)),
]


def vary(value: Any) -> Any:
    """A different value of the same kind (Priority is an int: HIGH + 1 is no Priority, but
    priority is unkeyed and only needs to differ)."""
    for kind, change in VARIATIONS:
        if isinstance(value, kind):  # type: ignore[arg-type]
            return change(value)
    raise AssertionError(f"no variation for {value!r}: extend VARIATIONS")


def with_field(request: GenerationRequest, path: str, value: Any) -> GenerationRequest:
    head, _, rest = path.partition(".")
    if not rest:
        return dataclasses.replace(request, **{head: value})
    inner = dataclasses.replace(getattr(request, head), **{rest: value})
    return dataclasses.replace(request, **{head: inner})


def keyed_paths() -> list[str]:
    paths = []
    for name in rc.KEYED[GenerationRequest]:
        cls = type(getattr(BASE, name))
        if cls in rc.KEYED:
            paths += [f"{name}.{inner}" for inner in rc.KEYED[cls]]
        else:
            paths.append(name)
    return paths


def current(path: str) -> Any:
    value: Any = BASE
    for part in path.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("path", keyed_paths())
def test_each_keyed_field_changes_the_key(path: str) -> None:
    changed = with_field(BASE, path, vary(current(path)))
    assert rc.response_key(MODEL, changed) != rc.response_key(MODEL, BASE)


@pytest.mark.parametrize("name", sorted(rc.UNKEYED[GenerationRequest]))
def test_unkeyed_fields_leave_the_key(name: str) -> None:
    changed = with_field(BASE, name, vary(current(name)))
    assert rc.response_key(MODEL, changed) == rc.response_key(MODEL, BASE)


def test_no_constraint_and_the_model_change_the_key() -> None:
    assert rc.response_key(MODEL, BASE) == rc.response_key(MODEL, dataclasses.replace(BASE))
    bare = dataclasses.replace(BASE, constraint=None)
    assert rc.response_key(MODEL, bare) != rc.response_key(MODEL, BASE)
    assert rc.response_key("cd" * 32, BASE) != rc.response_key(MODEL, BASE)


def test_scopes_and_tenants_never_share_a_key() -> None:
    """Another scope, or another tenant with the same scope name, is another entry."""
    keys = {
        rc.response_key(MODEL, dataclasses.replace(BASE, cache_scope=scope, tenant=tenant))
        for scope, tenant in [("", ""), ("a", ""), ("", "t1"), ("a", "t1"), ("a", "t2")]
    }
    assert len(keys) == 5


def test_set_order_does_not_change_the_key() -> None:
    a = with_field(BASE, "stopping.stop_token_ids", frozenset({3, 1, 2}))
    b = with_field(BASE, "stopping.stop_token_ids", frozenset({2, 3, 1}))
    assert rc.response_key(MODEL, a) == rc.response_key(MODEL, b)


# -- what is cacheable -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "stopping", "opt_in", "expected"),
    [
        (SamplingParams(temperature=0.0), StoppingParams(), True, True),
        (SamplingParams(temperature=0.8, seed=1), StoppingParams(), True, True),
        (SamplingParams(temperature=0.8), StoppingParams(), True, False),
        (SamplingParams(temperature=0.0), StoppingParams(time_limit_ms=100), True, False),
        (SamplingParams(temperature=0.0), StoppingParams(), False, False),
    ],
    ids=["greedy", "seeded", "sampled", "time-limited", "opted-out"],
)
def test_cacheable_only_when_the_output_is_a_function_of_the_inputs(
    sampling: SamplingParams, stopping: StoppingParams, opt_in: bool, expected: bool
) -> None:
    request = GenerationRequest("r", (1, 2), sampling, stopping, cache_response=opt_in)
    assert rc.is_cacheable(request) is expected


# -- the LRU ---------------------------------------------------------------------------------------


def test_a_stored_result_comes_back_and_counts_a_hit() -> None:
    cache = rc.ResponseCache(1 << 20)
    deltas = [delta("a"), delta("b", logprobs=2)]
    assert cache.get(b"k") is None
    assert cache.put(b"k", deltas, finished())
    found = cache.get(b"k")
    assert found is not None and found.deltas == tuple(deltas) and found.finished == finished()
    cache.count_miss()
    stats = cache.stats()
    assert (stats.entries, stats.hits, stats.misses, stats.evictions) == (1, 1, 1, 0)
    assert stats.bytes == found.size_bytes == rc.entry_size(deltas, finished())


def test_size_grows_with_text_tokens_and_logprobs() -> None:
    small = rc.entry_size([delta("a")], finished())
    assert rc.entry_size([delta("a" * 100)], finished()) == small + 99
    assert (
        rc.entry_size([delta("a", logprobs=3)], finished()) > small + 3 * rc.LOGPROB_OVERHEAD_BYTES
    )
    assert rc.entry_size([delta("a"), delta("a")], finished()) > small


def test_evicts_least_recently_used_by_bytes() -> None:
    one = rc.entry_size([delta("x")], finished())
    cache = rc.ResponseCache(3 * one)
    for key in (b"a", b"b", b"c"):
        assert cache.put(key, [delta("x")], finished())
    assert cache.get(b"a") is not None  # now b is the least recently used
    assert cache.put(b"d", [delta("x")], finished())
    assert cache.get(b"b") is None
    assert all(cache.get(k) is not None for k in (b"a", b"c", b"d"))
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (3, 3 * one, 1)
    big = [delta("x" * one)]  # almost two entries' size: the two least recently used go
    assert cache.put(b"e", big, finished())
    assert cache.get(b"a") is None and cache.get(b"c") is None and cache.get(b"d") is not None
    stats = cache.stats()
    assert (stats.entries, stats.evictions) == (2, 3) and stats.bytes <= cache.capacity_bytes


def test_an_entry_bigger_than_the_budget_is_not_stored_and_evicts_nothing() -> None:
    cache = rc.ResponseCache(2000)
    assert cache.put(b"a", [delta("x")], finished())
    assert not cache.put(b"huge", [delta("x" * 5000)], finished())
    assert cache.get(b"huge") is None and cache.get(b"a") is not None
    assert cache.stats().evictions == 0


def test_storing_a_key_again_replaces_it() -> None:
    """Two identical requests that both missed store the same result once."""
    cache = rc.ResponseCache(1 << 20)
    cache.put(b"k", [delta("a")], finished())
    cache.put(b"k", [delta("a" * 10)], finished())
    assert cache.stats().entries == 1
    assert cache.stats().bytes == rc.entry_size([delta("a" * 10)], finished())


@pytest.mark.parametrize("reason", [r for r in FinishReason if r in rc.STORED_REASONS])
def test_normal_finishes_are_stored(reason: FinishReason) -> None:
    assert rc.ResponseCache(1 << 20).put(b"k", [delta()], finished(reason))


def test_a_time_limited_result_is_not_stored() -> None:
    cache = rc.ResponseCache(1 << 20)
    assert not cache.put(b"k", [delta()], finished(FinishReason.TIME_LIMIT))
    assert cache.stats().entries == 0


def test_clear_frees_everything_and_keeps_the_counters() -> None:
    cache = rc.ResponseCache(1 << 20)
    cache.put(b"a", [delta()], finished())
    cache.put(b"b", [delta()], finished(FinishReason.STOP_SEQUENCE, "\n"))
    cache.get(b"a")
    total = cache.stats().bytes
    assert cache.clear() == rc.Freed(2, total)
    assert cache.get(b"a") is None
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.hits) == (0, 0, 1)
    assert cache.clear() == rc.Freed(0, 0)
