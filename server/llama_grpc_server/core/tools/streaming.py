"""The streaming machinery every tool-call format shares.

A parser reads the model's text as it arrives, in pieces split anywhere. Its grammar is written as
straight-line generator code (`StreamParser._run` and the format's `_section`): a helper that needs
more text than has arrived yields, push() resumes it once more text is there, finish() resumes it
once more with the end reached (helpers then see "" or None instead of waiting). Each character is
scanned a bounded number of times, so a long answer costs linear time in all.

What is shared:
- plain text and marker hold-back (`_text_until`): text is released as soon as it cannot be the
  start of a marker; a marker that opens a call hands over to the format's `_section`, any other
  marker of the format found outside a call is dropped, so text never holds a marker (but for
  the pathological case of a marker written across a dropped one: "<t", a dropped `<|"|>`,
  "ool_call|>"; the pieces are not joined again);
- whitespace after a call is held: dropped when another call or the end follows, released
  with the text that follows otherwise;
- the JSON call object `{"name": ..., "arguments": {...}}` (`_call_object`), streamed: the name
  delta once the name string is complete, then the arguments' raw text as it arrives
  (`JsonScanner` finds where the value ends: strings, escapes, bracket nesting), checked with
  json.loads when it ends;
- the bare JSON rule (`_bare`), tried first by every parser: see `StreamParser` below.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator, Sequence
from functools import lru_cache
from typing import Any, TypeVar

from ..requests.text import held_back_length
from .types import Parsed, ToolCall, ToolCallDelta, ToolSpec

_T = TypeVar("_T")
Step = Generator[None, None, _T]  # a grammar step: yields while it waits for more text

WHITESPACE = " \t\r\n"


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """json.loads, refusing NaN and Infinity (Python accepts them; JSON does not). Raises
    ValueError."""
    return json.loads(text, parse_constant=_not_json)


def is_json_object(text: str) -> bool:
    try:
        return isinstance(loads(text), dict)
    except ValueError:
        return False


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


_IN_STRING = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[\s,\]}]")


class JsonScanner:
    """Where one JSON value ends, in text that arrives in pieces. It tracks strings, escapes and
    the nesting of brackets (a closing bracket of the wrong kind is an error), not the whole
    grammar: whoever needs a valid value json.loads it once it ends. A value that is not an
    object, array or string (a number, true, ...) ends before the first space, comma or closing
    bracket, or at the end of the text."""

    __slots__ = ("_escape", "_in_string", "_scalar", "_stack", "done", "error", "started")

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._in_string = False
        self._escape = False
        self._scalar = False
        self.started = False
        self.done = False
        self.error = False

    def feed(self, text: str, i: int) -> int:  # noqa: PLR0911, PLR0912, PLR0915  # a hot loop, kept flat
        """Scan text[i:]. Returns the index just past the value when it ends there (`done`), the
        index of an offending bracket (`error`), else len(text): all of it belongs to the
        value."""
        n = len(text)
        stack = self._stack
        while i < n:
            if self._in_string:
                if self._escape:
                    self._escape = False
                    i += 1
                    continue
                m = _IN_STRING.search(text, i)
                if m is None:
                    return n
                j = m.start()
                if text[j] == "\\":
                    self._escape = True
                    i = j + 1
                    continue
                self._in_string = False
                i = j + 1
                if not stack:
                    self.done = True
                    return i
                continue
            if self._scalar:
                m = _SCALAR_END.search(text, i)
                if m is None:
                    return n
                self.done = True
                return m.start()
            if not self.started:
                self.started = True
                c = text[i]
                if c in "{[":
                    stack.append(c)
                    i += 1
                elif c == '"':
                    self._in_string = True
                    i += 1
                else:
                    self._scalar = True
                continue
            m = _STRUCTURE.search(text, i)
            if m is None:
                return n
            j = m.start()
            c = text[j]
            if c == '"':
                self._in_string = True
            elif c in "{[":
                stack.append(c)
            elif not stack or (stack[-1] == "{") != (c == "}"):
                self.error = True
                return j
            else:
                stack.pop()
                if not stack:
                    self.done = True
                    return j + 1
            i = j + 1
        return n

    def ends_at_eof(self) -> bool:
        """Whether the text's end completes the value (only a bare scalar's does)."""
        return self._scalar


@lru_cache(maxsize=256)
def _alternation(texts: tuple[str, ...]) -> re.Pattern[str]:
    """A pattern matching any of `texts`, the longest where several start at one place."""
    ordered = sorted(set(texts), key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in ordered))


_WORD = re.compile(r"[A-Za-z0-9_+.-]*")


class StreamParser:
    """One request's parser: the base every format's parser derives from (it is also the
    `generic` format's parser: the bare JSON rule and nothing else).

    The bare JSON rule: before any marker, the answer is a tool call only when, leading and
    trailing whitespace aside, the WHOLE answer is one JSON object `{"name": N, "arguments": A}`
    (or "parameters" for "arguments"; an optional "type": "function"; no other key, no key
    twice) with N the name of an offered tool and A a JSON object; or several such objects
    separated by whitespace or ';'; or a JSON array of them; or exactly one ``` or ```json fence
    holding one of those. Anything else is text, unchanged (the candidate is held back until
    decided and released as soon as it provably is no call). Bare calls are emitted at finish(),
    each as one delta carrying its name and whole arguments.

    A format's parser sets `openers` (the texts that start a tagged call) and `markers` (all its
    special texts) and implements `_section(opener)`, called right after an opener: it reads the
    call(s) that follow and returns, leaving what follows them to be read as text again.

    Choices for tagged calls: the call's index is taken when its name is complete (the first
    delta); a call is complete when its arguments are (the closing tag is consumed where present,
    not required); a call whose arguments turn out not to be a valid JSON object, or whose
    structure breaks, is abandoned like one cut short: its deltas stand, it is not in `calls`,
    and the text up to the format's closing tag (or the next opener, or the end) is dropped.
    """

    openers: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self._buf = ""
        self._pos = 0
        self._keeping = False  # consumed text is kept (the bare candidate), to be read again
        self._kept: list[str] = []
        self._eof = False
        self._done = False
        self._text: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._calls: list[ToolCall] = []
        self._started = 0  # calls started (the next call's index)
        self._index = -1  # the open call's index, -1 when none is open
        self._name = ""
        self._args: list[str] = []
        self._hold_ws = False  # whitespace is held (after a call): dropped if a call follows
        self._held_ws = ""
        self._all_markers = tuple(dict.fromkeys(self._openers() + self.markers))
        self._opener_set = frozenset(self._openers())
        self._scan = _alternation(self._all_markers) if self._all_markers else None
        self._steps = self._run()

    # -- the ToolCallParser interface -------------------------------------------------------

    def push(self, text: str) -> Parsed:
        if self._eof:
            raise RuntimeError("push() after finish()")
        if self._pos:
            if self._keeping:
                self._kept.append(self._buf[: self._pos])
            self._buf = self._buf[self._pos :]
            self._pos = 0
        self._buf += text
        self._resume()
        return self._take()

    def finish(self) -> Parsed:
        if not self._eof:
            self._eof = True
            self._resume()
        return self._take()

    @property
    def calls(self) -> Sequence[ToolCall]:
        return tuple(self._calls)

    # -- driving ----------------------------------------------------------------------------

    def _openers(self) -> tuple[str, ...]:
        return self.openers

    def _resume(self) -> None:
        if self._done:
            return
        try:
            next(self._steps)
        except StopIteration:
            self._done = True

    def _take(self) -> Parsed:
        text = "".join(self._text)
        self._text.clear()
        merged: list[ToolCallDelta] = []
        for delta in self._deltas:
            if merged and merged[-1].index == delta.index and not delta.name:
                last = merged[-1]
                merged[-1] = ToolCallDelta(last.index, last.name, last.arguments + delta.arguments)
            else:
                merged.append(delta)
        self._deltas.clear()
        return Parsed(text, tuple(merged))

    def _run(self) -> Step[None]:
        self._keeping = True
        first = yield from self._peek_past_ws()
        if first and first in "{[`" and self.tools:
            yield from self._skip_ws()
            calls = yield from self._bare()
            if calls is not None:
                for name, arguments in calls:
                    self._open_call(name)
                    self._add_args(arguments)
                    self._close_call()
                return
            # not a call: all of it is read again, as text
            self._buf = "".join(self._kept) + self._buf
            self._pos = 0
        self._keeping = False
        self._kept.clear()
        self._hold_ws = True  # leading whitespace: dropped if a call follows at once
        while True:
            opener = yield from self._text_until()
            if opener is None:
                break
            yield from self._section(opener)
            self._drop_call()  # a call still open here was abandoned
            self._hold_ws = True
        if self._held_ws and not self._started:
            self._text.append(self._held_ws)  # a whitespace-only answer stays as it was

    def _section(self, opener: str) -> Step[None]:
        """Read what follows `opener` (already consumed). Formats with openers override it."""
        return
        yield

    # -- text -------------------------------------------------------------------------------

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        if self._hold_ws:
            if not text.strip(WHITESPACE):
                self._held_ws += text
                return
            text = self._held_ws + text
            self._held_ws = ""
            self._hold_ws = False
        self._text.append(text)

    def _text_until(self) -> Step[str | None]:
        """Release text up to the next opener, which is consumed and returned (None at the end).
        Markers other than openers are dropped where they appear."""
        while True:
            buf = self._buf
            m = self._scan.search(buf, self._pos) if self._scan else None
            if m is not None:
                self._emit_text(buf[self._pos : m.start()])
                self._pos = m.end()
                if m.group() in self._opener_set:
                    self._held_ws = ""
                    return m.group()
                continue
            if self._eof:
                self._emit_text(buf[self._pos :])
                self._pos = len(buf)
                return None
            end = len(buf) - held_back_length(buf[self._pos :], self._all_markers)
            self._emit_text(buf[self._pos : end])
            self._pos = end
            yield

    # -- reading ----------------------------------------------------------------------------

    def _peek(self) -> Step[str]:
        """The next character (not consumed), "" at the end."""
        while self._pos >= len(self._buf):
            if self._eof:
                return ""
            yield
        return self._buf[self._pos]

    def _skip_ws(self) -> Step[None]:
        while True:
            buf, i = self._buf, self._pos
            n = len(buf)
            while i < n and buf[i] in WHITESPACE:
                i += 1
            self._pos = i
            if i < n or self._eof:
                return
            yield

    def _peek_past_ws(self) -> Step[str]:
        """The first character after any whitespace, "" at the end; nothing is consumed."""
        skipped = 0
        while True:
            buf = self._buf
            i = self._pos + skipped
            while i < len(buf) and buf[i] in WHITESPACE:
                i += 1
            if i < len(buf):
                return buf[i]
            if self._eof:
                return ""
            skipped = i - self._pos
            yield

    def _looking_at(self, literal: str, offset: int = 0) -> Step[bool]:
        """Whether `literal` comes next (after `offset` characters); nothing is consumed."""
        while True:
            start = self._pos + offset
            got = self._buf[start : start + len(literal)]
            if not literal.startswith(got):
                return False
            if len(got) == len(literal):
                return True
            if self._eof:
                return False
            yield

    def _accept(self, literal: str) -> Step[bool]:
        if (yield from self._looking_at(literal)):
            self._pos += len(literal)
            return True
        return False

    def _accept_past_ws(self, literal: str) -> Step[bool]:
        """Consume whitespace and `literal` when `literal` follows the whitespace, else nothing."""
        if (yield from self._peek_past_ws()) != literal[0]:
            return False
        skipped = 0
        while self._buf[self._pos + skipped] in WHITESPACE:
            skipped += 1
        if (yield from self._looking_at(literal, skipped)):
            self._pos += skipped + len(literal)
            return True
        return False

    def _read_until(
        self, stops: tuple[str, ...], *, consume: bool = True, keep: bool = True
    ) -> Step[tuple[str, str | None]]:
        """The text up to the first of `stops` and that stop (consumed when `consume`), or all
        the rest and None at the end. `keep=False` discards the text (returns "")."""
        pattern = _alternation(stops)
        parts: list[str] = []
        while True:
            buf = self._buf
            m = pattern.search(buf, self._pos)
            if m is not None:
                if keep:
                    parts.append(buf[self._pos : m.start()])
                self._pos = m.end() if consume else m.start()
                return "".join(parts), m.group()
            if self._eof:
                if keep:
                    parts.append(buf[self._pos :])
                self._pos = len(buf)
                return "".join(parts), None
            end = len(buf) - held_back_length(buf[self._pos :], stops)
            if keep:
                parts.append(buf[self._pos : end])
            self._pos = end
            yield

    def _read_word(self) -> Step[str]:
        """Letters, digits and `_+.-` from here on (a fence's language tag)."""
        while True:
            m = _WORD.match(self._buf, self._pos)
            assert m is not None  # the pattern matches the empty string
            if m.end() < len(self._buf) or self._eof:
                self._pos = m.end()
                return m.group()
            yield

    def _json_value(self, sink: Callable[[str], None] | None = None) -> Step[str | None]:
        """Read one JSON value starting here, passing its raw text to `sink` piece by piece as it
        arrives. Returns the raw text; None when the text ends first or a bracket mismatches (not
        validated beyond that: json.loads it)."""
        scanner = JsonScanner()
        parts: list[str] = []
        while True:
            start = self._pos
            end = scanner.feed(self._buf, start)
            piece = self._buf[start:end]
            self._pos = end
            if piece:
                parts.append(piece)
                if sink is not None:
                    sink(piece)  # up to an offending bracket too, so any split streams the same
            if scanner.error:
                return None
            if scanner.done:
                return "".join(parts)
            if self._eof:
                return "".join(parts) if scanner.ends_at_eof() and parts else None
            yield

    def _json_string(self) -> Step[str | None]:
        """A JSON string starting here, decoded; None when it is not one."""
        if (yield from self._peek()) != '"':
            return None
        raw = yield from self._json_value()
        if raw is None:
            return None
        try:
            value = loads(raw)
        except ValueError:
            return None
        return value if isinstance(value, str) else None

    def _resync(self, closers: tuple[str, ...] = ()) -> Step[None]:
        """Drop text up to and including the first of `closers`, or up to the next opener, or to
        the end: what follows a call that broke."""
        stops = closers + self._openers()
        if not stops:
            yield from self._drain()
            return
        _, stop = yield from self._read_until(stops, consume=False, keep=False)
        if stop is not None and stop in closers:
            self._pos += len(stop)

    def _drain(self) -> Step[None]:
        """Drop everything to the end."""
        while True:
            self._pos = len(self._buf)
            if self._eof:
                return
            yield

    # -- calls ------------------------------------------------------------------------------

    def _open_call(self, name: str) -> None:
        self._index = self._started
        self._started += 1
        self._name = name
        self._args = []
        self._deltas.append(ToolCallDelta(index=self._index, name=name))

    def _add_args(self, piece: str) -> None:
        if piece:
            self._args.append(piece)
            self._deltas.append(ToolCallDelta(index=self._index, arguments=piece))

    def _close_call(self) -> None:
        self._calls.append(ToolCall("", self._name, "".join(self._args), self._index))
        self._index = -1

    def _drop_call(self) -> None:
        self._index = -1

    def _call_object(  # noqa: PLR0912, PLR0915  # the object's grammar, read in one pass
        self, *, bare: bool = False
    ) -> Step[tuple[str, str] | None]:
        """At '{': one call object {"name": ..., "arguments": {...}}. Tagged (bare=False): the
        call is opened when its name is complete and its arguments are streamed (held until the
        name is known if they come first); other keys are skipped; missing arguments are "{}".
        Bare: nothing is emitted; the object is refused as soon as a key other than name,
        arguments/parameters or type ("function") appears, or the name is not offered.
        Returns (name, arguments), None when refused, broken or cut short."""
        self._pos += 1
        name: str | None = None
        arguments: str | None = None
        pending: list[str] = []
        seen: set[str] = set()
        yield from self._skip_ws()
        while True:
            key = yield from self._json_string()
            if key is None or key in seen:
                break
            seen.add(key)
            yield from self._skip_ws()
            if not (yield from self._accept(":")):
                break
            yield from self._skip_ws()
            first = yield from self._peek()
            if key == "name":
                name = yield from self._json_string()
                if not name or (bare and name not in self.tools):
                    name = None
                    break
                if not bare:
                    self._open_call(name)
                    self._add_args("".join(pending))
            elif key in ("arguments", "parameters"):
                if first != "{" or {"arguments", "parameters"} <= seen:
                    break
                sink = None if bare else (self._add_args if name is not None else pending.append)
                arguments = yield from self._json_value(sink)
                if arguments is None:
                    break
            else:
                value = yield from self._json_value()
                if value is None or (bare and (key != "type" or value != '"function"')):
                    break
            yield from self._skip_ws()
            separator = yield from self._peek()
            self._pos += separator in (",", "}")
            if separator == ",":
                yield from self._skip_ws()
                continue
            if separator != "}":
                break
            if name is None or (bare and arguments is None):
                break
            if arguments is None:
                arguments = "{}"
                self._add_args(arguments)
            if not is_json_object(arguments):
                break
            if not bare:
                self._close_call()
            return name, arguments
        self._drop_call()
        return None

    def _call_array(self) -> Step[bool]:
        """Just after '[': call objects separated by commas, then ']'. False when broken."""
        yield from self._skip_ws()
        if (yield from self._accept("]")):
            return True
        while True:
            if (yield from self._peek()) != "{":
                return False
            if (yield from self._call_object()) is None:
                return False
            yield from self._skip_ws()
            c = yield from self._peek()
            self._pos += c in (",", "]")
            if c == "]":
                return True
            if c != ",":
                return False
            yield from self._skip_ws()

    # -- the bare JSON rule -----------------------------------------------------------------

    def _bare(  # noqa: PLR0911, PLR0912  # the rule's grammar, refused at the first misfit
        self,
    ) -> Step[list[tuple[str, str]] | None]:
        """At the answer's first non-space character: the calls when the whole answer is bare
        JSON calls (see the class), else None, as soon as that is certain."""
        c = yield from self._peek()
        fenced = c == "`"
        if fenced:
            if not (yield from self._accept("```")):
                return None
            tag = yield from self._read_word()
            if tag.lower() not in ("", "json"):
                return None
            yield from self._skip_ws()
            c = yield from self._peek()
        calls: list[tuple[str, str]] = []
        if c == "[":
            self._pos += 1
            yield from self._skip_ws()
            while True:
                if (yield from self._peek()) != "{":
                    return None
                call = yield from self._call_object(bare=True)
                if call is None:
                    return None
                calls.append(call)
                yield from self._skip_ws()
                c = yield from self._peek()
                self._pos += c in (",", "]")
                if c == "]":
                    break
                if c != ",":
                    return None
                yield from self._skip_ws()
        elif c == "{":
            while True:
                call = yield from self._call_object(bare=True)
                if call is None:
                    return None
                calls.append(call)
                yield from self._skip_ws()
                if (yield from self._accept(";")):
                    yield from self._skip_ws()
                    if (yield from self._peek()) != "{":
                        return None
                elif (yield from self._peek()) != "{":
                    break
        else:
            return None
        yield from self._skip_ws()
        if fenced and not (yield from self._accept("```")):
            return None
        yield from self._skip_ws()
        if (yield from self._peek()) != "":
            return None
        return calls
