"""Incremental detokenization: UTF-8 split across tokens, stop-string hold-back."""

from __future__ import annotations

from llama_grpc_server.core.requests.text import TextAssembler, held_back_length

EURO = "€".encode()  # 3 bytes
PIECES = [b"Hello", b" wor", b"ld", EURO[:1], EURO[1:2], EURO[2:], b"\xf0\x9f", b"\x98\x80", b"!"]


def run(tokens: list[int], stops: tuple[str, ...] = ()) -> tuple[list[str], str, str]:
    asm = TextAssembler(PIECES, stops)
    outs, matched = [], ""
    for t in tokens:
        text, matched = asm.push(t)
        outs.append(text)
        if matched:
            return outs, matched, ""
    return outs, matched, asm.flush()


def test_multibyte_character_split_across_three_tokens() -> None:
    """A 3-byte character arriving one byte per token is emitted once, whole."""
    outs, _, tail = run([3, 4, 5, 8])
    assert outs == ["", "", "€", "!"] and tail == ""


def test_four_byte_emoji_split_in_two() -> None:
    """An emoji split over two tokens never yields a partial code point."""
    outs, _, _ = run([6, 7])
    assert outs == ["", "😀"]


def test_incomplete_character_at_end_flushes_as_replacement() -> None:
    """An unfinished character at the end becomes U+FFFD instead of vanishing."""
    _, _, tail = run([3])
    assert tail == "\ufffd"


def test_stop_string_prefix_is_held_back_then_released() -> None:
    """' wor' could start ' world!'? no: stop ' worm' held ' wor' until 'ld' proved otherwise."""
    outs, matched, tail = run([0, 1, 2], stops=(" worm",))
    assert outs == ["Hello", "", " world"] and not matched and tail == ""


def test_stop_string_across_tokens_cuts_text() -> None:
    """A stop spanning two tokens matches; text before it is emitted, the stop is not."""
    outs, matched, _ = run([0, 1, 2], stops=("world",))
    assert "".join(outs) == "Hello " and matched == "world"


def test_earliest_stop_wins() -> None:
    """With two stops in the same text, the one that starts first is reported."""
    _, matched, _ = run([0, 1, 2], stops=("ld", "o w"))
    assert matched == "o w"


def test_held_back_length() -> None:
    """The held-back suffix is the longest proper prefix of a stop at the end of the text."""
    assert held_back_length("abc<en", ["<end>"]) == 3
    assert held_back_length("abc", ["<end>"]) == 0
    assert held_back_length("ab<", ["<x>", "b<y"]) == 2
