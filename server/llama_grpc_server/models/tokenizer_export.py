"""Export a GGUF model's tokenizer as HuggingFace `tokenizers` files that give llama.cpp's ids.

An LLM gateway (SMG) tokenizes with HuggingFace `tokenizers` and sends token ids to its workers,
so the tokenizer it runs must split text exactly as llama.cpp's `llama_tokenize` does, or prefix
caching and stop tokens silently break. The files are built from the GGUF metadata alone
(gguf_vocab.py reads it and applies llama.cpp's defaults and token attributes; no llama_cpp, no
torch, no transformers) and checked by loading them with `tokenizers`:

- `tokenizer.json`, by `tokenizer.ggml.model`:
  - "llama" (SentencePiece-style: Gemma 3, Llama 2, ...): the vocabulary as a BPE model whose
    merges rebuild llama.cpp's SentencePiece merging (such GGUF files store no merges).
    llama.cpp merges any two adjacent symbols whose concatenation is a token, highest score
    first, the leftmost on a tie; so every way of splitting a token into two tokens is a merge,
    ranked by the token's score (then its id). The text is normalized (space -> U+2581, a
    leading U+2581 when `add_space_prefix`); bytes with no token fall back to <0xNN> tokens.
  - "gpt2" (byte-level BPE: Llama 3, Qwen, DeepSeek, GPT-2, StarCoder, ...) and "gemma4"
    (BPE on raw UTF-8 with U+2581 spaces): the file's merges, and llama.cpp's pre-tokenizer
    for `tokenizer.ggml.pre` as regex splits (tokenizer_bpe.py, bpe_pretokenizers.py).
  Control (and unknown) tokens are special added tokens, matched in the raw text only when
  specials are parsed; user-defined tokens (Gemma: runs of newlines, spaces and tabs, HTML tags)
  are added tokens matched in the raw text always, before the rest is normalized and split, just
  as llama.cpp's partition does. llama.cpp's types by text count (EOG and FIM tokens become
  control tokens, gpt-oss's channel tokens user-defined). The post-processor adds BOS/EOS as
  `add_bos_token` / `add_eos_token` say (llama.cpp's default for the model and pre-tokenizer,
  then the file's keys). The decoder gives llama_token_to_piece's text, token after token.
- `tokenizer_config.json` (special tokens, `add_bos_token`, `chat_template`: the GGUF's own or
  the one given; `clean_up_tokenization_spaces` false: the text is the engine's, see
  tokenizer_bpe.decoder), `special_tokens_map.json`, `config.json` and `generation_config.json`
  (BOS, EOS, llama.cpp's end-of-generation ids, the context length).

`encode(text, add_special_tokens=B)` then equals `llama_tokenize(text, add_special=B,
parse_special=True)`; with `tokenizer.encode_special_tokens = True` it equals
`parse_special=False`. A vocabulary the exporter cannot reproduce exactly raises
TokenizerExportError naming the reason: a tokenizer model other than the three (WPM/BERT,
UGM/T5, RWKV, ...), a pre-tokenizer llama.cpp splits with code of its own (Kimi K2, AFMoE,
Tiny Aya, SuperBPE, whitespace), two tokens with one text, missing byte tokens, a token
llama.cpp could merge through a character or merge that is no token, added tokens that overlap
(see _check_added). One known difference is accepted rather than refused: added tokens llama.cpp
strips whitespace beside (every special token of a model named Phi-3; some models' <mask>) get
HuggingFace's lstrip/rstrip, which strip Unicode White_Space where llama.cpp strips ASCII
whitespace only (C isspace): with specials parsed, "<|end|>\u3000x" keeps the U+3000 in
llama.cpp and loses it here (see STRIP_DIFFERENCE). Refusing the vocabulary instead would take
a whole family off the gateway for text no template writes. Not detected: where two
SentencePiece tokens have the same score, llama.cpp merges the leftmost pair first and the
export the lower id's (BPE ranks are unique); a result differs only if two such pairs compete
for one symbol. In Gemma 3 the only tied scores are the user-defined tokens' (never merged:
they are split off first); Llama 2's tied runs of U+2581 matched llama.cpp on 2,432 encodings
of space runs and random strings.
tests/model/test_tokenizer_vocabs.py checks every vocabulary of llama.cpp's own test data and
every pre-tokenizer name against llama.cpp.

Exports are cached per model file sha256 (in memory, and on disk under `cache_dir` when given);
`tokenizer_zip` gives the files as one zip archive with deterministic bytes (what the engine
protocol's GetTokenizer streams).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import io
import json
import os
import threading
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_grpc_server.models import tokenizer_bpe, tokenizer_wordpiece
from llama_grpc_server.models.bpe_pretokenizers import PRE_TYPES
from llama_grpc_server.models.files import file_sha256
from llama_grpc_server.models.gguf_vocab import (
    ADDED,
    BYTE,
    SPM,
    TYPES,
    UGM,
    USER_DEFINED,
    WPM,
    Attributes,
    GGUFVocab,
    TokenizerExportError,
    attributes,
    read_vocab,
)

__all__ = [
    "FILES", "FORMAT_VERSION", "GGUFVocab", "TokenizerExportError", "clear_cache",
    "default_cache_dir", "export_files", "exporter_id", "read_vocab", "tokenizer_json",
    "tokenizer_zip", "write_files",
]  # fmt: skip

FORMAT_VERSION = 4
"""Raised whenever the exported bytes change for the same model file (part of the disk cache's
key)."""

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
FILES = (CONFIG, GENERATION_CONFIG, SPECIAL_TOKENS_MAP, TOKENIZER_JSON, TOKENIZER_CONFIG)

SPACE_MARK = "\u2581"  # SentencePiece's visible space (llama_escape_whitespace)
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_REFUSED_KINDS = {
    # read in llm_tokenizer_ugm (llama-vocab.cpp); llama.cpp ships no Unigram vectors
    UGM: "llama.cpp's Unigram lattice leaves control tokens out (HuggingFace's Unigram scores "
    "every vocabulary entry, so '</s>' written in text could become that token) and takes the "
    "unknown-token penalty from the normal tokens' lowest score; not reproduced",
}


# -- the tokenizer -------------------------------------------------------------------------------


def _check(vocab: GGUFVocab, types: list[int]) -> dict[str, int]:
    """The vocabulary as {text: id}; TokenizerExportError for what could not be exact."""
    ids: dict[str, int] = {}
    for i, text in enumerate(vocab.tokens):
        if text in ids:
            raise TokenizerExportError(
                f"tokens {ids[text]} and {i} are both {text!r}: llama.cpp keeps only the last, "
                "a HuggingFace vocabulary cannot hold both"
            )
        if not text:
            raise TokenizerExportError(f"token {i} is empty")
        if types[i] not in TYPES:
            raise TokenizerExportError(f"token {i} ({text!r}) has unknown type {types[i]}")
        ids[text] = i
    return ids


def _check_bytes(vocab: GGUFVocab, ids: Mapping[str, int], types: list[int]) -> None:
    """SentencePiece byte fallback needs all 256 <0xNN> tokens, and byte tokens spelled so."""
    missing = [b for b in range(256) if f"<0x{b:02X}>" not in ids]
    if missing:
        raise TokenizerExportError(
            f"{len(missing)} byte tokens are missing (e.g. <0x{missing[0]:02X}>): llama.cpp's "
            "byte fallback and HuggingFace's would differ"
        )
    for i, text in enumerate(vocab.tokens):
        if types[i] == BYTE and ids.get(text) == i and not _is_byte_text(text):
            raise TokenizerExportError(f"byte token {i} is {text!r}, not <0xNN>")


def _check_added(vocab: GGUFVocab, types: list[int]) -> None:
    """Refuse added tokens that llama.cpp and HuggingFace would split off differently.

    llama.cpp (tokenizer_st_partition) splits the longest added token off first, wherever it is;
    HuggingFace takes the leftmost match (the longest there) and, when specials are not parsed,
    skips a special match without looking inside it for a user-defined token. They agree unless
    two added tokens overlap (A's end is B's start, B at least as long, not two runs of one
    character), or a user-defined token overlaps a special token or lies inside one."""
    added = [(t, k) for t, k in zip(vocab.tokens, types, strict=True) if k in ADDED]
    starts: dict[str, list[tuple[str, int]]] = {}
    for text, kind in added:
        for cut in range(1, len(text)):
            starts.setdefault(text[:cut], []).append((text, kind))
    for first, first_kind in added:
        for cut in range(1, len(first)):
            for second, second_kind in starts.get(first[cut:], ()):
                runs = len(set(first + second)) == 1
                longer = len(second) >= len(first) and not runs
                if second != first and (
                    longer or (first_kind != USER_DEFINED and second_kind == USER_DEFINED)
                ):
                    raise TokenizerExportError(
                        f"added tokens {first!r} and {second!r} overlap: llama.cpp would split "
                        "them off the text differently from HuggingFace"
                    )
    specials = [t for t, k in added if k != USER_DEFINED]
    for text, kind in added:
        if kind == USER_DEFINED:
            inside = next((s for s in specials if len(s) > len(text) and text in s), None)
            if inside is not None:
                raise TokenizerExportError(
                    f"user-defined token {text!r} lies inside special token {inside!r}: "
                    "HuggingFace would not split it off there when specials are not parsed"
                )


STRIP_DIFFERENCE = (
    "llama.cpp strips only ASCII whitespace (C isspace) beside a token with its lstrip/rstrip "
    "attribute, HuggingFace any Unicode White_Space: with specials parsed, a non-ASCII space "
    "(U+00A0, U+2000-U+200A, U+3000, ...) next to such a token stays in llama.cpp's ids and is "
    "dropped in the export's"
)
"""The one difference the export accepts (Phi-3's special tokens), stated in docs/models.md."""


def _is_byte_text(text: str) -> bool:
    return len(text) == 6 and text.startswith("<0x") and text.endswith(">")  # noqa: PLR2004


def _merges(vocab: GGUFVocab, ids: Mapping[str, int], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ranked by the token's score (then its id).

    llama.cpp (llm_tokenizer_spm_session) merges any adjacent pair of symbols whose
    concatenation is a token; its symbols start as single characters, so a pair with a
    character that is no token could merge there and never in a BPE model: refused."""
    scores = vocab.scores
    # characters no merging ever sees: spaces are respelled first, and a one-character
    # user-defined token is split off the raw text wherever it occurs
    unseen = {" "} | {t for t, kind in zip(vocab.tokens, types, strict=True)
                      if kind == USER_DEFINED and len(t) == 1}  # fmt: skip

    def symbol(piece: str) -> bool:
        return len(piece) == 1 and piece not in unseen

    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id, text in enumerate(vocab.tokens):
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            left_known, right_known = left in ids, right in ids
            if left_known and right_known:
                ranked.append((-scores[token_id], token_id, cut, left, right))
            elif (left_known or symbol(left)) and (right_known or symbol(right)):
                raise TokenizerExportError(
                    f"token {token_id} ({text!r}) can be merged from {left!r} + {right!r}, "
                    "which is not a token: llama.cpp would merge it, a BPE model cannot"
                )
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _added_tokens(vocab: GGUFVocab, attrs: Attributes) -> list[dict[str, Any]]:
    """Control and unknown tokens (special: parsed only with specials), user-defined ones (not
    special: always split off first), each matched in the raw text as llama.cpp does, with
    llama.cpp's lstrip/rstrip attributes (with the one accepted difference, STRIP_DIFFERENCE)."""
    out = []
    for i, text in enumerate(vocab.tokens):
        kind = attrs.types[i]
        if kind in ADDED:
            out.append({
                "id": i,
                "content": text,
                "single_word": False,
                "lstrip": i in attrs.lstrip,
                "rstrip": i in attrs.rstrip,
                "normalized": False,
                "special": kind != USER_DEFINED,
            })  # fmt: skip
    return out


def _post_processor(vocab: GGUFVocab) -> dict[str, Any]:
    bos = vocab.text(vocab.bos_id) if vocab.add_bos else None
    eos = vocab.text(vocab.eos_id) if vocab.add_eos else None

    def piece(seq: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if bos is not None:
            out.append({"SpecialToken": {"id": bos, "type_id": 0}})
        out.append({"Sequence": {"id": seq, "type_id": 0}})
        if eos is not None:
            out.append({"SpecialToken": {"id": eos, "type_id": 0}})
        return out

    special = {
        text: {"id": text, "ids": [vocab.tokens.index(text)], "tokens": [text]}
        for text in sorted({t for t in (bos, eos) if t is not None})
    }
    return {
        "type": "TemplateProcessing",
        "single": piece("A"),
        "pair": piece("A") + piece("B"),
        "special_tokens": special,
    }


def _spm(vocab: GGUFVocab, ids: Mapping[str, int], types: list[int]) -> dict[str, Any]:
    """The SentencePiece parts: normalizer, decoder and the BPE model (see the docstring)."""
    _check_bytes(vocab, ids, types)
    if vocab.unk_id is None:
        raise TokenizerExportError("the vocabulary has no unknown token")
    normalizers: list[dict[str, Any]] = []
    if vocab.add_space_prefix:
        normalizers.append({"type": "Prepend", "prepend": SPACE_MARK})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK})
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if vocab.add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": vocab.tokens[vocab.unk_id],
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": ids,
            "merges": [list(pair) for pair in _merges(vocab, ids, types)],
        },
    }


def _bpe(vocab: GGUFVocab, ids: Mapping[str, int], types: list[int]) -> dict[str, Any]:
    """The BPE parts (tokenizer_bpe.py): llama.cpp's pre-tokenizer, its merges."""
    name = tokenizer_bpe.pre_name(vocab)
    pre_type = PRE_TYPES[name.pre_type]
    added = [t for t, kind in zip(vocab.tokens, types, strict=True) if kind in ADDED]
    return {
        "normalizer": tokenizer_bpe.normalizer(name),
        "pre_tokenizer": tokenizer_bpe.pre_tokenizer(pre_type),
        "decoder": tokenizer_bpe.decoder(pre_type, name, added, vocab.tokens),
        "model": tokenizer_bpe.model(vocab, ids, name, pre_type),
    }


def tokenizer_json(vocab: GGUFVocab) -> dict[str, Any]:
    """The tokenizer.json document for `vocab` (see the module docstring)."""
    attrs = attributes(vocab)
    types = list(attrs.types)
    if vocab.kind in _REFUSED_KINDS:
        raise TokenizerExportError(
            f"tokenizer.ggml.model {vocab.model!r} is not supported: {_REFUSED_KINDS[vocab.kind]}"
        )
    if vocab.kind == WPM:  # BERT's own tokenizer, not llama.cpp's (tokenizer_wordpiece.py)
        _check(vocab, types)
        return tokenizer_wordpiece.tokenizer_document(vocab)
    ids = _check(vocab, types)
    _check_added(vocab, types)
    parts = _spm(vocab, ids, types) if vocab.kind == SPM else _bpe(vocab, ids, types)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(vocab, attrs),
        "normalizer": parts["normalizer"],
        "pre_tokenizer": parts["pre_tokenizer"],
        "post_processor": _post_processor(vocab),
        "decoder": parts["decoder"],
        "model": parts["model"],
    }


# -- the files -----------------------------------------------------------------------------------


def _json_bytes(document: Any, *, compact: bool = False) -> bytes:
    """UTF-8 JSON; tokenizer.json compact (json's C encoder: 1 s, not 15 s with an indent)."""
    if compact:
        text = json.dumps(document, ensure_ascii=False, separators=(",", ":"))
    else:
        text = json.dumps(document, ensure_ascii=False, indent=2)
    return (text + "\n").encode("utf-8")


def _special_tokens(vocab: GGUFVocab) -> dict[str, str]:
    """{"bos_token": "<bos>", ...}: the texts of the special tokens the file names."""
    named = (
        ("bos_token", vocab.bos_id),
        ("eos_token", vocab.eos_id),
        ("unk_token", vocab.unk_id),
        ("pad_token", vocab.pad_id),
    )
    return {key: vocab.tokens[token_id] for key, token_id in named if token_id is not None}


def _base_files(vocab: GGUFVocab) -> dict[str, bytes]:
    """Every file, tokenizer_config.json with the GGUF's own chat template (if any)."""
    eog = list(attributes(vocab).eog_ids)
    ids = {
        "bos_token_id": vocab.bos_id,
        "eos_token_id": vocab.eos_id,
        "pad_token_id": vocab.pad_id,
    }
    config = {
        "model_type": vocab.architecture,
        "vocab_size": len(vocab.tokens),
        "max_position_embeddings": vocab.context_length,
        **ids,
    }
    generation = {**ids, "eos_token_id": eog if len(eog) > 1 else vocab.eos_id}
    return {
        TOKENIZER_CONFIG: _json_bytes(_tokenizer_config(vocab)),
        TOKENIZER_JSON: _json_bytes(tokenizer_json(vocab), compact=True),
        SPECIAL_TOKENS_MAP: _json_bytes(_special_tokens(vocab)),
        CONFIG: _json_bytes(config),
        GENERATION_CONFIG: _json_bytes(generation),
    }


def _tokenizer_config(vocab: GGUFVocab) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": vocab.context_length or None,
    }
    config |= _special_tokens(vocab)
    if vocab.kind == WPM and vocab.add_sep and vocab.sep_id is not None:
        # BERT's [SEP] ends every input: SMG 1.13 adds what add_bos_token / add_eos_token name
        # around the text (measured: [CLS] alone, a different vector, while add_eos_token was
        # false), so [SEP] is named the EOS it adds
        config |= {"add_eos_token": True, "eos_token": vocab.tokens[vocab.sep_id]}
    if vocab.causal is False and not vocab.chat_template:
        # an encoder-only embedding model: a chat through the gateway fails in SMG's template
        # step, with this message instead of "tokenizer.chat_template is not set"
        config["chat_template"] = _refusing_template(vocab)
    if vocab.chat_template:
        config["chat_template"] = vocab.chat_template
    return config


def _refusing_template(vocab: GGUFVocab) -> str:
    name = vocab.name or "the model"
    message = (
        f"{name} is an encoder-only embedding model ({vocab.architecture}): it cannot chat or "
        "generate text; use /v1/embeddings"
    )
    return "{{ raise_exception(" + json.dumps(message) + ") }}"


def _with_template(config: bytes, chat_template: str) -> bytes:
    """tokenizer_config.json with `chat_template` in place of the GGUF's ("" for none)."""
    document = json.loads(config)
    document.pop("chat_template", None)
    if chat_template:
        document["chat_template"] = chat_template
    return _json_bytes(document)


@dataclass(frozen=True, slots=True)
class _Export:
    files: dict[str, bytes]  # tokenizer_config.json with the GGUF's own template
    zips: dict[str | None, bytes]  # by chat template, made when first asked for


_memory: dict[str, _Export] = {}
_lock = threading.Lock()


def _export(model_path: str | os.PathLike[str], cache_dir: Path | None) -> _Export:
    digest = file_sha256(Path(model_path))
    with _lock:  # one export per model at a time; a second caller waits for the first
        cached = _memory.get(digest)
        if cached is None:
            files = _read_disk(cache_dir, digest) if cache_dir is not None else None
            if files is None:
                with _collector_paused():
                    files = _base_files(read_vocab(model_path))
                    _validate(files[TOKENIZER_JSON])
                if cache_dir is not None:
                    _write_disk(cache_dir, digest, files)
            cached = _memory[digest] = _Export(files, {})
        return cached


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while an export builds: it allocates a few million
    containers (a 262k-token vocabulary's merges, the JSON document), each allocation threshold
    starting a collection that walks the growing, cycle-free heap. Paused, Gemma 4's export took
    3.1 s instead of 4.3, Llama 3's 1.3 instead of 1.8 (a quiet 2-core box). Process-wide, so
    another thread's cycles wait the export's few seconds; re-enabled only if it was on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _validate(document: bytes) -> None:
    """Load tokenizer.json with `tokenizers`: what the gateway will do with it."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(document.decode("utf-8"))
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise TokenizerExportError(f"tokenizers rejects the tokenizer.json made: {exc}") from exc


def default_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """$XDG_CACHE_HOME/llama-grpc/tokenizers (~/.cache/... without it): where the CLI keeps
    exports, and a server may."""
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "llama-grpc" / "tokenizers"


@functools.cache
def exporter_id() -> str:
    """A digest of the exporter's sources (this module, gguf_header, gguf_vocab and the BPE
    modules): a changed exporter never reads an older one's files from the disk cache, whether
    or not FORMAT_VERSION was raised."""
    here = Path(__file__)
    names = ("gguf_header.py", "gguf_vocab.py", "bpe_pretokenizers.py", "tokenizer_bpe.py",
             "tokenizer_wordpiece.py")  # fmt: skip
    sources = (here, *(here.with_name(name) for name in names))
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]


def _disk_path(cache_dir: Path, digest: str) -> Path:
    return cache_dir / f"{digest}-v{FORMAT_VERSION}-{exporter_id()}.zip"


def _read_disk(cache_dir: Path, digest: str) -> dict[str, bytes] | None:
    try:
        with zipfile.ZipFile(_disk_path(cache_dir, digest)) as archive:
            files = {name: archive.read(name) for name in archive.namelist()}
    except (OSError, zipfile.BadZipFile, KeyError):
        return None
    return files if set(files) == set(FILES) else None


def _write_disk(cache_dir: Path, digest: str, files: Mapping[str, bytes]) -> None:
    """Atomically (a temporary file renamed); a cache that cannot be written is skipped."""
    path = _disk_path(cache_dir, digest)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(_zip(files))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def export_files(
    model_path: str | os.PathLike[str],
    chat_template: str | None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> dict[str, bytes]:
    """The tokenizer files of the GGUF model at `model_path`, by file name. `chat_template` is
    the Jinja source written into tokenizer_config.json; None means the model's own (none if the
    file has none). Cached per model file sha256 in memory and, with `cache_dir`, on disk.
    TokenizerExportError when the vocabulary cannot be exported exactly."""
    files = _export(model_path, None if cache_dir is None else Path(cache_dir)).files
    if chat_template is None:
        return dict(files)
    return files | {TOKENIZER_CONFIG: _with_template(files[TOKENIZER_CONFIG], chat_template)}


def _zip(files: Mapping[str, bytes]) -> bytes:
    """A zip archive whose bytes depend only on `files`: sorted names, fixed dates and modes."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3  # unix, whichever system wrote it
            info.external_attr = 0o100644 << 16
            archive.writestr(info, files[name], compresslevel=6)
    return buffer.getvalue()


def tokenizer_zip(
    model_path: str | os.PathLike[str],
    chat_template: str | None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> bytes:
    """export_files() as one zip archive (the files at its root), deterministic bytes;
    remembered per model file and chat template."""
    export = _export(model_path, None if cache_dir is None else Path(cache_dir))
    with _lock:
        archive = export.zips.get(chat_template)
    if archive is None:
        archive = _zip(export_files(model_path, chat_template, cache_dir=cache_dir))
        with _lock:
            export.zips[chat_template] = archive
    return archive


def write_files(files: Mapping[str, bytes], directory: str | os.PathLike[str]) -> list[Path]:
    """Write the files into `directory` (created if need be); the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in sorted(files):
        path = out / name
        path.write_bytes(files[name])
        written.append(path)
    return written


def clear_cache() -> None:
    """Forget the in-memory exports (tests; a changed exporter in a long-lived process)."""
    with _lock:
        _memory.clear()
