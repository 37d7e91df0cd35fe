"""`structural_tag` constraints (vLLM protocol; xgrammar's format, which SMG sends for its
mistral, kimik2, kimi_k3 and inkling tool parsers and for gpt-oss) compiled to one GBNF grammar,
lazy when llama.cpp's lazy grammars can say it. Pure: no llama_cpp; JSON Schemas are converted
by the function the caller passes (the engine's converter), and the engine checks the result
like any grammar.

Accepted: the legacy form `{"type": "structural_tag", "structures": [{"begin", "schema",
"end"}], "triggers": [...]}` and the current one `{"type": "structural_tag", "format": F}` (SMG
leaves out "type"), where F is one of `const_string`, `json_schema`, `regex`, `grammar` (GBNF),
`any_text` (with `excludes` / `excluded_str`), `sequence`, `or`, `tag`, `triggered_tags`,
`tags_with_separator`, `optional`, `star` and `plus`. Refused, by name: other types
(`qwen_xml_parameter`), a tag no trigger is a prefix of, empty trigger or tag lists, and a regex,
schema or grammar the compilers refuse.

How each part becomes GBNF:
- Free text that must react to strings (the text between triggered tags, watching the triggers;
  `any_text`, avoiding its excludes and the text that follows it, such as its tag's end) is a
  right-linear grammar over the Aho-Corasick automaton of those strings: one rule per proper
  prefix, so a trigger is seen wherever it completes, even inside a token. The automaton may stop
  in any state (free text can end anywhere).
- A top-level `triggered_tags` without `at_least_one` (the tool-call case) is a lazy grammar:
  llama.cpp samples freely until the trigger pattern (the triggers, escaped, as one leftmost
  alternation) matches the text generated so far, then replays the text from the match on and
  constrains the rest: root ::= (any tag) (free text watching the triggers again, or nothing
  after the first tag with `stop_after_first`). A lazy grammar cannot go back to waiting, which
  is why the text after a tag is the automaton above. Everything else is an ordinary grammar from
  the first token (`at_least_one`: the output starts with a tag, as in xgrammar).

Differences from xgrammar: any_text followed by a string that overlaps itself (an end "aa" after
text ending in "a") may end one character later (the text avoids the end, then the end follows);
and see `TriggerGuard` for the tokens a lazy grammar may not take before its trigger."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from llama_grpc_server.core.constrained.regex_grammar import gbnf_char, gbnf_literal, regex_to_gbnf

MAX_DEPTH = 32  # nesting of formats (a recursive document is refused, not a stack overflow)
# Free text watching for strings has a rule per proper prefix of them: at most this many (the
# grammar is compiled on the event loop; real triggers and excludes have a few dozen characters)
MAX_WATCHED_PREFIXES = 2048
# std::regex's special characters (llama.cpp's common/regex_escape uses the same set)
_REGEX_SPECIAL = frozenset(".^$|()*+?[]{}\\")
_EMPTY = '""'


class StructuralTagUnsupported(ValueError):
    """The structural tag is invalid or uses something a (lazy) GBNF grammar cannot express;
    str() says where (`format.tags[1].content`) and what."""


@dataclass(frozen=True, slots=True)
class CompiledStructuralTag:
    """The grammar (root rule `root`); with `triggers` it is lazy: it applies from the first
    trigger on, and `starts` are the texts it may start with there (the tags' begins)."""

    gbnf: str
    triggers: tuple[str, ...] = ()
    starts: tuple[str, ...] = ()


def structural_tag_to_gbnf(
    text: str, json_schema_to_gbnf: Callable[[str], str]
) -> CompiledStructuralTag:
    """Compile the structural tag given as JSON text. `json_schema_to_gbnf` turns a JSON Schema
    (JSON text) into GBNF with root rule `root`, raising ValueError when it cannot."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise StructuralTagUnsupported(f"the structural tag is not valid JSON: {exc}") from None
    except RecursionError:  # json's parser recurses per nesting level
        raise StructuralTagUnsupported("the structural tag nests too deeply") from None
    if not isinstance(document, dict):
        raise StructuralTagUnsupported("the structural tag must be a JSON object")
    kind = document.get("type", "structural_tag")
    if kind != "structural_tag":
        raise StructuralTagUnsupported(f"type must be 'structural_tag', not {kind!r}")
    if "structures" in document:
        node, path = _legacy(document), ""
    elif "format" in document:
        node, path = document["format"], "format"
    else:
        raise StructuralTagUnsupported("the structural tag needs 'format' (or legacy 'structures')")
    return _Builder(json_schema_to_gbnf).build(node, path)


def trigger_pattern(triggers: Sequence[str]) -> str:
    """The one regex llama.cpp's lazy grammar searches for: the triggers escaped, longest first
    (std::regex_search finds the leftmost match, as `TriggerGuard` does)."""
    ordered = sorted(dict.fromkeys(triggers), key=lambda t: (-len(t), t))
    return "|".join("".join("\\" + c if c in _REGEX_SPECIAL else c for c in t) for t in ordered)


class TriggerGuard:
    """Which tokens a request with a lazy grammar may take before its grammar switches on.

    llama.cpp (0.3.36, src/llama-grammar.cpp llama_grammar_accept_impl) searches the trigger
    pattern in all the text sampled so far after each token; on a match it replays the text from
    the match start into the grammar. That replay is unchecked: text the grammar refuses makes
    llama_grammar_accept_token throw, and a C++ exception through the ctypes call aborts the
    process (measured: a lazy `root ::= "blu!"` with the trigger "blu", accepting Gemma 3's
    token " blue": "terminate called after throwing an instance of 'std::runtime_error' what():
    Unexpected empty grammar stack after accepting piece: blue (3730)", SIGABRT). Before the
    trigger the grammar masks nothing, so a token that completes a trigger and goes on within
    its own piece ("[TOOL_CALLS]garbage") would be sampled and abort us. The sampler asks
    `allows` for the token it is about to take while `is_awaiting`: a token whose replay (from
    the leftmost trigger to its end) is not a prefix of one of the tags' begins is refused and
    the sampler picks another. Tokens that complete a begin and go on into its content in the
    same piece are refused too (a slightly narrower choice, never a wrong text).
    Pieces are bytes as llama.cpp renders them (special tokens as their text)."""

    __slots__ = ("_keep", "_starts", "_tail", "_triggers", "is_awaiting")

    def __init__(self, triggers: Sequence[str], starts: Sequence[str]) -> None:
        self._triggers = tuple(t.encode("utf-8") for t in dict.fromkeys(triggers))
        self._starts = tuple(s.encode("utf-8") for s in dict.fromkeys(starts))
        self._keep = max(len(t) for t in self._triggers) - 1
        self._tail = b""
        self.is_awaiting = True

    def allows(self, piece: bytes) -> bool:
        """Whether taking a token with this piece next is safe."""
        replay = self._replay(piece)
        return replay is None or any(start.startswith(replay) for start in self._starts)

    def accept(self, piece: bytes) -> None:
        """The token with this piece was taken."""
        if not self.is_awaiting:
            return
        if self._replay(piece) is not None:
            self.is_awaiting = False
            self._tail = b""
            return
        text = self._tail + piece
        self._tail = text[len(text) - self._keep :] if self._keep else b""

    def _replay(self, piece: bytes) -> bytes | None:
        """The text the grammar would be given if this piece came next (None: no trigger).
        The tail holds no whole trigger: it would have matched when it completed."""
        text = self._tail + piece
        found = [at for at in (text.find(t) for t in self._triggers) if at >= 0]
        return text[min(found) :] if found else None


def _legacy(document: Mapping[str, Any]) -> dict[str, Any]:
    structures = document.get("structures")
    if not isinstance(structures, list):
        raise StructuralTagUnsupported("structures must be a list")
    tags = []
    for index, item in enumerate(structures):
        if not isinstance(item, dict):
            raise StructuralTagUnsupported(f"structures[{index}] must be an object")
        schema = item.get("schema")
        if isinstance(schema, str):  # xgrammar's legacy items also take the schema as text
            try:
                schema = json.loads(schema)
            except ValueError:
                raise StructuralTagUnsupported(
                    f"structures[{index}].schema is not valid JSON"
                ) from None
        tags.append(
            {
                "begin": item.get("begin"),
                "content": {"type": "json_schema", "json_schema": schema},
                "end": item.get("end"),
            }
        )
    return {"type": "triggered_tags", "triggers": document.get("triggers"), "tags": tags}


_Handler = Callable[["_Builder", Mapping[str, Any], str, str, int], str]


class _Builder:
    """Collects rules while walking the format; each method returns a GBNF expression."""

    def __init__(self, json_schema_to_gbnf: Callable[[str], str]) -> None:
        self._convert = json_schema_to_gbnf
        self._rules: list[str] = []  # whole rule lines (sub-grammars arrive as several)
        self._count = 0

    def build(self, node: Any, path: str) -> CompiledStructuralTag:
        fields = _object(node, path)
        if fields.get("type") == "triggered_tags" and not _flag(fields, "at_least_one", path):
            triggers, tags = self._triggered_parts(fields, path)
            root = self._triggered(fields, path, depth=1, lazy=True)
            starts = tuple(_string(t, "begin", f"{path}.tags[{i}]") for i, t in enumerate(tags))
            return CompiledStructuralTag(self._grammar(root), tuple(triggers), starts)
        return CompiledStructuralTag(self._grammar(self._format(node, path, "", depth=1)))

    # -- formats ----------------------------------------------------------------------------------

    def _format(self, node: Any, path: str, follow: str, depth: int) -> str:
        """`follow`: the text known to come right after this part ("" when unknown), which an
        any_text must not contain."""
        if depth > MAX_DEPTH:
            _refuse(path, f"formats nest deeper than {MAX_DEPTH}")
        fields = _object(node, path)
        kind = fields.get("type")
        if kind is None and "begin" in fields:  # the items of a tags list may leave out "type"
            kind = "tag"
        handler = self._HANDLERS.get(kind) if isinstance(kind, str) else None
        if handler is None:
            _refuse(path, f"format type {kind!r} is not supported")
        return handler(self, fields, path, follow, depth)

    def _const_string(self, fields: Mapping[str, Any], path: str, _f: str, _d: int) -> str:
        return _literal(_string(fields, "value", path))

    def _regex(self, fields: Mapping[str, Any], path: str, _f: str, _d: int) -> str:
        pattern = _string(fields, "pattern", path)
        return self._sub_grammar(path, lambda: regex_to_gbnf(pattern))

    def _gbnf(self, fields: Mapping[str, Any], path: str, _f: str, _d: int) -> str:
        grammar = _string(fields, "grammar", path)
        return self._sub_grammar(path, lambda: grammar)

    def _any_text(self, fields: Mapping[str, Any], path: str, follow: str, _d: int) -> str:
        excludes = fields.get("excludes", fields.get("excluded_str", []))
        if not isinstance(excludes, list) or not all(isinstance(e, str) for e in excludes):
            _refuse(path, "excludes must be a list of strings")
        return self._automaton(path, [e for e in [*excludes, follow] if e], {})

    def _sequence(self, fields: Mapping[str, Any], path: str, follow: str, depth: int) -> str:
        elements = _list(fields, "elements", path)
        parts = []
        for index, element in enumerate(elements):
            after = _start(elements[index + 1]) if index + 1 < len(elements) else follow
            parts.append(self._format(element, f"{path}.elements[{index}]", after, depth + 1))
        return _join(parts)

    def _or(self, fields: Mapping[str, Any], path: str, follow: str, depth: int) -> str:
        elements = _list(fields, "elements", path)
        options = [
            self._format(e, f"{path}.elements[{i}]", follow, depth + 1)
            for i, e in enumerate(elements)
        ]
        return "(" + " | ".join(o or _EMPTY for o in options) + ")"

    def _repeat(self, fields: Mapping[str, Any], path: str, _f: str, depth: int) -> str:
        kind = fields["type"]
        if "content" not in fields:
            _refuse(path, f"{kind} needs 'content'")
        inner = self._format(fields["content"], f"{path}.content", "", depth + 1)
        return f"({inner or _EMPTY})" + {"optional": "?", "star": "*", "plus": "+"}[kind]

    def _nested_triggered(self, fields: Mapping[str, Any], path: str, _f: str, depth: int) -> str:
        return self._triggered(fields, path, depth, lazy=False)

    def _tag(self, fields: Mapping[str, Any], path: str, follow: str, depth: int) -> str:
        begin, rest = self._tag_parts(fields, path, follow, depth)
        return _join([_literal(begin), rest])

    def _tag_parts(
        self, fields: Mapping[str, Any], path: str, follow: str, depth: int
    ) -> tuple[str, str]:
        """A tag's begin text, and the expression of its content and end."""
        begin, end = _string(fields, "begin", path), _string(fields, "end", path)
        if "content" not in fields:
            _refuse(path, "a tag needs 'content'")
        content = self._format(fields["content"], f"{path}.content", end or follow, depth + 1)
        return begin, _join([content, _literal(end)])

    def _json_schema(self, fields: Mapping[str, Any], path: str, _f: str, _d: int) -> str:
        if "json_schema" not in fields:
            _refuse(path, "json_schema needs 'json_schema'")
        schema = fields["json_schema"]
        if isinstance(schema, str):
            text = schema
        elif isinstance(schema, (dict, bool)):
            text = json.dumps(schema)
        else:
            _refuse(f"{path}.json_schema", "must be an object or a boolean")
        return self._sub_grammar(f"{path}.json_schema", lambda: self._convert(text))

    def _sub_grammar(self, path: str, make: Callable[[], str]) -> str:
        """A grammar with root `root` (a converted schema, a regex, given GBNF) as a rule of
        ours: its rules renamed apart."""
        try:
            gbnf = make()
        except ValueError as exc:
            _refuse(path, str(exc))
        prefix = self._name("g")
        self._rules.append(prefix_rules(gbnf, prefix + "-").rstrip("\n") + "\n")
        return f"{prefix}-root"

    def _triggered_parts(
        self, fields: Mapping[str, Any], path: str
    ) -> tuple[list[str], list[Mapping[str, Any]]]:
        triggers = _list(fields, "triggers", path)
        for index, trigger in enumerate(triggers):
            if not isinstance(trigger, str) or not trigger:
                _refuse(f"{path}.triggers[{index}]", "a trigger must be a non-empty string")
            if "\0" in trigger:
                _refuse(f"{path}.triggers[{index}]", "a trigger may not contain NUL")
        tags = [_object(t, f"{path}.tags[{i}]") for i, t in enumerate(_list(fields, "tags", path))]
        for index, tag in enumerate(tags):
            begin = _string(tag, "begin", f"{path}.tags[{index}]")
            if not any(begin.startswith(t) for t in triggers):
                _refuse(f"{path}.tags[{index}].begin", "no trigger is a prefix of it")
        return triggers, tags

    def _triggered(self, fields: Mapping[str, Any], path: str, depth: int, *, lazy: bool) -> str:
        """Free text where each trigger enters a tag that begins with it. `lazy`: the expression
        of a lazy root instead, which starts at a trigger (any tag, then what follows a tag)."""
        triggers, tags = self._triggered_parts(fields, path)
        parts = [self._tag_parts(t, f"{path}.tags[{i}]", "", depth + 1) for i, t in enumerate(tags)]
        free = self._name("free")  # the text between tags, named before the exits refer to it
        after = "" if _flag(fields, "stop_after_first", path) else free
        entries: dict[tuple[str, ...], str] = {}

        def enter(completed: Sequence[str]) -> str:
            key = tuple(sorted(completed))
            if key not in entries:
                options: list[str] = []
                for begin, rest in parts:
                    for trigger in key:
                        if begin.startswith(trigger):
                            option = _join([_literal(begin[len(trigger) :]), rest]) or _EMPTY
                            if option not in options:
                                options.append(option)
                body = _join(["(" + " | ".join(options) + ")", after])
                entries[key] = self._rule("enter", body)
            return entries[key]

        self._automaton(path, [], dict.fromkeys(triggers, enter), name=free)
        every_tag = self._rule("tags", " | ".join(_join([_literal(b), r]) for b, r in parts))
        if lazy or _flag(fields, "at_least_one", path):
            return _join([every_tag, after])
        return free

    def _with_separator(self, fields: Mapping[str, Any], path: str, _f: str, depth: int) -> str:
        separator = fields.get("separator", "")
        if not isinstance(separator, str):
            _refuse(f"{path}.separator", "must be a string")
        tags = _list(fields, "tags", path)
        bodies = [
            self._tag(_object(t, f"{path}.tags[{i}]"), f"{path}.tags[{i}]", separator, depth + 1)
            for i, t in enumerate(tags)
        ]
        one = self._rule("tag", " | ".join(bodies))
        if _flag(fields, "stop_after_first", path):
            more = one
        else:
            more = _join([one, f"({_join([_literal(separator), one]) or _EMPTY})*"])
        return more if _flag(fields, "at_least_one", path) else f"({more})?"

    _HANDLERS: ClassVar[dict[str, _Handler]] = {}

    # -- free text --------------------------------------------------------------------------------

    def _automaton(
        self,
        path: str,
        avoided: Sequence[str],
        exits: Mapping[str, Callable[[Sequence[str]], str]],
        name: str | None = None,
    ) -> str:
        """Text containing none of `avoided`, which may end anywhere; when one of `exits`
        completes (with any others completing at the same character) it goes on with
        `exits[...](completed)`. Returns the start rule's name."""
        words = list(dict.fromkeys([*avoided, *exits]))
        start = name or self._name("text")
        if not words:
            self._rules.append(f"{start} ::= [^\\x00]*\n")
            return start
        if sum(len(w) for w in words) > MAX_WATCHED_PREFIXES:
            _refuse(path, f"the strings free text watches for are longer than "
                    f"{MAX_WATCHED_PREFIXES} characters in all")  # fmt: skip
        step, completes = _aho_corasick(words)
        prefixes = [node for node in step if node not in completes or not completes[node]]
        names = {p: start if not p else f"{start}-{i}" for i, p in enumerate(prefixes)}
        alphabet = sorted({c for w in words for c in w})
        for prefix in prefixes:
            special: list[str] = []
            options = [_EMPTY]
            for c in alphabet:
                state = step[prefix][c]
                completed = completes[state]
                if completed:
                    special.append(c)
                    if any(w in avoided for w in completed):
                        continue
                    hits = [w for w in exits if w in completed]
                    options.append(f"{gbnf_literal(c)} {exits[hits[0]](hits)}")
                elif state:
                    special.append(c)
                    options.append(f"{gbnf_literal(c)} {names[state]}")
            others = "".join(gbnf_char(c) for c in special)
            options.insert(1, f"[^{others}] {start}")
            self._rules.append(f"{names[prefix]} ::= {' | '.join(options)}\n")
        return start

    # -- rules ------------------------------------------------------------------------------------

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"st{self._count}-{hint}"

    def _rule(self, hint: str, body: str) -> str:
        name = self._name(hint)
        self._rules.append(f"{name} ::= {body or _EMPTY}\n")
        return name

    def _grammar(self, root: str) -> str:
        return f"root ::= {root or _EMPTY}\n" + "".join(self._rules)


_Builder._HANDLERS.update(
    {
        "const_string": _Builder._const_string,
        "json_schema": _Builder._json_schema,
        "regex": _Builder._regex,
        "grammar": _Builder._gbnf,
        "any_text": _Builder._any_text,
        "sequence": _Builder._sequence,
        "or": _Builder._or,
        "optional": _Builder._repeat,
        "star": _Builder._repeat,
        "plus": _Builder._repeat,
        "tag": _Builder._tag,
        "triggered_tags": _Builder._nested_triggered,
        "tags_with_separator": _Builder._with_separator,
    }
)


def _aho_corasick(
    words: Sequence[str],
) -> tuple[dict[str, dict[str, str]], dict[str, list[str]]]:
    """The Aho-Corasick automaton of `words`, its states named by the prefix they stand for:
    (state -> character -> next state, for the characters of the words; any other character
    leads to ""), and state -> the words that end there (the words that are its suffixes)."""
    nodes = {w[:i] for w in words for i in range(len(w) + 1)}
    alphabet = sorted({c for w in words for c in w})
    step: dict[str, dict[str, str]] = {}
    completes: dict[str, list[str]] = {}
    fail = {"": ""}
    for node in sorted(nodes, key=lambda n: (len(n), n)):  # a fallback is shorter: done first
        if len(node) > 1:
            fail[node] = step[fail[node[:-1]]][node[-1]]
        elif node:
            fail[node] = ""
        back = step[fail[node]] if node else None
        step[node] = {
            c: node + c if node + c in nodes else (back[c] if back is not None else "")
            for c in alphabet
        }
        completes[node] = ([node] if node in words else []) + (
            completes[fail[node]] if node else []
        )
    return step, completes


def prefix_rules(gbnf: str, prefix: str) -> str:
    """The grammar with every rule name prefixed (definitions and references); string literals,
    character classes, repetition counts and comments are left alone."""
    out: list[str] = []
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and gbnf[j] != close:
                j += 2 if gbnf[j] == "\\" else 1
            out.append(gbnf[i : j + 1])
            i = j + 1
        elif c in "#{":
            j = gbnf.find("\n" if c == "#" else "}", i)
            j = n if j < 0 else j + (c == "{")
            out.append(gbnf[i:j])
            i = j
        elif c.isascii() and (c.isalnum() or c == "-"):
            j = i
            while j < n and gbnf[j].isascii() and (gbnf[j].isalnum() or gbnf[j] == "-"):
                j += 1
            out.append(prefix + gbnf[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _start(node: Any) -> str:
    """The literal text a format surely starts with, if it is a string or a tag."""
    if isinstance(node, dict):
        if node.get("type") == "const_string" and isinstance(node.get("value"), str):
            return str(node["value"])
        if node.get("type") in ("tag", None) and isinstance(node.get("begin"), str):
            return str(node["begin"])
    return ""


def _literal(text: str) -> str:
    return gbnf_literal(text) if text else ""


def _join(parts: Sequence[str]) -> str:
    return " ".join(p for p in parts if p)


def _object(node: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(node, dict):
        _refuse(path, "must be a JSON object")
    return node


def _list(fields: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = fields.get(key)
    if not isinstance(value, list) or not value:
        _refuse(f"{path}.{key}", "must be a non-empty list")
    return value


def _string(fields: Mapping[str, Any], key: str, path: str) -> str:
    value = fields.get(key)
    if not isinstance(value, str):
        _refuse(f"{path}.{key}", "must be a string")
    return value


def _flag(fields: Mapping[str, Any], key: str, path: str) -> bool:
    value = fields.get(key, False)
    if not isinstance(value, bool):
        _refuse(f"{path}.{key}", "must be a boolean")
    return value


def _refuse(path: str, what: str) -> NoReturn:
    raise StructuralTagUnsupported(f"{path}: {what}" if path else what)
