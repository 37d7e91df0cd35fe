"""A GGUF file's vocabulary as llama.cpp (llama-vocab.cpp, as bundled with llama-cpp-python
0.3.36) loads it: the tokenizer keys with llama.cpp's defaults for each tokenizer model and
pre-tokenizer name, and each token's effective attributes (the types it overrides by text: EOG,
FIM and gpt-oss tokens; lstrip/rstrip by model name). Read with gguf_header; no llama_cpp."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gguf import Keys, TokenType

from llama_grpc_server.models.bpe_pretokenizers import PRE_NAMES
from llama_grpc_server.models.gguf_header import GGUFError, read_header

# llama.cpp's token types (tokenizer.ggml.token_type; llama_token_type in llama.h), as ints
NORMAL, UNKNOWN, CONTROL = TokenType.NORMAL.value, TokenType.UNKNOWN.value, TokenType.CONTROL.value
USER_DEFINED, UNUSED = TokenType.USER_DEFINED.value, TokenType.UNUSED.value
BYTE = TokenType.BYTE.value
TYPES = frozenset(kind.value for kind in TokenType)
ADDED = frozenset({CONTROL, UNKNOWN, USER_DEFINED})  # llama.cpp's cache_special_tokens

# Texts llama.cpp marks as end-of-generation whatever the file says; it makes each a control
# token too.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]",
    "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})  # fmt: skip
# FIM tokens llama.cpp looks up by text when the file does not name them (each becomes a
# control token; pad, repo and separator end generation): key suffix -> candidate texts.
FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
                "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
_FIM_EOG = ("fim_pad", "fim_rep", "fim_sep")
_OLD_FIM_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}
# gpt-oss: llama.cpp always renders these, as user-defined tokens
_ALWAYS_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})

# tokenizer.ggml.model -> llama.cpp's tokenizer type
SPM, BPE, WPM, UGM = "SPM", "BPE", "WPM", "UGM"
_MODEL_TYPES = {"llama": SPM, "gpt2": BPE, "gemma4": BPE, "bert": WPM, "t5": UGM}
_UNSUPPORTED_MODELS = {
    "hybriddna": "llama.cpp tokenizes DNA k-mers with a session of its own",
    "whitespace": "llama.cpp splits on whitespace with a session of its own",
    "rwkv": "RWKV's trie tokenizer has no HuggingFace `tokenizers` model",
    "plamo2": "PLaMo-2's Aho-Corasick tokenizer has no HuggingFace `tokenizers` model",
}


class TokenizerExportError(ValueError):
    """The model's vocabulary cannot be exported so that it tokenizes exactly as llama.cpp."""


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The tokenizer part of a GGUF file's metadata (llama.cpp's defaults applied)."""

    model: str  # tokenizer.ggml.model
    kind: str  # SPM, BPE, WPM or UGM
    pre: str  # tokenizer.ggml.pre ("" when absent)
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]  # as the file says
    merges: tuple[str, ...]  # tokenizer.ggml.merges, "left right" each (BPE only)
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    sep_id: int | None
    other_eog_ids: tuple[int, ...]  # EOT, EOM and the FIM pad/repo/separator tokens, if set
    named_fim: frozenset[str]  # the FIM keys the file sets (fim_pre, ...)
    add_bos: bool
    add_eos: bool
    add_sep: bool
    add_space_prefix: bool
    chat_template: str | None
    architecture: str
    name: str
    context_length: int
    # BertNormalizer options (WordPiece), None where the file does not set them
    lowercase: bool | None = None
    strip_accents: bool | None = None
    causal: bool | None = None  # <arch>.attention.causal (false: an encoder, BERT and its kin)

    def text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def _token_id(meta: Mapping[str, Any], key: str, n_tokens: int, default: int | None) -> int | None:
    value = meta.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        return None
    if value < 0 or value == 0xFFFFFFFF:  # noqa: PLR2004  # LLAMA_TOKEN_NULL as uint32
        return None
    if value >= n_tokens:
        raise TokenizerExportError(f"{key} = {value} is outside the vocabulary ({n_tokens})")
    return value


def _numbers(
    meta: Mapping[str, Any], key: str, n_tokens: int, path: str | os.PathLike[str]
) -> tuple[float, ...]:
    values = meta.get(key)
    if (
        not isinstance(values, tuple)
        or len(values) != n_tokens
        or not all(isinstance(v, int | float) for v in values)
    ):
        raise TokenizerExportError(f"{path}: {key} must list all {n_tokens} tokens")
    return tuple(float(v) for v in values)


def _optional_flag(meta: Mapping[str, Any], key: str) -> bool | None:
    value = meta.get(key)
    return value if isinstance(value, bool) else None


def _flag(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key)
    return value if isinstance(value, bool) else default


# llama.cpp's defaults per tokenizer type: (BOS, EOS, UNK, SEP, PAD) ids, add_bos, add_eos,
# add_sep, add_space_prefix (the file's keys override each)
_DEFAULTS: dict[str, tuple[tuple[int | None, ...], bool, bool, bool, bool]] = {
    SPM: ((1, 2, 0, None, None), True, False, False, True),
    BPE: ((11, 11, None, None, None), False, False, False, False),
    WPM: ((101, None, 100, 102, 0), True, False, True, False),
    UGM: ((None, 1, 2, None, 0), False, True, False, False),
}
_GEMMA4_IDS: tuple[int | None, ...] = (None, None, None, None, None)


def _kind(model: Any, path: str | os.PathLike[str], key: str) -> str:
    if model is None:
        raise TokenizerExportError(f"{path}: the file has no tokenizer ({key})")
    if model in _UNSUPPORTED_MODELS:
        raise TokenizerExportError(
            f"{path}: {key} {model!r} is not supported: {_UNSUPPORTED_MODELS[model]}"
        )
    if model not in _MODEL_TYPES:
        raise TokenizerExportError(
            f"{path}: {key} {model!r} is not supported: llama.cpp 0.3.36 knows no such model"
        )
    return _MODEL_TYPES[model]


def _arrays(
    meta: Mapping[str, Any], kind: str, path: str | os.PathLike[str]
) -> tuple[tuple[str, ...], tuple[float, ...], tuple[int, ...], tuple[str, ...]]:
    """tokens, scores, types and merges; llama.cpp reads scores and types as zeros and NORMAL
    where the file has none (SentencePiece and Unigram need the scores)."""
    keys = Keys.Tokenizer
    listed = meta.get(keys.LIST)
    if not isinstance(listed, tuple) or not all(isinstance(t, str) for t in listed):
        raise TokenizerExportError(f"{path}: {keys.LIST} is not a list of strings")
    tokens = tuple(str(t) for t in listed)
    n = len(tokens)
    needs_scores = kind in (SPM, UGM) or keys.SCORES in meta
    scores = _numbers(meta, keys.SCORES, n, path) if needs_scores else (0.0,) * n
    types = (
        tuple(int(t) for t in _numbers(meta, keys.TOKEN_TYPE, n, path))
        if keys.TOKEN_TYPE in meta
        else (NORMAL,) * n
    )
    merges = meta.get(keys.MERGES, ())
    if not isinstance(merges, tuple) or not all(isinstance(m, str) for m in merges):
        raise TokenizerExportError(f"{path}: {keys.MERGES} is not a list of strings")
    return tokens, scores, types, tuple(str(m) for m in merges)


def _fim_ids(meta: Mapping[str, Any], n: int) -> dict[str, int | None]:
    """The FIM token ids the file names (the deprecated prefix/suffix/middle keys last, as
    llama.cpp reads them)."""
    fim = {k: _token_id(meta, f"tokenizer.ggml.{k}_token_id", n, None) for k in FIM_TEXTS}
    for key, old in _OLD_FIM_KEYS.items():
        if (token_id := _token_id(meta, f"tokenizer.ggml.{old}_token_id", n, None)) is not None:
            fim[key] = token_id
    return fim


def read_vocab(path: str | os.PathLike[str]) -> GGUFVocab:
    """The tokenizer metadata of the GGUF file at `path`; TokenizerExportError when it has none
    or it is not one this package can export. Read with gguf_header (the vocabulary arrays
    whole): gguf.GGUFReader takes ~23 s to open a 262k-token vocabulary, this ~0.3 s.
    llama.cpp's defaults apply in its order: the tokenizer model's, the pre-tokenizer name's,
    then the file's keys."""
    keys = Keys.Tokenizer
    try:
        header = read_header(path, full=(keys.LIST, keys.SCORES, keys.TOKEN_TYPE, keys.MERGES))
    except GGUFError as exc:
        raise TokenizerExportError(str(exc)) from None
    meta = header.metadata
    model = meta.get(keys.MODEL)
    kind = _kind(model, path, keys.MODEL)
    tokens, scores, types, merges = _arrays(meta, kind, path)
    n = len(tokens)
    ids, add_bos, add_eos, add_sep, add_prefix = _DEFAULTS[kind]
    bos, eos, unk, sep, pad = _GEMMA4_IDS if model == "gemma4" else ids
    pre = meta.get(keys.PRE)
    pre = "gemma4" if model == "gemma4" else (pre if isinstance(pre, str) else "")
    if kind == BPE and not merges and pre != "kimi-k2":  # llama.cpp needs them but for Kimi K2
        raise TokenizerExportError(f"{path}: a BPE vocabulary without {keys.MERGES}")
    settings = PRE_NAMES.get(pre) if kind == BPE else None
    if settings is not None:
        add_bos = add_bos or settings.add_bos
        add_sep = add_sep or settings.add_sep
        bos = None if settings.no_bos else bos
    # llama.cpp adds Gemma 4's BOS whatever the file says
    gemma4 = settings is not None and settings.pre_type == "GEMMA4"
    template = meta.get(keys.CHAT_TEMPLATE)
    context = meta.get(f"{header.architecture}.context_length")
    fim = _fim_ids(meta, n)
    eot_eom = (_token_id(meta, key, n, None) for key in (keys.EOT_ID, keys.EOM_ID))
    return GGUFVocab(
        model=str(model),
        kind=kind,
        pre=pre,
        tokens=tokens,
        scores=scores,
        types=types,
        merges=merges,
        bos_id=_token_id(meta, keys.BOS_ID, n, bos),
        eos_id=_token_id(meta, keys.EOS_ID, n, eos),
        unk_id=_token_id(meta, keys.UNK_ID, n, unk),
        pad_id=_token_id(meta, keys.PAD_ID, n, pad),
        sep_id=_token_id(meta, keys.SEP_ID, n, sep),
        other_eog_ids=tuple(i for i in (*eot_eom, *(fim[k] for k in _FIM_EOG)) if i is not None),
        named_fim=frozenset(k for k, i in fim.items() if i is not None),
        add_bos=_flag(meta, keys.ADD_BOS, add_bos) or gemma4,
        add_eos=_flag(meta, keys.ADD_EOS, add_eos),
        add_sep=_flag(meta, "tokenizer.ggml.add_sep_token", add_sep),
        add_space_prefix=_flag(meta, keys.ADD_PREFIX, add_prefix),
        chat_template=template if isinstance(template, str) and template else None,
        architecture=header.architecture,
        name=header.name,
        context_length=context if isinstance(context, int) and not isinstance(context, bool) else 0,
        lowercase=_optional_flag(meta, "tokenizer.ggml.normalizer.lowercase"),
        strip_accents=_optional_flag(meta, "tokenizer.ggml.normalizer.strip_accents"),
        causal=_optional_flag(meta, f"{header.architecture}.attention.causal"),
    )


@dataclass(frozen=True, slots=True)
class Attributes:
    """What llama.cpp makes of each token after loading: its effective type (CONTROL for the
    tokens it turns into control tokens by text, USER_DEFINED for gpt-oss's always-rendered
    ones, NORMAL for Gemma 4's plain "</s>"), the end-of-generation ids, and the added tokens
    it strips whitespace beside (LLAMA_TOKEN_ATTR_LSTRIP / RSTRIP, set by model name)."""

    types: tuple[int, ...]
    eog_ids: tuple[int, ...]
    lstrip: frozenset[int]
    rstrip: frozenset[int]


def attributes(vocab: GGUFVocab) -> Attributes:
    """llama.cpp's llama_vocab::impl::load() after the arrays: control-looking tokens, the EOG
    set and its exceptions, the per-model strip attributes."""
    types = list(vocab.types)
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    eog = set(vocab.other_eog_ids)
    if vocab.eos_id is not None:
        eog.add(vocab.eos_id)
    for key, texts in FIM_TEXTS.items():
        if key in vocab.named_fim:
            continue
        found = [ids[t] for t in texts if t in ids]
        if len(found) > 1:
            # llama.cpp takes the first it meets in a hash map's order
            raise TokenizerExportError(
                f"tokens {', '.join(repr(vocab.tokens[i]) for i in found)} all look like "
                f"llama.cpp's {key} token: which one it takes depends on a hash map's order"
            )
        for i in found:
            types[i] = CONTROL
            if key in _FIM_EOG:
                eog.add(i)
    for text in EOG_TEXTS:
        if text in ids:
            types[ids[text]] = CONTROL
            eog.add(ids[text])
    for text in _ALWAYS_USER_DEFINED & ids.keys():
        types[ids[text]] = USER_DEFINED
    eog_texts = {vocab.tokens[i] for i in eog}
    if "<|end|>" in eog_texts and (
        {"<|return|>", "<|call|>"} <= eog_texts or {"<|calls|>", "<|flush|>"} <= eog_texts
    ):
        eog.discard(ids["<|end|>"])
        types[ids["<|end|>"]] = USER_DEFINED
    if "</s>" in eog_texts and eog_texts & {"<|tool_response>", "<|plamo:eos|>"}:
        eog.discard(ids["</s>"])
        types[ids["</s>"]] = NORMAL
    lstrip, rstrip = _strips(vocab, types, ids)
    return Attributes(tuple(types), tuple(sorted(eog)), lstrip, rstrip)


def _strips(
    vocab: GGUFVocab, types: list[int], ids: Mapping[str, int]
) -> tuple[frozenset[int], frozenset[int]]:
    """llama.cpp sets LSTRIP on <mask> for Jina v2 and Nomic BERT MoE / Jina BERT v3, on [MASK]
    for ModernBERT, and RSTRIP on every added token of a model named Phi-3 (but <unk>, <s>,
    <|endoftext|>) and on its </s>."""
    name = vocab.name.lower()
    jina = any(p in vocab.pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
    if jina or any(a in vocab.architecture for a in ("nomic-bert-moe", "jina-bert-v3")):
        return frozenset({ids["<mask>"]} if "<mask>" in ids else ()), frozenset()
    if "phi-3" in name or "phi3" in name:
        rstrip = {i for i, kind in enumerate(types) if kind in ADDED}
        rstrip |= {ids["</s>"]} if "</s>" in ids else set()
        rstrip -= {ids[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in ids}
        return frozenset(), frozenset(rstrip)
    if "modern-bert" in name and "[MASK]" in ids:
        return frozenset({ids["[MASK]"]}), frozenset()
    return frozenset(), frozenset()
