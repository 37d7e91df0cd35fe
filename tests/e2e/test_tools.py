"""Tools over v1 on trained weights (issue 49): Qwen 2.5 Coder 0.5B Instruct, which writes its
calls as bare JSON although its template asks for <tool_call> tags. The words matter here, so
these tests run the trained model (fetched once per machine, tests/support/trained.py), greedy,
on one llama.cpp thread: a call, the call streamed, the answer after the tool's result, a named
call constrained into the template's own format, a question that needs no tool, and
tool_choice none."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from llama_grpc import AsyncClient, InvalidArgumentError, Tool
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from tests.support.trained import QWEN_05B, trained_model_path

from .conftest import loaded_server, settings

WEATHER = pb.Tool(
    name="get_weather",
    description="Get the current weather in a given city",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        }
    ),
)
TOKYO = [pb.ChatMessage(role="user", content="What's the weather like in Tokyo right now?")]
RESULT = '{"city": "Tokyo", "temperature_c": 18, "condition": "light rain"}'


def params(max_tokens: int = 64) -> pb.GenerationParams:
    return pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=max_tokens))


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stub_port() -> AsyncIterator[int]:
    conf = settings(str(trained_model_path(QWEN_05B)), n_parallel=2)
    async with loaded_server(conf) as running:
        yield running.port


@pytest_asyncio.fixture(loop_scope="session")
async def stub(stub_port: int) -> AsyncIterator[pb_grpc.LlmServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stub_port}") as channel:
        yield pb_grpc.LlmServiceStub(channel)


async def test_the_model_calls_the_tool_and_no_json_reaches_the_text(
    stub: pb_grpc.LlmServiceStub,
) -> None:
    """The model's bare JSON call comes back as a call, the text empty, the turn TOOL_CALLS."""
    reply = await stub.Generate(
        pb.GenerateRequest(messages=TOKYO, tools=[WEATHER], params=params())
    )
    assert reply.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert reply.text == ""
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Tokyo"})
    ]
    assert reply.tool_calls[0].id.startswith("call_") and len(reply.tool_calls[0].id) == 29


async def test_a_streamed_call_arrives_as_call_deltas(stub: pb_grpc.LlmServiceStub) -> None:
    """The stream's call deltas: the first names the call (index, id, name), the arguments'
    fragments join to the call's arguments; no delta has text; done says TOOL_CALLS."""
    pieces: list[pb.ToolCallDelta] = []
    text = ""
    done = None
    async for event in stub.StreamGenerate(
        pb.StreamGenerateRequest(messages=TOKYO, tools=[WEATHER], params=params())
    ):
        if event.HasField("delta"):
            text += event.delta.text
            pieces.extend(event.delta.tool_calls)
        else:
            done = event.done
    assert done is not None and done.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert text == ""
    assert pieces[0].index == 0 and pieces[0].name == "get_weather"
    assert pieces[0].id.startswith("call_")
    assert {p.index for p in pieces} == {0}
    assert json.loads("".join(p.arguments for p in pieces)) == {"city": "Tokyo"}


async def test_the_answer_after_the_tool_result_uses_it(stub: pb_grpc.LlmServiceStub) -> None:
    """The conversation goes on: the call, its result as a tool message, and the final answer
    is text built on the result (its temperature and condition), with no call."""
    first = await stub.Generate(
        pb.GenerateRequest(messages=TOKYO, tools=[WEATHER], params=params())
    )
    (call,) = first.tool_calls
    conversation = [
        *TOKYO,
        pb.ChatMessage(role="assistant", tool_calls=[call]),
        pb.ChatMessage(role="tool", tool_call_id=call.id, content=RESULT),
    ]
    reply = await stub.Generate(
        pb.GenerateRequest(messages=conversation, tools=[WEATHER], params=params(96))
    )
    assert reply.finish_reason == pb.FINISH_REASON_EOS
    assert not reply.tool_calls
    assert "18" in reply.text
    assert "rain" in reply.text.lower()


async def test_a_named_call_is_constrained_to_the_template_format(
    stub: pb_grpc.LlmServiceStub,
) -> None:
    """tool_choice naming get_weather on a question that needs no weather: the answer is
    constrained to a <tool_call> of it whose arguments match the schema."""
    reply = await stub.Generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="Tell me about Paris.")],
            tools=[WEATHER],
            tool_choice=pb.ToolChoice(function="get_weather"),
            params=params(),
        )
    )
    assert reply.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert reply.text == ""
    (call,) = reply.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}


async def test_a_question_that_needs_no_tool_gets_an_answer(stub: pb_grpc.LlmServiceStub) -> None:
    reply = await stub.Generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="Hello! Who are you?")],
            tools=[WEATHER],
            params=params(),
        )
    )
    assert reply.finish_reason == pb.FINISH_REASON_EOS
    assert not reply.tool_calls
    assert "Qwen" in reply.text


async def test_json_naming_no_offered_tool_stays_text(stub: pb_grpc.LlmServiceStub) -> None:
    """The bare-JSON rule is precise: asked to write code, the model answers with a fenced
    JSON "call" of a function nobody offered; it reaches the text as the model wrote it."""
    reply = await stub.Generate(
        pb.GenerateRequest(
            messages=[
                pb.ChatMessage(
                    role="user", content="Write a Python function that reverses a string."
                )
            ],
            tools=[WEATHER],
            params=params(),
        )
    )
    assert reply.finish_reason == pb.FINISH_REASON_EOS
    assert not reply.tool_calls
    assert reply.text.startswith("```json\n{")
    assert json.loads(reply.text.removeprefix("```json").removesuffix("```"))["name"] == (
        "reverse_string"
    )


async def test_tool_choice_none_hides_the_tools(stub: pb_grpc.LlmServiceStub) -> None:
    """With tool_choice none the prompt has no tools (fewer prompt tokens than with them) and
    nothing is parsed as a call."""
    offered = await stub.Generate(
        pb.GenerateRequest(messages=TOKYO, tools=[WEATHER], params=params(1))
    )
    hidden = await stub.Generate(
        pb.GenerateRequest(
            messages=TOKYO,
            tools=[WEATHER],
            tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE),
            params=params(),
        )
    )
    plain = await stub.Generate(pb.GenerateRequest(messages=TOKYO, params=params(1)))
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens < offered.usage.prompt_tokens
    assert not hidden.tool_calls
    assert hidden.finish_reason != pb.FINISH_REASON_TOOL_CALLS


async def test_the_client_loop_and_a_bad_tool_named(stub_port: int) -> None:
    """The Python client's loop: chat with tools, run the call, send its result back, read the
    answer; a tool whose parameters are not JSON is InvalidArgumentError naming the field."""
    async with AsyncClient(f"127.0.0.1:{stub_port}", timeout=120) as client:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": WEATHER.name,
                    "description": WEATHER.description,
                    "parameters": json.loads(WEATHER.parameters),
                },
            }
        ]
        messages: list[Any] = [{"role": "user", "content": TOKYO[0].content}]
        first = await client.chat(messages, tools=tools, max_tokens=64)
        assert first.finish_reason == "tool_calls"
        (call,) = first.tool_calls
        assert call.parsed_arguments() == {"city": "Tokyo"}
        messages += [first.message(), call.result_message(json.loads(RESULT))]
        answer = await client.chat(messages, tools=tools, max_tokens=96)
        assert answer.finish_reason == "eos" and not answer.tool_calls
        assert "18" in answer.text
        with pytest.raises(InvalidArgumentError) as caught:
            await client.chat(messages, tools=[Tool("f", parameters="not json")], max_tokens=8)
        assert caught.value.field == "tools[0].parameters"
