"""LlamaModel: the llama.cpp model, context and vocabulary, created in one place and freed in
close(). Only the engine thread may decode or edit memory; vocabulary calls are thread-safe."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import structlog

from llama_grpc_server.config import ModelSettings
from llama_grpc_server.core.api import ModelInfo
from llama_grpc_server.core.requests.chat import ChatMessage, template_in_use, template_origin
from llama_grpc_server.core.speculation.draft_model import VocabView
from llama_grpc_server.core.tools.types import ToolSpec
from llama_grpc_server.engine import cpu_share, grammar
from llama_grpc_server.engine.chat import ChatRenderer
from llama_grpc_server.engine.offload import resolve_n_gpu_layers
from llama_grpc_server.models.gguf_vocab import TokenizerExportError
from llama_grpc_server.models.tokenizer_wordpiece import WordPieceTokenizer

log = structlog.get_logger("llama_grpc.engine")

# --batch-invariant (ModelSettings.batch_invariant). On the CPU, llama.cpp computes a row's
# output by kernels that the batch picks, and they round differently (bench/batch_invariant.py
# measured each on Gemma 3 270M Q4_K_M: logits move by up to ~1-10, greedy tokens diverge):
# - repacked weights (use_extra_bufts: Q4_0, Q4_K, IQ4_NL into interleaved blocks): a GEMM
#   kernel for each 4 rows of the micro-batch, a GEMV kernel for the rest: off, the plain
#   per-row dot products (vec_dot; tinyBLAS for Q5_0/Q8_0 gave the same bits at every row count);
# - the tiled K-quant matmul (Q4_K, Q6_K, ... once src1 has 8 rows): off (GGML_CPU_TILED_MM=0,
#   which ggml reads once per process: set before the first forward pass);
# - flash attention's tiled path, taken for a micro-batch of 64 query rows or more: micro-batches
#   of BATCH_INVARIANT_UBATCH rows;
# - flash attention's split-KV path, for a micro-batch of one row over 512 KV cells or more,
#   whose partial sums follow the thread count: a pass that would leave one row in its last
#   micro-batch takes a spare row (engine/batch.py: needs_spare_row; engine/runner.py).
# Flash attention stays on (without it the attention matmuls take tinyBLAS from 2 rows, vec_dot
# for one, and sum over the KV view's length). What remains: flash attention sums a sequence's
# KV cells in cell order, so tokens placed in cells freed below its earlier ones (another
# sequence's cells removed while it runs, or the cache wrapping around) sum in another order.
BATCH_INVARIANT_ENV = {"GGML_CPU_TILED_MM": "0"}
BATCH_INVARIANT_UBATCH = 32


@functools.cache
def _init_backend() -> None:
    """llama_backend_init once per process."""
    llama_cpp.llama_backend_init()


def system_info() -> str:
    """llama.cpp's build features, e.g. "CPU : SSE3 = 1 | ... | AVX512 = 1 | ..."."""
    return bytes(llama_cpp.llama_print_system_info()).decode(errors="replace")


class ModelLoadError(RuntimeError):
    """The GGUF file could not be loaded or the context could not be created."""


def _meta(model: Any, key: str) -> str:
    buf = ctypes.create_string_buffer(512)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", errors="replace") if n >= 0 else ""


class LlamaModel:
    """Owns llama_model + llama_context (unified KV, n_seq_max = slots)."""

    def __init__(self, settings: ModelSettings, model_path: str, n_seq_max: int) -> None:
        _init_backend()
        if not Path(model_path).is_file():
            raise ModelLoadError(f"model file not found: {model_path}")
        self.path = model_path
        self.settings = settings
        # The engines decoding meanwhile leave this load a core (cpu_share) until the model,
        # its context and the vocabulary tables below are built.
        with cpu_share.loading():
            self._load(model_path, n_seq_max)

    def _load(self, model_path: str, n_seq_max: int) -> None:
        settings = self.settings
        mparams = llama_cpp.llama_model_default_params()
        self.n_gpu_layers = resolve_n_gpu_layers(settings.n_gpu_layers, model_path, settings.n_ctx)
        mparams.n_gpu_layers = self.n_gpu_layers
        if settings.batch_invariant:
            _batch_invariant_kernels(self.n_gpu_layers)
            mparams.use_extra_bufts = False
        self.model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise ModelLoadError(f"llama.cpp could not load {model_path}")
        self.is_encoder = False
        cparams = self._context_params(n_seq_max)
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if self.ctx and not llama_cpp.llama_get_memory(self.ctx):
            # An encoder-only model (BERT and its kin): a context without memory, where
            # llama_decode runs llama_encode, non-causal over the whole batch in one ubatch (it
            # asserts n_ubatch >= n_tokens), positions bounded by the trained context (BERT's
            # are learned). Recreated so that any input the context admits fits one pass.
            llama_cpp.llama_free(self.ctx)
            self.is_encoder = True
            cparams = self._context_params(n_seq_max)
            self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise ModelLoadError(f"could not create a context (n_ctx={settings.n_ctx})")
        # (generation, prompt) threads as configured; cpu_share may lower them during a load
        self.threads: tuple[int, int] = (int(cparams.n_threads), int(cparams.n_threads_batch))
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.wordpiece = self._wordpiece(model_path)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx))
        self.n_batch = int(llama_cpp.llama_n_batch(self.ctx))
        self.n_ubatch = int(llama_cpp.llama_n_ubatch(self.ctx))
        # a generation context's passes take the mode's spare row (engine/runner.py)
        self.batch_invariant = settings.batch_invariant and not self.is_encoder
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(self.model))
        self.pooling = _gguf_pooling(self.model)
        self.n_seq_max = n_seq_max
        self.eog_ids = frozenset(
            t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)
        )
        self.pieces = self._piece_table()
        self.gguf_chat_template = _gguf_chat_template(self.model)
        self.architecture = _meta(self.model, "general.architecture")
        self.chat = ChatRenderer(
            self.gguf_chat_template,
            bos_token=self._special_text(llama_cpp.llama_vocab_bos(self.vocab)),
            eos_token=self._special_text(llama_cpp.llama_vocab_eos(self.vocab)),
        )
        # Recurrent and hybrid models cannot remove part of a sequence.
        self.supports_partial_removal = not (
            llama_cpp.llama_model_is_recurrent(self.model)
            or llama_cpp.llama_model_is_hybrid(self.model)
        )

    def _wordpiece(self, model_path: str) -> WordPieceTokenizer | None:
        """BERT's own tokenizer for a WordPiece vocabulary (models/tokenizer_wordpiece.py: what
        the exported tokenizer.json gives the gateway), not llama.cpp's, whose normalizer keeps
        a Hangul syllable's leading consonant only and drops spacing marks. A vocabulary it
        cannot be built for keeps llama.cpp's (logged)."""
        if llama_cpp.llama_vocab_type(self.vocab) != llama_cpp.LLAMA_VOCAB_TYPE_WPM:
            return None
        try:
            return WordPieceTokenizer.for_model(model_path)
        except TokenizerExportError as exc:
            log.warning("wordpiece_tokenizer_unavailable", path=model_path, reason=str(exc))
            return None

    def _context_params(self, n_seq_max: int) -> Any:
        s = self.settings
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = s.n_ctx
        params.n_batch = min(s.n_batch, s.n_ctx)
        params.n_ubatch = min(s.n_ubatch, params.n_batch)
        if s.batch_invariant:
            params.n_ubatch = max(2, min(params.n_ubatch, BATCH_INVARIANT_UBATCH))
        if self.is_encoder:  # _load: one pass holds a whole input, up to the trained context
            n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self.model))
            params.n_ctx = min(s.n_ctx, n_ctx_train) if n_ctx_train > 0 else s.n_ctx
            params.n_batch = params.n_ubatch = params.n_ctx
        params.n_seq_max = n_seq_max
        params.kv_unified = True  # slots share all cells; seq_cp only tags cells
        params.swa_full = True  # partial prefix reuse stays correct on sliding-window models
        params.n_threads, params.n_threads_batch = s.threads()
        params.no_perf = True
        # Embedding passes read every token's output and pool them in numpy
        # (core.requests.embedding), whatever the model's own pooling: one context for generation
        # and every pooling.
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        # Measured on Gemma 3 270M (1,800-token prompt): a sequence's logits are bit-identical
        # when recomputed alone, but move by up to ~1.0 (mean ~0.2; argmax unchanged) with the
        # chunk size (flash attention on) or with how many other cells are in use (either way),
        # and identically whether those cells hold the same or unrelated text: kernel-path
        # numerics (F16 accumulation), not a cross-sequence leak. Greedy near-ties can flip.
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
            if s.flash_attn or s.batch_invariant
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        return params

    def _piece_table(self) -> list[bytes]:
        """Each token's bytes (special tokens render empty): one ctypes call per token, once."""
        buf = ctypes.create_string_buffer(256)
        out: list[bytes] = []
        for token in range(self.n_vocab):
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 256, 0, False)
            out.append(buf.raw[:n] if n > 0 else b"")
        return out

    # -- vocabulary (thread-safe) --------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        if self.wordpiece is not None:
            return self.wordpiece.tokenize(
                text, add_special=add_special, parse_special=parse_special
            )
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            out = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), out, capacity, add_special, parse_special
            )
            if n >= 0:
                return list(out[:n])
            capacity = -n

    def detokenize(self, token_ids: Sequence[int], *, render_special: bool) -> str:
        """llama_detokenize's text of the ids as a whole, special tokens kept (as text or as
        nothing). Not the pieces joined: llama.cpp drops the space a SentencePiece vocabulary
        with add_space_prefix (phi-3, llama-spm) puts before the first word, and a BPE
        vocabulary with clean_spaces (llama-bpe: Llama 3) drops the space before . , ? ! and
        some apostrophes, as HuggingFace decode does. Joined pieces differed on both (tests/e2e/
        test_families.py: " Hello world" for phi-3's "Hello world"). The stream's deltas are
        pieces joined (core/requests/text.py): a continuation keeps its spaces."""
        if not token_ids:
            return ""
        tokens = (llama_cpp.llama_token * len(token_ids))(*token_ids)
        capacity = 8 * len(token_ids) + 64
        while True:
            buf = ctypes.create_string_buffer(capacity)
            n = llama_cpp.llama_detokenize(
                self.vocab, tokens, len(token_ids), buf, capacity, False, render_special
            )
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            capacity = -n

    def special_piece(self, token_id: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token_id, buf, 256, 0, True)
        return buf.raw[:n] if n > 0 else b""

    def check_grammar(self, gbnf: str, root: str) -> None:
        """Raise GrammarError (a ValueError) with llama.cpp's message unless it compiles."""
        grammar.check_grammar(self.vocab, gbnf, root)

    def json_schema_to_grammar(self, schema: str) -> str:
        return grammar.json_schema_to_gbnf(schema)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        template: str,
        tools: Sequence[ToolSpec] = (),
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Raise ChatTemplateError (a ValueError) when the template cannot render them."""
        return self.chat.render(messages, template, tools, variables)

    def tool_format(self, template: str) -> str:
        return self.chat.tool_format(template)

    def reasoning_format(self, template: str) -> str:
        return self.chat.reasoning_format(template)

    def _special_text(self, token_id: int) -> str:
        return (
            self.special_piece(token_id).decode("utf-8", errors="replace") if token_id >= 0 else ""
        )

    def info(self, model_name: str) -> ModelInfo:
        bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        return ModelInfo(
            model_name=model_name,
            model_path=self.path,
            n_ctx_train=int(llama_cpp.llama_model_n_ctx_train(self.model)),
            n_ctx=self.n_ctx,
            n_vocab=self.n_vocab,
            bos_token_id=bos if bos >= 0 else None,
            eos_token_id=eos if eos >= 0 else None,
            eog_token_ids=tuple(sorted(self.eog_ids)),
            has_chat_template=bool(self.gguf_chat_template),
            n_parallel=self.n_seq_max,
            n_batch=self.n_batch,
            description=_meta(self.model, "general.name") or Path(self.path).stem,
            size_bytes=int(llama_cpp.llama_model_size(self.model)),
            n_params=int(llama_cpp.llama_model_n_params(self.model)),
            add_bos=bool(llama_cpp.llama_vocab_get_add_bos(self.vocab)),
            n_embd=self.n_embd,
            pooling=self.pooling,
            architecture=self.architecture,
            is_encoder=self.is_encoder,
            chat_template=template_in_use(
                self.settings.chat_template, bool(self.gguf_chat_template), self.architecture
            ),
            chat_template_origin=template_origin(
                self.settings.chat_template, bool(self.gguf_chat_template), self.architecture
            ),
        )

    def vocab_view(self) -> VocabView:
        """The vocabulary as a draft model's must match it (core.speculation.draft_model):
        the token count, every token's text and the special ids."""
        v = self.vocab
        special = {name: int(getattr(llama_cpp, f"llama_vocab_{name}")(v)) for name in _SPECIAL_IDS}
        special["add_bos"] = int(bool(llama_cpp.llama_vocab_get_add_bos(v)))
        texts = [bytes(llama_cpp.llama_vocab_get_text(v, t) or b"") for t in range(self.n_vocab)]
        return VocabView(self.n_vocab, texts, special)

    def kv_fingerprint(self, model_sha256: str) -> dict[str, object]:
        """Everything that decides what a saved sequence state means: a disk-tier file made under
        any other value is never restored here (kv_disk.py)."""
        params = self._context_params(self.n_seq_max)
        return {
            "model_sha256": model_sha256,
            "n_ctx": self.n_ctx,
            "type_k": int(params.type_k),
            "type_v": int(params.type_v),
            "flash_attn": self.settings.flash_attn,
            # the mode's kernels compute other bits: its KV is not the default's
            "batch_invariant": self.settings.batch_invariant,
            "swa_full": bool(params.swa_full),
            "kv_unified": bool(params.kv_unified),
            "n_gpu_layers": self.settings.n_gpu_layers,
            "llama_cpp_python": llama_cpp.__version__,
        }

    # -- engine thread only ----------------------------------------------------------------------

    def set_threads(self, n_threads: int, n_threads_batch: int) -> None:
        """Threads of the next forward passes (llama_set_n_threads: no reallocation)."""
        llama_cpp.llama_set_n_threads(self.ctx, n_threads, n_threads_batch)

    def current_threads(self) -> tuple[int, int]:
        """(generation, prompt) threads the context decodes with now."""
        return int(llama_cpp.llama_n_threads(self.ctx)), int(
            llama_cpp.llama_n_threads_batch(self.ctx)
        )

    # -- memory (engine thread only) -------------------------------------------------------------

    def seq_remove(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        return bool(llama_cpp.llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def seq_copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        llama_cpp.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def seq_save(self, seq_id: int) -> bytes:
        """The sequence's KV state as bytes (llama_state_seq_get_data), for the RAM tier."""
        size = int(llama_cpp.llama_state_seq_get_size(self.ctx, seq_id))
        if size <= 0:
            return b""
        buf = (ctypes.c_uint8 * size)()
        n = int(llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, seq_id))
        return ctypes.string_at(buf, n)

    def seq_restore(self, seq_id: int, data: bytes) -> bool:
        """Load a saved state into an empty sequence; False when llama.cpp finds no room."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(llama_cpp.llama_state_seq_set_data(self.ctx, buf, len(data), seq_id)) > 0

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None


def _batch_invariant_kernels(n_gpu_layers: int) -> None:
    """The mode's process-wide ggml settings, before this process's first forward pass (ggml
    reads them once); a process that has run one already keeps what it read."""
    os.environ.pop("GGML_CPU_TILED_MM_FORCE", None)
    os.environ.update(BATCH_INVARIANT_ENV)
    if n_gpu_layers != 0:
        log.warning(
            "batch_invariant_cpu_only",
            n_gpu_layers=n_gpu_layers,
            reason="the mode sets llama.cpp's CPU kernels; offloaded layers keep the GPU's",
        )


# the special ids a draft model must share with its target (llama_vocab_<name>)
_SPECIAL_IDS = ("bos", "eos", "eot", "sep", "nl", "pad", "fim_pre", "fim_suf", "fim_mid")


# llama.cpp's enum llama_pooling_type by value, as core.requests.embedding names them
_POOLINGS = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def _gguf_pooling(model: Any) -> str:
    """The GGUF's `<arch>.pooling_type` by name ("" when the file has none, as generation
    models do)."""
    arch = _meta(model, "general.architecture")
    value = _meta(model, f"{arch}.pooling_type") if arch else ""
    return _POOLINGS.get(int(value), "") if value.lstrip("-").isdigit() else ""


def _gguf_chat_template(model: Any) -> str:
    """The Jinja chat template stored in the GGUF file ("" when it has none)."""
    template = llama_cpp.llama_model_chat_template(model, None)
    return template.decode("utf-8", errors="replace") if template else ""
