"""tokenizer_export on tiny hand-written GGUF vocabularies: llama.cpp's SentencePiece merging
rebuilt as BPE merges (ids worked out by hand), special and user-defined tokens, BOS, the
refusals, deterministic zips, the caches and `models export-tokenizer`. The comparison with
llama.cpp itself on the real models is tests/model/test_tokenizer_export.py."""

from __future__ import annotations

import gc
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES
from llama_grpc_server.models import catalog, tokenizer_export
from llama_grpc_server.models import cli as models_cli
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME
from llama_grpc_server.models.tokenizer_export import TokenizerExportError
from tests.support.gguf_files import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32, Value, gguf_bytes

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
SPACE = "\u2581"

# (text, type, score): specials first, then the bytes, then the pieces. Scores decide the merge
# order: "bc" (-1) before "ab" (-2), so "abc" is a + bc -> abc; "▁a" (-3) before "ab".
PIECES: list[tuple[str, int, float]] = [
    ("<pad>", CONTROL, -1000.0),
    ("<eos>", CONTROL, -1000.0),
    ("<bos>", CONTROL, -1000.0),
    ("<unk>", CONTROL, -1000.0),
    ("<start_of_turn>", CONTROL, -1000.0),
    ("<end_of_turn>", NORMAL, -1000.0),  # llama.cpp makes it a control (EOG) token
    ("\n", USER_DEFINED, -1000.0),
    ("  ", USER_DEFINED, -1000.0),
    *((f"<0x{b:02X}>", BYTE, 0.0) for b in range(256)),
    (SPACE, NORMAL, -10.0),
    ("a", NORMAL, -11.0),
    ("b", NORMAL, -12.0),
    ("c", NORMAL, -13.0),
    ("<", NORMAL, -14.0),
    (">", NORMAL, -15.0),
    ("bc", NORMAL, -1.0),
    ("ab", NORMAL, -2.0),
    (SPACE + "a", NORMAL, -3.0),
    ("abc", NORMAL, -4.0),
    (SPACE + "abc", NORMAL, -5.0),
]
IDS = {text: i for i, (text, _, _) in enumerate(PIECES)}


def _metadata(**overrides: Value | None) -> dict[str, Value]:
    meta: dict[str, Value | None] = {
        "general.architecture": (STRING, "tiny"),
        "general.name": (STRING, "Tiny"),
        "tiny.context_length": (UINT32, 2048),
        "tokenizer.ggml.model": (STRING, "llama"),
        "tokenizer.ggml.tokens": (ARRAY, (STRING, [t for t, _, _ in PIECES])),
        "tokenizer.ggml.scores": (ARRAY, (FLOAT32, [s for _, _, s in PIECES])),
        "tokenizer.ggml.token_type": (ARRAY, (INT32, [k for _, k, _ in PIECES])),
        "tokenizer.ggml.bos_token_id": (UINT32, IDS["<bos>"]),
        "tokenizer.ggml.eos_token_id": (UINT32, IDS["<eos>"]),
        "tokenizer.ggml.unknown_token_id": (UINT32, IDS["<unk>"]),
        "tokenizer.ggml.padding_token_id": (UINT32, IDS["<pad>"]),
        "tokenizer.ggml.add_bos_token": (BOOL, True),
        "tokenizer.ggml.add_space_prefix": (BOOL, False),
        "tokenizer.chat_template": (STRING, "{{ messages }}"),
    }
    meta.update(overrides)
    return {key: value for key, value in meta.items() if value is not None}


def _write(path: Path, **overrides: Value | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gguf_bytes(_metadata(**overrides)))
    return path


@pytest.fixture(autouse=True)
def _fresh_cache() -> Any:
    tokenizer_export.clear_cache()
    yield
    tokenizer_export.clear_cache()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return _write(tmp_path / "tiny.gguf")


def _tokenizer(files: dict[str, bytes]) -> Tokenizer:
    return Tokenizer.from_str(files["tokenizer.json"].decode())


def _cache_name(model: Path) -> str:
    digest, version = tokenizer_export.file_sha256(model), tokenizer_export.FORMAT_VERSION
    return f"{digest}-v{version}-{tokenizer_export.exporter_id()}.zip"


def _ids(*texts: str) -> list[int]:
    return [IDS[t] for t in texts]


def test_merges_follow_scores_and_specials_split_first(model: Path) -> None:
    tok = _tokenizer(tokenizer_export.export_files(model, None))
    encode = tok.encode
    assert encode("abc", add_special_tokens=False).ids == _ids("abc")  # a + bc, then abc
    assert encode("ab", add_special_tokens=False).ids == _ids("ab")
    assert encode(" abc", add_special_tokens=False).ids == _ids(SPACE + "abc")  # ▁a + bc
    assert encode("a  b", add_special_tokens=False).ids == _ids("a", "  ", "b")  # user-defined
    assert encode("a\nb", add_special_tokens=False).ids == _ids("a", "\n", "b")
    assert encode("cé", add_special_tokens=False).ids == _ids("c", "<0xC3>", "<0xA9>")
    assert encode("", add_special_tokens=True).ids == _ids("<bos>")
    assert encode("a", add_special_tokens=True).ids == _ids("<bos>", "a")
    parsed = encode("<start_of_turn>a<end_of_turn>", add_special_tokens=False).ids
    assert parsed == _ids("<start_of_turn>", "a", "<end_of_turn>")
    tok.encode_special_tokens = True  # llama.cpp's parse_special=False
    assert encode("<bos>", add_special_tokens=False).ids == _ids("<", "b", "<0x6F>", "<0x73>", ">")
    assert encode("x\n", add_special_tokens=False).ids == _ids("<0x78>", "\n")  # still split
    spelled = _ids("<bos>", SPACE + "abc", "  ", "<0xC3>", "<0xA9>")
    assert tok.decode(spelled, skip_special_tokens=False) == "<bos> abc  é"
    assert tok.decode(_ids("<bos>", "a"), skip_special_tokens=True) == "a"


def test_space_prefix_and_eos_as_the_file_says(tmp_path: Path) -> None:
    """add_space_prefix (llama.cpp's SPM default) prefixes each run of text with ▁ and decoding
    strips it; add_bos false, add_eos true."""
    path = _write(
        tmp_path / "p.gguf",
        **{
            "tokenizer.ggml.add_space_prefix": None,  # absent: the SPM default, true
            "tokenizer.ggml.add_bos_token": (BOOL, False),
            "tokenizer.ggml.add_eos_token": (BOOL, True),
        },
    )
    files = tokenizer_export.export_files(path, None)
    tok = _tokenizer(files)
    assert tok.encode("abc", add_special_tokens=True).ids == _ids(SPACE + "abc", "<eos>")
    assert tok.encode("a\nabc", add_special_tokens=False).ids == _ids(
        SPACE + "a", "\n", SPACE + "abc"
    )
    assert tok.decode(_ids(SPACE + "abc")) == "abc"
    config = json.loads(files["tokenizer_config.json"])
    assert (config["add_bos_token"], config["add_eos_token"]) == (False, True)


def test_the_files_and_their_fields(model: Path) -> None:
    files = tokenizer_export.export_files(model, None)
    assert sorted(files) == sorted(tokenizer_export.FILES)
    config = json.loads(files["tokenizer_config.json"])
    assert config == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "chat_template": "{{ messages }}",
    }
    assert json.loads(files["special_tokens_map.json"]) == {
        "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
    }  # fmt: skip
    assert json.loads(files["config.json"]) == {
        "model_type": "tiny",
        "vocab_size": len(PIECES),
        "max_position_embeddings": 2048,
        "bos_token_id": IDS["<bos>"],
        "eos_token_id": IDS["<eos>"],
        "pad_token_id": IDS["<pad>"],
    }
    generation = json.loads(files["generation_config.json"])
    assert generation["eos_token_id"] == _ids("<eos>", "<end_of_turn>")  # llama.cpp's EOG set
    override = tokenizer_export.export_files(model, "{{ other }}")
    assert json.loads(override["tokenizer_config.json"])["chat_template"] == "{{ other }}"
    assert override["tokenizer.json"] == files["tokenizer.json"]


def test_the_zip_is_deterministic_and_flat(model: Path, tmp_path: Path) -> None:
    first = tokenizer_export.tokenizer_zip(model, None)
    tokenizer_export.clear_cache()
    again = tokenizer_export.tokenizer_zip(model, None, cache_dir=tmp_path / "cache")
    assert first == again
    with zipfile.ZipFile(io.BytesIO(first)) as archive:
        assert archive.namelist() == sorted(tokenizer_export.FILES)
        assert (
            archive.read("tokenizer.json")
            == tokenizer_export.export_files(model, None)["tokenizer.json"]
        )
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
    assert tokenizer_export.tokenizer_zip(model, "{{ x }}") != first


def test_caches_in_memory_and_on_disk(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built once per file sha256; with cache_dir a new process reads it back from disk without
    reading the model's vocabulary again, unless the exporter's source changed."""
    calls = []
    build = tokenizer_export.tokenizer_json

    def counting(vocab: tokenizer_export.GGUFVocab) -> dict[str, Any]:
        calls.append(vocab.name)
        return build(vocab)

    monkeypatch.setattr(tokenizer_export, "tokenizer_json", counting)
    cache = tmp_path / "cache"
    first = tokenizer_export.export_files(model, None, cache_dir=cache)
    assert tokenizer_export.export_files(model, None, cache_dir=cache) == first
    copy = tmp_path / "copy.gguf"  # same bytes elsewhere: the same sha256
    copy.write_bytes(model.read_bytes())
    assert tokenizer_export.export_files(copy, None) == first
    assert calls == ["Tiny"]
    assert [p.name for p in cache.iterdir()] == [_cache_name(model)]
    tokenizer_export.clear_cache()  # as a new process would: the disk, not the GGUF's vocabulary

    def unread(path: object) -> None:
        raise AssertionError(f"{path} read again")

    monkeypatch.setattr(tokenizer_export, "read_vocab", unread)
    assert tokenizer_export.export_files(model, None, cache_dir=cache) == first
    override = tokenizer_export.export_files(model, "{{ t }}", cache_dir=cache)
    assert json.loads(override["tokenizer_config.json"])["chat_template"] == "{{ t }}"
    assert calls == ["Tiny"]
    tokenizer_export.clear_cache()  # another exporter's files are never read
    monkeypatch.setattr(tokenizer_export, "exporter_id", lambda: "changed")
    with pytest.raises(AssertionError, match="read again"):
        tokenizer_export.export_files(model, None, cache_dir=cache)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenizer.ggml.model": (STRING, "rwkv")}, "'rwkv' is not supported: RWKV's trie"),
        ({"tokenizer.ggml.model": (STRING, "gpt2")}, "a BPE vocabulary without .*merges"),
        (
            {"tokenizer.ggml.model": (STRING, "gpt2"), "tokenizer.ggml.pre": (STRING, "kimi-k2")},
            "pre-tokenizer 'kimi-k2' is not supported: llama.cpp splits it with a hand-written",
        ),
        ({"tokenizer.ggml.model": None}, "has no tokenizer"),
        (
            {"tokenizer.ggml.scores": (ARRAY, (FLOAT32, [0.0] * 10))},
            "tokenizer.ggml.scores must list all 275 tokens",
        ),
        ({"tokenizer.ggml.bos_token_id": (UINT32, 999)}, "bos_token_id = 999 is outside"),
    ],
)
def test_unsupported_files_are_refused(
    tmp_path: Path, overrides: dict[str, Value | None], message: str
) -> None:
    with pytest.raises(TokenizerExportError, match=message):
        tokenizer_export.export_files(_write(tmp_path / "x.gguf", **overrides), None)


@pytest.mark.parametrize("collecting", [True, False])
def test_an_export_leaves_the_garbage_collector_as_it_found_it(
    tmp_path: Path, collecting: bool
) -> None:
    """The collector is paused while an export builds (tokenizer_export._collector_paused) and
    is as it was after one that succeeds and one that is refused: on again if it was on, still
    off if the application had turned it off."""
    good = _write(tmp_path / "good.gguf")
    bad = _write(tmp_path / "bad.gguf", **{"tokenizer.ggml.model": None})
    was = gc.isenabled()
    try:
        gc.enable() if collecting else gc.disable()
        tokenizer_export.clear_cache()
        assert tokenizer_export.export_files(good, None)
        assert gc.isenabled() is collecting
        with pytest.raises(TokenizerExportError):
            tokenizer_export.export_files(bad, None)
        assert gc.isenabled() is collecting
    finally:
        gc.enable() if was else gc.disable()
        tokenizer_export.clear_cache()


def _with_pieces(tmp_path: Path, pieces: list[tuple[str, int, float]]) -> Path:
    return _write(
        tmp_path / "v.gguf",
        **{
            "tokenizer.ggml.tokens": (ARRAY, (STRING, [t for t, _, _ in pieces])),
            "tokenizer.ggml.scores": (ARRAY, (FLOAT32, [s for _, _, s in pieces])),
            "tokenizer.ggml.token_type": (ARRAY, (INT32, [k for _, k, _ in pieces])),
        },
    )


def test_vocabularies_that_cannot_be_exact_are_refused(tmp_path: Path) -> None:
    duplicate = [*PIECES, ("ab", NORMAL, -50.0)]
    with pytest.raises(TokenizerExportError, match=r"tokens \d+ and \d+ are both 'ab'"):
        tokenizer_export.export_files(_with_pieces(tmp_path, duplicate), None)
    tokenizer_export.clear_cache()
    no_bytes = [p for p in PIECES if p[1] != BYTE]
    with pytest.raises(TokenizerExportError, match="256 byte tokens are missing"):
        tokenizer_export.export_files(_with_pieces(tmp_path, no_bytes), None)
    tokenizer_export.clear_cache()
    # "éa" merges from the character "é" in llama.cpp, which no BPE model can (é is no token)
    unknown_char = [*PIECES, ("éa", NORMAL, -60.0)]
    with pytest.raises(TokenizerExportError, match=r"'é' \+ 'a', which is not a token"):
        tokenizer_export.export_files(_with_pieces(tmp_path, unknown_char), None)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # llama.cpp splits the longer "q>z" off "<q>z" first, HuggingFace the leftmost "<q>"
        ([("<q>", USER_DEFINED), ("q>zz", USER_DEFINED)], r"'<q>' and 'q>zz' overlap"),
        # equal lengths: llama.cpp's order is unspecified
        ([("mn", USER_DEFINED), ("no", USER_DEFINED)], r"'mn' and 'no' overlap"),
        # specials not parsed: HuggingFace skips "<x>" whole, llama.cpp still splits "x>" off
        ([("<x>", CONTROL), ("x>", USER_DEFINED)], r"'x>' lies inside special token '<x>'"),
        ([("<y", CONTROL), ("y>", USER_DEFINED)], r"'<y' and 'y>' overlap"),
    ],
)
def test_overlapping_added_tokens_are_refused(
    tmp_path: Path, extra: list[tuple[str, int]], message: str
) -> None:
    pieces = [*PIECES, *((text, kind, -1000.0) for text, kind in extra)]
    with pytest.raises(TokenizerExportError, match=message):
        tokenizer_export.export_files(_with_pieces(tmp_path, pieces), None)


def test_runs_of_one_character_may_overlap(tmp_path: Path) -> None:
    """Runs of newlines (Gemma has 1 to 31) are split greedily from the left both ways."""
    runs = [("\n" * n, USER_DEFINED, -1000.0) for n in (2, 3)]
    files = tokenizer_export.export_files(_with_pieces(tmp_path, [*PIECES, *runs]), None)
    ids = _tokenizer(files).encode("a" + "\n" * 6 + "b", add_special_tokens=False).ids
    assert ids == [IDS["a"], len(PIECES) + 1, len(PIECES) + 1, IDS["b"]]


def test_export_tokenizer_command(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    restore_logging: None,  # the command configures logging (warning level): undone after
) -> None:
    """By catalog name (the embedded one here) and by path, the export kept in the cache
    directory; a refused vocabulary exits 1 with one error line and writes nothing."""
    embedded = _write(tmp_path / "embedded.gguf")
    monkeypatch.setattr(catalog, "default_model_path", lambda: embedded)
    monkeypatch.delenv(catalog.MODELS_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    out = tmp_path / "out"
    argv = ["export-tokenizer", DEFAULT_MODEL_NAME, str(out), "--chat-template", "chatml"]
    assert models_cli.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in printed] == [
        str(out / name) for name in sorted(tokenizer_export.FILES)
    ]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"].startswith("{%- for message in messages -%}")
    cached = tmp_path / "xdg" / "llama-grpc" / "tokenizers"
    assert [p.name for p in cached.iterdir()] == [_cache_name(embedded)]
    bad = _write(tmp_path / "rwkv.gguf", **{"tokenizer.ggml.model": (STRING, "rwkv")})
    assert models_cli.main(["export-tokenizer", str(bad), str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'rwkv' is not supported" in err
    assert not (tmp_path / "none").exists()


def test_export_tokenizer_command_writes_the_template_a_server_would_use(
    tmp_path: Path,
    restore_logging: None,  # the command configures logging (warning level): undone after
) -> None:
    """Without --chat-template the files carry the template `llama-grpc serve` would render
    messages with (core.requests.chat.template_in_use): the file's own, else its family's built-in
    (a Gemma file with none gets Gemma's), else none; --chat-template overrides both."""

    def exported(name: str, *argv: str, **meta: Value | None) -> dict[str, Any]:
        path = _write(tmp_path / f"{name}.gguf", **meta)
        out = tmp_path / name
        assert models_cli.main(["export-tokenizer", str(path), str(out), "--no-cache", *argv]) == 0
        return dict(json.loads((out / "tokenizer_config.json").read_text()))

    gemma = {"general.architecture": (STRING, "gemma3"), "tokenizer.chat_template": None}
    assert exported("own")["chat_template"] == "{{ messages }}"
    assert exported("family", **gemma)["chat_template"] == BUILTIN_TEMPLATES["gemma"]
    chatml = exported("chatml", "--chat-template", "chatml", **gemma)
    assert chatml["chat_template"] == BUILTIN_TEMPLATES["chatml"]
    assert "chat_template" not in exported("none", **{"tokenizer.chat_template": None})
