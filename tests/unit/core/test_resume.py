"""Resumable streams without a model (docs/api.md#resumable-streams): a request resumed with the
first N tokens of an answer (GenerationRequest.resumed) goes on exactly as the undisturbed one,
for every cut N of short answers whose end is a stop string spanning the seam, min_tokens,
max_tokens with text held back, a stop token or an end of generation; the deltas' positions
(index); the replay of the text state; the engine stream's merging; the chat transforms
resumed; and the gRPC surface over the FakeEngine (validation naming params.resume.token_ids)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.core import response_cache
from llama_grpc_server.core.reasoning.formats import THINK
from llama_grpc_server.core.reasoning.split import ReasoningSplitter
from llama_grpc_server.core.reasoning.stream import with_reasoning
from llama_grpc_server.core.requests.outputs import Outputs
from llama_grpc_server.core.requests.request import (
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    Request,
    Resumed,
    SamplingParams,
    SpeculativeMode,
    SpeculativeParams,
    StoppingParams,
    TokenDelta,
    Usage,
)
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.core.tools.formats import format_named
from llama_grpc_server.core.tools.stream import ToolSession, with_tool_calls
from llama_grpc_server.core.tools.types import ToolSpec
from llama_grpc_server.engine.streams import EngineStream
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_server.rpc.v1.servicer import _Chat
from llama_grpc_server.testing import EOS_ID, N_VOCAB, PIECES, FakeEngine, FakeRunner, encode
from tests.support.scheduler import Clock, drive
from tests.support.servicer_fake import SETTINGS, collect, details
from tests.unit.core.test_tool_formats import CORPUS as TOOL_CORPUS
from tests.unit.core.test_tool_formats import TOOLS as TOOL_CORPUS_TOOLS

GREEDY = SamplingParams(temperature=0.0)
PROMPT = (1, *encode("Q: "))
STOP_TOKEN = 200  # a byte token the scripts never use as text

# name -> (the answer's script, then EOS; its stopping)
CASES: dict[str, tuple[list[int], StoppingParams]] = {
    "eos": (encode("Hello, wörld!"), StoppingParams(max_tokens=64)),
    "stop_string_spanning_the_seam": (
        encode("abc<END>xyz"),
        StoppingParams(max_tokens=64, stop=("<END>",)),
    ),
    "min_tokens": (
        encode("ab STOP cd STOP ef"),
        StoppingParams(max_tokens=64, stop=("STOP",), min_tokens=5),
    ),
    "max_tokens_with_text_held_back": (
        encode("abcdefghij"),
        StoppingParams(max_tokens=6, stop=("fgh",)),
    ),
    "stop_token_after_the_seam": (
        [*encode("abc"), STOP_TOKEN, *encode("def")],
        StoppingParams(max_tokens=64, stop_token_ids=frozenset({STOP_TOKEN})),
    ),
}


def scheduler(**limits: Any) -> tuple[Scheduler, FakeRunner]:
    clock = Clock()
    scheduler = Scheduler(
        SchedulerLimits(2, 256, 64, 16, 8, **limits),
        pieces=PIECES,
        eog_ids=frozenset({EOS_ID}),
        clock_ns=clock.tick_ns,
        monotonic=clock.monotonic,
    )
    return scheduler, FakeRunner(N_VOCAB, eos_id=EOS_ID)


def submit(  # noqa: PLR0917  # the tests' call sites read best positionally
    s: Scheduler,
    runner: FakeRunner,
    rid: str,
    script: Sequence[int],
    stopping: StoppingParams,
    resumed: Sequence[int] = (),
    **fields: Any,
) -> Request:
    spec = GenerationRequest(rid, PROMPT, GREEDY, stopping, resumed=tuple(resumed), **fields)
    runner.pending_scripts[spec.key] = list(script)
    request = Request(spec)
    s.add(request)
    return request


def events_of(rid: str, emitted: list[tuple[Request, Event]]) -> list[Event]:
    return [e for r, e in emitted if r.request_id == rid]


def run(
    script: Sequence[int], stopping: StoppingParams, resumed: Sequence[int] = (), **fields: Any
) -> list[Event]:
    s, runner = scheduler()
    submit(s, runner, "r", script, stopping, resumed, **fields)
    return events_of("r", drive(s, runner))


def deltas(events: list[Event]) -> list[tuple[int, tuple[int, ...], str]]:
    return [(e.index, e.token_ids, e.text) for e in events if isinstance(e, TokenDelta)]


def outcome(events: list[Event]) -> tuple[FinishReason, str, int | None, int, int]:
    done = events[-1]
    assert isinstance(done, Finished), done
    usage = done.usage
    return (
        done.reason,
        done.matched_stop,
        done.matched_token_id,
        usage.prompt_tokens,
        usage.completion_tokens,
    )


def answer_tokens(events: list[Event]) -> list[int]:
    return [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]


def cases() -> list[tuple[str, int]]:
    out = []
    for name, (script, stopping) in CASES.items():
        n = len(answer_tokens(run(script, stopping)))
        out += [(name, cut) for cut in range(n + 1)]
    return out


@pytest.mark.parametrize(("name", "cut"), cases())
def test_a_resumed_answer_is_the_tail_of_the_undisturbed_one(name: str, cut: int) -> None:
    """Cut after `cut` tokens and resumed with them: the deltas from position `cut` on are the
    undisturbed run's (tokens, text with what was held back at the seam, positions), the finish
    and usage are the same, the Resumed event carries exactly the text the caller had (that of
    the deltas with tokens before the cut), and every position arrives once."""
    script, stopping = CASES[name]
    whole = run(script, stopping)
    tokens = answer_tokens(whole)
    resumed = run(script, stopping, tokens[:cut])
    had = [d for d in deltas(whole) if d[1] and d[0] < cut]
    if cut:
        assert resumed[0] == Resumed("".join(text for _, _, text in had))
    else:
        assert not any(isinstance(e, Resumed) for e in resumed)
    assert deltas(resumed) == [d for d in deltas(whole) if d[0] >= cut]
    assert outcome(resumed) == outcome(whole)
    pieces = [*had, *deltas(resumed)]
    positions = [i for index, ids, _ in pieces for i in range(index, index + len(ids))]
    assert positions == list(range(len(tokens)))


def test_the_cases_end_as_meant() -> None:
    """The table's answers end the way their names say (so the cuts cover those seams)."""
    reasons = {name: outcome(run(*case))[0] for name, case in CASES.items()}
    assert reasons == {
        "eos": FinishReason.EOS,
        "stop_string_spanning_the_seam": FinishReason.STOP_SEQUENCE,
        "min_tokens": FinishReason.STOP_SEQUENCE,
        "max_tokens_with_text_held_back": FinishReason.MAX_TOKENS,
        "stop_token_after_the_seam": FinishReason.STOP_TOKEN,
    }
    script, stopping = CASES["min_tokens"]
    assert "".join(d[2] for d in deltas(run(script, stopping))) == "ab STOP cd "
    script, stopping = CASES["max_tokens_with_text_held_back"]
    assert deltas(run(script, stopping))[-2:] == [(5, (encode("f")[0],), ""), (6, (), "f")]


def test_resumed_tokens_ending_the_answer_finish_it_at_once() -> None:
    """A resume whose last token is the end of generation or a stop token (not output: usage
    leaves it out), or which reaches max_tokens or completes a stop string, finishes with that
    reason and computes nothing; the text held back at the end is sent."""
    eos = run(encode("abc"), StoppingParams(max_tokens=64), [*encode("ab"), EOS_ID])
    assert eos[0] == Resumed("ab") and len(eos) == 2
    assert outcome(eos) == (FinishReason.EOS, "", EOS_ID, len(PROMPT), 2)
    stop = run(encode("abc"), StoppingParams(max_tokens=64, stop_token_ids=frozenset({9})), [9])
    assert outcome(stop) == (FinishReason.STOP_TOKEN, "", 9, len(PROMPT), 0)
    script, stopping = CASES["max_tokens_with_text_held_back"]
    full = run(script, stopping, script[:6])
    assert full == [Resumed("abcde"), TokenDelta((), "f", index=6), full[-1]]
    assert outcome(full)[0] is FinishReason.MAX_TOKENS
    script, stopping = CASES["stop_string_spanning_the_seam"]
    matched = run(script, stopping, script[:8])
    assert matched[0] == Resumed("abc") and outcome(matched)[:2] == (
        FinishReason.STOP_SEQUENCE,
        "<END>",
    )
    assert len(matched) == 2


@pytest.mark.parametrize(
    ("name", "resumed", "field"),
    [
        ("stop_string_spanning_the_seam", [*encode("abc<END>"), 5], "params.resume.token_ids[8]"),
        ("max_tokens_with_text_held_back", encode("abcdefg"), "params.resume.token_ids[6]"),
        ("eos", [*encode("He"), EOS_ID, *encode("l")], "params.resume.token_ids[3]"),
    ],
)
def test_tokens_past_the_end_of_the_answer_are_refused(
    name: str, resumed: list[int], field: str
) -> None:
    """A resume that goes on after the answer ended (a stop string, max_tokens, an end of
    generation) is INVALID_ARGUMENT naming the first token past the end; nothing is computed."""
    script, stopping = CASES[name]
    s, runner = scheduler()
    submit(s, runner, "r", script, stopping, resumed)
    events = events_of("r", drive(s, runner))
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert isinstance(events[0].error, errors.InvalidRequest)
    assert events[0].error.field == field
    assert not runner.plans or not any(p.chunks for p in runner.plans)
    assert not runner.samplers  # no sampler left open


def test_the_sampler_gets_the_resumed_tokens_and_the_usage_counts_the_prompt_only() -> None:
    """The sampler opens with the resumed tokens (the runner's script goes on after them); a
    resume on the replica that served the cut answer finds prompt + resumed tokens cached, and
    cached_prompt_tokens counts the prompt's only (like prompt_tokens)."""
    script, stopping = CASES["eos"]
    s, runner = scheduler()
    submit(s, runner, "a", script, stopping)
    whole = events_of("a", drive(s, runner))
    tokens = answer_tokens(whole)
    submit(s, runner, "b", script, stopping, tokens[:7])
    resumed = events_of("b", drive(s, runner))
    opened = [
        spec for plan in runner.plans for spec in plan.open_samplers if spec.request_id == "b"
    ]
    assert [spec.resumed for spec in opened] == [tuple(tokens[:7])]
    fed = [c for plan in runner.plans for c in plan.chunks if c.request_id == "b"]
    assert fed[0].start_pos == len(PROMPT) + 6  # only the last resumed token is recomputed
    done = resumed[-1]
    assert isinstance(done, Finished)
    assert done.usage == Usage(len(PROMPT), len(tokens), len(PROMPT))
    assert answer_tokens(resumed) == tokens[7:]


def test_speculation_drafts_from_the_resumed_tokens_too() -> None:
    """Prompt lookup sees the resumed tokens (a repetitive answer drafts at once after the
    seam) and the output is the same."""
    script = encode("abcabcabcabcabcabcabcabc")
    stopping = StoppingParams(max_tokens=64)
    on = SpeculativeParams(SpeculativeMode.ON)
    whole = run(script, stopping, speculative=on)
    resumed = run(script, stopping, script[:12], speculative=on)
    assert answer_tokens(resumed) == script[12:]
    done = resumed[-1]
    assert isinstance(done, Finished) and done.usage.accepted_draft_tokens >= 6
    assert outcome(resumed) == outcome(whole)


def test_preempted_resumed_request_still_gives_the_tail() -> None:
    """Under KV pressure a resumed request is preempted and re-prefilled like any other."""
    script, stopping = CASES["eos"]
    tokens = answer_tokens(run(script, stopping))
    s, runner = scheduler()
    runner.kv_cells = 2 * len(PROMPT) + 20
    submit(s, runner, "a", encode("0123456789"), StoppingParams(max_tokens=10))
    submit(s, runner, "b", script, stopping, tokens[:3])
    emitted = drive(s, runner)
    assert s.counters.preemptions >= 1
    assert answer_tokens(events_of("b", emitted)) == tokens[3:]


# -- Outputs ---------------------------------------------------------------------------------------


def test_judge_gives_each_delta_its_position() -> None:
    outputs = Outputs(PIECES, frozenset({EOS_ID}), 256)
    request = Request(GenerationRequest("r", PROMPT, GREEDY, StoppingParams(max_tokens=8)))
    outputs.open(request)
    got = [outputs.judge(request, t, None).delta for t in encode("hey")]
    assert [(d.index, d.text) for d in got if d is not None] == [(0, "h"), (1, "e"), (2, "y")]


def test_replay_keeps_held_back_text_and_a_split_character() -> None:
    """The replay releases what the stream had released; a possible stop string and the first
    bytes of a character stay held, and go out with the next token's delta."""
    outputs = Outputs(PIECES, frozenset({EOS_ID}), 256)
    text = encode("x<Eé")
    stopping = StoppingParams(max_tokens=8, stop=("<END>",))
    spec = GenerationRequest("r", PROMPT, GREEDY, stopping, resumed=tuple(text[:-1]))
    request = Request(spec)
    outputs.open(request)
    replay = outputs.replay(request)
    assert (replay.text, replay.reason) == ("x", None)
    assert request.num_output == len(text) - 1
    delta = outputs.judge(request, text[-1], None).delta
    assert delta is not None and (delta.index, delta.text) == (len(text) - 1, "<Eé")


def test_a_resumed_request_is_never_answered_from_or_stored_in_the_response_cache() -> None:
    seeded = GenerationRequest("r", PROMPT, SamplingParams(temperature=0.8, seed=1))
    assert response_cache.is_cacheable(seeded)
    assert not response_cache.is_cacheable(dataclasses.replace(seeded, resumed=(5,)))


# -- the engine stream ---------------------------------------------------------------------------


class _Engine:
    def wake(self) -> None:
        return

    def cancel(self, *_: Any, **__: Any) -> None:
        return


async def test_a_slow_reader_gets_merged_deltas_but_the_end_apart() -> None:
    """Deltas with tokens waiting together come out as one (the first one's index); the
    held-back text flushed at the end (no tokens) never joins them, nor does Resumed."""
    request = Request(GenerationRequest("r", PROMPT, GREEDY))
    stream = EngineStream(_Engine(), request, asyncio.get_running_loop())  # type: ignore[arg-type]
    events: list[Event] = [
        Resumed("ab"),
        TokenDelta((10,), "c", index=2),
        TokenDelta((11,), "d", index=3),
        TokenDelta((), "e", index=4),
        Finished(FinishReason.EOS, Usage(3, 4, 0), None, 0),  # type: ignore[arg-type]
    ]
    for event in events:
        stream.queue.put_nowait(event)
    got = [event async for event in stream]
    assert got[0] == Resumed("ab")
    assert got[1] == TokenDelta((10, 11), "cd", index=2)
    assert got[2] == TokenDelta((), "e", index=4)
    assert isinstance(got[3], Finished)


# -- chat: thinking and tool calls go on across the seam ---------------------------------------


TOOLS = (ToolSpec("get_time", "The time", {"type": "object", "properties": {}}),)
CHAT_TEXT = (
    '<think>\nThe user wants the time.\n</think>\n\n{"name": "get_time", '
    '"arguments": {"tz": "UTC"}}'
)


def chat() -> _Chat:
    parser = format_named("hermes").parser(TOOLS)
    return _Chat(ReasoningSplitter(THINK, opened=False), ToolSession(parser, "req-1"))


async def chat_events(pieces: Sequence[str], start: int, transforms: _Chat) -> list[TokenDelta]:
    """The chat transforms over one delta per piece from `start` on, then the end."""

    async def source() -> AsyncIterator[TokenDelta | Finished]:
        for i in range(start, len(pieces)):
            yield TokenDelta((i + 3,), pieces[i], index=i)
        yield Finished(FinishReason.EOS, Usage(3, len(pieces), 0), None, 0)  # type: ignore[arg-type]

    events: AsyncIterator[TokenDelta | Finished] = source()
    assert transforms.splitter is not None and transforms.session is not None
    events = with_tool_calls(with_reasoning(events, transforms.splitter), transforms.session)
    out = [e async for e in events]
    done = out[-1]
    assert isinstance(done, Finished) and done.reason is FinishReason.TOOL_CALLS
    assert [c.name for c in done.tool_calls] == ["get_time"]
    return [e for e in out if isinstance(e, TokenDelta)]


def joined(events: Sequence[TokenDelta]) -> tuple[str, str, dict[int, tuple[str, str, str]]]:
    calls: dict[int, tuple[str, str, str]] = {}
    for event in events:
        for piece in event.tool_calls:
            id_, name, args = calls.get(piece.index, ("", "", ""))
            calls[piece.index] = (id_ + piece.id, name + piece.name, args + piece.arguments)
    text = "".join(e.text for e in events)
    return "".join(e.reasoning for e in events), text, calls


@pytest.mark.parametrize("cut", range(0, len(CHAT_TEXT) + 1, 3))
async def test_thinking_and_a_tool_call_go_on_across_the_seam(cut: int) -> None:
    """Cut anywhere (in the thinking, its closer, or inside the call's JSON), the transforms
    replay the text the caller had and go on: thinking, answer text and the call's id, name
    and arguments, put together, are the undisturbed ones."""
    pieces = list(CHAT_TEXT)  # a token per character
    whole = await chat_events(pieces, 0, chat())
    had = [e for e in whole if e.token_ids and e.index < cut]
    transforms = chat()
    transforms.resume("".join(pieces[:cut]))
    after = await chat_events(pieces, cut, transforms)
    assert joined([*had, *after]) == joined(whole)
    assert joined(whole)[2] == {0: (joined(whole)[2][0][0], "get_time", '{"tz": "UTC"}')}


# -- over gRPC with the FakeEngine -----------------------------------------------------------------


@pytest.fixture
async def server(engine: FakeEngine) -> AsyncIterator[RunningServer]:
    async with start_server(SETTINGS, lambda: engine) as running:
        assert await running.wait_loaded()
        yield running


def positions(messages: Sequence[Any]) -> list[int]:
    """The answer positions the deltas carry (a slow reader's deltas come merged)."""
    deltas = [m.delta for m in messages if m.WhichOneof("event") == "delta"]
    return [d.index + i for d in deltas for i in range(len(d.token_ids))]


def resume(*token_ids: int, max_tokens: int | None = None) -> pb.GenerationParams:
    params = pb.GenerationParams(resume=pb.Resume(token_ids=token_ids))
    if max_tokens is not None:
        params.stopping.max_tokens = max_tokens
    return params


async def test_stream_deltas_carry_their_index_and_a_resume_goes_on(stub: Any) -> None:
    """ "hello" reversed is "olleh" then EOS: each delta's index is its first token's position;
    resumed after N tokens, the stream starts at index N and the answer, put together, is the
    same."""
    whole = await collect(stub.StreamGenerate(pb.StreamGenerateRequest(prompt="hello")))
    tokens = [t for m in whole[:-1] for t in m.delta.token_ids]
    assert positions(whole) == list(range(5))
    for cut in range(6):
        request = pb.StreamGenerateRequest(prompt="hello", params=resume(*tokens[:cut]))
        got = await collect(stub.StreamGenerate(request))
        assert positions(got) == list(range(cut, 5))
        assert not got[:-1] or got[0].delta.index == cut
        assert [t for m in got[:-1] for t in m.delta.token_ids] == tokens[cut:]
        assert "olleh"[:cut] + "".join(m.delta.text for m in got[:-1]) == "olleh"
        assert got[-1].done.usage.completion_tokens == 5
        assert got[-1].done.finish_reason == pb.FINISH_REASON_EOS
    unary = await stub.Generate(pb.GenerateRequest(prompt="hello", params=resume(*tokens[:2])))
    assert (unary.text, unary.usage.completion_tokens) == ("leh", 5)
    tokens_request = pb.GenerateTokensRequest(token_ids=[1, *encode("abc")])
    gen = await collect(stub.GenerateTokens(tokens_request))
    assert positions(gen) == [0, 1, 2]
    tokens_request.params.CopyFrom(resume(*encode("c")))
    gen = await collect(stub.GenerateTokens(tokens_request))
    assert positions(gen) == [1, 2] and gen[0].delta.index == 1
    assert [t for m in gen[:-1] for t in m.delta.token_ids] == encode("ba")
    assert gen[-1].done.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (resume(50, 10**6), "params.resume.token_ids[1]"),
        (resume(50, 51, 52, 53, max_tokens=3), "params.resume.token_ids"),
    ],
)
async def test_a_bad_resume_is_invalid_argument_naming_the_field(
    stub: Any, params: pb.GenerationParams, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(pb.GenerateRequest(prompt="hi", params=params))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details(caught.value)["BadRequest"].field_violations[0].field == field


async def test_a_chat_tool_call_resumed_inside_its_arguments_is_the_same(
    stub: Any, engine: FakeEngine
) -> None:
    """A chat answer that is a tool call (the generic format's bare JSON), cut inside its
    arguments and resumed with the same x-request-id: the same tool call, the same id."""
    call = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
    engine.script = lambda request: encode(call)
    engine.token_delay_s = 0.002  # a reader that keeps up: a delta per token, mostly
    tool = pb.Tool(name="get_time", parameters=json.dumps({"type": "object", "properties": {}}))
    message = pb.ChatMessage(role="user", content="time?")
    metadata = (("x-request-id", "chat-1"),)

    async def ask(params: pb.GenerationParams | None = None) -> list[Any]:
        request = pb.StreamGenerateRequest(
            messages=[message], tools=[tool], chat_template="chatml", params=params
        )
        return await collect(stub.StreamGenerate(request, metadata=metadata))

    whole = await ask()
    assert whole[-1].done.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    tokens = [t for m in whole[:-1] for t in m.delta.token_ids]
    expected = calls_of(whole)
    assert expected == [("get_time", '{"tz": "UTC"}')] and len(ids_of(whole)) == 1
    # a caller has whole deltas (a slow reader's are merged): cut where one ends
    ends = sorted({m.delta.index + len(m.delta.token_ids) for m in whole[:-1]})
    cuts = [cut for cut in ends if cut % 7 == 3 or cut == ends[-1]]
    assert len(cuts) >= 3
    for cut in cuts:
        had = [m for m in whole[:-1] if m.delta.token_ids and m.delta.index < cut]
        got = await ask(resume(*tokens[:cut]))
        assert got[-1].done.finish_reason == pb.FINISH_REASON_TOOL_CALLS, cut
        assert calls_of([*had, *got]) == expected, cut
        assert ids_of([*had, *got]) == ids_of(whole), cut


def calls_of(messages: Sequence[Any]) -> list[tuple[str, str]]:
    pieces = [p for m in messages if m.WhichOneof("event") == "delta" for p in m.delta.tool_calls]
    names = {p.index: p.name for p in pieces if p.name}
    return [(names[i], "".join(p.arguments for p in pieces if p.index == i)) for i in sorted(names)]


def ids_of(messages: Sequence[Any]) -> list[str]:
    return [
        p.id
        for m in messages
        if m.WhichOneof("event") == "delta"
        for p in m.delta.tool_calls
        if p.id
    ]


# -- what the replay relies on: a parser's output so far depends on the text, not its split ----


def _released(fmt: str, chunks: Sequence[str]) -> list[tuple[str, dict[int, tuple[str, str]]]]:
    """What a format's parser has released after each chunk: text, and each call's name and
    arguments so far."""
    parser = format_named(fmt).parser(TOOL_CORPUS_TOOLS)
    text, out = "", []
    calls: dict[int, tuple[str, str]] = {}
    for chunk in chunks:
        parsed = parser.push(chunk)
        text += parsed.text
        for piece in parsed.calls:
            name, args = calls.get(piece.index, ("", ""))
            calls[piece.index] = (name + piece.name, args + piece.arguments)
        out.append((text, dict(calls)))
    return out


def test_every_format_releases_a_prefix_the_same_in_one_push_or_many() -> None:
    """_Chat.resume pushes the resumed text at once, where the cut stream pushed it delta by
    delta: for every output of the formats' corpus and every prefix, the parser has released
    the same text and call pieces either way (so the resumed stream goes on where the caller's
    left off). The reasoning splitter too."""
    for fmt, output in TOOL_CORPUS:
        by_char = _released(fmt, list(output))
        for cut in range(1, len(output) + 1):
            assert _released(fmt, [output[:cut]])[-1] == by_char[cut - 1], (fmt, output, cut)
    for opened in (False, True):
        splitter = ReasoningSplitter(THINK, opened=opened)
        thinking, answer = "", ""
        for cut, char in enumerate(CHAT_TEXT, 1):
            t, a = splitter.push(char)
            thinking, answer = thinking + t, answer + a
            once = ReasoningSplitter(THINK, opened=opened).push(CHAT_TEXT[:cut])
            assert once == (thinking, answer), cut
