"""The tokenizer export on every vocabulary llama.cpp ships test data for (the vocabulary-only GGUFs
of llama_grpc_testkit.llama_sdist: SentencePiece, byte-level BPE with each family's pre-tokenizer,
Gemma 4's BPE, T5; BERT's WordPiece is BERT's own tokenizer, tested in test_tokenizer_wordpiece.py):
llama.cpp's own test-tokenizer-0 vectors give 0 differing ids, seeded random strings (the
vocabulary's special tokens written among them) give `llama_tokenize`'s ids with and without BOS,
with special tokens parsed or not, and decode to the engine's text; llama.cpp's attributes (EOG set,
control and user-defined tokens, add_bos) carry over. A vocabulary that cannot be exact is refused
with its reason, checked word for word."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from tokenizers import Tokenizer

from llama_grpc_server.models import tokenizer_export
from llama_grpc_server.models.bpe_pretokenizers import PRE_NAMES, PRE_TYPES
from llama_grpc_server.models.tokenizer_export import TokenizerExportError
from llama_grpc_testkit import llama_sdist
from tests.support.gguf_files import ARRAY, FLOAT32, INT32, STRING, UINT32, Value, gguf_bytes
from tests.support.tokenizer_corpus import (
    CJK,
    CODE,
    DIGITS,
    EMOJI,
    PROSE,
    RUNS,
    WHITESPACE,
    random_texts,
)
from tests.support.tokenizer_corpus import (
    hf_ids as _hf_ids,
)

REFUSED = {
    "nomic-bert-moe": (
        "tokenizer.ggml.model 't5' is not supported: llama.cpp's Unigram lattice leaves control "
        "tokens out (HuggingFace's Unigram scores every vocabulary entry, so '</s>' written in "
        "text could become that token) and takes the unknown-token penalty from the normal "
        "tokens' lowest score; not reproduced"
    ),
    # ">>TITLE<<|endoftext|>": llama.cpp splits the longer <|endoftext|> off first, HuggingFace
    # the leftmost >>TITLE<<
    "falcon": (
        "added tokens '>>TITLE<<' and '<|endoftext|>' overlap: llama.cpp would split them off "
        "the text differently from HuggingFace"
    ),
}
NAMES = llama_sdist.vocab_names()
# BERT's own tokenizer, on purpose not llama.cpp's: tests/model/test_tokenizer_wordpiece.py
WORDPIECE = ("bert-bge",)
EXPORTED = [name for name in NAMES if name not in REFUSED and name not in WORDPIECE]
WITH_VECTORS = [name for name in EXPORTED if llama_sdist.vectors(name) is not None]
N_RANDOM = 200


def test_every_vocabulary_is_exported_or_refused_by_name() -> None:
    """llama.cpp's 19 test vocabularies, 15 with vectors; each refusal word for word."""
    assert len(NAMES) == 19
    assert set(WORDPIECE) < set(NAMES)
    assert sum(llama_sdist.vectors(n) is not None for n in NAMES) == 15
    for name, message in REFUSED.items():
        with pytest.raises(TokenizerExportError) as caught:
            tokenizer_export.tokenizer_json(tokenizer_export.read_vocab(_path(name)))
        assert str(caught.value).endswith(message), name


def _path(name: str) -> Path:
    return llama_sdist.vocab_path(name)


class LlamaVocab:
    """A vocabulary-only GGUF loaded by llama.cpp: tokenize and token_to_piece as the engine
    calls them."""

    def __init__(self, path: Path) -> None:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, path
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_tokens = int(llama_cpp.llama_vocab_n_tokens(self.vocab))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode()
        size = len(data) + 4
        buf = (llama_cpp.llama_token * size)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, size, add_special,
                                     parse_special)  # fmt: skip
        assert n >= 0, text
        return list(buf[:n])

    def text(self, token_ids: list[int], *, special: bool) -> str:
        """llama_token_to_piece's pieces joined, control tokens rendered or not."""
        pieces = []
        for token_id in token_ids:
            buf = ctypes.create_string_buffer(512)
            n = llama_cpp.llama_token_to_piece(self.vocab, token_id, buf, len(buf), 0, special)
            assert n >= 0
            pieces.append(buf.raw[:n])
        return b"".join(pieces).decode("utf-8", errors="replace")

    def close(self) -> None:
        llama_cpp.llama_model_free(self.model)


@dataclass
class Exported:
    name: str
    llama: LlamaVocab
    hf: Tokenizer
    files: dict[str, bytes]
    document: dict[str, Any]  # tokenizer.json
    specials: list[str]  # some added tokens' texts, for the random strings


@pytest.fixture(scope="module", params=EXPORTED)
def exported(request: pytest.FixtureRequest) -> Iterator[Exported]:
    """One export and one llama.cpp load per vocabulary for the whole module."""
    name: str = request.param
    files = tokenizer_export.export_files(_path(name), None)
    tokenizer_export.clear_cache()  # 15 vocabularies' exports would stay in memory
    document = json.loads(files["tokenizer.json"])
    added = [token["content"] for token in document["added_tokens"]]
    llama = LlamaVocab(_path(name))
    hf = Tokenizer.from_str(files["tokenizer.json"].decode())
    yield Exported(name, llama, hf, files, document, added[::7][:40])
    llama.close()


def _first_difference(text: str, want: list[int], got: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
              min(len(got), len(want)))  # fmt: skip
    return (
        f"{text[:80]!r} ({len(text)} chars): first difference at token {at}: "
        f"llama.cpp {want[max(0, at - 3) : at + 3]}, exported {got[max(0, at - 3) : at + 3]}"
    )


@pytest.mark.parametrize("exported", WITH_VECTORS, indirect=True)
def test_llama_cpp_vectors_give_no_differing_id(exported: Exported) -> None:
    """test-tokenizer-0's texts (add_special false, parse_special false) against its ids, for
    every exported vocabulary that has them (aquila, baichuan and gpt-neox have none)."""
    vectors = llama_sdist.vectors(exported.name)
    assert vectors is not None
    differing = [
        _first_difference(text, ids, got)
        for text, ids in zip(vectors.texts, vectors.ids, strict=True)
        if (got := _hf_ids(exported.hf, text, add_special=False, parse_special=False)) != ids
    ]
    assert not differing, f"{len(differing)} of {len(vectors.texts)} differ: {differing[:3]}"


def _corpus(exported: Exported) -> list[str]:
    fixed = [PROSE, CODE, CJK, EMOJI, DIGITS, *WHITESPACE, *RUNS]
    return fixed + random_texts(N_RANDOM, seed=39, extra=exported.specials)


@pytest.mark.parametrize("parse_special", [False, True])
@pytest.mark.parametrize("add_special", [False, True])
def test_random_strings_give_llama_tokenize_ids(
    exported: Exported, add_special: bool, parse_special: bool
) -> None:
    """Fixed stress texts and seeded random strings, token for token, in all four modes."""
    corpus = _corpus(exported)
    assert len(corpus) > N_RANDOM
    for text in corpus:
        if parse_special and _strip_difference(exported, text):
            continue  # the one accepted difference: test_the_one_accepted_difference
        want = exported.llama.tokenize(text, add_special=add_special, parse_special=parse_special)
        got = _hf_ids(exported.hf, text, add_special=add_special, parse_special=parse_special)
        if got != want:
            pytest.fail(_first_difference(text, want, got))


# Unicode White_Space (what HuggingFace's lstrip/rstrip strip) beyond C isspace's ASCII six
_NON_ASCII_SPACE = frozenset(
    "\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
_SPACES = frozenset(" \t\n\v\f\r") | _NON_ASCII_SPACE


def _strip_difference(exported: Exported, text: str) -> bool:
    """Whether `text` (specials parsed) meets tokenizer_export.STRIP_DIFFERENCE: a token with
    llama.cpp's rstrip (lstrip) attribute followed (preceded) by a run of whitespace with a
    non-ASCII space in it."""
    for token in exported.document["added_tokens"]:
        start = text.find(token["content"])
        while start >= 0:
            end = start + len(token["content"])
            after = text[end:]
            run_after = after[: len(after) - len(after.lstrip("".join(_SPACES)))]
            before = text[:start]
            run_before = before[len(before.rstrip("".join(_SPACES))) :]
            if (token["rstrip"] and _NON_ASCII_SPACE & set(run_after)) or (
                token["lstrip"] and _NON_ASCII_SPACE & set(run_before)
            ):
                return True
            start = text.find(token["content"], start + 1)
    return False


def test_the_one_accepted_difference(exported: Exported) -> None:
    """tokenizer_export.STRIP_DIFFERENCE, word for word where it applies (Phi-3: every special
    token rstrips): ASCII whitespace after such a token is stripped by both, a non-ASCII space
    by HuggingFace only; a vocabulary without such tokens has nothing of the kind."""
    stripping = [t["content"] for t in exported.document["added_tokens"] if t["rstrip"]]
    if exported.name != "phi-3":
        assert stripping == [] and not any(t["lstrip"] for t in exported.document["added_tokens"])
        return
    assert "<|end|>" in stripping

    def both(text: str) -> tuple[list[int], list[int]]:
        want = exported.llama.tokenize(text, add_special=False, parse_special=True)
        return want, _hf_ids(exported.hf, text, add_special=False, parse_special=True)

    ascii_want, ascii_got = both("<|end|>\n \tx")
    assert ascii_want == ascii_got == both("<|end|>x")[0]
    unicode_want, unicode_got = both("<|end|>\u3000x")
    assert unicode_got == both("<|end|>x")[0]  # HuggingFace strips U+3000
    assert unicode_want != unicode_got  # llama.cpp keeps it


def test_decoding_gives_the_engines_text(exported: Exported) -> None:
    """decode(ids) equals llama_token_to_piece's pieces joined (the text the engine streams),
    special tokens rendered, and skipped where they are, for every text of the corpus
    tokenized with BOS and specials parsed. (A SentencePiece vocabulary with add_space_prefix
    strips the text's first space as llama_detokenize does: its skipped BOS leaves it first.)"""
    strips = "Strip" in json.dumps(exported.document["decoder"])
    for text in _corpus(exported):
        ids = exported.llama.tokenize(text, add_special=True, parse_special=True)
        rendered = exported.llama.text(ids, special=True)
        assert exported.hf.decode(ids, skip_special_tokens=False) == rendered, text
        if not strips:
            skipped = exported.llama.text(ids, special=False)
            assert exported.hf.decode(ids, skip_special_tokens=True) == skipped, text


def test_attributes_are_llama_cpps(exported: Exported) -> None:
    """The end-of-generation ids, which added tokens are special (control/unknown: parsed only
    with specials, hidden when decoding without them) and which not (user-defined), BOS, EOS
    and add_bos / add_eos: what llama.cpp loaded."""
    vocab, n = exported.llama.vocab, exported.llama.n_tokens
    eog = [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    generation = json.loads(exported.files["generation_config.json"])
    eos = generation["eos_token_id"]
    assert (eos if isinstance(eos, list) else [eos]) == eog
    attr = [int(llama_cpp.llama_vocab_get_attr(vocab, i)) for i in range(n)]
    control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
    user = llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    added = exported.document["added_tokens"]
    assert sorted(t["id"] for t in added if t["special"]) == [
        i for i in range(n) if attr[i] & control
    ]
    assert sorted(t["id"] for t in added if not t["special"]) == [
        i for i in range(n) if attr[i] & user and not attr[i] & control
    ]
    config = json.loads(exported.files["tokenizer_config.json"])
    assert config["add_bos_token"] is bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    assert config["add_eos_token"] is bool(llama_cpp.llama_vocab_get_add_eos(vocab))
    bos, eos_id = llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)
    assert generation["bos_token_id"] == (bos if bos >= 0 else None)
    assert json.loads(exported.files["config.json"])["eos_token_id"] == (
        eos_id if eos_id >= 0 else None
    )


# -- every pre-tokenizer name, on a small vocabulary ----------------------------------------------

N_MERGES = 3000
PRE_SAMPLE = dict(reversed(PRE_NAMES.items()))
DISTINCT = sorted(
    {settings: name for name, settings in PRE_SAMPLE.items()}.values()
)  # one name per distinct setting (pre-type and flags)
TESTED = [n for n in DISTINCT if not PRE_TYPES[PRE_NAMES[n].pre_type].refused]


SmallVocab = tuple[list[str], list[int], list[str]]  # tokens, types, merges


def _cut(name: str, n_first: int, wanted: Callable[[int, str], bool]) -> SmallVocab:
    """The vocabulary's first `n_first` tokens (its 256 bytes), those of the merges `wanted`
    picks, each with the merges making its parts; then two control tokens and a user-defined
    one."""
    vocab = tokenizer_export.read_vocab(_path(name))
    first = vocab.tokens[:n_first]
    made = {m.replace(" ", "", 1): rank for rank, m in enumerate(vocab.merges)}
    picked = [rank for rank, m in enumerate(vocab.merges) if wanted(rank, m)]
    chosen: set[int] = set()
    while picked:
        rank = picked.pop()
        if rank not in chosen:
            chosen.add(rank)
            picked += [made[p] for p in vocab.merges[rank].split(" ", 1) if p in made]
    merges = [vocab.merges[rank] for rank in sorted(chosen)]
    parts = [p for m in merges for p in m.split(" ", 1)]  # base tokens too (Gemma's "\n")
    tokens = [*first, *parts, *(m.replace(" ", "", 1) for m in merges)]
    if n_first == 0:
        tokens = [f"<0x{b:02X}>" for b in range(256)] + tokens
    tokens = list(dict.fromkeys(tokens))
    types = [6 if t.startswith("<0x") and len(t) == 6 else 1 for t in tokens]
    for text, kind in (("<|endoftext|>", 3), ("<|im_start|>", 3), ("<tool>", 4)):
        tokens.append(text)
        types.append(kind)
    return tokens, types, merges


@pytest.fixture(scope="module")
def byte_level_vocab() -> SmallVocab:
    """Qwen2's 256 byte characters and the tokens of its first N_MERGES merges, of every merge
    into a run of whitespace or digits and of those with a newline or a combining mark's lead
    byte (so that pieces split differently tokenize differently)."""
    runs = set("ĠĊĉč0123456789")  # GPT-2's characters of " \n\t\r", digits
    return _cut(
        "qwen2",
        256,
        lambda rank, m: rank < N_MERGES or set(m.replace(" ", "")) <= runs or "Ì" in m or "Ċ" in m,
    )


@pytest.fixture(scope="module")
def raw_utf8_vocab() -> SmallVocab:
    """The 256 <0xNN> tokens and the tokens of Gemma 4's first N_MERGES merges and of its
    newline and U+2581 runs."""
    return _cut(
        "gemma-4",
        0,
        lambda rank, m: rank < N_MERGES or set(m.replace(" ", "", 1)) <= {"\n", "\u2581"},
    )


def _small_gguf(path: Path, pre: str, vocab: SmallVocab) -> Path:
    tokens, types, merges = vocab
    meta: dict[str, Value] = {
        "general.architecture": (STRING, "gpt2"),
        "general.name": (STRING, "small"),
        "gpt2.block_count": (UINT32, 1),
        "gpt2.context_length": (UINT32, 1024),
        "gpt2.embedding_length": (UINT32, 64),
        "gpt2.feed_forward_length": (UINT32, 256),
        "gpt2.attention.head_count": (UINT32, 1),
        "gpt2.attention.layer_norm_epsilon": (FLOAT32, 1e-5),
        "tokenizer.ggml.model": (STRING, "gpt2"),
        "tokenizer.ggml.pre": (STRING, pre),
        "tokenizer.ggml.tokens": (ARRAY, (STRING, tokens)),
        "tokenizer.ggml.token_type": (ARRAY, (INT32, types)),
        "tokenizer.ggml.merges": (ARRAY, (STRING, merges)),
        "tokenizer.ggml.bos_token_id": (UINT32, len(tokens) - 3),
        "tokenizer.ggml.eos_token_id": (UINT32, len(tokens) - 3),
    }
    path.write_bytes(gguf_bytes(meta))
    return path


def test_the_small_vocabulary_covers_every_exported_pre_tokenizer() -> None:
    """Every pre-tokenizer setting llama.cpp knows is tested below or refused by name."""
    refused = {n for n in DISTINCT if PRE_TYPES[PRE_NAMES[n].pre_type].refused}
    assert set(TESTED) | refused == set(DISTINCT)
    assert {PRE_NAMES[n].pre_type for n in refused} == {
        "TINY_AYA", "KIMI_K2", "AFMOE", "SUPERBPE", "WHITESPACE"
    }  # fmt: skip
    assert len(TESTED) == 55


@pytest.mark.parametrize("pre", TESTED)
def test_each_pre_tokenizer_gives_llama_tokenize_ids(
    pre: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """llama.cpp loads a small vocabulary with this tokenizer.ggml.pre, the export of the same
    file gives its ids on the stress texts and 150 random strings, without BOS and specials,
    and with both."""
    byte_level = PRE_TYPES[PRE_NAMES[pre].pre_type].byte_level
    vocab = request.getfixturevalue("byte_level_vocab" if byte_level else "raw_utf8_vocab")
    path = _small_gguf(tmp_path / "small.gguf", pre, vocab)
    document = tokenizer_export.tokenizer_json(tokenizer_export.read_vocab(path))
    hf = Tokenizer.from_str(json.dumps(document))
    llama = LlamaVocab(path)
    try:
        texts = [PROSE, CODE, CJK, EMOJI, DIGITS, *WHITESPACE, *RUNS]
        texts += random_texts(150, seed=len(pre), extra=["<|endoftext|>", "<tool>", "<|im_"])
        # the splits are what differs between names: two modes (BOS and specials together)
        for add_special, parse_special in ((False, False), (True, True)):
            for text in texts:
                want = llama.tokenize(text, add_special=add_special, parse_special=parse_special)
                got = _hf_ids(hf, text, add_special=add_special, parse_special=parse_special)
                if got != want:
                    mode = f"{add_special=} {parse_special=}: "
                    pytest.fail(mode + _first_difference(text, want, got))
    finally:
        llama.close()
