"""Every v1 door on every model family (issue 39): a real server per family
(llama_grpc_testkit.synth_gguf's tiny random-weight models with the family's real vocabulary and
chat template; gemma3 is the embedded model), one at a time. Tokenize and Detokenize equal
llama.cpp's own tokenizer on the same file; the prompt the server builds from `messages` is, id for
id, the family's template rendered here and tokenized by llama.cpp; GenerateTokens runs a token-id
prompt; GetModelInfo names llama.cpp's special tokens; each end-of-turn token, chosen with
logit_bias after a text a grammar dictates (the output is noise otherwise), ends the stream there as
EOS, unseen."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.config import ModelSettings, SchedulerSettings, ServerSettings, Settings
from llama_grpc_server.core.constrained.regex_grammar import gbnf_literal
from llama_grpc_server.core.reasoning.formats import reasoning_format_for
from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES, ChatMessage
from llama_grpc_server.core.tools import prompt as tool_prompt
from llama_grpc_server.core.tools.types import ToolCall, ToolSpec
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.engine.chat import _Template
from llama_grpc_server.rpc.plumbing.server import start_server
from tests.support.families import (
    CONVERSATION,
    CORPUS,
    FAMILIES,
    Family,
    Reference,
    family_model,
    template_source,
)

from .conftest import GREEDY

N_CTX = 1024
ANSWER = "Blue 🦙 中文"  # characters that byte-level vocabularies split across tokens
DETOKENIZE_SAMPLE = 512  # ids spread over the whole vocabulary, detokenized in one request


@dataclass
class Served:
    family: Family
    path: Path
    llama: Reference  # llama.cpp's tokenizer on the same file, loaded by the test
    stub: pb_grpc.LlmServiceStub

    @property
    def template(self) -> str:
        """The Jinja source the server renders `messages` with."""
        return template_source(self.family) or BUILTIN_TEMPLATES[self.family.server_template]

    def corpus(self) -> list[str]:
        """CORPUS and the family's special tokens written as text: alone, around words, and a
        turn as its template writes one."""
        bos = self.llama.token_text(self.llama.bos_id)
        eots = self.family.end_of_turn
        specials = [*eots, f"{bos}Hi{eots[0]}", f"x{eots[0]}\ny", f"{eots[0]}{eots[0]} tail"]
        return [*CORPUS, *specials]


@pytest_asyncio.fixture(loop_scope="session", scope="module", params=list(FAMILIES))
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    family = FAMILIES[request.param]
    path = family_model(family.name)
    conf = Settings(
        model=ModelSettings(
            model_path=str(path),
            n_ctx=N_CTX,
            n_batch=256,
            n_threads=1,
            chat_template=family.server_template,
        ),
        scheduler=SchedulerSettings(n_parallel=1, default_sampling=GREEDY),
        server=ServerSettings(port=0, grace_s=1.0),
    )
    llama = Reference(path)
    try:
        async with start_server(conf, lambda: build_engine(conf)) as running:
            assert await running.wait_loaded()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                yield Served(family, path, llama, pb_grpc.LlmServiceStub(channel))
    finally:
        llama.close()


async def test_tokenize_equals_llama_cpp(served: Served) -> None:
    """v1 Tokenize gives llama_tokenize's ids for every text, in all four add_special x
    parse_special modes, and each token's piece as llama_token_to_piece renders it."""
    for text, add_special, parse_special in itertools.product(
        served.corpus(), (False, True), (False, True)
    ):
        got = await served.stub.Tokenize(
            pb.TokenizeRequest(
                text=text, add_special=add_special, parse_special=parse_special, return_pieces=True
            )
        )
        want = served.llama.tokenize(text, add_special=add_special, parse_special=parse_special)
        assert list(got.token_ids) == want, (text, add_special, parse_special)
        assert list(got.pieces) == [served.llama.piece(t) for t in want], text


async def test_detokenize_equals_llama_cpp(served: Served) -> None:
    """v1 Detokenize gives llama_detokenize's text (special tokens kept, rendered or not) for the
    corpus' ids and for ids spread over the whole vocabulary."""
    llama = served.llama
    step = max(1, llama.n_vocab // DETOKENIZE_SAMPLE)
    cases = [
        llama.tokenize(t, add_special=add, parse_special=True)
        for t in served.corpus()
        for add in (False, True)
    ]
    cases.append(list(range(0, llama.n_vocab, step)))
    for ids, render_special in itertools.product(cases, (False, True)):
        got = await served.stub.Detokenize(
            pb.DetokenizeRequest(token_ids=ids, render_special=render_special)
        )
        assert got.text == llama.detokenize(ids, render_special=render_special), (
            ids[:8],
            render_special,
        )


def chat_messages() -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in CONVERSATION]


async def test_messages_prompt_is_the_family_template(served: Served) -> None:
    """The prompt the server builds from `messages` is the family's template rendered here and
    tokenized by llama.cpp, id for id. The server shows only the count (usage.prompt_tokens);
    the ids show through its prefix cache (one slot): right after the chat request, a token-id
    prompt of those ids plus one more finds all of them cached, and it could not, had any id
    differed (the cache reuses the longest common prefix, and the chat request's one generated
    token is never decoded into the slot)."""
    want = served.llama.chat_prompt(CONVERSATION, served.template)
    assert len(want) < N_CTX // 2
    chat = await served.stub.Generate(
        pb.GenerateRequest(
            messages=chat_messages(),
            params=pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=1)),
        )
    )
    assert chat.usage.prompt_tokens == len(want)
    extra = want[-1]  # any id: the comparison covers len(want) ids either way
    probe = await collect_tokens(served, [*want, extra], max_tokens=1)
    assert probe.usage.prompt_tokens == len(want) + 1
    assert probe.usage.cached_prompt_tokens == len(want)


async def test_generate_tokens_runs_a_token_prompt(served: Served) -> None:
    """GenerateTokens: a token-id prompt in, 6 ids of the vocabulary out, MAX_TOKENS; greedy,
    so a second run gives the same ids. Both runs compute the whole prompt (cache_prompt off):
    a run on the first one's cached prefix computes in another layout, and the embedded Gemma
    3's first step after this prompt is a near-tie (a two-worker run once got 564 then 108)."""
    llama = served.llama
    prompt = llama.tokenize("Hello world, how are you?", add_special=True, parse_special=False)
    first = await collect_tokens(served, prompt, max_tokens=6, ignore_eos=True, cache=False)
    again = await collect_tokens(served, prompt, max_tokens=6, ignore_eos=True, cache=False)
    assert first.done.finish_reason == pb.FINISH_REASON_MAX_TOKENS
    assert len(first.ids) == 6 and all(0 <= t < llama.n_vocab for t in first.ids)
    assert first.done.usage.prompt_tokens == len(prompt)
    assert again.ids == first.ids


async def test_model_info_names_llama_cpp_special_tokens(served: Served) -> None:
    """GetModelInfo (what a gateway takes its stop tokens from) gives llama.cpp's BOS, EOS,
    add_bos and end-of-generation ids, the end-of-turn tokens among them, and the template."""
    llama = served.llama
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest())
    eog = [t for t in range(llama.n_vocab) if llama.is_eog(t)]
    assert (info.n_vocab, info.bos_token_id, info.eos_token_id, info.add_bos) == (
        llama.n_vocab,
        llama.bos_id,
        llama.eos_id,
        llama.add_bos,
    )
    assert list(info.eog_token_ids) == eog
    assert {llama.token_id(text) for text in served.family.end_of_turn} <= set(eog)
    assert info.chat_template == (served.family.server_template or "gguf")


async def test_end_of_turn_ends_the_stream(served: Served) -> None:
    """Each end-of-turn token ends a chat stream where it comes: a grammar makes the model write
    ANSWER first (it allows end-of-generation only once complete) and logit_bias makes that
    end-of-turn token the one chosen then (the output is noise otherwise). The text is ANSWER,
    the reason EOS naming the token, which no delta carries."""
    for eot_text in served.family.end_of_turn:
        eot = served.llama.token_id(eot_text)
        params = pb.GenerationParams(
            sampling=pb.SamplingParams(logit_bias={eot: 100.0}),
            stopping=pb.StoppingCriteria(max_tokens=32),
            grammar=pb.Grammar(gbnf=f'root ::= "{ANSWER}"'),
        )
        ids: list[int] = []
        text = ""
        done: pb.GenerationDone | None = None
        async for event in served.stub.StreamGenerate(
            # a thinking family's grammar applies after its thinking: none here
            pb.StreamGenerateRequest(messages=chat_messages(), params=params, reasoning_budget=0)
        ):
            if event.HasField("delta"):
                ids += event.delta.token_ids
                text += event.delta.text
            else:
                done = event.done
        assert done is not None
        assert (text, done.finish_reason) == (ANSWER, pb.FINISH_REASON_EOS), eot_text
        assert done.finish.matched_token_id == eot
        assert eot not in ids and done.usage.completion_tokens == len(ids)  # EOS is not output


@dataclass
class TokensOut:
    ids: list[int]
    done: pb.GenerationDone

    @property
    def usage(self) -> pb.Usage:
        return self.done.usage


async def collect_tokens(
    served: Served,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    ignore_eos: bool = False,
    cache: bool = True,
) -> TokensOut:
    request = pb.GenerateTokensRequest(
        token_ids=list(prompt),
        params=pb.GenerationParams(
            stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=ignore_eos),
            cache_prompt=cache,
        ),
    )
    ids: list[int] = []
    done: pb.GenerationDone | None = None
    async for event in served.stub.GenerateTokens(request):
        if event.HasField("delta"):
            ids += event.delta.token_ids
        else:
            done = event.done
    assert done is not None
    return TokensOut(ids, done)


# -- tools (issue 49): each family's own call format, a named call, a tool result -------------

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Tokyo", "Paris"]}},
    "required": ["city"],
}
WEATHER = pb.Tool(name="get_weather", description="Current weather", parameters=json.dumps(CITY))
# Each family's call of get_weather(city="Tokyo") as its model writes it (core/tools/formats)
OWN_CALL = {
    "gemma3": '{"name": "get_weather", "arguments": {"city": "Tokyo"}}',
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>',
    "qwen35": "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n"
    "</function>\n</tool_call>",
    "llama3": '{"name": "get_weather", "parameters": {"city": "Tokyo"}}',
    "deepseek-r1-distill": (
        "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>"
        'function<\uff5ctool\u2581sep\uff5c>get_weather\n```json\n{"city": "Tokyo"}\n```'
        "<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>"
    ),
    "phi3": '{"name": "get_weather", "arguments": {"city": "Tokyo"}}',
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Tokyo<|"|>}<tool_call|>',
}
ASK = [pb.ChatMessage(role="user", content="Weather in Tokyo?")]
# DeepSeek's tool tokens are not tokens of the deepseek-llm vocabulary: a call is ~300 tokens
CALL_TOKENS = 400


async def stream_calls(
    served: Served, request: pb.StreamGenerateRequest
) -> tuple[str, list[pb.ToolCallDelta], pb.GenerationDone]:
    text, pieces, done = "", [], None
    async for event in served.stub.StreamGenerate(request):
        if event.HasField("delta"):
            text += event.delta.text
            pieces += event.delta.tool_calls
        else:
            done = event.done
    assert done is not None
    return text, pieces, done


async def test_tools_a_call_in_the_family_format_streams_as_a_call(served: Served) -> None:
    """The family's own call format (forced by a grammar: these models write noise) is parsed as
    it streams: no text, the call's first delta names it, its argument pieces join to the
    arguments, the turn ends TOOL_CALLS. Special-token markers (Gemma 4's) reach the parser."""
    grammar = pb.Grammar(gbnf=f"root ::= {gbnf_literal(OWN_CALL[served.family.name])}")
    text, pieces, done = await stream_calls(
        served,
        pb.StreamGenerateRequest(
            messages=ASK,
            tools=[WEATHER],
            params=pb.GenerationParams(
                stopping=pb.StoppingCriteria(max_tokens=CALL_TOKENS), grammar=grammar
            ),
            reasoning_budget=0,  # a thinking family calls after its (empty) thinking
        ),
    )
    assert (text, done.finish_reason) == ("", pb.FINISH_REASON_TOOL_CALLS)
    assert (pieces[0].index, pieces[0].name) == (0, "get_weather")
    assert pieces[0].id.startswith("call_")
    assert json.loads("".join(p.arguments for p in pieces)) == {"city": "Tokyo"}


async def test_tools_a_named_call_is_constrained(served: Served) -> None:
    """tool_choice naming the function constrains the answer to one call of it in the
    family's format (or the bare JSON call), its arguments matching the schema."""
    reply = await served.stub.Generate(
        pb.GenerateRequest(
            messages=ASK,
            tools=[WEATHER],
            tool_choice=pb.ToolChoice(function="get_weather"),
            params=pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=CALL_TOKENS)),
            reasoning_budget=0,
        )
    )
    assert (reply.text, reply.finish_reason) == ("", pb.FINISH_REASON_TOOL_CALLS)
    (call,) = reply.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Tokyo", "Paris")


async def test_tools_a_result_is_rendered(served: Served) -> None:
    """A conversation with a call and its result: the server's prompt is, id for id, the
    family's template rendered here with the messages core.tools.prompt hands it (the
    template's own tool rendering where it has one, else the generic prompt, the call as JSON
    and the result as a user turn), and the result's text is in it."""
    call = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Tokyo"}')
    conversation = [
        *ASK,
        pb.ChatMessage(role="assistant", tool_calls=[call]),
        pb.ChatMessage(role="tool", tool_call_id="call_1", content="21 degrees, sunny"),
    ]
    template = _Template(served.template, "", "")
    spec = ToolSpec("get_weather", "Current weather", CITY)
    messages = tool_prompt.template_messages(
        (
            ChatMessage("user", "Weather in Tokyo?"),
            ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Tokyo"}'),)),
            ChatMessage("tool", "21 degrees, sunny", tool_call_id="call_1"),
        ),
        template.caps,
        (spec,),
    )
    tools = [tool_prompt.openai_tool(spec)] if template.caps.tools else None
    want = served.llama.chat_prompt(messages, served.template, tools=tools)
    rendered = served.llama.detokenize(want, render_special=True)
    assert "21 degrees, sunny" in rendered
    chat = await served.stub.Generate(
        pb.GenerateRequest(
            messages=conversation,
            tools=[WEATHER],
            params=pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=1)),
        )
    )
    assert chat.usage.prompt_tokens == len(want)
    probe = await collect_tokens(served, [*want, want[-1]], max_tokens=1)
    assert probe.usage.cached_prompt_tokens == len(want)


# -- reasoning (issue 50): thinking apart from the answer, the budget, constraints after it -----

# How each thinking family is made to think on random weights: Qwen 3.5's and the R1 distill's
# templates open the section at the end of the prompt; Gemma 4 thinks with enable_thinking and
# opens its section itself (a bias on its <|channel> token makes the random model do so); the R1
# distill's random model writes blank lines, so they are banned. Qwen 3 opens its section itself
# and has no single-token opener here: its random model never thinks (a budget of 0 still forces
# the empty section).
THINKING = {
    "qwen35": {},
    "deepseek-r1-distill": {"ban": "\n"},
    "gemma4": {"enable_thinking": True, "bias": "<|channel>"},
}
BUDGET = 5


def think_request(served: Served, **fields: Any) -> pb.StreamGenerateRequest:
    how = THINKING.get(served.family.name, {})
    params = fields.pop("params", pb.GenerationParams())
    params.stopping.max_tokens = fields.pop("max_tokens", 24)
    if "ban" in how:
        (banned,) = served.llama.tokenize(how["ban"], add_special=False, parse_special=True)
        params.sampling.logit_bias[banned] = float("-inf")
    if "bias" in how:
        params.sampling.logit_bias[served.llama.token_id(how["bias"])] = 100.0
    if "enable_thinking" in how:
        fields["enable_thinking"] = True
    return pb.StreamGenerateRequest(messages=ASK, params=params, **fields)


async def stream_answer(
    served: Served, request: pb.StreamGenerateRequest
) -> tuple[list[pb.GenerationDelta], pb.GenerationDone]:
    deltas, done = [], None
    async for event in served.stub.StreamGenerate(request):
        if event.HasField("delta"):
            deltas.append(event.delta)
        else:
            done = event.done
    assert done is not None
    return deltas, done


def forced_end(served: Served) -> list[int]:
    fmt = reasoning_format_for(served.template)
    assert fmt is not None
    return served.llama.tokenize(fmt.forced_end(), add_special=False, parse_special=True)


async def test_reasoning_streams_thinking_then_the_answer(served: Served) -> None:
    """A thinking family streams reasoning deltas, then text deltas, never mixed; the budget
    ends the section after BUDGET thinking tokens with the forced end (its ids right there in
    the output). A family that does not think has no reasoning at all."""
    deltas, _ = await stream_answer(served, think_request(served, reasoning_budget=BUDGET))
    ids = [t for d in deltas for t in d.token_ids]
    thinking = "".join(d.reasoning for d in deltas)
    if served.family.name not in THINKING:
        assert thinking == ""
        return
    assert thinking
    last_reasoning = max(i for i, d in enumerate(deltas) if d.reasoning)
    first_text = min((i for i, d in enumerate(deltas) if d.text), default=len(deltas))
    assert last_reasoning < first_text
    opener = 1 if "bias" in THINKING[served.family.name] else 0  # Gemma 4 opens it itself
    end = forced_end(served)
    assert ids[opener + BUDGET : opener + BUDGET + len(end)] == end


async def test_reasoning_budget_zero_skips_thinking(served: Served) -> None:
    """Budget 0: no reasoning; a section the prompt opened is closed at once (the forced end
    first), and a model that opens its own (Qwen 3, Gemma 4) gets the empty section forced."""
    deltas, _ = await stream_answer(served, think_request(served, reasoning_budget=0))
    ids = [t for d in deltas for t in d.token_ids]
    assert "".join(d.reasoning for d in deltas) == ""
    fmt = reasoning_format_for(served.template)
    if fmt is not None and served.family.name in (*THINKING, "qwen3"):
        opened = served.family.name in ("qwen35", "deepseek-r1-distill")
        forced = fmt.forced_end() if opened else fmt.forced_empty()
        want = served.llama.tokenize(forced, add_special=False, parse_special=True)
        assert ids[: len(want)] == want


async def test_reasoning_a_constraint_applies_after_thinking(served: Served) -> None:
    """A json_schema on a thinking request: the thinking is free, the answer after it is the
    schema's JSON (the budget ends the thinking of these random models). A family that does
    not think is constrained from its first token, as before."""
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    request = think_request(
        served,
        reasoning_budget=BUDGET,
        params=pb.GenerationParams(json_schema=json.dumps(schema)),
        max_tokens=96,
    )
    deltas, done = await stream_answer(served, request)
    assert done.finish_reason == pb.FINISH_REASON_EOS
    assert json.loads("".join(d.text for d in deltas))["a"] in (1, 2)
    thinking = "".join(d.reasoning for d in deltas)
    # a thinking family's grammar begins with its section: Qwen 3's random model writes one too
    assert bool(thinking) == (reasoning_format_for(served.template) is not None)
