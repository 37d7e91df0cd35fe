"""Texts that stress a tokenizer's edges, shared by the tokenizer-export tests: prose, code with
tabs and runs of spaces, CJK, emoji, digits, contractions, Unicode spaces, combining marks, and
seeded random strings built from such pieces (plus a vocabulary's own special tokens, written as
text)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

PROSE = (
    "The quick brown fox jumps over the lazy dog. It's 2024, and naïve café owners "
    "can't stop saying “déjà vu” — or so they said... Mr. O'Neil's co-worker re-entered."
)
CODE = (
    "def f(x):\n\tif x:\n\t\treturn  x  *  2   # two spaces, then three\n"
    "    else:\n        return None\n\n\n\nclass  A :\n\t\t\tpass\t \t\n"
    '    s = "a\\tb"  ;  y = {"k": [1, 2, 3]}\r\n'
)
CJK = "日本語のテキストと中文文本\uff0c还有한국어 텍스트。漢字仮名交じり文「括弧」"
EMOJI = "I ❤️ 🦙 and 👩‍👩‍👧‍👦 🇫🇷 ✨🤖👍🏽 ∑∫≠½ é e\u0301 \u00a0nbsp \u200bzw"
DIGITS = "3.14159 2718281828 1,000,000 0x1F 007 12345678901234567890 -42 +1e-9"
WHITESPACE = (
    "",
    " ",
    "  ",
    "   leading spaces",
    "trailing spaces   ",
    "\n",
    "\n\n\n\nfour newlines then text\n\n",
    "\n" * 40 + "forty newlines",
    " " * 40 + "forty spaces",
    "\t" * 40 + "forty tabs",
    " \n \t \r\n \u3000 \u2581 \u2581\u2581 mixed",
    "a" * 50 + " " + "b" * 3,
)
# runs of one character, each length once: where llama.cpp's whitespace rules and Gemma 4's
# newline-run tokens (1 to 31 newlines) meet the merges
RUNS = tuple(ch * n for ch in ("\n", " ", "\t", "\r\n") for n in range(1, 41)) + tuple(
    f"a{ch * n}b" for ch in ("\n", " ") for n in (1, 2, 3, 31, 32, 33, 62, 63, 64)
)

PIECES = (
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", "a", "the", " the", "The", "ing", "<",
    ">", "'s", "'S", "'ll", "'LL", "'re", "'Ve", "'d", "'m", "'t", "\u2019s", "é", "e\u0301",
    "\u0301", "\u0903", "日本", "中文", "한국어", "カタカナ", "🦙", "👍🏽",
    "👩\u200d👩\u200d👧", "1",
    "23", "456", "7890", "12345678", "٣", "½", "²", "Ⅻ", ".", ",", "!", "?", "...", "'", '"',
    "\\", "{", "}", "(", ")", "$", "+", "=", "^", "`", "|", "~", "_", "-", "—", "。", "\uff0c",
    "、", "…", "\u00a0", "\u2000", "\u2003", "\u200b", "\u2028", "\u3000", "\u0085", "\u1680",
    "\u180e", "\ufeff", "\x00", "\x0b", "\x1f", "\x7f", "xxxxxxx", "<0x41>", "\u2581",
    "\u2581\u2581", "Ġ", "Ċ", "õ", "Straße", "ΑΒΓ", "ǅ", "ﬁ", "\U0001d400", "\U00013595",
    "\U000e0041", "<|", "|>", "<s>", "</s>", "[PAD]", "<|endoftext|>",
)  # fmt: skip


def random_texts(n: int, seed: int, extra: Sequence[str] = ()) -> list[str]:
    """`n` seeded random strings of 1-30 pieces (PIECES, `extra`, random code points from the
    BMP and the supplementary planes)."""
    rng = random.Random(seed)
    pieces = [*PIECES, *extra]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(0, 3)):
            point = rng.choice((
                rng.randint(0x20, 0x2FFF), rng.randint(0x3000, 0xFFFD),
                rng.randint(0x10000, 0x3FFFF),
            ))  # fmt: skip
            if not 0xD800 <= point < 0xE000:  # surrogates are no text
                chars.append(chr(point))
        out.append("".join(rng.choice(pieces + chars) for _ in range(rng.randint(1, 30))))
    return out


def hf_ids(hf: Any, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
    """A HuggingFace tokenizer's ids for `text` in llama_tokenize's terms: parse_special false
    is `encode_special_tokens = True` (restored after)."""
    hf.encode_special_tokens = not parse_special
    try:
        return list(hf.encode(text, add_special_tokens=add_special).ids)
    finally:
        hf.encode_special_tokens = False
