"""min_tokens in the core (what the sampler is told to suppress, stop strings deferred) and the
cached prompt count every delta carries (no model; the sampler's own ban is tested in e2e)."""

from __future__ import annotations

from llama_grpc_server.core.requests.request import (
    Finished,
    FinishReason,
    StoppingParams,
    TokenDelta,
)
from llama_grpc_server.core.requests.text import TextAssembler
from llama_grpc_server.testing import FakeRunner
from tests.support.scheduler import PIECES, alone, drive, finals, make, req


def test_sampler_spec_suppresses_eog_and_stop_tokens_until_min_tokens() -> None:
    """The sampler of a request with min_tokens gets its stop tokens and the model's EOG ids;
    ignore_eos leaves EOG out; without min_tokens nothing is suppressed."""
    cases = [
        ({"min_tokens": 3, "stop_token_ids": frozenset({40, 7})}, 3, (5, 6, 7, 40)),
        ({"min_tokens": 3, "stop_token_ids": frozenset({40}), "ignore_eos": True}, 3, (40,)),
        ({"stop_token_ids": frozenset({40})}, 0, ()),
    ]
    for fields, min_tokens, suppressed in cases:
        s, runner = make(n_parallel=1, eog=frozenset({5, 6})), FakeRunner()
        s.add(req("a", 20, 4, **fields))
        drive(s, runner)
        [spec] = [spec for plan in runner.plans for spec in plan.open_samplers]
        assert (spec.min_tokens, spec.suppressed) == (min_tokens, suppressed), fields


def test_stop_strings_are_looked_for_after_min_tokens() -> None:
    """A stop string completed by the first min_tokens tokens does not end the request, and
    nothing is held back meanwhile; without min_tokens the same one ends it at once."""
    toks = alone(20, 6, "a")
    stop = PIECES[toks[1]].decode()
    assert stop not in "".join(PIECES[t].decode() for t in toks[2:])  # it does not come again
    s, runner = make(n_parallel=1), FakeRunner()
    s.add(req("a", 20, 6, stop=(stop,)))
    done = finals(drive(s, runner))["a"]
    assert isinstance(done, Finished) and done.reason is FinishReason.STOP_SEQUENCE
    s, runner = make(n_parallel=1), FakeRunner()
    s.add(req("a", 20, 6, stop=(stop,), min_tokens=2))
    events = drive(s, runner)
    text = "".join(e.text for _, e in events if isinstance(e, TokenDelta))
    done = finals(events)["a"]
    assert isinstance(done, Finished) and done.reason is FinishReason.MAX_TOKENS
    assert text == "".join(PIECES[t].decode() for t in toks)


def test_text_assembler_without_stop_search_holds_nothing_back() -> None:
    pieces = [b"a", b"b", b"c"]
    text = TextAssembler(pieces, ("bc",))
    assert text.push(0, find_stops=False) == ("a", "")
    assert text.push(1, find_stops=False) == ("b", "")  # "b" could start "bc": not held back
    assert text.push(2) == ("c", "")  # "bc" spans the boundary: only the text after is searched
    text = TextAssembler(pieces, ("bc",))
    assert [text.push(t) for t in (0, 1, 2)] == [("a", ""), ("", ""), ("", "bc")]


def test_deltas_carry_the_cached_prompt_tokens() -> None:
    """Every token delta of a repeated prompt reports the prefix served from cache, the same
    number the Finished usage reports."""
    s, runner = make(n_parallel=1), FakeRunner()
    s.add(req("a", 40, 3))
    first = drive(s, runner)
    s.add(req("a", 40, 3))
    second = drive(s, runner)
    for events, cached in ((first, 0), (second, 39)):
        deltas = [e for _, e in events if isinstance(e, TokenDelta)]
        done = finals(events)["a"]
        assert isinstance(done, Finished) and done.usage.cached_prompt_tokens == cached
        assert [d.cached_prompt_tokens for d in deltas] == [cached] * 3


def test_min_tokens_defaults_to_zero() -> None:
    assert StoppingParams().min_tokens == 0
