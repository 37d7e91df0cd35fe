"""The exported tokenizer gives llama.cpp's ids: a corpus (prose, code with tabs and runs of
spaces, CJK, emoji, digits, special tokens written as text, the empty string, newline runs,
20,000 characters, seeded random strings) tokenized by `llama_tokenize` (as the server calls it)
and by the exported tokenizer.json, for the embedded model and the second test model, with and
without BOS, with special tokens parsed or not; one differing id fails. Decoding matches too."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from llama_grpc_server.config import ModelSettings
from llama_grpc_server.engine.llama import LlamaModel
from llama_grpc_server.models import cli as models_cli
from llama_grpc_server.models import tokenizer_export
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME, default_model_path
from tests.support.tokenizer_corpus import CJK, CODE, DIGITS, EMOJI, PROSE, WHITESPACE
from tests.support.tokenizer_corpus import hf_ids as _hf_ids

SPECIAL_AS_TEXT = (
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos><bos>text<eos> <pad><unk><mask> a</s>b </s>",
    "<unused0><unused6241> [multimodal] <start_of_image>",
    "<start_of_turn <end_of_turn>> <<bos>> <bo s>",
    "<table><tr><td>cell</td></tr></table> <div>  <h1>Title</h1></div>",
)


def _random_texts(n: int, seed: int = 31) -> list[str]:
    """Seeded random strings from pieces that stress the tokenizer's edges."""
    rng = random.Random(seed)
    pieces = [
        " ", "  ", "\t", "\n", "\n\n", "a", "the", " the", "ing", "<", ">", "<bos>",
        "<start_of_turn>", "<end_of_turn>", "<div>", "</div>", "▁", "é", "日本", "🦙", "👍🏽", "1",
        "23", ".", ",", "'", '"', "\\", "{", "}", "\u0301", "\u00a0", "x" * 7, "<0x41>", "\r",
    ]  # fmt: skip
    out = []
    for _ in range(n):
        length = rng.randint(1, 40)
        chars = [chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(0, 3))]
        out.append("".join(rng.choice(pieces + chars) for _ in range(length)))
    return out


def _long_text(n_chars: int = 20_000) -> str:
    parts = [PROSE, CODE, CJK, EMOJI, DIGITS, *SPECIAL_AS_TEXT, *WHITESPACE]
    rng = random.Random(20_000)
    text = ""
    while len(text) < n_chars:
        text += rng.choice(parts) + rng.choice([" ", "\n", "", "  ", "\t"])
    return text[:n_chars]


CORPUS = [
    PROSE, CODE, CJK, EMOJI, DIGITS, *SPECIAL_AS_TEXT, *WHITESPACE, *_random_texts(300),
    _long_text(),
]  # fmt: skip


@pytest.fixture(scope="module", params=["embedded", "second"])
def model_path(request: pytest.FixtureRequest) -> Path:
    if request.param == "embedded":
        return default_model_path()
    path: Path = request.getfixturevalue("second_model_path")
    return path


@pytest.fixture(scope="module")
def llama(model_path: Path) -> Iterator[LlamaModel]:
    model = LlamaModel(ModelSettings(n_ctx=256, n_batch=256), str(model_path), 1)
    yield model
    model.close()


@pytest.fixture(scope="module")
def files(model_path: Path) -> dict[str, bytes]:
    return tokenizer_export.export_files(model_path, None)


@pytest.fixture(scope="module")
def hf(files: dict[str, bytes]) -> Tokenizer:
    return Tokenizer.from_str(files["tokenizer.json"].decode())


@pytest.mark.parametrize("parse_special", [True, False])
@pytest.mark.parametrize("add_special", [True, False])
def test_exported_ids_equal_llama_tokenize(
    llama: LlamaModel, hf: Tokenizer, add_special: bool, parse_special: bool
) -> None:
    """Every text of the corpus, token for token (the first difference is reported)."""
    assert len(CORPUS) > 300 and max(map(len, CORPUS)) == 20_000
    for text in CORPUS:
        want = llama.tokenize(text, add_special=add_special, parse_special=parse_special)
        got = _hf_ids(hf, text, add_special=add_special, parse_special=parse_special)
        if got != want:
            at = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            pytest.fail(
                f"{text[:80]!r} ({len(text)} chars): first difference at token {at}: "
                f"llama.cpp {want[max(0, at - 3) : at + 3]}, "
                f"exported {got[max(0, at - 3) : at + 3]}"
            )


def test_the_corpus_exercises_specials_bos_and_byte_fallback(
    llama: LlamaModel, hf: Tokenizer
) -> None:
    """Guards the corpus: BOS first, a special token parsed from text, an emoji spelled in byte
    tokens, a run of spaces as one user-defined token."""
    ids = llama.tokenize(SPECIAL_AS_TEXT[0], add_special=True, parse_special=True)
    assert ids[:2] == [hf.token_to_id("<bos>"), hf.token_to_id("<start_of_turn>")]
    assert llama.tokenize("", add_special=True, parse_special=False) == [hf.token_to_id("<bos>")]
    emoji = llama.tokenize(EMOJI, add_special=False, parse_special=False)
    assert any((hf.id_to_token(t) or "").startswith("<0x") for t in emoji)
    assert llama.tokenize("a   b", add_special=False, parse_special=False)[1] == hf.token_to_id(
        "   "
    )


def test_decoding_matches_llama_cpp(llama: LlamaModel, hf: Tokenizer) -> None:
    """decode(ids) equals the server's detokenize, special tokens rendered or skipped, and
    gives the text back (unless it holds U+2581, which both decode as a space)."""
    for text in CORPUS[:-1]:  # the long text is the same pieces again
        ids = llama.tokenize(text, add_special=True, parse_special=True)
        assert hf.decode(ids, skip_special_tokens=False) == llama.detokenize(
            ids, render_special=True
        ), text
        assert hf.decode(ids, skip_special_tokens=True) == llama.detokenize(
            ids, render_special=False
        ), text
        if "\u2581" not in text:  # SentencePiece spells a space so: it decodes as " "
            plain = llama.tokenize(text, add_special=False, parse_special=True)
            assert hf.decode(plain, skip_special_tokens=False) == text


def test_configs_name_the_engines_special_tokens(
    llama: LlamaModel, files: dict[str, bytes]
) -> None:
    """BOS, EOS, add_bos_token and the end-of-generation ids are what llama.cpp uses."""
    info = llama.info("m")
    config = json.loads(files["tokenizer_config.json"])
    assert config["bos_token"] == "<bos>" and config["eos_token"] == "<eos>"
    assert config["add_bos_token"] is info.add_bos is True
    assert config["add_eos_token"] is False
    assert "chat_template" not in config  # this GGUF carries none
    generation = json.loads(files["generation_config.json"])
    assert generation["bos_token_id"] == info.bos_token_id == 2
    # llama.cpp ends generation at <eos>, <end_of_turn> and "</s>" (a user-defined token that
    # it makes a control token by its text; the exporter does the same)
    assert generation["eos_token_id"] == list(info.eog_token_ids) == [1, 106, 212]
    model_config = json.loads(files["config.json"])
    assert model_config["eos_token_id"] == info.eos_token_id == 1
    assert model_config["vocab_size"] == info.n_vocab == 262_144
    assert model_config["max_position_embeddings"] == info.n_ctx_train == 32_768


@pytest.mark.usefixtures("restore_logging")  # the CLI configures structlog at its "error" level
def test_export_tokenizer_cli_writes_the_files(tmp_path: Path) -> None:
    """`llama-grpc models export-tokenizer NAME DIR` with the embedded model's name: the files,
    with the chosen built-in chat template; they load with `tokenizers`."""
    out = tmp_path / "tok"
    status = models_cli.main(
        ["export-tokenizer", DEFAULT_MODEL_NAME, str(out), "--chat-template", "gemma"]
    )
    assert status == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(tokenizer_export.FILES)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"].startswith("{{ bos_token }}")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("Hello", add_special_tokens=True).ids[0] == 2
