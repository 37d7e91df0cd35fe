"""BERT's tokenizer as HuggingFace's Python `BertTokenizer` (transformers' tokenization_bert.py:
BasicTokenizer, then WordpieceTokenizer) computes it, written out here from that code so that
the tests check the export against an implementation that shares nothing with it (the export is
`tokenizers`' Rust BertNormalizer / BertPreTokenizer / WordPiece). Python's unicodedata is
Unicode 14.0 (3.11), the same tables `transformers` would use here.

Where the Rust tokenizer (what the gateway and the engine run) and this Python one disagree is
known and listed in `FAST_DIFFERENCES` (tests/model/test_tokenizer_wordpiece.py shows each):
the tests keep those characters out of the comparison and check them on their own."""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence

# (code points, why): where HuggingFace's fast (Rust) BertNormalizer differs from BertTokenizer
FAST_DIFFERENCES: tuple[tuple[str, str], ...] = (
    (
        "".join(chr(c) for c in range(0x2B820, 0x2B920, 0x20)),
        "CJK Extension E U+2B820-U+2B91F: Python's _is_chinese_char includes them, the Rust "
        "is_chinese_char starts its range at U+2B920 (llama.cpp copied the Rust one)",
    ),
    (
        "\x0b\x0c\x85\u2028\u2029\x1c\x1d\x1e\x1f",
        "characters Rust's char::is_whitespace (Unicode White_Space) and Python's _is_whitespace "
        "(space, tab, newline, return, Zs) or _is_control (category C*) judge differently",
    ),
)


def _is_whitespace(char: str) -> bool:
    if char in (" ", "\t", "\n", "\r"):
        return True
    return unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    if char in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(char).startswith("C")


def _is_punctuation(char: str) -> bool:
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _is_chinese_char(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


class BertReference:
    """BertTokenizer(vocab, do_lower_case, strip_accents=None, tokenize_chinese_chars=True)
    with `never_split` the special tokens; encode() as BertTokenizer.encode with
    split_special_tokens (parse_special False) or not."""

    def __init__(
        self,
        vocab: Mapping[str, int],
        *,
        lowercase: bool,
        specials: Sequence[str],
        unk: str = "[UNK]",
        cls: str | None = "[CLS]",
        sep: str | None = "[SEP]",
    ) -> None:
        self.vocab = vocab
        self.lowercase = lowercase
        self.specials = tuple(sorted(specials, key=len, reverse=True))
        self.unk, self.cls, self.sep = unk, cls, sep

    # -- BasicTokenizer ------------------------------------------------------------------------

    def _clean_text(self, text: str) -> str:
        out = []
        for char in text:
            cp = ord(char)
            if cp in (0, 0xFFFD) or _is_control(char):
                continue
            out.append(" " if _is_whitespace(char) else char)
        return "".join(out)

    def _tokenize_chinese_chars(self, text: str) -> str:
        return "".join(f" {c} " if _is_chinese_char(ord(c)) else c for c in text)

    def _strip_accents(self, text: str) -> str:
        return "".join(
            c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn"
        )

    def _split_on_punc(self, text: str) -> list[str]:
        output: list[list[str]] = []
        start_new_word = True
        for char in text:
            if _is_punctuation(char):
                output.append([char])
                start_new_word = True
            else:
                if start_new_word:
                    output.append([])
                start_new_word = False
                output[-1].append(char)
        return ["".join(x) for x in output]

    def basic(self, text: str) -> list[str]:
        text = self._clean_text(text)
        text = self._tokenize_chinese_chars(text)
        text = unicodedata.normalize("NFC", text)
        split: list[str] = []
        for word in text.split():
            token = self._strip_accents(word.lower()) if self.lowercase else word
            split.extend(self._split_on_punc(token))
        return " ".join(split).split()

    # -- WordpieceTokenizer --------------------------------------------------------------------

    def wordpiece(self, token: str) -> list[str]:
        chars = list(token)
        if len(chars) > 100:  # max_input_chars_per_word
            return [self.unk]
        out: list[str] = []
        start = 0
        while start < len(chars):
            end = len(chars)
            current = None
            while start < end:
                piece = "".join(chars[start:end])
                if start > 0:
                    piece = "##" + piece
                if piece in self.vocab:
                    current = piece
                    break
                end -= 1
            if current is None:
                return [self.unk]
            out.append(current)
            start = end
        return out

    # -- encode --------------------------------------------------------------------------------

    def tokens(self, text: str, *, parse_special: bool) -> list[str]:
        """The text split on the special tokens first (when parsed), each rest tokenized."""
        if parse_special:
            found = [(text.find(s), -len(s), s) for s in self.specials if s in text]
            if found:
                at, _, special = min(found)
                return [
                    *self.tokens(text[:at], parse_special=True),
                    special,
                    *self.tokens(text[at + len(special) :], parse_special=True),
                ]
        return [piece for word in self.basic(text) for piece in self.wordpiece(word)]

    def encode(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        ids = [self.vocab[t] for t in self.tokens(text, parse_special=parse_special)]
        if add_special:
            head = [self.vocab[self.cls]] if self.cls else []
            tail = [self.vocab[self.sep]] if self.sep else []
            ids = head + ids + tail
        return ids
