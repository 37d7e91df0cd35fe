"""llama.cpp's BPE pre-tokenizers (`tokenizer.ggml.pre`, llama-vocab.cpp of llama-cpp-python
0.3.36) as HuggingFace `tokenizers` regexes: each name's flags and the list of regexes that
llama.cpp applies one after another, each splitting the pieces of the previous; or why one
cannot be reproduced. Pure data and a lookup; no llama_cpp, no tokenizers.

How llama.cpp's splitting (unicode.cpp, unicode_regex_split) maps onto Oniguruma, which
`tokenizers` runs:
- Four regexes run hand-written splitters: GPT-2's, Llama 3's, Qwen2's and Qwen3.5's. Each gives
  the regex's own matches (read line by line; the random corpora of
  tests/model/test_tokenizer_vocabs.py agree), except that GPT-2's also takes a lone whitespace
  run as `\\s+` (the regex string lacks that alternative): written here with it.
- The others run std::regex on a "collapsed" text where every non-ASCII code point stands for
  its category (letter, number, punctuation, mark, symbol, whitespace as \\v, other) and
  \\p{..} for the same class: the same matches as Oniguruma's \\p{..} on the text, given the
  same categories (they differ only on the code points of UNICODE_16_NEW, which oniguruma()
  takes out of each class). llama.cpp reads \\p{Lu}, \\p{Ll}, \\p{Lt}, \\p{Lm} and \\p{Lo}
  as any letter, ASCII included: written \\p{L} here.
- Regexes without \\p{..} run std::wregex on the text with non-ASCII whitespace replaced by
  \\v: a character class then matches such a space only if it matches \\v, so the CJK ranges
  that span U+2000-U+3000 are intersected with [^\\s] here, and ECMAScript's `$` (end of
  input) is written \\z (Oniguruma's `$` also matches before a newline).
- Unmatched text between matches is a piece of its own: `Split(..., behavior="isolated")`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Code points that Unicode 16.0 assigned a category and llama.cpp's unicode-data tables (Unicode
# 15) leave undefined: Oniguruma (tokenizers 0.23) puts them in \p{L}, \p{N}, \p{M}, \p{P} or
# \p{S}, llama.cpp in none. Measured over every code point (\p{..} through a tokenizers Split
# against the tables of unicode-data.cpp): these are the only differences, white space agrees.
# Excluding them is harmless under an Oniguruma with older tables.
UNICODE_16_NEW = (
    r"\x{897}\x{1B4E}-\x{1B4F}\x{1B7F}\x{1C89}-\x{1C8A}\x{2427}-\x{2429}\x{31E4}-\x{31E5}"
    r"\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3}\x{10D40}-\x{10D65}"
    r"\x{10D69}-\x{10D85}\x{10D8E}-\x{10D8F}\x{10EC2}-\x{10EC4}\x{10EFC}\x{11380}-\x{11389}"
    r"\x{1138B}\x{1138E}\x{11390}-\x{113B5}\x{113B7}-\x{113C0}\x{113C2}\x{113C5}"
    r"\x{113C7}-\x{113CA}\x{113CC}-\x{113D5}\x{113D7}-\x{113D8}\x{113E1}-\x{113E2}"
    r"\x{116D0}-\x{116E3}\x{11BC0}-\x{11BE1}\x{11BF0}-\x{11BF9}\x{11F5A}\x{13460}-\x{143FA}"
    r"\x{16100}-\x{16139}\x{16D40}-\x{16D79}\x{18CFF}\x{1CC00}-\x{1CCF9}\x{1CD00}-\x{1CEB3}"
    r"\x{1E5D0}-\x{1E5FA}\x{1E5FF}\x{1F8B2}-\x{1F8BB}\x{1F8C0}-\x{1F8C1}\x{1FA89}\x{1FA8F}"
    r"\x{1FABE}\x{1FAC6}\x{1FADC}\x{1FADF}\x{1FAE9}\x{1FBCB}-\x{1FBEF}"
)
_CATEGORY = re.compile(r"\\p\{([LNMPS])\}")


def oniguruma(regex: str) -> str:
    """`regex` with each \\p{X} limited to llama.cpp's code points (inside a class as well:
    Oniguruma nests classes)."""
    return _CATEGORY.sub(lambda m: rf"[\p{{{m[1]}}}&&[^{UNICODE_16_NEW}]]", regex)


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL
QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NEWLINES = r"[^\n]+|[\n]+"
# llama.cpp's [一-龥ࠀ-一가-퟿]+; U+0800-U+4E00 spans the non-ASCII spaces (\v to std::wregex)
_CJK = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}&&[^\s]]+"
_ASCII_PUNCT = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"
_DEEPSEEK3 = (
    _ASCII_PUNCT + r"[A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PORO = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+"
_UPPER_LOWER = (  # llama.cpp's rewrite of [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}...]+
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+",
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*",
)
_ANY_LM = r"[\p{L}\p{M}]"  # llama.cpp's [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and the like


def _youtu() -> str:
    word = r"[^\r\n\p{L}\p{N}]?" + _ANY_LM
    return (
        f"{word}*{_ANY_LM}+{_CONTRACTIONS}?|{word}+{_ANY_LM}*{_CONTRACTIONS}?"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


def _tiny_aya_word() -> str:
    word = r"[^\r\n\p{L}\p{N}]?" + _ANY_LM
    return (
        f"{word}*{_ANY_LM}+{_CONTRACTIONS}?|{word}+{_ANY_LM}*{_CONTRACTIONS}?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


def _jais2() -> str:
    runs = "|".join(rf"\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
    return (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        rf"|\s*[\r\n]+|{runs}|\s{{1,2}}(?!\S)|\s{{1}}"
    )


@dataclass(frozen=True, slots=True)
class PreType:
    """One LLAMA_VOCAB_PRE_TYPE_*: its splits, or why it cannot be exported."""

    splits: tuple[str, ...] = ()
    byte_level: bool = True  # GPT-2's byte-to-unicode mapping (False: raw UTF-8, SPM-style)
    refused: str = ""


# the letters of llama.cpp's deepseek-llm regex, escaped (an editor's NFC would change some)
_DEEPSEEK_LLM_LETTERS = (
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}"
    r"\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-"
    r"\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-"
    r"\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-"
    r"\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-"
    r"\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}"
    r"\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-"
    r"\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-"
    r"\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}"
    r"\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}"
    r"\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}"
    r"\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-"
    r"\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-"
    r"\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}"
    r"\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+"
)

PRE_TYPES: dict[str, PreType] = {
    "DEFAULT": PreType((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    "LLAMA3": PreType((LLAMA3,)),
    "JAIS2": PreType((_jais2(),)),
    "DEEPSEEK_LLM": PreType(
        (
            "[\r\n]",
            _DEEPSEEK_LLM_LETTERS,
            # llama.cpp's range U+3000-U+3002: U+3000 reaches std::wregex as \v, no match
            r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3001}-\x{3002}]+",
            r"\s+\z",
            _CJK,
            r"\p{N}+",
        )
    ),
    "DEEPSEEK3_LLM": PreType(
        (r"\p{N}{1,3}", r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+", _DEEPSEEK3)
    ),
    "SPARK2_5": PreType(
        (
            r"\p{N}{1,3}",
            r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
            _ASCII_PUNCT + r"[A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]"
            r"|\s+(?!\S)|\s+",
            r"\p{N}",
        )
    ),
    "YOUTU": PreType(
        (
            r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+"
            r"|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}\x{FF1A}\x{FF1B}\x{FF0C}"
            r"\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+"
            r"|[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
            _youtu(),
        )
    ),
    "DEEPSEEK_CODER": PreType(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "FALCON": PreType((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    "STARCODER": PreType((r"\p{N}", GPT2)),
    "GPT2": PreType((GPT2,)),
    "QWEN2": PreType((QWEN2,)),
    "QWEN35": PreType((QWEN35,)),
    "PORO": PreType((_PORO,)),
    "VIKING": PreType((_PORO, r"\p{N}")),
    "TEKKEN": PreType(
        ("|".join(_UPPER_LOWER) + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
    ),
    "CHAMELEON": PreType(
        (
            "<sentinel:[0-9]+>",
            "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            "([\\t\\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            GPT2,
        )
    ),
    "GPT4O": PreType(
        (
            "|".join(p + _CONTRACTIONS + "?" for p in _UPPER_LOWER)
            + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    "GRANITE_EMB_MULTI": PreType(
        (
            "|".join(
                p.replace(r"[\p{L}]", r"[\p{L}\p{M}]") + _CONTRACTIONS + "?" for p in _UPPER_LOWER
            )
            + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    "BAILINGMOE": PreType(
        (
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ),
    "SEED_CODER": PreType(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
            r"|\s+(?!\S)|\s+",
        )
    ),
    "UFAKZEKA": PreType((r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL,)),
    "LAGUNA": PreType((NEWLINES, QWEN2)),
    "EXAONE_MOE": PreType(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ),
    "GEMMA4": PreType((NEWLINES,), byte_level=False),
    "SARVAM_MOE": PreType((NEWLINES,), byte_level=False),
    "MINICPM5": PreType(
        (
            r"\p{N}{1,3}",
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+" + _TAIL,
        )
    ),
    "TINY_AYA": PreType(
        refused="llama.cpp splits its digit groups with the AFMoE splitter, which glues the "
        "text before a number to its first group, unlike the file's regex"
    ),
    "KIMI_K2": PreType(
        refused="llama.cpp splits it with a hand-written splitter (Han exclusion) not "
        "reproduced here"
    ),
    "AFMOE": PreType(
        refused="llama.cpp's AFMoE digit splitter glues the text before a number to its first "
        "digit group, which no regex split reproduces"
    ),
    "SUPERBPE": PreType(
        refused="its empty-match split (?=(\\d{3})+(?!\\d)) runs through std::regex_iterator, "
        "whose empty-match stepping is not reproduced here"
    ),
    "WHITESPACE": PreType(refused="llama.cpp tokenizes it with a whitespace session of its own"),
}
# the names llama.cpp maps to the same splits
for _alias, _target in {
    "DBRX": "LLAMA3", "SMAUG": "LLAMA3", "CHATGLM4": "LLAMA3",
    "HUNYUAN_DENSE": "DEEPSEEK3_LLM", "JOYAI_LLM": "DEEPSEEK3_LLM", "HY_V4": "DEEPSEEK3_LLM",
    "REFACT": "STARCODER", "COMMAND_R": "STARCODER", "SMOLLM": "STARCODER",
    "CODESHELL": "STARCODER", "EXAONE": "STARCODER", "MINERVA": "STARCODER",
    "MELLUM2": "STARCODER", "MPT": "GPT2", "OLMO": "GPT2", "JAIS": "GPT2", "TRILLION": "GPT2",
    "GRANITE_DOCLING": "GPT2", "STABLELM2": "QWEN2", "HUNYUAN": "QWEN2", "SOLAR_OPEN": "QWEN2",
    "GROK_2": "QWEN2", "BLOOM": "PORO", "GPT3_FINNISH": "PORO", "MINIMAX_M2": "GPT4O",
}.items():  # fmt: skip
    PRE_TYPES[_alias] = PRE_TYPES[_target]


@dataclass(frozen=True, slots=True)
class PreName:
    """What llama.cpp sets for one `tokenizer.ggml.pre` name before the file's own keys."""

    pre_type: str
    ignore_merges: bool = False
    clean_spaces: bool = True
    add_bos: bool = False  # True: add_bos defaults to true (the file's key still overrides)
    add_sep: bool = False
    no_bos: bool = False  # BOS defaults to none (the file's key still overrides)
    escape_whitespaces: bool = False  # spaces -> U+2581 before splitting (SPM-style BPE)


def _names() -> dict[str, PreName]:
    plain = PreName
    kept = {  # clean_spaces stays true
        "default": plain("DEFAULT"), "falcon": plain("FALCON"), "mpt": plain("MPT"),
        "starcoder": plain("STARCODER"), "jais-2": plain("JAIS2"), "refact": plain("REFACT"),
        "stablelm2": plain("STABLELM2"), "olmo": plain("OLMO"), "dbrx": plain("DBRX"),
        "smaug-bpe": plain("SMAUG"), "jais": plain("JAIS"), "codeshell": plain("CODESHELL"),
        "bloom": plain("BLOOM"), "gpt3-finnish": plain("GPT3_FINNISH"),
        "exaone": plain("EXAONE"), "exaone4": plain("GPT2"), "exaone-moe": plain("EXAONE_MOE"),
        "minerva-7b": plain("MINERVA"), "megrez": plain("QWEN2"), "mellum2": plain("MELLUM2"),
        "minicpm5": plain("MINICPM5", ignore_merges=True),
        "chatglm-bpe": plain("CHATGLM4", no_bos=True),
        "glm4": plain("CHATGLM4", no_bos=True, ignore_merges=True),
        "glm5": plain("CHATGLM4", no_bos=True, ignore_merges=True),
        "gemma4": plain("GEMMA4", escape_whitespaces=True),
        "granite-embed-multi-311m": plain("GEMMA4", escape_whitespaces=True),
    }  # fmt: skip
    for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                 "midm-2.0", "lfm2", "jina-v5-nano"):  # fmt: skip
        kept[name] = plain("LLAMA3", ignore_merges=True, add_bos=True)
    for name in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                 "jina-v2-de", "a.x-4.0", "mellum", "modern-bert"):  # fmt: skip
        kept[name] = plain("GPT2")
    for name in ("jina-v1-en", "jina-v2-code", "roberta-bpe"):
        kept[name] = plain("GPT2", add_sep=True)
    unclean = {
        "deepseek-llm": "DEEPSEEK_LLM", "deepseek-coder": "DEEPSEEK_CODER",
        "deepseek-v3": "DEEPSEEK3_LLM", "spark2_5": "SPARK2_5", "command-r": "COMMAND_R",
        "qwen2": "QWEN2", "deepseek-r1-qwen": "QWEN2", "kormo": "QWEN2", "f2llmv2": "QWEN2",
        "qwen35": "QWEN35", "poro-chat": "PORO", "viking": "VIKING", "smollm": "SMOLLM",
        "gpt-4o": "GPT4O", "llama4": "GPT4O", "kanana2": "GPT4O", "talkie": "GPT4O",
        "tiny_aya": "TINY_AYA", "cohere2moe": "TINY_AYA", "superbpe": "SUPERBPE",
        "trillion": "TRILLION", "granite-docling": "GRANITE_DOCLING",
        "bailingmoe": "BAILINGMOE", "bailingmoe2": "BAILINGMOE", "llada-moe": "BAILINGMOE",
        "seed-coder": "SEED_CODER", "hunyuan": "HUNYUAN", "hunyuan-dense": "HUNYUAN_DENSE",
        "hy_v4": "HY_V4", "joyai-llm": "JOYAI_LLM", "kimi-k2": "KIMI_K2",
        "ufakzeka": "UFAKZEKA", "grok-2": "GROK_2", "afmoe": "AFMOE", "laguna": "LAGUNA",
        "minimax-m2": "MINIMAX_M2", "solar-open": "SOLAR_OPEN",
    }  # fmt: skip
    for name, pre_type in unclean.items():
        kept[name] = plain(pre_type, clean_spaces=False)
    kept["youtu"] = plain("YOUTU", clean_spaces=False, ignore_merges=True)
    kept["tekken"] = plain("TEKKEN", clean_spaces=False, ignore_merges=True, add_bos=True)
    kept["chameleon"] = plain("CHAMELEON", clean_spaces=False, add_bos=True)
    kept["granite-embed-multi-97m"] = plain(
        "GRANITE_EMB_MULTI", clean_spaces=False, ignore_merges=True
    )
    kept["sarvam-moe"] = plain("SARVAM_MOE", clean_spaces=False, escape_whitespaces=True)
    kept["whitespace"] = plain("WHITESPACE")
    kept[""] = kept["default"]  # no tokenizer.ggml.pre: llama.cpp warns and uses 'default'
    return kept


PRE_NAMES: dict[str, PreName] = _names()
