"""BERT's WordPiece tokenizer for a GGUF `bert` vocabulary (bert, nomic-bert, jina-bert, ...
embedding models), as HuggingFace builds it for BERT (`BertConverter`: BertNormalizer,
BertPreTokenizer, WordPiece with `##` continuations, `[CLS] ... [SEP]` post-processing), from
the GGUF's own vocabulary. tokenizer_export.py writes it as tokenizer.json (the gateway's
tokenizer) and `WordPieceTokenizer` tokenizes with it in the engine (v1 Tokenize and Embed), so
every door gives the ids BERT's own tokenizer gives.

Why not llama.cpp's tokenizer: measured against the original model, llama.cpp's WordPiece
(llm_tokenizer_wpm_session) is what is wrong. Its normalizer maps each code point to the first
code point of its NFD (unicode_cpts_normalize_nfd keeps one code point per input), so a Hangul
syllable becomes its leading jamo ("한국어" -> ▁ᄒ ᄀ ᄋ: an embedding at cosine ~0.65 to the
original model's on Korean), a Devanagari vowel sign or Thai mark that is a spacing mark is
dropped as an "accent", and code points BERT removes (unassigned, private use, format) are
kept. BERT's normalizer decomposes fully (NFD) and removes only nonspacing marks (Mn).
docs/models.md lists each difference with its share of the test corpus.

The vocabulary: convert_hf_to_gguf wrote each word-initial BERT token `w` as "▁w" and each
continuation `##w` as "w", and kept `[...]` tokens (special, unused) as they are; this undoes
it. Lowercasing is the file's `tokenizer.ggml.normalizer.lowercase` (and `.strip_accents`)
when it has them, else the vocabulary's own evidence: an uncased BERT vocabulary has no token
with an upper-case letter (bert-base-uncased, bge, nomic: none of 30,522), a cased one has
thousands. Accents are stripped as BertNormalizer does by default: when lowercasing."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from llama_grpc_server.models.gguf_vocab import (
    ADDED,
    NORMAL,
    USER_DEFINED,
    WPM,
    GGUFVocab,
    TokenizerExportError,
    attributes,
    read_vocab,
)

WORD_START = "\u2581"  # llama.cpp's phantom space before a word-initial WordPiece token
CONTINUATION = "##"  # BERT's prefix of a token that continues a word
MAX_WORD_CHARS = 100  # WordPiece's max_input_chars_per_word: a longer word is [UNK]


def is_wordpiece(vocab: GGUFVocab) -> bool:
    return vocab.kind == WPM


def bert_text(gguf_text: str, kind: int) -> str:
    """A GGUF token's text as BERT's vocab.txt has it: "▁w" -> "w", "w" -> "##w"; `[...]`
    and added (control, unknown, user-defined) tokens as they are."""
    if kind in ADDED or (gguf_text.startswith("[") and gguf_text.endswith("]")):
        return gguf_text
    if gguf_text.startswith(WORD_START):
        return gguf_text[len(WORD_START) :]
    return CONTINUATION + gguf_text


def bert_vocab(vocab: GGUFVocab, types: Sequence[int]) -> dict[str, int]:
    """{BERT text: id}; TokenizerExportError when two tokens become one text."""
    out: dict[str, int] = {}
    for token_id, (text, kind) in enumerate(zip(vocab.tokens, types, strict=True)):
        bert = bert_text(text, kind)
        if not bert:
            raise TokenizerExportError(f"token {token_id} ({text!r}) is an empty WordPiece token")
        if bert in out:
            raise TokenizerExportError(
                f"tokens {out[bert]} and {token_id} are both {bert!r} as WordPiece tokens"
            )
        out[bert] = token_id
    return out


def lowercases(vocab: GGUFVocab, types: Sequence[int]) -> bool:
    """The file's tokenizer.ggml.normalizer.lowercase, else whether no normal token has an
    upper-case letter (an uncased vocabulary)."""
    if vocab.lowercase is not None:
        return vocab.lowercase
    return not any(
        kind == NORMAL and text != text.lower()
        for text, kind in zip(vocab.tokens, types, strict=True)
    )


def _post_processor(vocab: GGUFVocab) -> dict[str, Any]:
    """[CLS] A [SEP] (pair: [CLS] A [SEP] B [SEP], B's type 1), as llama.cpp adds BOS and SEP
    with add_special (each only where the file adds it)."""
    cls = vocab.text(vocab.bos_id) if vocab.add_bos else None
    sep = vocab.text(vocab.sep_id) if vocab.add_sep else None

    def special(text: str | None, type_id: int) -> list[dict[str, Any]]:
        return [] if text is None else [{"SpecialToken": {"id": text, "type_id": type_id}}]

    def sequence(name: str, type_id: int) -> list[dict[str, Any]]:
        return [{"Sequence": {"id": name, "type_id": type_id}}]

    ids = {t: vocab.tokens.index(t) for t in (cls, sep) if t is not None}
    return {
        "type": "TemplateProcessing",
        "single": special(cls, 0) + sequence("A", 0) + special(sep, 0),
        "pair": special(cls, 0) + sequence("A", 0) + special(sep, 0)
        + sequence("B", 1) + special(sep, 1),
        "special_tokens": {
            text: {"id": text, "ids": [token_id], "tokens": [text]}
            for text, token_id in sorted(ids.items())
        },
    }  # fmt: skip


def parts(vocab: GGUFVocab, types: Sequence[int]) -> dict[str, Any]:
    """The tokenizer.json parts of BERT's tokenizer for this vocabulary: normalizer,
    pre-tokenizer, model, post-processor and decoder."""
    if vocab.unk_id is None:
        raise TokenizerExportError("the WordPiece vocabulary has no unknown token")
    lowercase = lowercases(vocab, types)
    return {
        "normalizer": {
            "type": "BertNormalizer",
            "clean_text": True,
            "handle_chinese_chars": True,
            "strip_accents": vocab.strip_accents,  # None: as lowercase
            "lowercase": lowercase,
        },
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": _post_processor(vocab),
        "decoder": {"type": "WordPiece", "prefix": CONTINUATION, "cleanup": True},
        "model": {
            "type": "WordPiece",
            "unk_token": bert_text(vocab.tokens[vocab.unk_id], types[vocab.unk_id]),
            "continuing_subword_prefix": CONTINUATION,
            "max_input_chars_per_word": MAX_WORD_CHARS,
            "vocab": bert_vocab(vocab, types),
        },
    }


def added_tokens(vocab: GGUFVocab, types: Sequence[int]) -> list[dict[str, Any]]:
    """The control and unknown tokens as BERT's special added tokens (matched in the raw text
    only when specials are parsed), user-defined ones as plain added tokens."""
    return [
        {
            "id": token_id,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind != USER_DEFINED,
        }
        for token_id, (text, kind) in enumerate(zip(vocab.tokens, types, strict=True))
        if kind in ADDED
    ]


def tokenizer_document(vocab: GGUFVocab) -> dict[str, Any]:
    """The whole tokenizer.json document of a WordPiece vocabulary."""
    types = list(attributes(vocab).types)
    built = parts(vocab, types)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens(vocab, types),
        **built,
    }


class WordPieceTokenizer:
    """BERT's tokenizer of a GGUF WordPiece vocabulary, with llama_tokenize's arguments (the
    engine's tokenize for such a model: engine/llama.py):
    `add_special` adds [CLS] and [SEP] as llama.cpp would, `parse_special` matches the special
    tokens' texts in the input. Thread-safe (two `tokenizers` objects, one per parse_special,
    never mutated after construction)."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        from tokenizers import Tokenizer  # the server's dependency, imported where it is used

        text = json.dumps(document, ensure_ascii=False)
        self._parsing = Tokenizer.from_str(text)
        self._literal = Tokenizer.from_str(text)
        self._literal.encode_special_tokens = True

    @classmethod
    def for_model(cls, path: str | os.PathLike[str]) -> WordPieceTokenizer | None:
        """The tokenizer of the GGUF model at `path` when its vocabulary is WordPiece, else
        None (TokenizerExportError when it is one that cannot be built)."""
        vocab = read_vocab(path)
        return cls(tokenizer_document(vocab)) if is_wordpiece(vocab) else None

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        tokenizer = self._parsing if parse_special else self._literal
        return list(tokenizer.encode(text, add_special_tokens=add_special).ids)
