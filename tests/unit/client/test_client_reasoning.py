"""Reasoning in the client: enable_thinking, chat_template_kwargs and reasoning_budget on chat
requests, `reasoning` in results, ReasoningDelta events (before the Delta of the same proto
delta) and their joining, reasoning_content in messages, and `llama-grpc chat --think`, against
a scripted in-process gRPC server on 127.0.0.1:0."""

from __future__ import annotations

import io
import sys
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from llama_grpc import (
    AsyncClient,
    ChatMessage,
    ChatStreamEvent,
    Client,
    Delta,
    Done,
    ReasoningDelta,
    StreamAccumulator,
    ToolCall,
    ToolCallDelta,
    cli,
)
from llama_grpc.client import build_chat_request, chat_messages
from llama_grpc.types import chat_events_from_proto, result_from_proto
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

# --- requests --------------------------------------------------------------------------------


def test_chat_request_carries_the_thinking_options() -> None:
    """enable_thinking and reasoning_budget are set; chat_template_kwargs goes out as JSON."""
    request = build_chat_request(
        pb.StreamGenerateRequest(),
        [("user", "Hi")],
        None,
        None,
        None,
        {"max_tokens": 5},
        (False, {"enable_thinking": True, "style": "café", "n": [1, 2]}, 64),
    )
    assert request.HasField("enable_thinking")
    assert request.enable_thinking is False
    assert request.chat_template_kwargs == '{"enable_thinking": true, "style": "café", "n": [1, 2]}'
    assert request.HasField("reasoning_budget")
    assert request.reasoning_budget == 64
    assert request.params.stopping.max_tokens == 5


@pytest.mark.parametrize("thinking", [None, (None, None, None)])
def test_chat_request_without_thinking_options_leaves_them_unset(thinking: Any) -> None:
    request = build_chat_request(
        pb.GenerateRequest(), [("user", "Hi")], None, None, None, {}, thinking
    )
    assert not request.HasField("enable_thinking")
    assert not request.HasField("reasoning_budget")
    assert request.chat_template_kwargs == ""


@pytest.mark.parametrize(("budget", "sent"), [(-1, -1), (0, 0), (1, 1)])
def test_budget_edges_are_sent_as_given(budget: int, sent: int) -> None:
    request = build_chat_request(
        pb.GenerateRequest(), [("user", "Hi")], None, None, None, {}, (True, {}, budget)
    )
    assert (request.enable_thinking, request.chat_template_kwargs, request.reasoning_budget) == (
        True,
        "{}",
        sent,
    )


@pytest.mark.parametrize(
    ("thinking", "error", "message"),
    [
        ((None, '{"a": 1}', None), TypeError, "chat_template_kwargs must be a mapping"),
        ((None, [("a", 1)], None), TypeError, "chat_template_kwargs must be a mapping"),
        ((None, None, -2), ValueError, "reasoning_budget must be -1 (no limit), 0 (no thinking)"),
        ((None, None, True), TypeError, "reasoning_budget must be an int, not True"),
        ((None, None, 1.5), TypeError, "reasoning_budget must be an int, not 1.5"),
    ],
)
def test_bad_thinking_options_raise(thinking: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_chat_request(pb.GenerateRequest(), [("user", "Hi")], None, None, None, {}, thinking)


# --- events, results, accumulation -----------------------------------------------------------


def test_a_delta_with_reasoning_and_text_gives_the_reasoning_first() -> None:
    message = pb.GenerationDelta(reasoning="so 2+2=4.", text="Four", token_ids=[7, 8])
    assert chat_events_from_proto(message) == [ReasoningDelta("so 2+2=4."), Delta("Four", (7, 8))]


def test_thinking_tokens_without_text_still_give_their_delta() -> None:
    message = pb.GenerationDelta(reasoning="Hmm", token_ids=[5])
    assert chat_events_from_proto(message) == [ReasoningDelta("Hmm"), Delta("", (5,))]


def test_reasoning_alone_gives_no_empty_delta() -> None:
    assert chat_events_from_proto(pb.GenerationDelta(reasoning="Hmm")) == [ReasoningDelta("Hmm")]


def test_a_delta_without_reasoning_is_unchanged() -> None:
    assert chat_events_from_proto(pb.GenerationDelta(text="a", token_ids=[1])) == [Delta("a", (1,))]
    assert chat_events_from_proto(pb.GenerationDelta()) == [Delta("", ())]


def test_reasoning_text_and_call_pieces_in_one_delta_keep_that_order() -> None:
    message = pb.GenerationDelta(
        reasoning="call it.",
        token_ids=[3],
        tool_calls=[pb.ToolCallDelta(index=0, id="call_1", name="f")],
    )
    assert chat_events_from_proto(message) == [
        ReasoningDelta("call it."),
        Delta("", (3,)),
        ToolCallDelta(0, "call_1", "f", ""),
    ]


def test_result_carries_reasoning_into_its_message() -> None:
    result = result_from_proto(
        pb.GenerateResponse(
            text="4",
            reasoning="2+2 is 4.",
            finish_reason=pb.FINISH_REASON_EOS,
            tool_calls=[pb.ToolCall(id="call_1", name="f", arguments="{}")],
        ),
        "req-1",
    )
    assert (result.text, result.reasoning) == ("4", "2+2 is 4.")
    assert result.message() == ChatMessage(
        "assistant", "4", tool_calls=(ToolCall("call_1", "f", "{}"),), reasoning_content="2+2 is 4."
    )


def test_result_without_reasoning_has_an_empty_one() -> None:
    result = result_from_proto(pb.GenerateResponse(text="Hi"), "req-1")
    assert result.reasoning == ""
    assert result.message() == ChatMessage("assistant", "Hi")


def test_accumulator_joins_the_reasoning_apart_from_the_text() -> None:
    acc = StreamAccumulator()
    events: list[ChatStreamEvent] = [
        ReasoningDelta("Let me "),
        Delta("", (1,)),
        ReasoningDelta("think."),
        Delta("", (2,)),
        Delta("Yes", (3,)),
        Delta(".", (4,)),
    ]
    for event in events:
        acc.add(event)
    assert (acc.reasoning, acc.text) == ("Let me think.", "Yes.")
    assert acc.message() == ChatMessage("assistant", "Yes.", reasoning_content="Let me think.")
    assert StreamAccumulator().reasoning == ""


# --- messages ----------------------------------------------------------------------------------


def test_message_with_reasoning_round_trips() -> None:
    message = ChatMessage("assistant", "4", reasoning_content="2+2 is 4.")
    as_dict = {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4."}
    assert message.to_dict() == as_dict
    assert ChatMessage.from_dict(as_dict) == message
    assert ChatMessage("assistant", "4").to_dict() == {"role": "assistant", "content": "4"}


def test_openai_shaped_reasoning_is_accepted_under_either_name() -> None:
    """reasoning_content (vLLM, DeepSeek's API, SMG) or reasoning (newer vLLM); the first wins."""
    assert ChatMessage.from_dict(
        {"role": "assistant", "content": None, "reasoning": "hm"}
    ) == ChatMessage("assistant", "", reasoning_content="hm")
    both = {"role": "assistant", "content": "x", "reasoning_content": "a", "reasoning": "b"}
    assert ChatMessage.from_dict(both).reasoning_content == "a"


def test_reasoning_content_reaches_the_proto_message() -> None:
    assert chat_messages(
        [
            {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4."},
            ChatMessage("assistant", "5", reasoning_content="no"),
            ("user", "ok"),
        ]
    ) == [
        pb.ChatMessage(role="assistant", content="4", reasoning_content="2+2 is 4."),
        pb.ChatMessage(role="assistant", content="5", reasoning_content="no"),
        pb.ChatMessage(role="user", content="ok"),
    ]


# --- the clients against a scripted server --------------------------------------------------


def _done_pb() -> pb.GenerationDone:
    return pb.GenerationDone(
        finish_reason=pb.FINISH_REASON_EOS,
        usage=pb.Usage(prompt_tokens=10, completion_tokens=4),
        request_id="req-1",
        seed=7,
    )


def _thinking_stream(
    reasoning: tuple[str, ...] = ("Let me\n", "think."), text: str = "Four."
) -> list[pb.StreamGenerateResponse]:
    """Thinking deltas (one token each), one delta with the end of thinking and the first
    text, then the Done."""
    deltas = [pb.GenerationDelta(reasoning=r, token_ids=[i + 1]) for i, r in enumerate(reasoning)]
    deltas.append(pb.GenerationDelta(reasoning="", text=text, token_ids=[9]))
    return [
        *(pb.StreamGenerateResponse(delta=d) for d in deltas),
        pb.StreamGenerateResponse(done=_done_pb()),
    ]


class ThinkingServicer(pb_grpc.LlmServiceServicer):
    """Answers Generate and StreamGenerate from queues of scripted answers; records requests."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.answers: deque[pb.GenerateResponse] = deque()
        self.streams: deque[list[pb.StreamGenerateResponse]] = deque()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Any:
        self.requests.append(request)
        return self.answers.popleft()

    def StreamGenerate(
        self, request: pb.StreamGenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StreamGenerateResponse]:
        self.requests.append(request)
        yield from self.streams.popleft()


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[tuple[str, ThinkingServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = ThinkingServicer()
    pb_grpc.add_LlmServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


@pytest.fixture
def servicer(thinking_server: tuple[str, ThinkingServicer]) -> Iterator[ThinkingServicer]:
    servicer = thinking_server[1]
    servicer.requests.clear()
    servicer.answers.clear()
    servicer.streams.clear()
    yield servicer
    assert not servicer.answers
    assert not servicer.streams


@pytest.fixture
def target(thinking_server: tuple[str, ThinkingServicer], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(cli.TARGET_ENV, thinking_server[0])
    monkeypatch.delenv("NO_COLOR", raising=False)
    return thinking_server[0]


def test_sync_chat_and_stream_chat(target: str, servicer: ThinkingServicer) -> None:
    """chat() sends the options and returns the reasoning; stream_chat() yields each delta's
    ReasoningDelta before its Delta and joins both; the next turn sends reasoning_content."""
    servicer.answers.append(pb.GenerateResponse(text="4", reasoning="2+2.", token_ids=[1]))
    servicer.streams.append(_thinking_stream())
    with Client(target, timeout=10) as client:
        result = client.chat(
            [("user", "2+2?")],
            enable_thinking=True,
            chat_template_kwargs={"reasoning_effort": "low"},
            reasoning_budget=128,
        )
        stream = client.stream_chat([("user", "2+2?"), result.message()])
        events = list(stream)
    assert (result.text, result.reasoning) == ("4", "2+2.")
    assert events[:-1] == [
        ReasoningDelta("Let me\n"),
        Delta("", (1,)),
        ReasoningDelta("think."),
        Delta("", (2,)),
        Delta("Four.", (9,)),
    ]
    assert isinstance(events[-1], Done)
    assert (stream.reasoning, stream.text) == ("Let me\nthink.", "Four.")
    assert stream.message() == ChatMessage("assistant", "Four.", reasoning_content="Let me\nthink.")
    first, second = servicer.requests
    assert (first.enable_thinking, first.chat_template_kwargs, first.reasoning_budget) == (
        True,
        '{"reasoning_effort": "low"}',
        128,
    )
    assert not second.HasField("enable_thinking")
    assert not second.HasField("reasoning_budget")
    assert second.chat_template_kwargs == ""
    assert list(second.messages)[1] == pb.ChatMessage(
        role="assistant", content="4", reasoning_content="2+2."
    )


async def test_async_chat_and_stream_chat(target: str, servicer: ThinkingServicer) -> None:
    servicer.answers.append(pb.GenerateResponse(text="4", reasoning="2+2."))
    servicer.streams.append(_thinking_stream(("a", "b"), "c"))
    async with AsyncClient(target, timeout=10) as client:
        result = await client.chat([("user", "q")], enable_thinking=False, reasoning_budget=0)
        stream = client.stream_chat([("user", "q")], chat_template_kwargs={"x": 1})
        events = [event async for event in stream]
    assert result.reasoning == "2+2."
    assert [e for e in events if isinstance(e, ReasoningDelta)] == [
        ReasoningDelta("a"),
        ReasoningDelta("b"),
    ]
    assert (stream.reasoning, stream.text) == ("ab", "c")
    assert stream.message() == ChatMessage("assistant", "c", reasoning_content="ab")
    first, second = servicer.requests
    assert (first.enable_thinking, first.reasoning_budget) == (False, 0)
    assert first.HasField("enable_thinking")
    assert second.chat_template_kwargs == '{"x": 1}'


# --- llama-grpc chat --------------------------------------------------------------------------


def test_chat_think_flags_reach_the_request_and_thinking_is_prefixed(
    target: str, servicer: ThinkingServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a terminal: each thinking line starts with "[thinking] " (newlines at its start and
    end dropped, blank lines kept), then the answer on its own line."""
    servicer.streams.append(_thinking_stream(("\nLet me", "\n\nthink.\n"), "Four."))
    assert cli.main(["chat", "2+2?", "--think", "--reasoning-budget", "64"]) == 0
    assert capsys.readouterr() == (
        "[thinking] Let me\n[thinking]\n[thinking] think.\nFour.\n",
        "",
    )
    (request,) = servicer.requests
    assert (request.enable_thinking, request.reasoning_budget) == (True, 64)
    assert request.HasField("enable_thinking")


def test_chat_no_think_and_no_flags(
    target: str, servicer: ThinkingServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    servicer.streams.append(_thinking_stream((), "Hi."))
    servicer.streams.append(_thinking_stream((), "Hi."))
    assert cli.main(["chat", "Hi", "--no-think"]) == 0
    assert cli.main(["chat", "Hi"]) == 0
    assert capsys.readouterr().out == "Hi.\nHi.\n"
    no_think, default = servicer.requests
    assert no_think.HasField("enable_thinking")
    assert no_think.enable_thinking is False
    assert not default.HasField("enable_thinking")
    assert not default.HasField("reasoning_budget")


def test_chat_on_a_terminal_dims_the_thinking_between_markers(
    target: str,
    servicer: ThinkingServicer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    servicer.streams.append(_thinking_stream(("Let me\n", "think."), "Four."))
    monkeypatch.setattr(cli, "_styled_output", lambda: True)
    assert cli.main(["chat", "2+2?"]) == 0
    assert capsys.readouterr().out == "\x1b[2m<think>\nLet me\nthink.\n</think>\x1b[0m\nFour.\n"


def test_chat_hide_thinking_prints_only_the_answer(
    target: str, servicer: ThinkingServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    servicer.streams.append(_thinking_stream())
    assert cli.main(["chat", "2+2?", "--hide-thinking"]) == 0
    assert capsys.readouterr().out == "Four.\n"


def test_chat_thinking_cut_off_before_any_text_still_ends_its_line(
    target: str, servicer: ThinkingServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    servicer.streams.append(_thinking_stream(("Still thinking",), ""))
    assert cli.main(["chat", "2+2?"]) == 0
    assert capsys.readouterr().out == "[thinking] Still thinking\n"


def test_chat_conversation_keeps_the_reasoning_in_its_history(
    target: str,
    servicer: ThinkingServicer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    servicer.streams.extend([_thinking_stream(("hm",), "A."), _thinking_stream((), "B.")])
    monkeypatch.setattr(sys, "stdin", io.StringIO("one\ntwo\n"))
    assert cli.main(["chat", "--reasoning-budget", "0"]) == 0
    assert capsys.readouterr().out == "[thinking] hm\nA.\nB.\n"
    assert [list(r.messages) for r in servicer.requests][1] == [
        pb.ChatMessage(role="user", content="one"),
        pb.ChatMessage(role="assistant", content="A.", reasoning_content="hm"),
        pb.ChatMessage(role="user", content="two"),
    ]
    assert all(r.reasoning_budget == 0 for r in servicer.requests)


def test_chat_bad_reasoning_budget_is_a_usage_error(
    target: str, servicer: ThinkingServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["chat", "Hi", "--reasoning-budget", "-2"]) == 2
    assert capsys.readouterr().err == (
        "error: --reasoning-budget: -1 (no limit), 0 (no thinking) or more\n"
    )
    assert servicer.requests == []
