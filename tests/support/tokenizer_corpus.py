# ruff: noqa: RUF001  (the multilingual corpus is look-alike letters and full-width punctuation)
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


# -- a multilingual corpus for WordPiece (BERT) vocabularies -------------------------------------

# (label, text): sentences in the scripts where BERT's normalizer and llama.cpp's differ, and the
# edges of BERT's cleaning (control, format, private-use and unassigned code points) and of
# WordPiece (words past its 100-character limit)
MULTILINGUAL: tuple[tuple[str, str], ...] = (
    ("english", "Retrieval-augmented generation finds the passages a question needs."),
    ("english", "The Eiffel Tower, completed in 1889, is 330 metres tall!"),
    ("french", "Où est la bibliothèque ? Elle a été fermée à cause de la grève."),
    ("german", "Die Straße ist für Fußgänger gesperrt; Öffnungszeiten ändern sich."),
    ("spanish", "¿Cuántos años tiene el señor Núñez? ¡Muchísimos!"),
    ("vietnamese", "Tiếng Việt có nhiều dấu thanh: ả, ã, ạ, ấ, ầ, ẩ, ẫ, ậ."),
    ("greek", "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας."),
    ("russian", "Москва — столица России, а Ёлкино — маленькая деревня."),
    ("arabic", "القاهرة هي عاصمة مصر وأكبر مدنها."),
    ("hebrew", "ירושלים היא עיר עתיקה."),
    ("korean", "서울은 대한민국의 수도입니다."),
    ("korean", "한국어 문장을 토큰으로 나누면 자모가 모두 남아야 합니다."),
    ("korean", "김치찌개와 불고기는 한국 음식입니다. 맛있어요!"),
    ("korean", "ᄒᆞᆫ글 옛 자모와 호환 자모 ㄱㄴㄷ ㅏㅑㅓ"),
    ("thai", "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย"),
    ("thai", "ภาษาไทยไม่มีช่องว่างระหว่างคำ และมีวรรณยุกต์ ่ ้ ๊ ๋"),
    ("devanagari", "नई दिल्ली भारत की राजधानी है।"),
    ("devanagari", "हिन्दी में मात्राएँ और अनुस्वार ं तथा विसर्ग ः होते हैं"),
    ("tamil", "சென்னை தமிழ்நாட்டின் தலைநகரம்."),
    ("bengali", "ঢাকা বাংলাদেশের রাজধানী।"),
    ("chinese", "北京是中华人民共和国的首都，也是政治和文化中心。"),
    ("chinese", "𠀀𠀁𪜀 古籍用字（扩展B区）与「全角标点」"),
    ("japanese", "東京は日本の首都です。カタカナとひらがなも使います。"),
    ("japanese", "ｶﾀｶﾅ（半角）とＡＢＣ（全角）"),
    ("combining", "e\u0301 a\u0300 o\u0308 n\u0303 c\u0327 i\u0307 \u0301 z\u0335\u0336"),
    ("combining", "Å vs A\u030a, ﬁ ligature, Ⅻ numeral, ² superscript, ǅ titlecase"),
    ("emoji", "I ❤️ 🦙 and 👩‍👩‍👧‍👦 🇫🇷 ✨🤖👍🏽 🥺🫠"),
    ("symbols", "∑∫≠½ € £ ¥ ₩ © ® ™ § ¶ † ‡ • … ‰ ← → ↔"),
    ("control", "tab\tnew\nline\rreturn nul\x00byte bell\x07 del\x7f esc\x1b end"),
    ("control", "soft\u00adhyphen zero\u200bwidth join\u200dzwj bom\ufeffmark rtl\u200fmark"),
    ("control", "vertical\x0btab form\x0cfeed next\x85line sep\u2028para\u2029end"),
    ("unassigned", "x\u0378y \U000e0080 \U0003fffe z\ufdd0w private\ue000use \U000f0000"),
    ("unassigned", "\U0002b820 \U0002b900 CJK extension E"),
    ("spaces", "no\u00a0break em\u2003space ideographic\u3000space ogham\u1680mark"),
    ("long", "a" * 100 + " " + "b" * 101 + " " + "antidisestablishmentarianism" * 4),
    ("long", "Pneumonoultramicroscopicsilicovolcanoconiosis " + "x" * 250),
    ("long", "한" * 101 + " " + "é" * 100),
    ("mixed", "BERT は 서울 과 Bangkok (กรุงเทพ) と दिल्ली を含む"),
    ("specials", "[CLS] [SEP] [MASK] [PAD] [UNK] [unused0] literal [cls]"),
)


def multilingual_texts(n_random: int, seed: int) -> list[tuple[str, str]]:
    """MULTILINGUAL and `n_random` seeded strings mixing its words, marks and code points."""
    rng = random.Random(seed)
    words = [w for _, text in MULTILINGUAL for w in text.split()]
    marks = ["\u0301", "\u0308", "\u0e48", "\u0902", "\u093e", "\u1161", "\u11a8", "\u200d",
             "\u00ad", "\x00", "\x0b", "\u2028", "\ue000", " ", "\t"]  # fmt: skip
    out = list(MULTILINGUAL)
    for _ in range(n_random):
        pieces = [rng.choice(words) if rng.random() < 0.7 else rng.choice(marks)
                  for _ in range(rng.randint(1, 12))]  # fmt: skip
        out.append(("random", "".join(p + (" " if rng.random() < 0.5 else "") for p in pieces)))
    return out
