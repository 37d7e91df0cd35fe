"""Thinking models, whichever protocol asked: whether a request's prompt thinks, the budget's
forced token ids, the splitter that separates thinking from the answer, the format's markers the
output must show, and the request's constraint made to apply from the end of thinking on (vLLM's
grammar waits for its reasoning parser to see the end of thinking; here the thinking section is
part of the grammar). The splitting itself is core.reasoning; v1's chat options are checked in
rpc.v1.reasoning."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from llama_grpc_server import errors
from llama_grpc_server.config import SchedulerSettings
from llama_grpc_server.core.api import EngineApi, GrammarCompiler
from llama_grpc_server.core.constrained.structural_tag import prefix_rules, structural_tag_to_gbnf
from llama_grpc_server.core.reasoning.budget import ReasoningParams
from llama_grpc_server.core.reasoning.formats import ReasoningFormat, reasoning_format_named
from llama_grpc_server.core.reasoning.split import ReasoningSplitter
from llama_grpc_server.core.requests.request import Constraint


@dataclass(frozen=True, slots=True)
class Thinking:
    """A request that thinks: its format and the budget's parameters."""

    fmt: ReasoningFormat
    params: ReasoningParams

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.fmt, opened=self.params.opened)


def thinking(
    engine: EngineApi,
    template: str,
    prompt: str,
    budget: int | None,
    limits: SchedulerSettings,
) -> Thinking | None:
    """The request's thinking, or None when its model does not think or its prompt closed the
    section (enable_thinking false). `budget` None: the server's (-1: no limit)."""
    name = engine.reasoning_format(template)
    if not name:
        return None
    fmt = reasoning_format_named(name)
    if not fmt.thinks(prompt):
        return None
    chosen = limits.reasoning_budget if budget is None else budget
    params = ReasoningParams(fmt.opener, fmt.closer, fmt.opened_by_prompt(prompt))
    if chosen >= 0:
        message = limits.reasoning_budget_message

        def ids(text: str) -> tuple[int, ...]:
            return tuple(engine.tokenize(text, add_special=False, parse_special=True))

        params = dataclasses.replace(
            params,
            budget=chosen,
            forced_end_ids=ids(fmt.forced_end(message)),
            forced_empty_ids=ids(fmt.forced_empty()),
        )
    return Thinking(fmt, params)


def shown_specials(engine: EngineApi, fmt: ReasoningFormat) -> tuple[tuple[int, str], ...]:
    """The format's markers that are special tokens of this model (Gemma 4's `<|channel>`):
    the output must show them for the splitter to see them."""
    shown: list[tuple[int, str]] = []
    for marker in (fmt.opener, fmt.closer):
        ids = engine.tokenize(marker, add_special=False, parse_special=True)
        if len(ids) == 1 and not engine.detokenize(ids, render_special=False):
            shown.append((ids[0], marker))
    return tuple(shown)


def after_thinking(
    constraint: Constraint | None,
    fmt: ReasoningFormat,
    grammars: GrammarCompiler | None,
    *,
    opened: bool,
) -> Constraint | None:
    """The constraint applied from the end of thinking on, as one grammar from the first
    token (llama.cpp's own chat parsers do the same): free text that never holds the closer,
    the closer, at most 4 blanks (unbounded, a model may write blank lines forever), then the
    request's grammar. When the model opens its section itself (`opened` false), the grammar
    begins with the opener: a thinking model always writes its section (Qwen 3 an empty one
    when told not to think), and SMG's reasoning parsers read an answer as thinking until the
    closer. A budget's forced end (and forced empty section) is text this grammar accepts.
    An already lazy constraint (a structural tag with triggers of its own) is left as it is."""
    if constraint is None or constraint.triggers or grammars is None:
        return constraint
    inner = constraint.gbnf
    if constraint.root != "root":  # the structural tag embeds a grammar by its `root`
        inner = prefix_rules(inner, "g-") + f"\nroot ::= g-{constraint.root}\n"
    blanks = {"type": "regex", "pattern": "[ \\t\\n]{0,4}"}
    thinking = {"type": "any_text", "excludes": [fmt.closer]}
    section: dict[str, Any] = {
        "type": "sequence",
        "elements": [thinking, {"type": "const_string", "value": fmt.closer}, blanks],
    }
    if not opened:
        opener = {"type": "const_string", "value": fmt.opener}
        section = {"type": "sequence", "elements": [blanks, opener, section]}
    answer = {"type": "grammar", "grammar": inner}
    document = {
        "type": "structural_tag",
        "format": {"type": "sequence", "elements": [section, answer]},
    }
    text = json.dumps(document, ensure_ascii=False)
    try:
        gbnf = structural_tag_to_gbnf(text, grammars.json_schema_to_grammar).gbnf
        grammars.check_grammar(gbnf, "root")
    except ValueError as exc:
        raise errors.InvalidRequest(str(exc), field=constraint.field) from None
    return dataclasses.replace(constraint, gbnf=gbnf, root="root")
