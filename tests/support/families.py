"""The model families of llama_grpc_testkit.synth_gguf (`FAMILIES`, `family_model`) and what the
tests compare the server with: llama.cpp's own tokenizer on the same file (`Reference`, loaded
vocabulary-only by the test, not through the engine) and the family's chat template rendered here
with jinja2 (`render_chat`), as llama-cpp-python's Jinja2ChatFormatter and HuggingFace transformers
render chat templates."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import llama_cpp
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llama_grpc_testkit import llama_sdist, synth_gguf

FAMILIES = synth_gguf.FAMILIES
Family = synth_gguf.Family
family_model = synth_gguf.family_model

# A conversation every family's template renders: system, user, assistant, user.
CONVERSATION = (
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Name a colour."},
)

# Texts for the tokenizer doors: spaces, tabs and newlines, accents, an emoji, CJK, digits and
# punctuation (the pre-tokenizers split these differently); each family adds its special tokens.
CORPUS = (
    "Hello world",
    " leading space, trailing space ",
    "two  spaces\tand a tab\n\nnewlines\r\n",
    "naïve café, Ünïcödé 🦙 中文 日本語 한국어",
    "3.14159 + 2 = x? 'quoted' \"double\" it's we're",
    "def f(x):\n    return x ** 2  # code",
)


def template_source(family: Family) -> str:
    """The chat template the family's model file carries ("" for the embedded model: the test
    reads it from the file)."""
    return llama_sdist.template(family.template) if family.template else ""


class Reference:
    """llama.cpp's tokenizer over a model file, loaded vocabulary-only (its own llama_model)."""

    def __init__(self, path: Path) -> None:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self._model, f"llama.cpp could not load {path}"
        self.vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.bos_id = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos_id = int(llama_cpp.llama_vocab_eos(self.vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        template = llama_cpp.llama_model_chat_template(self._model, None)
        self.chat_template = template.decode() if template else ""

    def close(self) -> None:
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode()
        out = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(
            self.vocab, data, len(data), out, len(out), add_special, parse_special
        )
        assert n >= 0
        return list(out[:n])

    def detokenize(self, ids: Sequence[int], *, render_special: bool) -> str:
        """llama_detokenize, keeping special tokens (rendered as text or not)."""
        tokens = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
        size = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(
            self.vocab, tokens, len(ids), buf, size, False, render_special
        )
        assert n >= 0
        return buf.raw[:n].decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str:
        """llama_token_to_piece, special tokens rendered (invalid UTF-8 replaced)."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token_id, buf, len(buf), 0, True)
        assert n >= 0
        return buf.raw[:n].decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.detokenize([token_id], render_special=True) if token_id >= 0 else ""

    def token_id(self, text: str) -> int:
        """The id of a special token written as text (one token, or the test fails)."""
        (token,) = self.tokenize(text, add_special=False, parse_special=True)
        return token

    def is_eog(self, token_id: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token_id))

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        template: str,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The conversation rendered here and tokenized by llama.cpp with parse_special, one BOS
        at the start when the vocabulary wants one (the template's own, or added): llama.cpp's
        server rule (common/chat.cpp drops a rendered BOS text and tokenizes with add_special)."""
        text = render_chat(
            template,
            messages,
            bos_token=self.token_text(self.bos_id),
            eos_token=self.token_text(self.eos_id),
            tools=tools,
        )
        ids = self.tokenize(text, add_special=False, parse_special=True)
        if self.add_bos and self.bos_id >= 0 and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str,
    eos_token: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """A chat template rendered the way HuggingFace transformers does (sandboxed, trim_blocks,
    lstrip_blocks, loop controls, its tojson, strftime_now, raise_exception), opening the
    assistant's turn."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    return env.from_string(template).render(
        messages=list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=True,
        bos_token=bos_token,
        eos_token=eos_token,
        raise_exception=raise_exception,
        # Llama 3.x templates write today's date: the server renders the same one, unless the
        # two renders straddle midnight
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
    )
