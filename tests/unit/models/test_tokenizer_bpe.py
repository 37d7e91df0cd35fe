"""tokenizer_export on tiny hand-written BPE vocabularies: byte-level merges in rank order (a
repeated pair at its first rank), ignore_merges and add_bos by pre-tokenizer name, llama.cpp's
EOG and FIM tokens by text, and the refusals (a merge through a non-token, an unknown or
refused pre-tokenizer, Gemma 4 newline runs its merges do not make). The comparison with
llama.cpp itself is tests/model/test_tokenizer_vocabs.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from llama_grpc_server.models import tokenizer_export
from llama_grpc_server.models.tokenizer_export import TokenizerExportError
from tests.support.gguf_files import ARRAY, INT32, STRING, UINT32, Value, gguf_bytes

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
# GPT-2's characters for the bytes 0x21-0x7E are the bytes themselves; " " is "Ġ"
BYTES = [chr(b) for b in range(0x21, 0x7F)] + ["Ġ"]
MERGES = ["a b", "ab c", "Ġ a", "Ġa b", "a b"]  # the last repeats the first: rank 0 stays
TOKENS = [*BYTES, "ab", "abc", "Ġa", "Ġab", "<|endoftext|>", "<|fim_prefix|>", "<tool>"]
TYPES = [NORMAL] * (len(TOKENS) - 3) + [NORMAL, CONTROL, USER_DEFINED]
IDS = {t: i for i, t in enumerate(TOKENS)}


@pytest.fixture(autouse=True)
def _fresh_cache() -> Any:
    tokenizer_export.clear_cache()
    yield
    tokenizer_export.clear_cache()


def _write(path: Path, **overrides: Value | None) -> Path:
    meta: dict[str, Value | None] = {
        "general.architecture": (STRING, "gpt2"),
        "gpt2.context_length": (UINT32, 1024),
        "tokenizer.ggml.model": (STRING, "gpt2"),
        "tokenizer.ggml.pre": (STRING, "gpt-2"),
        "tokenizer.ggml.tokens": (ARRAY, (STRING, TOKENS)),
        "tokenizer.ggml.token_type": (ARRAY, (INT32, TYPES)),
        "tokenizer.ggml.merges": (ARRAY, (STRING, MERGES)),
        "tokenizer.ggml.bos_token_id": (UINT32, IDS["<|endoftext|>"]),
        "tokenizer.ggml.eos_token_id": (UINT32, IDS["<|endoftext|>"]),
    }
    meta.update(overrides)
    path.write_bytes(gguf_bytes({k: v for k, v in meta.items() if v is not None}))
    return path


def _export(path: Path) -> tuple[Tokenizer, dict[str, Any]]:
    files = tokenizer_export.export_files(path, None)
    document = json.loads(files["tokenizer.json"])
    return Tokenizer.from_str(files["tokenizer.json"].decode()), document


def test_byte_level_merges_and_added_tokens(tmp_path: Path) -> None:
    """GPT-2's split (" abc" is one piece), merges by rank (a repeated pair at its first),
    <|endoftext|> made a control token by its text (it is normal in the file), <|fim_prefix|>
    found by text, <tool> always split off; no BOS for gpt-2; decoding gives the text back."""
    tok, document = _export(_write(tmp_path / "v.gguf"))
    assert document["model"]["merges"] == [["a", "b"], ["ab", "c"], ["Ġ", "a"], ["Ġa", "b"]]
    assert document["model"]["ignore_merges"] is False
    ids = tok.encode("abc abc<tool>c", add_special_tokens=True).ids
    # " abc": a+b (rank 0) before Ġ+a (2), then ab+c (1); Ġab never forms
    assert ids == [IDS["abc"], IDS["Ġ"], IDS["abc"], IDS["<tool>"], IDS["c"]]
    special = {t["content"]: t["special"] for t in document["added_tokens"]}
    assert special == {"<|endoftext|>": True, "<|fim_prefix|>": True, "<tool>": False}
    assert tok.decode(ids) == "abc abc<tool>c"
    tok.encode_special_tokens = True
    assert IDS["<|endoftext|>"] not in tok.encode("<|endoftext|>").ids


def test_llama3_names_take_whole_pieces_and_add_bos(tmp_path: Path) -> None:
    """llama-bpe: ignore_merges (a piece that is a token stays whole) and BOS by default."""
    path = _write(tmp_path / "v.gguf", **{"tokenizer.ggml.pre": (STRING, "llama-bpe")})
    tok, document = _export(path)
    assert document["model"]["ignore_merges"] is True
    assert tok.encode("abc", add_special_tokens=True).ids == [IDS["<|endoftext|>"], IDS["abc"]]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"tokenizer.ggml.merges": (ARRAY, (STRING, ["a b", "b c"]))},
            r"merge 1 \('b c'\): 'bc' is no token: llama.cpp would merge through it",
        ),
        (
            {"tokenizer.ggml.pre": (STRING, "no-such-pre")},
            "tokenizer.ggml.pre 'no-such-pre' is unknown to llama.cpp 0.3.36",
        ),
        (
            {"tokenizer.ggml.pre": (STRING, "superbpe")},
            "pre-tokenizer 'superbpe' is not supported: its empty-match split",
        ),
        ({"tokenizer.ggml.merges": None}, "a BPE vocabulary without tokenizer.ggml.merges"),
    ],
)
def test_bpe_vocabularies_that_cannot_be_exact_are_refused(
    tmp_path: Path, overrides: dict[str, Value | None], message: str
) -> None:
    with pytest.raises(TokenizerExportError, match=message):
        tokenizer_export.export_files(_write(tmp_path / "v.gguf", **overrides), None)


def _gemma4(path: Path, merges: list[str]) -> Path:
    tokens = [f"<0x{b:02X}>" for b in range(256)] + ["\n", "\n\n", "\n\n\n", "<bos>", "<eos>"]
    return _write(
        path,
        **{
            "tokenizer.ggml.model": (STRING, "gemma4"),
            "tokenizer.ggml.pre": None,
            "tokenizer.ggml.tokens": (ARRAY, (STRING, tokens)),
            "tokenizer.ggml.token_type": (ARRAY, (INT32, [6] * 256 + [1, 1, 1, 3, 3])),
            "tokenizer.ggml.merges": (ARRAY, (STRING, merges)),
            "tokenizer.ggml.bos_token_id": (UINT32, 259),
            "tokenizer.ggml.eos_token_id": (UINT32, 260),
        },
    )


def test_gemma4_newline_runs_must_merge_whole(tmp_path: Path) -> None:
    """llama.cpp takes Gemma 4's newline-run tokens whole: exact where the merges make each
    run (then BOS always, raw UTF-8 with byte fallback), refused where one is not made."""
    tok, document = _export(_gemma4(tmp_path / "g.gguf", ["\n \n", "\n\n \n"]))
    assert document["pre_tokenizer"]["pretokenizers"][-1]["type"] == "Split"  # no ByteLevel
    assert tok.encode("\n\n\nA", add_special_tokens=True).ids == [259, 258, 0x41]
    assert tok.decode([258, 0xC3, 0xA9]) == "\n\n\né"
    tokenizer_export.clear_cache()
    with pytest.raises(TokenizerExportError, match=r"newline run '\\n\\n\\n' whole"):
        tokenizer_export.export_files(_gemma4(tmp_path / "h.gguf", ["\n \n"]), None)
