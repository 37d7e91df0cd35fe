"""Regular expressions and choice lists compiled to GBNF grammars, for the `regex` and `choice`
constraints of the vLLM engine protocol. Pure: no llama_cpp; the engine checks the result like
any grammar.

The output must match the whole pattern (as vLLM's structured outputs do), so `^` at the very
start and `$` at the very end mean nothing more and are accepted. Supported: literals and
escapes (\\n \\t \\r \\f \\v \\0 \\xHH \\uHHHH, an escaped punctuation mark), `.` (any character
but a newline), classes `[...]` with ranges and negation, \\d \\w \\s and their negations,
groups `(...)`, `(?:...)`, named groups, alternation, and the quantifiers `*`, `+`, `?`,
`{m}`, `{m,}`, `{m,n}` (lazy forms match the same strings). Everything else is refused with a
RegexUnsupported that names the feature: backreferences, lookaround, anchors inside the
pattern, word boundaries, inline flags, Unicode properties, possessive quantifiers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

MAX_REPEAT = 1000  # the largest {m,n} bound accepted (llama.cpp expands repetitions into rules)

_BMP_LAST = 0xFFFF  # above it GBNF writes \U and eight digits
_DIGIT = "0-9"
_WORD = "a-zA-Z0-9_"
_SPACE = " \t\n\r\f\v"
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a"}
_REFUSED_ESCAPES = {
    "b": "a word boundary (\\b)",
    "B": "a non-boundary (\\B)",
    "A": "an anchor (\\A)",
    "Z": "an anchor (\\Z)",
    "z": "an anchor (\\z)",
    "G": "an anchor (\\G)",
    "p": "a Unicode property (\\p)",
    "P": "a Unicode property (\\P)",
    "k": "a named backreference (\\k)",
}


class RegexUnsupported(ValueError):
    """The pattern is invalid, or uses a feature that cannot become a grammar."""


def regex_to_gbnf(pattern: str) -> str:
    """A GBNF grammar (root rule `root`) whose language is the strings `pattern` fully matches."""
    if not pattern:
        raise RegexUnsupported("the regex is empty")
    return f"root ::= {_Parser(pattern).parse()}\n"


def choice_to_gbnf(choices: Sequence[str]) -> str:
    """A GBNF grammar matching exactly one of `choices` (which must be non-empty strings)."""
    if not choices:
        raise RegexUnsupported("the choice list is empty")
    for index, choice in enumerate(choices):
        if not choice:
            raise RegexUnsupported(f"choice {index} is an empty string")
    return "root ::= " + " | ".join(_literal(c) for c in dict.fromkeys(choices)) + "\n"


def gbnf_literal(text: str) -> str:
    """`text` as a GBNF string literal (core/constrained/structural_tag.py builds grammars with it
    too)."""
    return _literal(text)


def gbnf_char(c: str) -> str:
    """One character as GBNF writes it inside a string literal or a class."""
    return _char(c)


def _char(c: str) -> str:
    """One character as GBNF writes it inside a string literal or a class."""
    if c.isascii() and (c.isalnum() or c in " _,;:!?#%&'/=<>@`~"):
        return c
    code = ord(c)
    if c.isascii():
        return f"\\x{code:02X}"
    if code <= _BMP_LAST:
        return f"\\u{code:04X}"
    return f"\\U{code:08X}"


def _class_ranges(ranges: str) -> str:
    """The members of \\d, \\w or \\s inside a GBNF class (their '-' are range operators)."""
    return "".join(x if x == "-" else _char(x) for x in ranges)


def _merge_literals(items: list[str]) -> list[str]:
    """Adjacent plain string literals as one: "a" "b" -> "ab" (a quantified one ends in its
    quantifier, never in a quote, so it stays apart)."""
    out: list[str] = []
    for item in items:
        if out and _is_literal(out[-1]) and _is_literal(item):
            out[-1] = out[-1][:-1] + item[1:]
        elif item:
            out.append(item)
    return out


def _is_literal(item: str) -> bool:
    return len(item) > 1 and item[0] == '"' and item[-1] == '"'


def _literal(text: str) -> str:
    return '"' + "".join(_char(c) for c in text) + '"'


class _Parser:
    """Recursive descent over the pattern; each method returns GBNF text."""

    def __init__(self, pattern: str) -> None:
        self._text = pattern
        self._pos = 0

    def parse(self) -> str:
        if self._text.startswith("^"):
            self._pos = 1
        out = self._alternation()
        if self._pos < len(self._text):  # only a stray ")" stops an alternation early
            self._refuse(f"an unbalanced ')' at position {self._pos}")
        return out

    # -- structure --------------------------------------------------------------------------------

    def _alternation(self) -> str:
        branches = [self._sequence()]
        while self._peek() == "|":
            self._pos += 1
            branches.append(self._sequence())
        filled = [b for b in branches if b]
        if not filled:
            self._refuse("an empty group or pattern")
        body = " | ".join(filled)
        if len(filled) < len(branches):  # an empty branch: the whole choice is optional
            return f"({body})?"
        return body

    def _sequence(self) -> str:
        items: list[str] = []
        while self._pos < len(self._text) and self._peek() not in "|)":
            if self._peek() == "$":
                self._end_anchor()
                continue
            atom = self._atom()
            items.append(self._quantified(atom))
        return " ".join(_merge_literals(items))

    def _end_anchor(self) -> None:
        if self._pos != len(self._text) - 1:
            self._refuse(f"an anchor '$' inside the pattern (position {self._pos})")
        self._pos += 1

    def _quantified(self, atom: str) -> str:
        quantifier = self._quantifier()
        if quantifier is None:
            return atom
        if self._peek() == "?":  # lazy: the same strings match in full
            self._pos += 1
        elif self._peek() == "+":
            self._refuse(f"a possessive quantifier at position {self._pos}")
        if self._peek() in ("*", "+", "?") or self._repeat_ahead():
            self._refuse(f"a repeated quantifier at position {self._pos}")
        return atom + quantifier  # every atom is one GBNF symbol: a literal, class or group

    def _quantifier(self) -> str | None:
        c = self._peek()
        if c in ("*", "+", "?"):
            self._pos += 1
            return c
        if c == "{" and self._repeat_ahead():
            end = self._text.index("}", self._pos)
            body = self._text[self._pos + 1 : end]
            self._pos = end + 1
            low_text, comma, high_text = body.partition(",")
            low = int(low_text or "0")
            high = int(high_text) if high_text else None
            if high is not None and high < low:
                self._refuse(f"a repetition {{{body}}} whose maximum is below its minimum")
            if max(low, high or 0) > MAX_REPEAT:
                self._refuse(f"a repetition bound above {MAX_REPEAT} ({{{body}}})")
            if not comma:
                return f"{{{low}}}"
            return f"{{{low},}}" if high is None else f"{{{low},{high}}}"
        return None

    def _repeat_ahead(self) -> bool:
        """Whether a {m}, {m,} or {m,n} quantifier starts here (else '{' is a literal)."""
        if self._peek() != "{":
            return False
        end = self._text.find("}", self._pos)
        if end < 0:
            return False
        low, comma, high = self._text[self._pos + 1 : end].partition(",")
        if not low:  # {,n} is {0,n}
            return bool(comma) and high.isdigit()
        return low.isdigit() and (not high or high.isdigit())

    # -- atoms ------------------------------------------------------------------------------------

    def _atom(self) -> str:
        c = self._text[self._pos]
        if c == "(":
            return self._group()
        if c == "[":
            return self._class()
        self._pos += 1
        if c == ".":
            return "[^\\x0A]"
        if c == "\\":
            return self._escape()
        if c in "*+?":
            self._refuse(f"a quantifier with nothing to repeat at position {self._pos - 1}")
        if c == "^":
            self._refuse(f"an anchor '^' inside the pattern (position {self._pos - 1})")
        return _literal(c)

    def _group(self) -> str:
        start = self._pos
        self._pos += 1
        if self._text.startswith("?", self._pos):
            self._group_prefix(start)
        inner = self._alternation()
        if self._peek() != ")":
            self._refuse(f"an unclosed group opened at position {start}")
        self._pos += 1
        return f"({inner})"

    def _group_prefix(self, start: int) -> None:
        rest = self._text[self._pos :]
        if rest.startswith("?:"):
            self._pos += 2
            return
        for opener in ("?P<", "?<"):
            if rest.startswith(opener) and not rest.startswith(("?<=", "?<!")):
                end = self._text.find(">", self._pos)
                if end < 0:
                    self._refuse(f"an unterminated group name at position {start}")
                self._pos = end + 1
                return
        kinds = {"?=": "a lookahead", "?!": "a negative lookahead", "?<=": "a lookbehind",
                 "?<!": "a negative lookbehind", "?P=": "a named backreference",
                 "?>": "an atomic group", "?#": "a comment group"}  # fmt: skip
        for opener, name in kinds.items():
            if rest.startswith(opener):
                self._refuse(f"{name} at position {start}")
        self._refuse(f"inline flags or a conditional at position {start}")

    def _escape(self) -> str:
        c, at = self._after_backslash()
        if c in _CLASS_ESCAPES:
            return f"[{_class_ranges(_CLASS_ESCAPES[c])}]"
        if c.lower() in _CLASS_ESCAPES:
            return f"[^{_class_ranges(_CLASS_ESCAPES[c.lower()])}]"
        return _literal(self._escaped_char(c, at))

    def _escaped_char(self, c: str, at: int) -> str:
        """The character an escape (the backslash at `at`, then `c`) stands for."""
        if c in _CHAR_ESCAPES:
            return _CHAR_ESCAPES[c]
        if c in ("x", "u", "U"):
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self._text[self._pos : self._pos + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self._refuse(f"a malformed \\{c} escape at position {at}")
            self._pos += width
            return chr(int(digits, 16))
        if c.isdigit():
            self._refuse(f"a backreference (\\{c}) at position {at}")
        if c in _REFUSED_ESCAPES:
            self._refuse(f"{_REFUSED_ESCAPES[c]} at position {at}")
        if c.isalnum():
            self._refuse(f"the unknown escape \\{c} at position {at}")
        return c

    def _class(self) -> str:
        start = self._pos
        self._pos += 1
        negated = self._peek() == "^"
        if negated:
            self._pos += 1
        parts: list[str] = []
        is_first = True
        while True:
            if self._pos >= len(self._text):
                self._refuse(f"an unclosed character class opened at position {start}")
            if self._peek() == "]" and not is_first:
                self._pos += 1
                break
            is_first = False
            if self._text.startswith(("[:", "[=", "[."), self._pos):
                self._refuse(f"a POSIX class at position {self._pos}")
            low, ranges = self._class_member()
            if ranges:
                parts.append(ranges)
            elif self._peek() == "-" and self._text[self._pos + 1 : self._pos + 2] not in ("]", ""):
                self._pos += 1
                high, high_ranges = self._class_member()
                if high_ranges:
                    self._refuse(f"a range ending in a class escape in the class at {start}")
                if ord(high) < ord(low):
                    self._refuse(f"a reversed range {low!r}-{high!r} in the class at {start}")
                parts.append(f"{_char(low)}-{_char(high)}")
            else:
                parts.append(_char(low))
        return "[" + ("^" if negated else "") + "".join(parts) + "]"

    def _class_member(self) -> tuple[str, str]:
        """One member of a class: (a character, "") or ("", the ranges of \\d, \\w or \\s)."""
        c = self._text[self._pos]
        self._pos += 1
        if c != "\\":
            return c, ""
        e, at = self._after_backslash()
        if e in _CLASS_ESCAPES:
            return "", _class_ranges(_CLASS_ESCAPES[e])
        if e.lower() in _CLASS_ESCAPES:
            self._refuse(f"a negated class escape (\\{e}) inside a class, at position {at}")
        if e == "b":
            return "\b", ""  # backspace inside a class
        return self._escaped_char(e, at), ""

    # -- helpers ----------------------------------------------------------------------------------

    def _after_backslash(self) -> tuple[str, int]:
        """The character after the backslash just read, and the backslash's position."""
        at = self._pos - 1
        if self._pos >= len(self._text):
            self._refuse("a trailing backslash")
        self._pos += 1
        return self._text[self._pos - 1], at

    def _peek(self) -> str:
        return self._text[self._pos] if self._pos < len(self._text) else ""

    def _refuse(self, feature: str) -> NoReturn:
        raise RegexUnsupported(f"the regex uses {feature}, which cannot be compiled to a grammar")
