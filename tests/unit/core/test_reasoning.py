"""Thinking split from the answer as it streams (core.reasoning.split), which templates think
(core.reasoning.formats), the budget that forces the end of thinking (core.reasoning.budget),
and v1's checks of the chat options (rpc.v1.reasoning)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.core.reasoning.budget import ReasoningParams, ThinkingBudget
from llama_grpc_server.core.reasoning.formats import CHANNEL, THINK, reasoning_format_for
from llama_grpc_server.core.reasoning.split import ReasoningSplitter
from llama_grpc_server.core.requests.request import Constraint
from llama_grpc_server.rpc.shared import thinking
from llama_grpc_server.rpc.v1 import reasoning as rpc_reasoning


def split(
    text: str, pieces: list[int] | None = None, *, opened: bool, fmt: Any = THINK
) -> tuple[str, str]:
    """The whole output pushed in pieces of the given sizes (one piece by default)."""
    splitter = ReasoningSplitter(fmt, opened=opened)
    thinking, answer, at = [], [], 0
    for size in [*(pieces or []), len(text)]:
        chunk, at = text[at : at + size], at + size
        t, a = splitter.push(chunk)
        thinking.append(t)
        answer.append(a)
    t, a = splitter.finish()
    return "".join(thinking) + t, "".join(answer) + a


@pytest.mark.parametrize(
    ("text", "opened", "want"),
    [
        ("<think>\nLet me see.\n</think>\n\nParis.", False, ("Let me see.", "Paris.")),
        ("Let me see.\n\nStill.\n</think>\n\nParis.", True, ("Let me see.\n\nStill.", "Paris.")),
        ("Paris.", False, ("", "Paris.")),
        ("  Paris <think> is", False, ("", "Paris <think> is")),
        ("<think>\ncut short", False, ("cut short", "")),
        ("\n</think>\n\nAnswer", True, ("", "Answer")),
        ("a </thinking> b", True, ("a </thinking> b", "")),
        ("<thi", False, ("", "<thi")),
    ],
)
def test_thinking_and_answer(text: str, opened: bool, want: tuple[str, str]) -> None:
    assert split(text, opened=opened) == want


def test_gemma4_channel_drops_its_label() -> None:
    text = "<|channel>thought\nHmm.<channel|>Yes."
    assert split(text, opened=False, fmt=CHANNEL) == ("Hmm.", "Yes.")


@given(st.lists(st.integers(min_value=1, max_value=7), max_size=20), st.booleans())
def test_any_split_gives_the_same_result(pieces: list[int], opened: bool) -> None:
    text = (
        "" if opened else " <think>\n"
    ) + "I think <thin </think> no\n\n</think>\n\n  Done </think>."
    assert split(text, pieces, opened=opened) == split(text, opened=opened)


def test_formats_from_templates() -> None:
    assert reasoning_format_for("{{ '<think>' }} ... {{ '</think>' }}") is THINK
    assert reasoning_format_for("'<|channel>thought\\n<channel|>'") is CHANNEL
    assert reasoning_format_for("<|im_start|>assistant") is None
    assert THINK.thinks("<|im_start|>assistant\n") and THINK.thinks("assistant\n<think>\n")
    assert not THINK.thinks("assistant\n<think>\n\n</think>\n\n")
    assert THINK.opened_by_prompt("<\uff5cAssistant\uff5c><think>\n")
    assert not THINK.opened_by_prompt("<|im_start|>assistant\n")
    assert THINK.forced_end("Time is up.") == "\nTime is up.\n</think>\n\n"
    assert THINK.forced_empty() == "<think>\n\n</think>\n\n"


# -- the budget ------------------------------------------------------------------------------------

END = (901, 902)  # the forced end's ids
EMPTY = (800, 801, 902)


def run_budget(params: ReasoningParams, pieces: list[bytes]) -> list[int | bytes]:
    """Each step: the forced id, or the sampled piece (taken from `pieces` in order)."""
    budget = ThinkingBudget(params)
    out: list[int | bytes] = []
    sampled = iter(pieces)
    while not budget.is_done:
        forced = budget.forced()
        if forced is not None:
            out.append(forced)
            budget.observe(b"</think>" if forced == 902 else b"x")
            continue
        piece = next(sampled, None)
        if piece is None:
            break
        out.append(piece)
        budget.observe(piece)
    return out


def params(budget: int | None, *, opened: bool = True) -> ReasoningParams:
    return ReasoningParams("<think>", "</think>", opened, budget, END, EMPTY)


def test_the_end_is_forced_after_the_budget() -> None:
    assert run_budget(params(3), [b"a", b"b", b"c", b"d"]) == [b"a", b"b", b"c", 901, 902]


def test_a_closer_the_model_writes_ends_the_section() -> None:
    assert run_budget(params(5), [b"a", b"</th", b"ink>", b"z"]) == [b"a", b"</th", b"ink>"]


def test_a_character_is_never_split() -> None:
    snow = "\u2603".encode()  # three bytes
    pieces = [b"a", snow[:1], snow[1:2], snow[2:], b"b"]
    assert run_budget(params(2), pieces) == [b"a", snow[:1], snow[1:2], snow[2:], 901, 902]


def test_budget_zero_and_a_model_that_opens_its_section() -> None:
    assert run_budget(params(0), [b"a"]) == [901, 902]
    assert run_budget(params(0, opened=False), [b"a"]) == [800, 801, 902]
    waiting = params(2, opened=False)
    assert run_budget(waiting, [b"\n<th", b"ink>", b"a", b"b", b"c"]) == [
        b"\n<th",
        b"ink>",
        b"a",
        b"b",
        901,
        902,
    ]
    assert run_budget(waiting, [b"Hello", b"a", b"b", b"c"]) == [b"Hello"]  # no thinking
    assert run_budget(params(None), [b"a", b"b"]) == [b"a", b"b"]


# -- v1's checks -----------------------------------------------------------------------------------


def chat(**fields: Any) -> pb.GenerateRequest:
    fields.setdefault("messages", [pb.ChatMessage(role="user", content="hi")])
    return pb.GenerateRequest(**fields)


def test_chat_options() -> None:
    got = rpc_reasoning.parse_chat_options(
        chat(chat_template_kwargs='{"enable_thinking": true, "x": 1}', enable_thinking=False)
    )
    assert got == rpc_reasoning.ChatOptions({"enable_thinking": False, "x": 1}, None)
    assert rpc_reasoning.parse_chat_options(chat(reasoning_budget=0)).budget == 0


@pytest.mark.parametrize(
    ("fields", "field", "text"),
    [
        ({"reasoning_budget": -2}, "reasoning_budget", "got -2"),
        ({"chat_template_kwargs": "[1]"}, "chat_template_kwargs", "got list"),
        (
            {"messages": [], "prompt": "p", "enable_thinking": True},
            "enable_thinking",
            "messages only",
        ),
    ],
)
def test_bad_chat_options_name_the_field(fields: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        rpc_reasoning.parse_chat_options(chat(**fields))
    assert caught.value.field == field
    assert text in caught.value.message


class Grammars:
    def __init__(self) -> None:
        self.checked: list[tuple[str, str]] = []

    def check_grammar(self, gbnf: str, root: str) -> None:
        self.checked.append((gbnf, root))

    def json_schema_to_grammar(self, schema: str) -> str:
        raise NotImplementedError


def test_a_constraint_applies_after_the_section() -> None:
    """The grammar: the section (optional when the model opens it itself), then the request's
    grammar, embedded by its root; llama.cpp checks it (tests/e2e/test_families.py runs it:
    thinking, then the schema's JSON)."""
    grammars = Grammars()
    inner = Constraint('start ::= "{}"', "start", "params.grammar.gbnf")
    opened = thinking.after_thinking(inner, THINK, grammars, opened=True)
    waiting = thinking.after_thinking(inner, THINK, grammars, opened=False)
    assert opened is not None and waiting is not None
    for got in (opened, waiting):
        assert (got.root, got.field, got.triggers) == ("root", "params.grammar.gbnf", ())
        assert '"</think>"' in got.gbnf
        assert 'g-start ::= "{}"' in got.gbnf  # the request's grammar, its rules prefixed
    assert '"<think>"' in waiting.gbnf and '"<think>"' not in opened.gbnf
    assert grammars.checked == [(opened.gbnf, "root"), (waiting.gbnf, "root")]
    already = Constraint("root ::= x", "root", "f", triggers=("<tool_call>",))
    assert thinking.after_thinking(already, THINK, grammars, opened=True) is already
