"""tokenizer.json's model, pre-tokenizer, normalizer and decoder for llama.cpp's BPE
vocabularies: byte-level BPE (`tokenizer.ggml.model` "gpt2") and SPM-style BPE on raw UTF-8
("gemma4"), from the GGUF's merges. No llama_cpp, no tokenizers (tokenizer_export.py loads the
result to check it).

llama.cpp (llm_tokenizer_bpe_session) splits the text with its pre-tokenizer's regexes
(bpe_pretokenizers.py), maps each piece's bytes to GPT-2's printable characters (byte-level
vocabularies), then merges adjacent symbols by the rank of their pair in tokenizer.ggml.merges,
lowest first, the leftmost on a tie: HuggingFace's BPE model does the same, given the same
merges. A piece that is itself a token stays whole with `ignore_merges` (the pre-tokenizers that
set it: Llama 3, GLM 4, Tekken, ...), as HuggingFace's `ignore_merges` does. Differences that
would break exactness are refused: a merge whose parts or result are no token (llama.cpp would
merge through it, HuggingFace refuses the file), a pre-tokenizer llama.cpp splits with code of
its own (bpe_pretokenizers.PRE_TYPES' `refused`)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from llama_grpc_server.models.bpe_pretokenizers import (
    PRE_NAMES,
    PRE_TYPES,
    PreName,
    PreType,
    oniguruma,
)
from llama_grpc_server.models.gguf_vocab import GGUFVocab, TokenizerExportError

SPACE_MARK = "\u2581"


def pre_name(vocab: GGUFVocab) -> PreName:
    """llama.cpp's settings for the file's tokenizer.ggml.pre; refused when it knows no such
    name (it would not load the file) or splits it with code not reproduced here."""
    name = PRE_NAMES.get(vocab.pre)
    if name is None:
        raise TokenizerExportError(
            f"tokenizer.ggml.pre {vocab.pre!r} is unknown to llama.cpp 0.3.36: it would not "
            "load this file"
        )
    refused = PRE_TYPES[name.pre_type].refused
    if refused:
        raise TokenizerExportError(f"pre-tokenizer {vocab.pre!r} is not supported: {refused}")
    return name


def merges(vocab: GGUFVocab, ids: Mapping[str, int]) -> list[list[str]]:
    """tokenizer.ggml.merges as [left, right] pairs, in rank order, a repeated pair at its first
    rank (llama.cpp keeps the first, HuggingFace would keep the last)."""
    seen: set[tuple[str, str]] = set()
    out: list[list[str]] = []
    for rank, line in enumerate(vocab.merges):
        cut = line.find(" ", 1)  # as llama.cpp splits it: a leading space belongs to the left
        if cut < 0:
            continue  # llama.cpp ranks the pair ("", ""), which never applies
        left, right = line[:cut], line[cut + 1 :]
        if (left, right) in seen:
            continue
        seen.add((left, right))
        if left not in ids or right not in ids or left + right not in ids:
            part = next(p for p in (left, right, left + right) if p not in ids)
            raise TokenizerExportError(
                f"merge {rank} ({line!r}): {part!r} is no token: llama.cpp would merge "
                "through it, a HuggingFace BPE model cannot"
            )
        out.append([left, right])
    return out


def _split(regex: str) -> dict[str, Any]:
    return {
        "type": "Split",
        "pattern": {"Regex": oniguruma(regex)},
        "behavior": "Isolated",
        "invert": False,
    }


def _byte_map() -> dict[str, int]:
    """GPT-2's printable character for each byte -> the byte (bytes_to_unicode)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTES = _byte_map()
_MARKS = ("\ufdd0", "\ufdd1", "\ufdd2", "\ufdd3")  # noncharacters


def _raw_tokens(added: list[str]) -> list[str]:
    """Added tokens llama.cpp renders as their text but HuggingFace's ByteLevel decoder would
    read as bytes: those spelled only in GPT-2's byte characters that mean other bytes
    (DeepSeek's user-defined "õ", "÷", ...: bytes no UTF-8 text holds, so its BPE never makes
    them)."""
    return [
        t for t in added if set(t) <= _BYTES.keys() and bytes(_BYTES[c] for c in t) != t.encode()
    ]


def _escape(text: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


def pre_tokenizer(pre_type: PreType) -> dict[str, Any]:
    splits = [_split(r) for r in pre_type.splits]
    if pre_type.byte_level:
        splits.append({
            "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
            "use_regex": False,
        })  # fmt: skip
    return {"type": "Sequence", "pretokenizers": splits}


def normalizer(name: PreName) -> dict[str, Any] | None:
    if not name.escape_whitespaces:
        return None
    return {"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK}


def decoder(
    pre_type: PreType, name: PreName, added: list[str], tokens: tuple[str, ...]
) -> dict[str, Any]:
    """The text llama_token_to_piece gives, token after token (what the engine streams):
    byte-level tokens mapped back to bytes, added tokens as they are written; SPM-style ones
    with U+2581 as a space and <0xNN> tokens as bytes. llama_detokenize's clean_spaces passes
    are not applied (the engine's text has none).

    HuggingFace's ByteLevel decoder reads a token as bytes unless one of its characters is no
    byte character: an added token in _raw_tokens gets a noncharacter put in front first (a
    zero-width Replace that matches only the whole token), so it passes as its text, and the
    noncharacter is removed after."""
    if pre_type.byte_level:
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                      "use_regex": False}  # fmt: skip
        raw = _raw_tokens(added)
        if not raw:
            return byte_level
        mark = next((m for m in _MARKS if not any(m in t for t in tokens)), None)
        if mark is None:
            raise TokenizerExportError("tokens hold every noncharacter U+FDD0-U+FDD3")
        whole = r"\A(?=(?:" + "|".join(map(_escape, raw)) + r")\z)"
        return {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"Regex": whole}, "content": mark},
            byte_level,
            {"type": "Replace", "pattern": {"String": mark}, "content": ""},
        ]}  # fmt: skip
    decoders: list[dict[str, Any]] = []
    if name.escape_whitespaces:
        decoders.append({"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "})
    decoders += [{"type": "ByteFallback"}, {"type": "Fuse"}]
    return {"type": "Sequence", "decoders": decoders}


def _bpe_merge(word: str, ranks: Mapping[tuple[str, str], int]) -> list[str]:
    """llama.cpp's merging of one piece: the lowest-ranked adjacent pair first, the leftmost
    on a tie (a plain loop: only used on short runs)."""
    symbols = list(word)
    while True:
        ranked = [
            (rank, i)
            for i, pair in enumerate(itertools.pairwise(symbols))
            if (rank := ranks.get(pair)) is not None
        ]
        if not ranked:
            return symbols
        _, i = min(ranked)
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]


def _check_newline_runs(vocab: GGUFVocab, pairs: list[list[str]]) -> None:
    """Gemma 4 (pre-type GEMMA4): llama.cpp takes a run of newlines that is a token whole,
    without merging (llama.cpp PR 21343). The export merges it like any piece, so it is exact
    only where the merges make that token anyway (Gemma 4's do, for all 31 runs)."""
    ranks = {(left, right): rank for rank, (left, right) in enumerate(pairs)}
    for text in vocab.tokens:
        if text and not text.strip("\n") and _bpe_merge(text, ranks) != [text]:
            raise TokenizerExportError(
                f"llama.cpp keeps the newline run {text!r} whole, its merges do not make it: "
                "a HuggingFace BPE model cannot take only newline runs whole"
            )


def model(
    vocab: GGUFVocab, ids: Mapping[str, int], name: PreName, pre_type: PreType
) -> dict[str, Any]:
    pairs = merges(vocab, ids)
    if name.pre_type == "GEMMA4":
        _check_newline_runs(vocab, pairs)
    if not pre_type.byte_level:
        missing = [b for b in range(256) if f"<0x{b:02X}>" not in ids]
        if missing:
            raise TokenizerExportError(
                f"{len(missing)} byte tokens are missing (e.g. <0x{missing[0]:02X}>): "
                "llama.cpp's byte fallback and HuggingFace's would differ"
            )
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,  # llama.cpp's BPE drops bytes that are no token; so does this one
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": not pre_type.byte_level,
        "ignore_merges": name.ignore_merges,
        "vocab": dict(ids),
        "merges": pairs,
    }
