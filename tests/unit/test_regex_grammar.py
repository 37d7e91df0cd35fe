"""core.constrained.regex_grammar: regex and choice constraints as GBNF, and the features it
refuses."""

from __future__ import annotations

import pytest

from llama_grpc_server.core.constrained.regex_grammar import (
    MAX_REPEAT,
    RegexUnsupported,
    choice_to_gbnf,
    regex_to_gbnf,
)
from tests.support.regex_grammar import REGEX_CASES


@pytest.mark.parametrize(("pattern", "body"), REGEX_CASES)
def test_regex_compiles_to_this_grammar(pattern: str, body: str) -> None:
    assert regex_to_gbnf(pattern) == f"root ::= {body}\n"


@pytest.mark.parametrize(
    ("pattern", "feature"),
    [
        ("", "the regex is empty"),
        ("a(b", "an unclosed group opened at position 1"),
        (r"(a)\1", "a backreference (\\1) at position 3"),
        ("a(?=b)", "a lookahead at position 1"),
        ("a(?!b)", "a negative lookahead at position 1"),
        ("(?<=a)b", "a lookbehind at position 0"),
        ("(?<!a)b", "a negative lookbehind at position 0"),
        ("(?P<x>a)(?P=x)", "a named backreference at position 8"),
        ("(?>a)", "an atomic group at position 0"),
        ("(?i)a", "inline flags or a conditional at position 0"),
        (r"\bword", "a word boundary (\\b) at position 0"),
        (r"a\B", "a non-boundary (\\B) at position 1"),
        (r"\Aa", "an anchor (\\A) at position 0"),
        ("a^b", "an anchor '^' inside the pattern (position 1)"),
        ("a$b", "an anchor '$' inside the pattern (position 1)"),
        ("a*+", "a possessive quantifier at position 2"),
        ("a{1001}", f"a repetition bound above {MAX_REPEAT} ({{1001}})"),
        ("[[:alpha:]]", "a POSIX class at position 1"),
        (r"[\D]", "a negated class escape (\\D) inside a class, at position 1"),
        ("()", "an empty group or pattern"),
    ],
)
def test_regex_refusals_name_the_feature(pattern: str, feature: str) -> None:
    with pytest.raises(RegexUnsupported) as caught:
        regex_to_gbnf(pattern)
    message = str(caught.value)
    if feature == "the regex is empty":
        assert message == feature
    else:
        assert message == f"the regex uses {feature}, which cannot be compiled to a grammar"


def test_choice_is_an_alternation_of_literals() -> None:
    """Each choice is one literal, escaped; duplicates appear once, in order."""
    grammar = choice_to_gbnf(["yes", "no", 'it"s', "yes", "é"])
    assert grammar == 'root ::= "yes" | "no" | "it\\x22s" | "\\u00E9"\n'


@pytest.mark.parametrize(
    ("choices", "message"),
    [([], "the choice list is empty"), (["a", ""], "choice 1 is an empty string")],
)
def test_choice_refusals(choices: list[str], message: str) -> None:
    with pytest.raises(RegexUnsupported, match=f"^{message}$"):
        choice_to_gbnf(choices)
