"""A small GBNF recognizer in pure Python: does a grammar accept a whole string? For property
tests of the grammars core/constrained writes (regex_grammar.py's), without llama.cpp.

It reads llama.cpp's GBNF (grammar-parser.cpp) as far as those grammars go: rules `name ::= ...`
(a newline outside parentheses ends one; `#` starts a comment), alternation `|`, sequences,
groups, rule references, string literals, character classes `[...]` (ranges, `^` negation), `.`,
and the postfix operators `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`; escapes \\xHH \\uHHHH
\\UHHHHHHHH \\n \\r \\t \\\\ \\" \\[ \\] \\-. Matching computes the set of positions each part can
end at (memoized per part and position), so ambiguity costs nothing but the set's size; it is
meant for short strings, not for left-recursive grammars (llama.cpp refuses those too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NoReturn

_SIMPLE_ESCAPES = {
    "n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-",
}  # fmt: skip
_HEX_WIDTHS = {"x": 2, "u": 4, "U": 8}
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


class GBNFSyntaxError(ValueError):
    """The grammar text is not GBNF this recognizer reads."""


@dataclass(eq=False)
class _Node:
    kind: str  # "lit", "class", "any", "ref", "seq", "alt", "rep"
    text: str = ""  # lit: the string; ref: the rule name
    negated: bool = False  # class
    ranges: list[tuple[str, str]] = field(default_factory=list)  # class: (low, high) each
    children: list[_Node] = field(default_factory=list)  # seq, alt; rep: the one repeated
    low: int = 0  # rep
    high: int | None = None  # rep: None is unbounded


class Grammar:
    """A parsed GBNF grammar; `accepts(text)` says whether its root rule matches all of text."""

    def __init__(self, text: str) -> None:
        self.rules = _Parser(text).parse()
        for node in self._nodes():
            if node.kind == "ref" and node.text not in self.rules:
                raise GBNFSyntaxError(f"undefined rule {node.text!r}")

    def accepts(self, text: str, root: str = "root") -> bool:
        if root not in self.rules:
            raise GBNFSyntaxError(f"no rule {root!r}")
        memo: dict[tuple[int, int], frozenset[int]] = {}
        return len(text) in self._ends(self.rules[root], text, 0, memo)

    def _nodes(self) -> list[_Node]:
        out, todo = [], list(self.rules.values())
        while todo:
            node = todo.pop()
            out.append(node)
            todo += node.children
        return out

    def _ends(
        self, node: _Node, text: str, pos: int, memo: dict[tuple[int, int], frozenset[int]]
    ) -> frozenset[int]:
        key = (id(node), pos)
        if key not in memo:
            memo[key] = frozenset(self._match(node, text, pos, memo))
        return memo[key]

    def _match(  # noqa: PLR0911 (one return per kind of part)
        self, node: _Node, text: str, pos: int, memo: dict[tuple[int, int], frozenset[int]]
    ) -> set[int]:
        if node.kind == "lit":
            return {pos + len(node.text)} if text.startswith(node.text, pos) else set()
        if node.kind in ("class", "any"):
            if pos >= len(text):
                return set()
            c = text[pos]
            inside = node.kind == "any" or any(lo <= c <= hi for lo, hi in node.ranges)
            return {pos + 1} if inside != node.negated else set()
        if node.kind == "ref":
            return set(self._ends(self.rules[node.text], text, pos, memo))
        if node.kind == "alt":
            return set().union(*(self._ends(c, text, pos, memo) for c in node.children))
        if node.kind == "seq":
            positions = {pos}
            for child in node.children:
                positions = set().union(*(self._ends(child, text, p, memo) for p in positions))
            return positions
        return self._repeat(node, text, pos, memo)

    def _repeat(
        self, node: _Node, text: str, pos: int, memo: dict[tuple[int, int], frozenset[int]]
    ) -> set[int]:
        """Ends after low to high repetitions. Once low are done every further count accepts
        alike, so a position seen then is not walked again (an unbounded loop ends)."""
        [child] = node.children
        frontier, ends, count = {pos}, set(), 0
        if node.low == 0:
            ends.add(pos)
        while frontier and (node.high is None or count < node.high):
            frontier = set().union(*(self._ends(child, text, p, memo) for p in frontier))
            count += 1
            if count >= node.low:
                frontier -= ends
                ends |= frontier
        return ends


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def parse(self) -> dict[str, _Node]:
        rules: dict[str, _Node] = {}
        self.space(newlines=True)
        while self.pos < len(self.text):
            name = self.name()
            self.space(newlines=False)
            if not self.text.startswith("::=", self.pos):
                self.fail("'::=' after a rule name")
            self.pos += 3
            self.space(newlines=False)
            if name in rules:
                raise GBNFSyntaxError(f"rule {name!r} defined twice")
            rules[name] = self.alternation(depth=0)
            self.space(newlines=True)
        if not rules:
            raise GBNFSyntaxError("no rules")
        return rules

    def alternation(self, depth: int) -> _Node:
        branches = [self.sequence(depth)]
        while self.peek() == "|":
            self.pos += 1
            self.space(newlines=True)
            branches.append(self.sequence(depth))
        return branches[0] if len(branches) == 1 else _Node("alt", children=branches)

    def sequence(self, depth: int) -> _Node:
        items: list[_Node] = []
        while True:
            self.space(newlines=depth > 0)
            c = self.peek()
            if c in ("", "|", ")", "\n"):
                break
            if c in _NAME_CHARS and self.is_rule_start():
                break  # the next rule (only after a newline at depth 0, which stops sooner)
            items.append(self.postfix(self.atom(depth)))
        return items[0] if len(items) == 1 else _Node("seq", children=items)

    def is_rule_start(self) -> bool:
        end = self.pos
        while end < len(self.text) and self.text[end] in _NAME_CHARS:
            end += 1
        return self.text[end:].lstrip(" \t").startswith("::=")

    def atom(self, depth: int) -> _Node:
        c = self.peek()
        if c == '"':
            self.pos += 1
            chars = []
            while self.peek() != '"':
                if not self.peek():
                    self.fail("a closing '\"'")
                chars.append(self.char())
            self.pos += 1
            return _Node("lit", text="".join(chars))
        if c == "[":
            return self.char_class()
        if c == "(":
            self.pos += 1
            self.space(newlines=True)
            inner = self.alternation(depth + 1)
            self.space(newlines=True)
            if self.peek() != ")":
                self.fail("')'")
            self.pos += 1
            return inner
        if c == ".":
            self.pos += 1
            return _Node("any")
        if c in _NAME_CHARS:
            return _Node("ref", text=self.name())
        self.fail("a literal, class, group or rule name")

    def char_class(self) -> _Node:
        self.pos += 1
        node = _Node("class")
        if self.peek() == "^":
            node.negated = True
            self.pos += 1
        while self.peek() != "]":
            if not self.peek():
                self.fail("a closing ']'")
            low = self.char()
            high = low
            if self.peek() == "-" and self.text[self.pos + 1 : self.pos + 2] not in ("]", ""):
                self.pos += 1
                high = self.char()
            node.ranges.append((low, high))
        self.pos += 1
        return node

    def postfix(self, node: _Node) -> _Node:
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.pos += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{":
                end = self.text.find("}", self.pos)
                if end < 0:
                    self.fail("a closing '}'")
                body = self.text[self.pos + 1 : end].replace(" ", "")
                self.pos = end + 1
                low_text, comma, high_text = body.partition(",")
                if not low_text.isdigit() or (high_text and not high_text.isdigit()):
                    self.fail("{m}, {m,} or {m,n}")
                low = int(low_text)
                high = (int(high_text) if high_text else None) if comma else low
            else:
                return node
            node = _Node("rep", children=[node], low=low, high=high)

    def char(self) -> str:
        c = self.text[self.pos]
        self.pos += 1
        if c != "\\":
            return c
        e = self.peek()
        self.pos += 1
        if e in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[e]
        if e in _HEX_WIDTHS:
            digits = self.text[self.pos : self.pos + _HEX_WIDTHS[e]]
            try:
                code = int(digits, 16)
            except ValueError:
                self.fail(f"{_HEX_WIDTHS[e]} hex digits after \\{e}")
            if len(digits) != _HEX_WIDTHS[e]:
                self.fail(f"{_HEX_WIDTHS[e]} hex digits after \\{e}")
            self.pos += len(digits)
            return chr(code)
        self.fail("a known escape")

    def name(self) -> str:
        start = self.pos
        while self.peek() and self.peek() in _NAME_CHARS:
            self.pos += 1
        if self.pos == start:
            self.fail("a rule name")
        return self.text[start : self.pos]

    def space(self, *, newlines: bool) -> None:
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            elif c in " \t\r" or (newlines and c == "\n"):
                self.pos += 1
            else:
                return

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def fail(self, expected: str) -> NoReturn:
        raise GBNFSyntaxError(f"expected {expected} at position {self.pos}: {self.text!r}")
