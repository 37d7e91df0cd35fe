"""BERT's WordPiece tokenizer for GGUF `bert` vocabularies (models/tokenizer_wordpiece.py), the one
the export writes for the gateway and the engine tokenizes with: on llama.cpp's ggml-vocab-bert-bge
vectors it gives llama.cpp's ids (where llama.cpp agrees with BERT); on a multilingual corpus it
gives the ids of HuggingFace's Python BertTokenizer (tests/support/bert_reference.py) for every
text but those with the code points HuggingFace's two implementations treat differently; and
every place llama.cpp's own tokenizer differs is one of four known reasons, counted."""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from llama_grpc_server.models import tokenizer_export, tokenizer_wordpiece
from llama_grpc_server.models.tokenizer_wordpiece import WordPieceTokenizer
from llama_grpc_testkit import llama_sdist
from tests.model.test_tokenizer_vocabs import LlamaVocab
from tests.support.bert_reference import BertReference
from tests.support.tokenizer_corpus import multilingual_texts

N_RANDOM = 300
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MODES = [(False, False), (True, False), (False, True), (True, True)]  # add_special, parse_special


@pytest.fixture(scope="module")
def bge() -> Iterator[tuple[dict[str, object], WordPieceTokenizer, LlamaVocab]]:
    path = llama_sdist.vocab_path("bert-bge")
    document = tokenizer_export.tokenizer_json(tokenizer_export.read_vocab(path))
    llama = LlamaVocab(path)
    yield document, WordPieceTokenizer(document), llama
    llama.close()


@pytest.fixture(scope="module")
def corpus() -> list[tuple[str, str]]:
    return multilingual_texts(N_RANDOM, seed=51)


def _reference(document: dict[str, object]) -> BertReference:
    model = document["model"]
    assert isinstance(model, dict)
    return BertReference(model["vocab"], lowercase=True, specials=SPECIALS)


def test_the_document_is_berts_tokenizer(
    bge: tuple[dict[str, object], WordPieceTokenizer, LlamaVocab],
) -> None:
    """What transformers' BertConverter writes for an uncased BERT, from the GGUF's tokens:
    "▁the" is BERT's "the", "ing" its "##ing", [CLS]/[SEP] around the text."""
    document, tokenizer, _ = bge
    assert document["normalizer"] == {
        "type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
        "strip_accents": None, "lowercase": True,
    }  # fmt: skip
    assert document["pre_tokenizer"] == {"type": "BertPreTokenizer"}
    model = document["model"]
    assert isinstance(model, dict)
    assert (model["type"], model["unk_token"], model["max_input_chars_per_word"]) == (
        "WordPiece", "[UNK]", 100,
    )  # fmt: skip
    vocab = model["vocab"]
    assert (vocab["the"], vocab["##ing"], vocab["[CLS]"], vocab["[unused0]"]) == (
        1996,
        2075,
        101,
        1,
    )
    assert len(vocab) == 30522
    added = document["added_tokens"]
    assert isinstance(added, list)
    assert [(t["id"], t["content"], t["special"]) for t in added] == [
        (0, "[PAD]", True), (100, "[UNK]", True), (101, "[CLS]", True), (102, "[SEP]", True),
        (103, "[MASK]", True),
    ]  # fmt: skip
    text = "Hello, World! [MASK] embeddings"
    assert tokenizer.tokenize(text, add_special=True, parse_special=True) == [
        101, 7592, 1010, 2088, 999, 103, 7861, 8270, 4667, 2015, 102,
    ]  # fmt: skip
    # [MASK] as text when specials are not parsed: "[", "mask", "]"
    assert tokenizer.tokenize(text, add_special=False, parse_special=False)[4:7] == [
        1031,
        7308,
        1033,
    ]
    hf = Tokenizer.from_str(json.dumps(document))
    assert hf.decode([101, 7592, 1010, 2088, 999, 7861, 8270, 4667, 2015, 102]) == (
        "hello, world! embeddings"
    )


def test_llama_cpp_vectors_agree(
    bge: tuple[dict[str, object], WordPieceTokenizer, LlamaVocab],
) -> None:
    """All 46 of llama.cpp's test-tokenizer-0 texts for bert-bge: the export's ids are llama.cpp's
    (its vectors have no Korean, no Indic spacing mark, no word over 100 characters) and the
    Python BertTokenizer's."""
    document, tokenizer, _ = bge
    reference = _reference(document)
    vectors = llama_sdist.vectors("bert-bge")
    assert vectors is not None and len(vectors.texts) == 46
    for text, ids in zip(vectors.texts, vectors.ids, strict=True):
        assert tokenizer.tokenize(text, add_special=False, parse_special=False) == ids, text
        assert reference.encode(text, add_special=False, parse_special=False) == ids, text


def _fast_slow_differ(char: str, reference: BertReference, hf: Tokenizer) -> bool:
    """Whether HuggingFace's Rust BertNormalizer + BertPreTokenizer and its Python BasicTokenizer
    split "a{char}b" differently."""
    assert hf.normalizer is not None and hf.pre_tokenizer is not None
    text = f"a{char}b"
    fast = [w for w, _ in hf.pre_tokenizer.pre_tokenize_str(hf.normalizer.normalize_str(text))]
    return fast != reference.basic(text)


# The corpus's code points where HuggingFace's two BERT tokenizers disagree: Python's drops
# unassigned code points (category Cn: _is_control is any C*), Rust's keeps them (its is_other
# has no Cn: a word with one is [UNK], as in llama.cpp); Rust's CJK ranges skip U+2B820-U+2B91F
# (Extension E: a word of its own in Python, part of the word in Rust).
FAST_SLOW = {"\u0378", "\ufdd0", "\U0003fffe", "\U000e0080", "\U0002b820", "\U0002b900"}


def test_multilingual_corpus_gives_berts_ids(
    bge: tuple[dict[str, object], WordPieceTokenizer, LlamaVocab], corpus: list[tuple[str, str]]
) -> None:
    """Korean, Thai, Devanagari, Tamil, Bengali, Chinese (and Extension B), Japanese half- and
    full-width, combining marks, emoji, control, format, private-use and unassigned code points,
    words past 100 characters, special tokens, and 300 seeded mixtures of them: token for token
    the Python BertTokenizer's ids in all four modes, but for the texts holding one of FAST_SLOW
    (where the Rust tokenizer, the one every door runs, is what the model's users get)."""
    document, tokenizer, _ = bge
    reference = _reference(document)
    hf = Tokenizer.from_str(json.dumps(document))
    chars = {c for _, text in corpus for c in text}
    assert {c for c in chars if _fast_slow_differ(c, reference, hf)} == FAST_SLOW
    compared = 0
    for label, text in corpus:
        if FAST_SLOW & set(text):
            continue
        compared += 1
        for add_special, parse_special in MODES:
            got = tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)
            want = reference.encode(text, add_special=add_special, parse_special=parse_special)
            assert got == want, (label, text, add_special, parse_special)
    assert (len(corpus), compared) == (339, 307)


def _llama_cpp_reasons(text: str, hf: Tokenizer) -> set[str]:
    """Why llama.cpp's WordPiece may tokenize `text` differently from BERT's (docs/models.md)."""
    reasons = set()
    for char in text:
        tail = unicodedata.normalize("NFD", char)[1:]
        if 0xAC00 <= ord(char) <= 0xD7A3:
            reasons.add("hangul")  # NFD's first code point only: the leading consonant
        elif any(unicodedata.category(c) != "Mn" for c in tail):
            reasons.add("decomposition")  # the same, for other characters
        elif unicodedata.category(char) == "Mc":
            reasons.add("spacing mark")  # dropped as an accent; BERT strips only Mn
        elif char in "\x0b\x0c\x85":
            reasons.add("control as space")  # a word break in llama.cpp, removed by BERT
    assert hf.normalizer is not None and hf.pre_tokenizer is not None
    words = hf.pre_tokenizer.pre_tokenize_str(hf.normalizer.normalize_str(text))
    if any(len(word) > tokenizer_wordpiece.MAX_WORD_CHARS for word, _ in words):
        reasons.add("long word")  # [UNK] in BERT, pieces in llama.cpp
    return reasons


def test_differences_from_llama_cpp_are_the_known_ones(
    bge: tuple[dict[str, object], WordPieceTokenizer, LlamaVocab], corpus: list[tuple[str, str]]
) -> None:
    """Every text where llama.cpp's ids differ has one of the four reasons, and the share of
    each is what docs/models.md states; "한국어" is the Korean case in full."""
    document, tokenizer, llama = bge
    hf = Tokenizer.from_str(json.dumps(document))
    differing: Counter[str] = Counter()
    n_differing = 0
    for _, text in corpus:
        got = tokenizer.tokenize(text, add_special=True, parse_special=False)
        if got != llama.tokenize(text, add_special=True, parse_special=False):
            n_differing += 1
            reasons = _llama_cpp_reasons(text, hf)
            assert reasons, text
            differing.update(reasons)
    # 160 of 339 texts (a text may have several reasons)
    assert (n_differing, dict(differing)) == (
        160, {"hangul": 94, "spacing mark": 89, "control as space": 31, "long word": 26},
    )  # fmt: skip
    # 한국어: BERT keeps every jamo (ᄒ ᅡ ᆫ ##ᄀ ##ᅮ ##ᆨ ##ᄋ ##ᅥ); llama.cpp the leading ones
    ids = tokenizer.tokenize("한국어", add_special=False, parse_special=False)
    assert llama.tokenize("한국어", add_special=False, parse_special=False) == [1469, 29991, 29999]
    assert ids == [1469, 30006, 30021, 29991, 30014, 30020, 29999, 30008]


def test_the_files_tell_the_gateway_what_bert_adds_and_that_it_cannot_chat(
    tmp_path: Path,
) -> None:
    """tokenizer_config.json: [CLS] as the BOS and [SEP] as the EOS SMG adds around the text
    (SMG 1.13 reads add_bos_token / add_eos_token), and for an encoder (bert.attention.causal
    false) a chat template that fails naming the model's kind; the gateway's model check sees
    an embeddings-only model."""
    from deploy.gateway import check_model

    path = llama_sdist.vocab_path("bert-bge")
    files = tokenizer_export.export_files(path, None)
    config = json.loads(files["tokenizer_config.json"])
    assert (config["add_bos_token"], config["bos_token"]) == (True, "[CLS]")
    assert (config["add_eos_token"], config["eos_token"]) == (True, "[SEP]")
    assert config["chat_template"] == (
        '{{ raise_exception("bert-bge is an encoder-only embedding model (bert): it cannot chat '
        'or generate text; use /v1/embeddings") }}'
    )
    checked = check_model(["--model", str(path)], {"XDG_CACHE_HOME": str(tmp_path)})
    assert checked.embeddings_only
    assert checked.chat_template == config["chat_template"]
