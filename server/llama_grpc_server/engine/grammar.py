"""Grammar constraints: check GBNF with llama.cpp's own parser (capturing its message, which it
prints to stderr), turn a JSON Schema into GBNF with llama-cpp-python's converter, and create the
grammar sampler that engine/sampler.py drives. Safe from any thread (reads the vocabulary)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import llama_cpp
from llama_cpp import llama_grammar

from llama_grpc_server.core.constrained.structural_tag import trigger_pattern
from llama_grpc_server.engine import logs

MAX_MESSAGE_CHARS = 300
_PARSE_ERROR = "error parsing grammar: "
_STDERR_LOCK = threading.Lock()


class GrammarError(ValueError):
    """The grammar or schema is invalid; str() is the parser's message."""


def init_grammar(vocab: Any, gbnf: str, root: str, triggers: tuple[str, ...] = ()) -> Any:
    """A llama_sampler for the grammar, or a NULL pointer when llama.cpp rejects it. With
    `triggers` it is lazy: it masks nothing until one of them appears in the sampled text
    (core/structural_tag.trigger_pattern; its std::regex is built from escaped literals only, since
    a bad pattern would throw through ctypes)."""
    if not triggers:
        return llama_cpp.llama_sampler_init_grammar(
            vocab, gbnf.encode("utf-8"), root.encode("utf-8")
        )
    patterns = (ctypes.c_char_p * 1)(trigger_pattern(triggers).encode("utf-8"))
    no_tokens = (llama_cpp.llama_token * 1)()
    return llama_cpp.llama_sampler_init_grammar_lazy_patterns(
        vocab, gbnf.encode("utf-8"), root.encode("utf-8"), patterns, 1, no_tokens, 0
    )


def token_piece(vocab: Any, token: int) -> bytes:
    """A token's text as the grammar sees it (llama.cpp's piece cache renders special tokens)."""
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
    return buf.raw[: max(n, 0)]


def check_grammar(vocab: Any, gbnf: str, root: str) -> None:
    """Raise GrammarError with llama.cpp's message unless the grammar compiles. The parser
    prints its reason to stderr and the rest goes to the log, so both are captured."""
    with _captured_stderr() as printed, logs.captured_errors() as logged:
        sampler = init_grammar(vocab, gbnf, root)
    if not sampler:
        raise GrammarError(_message(printed, logged))
    llama_cpp.llama_sampler_free(sampler)


def json_schema_to_gbnf(schema: str) -> str:
    """The GBNF of a JSON Schema given as JSON text; GrammarError when it is not valid JSON or
    uses something the converter does not support."""
    try:
        return str(llama_grammar.json_schema_to_gbnf(schema))
    except Exception as exc:  # the converter raises anything; every kind means "invalid"
        raise GrammarError(f"{type(exc).__name__}: {exc}"[:MAX_MESSAGE_CHARS]) from None


def _message(printed: list[str], logged: list[str]) -> str:
    """The parser's reason (first line only: it goes on to echo the whole grammar)."""
    for text in printed:
        at = text.find(_PARSE_ERROR)
        if at >= 0:
            reason = text[at + len(_PARSE_ERROR) :].split("\n", 1)[0].strip()
            return f"invalid grammar: {reason}"[:MAX_MESSAGE_CHARS]
    reasons = [line for line in logged if "failed to parse grammar" not in line]
    if reasons:
        return f"invalid grammar: {reasons[0]}"[:MAX_MESSAGE_CHARS]
    return "invalid grammar: llama.cpp could not compile it"


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """Point fd 2 at a temporary file for the block. Anything other threads write meanwhile is
    written back to the real stderr afterwards."""
    out: list[str] = []
    with _STDERR_LOCK, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode("utf-8", errors="replace")
            out.append(text)
            _write_back(text)


def _write_back(text: str) -> None:
    """Give back what was not the parser's report (which echoes the grammar after it)."""
    if text and _PARSE_ERROR not in text:
        with contextlib.suppress(OSError):
            os.write(2, text.encode("utf-8"))
