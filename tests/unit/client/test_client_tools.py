"""Tool calling in the client: tools, tool_choice and messages as protobuf, tool calls in
results, ToolCallDelta events in chat streams and their joining, the tool-result loop, and the
`llama-grpc chat` command, against a scripted in-process gRPC server on 127.0.0.1:0."""

from __future__ import annotations

import io
import json
import sys
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from llama_grpc import (
    AsyncChatStream,
    AsyncClient,
    ChatMessage,
    ChatStream,
    Client,
    Delta,
    Done,
    StreamAccumulator,
    Tool,
    ToolCall,
    ToolCallDelta,
    Usage,
    cli,
)
from llama_grpc.client import build_chat_request, chat_messages, tool_choice_message, tool_message
from llama_grpc.types import Timings, chat_events_from_proto, result_from_proto
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER_OPENAI = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": WEATHER_SCHEMA,
    },
}
WEATHER_PB = pb.Tool(
    name="get_weather",
    description="Current weather of a city",
    parameters=json.dumps(WEATHER_SCHEMA),
)
TOKYO = '{"city": "Tokyo"}'


# --- tools and tool_choice as protobuf -----------------------------------------------------


@pytest.mark.parametrize(
    "tool",
    [
        WEATHER_OPENAI,
        WEATHER_OPENAI["function"],  # plain {"name", "description", "parameters"}
        {"type": "function", **WEATHER_OPENAI["function"]},  # flat (OpenAI's Responses API)
        Tool("get_weather", "Current weather of a city", WEATHER_SCHEMA),
        Tool("get_weather", "Current weather of a city", json.dumps(WEATHER_SCHEMA)),
    ],
)
def test_every_tool_shape_becomes_the_same_message(tool: Any) -> None:
    """OpenAI's shape, a plain dict and a Tool (schema dict or JSON text) give one Tool."""
    assert tool_message(tool) == WEATHER_PB


def test_a_tool_without_description_or_parameters_sends_empty_fields() -> None:
    """No description and no parameters: both fields empty (a function without arguments)."""
    assert tool_message(Tool("now")) == pb.Tool(name="now", description="", parameters="")
    assert tool_message({"name": "now"}) == pb.Tool(name="now")


@pytest.mark.parametrize(
    ("tool", "error", "message"),
    [
        ({"type": "code_interpreter"}, ValueError, "only function tools can be sent"),
        ({"type": "function", "function": {"description": "x"}}, ValueError, "needs a name"),
        ({"function": "get_weather"}, ValueError, "function must be a dict"),
        (Tool(""), ValueError, "needs a name"),
        ("get_weather", TypeError, "a tool must be a Tool or a dict, not str"),
    ],
)
def test_bad_tools_raise_before_any_rpc(tool: Any, error: type[Exception], message: str) -> None:
    """A tool that is not a function, or has no name, is refused by name."""
    with pytest.raises(error, match=message):
        tool_message(tool)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("auto", pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_AUTO)),
        ("none", pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE)),
        ("required", pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)),
        ("get_weather", pb.ToolChoice(function="get_weather")),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            pb.ToolChoice(function="get_weather"),
        ),
        ({"type": "function", "name": "get_weather"}, pb.ToolChoice(function="get_weather")),
        (Tool("get_weather"), pb.ToolChoice(function="get_weather")),
    ],
)
def test_tool_choice_shapes(choice: Any, expected: pb.ToolChoice) -> None:
    """The three modes by name; a name, an OpenAI dict or a Tool as the one function."""
    message = tool_choice_message(choice)
    assert message == expected
    assert message.WhichOneof("choice") == expected.WhichOneof("choice")


@pytest.mark.parametrize("choice", ["", {"type": "function"}, {"function": {}}, 3])
def test_bad_tool_choice_raises(choice: Any) -> None:
    """An empty name, a dict without a name or another type is refused, naming the forms."""
    with pytest.raises(ValueError, match="tool_choice must be 'auto', 'none', 'required'"):
        tool_choice_message(choice)


def test_chat_request_carries_tools_choice_and_parallel_flag() -> None:
    """build_chat_request fills messages, tools, tool_choice, parallel_tool_calls and params."""
    request = build_chat_request(
        pb.StreamGenerateRequest(),
        [("user", "Weather in Tokyo?")],
        [WEATHER_OPENAI],
        "required",
        False,
        {"max_tokens": 64, "chat_template": "chatml"},
    )
    assert list(request.messages) == [pb.ChatMessage(role="user", content="Weather in Tokyo?")]
    assert list(request.tools) == [WEATHER_PB]
    assert request.tool_choice == pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)
    assert request.HasField("parallel_tool_calls")
    assert request.parallel_tool_calls is False
    assert request.params.stopping.max_tokens == 64
    assert request.chat_template == "chatml"


def test_chat_request_without_tools_leaves_every_tool_field_unset() -> None:
    """None for tools, tool_choice and parallel_tool_calls: nothing on the wire."""
    request = build_chat_request(pb.GenerateRequest(), [("user", "Hi")], None, None, None, {})
    assert list(request.tools) == []
    assert not request.HasField("tool_choice")
    assert not request.HasField("parallel_tool_calls")
    assert (
        request.SerializeToString()
        == pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="Hi")]
        ).SerializeToString()
    )


@pytest.mark.parametrize("tools", [WEATHER_OPENAI, "get_weather"])
def test_tools_must_be_a_list(tools: Any) -> None:
    """One tool dict (or a str) instead of a list is a TypeError, not a loop over its keys."""
    with pytest.raises(TypeError, match="tools must be a list of tools"):
        build_chat_request(pb.GenerateRequest(), [], tools, None, None, {})


# --- messages -------------------------------------------------------------------------------


def test_openai_shaped_conversation_becomes_messages() -> None:
    """Assistant tool_calls (arguments as text or as a dict, content None), a tool result with
    tool_call_id and name, and text content parts all reach their fields."""
    messages = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        },
        {"role": "user", "content": "Weather in Tokyo and Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": TOKYO},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "name": "get_weather",
            "content": '{"temp": 21}',
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "18 C"},
    ]
    assert chat_messages(messages) == [
        pb.ChatMessage(role="system", content="Be brief."),
        pb.ChatMessage(role="user", content="Weather in Tokyo and Paris?"),
        pb.ChatMessage(
            role="assistant",
            content="",
            tool_calls=[
                pb.ToolCall(id="call_1", name="get_weather", arguments=TOKYO),
                pb.ToolCall(id="call_2", name="get_weather", arguments='{"city": "Paris"}'),
            ],
        ),
        pb.ChatMessage(
            role="tool", content='{"temp": 21}', tool_call_id="call_1", name="get_weather"
        ),
        pb.ChatMessage(role="tool", content="18 C", tool_call_id="call_2"),
    ]


def test_client_messages_and_pairs_become_the_same_messages() -> None:
    """ChatMessage values (with ToolCalls), flat tool-call dicts and (role, content) pairs."""
    call = ToolCall("call_1", "get_weather", TOKYO)
    messages: list[Any] = [
        ("user", "Weather?"),
        ChatMessage("assistant", "", tool_calls=(call,)),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": TOKYO}],
        },
        {"role": "assistant", "content": "", "tool_calls": [call]},
        call.result_message({"temp": 21}),
    ]
    assistant = pb.ChatMessage(
        role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments=TOKYO)]
    )
    assert chat_messages(messages) == [
        pb.ChatMessage(role="user", content="Weather?"),
        assistant,
        assistant,
        assistant,
        pb.ChatMessage(
            role="tool", content='{"temp": 21}', tool_call_id="call_1", name="get_weather"
        ),
    ]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"content": "no role"}, "needs a role"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "only text"),
        ({"role": "user", "content": 3}, "must be a str or a list of text parts"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}, "function name"),
        ({"role": "assistant", "tool_calls": ["get_weather"]}, "a ToolCall or a dict"),
    ],
)
def test_bad_messages_raise_value_error(message: dict[str, Any], error: str) -> None:
    """A message without role, non-text content or a call without a name is refused."""
    with pytest.raises(ValueError, match=error):
        chat_messages([message])


def test_message_to_dict_round_trips() -> None:
    """to_dict() writes OpenAI's shape (empty fields left out) and from_dict reads it back."""
    call = ToolCall("call_1", "get_weather", TOKYO)
    assistant = ChatMessage("assistant", "", tool_calls=(call,))
    assert assistant.to_dict() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": TOKYO},
            }
        ],
    }
    result = call.result_message("21 C")
    assert result.to_dict() == {
        "role": "tool",
        "content": "21 C",
        "tool_call_id": "call_1",
        "name": "get_weather",
    }
    assert ChatMessage("user", "Hi").to_dict() == {"role": "user", "content": "Hi"}
    for message in (assistant, result):
        assert ChatMessage.from_dict(message.to_dict()) == message


# --- tool calls -----------------------------------------------------------------------------


def test_parsed_arguments() -> None:
    """JSON object arguments as a dict; empty arguments as {}; anything else a ValueError."""
    assert ToolCall("c", "f", '{"city": "Tokyo", "days": 3}').parsed_arguments() == {
        "city": "Tokyo",
        "days": 3,
    }
    assert ToolCall("c", "f", "").parsed_arguments() == {}
    with pytest.raises(ValueError, match=r"the arguments of f are not a JSON object: \['Tokyo'\]"):
        ToolCall("c", "f", '["Tokyo"]').parsed_arguments()
    with pytest.raises(ValueError, match="Expecting"):  # json.JSONDecodeError
        ToolCall("c", "f", '{"city": ').parsed_arguments()


def test_result_message_writes_non_text_results_as_json() -> None:
    """A str result is sent as is; a dict (or list, number) as JSON text."""
    call = ToolCall("call_9", "get_weather", TOKYO)
    assert call.result_message("sunny") == ChatMessage(
        "tool", "sunny", tool_call_id="call_9", name="get_weather"
    )
    assert call.result_message({"temp": 21, "sky": "clear"}).content == (
        '{"temp": 21, "sky": "clear"}'
    )
    assert call.result_message(21.5).content == "21.5"


def test_result_carries_tool_calls_and_builds_the_assistant_turn() -> None:
    """GenerateResponse.tool_calls become ToolCalls; finish reason TOOL_CALLS is "tool_calls";
    message() is the assistant turn with text and calls."""
    response = pb.GenerateResponse(
        text="Let me check.",
        finish_reason=pb.FINISH_REASON_TOOL_CALLS,
        tool_calls=[
            pb.ToolCall(id="call_1", name="get_weather", arguments=TOKYO),
            pb.ToolCall(id="call_2", name="get_time", arguments="{}"),
        ],
    )
    result = result_from_proto(response, "r-1")
    calls = (
        ToolCall("call_1", "get_weather", TOKYO),
        ToolCall("call_2", "get_time", "{}"),
    )
    assert result.finish_reason == "tool_calls"
    assert result.tool_calls == calls
    assert result.message() == ChatMessage("assistant", "Let me check.", tool_calls=calls)


def test_result_without_calls_has_none() -> None:
    """A plain answer: no tool calls, and message() is a plain assistant turn."""
    result = result_from_proto(
        pb.GenerateResponse(text="Hi!", finish_reason=pb.FINISH_REASON_EOS), "r"
    )
    assert result.tool_calls == ()
    assert result.message() == ChatMessage("assistant", "Hi!")


# --- stream events and their joining --------------------------------------------------------


def test_a_delta_with_text_and_call_pieces_gives_a_delta_then_the_pieces() -> None:
    """Text first, then one ToolCallDelta per piece, in the message's order."""
    message = pb.GenerationDelta(
        text="Checking.",
        token_ids=[5, 6],
        tool_calls=[
            pb.ToolCallDelta(index=0, id="call_1", name="get_weather"),
            pb.ToolCallDelta(index=0, arguments='{"city": '),
        ],
    )
    assert chat_events_from_proto(message) == [
        Delta("Checking.", (5, 6)),
        ToolCallDelta(0, "call_1", "get_weather", ""),
        ToolCallDelta(0, "", "", '{"city": '),
    ]


def test_call_tokens_without_text_still_give_their_delta() -> None:
    """Tokens whose text is all in a call: a Delta with empty text keeps their ids."""
    message = pb.GenerationDelta(
        token_ids=[7], tool_calls=[pb.ToolCallDelta(index=0, arguments='"Tokyo"}')]
    )
    assert chat_events_from_proto(message) == [
        Delta("", (7,)),
        ToolCallDelta(0, "", "", '"Tokyo"}'),
    ]


def test_call_pieces_alone_give_no_empty_delta() -> None:
    """A delta of call pieces only yields the pieces; an empty delta still yields its Delta."""
    only_calls = pb.GenerationDelta(tool_calls=[pb.ToolCallDelta(index=1, id="c", name="f")])
    assert chat_events_from_proto(only_calls) == [ToolCallDelta(1, "c", "f", "")]
    assert chat_events_from_proto(pb.GenerationDelta()) == [Delta("", ())]


def _done(reason: str = "tool_calls") -> Done:
    return Done(reason, None, None, Usage(1, 2, 0), Timings(0, 0, 0, 0, 0), "r", 0)


def test_accumulator_joins_interleaved_pieces_in_index_order() -> None:
    """Pieces of two calls, interleaved and out of index order, join into whole calls; text is
    joined; the first piece may carry arguments already; the Done gives the finish reason."""
    acc = StreamAccumulator()
    assert (acc.text, acc.tool_calls, acc.finish_reason) == ("", (), None)
    events: list[Any] = [
        Delta("On it", (1,)),
        Delta(".", (2,)),
        ToolCallDelta(1, "call_b", "get_time", '{"tz": '),
        ToolCallDelta(0, "call_a", "get_weather"),
        ToolCallDelta(0, arguments='{"city": '),
        ToolCallDelta(1, arguments='"JST"}'),
        ToolCallDelta(0, arguments='"Tokyo"}'),
        _done(),
    ]
    for event in events:
        acc.add(event)
    calls = (
        ToolCall("call_a", "get_weather", TOKYO),
        ToolCall("call_b", "get_time", '{"tz": "JST"}'),
    )
    assert acc.text == "On it."
    assert acc.tool_calls == calls
    assert acc.finish_reason == "tool_calls"
    assert acc.done == events[-1]
    assert acc.message() == ChatMessage("assistant", "On it.", tool_calls=calls)


def test_accumulator_keeps_the_first_id_and_name() -> None:
    """A later piece's id or name fills only what the earlier pieces left empty."""
    acc = StreamAccumulator()
    for event in (
        ToolCallDelta(0, "", "get_weather", "{"),
        ToolCallDelta(0, "call_late", "other", "}"),
    ):
        acc.add(event)
    assert acc.tool_calls == (ToolCall("call_late", "get_weather", "{}"),)


# --- the clients against a scripted server --------------------------------------------------


def _stream_of_call(text: str = "") -> list[pb.StreamGenerateResponse]:
    """A streamed answer: optional text, then a get_weather call for Tokyo in three pieces."""
    messages = []
    if text:
        messages.append(pb.GenerationDelta(text=text, token_ids=[1]))
    messages += [
        pb.GenerationDelta(
            token_ids=[2], tool_calls=[pb.ToolCallDelta(index=0, id="call_1", name="get_weather")]
        ),
        pb.GenerationDelta(token_ids=[3], tool_calls=[pb.ToolCallDelta(arguments='{"city": ')]),
        pb.GenerationDelta(token_ids=[4], tool_calls=[pb.ToolCallDelta(arguments='"Tokyo"}')]),
    ]
    return [
        *(pb.StreamGenerateResponse(delta=m) for m in messages),
        pb.StreamGenerateResponse(done=_done_pb(pb.FINISH_REASON_TOOL_CALLS)),
    ]


def _stream_of_text(*pieces: str) -> list[pb.StreamGenerateResponse]:
    deltas = [
        pb.StreamGenerateResponse(delta=pb.GenerationDelta(text=p, token_ids=[9])) for p in pieces
    ]
    return [*deltas, pb.StreamGenerateResponse(done=_done_pb(pb.FINISH_REASON_EOS))]


def _done_pb(reason: int) -> pb.GenerationDone:
    return pb.GenerationDone(
        finish_reason=reason,
        usage=pb.Usage(prompt_tokens=10, completion_tokens=4),
        timings=pb.Timings(ttft_ms=1.0, total_ms=2.0),
        request_id="req-1",
        seed=7,
    )


class ToolServicer(pb_grpc.LlmServiceServicer):
    """Answers Generate and StreamGenerate from queues of scripted answers (a stream whose
    last message's user content is "fail" is refused); records every request."""

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
        if request.messages and request.messages[-1].content == "fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "scripted failure")
        yield from self.streams.popleft()


@pytest.fixture(scope="module")
def tool_server() -> Iterator[tuple[str, ToolServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = ToolServicer()
    pb_grpc.add_LlmServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


@pytest.fixture
def servicer(tool_server: tuple[str, ToolServicer]) -> Iterator[ToolServicer]:
    """The servicer with empty queues and no requests; every scripted answer must be used."""
    servicer = tool_server[1]
    servicer.requests.clear()
    servicer.answers.clear()
    servicer.streams.clear()
    yield servicer
    assert not servicer.answers
    assert not servicer.streams


@pytest.fixture
def target(tool_server: tuple[str, ToolServicer], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(cli.TARGET_ENV, tool_server[0])
    return tool_server[0]


def test_the_tool_result_loop(target: str, servicer: ToolServicer) -> None:
    """The README's loop: call, run the tool, send the result, get the final answer; the
    second request carries the assistant turn with its call and the tool's result."""
    servicer.answers.extend(
        [
            pb.GenerateResponse(
                finish_reason=pb.FINISH_REASON_TOOL_CALLS,
                tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments=TOKYO)],
            ),
            pb.GenerateResponse(text="It is 21 C in Tokyo.", finish_reason=pb.FINISH_REASON_EOS),
        ]
    )

    def get_weather(city: str) -> dict[str, Any]:
        return {"city": city, "temp": 21}

    messages: list[Any] = [{"role": "user", "content": "Weather in Tokyo?"}]
    with Client(target, timeout=10) as client:
        result = client.chat(messages, tools=[WEATHER_OPENAI], tool_choice="auto")
        while result.tool_calls:
            messages.append(result.message())
            for call in result.tool_calls:
                messages.append(call.result_message(get_weather(**call.parsed_arguments())))
            result = client.chat(messages, tools=[WEATHER_OPENAI])
    assert (result.text, result.finish_reason, result.tool_calls) == (
        "It is 21 C in Tokyo.",
        "eos",
        (),
    )
    first, second = servicer.requests
    assert list(first.tools) == [WEATHER_PB]
    assert first.tool_choice == pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_AUTO)
    assert not second.HasField("tool_choice")
    assert list(second.messages) == [
        pb.ChatMessage(role="user", content="Weather in Tokyo?"),
        pb.ChatMessage(
            role="assistant",
            tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments=TOKYO)],
        ),
        pb.ChatMessage(
            role="tool",
            content='{"city": "Tokyo", "temp": 21}',
            tool_call_id="call_1",
            name="get_weather",
        ),
    ]


def test_sync_chat_stream_yields_pieces_and_joins_them(target: str, servicer: ToolServicer) -> None:
    """stream_chat() returns a ChatStream: Delta and ToolCallDelta events, then the Done; its
    text, tool_calls and message() join them."""
    servicer.streams.append(_stream_of_call("Checking. "))
    with Client(target, timeout=10) as client:
        stream = client.stream_chat(
            [("user", "Weather?")], tools=[Tool("get_weather")], parallel_tool_calls=False
        )
        assert isinstance(stream, ChatStream)
        events = list(stream)
    assert events[:-1] == [
        Delta("Checking. ", (1,)),
        Delta("", (2,)),
        ToolCallDelta(0, "call_1", "get_weather", ""),
        Delta("", (3,)),
        ToolCallDelta(0, "", "", '{"city": '),
        Delta("", (4,)),
        ToolCallDelta(0, "", "", '"Tokyo"}'),
    ]
    done = events[-1]
    assert isinstance(done, Done)
    assert (done.finish_reason, done.request_id) == ("tool_calls", "req-1")
    assert stream.text == "Checking. "
    assert stream.tool_calls == (ToolCall("call_1", "get_weather", TOKYO),)
    assert stream.message() == ChatMessage(
        "assistant", "Checking. ", tool_calls=(ToolCall("call_1", "get_weather", TOKYO),)
    )
    (request,) = servicer.requests
    assert list(request.tools) == [pb.Tool(name="get_weather")]
    assert request.parallel_tool_calls is False


async def test_async_chat_and_chat_stream(target: str, servicer: ToolServicer) -> None:
    """AsyncClient: chat() returns the calls; stream_chat() is an AsyncChatStream that joins
    its pieces the same way."""
    servicer.answers.append(
        pb.GenerateResponse(
            finish_reason=pb.FINISH_REASON_TOOL_CALLS,
            tool_calls=[pb.ToolCall(id="call_7", name="get_weather", arguments=TOKYO)],
        )
    )
    servicer.streams.append(_stream_of_call())
    async with AsyncClient(target, timeout=10) as client:
        result = await client.chat(
            [{"role": "user", "content": "Weather?"}],
            tools=[WEATHER_OPENAI],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        stream = client.stream_chat([("user", "Weather?")], tools=[WEATHER_OPENAI])
        assert isinstance(stream, AsyncChatStream)
        events = [event async for event in stream]
    assert result.tool_calls == (ToolCall("call_7", "get_weather", TOKYO),)
    assert result.finish_reason == "tool_calls"
    assert servicer.requests[0].tool_choice == pb.ToolChoice(function="get_weather")
    assert [e for e in events if isinstance(e, ToolCallDelta)] == [
        ToolCallDelta(0, "call_1", "get_weather", ""),
        ToolCallDelta(0, "", "", '{"city": '),
        ToolCallDelta(0, "", "", '"Tokyo"}'),
    ]
    assert stream.tool_calls == (ToolCall("call_1", "get_weather", TOKYO),)
    assert stream.done is events[-1]


def test_plain_stream_ignores_nothing_it_had_before(target: str, servicer: ToolServicer) -> None:
    """stream() (a prompt) still yields only Delta values and the Done."""
    servicer.streams.append(_stream_of_text("Hel", "lo"))
    with Client(target, timeout=10) as client:
        events = list(client.stream("p"))
    assert events[:2] == [Delta("Hel", (9,)), Delta("lo", (9,))]
    assert isinstance(events[2], Done)


# --- llama-grpc chat --------------------------------------------------------------------------


@pytest.fixture
def tools_file(tmp_path: Path) -> str:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER_OPENAI]), encoding="utf-8")
    return str(path)


def _stdin(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))


def test_chat_one_turn_prints_the_answer(
    target: str, servicer: ToolServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`chat PROMPT` streams one answer and exits; --system and generation flags are sent."""
    servicer.streams.append(_stream_of_text("Hello", " there!"))
    argv = ["chat", "Hi", "--system", "Be brief.", "--max-tokens", "9", "--chat-template", "chatml"]
    assert cli.main(argv) == 0
    assert capsys.readouterr() == ("Hello there!\n", "")
    (request,) = servicer.requests
    assert list(request.messages) == [
        pb.ChatMessage(role="system", content="Be brief."),
        pb.ChatMessage(role="user", content="Hi"),
    ]
    assert (request.chat_template, request.params.stopping.max_tokens) == ("chatml", 9)
    assert list(request.tools) == []
    assert not request.HasField("tool_choice")


def test_chat_one_turn_prints_the_calls_without_running_them(
    target: str, servicer: ToolServicer, tools_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --tools, a one-turn chat prints the answer's calls and ends there (no result is
    asked for); --tool-choice and --no-parallel-tool-calls reach the request."""
    servicer.streams.append(_stream_of_call("Checking."))
    argv = ["chat", "Weather in Tokyo?", "--tools", tools_file, "--tool-choice", "get_weather"]
    assert cli.main([*argv, "--no-parallel-tool-calls", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert out == 'Checking.\n[tool call] get_weather({"city": "Tokyo"})\n'
    assert err.startswith("[done] finish_reason=tool_calls prompt_tokens=10 completion_tokens=4")
    (request,) = servicer.requests
    assert list(request.tools) == [WEATHER_PB]
    assert request.tool_choice == pb.ToolChoice(function="get_weather")
    assert request.parallel_tool_calls is False


def test_chat_conversation_with_a_tool_result(
    target: str,
    servicer: ToolServicer,
    tools_file: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Interactive: lines from stdin, history kept, a call's result read from the next line and
    sent back as a tool message, the turn continued, /clear keeping the system prompt, /bye."""
    servicer.streams.extend(
        [
            _stream_of_text("Hello!"),
            _stream_of_call(),
            _stream_of_text("It is 21 C in Tokyo."),
            _stream_of_text("Hi again."),
        ]
    )
    lines = ["Hi", "", "Weather in Tokyo?", '{"temp": 21}', "/clear", "Hello", "/bye", "ignored"]
    _stdin(monkeypatch, "\n".join(lines) + "\n")
    assert cli.main(["chat", "--tools", tools_file, "--system", "S"]) == 0
    out, err = capsys.readouterr()
    assert out == (
        'Hello!\n[tool call] get_weather({"city": "Tokyo"})\nIt is 21 C in Tokyo.\nHi again.\n'
    )
    assert err == "(conversation cleared)\n"
    system, hi = (
        pb.ChatMessage(role="system", content="S"),
        pb.ChatMessage(role="user", content="Hi"),
    )
    hello_answer = pb.ChatMessage(role="assistant", content="Hello!")
    weather = pb.ChatMessage(role="user", content="Weather in Tokyo?")
    call = pb.ChatMessage(
        role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments=TOKYO)]
    )
    result = pb.ChatMessage(
        role="tool", content='{"temp": 21}', tool_call_id="call_1", name="get_weather"
    )
    assert [list(r.messages) for r in servicer.requests] == [
        [system, hi],
        [system, hi, hello_answer, weather],
        [system, hi, hello_answer, weather, call, result],
        [system, pb.ChatMessage(role="user", content="Hello")],
    ]
    assert all(list(r.tools) == [WEATHER_PB] for r in servicer.requests)


def test_chat_end_of_input_quits_and_an_error_drops_only_its_turn(
    target: str,
    servicer: ToolServicer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A failed turn prints its error and is forgotten; an unknown command is named; the end
    of input ends the conversation with status 0."""
    servicer.streams.append(_stream_of_text("Fine."))
    _stdin(monkeypatch, "fail\n/nope\nHow are you?")
    assert cli.main(["chat"]) == 0
    out, err = capsys.readouterr()
    assert out == "Fine.\n"
    assert err.splitlines()[0] == "error: INVALID_ARGUMENT: scripted failure"
    assert err.splitlines()[1].startswith("unknown command /nope (commands: /bye")
    assert [list(r.messages) for r in servicer.requests] == [
        [pb.ChatMessage(role="user", content="fail")],
        [pb.ChatMessage(role="user", content="How are you?")],
    ]


def test_chat_end_of_input_instead_of_a_tool_result_quits(
    target: str,
    servicer: ToolServicer,
    tools_file: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The input ends where a tool result was expected: the conversation ends, status 0."""
    servicer.streams.append(_stream_of_call())
    _stdin(monkeypatch, "Weather?\n")
    assert cli.main(["chat", "--tools", tools_file]) == 0
    assert capsys.readouterr().out == '[tool call] get_weather({"city": "Tokyo"})\n'
    assert len(servicer.requests) == 1


def test_chat_one_turn_error_exits_1(
    target: str, servicer: ToolServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failed one-turn chat prints the error and exits 1, as the other commands do."""
    assert cli.main(["chat", "fail"]) == 1
    assert capsys.readouterr().err == "error: INVALID_ARGUMENT: scripted failure\n"


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("{not json", "Expecting property name enclosed in double quotes: line 1 column 2"),
        ('{"tools": {}}', 'tools.json: expected a JSON list of tools (or {"tools": [...]})'),
        ('["get_weather"]', "tools.json: a tool must be a JSON object, not 'get_weather'"),
        ('[{"type": "function", "function": {}}]', "a tool needs a name"),
        (None, "[Errno 2] No such file or directory"),
    ],
)
def test_chat_bad_tools_file_is_a_usage_error(
    target: str,
    servicer: ToolServicer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    *,
    content: str | None,
    error: str,
) -> None:
    """A --tools file that is missing, not JSON, not a list or with a nameless tool exits 2
    before any call, saying why."""
    path = tmp_path / "tools.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    assert cli.main(["chat", "Hi", "--tools", str(path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --tools: ")
    assert error in line
    assert servicer.requests == []


def test_chat_empty_tool_choice_is_a_usage_error(
    target: str, servicer: ToolServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tool-choice "" exits 2 before any call, naming the accepted forms."""
    assert cli.main(["chat", "Hi", "--tool-choice", ""]) == 2
    assert capsys.readouterr().err.startswith(
        "error: --tool-choice: tool_choice must be 'auto', 'none', 'required'"
    )
    assert servicer.requests == []
