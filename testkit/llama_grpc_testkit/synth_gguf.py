"""A Gemma 3 GGUF with random weights, for benchmarks where nothing large may travel (the GPU
machine fetches nothing): written here in f16 (norms f32), then quantized with llama-quantize
from the same llama.cpp tree if asked. A forward pass costs the same whatever the weights are, so
its timings stand for a real model of the same shape; its outputs are noise, so benchmarks run
with ignore_eos and token-id prompts.

The vocabulary is synthetic but complete for llama.cpp's SentencePiece ("llama") tokenizer, laid
out like Gemma 3's: <pad> 0, <eos> 1, <bos> 2, <unk> 3, the 256 byte tokens, then pieces "▁a",
"▁b", ..., with descending scores, so text tokenizes (bytes at worst) and every id detokenizes.

    python -m llama_grpc_testkit.synth_gguf --shape 270m --out /tmp/g270m-f16.gguf \\
        --quantize build/bin/llama-quantize            # -> /tmp/g270m-q4_k_m.gguf
    python -m llama_grpc_testkit.synth_gguf --shape tiny --out /tmp/tiny.gguf   # for tests

Shapes: `270m` is the embedded Gemma 3 270M's (hyperparameters read off its GGUF), `1b` Gemma 3
1B's (~1.0 B parameters, 262,144-token vocabulary), `tiny` a few hundred kB for tests.

The tests' tiny model is the counting model (`counting_model()`, `write_counting`): the
`counting` shape with weights set, not drawn, so that its greedy next token is always
`successor(last token)` ("▁a" "▁b" "▁c" ...) by a margin of 10+ nats, whatever the batch: tests
that compare outputs token for token, or need streams in flight, get exact answers for
microseconds a pass. Its vocabulary ends with "▁" and the letters, so the tokenizer export
(SMG) takes it:

    python -m llama_grpc_testkit.synth_gguf --counting --out /tmp/counting.gguf

Families (`FAMILIES`): tiny random-weight models of real model families, each with its llama.cpp
architecture (tensor names and hyperparameter keys of the pinned llama.cpp's
`src/models/<arch>.cpp`), every `tokenizer.ggml.*` key of the family's real vocabulary GGUF and
its real chat template (both from llama.cpp's own test data, `llama_sdist.py` beside this module).
`family_model(name)` writes one once per machine under ~/.cache/llama-grpc/test-models/:

    python -m llama_grpc_testkit.synth_gguf --family qwen3 --out /tmp/qwen3.gguf

An encoder (`bert_model(pooling)`, cached the same way): a tiny random-weight BERT (arch
`bert`, non-causal, `bert.pooling_type`) with the real `ggml-vocab-bert-bge.gguf` vocabulary,
an encoder-only embedding model for the tests:

    python -m llama_grpc_testkit.synth_gguf --bert cls --out /tmp/bert.gguf"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ARCH = "gemma3"
PAD, EOS, BOS, UNK = 0, 1, 2, 3
FIRST_BYTE = 4  # <0x00> .. <0xFF>
FIRST_PIECE = FIRST_BYTE + 256  # ordinary pieces from here: prompts may use any id >= this
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_BYTE = 1, 2, 3, 6
WEIGHT_STD = 0.02
POOL = 1 << 22  # random values drawn once; each matrix takes them from a random offset


@dataclasses.dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int = 32768
    sliding_window: int = 512

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, numpy shape) in file order; numpy shapes are GGUF's reversed ([rows, cols])."""
        q, kv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        out = [("token_embd.weight", (self.n_vocab, self.n_embd)),
               ("output_norm.weight", (self.n_embd,))]  # fmt: skip
        for i in range(self.n_layer):
            b = f"blk.{i}."
            out += [
                (b + "attn_norm.weight", (self.n_embd,)),
                (b + "attn_q.weight", (q, self.n_embd)),
                (b + "attn_k.weight", (kv, self.n_embd)),
                (b + "attn_v.weight", (kv, self.n_embd)),
                (b + "attn_q_norm.weight", (self.head_dim,)),
                (b + "attn_k_norm.weight", (self.head_dim,)),
                (b + "attn_output.weight", (self.n_embd, q)),
                (b + "post_attention_norm.weight", (self.n_embd,)),
                (b + "ffn_norm.weight", (self.n_embd,)),
                (b + "ffn_gate.weight", (self.n_ff, self.n_embd)),
                (b + "ffn_up.weight", (self.n_ff, self.n_embd)),
                (b + "ffn_down.weight", (self.n_embd, self.n_ff)),
                (b + "post_ffw_norm.weight", (self.n_embd,)),
            ]
        return out

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.tensors())


SHAPES = {
    # gemma-3-270m's GGUF: 640 wide, 18 layers, 4 heads / 1 KV head of 256, FFN 2048
    "270m": Shape(640, 18, 4, 1, 256, 2048, 262144),
    # Gemma 3 1B: 1152 wide, 26 layers, 4 heads / 1 KV head of 256, FFN 6912
    "1b": Shape(1152, 26, 4, 1, 256, 6912, 262144),
    "tiny": Shape(64, 2, 2, 1, 32, 128, 1024, n_ctx_train=4096, sliding_window=64),
    # the counting model's (write_counting): wider, for wider margins (random rows of 128 are
    # closer to orthogonal than rows of 64)
    "counting": Shape(128, 2, 2, 1, 64, 256, 1024, n_ctx_train=4096, sliding_window=64),
}


ALPHABET = "abcdefghijklmnopqrstuvwxyz"
# The counting model's vocabulary ends with "▁" and the letters, so that every piece is a merge of
# two tokens ("▁ab" = "▁a" + "b") and the tokenizer export (a BPE model) can say so.
LETTERS = ("\u2581", *ALPHABET)


def vocabulary(n_vocab: int, letters: bool = False) -> tuple[list[bytes], list[float], list[int]]:
    tail = list(LETTERS) if letters else []
    if n_vocab < FIRST_PIECE + len(tail) + 1:
        raise ValueError(f"n_vocab must be at least {FIRST_PIECE + len(tail) + 1}")
    tokens = [b"<pad>", b"<eos>", b"<bos>", b"<unk>"]
    types = [TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_UNKNOWN]
    tokens += [f"<0x{b:02X}>".encode() for b in range(256)]
    types += [TOKEN_BYTE] * 256
    n_words = n_vocab - FIRST_PIECE - len(tail)
    for i in range(n_words):
        word, n = "", i
        while True:  # bijective base 26: a .. z, aa .. zz, aaa ..
            word = ALPHABET[n % 26] + word
            n = n // 26 - 1
            if n < 0:
                break
        tokens.append(("\u2581" + word).encode())
        types.append(TOKEN_NORMAL)
    tokens += [t.encode() for t in tail]
    types += [TOKEN_NORMAL] * len(tail)
    scores = [0.0] * FIRST_PIECE + [-float(i) for i in range(n_vocab - FIRST_PIECE)]
    return tokens, scores, types


def write(shape: Shape, path: Path, seed: int = 0) -> None:
    writer = _gemma3_writer(
        shape, path, f"synthetic gemma3 {shape.n_params / 1e6:.0f}M (random weights)"
    )
    tensors = shape.tensors()
    _tensor_infos(writer, tensors)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL, dtype=np.float32) * WEIGHT_STD).astype(np.float16)
    for _, dims in tensors:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        n = int(np.prod(dims))
        start = int(rng.integers(POOL))
        writer.write_tensor_data(np.resize(np.roll(pool, -start), n).reshape(dims))
    writer.close()


def _gemma3_writer(shape: Shape, path: Path, name: str, letters: bool = False) -> Any:
    """A GGUF writer with every key of a Gemma 3 of `shape` and the synthetic vocabulary."""
    import gguf

    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_name(name)
    _shape_keys(writer, shape)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(shape.sliding_window)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, scores, types = vocabulary(shape.n_vocab, letters)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(UNK)
    writer.add_pad_token_id(PAD)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    return writer


def _tensor_infos(writer: Any, tensors: list[tuple[str, tuple[int, ...]]]) -> None:
    """Declare the tensors (vectors f32, matrices f16) and write everything before their data."""
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        n_bytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), n_bytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()


# -- a counting model: the tests' tiny model, whose greedy output is known ------------------------

# The block outputs' post-norm weight: each block adds a vector of RMS 0.02 to a residual of RMS
# ~8 (the embedding row, RMS ~1, times Gemma's sqrt(n_embd)), so attention and the FFN run on
# the real KV cache but cannot move the argmax.
COUNTING_BLOCK_GAIN = 0.02
# The output rows' scale: the right next token's logit is ~COUNTING_LOGIT_SCALE * n_embd (16
# for 64 wide); a wrong one's is a dot product of two random rows, ~N(0, scale^2 * n_embd).
COUNTING_LOGIT_SCALE = 0.25


def successor(token: int, n_vocab: int) -> int:
    """The counting model's greedy next token after `token`: the next word piece ("▁a", "▁b",
    ..., the last wraps to the first); any other token t (control, byte, letter) is followed by
    the word piece FIRST_PIECE + t % (the number of word pieces). Never EOS: a stream runs to
    max_tokens, and its text is words (" a b c ...") that tokenize back to the same ids."""
    n_words = n_vocab - FIRST_PIECE - len(LETTERS)
    if FIRST_PIECE <= token < FIRST_PIECE + n_words:
        return FIRST_PIECE + (token - FIRST_PIECE + 1) % n_words
    return FIRST_PIECE + token % n_words


def write_counting(shape: Shape, path: Path, seed: int = 0) -> None:
    """A Gemma 3 of `shape` whose greedy next token is successor(last token), by a margin of
    several nats whatever came before: a forward pass costs what the random `tiny` one does, but
    its output is known and does not change with the batch (the random model's top-2 margins
    are hundredths of a nat, so batching alone changes its greedy text). The embedding rows are
    random (RMS 1), an untied output matrix (`output.weight`, which llama.cpp's Gemma 3 reads
    when present) maps row t to successor(t); attention and the FFN are random, damped by their
    post-norms (COUNTING_BLOCK_GAIN), so a pass still reads and writes the KV cache."""
    writer = _gemma3_writer(
        shape, path, "synthetic gemma3 counting model (successor weights)", letters=True
    )
    tensors = [*shape.tensors(), ("output.weight", (shape.n_vocab, shape.n_embd))]
    _tensor_infos(writer, tensors)
    rng = np.random.default_rng(seed)
    embd = rng.standard_normal((shape.n_vocab, shape.n_embd), dtype=np.float32)
    embd /= np.sqrt(np.mean(embd**2, axis=1, keepdims=True))  # every row RMS 1
    output = np.zeros_like(embd)
    for token in range(shape.n_vocab):
        output[successor(token, shape.n_vocab)] += COUNTING_LOGIT_SCALE * embd[token]
    for name, dims in tensors:
        if name == "token_embd.weight":
            data = embd
        elif name == "output.weight":
            data = output
        elif name.endswith(("post_attention_norm.weight", "post_ffw_norm.weight")):
            data = np.full(dims, COUNTING_BLOCK_GAIN, dtype=np.float32)
        elif len(dims) == 1:
            data = np.ones(dims, dtype=np.float32)
        else:
            data = rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD
        writer.write_tensor_data(data.astype(np.float32 if len(dims) == 1 else np.float16))
    writer.close()


def counting_model() -> Path:
    """The `tiny` counting model (write_counting), written once per machine like shape_model's:
    the tests' tiny model."""
    return _cached("gemma3-counting", lambda tmp: write_counting(SHAPES["counting"], tmp))


# -- families: real vocabularies and templates on tiny random-weight models ----------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family as the tests and the gateway see it. `vocabulary` and `template` name files
    of llama.cpp's test data (llama_sdist.vocab_path / llama_sdist.template); both empty means
    the embedded Gemma 3 270M itself, real weights and vocabulary, whose file has no chat
    template: the server renders its `messages` with the built-in `server_template`."""

    name: str
    architecture: str  # general.architecture: llama.cpp's model class and tensor layout
    vocabulary: str
    template: str
    end_of_turn: tuple[str, ...]  # the texts of the tokens that end an assistant turn
    note: str = ""
    server_template: str = ""  # the server's --chat-template for it ("": the file's own)
    # (door, what holds there instead) where a door of DOORS does not simply work; the tests
    # of that door assert what the text says instead, and docs/families.md shows it
    limits: tuple[tuple[str, str], ...] = ()

    def limit(self, door: str) -> str | None:
        if door not in DOORS:
            raise KeyError(door)
        return dict(self.limits).get(door)


# The doors every family is tested through (door -> its column in docs/families.md): the
# tokenizer export (tests/model/test_tokenizer_vocabs.py, by vocabulary), the v1 API
# (tests/e2e/test_families.py) and `make gateway` with the OpenAI SDK
# (tests/e2e/test_gateway_families.py).
DOORS: dict[str, str] = {
    "export": "tokenizer export",
    "tokenize": "v1 Tokenize, Detokenize",
    "messages": "v1 messages (its template)",
    "generate_tokens": "v1 GenerateTokens",
    "end_of_turn": "end of turn ends a stream",
    "v1_tools": "v1 tools: its call format streamed as a call, a named call, a tool result",
    "v1_reasoning": "v1 reasoning: thinking streamed apart, budget N and 0, a constraint after "
    "thinking",
    "gateway_chat": "gateway chat: stream, stop, usage",
    "gateway_forced_tools": "gateway tool_choice required / named (thinking on), json_schema",
    "gateway_own_tools": "gateway tool call in its own format",
}


# DeepSeek's end of sentence, spelled with FULLWIDTH VERTICAL LINE (U+FF5C) and U+2581
DEEPSEEK_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("gemma3", "gemma3", "", "", ("<end_of_turn>",),
               "the embedded Gemma 3 270M itself (real weights and vocabulary); its file has no "
               "chat template: the server's built-in gemma one", server_template="gemma"),
        Family("qwen3", "qwen3", "qwen2", "Qwen-Qwen3-0.6B", ("<|im_end|>",),
               limits=(("v1_reasoning",
                        "✔ budget 0 and constraints; its model opens its thinking itself, which "
                        "these random weights never do unconstrained (a constraint makes it: its "
                        "grammar begins with the section)"),)),
        Family("qwen35", "qwen35", "qwen35", "Qwen3.5-4B", ("<|im_end|>",),
               "the real hybrid architecture: gated delta-net layer 0, attention layer 1"),
        Family("llama3", "llama", "llama-bpe", "meta-llama-Llama-3.2-3B-Instruct",
               ("<|eot_id|>",),
               "llama-bpe is Llama 3.0's vocabulary: no `<|eom_id|>` (3.1's 128008 is "
               "`<|reserved_special_token_4|>` here), so only `<|eot_id|>` ends a turn"),
        Family("deepseek-r1-distill", "llama", "deepseek-llm",
               "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", (DEEPSEEK_EOS,),
               "neither R1-Distill template's User and Assistant markers is a token of the "
               "deepseek-llm vocabulary (the real distills add them): they tokenize as text; "
               "its BOS and end of sentence are tokens"),
        Family("phi3", "phi3", "phi-3", "microsoft-Phi-3.5-mini-instruct", ("<|end|>",),
               "special tokens eat the whitespace after them (llama.cpp: RSTRIP when "
               "general.name has phi3), so the template's newlines vanish",
               limits=(("export",
                        "✔ but a non-ASCII space right after a special token is stripped "
                        "(llama.cpp strips ASCII only; docs/models.md)"),)),
        Family("gemma4", "gemma4", "gemma-4", "google-gemma-4-31B-it", ("<turn|>",),
               "layer 0 sliding-window, layer 1 global",
               limits=(("gateway_forced_tools",
                        "✔ unconstrained: SMG 1.13's gemma4 parser sends no constraint and "
                        "reads the call from the model's own format (forced here by a regex)"),)),
    )
}  # fmt: skip

# Every family's layers: 64 wide, 2 layers, 2 heads of 32 (1 KV head), FFN 128; the vocabulary
# (32,064 to 262,144 tokens) is the size: 4 to 32 MiB of f16 embeddings, tied to the output.
FAMILY_SHAPE = Shape(64, 2, 2, 1, 32, 128, 0, n_ctx_train=4096, sliding_window=64)
# qwen35's gated delta-net (linear attention) layer: 2 key heads and 2 value heads of 16
SSM_STATE, SSM_HEADS, SSM_CONV = 16, 2, 4

Tensor = tuple[str, tuple[int, ...], float | None]  # name, numpy shape, constant (None: random)


def _attention(b: str, s: Shape, *, q_gate: bool = False) -> list[Tensor]:
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    return [(b + "attn_q.weight", (q * (2 if q_gate else 1), s.n_embd), None),
            (b + "attn_k.weight", (kv, s.n_embd), None),
            (b + "attn_v.weight", (kv, s.n_embd), None),
            (b + "attn_output.weight", (s.n_embd, q), None)]  # fmt: skip


def _qk_norms(b: str, s: Shape) -> list[Tensor]:
    return [(b + "attn_q_norm.weight", (s.head_dim,), 1.0),
            (b + "attn_k_norm.weight", (s.head_dim,), 1.0)]  # fmt: skip


def _ffn(b: str, s: Shape) -> list[Tensor]:
    return [(b + "ffn_gate.weight", (s.n_ff, s.n_embd), None),
            (b + "ffn_up.weight", (s.n_ff, s.n_embd), None),
            (b + "ffn_down.weight", (s.n_embd, s.n_ff), None)]  # fmt: skip


def _delta_net(b: str, s: Shape) -> list[Tensor]:
    """qwen35's linear-attention layer (src/models/qwen35.cpp): A = -1 so the state decays."""
    dim = SSM_STATE * SSM_HEADS  # key_dim = value_dim
    return [(b + "attn_qkv.weight", (3 * dim, s.n_embd), None),
            (b + "attn_gate.weight", (dim, s.n_embd), None),
            (b + "ssm_conv1d.weight", (3 * dim, SSM_CONV), None),
            (b + "ssm_dt.bias", (SSM_HEADS,), 0.0),
            (b + "ssm_a", (SSM_HEADS,), -1.0),
            (b + "ssm_beta.weight", (SSM_HEADS, s.n_embd), None),
            (b + "ssm_alpha.weight", (SSM_HEADS, s.n_embd), None),
            (b + "ssm_norm.weight", (SSM_STATE,), 1.0),
            (b + "ssm_out.weight", (s.n_embd, dim), None)]  # fmt: skip


def _layer(arch: str, i: int, s: Shape) -> list[Tensor]:
    b, e = f"blk.{i}.", s.n_embd
    norm = [(b + "attn_norm.weight", (e,), 1.0)]
    ffn_norm = [(b + "ffn_norm.weight", (e,), 1.0)]
    if arch == "llama":
        return norm + _attention(b, s) + ffn_norm + _ffn(b, s)
    if arch == "qwen3":
        return norm + _attention(b, s) + _qk_norms(b, s) + ffn_norm + _ffn(b, s)
    if arch == "phi3":  # fused QKV, fused gate+up (n_ff each); Q is n_embd wide
        qkv = s.n_embd + 2 * s.n_head_kv * s.head_dim
        return [*norm, (b + "attn_qkv.weight", (qkv, e), None),
                (b + "attn_output.weight", (e, e), None), *ffn_norm,
                (b + "ffn_up.weight", (2 * s.n_ff, e), None),
                (b + "ffn_down.weight", (e, s.n_ff), None)]  # fmt: skip
    if arch == "gemma4":
        post = [(b + "post_attention_norm.weight", (e,), 1.0)]
        ffw_post = [(b + "post_ffw_norm.weight", (e,), 1.0)]
        return norm + _attention(b, s) + _qk_norms(b, s) + post + ffn_norm + _ffn(b, s) + ffw_post
    if arch == "qwen35":
        post = [(b + "post_attention_norm.weight", (e,), 1.0)]
        mixer = _delta_net(b, s) if i % 2 == 0 else _attention(b, s, q_gate=True) + _qk_norms(b, s)
        return norm + post + mixer + _ffn(b, s)
    raise ValueError(f"no tensor layout for architecture {arch!r}")


def family_tensors(arch: str, shape: Shape) -> list[Tensor]:
    out: list[Tensor] = [("token_embd.weight", (shape.n_vocab, shape.n_embd), None),
                         ("output_norm.weight", (shape.n_embd,), 1.0)]  # fmt: skip
    if arch == "gemma4":  # the global layers' proportional-RoPE factors, shared by all of them
        out.append(("rope_freqs.weight", (shape.head_dim // 2,), 1.0))
    for i in range(shape.n_layer):
        out += _layer(arch, i, shape)
    return out


def _shape_keys(writer: Any, s: Shape) -> None:
    """The shape's keys, which every architecture's load_hparams reads."""
    writer.add_context_length(s.n_ctx_train)
    writer.add_embedding_length(s.n_embd)
    writer.add_block_count(s.n_layer)
    writer.add_feed_forward_length(s.n_ff)
    writer.add_head_count(s.n_head)
    writer.add_head_count_kv(s.n_head_kv)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)


def _hyperparameters(writer: Any, arch: str, s: Shape) -> None:
    """The keys llama.cpp's load_hparams and the architecture's load_arch_hparams read."""
    _shape_keys(writer, s)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    if arch == "llama":
        writer.add_vocab_size(s.n_vocab)
    if arch == "gemma4":
        writer.add_sliding_window(s.sliding_window)
        writer.add_sliding_window_pattern([i % 2 == 0 for i in range(s.n_layer)])
        writer.add_uint32(f"{arch}.embedding_length_per_layer_input", 0)
        writer.add_uint32(f"{arch}.attention.shared_kv_layers", 0)
        writer.add_uint32(f"{arch}.attention.key_length_swa", s.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length_swa", s.head_dim)
        writer.add_rope_dimension_count_swa(s.head_dim)
        writer.add_float32(f"{arch}.rope.freq_base_swa", 1e4)
        writer.add_final_logit_softcapping(30.0)
    if arch == "qwen35":
        writer.add_rope_dimension_sections([6, 5, 5, 0])  # sums to head_dim / 2
        writer.add_ssm_conv_kernel(SSM_CONV)
        writer.add_ssm_inner_size(SSM_STATE * SSM_HEADS)
        writer.add_ssm_state_size(SSM_STATE)
        writer.add_ssm_time_step_rank(SSM_HEADS)
        writer.add_ssm_group_count(SSM_HEADS)
        writer.add_uint32(f"{arch}.full_attention_interval", 2)


# GGUF metadata value types (gguf.GGUFValueType: not imported here, the module imports gguf
# lazily): strings and arrays; the others are fixed-size scalars, sized by _gguf_scalar_bytes.
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@functools.cache
def _gguf_scalar_bytes() -> dict[int, int]:
    """Each fixed-size GGUF value type's size in bytes, from gguf's numpy type for it."""
    import gguf

    assert (_GGUF_STRING, _GGUF_ARRAY) == (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)
    scalars = gguf.GGUFReader.gguf_scalar_to_np.items()
    return {kind.value: np.dtype(scalar).itemsize for kind, scalar in scalars}


class RawValue(bytes):
    """A metadata value's encoded bytes (what follows its type), copied from another GGUF."""


def _skip_value(data: memoryview, pos: int, kind: int) -> int:
    """The offset just past a value of type `kind` at `pos` (GGUF v3, little-endian)."""
    if kind == _GGUF_STRING:
        return pos + 8 + int.from_bytes(data[pos : pos + 8], "little")
    if kind != _GGUF_ARRAY:
        return pos + _gguf_scalar_bytes()[kind]
    element = int.from_bytes(data[pos : pos + 4], "little")
    count = int.from_bytes(data[pos + 4 : pos + 12], "little")
    pos += 12
    if element not in (_GGUF_STRING, _GGUF_ARRAY):
        return pos + count * _gguf_scalar_bytes()[element]
    for _ in range(count):
        pos = _skip_value(data, pos, element)
    return pos


def tokenizer_keys(vocab: Path) -> list[tuple[str, int, RawValue]]:
    """Every tokenizer.ggml.* key of a GGUF file as (key, type, the value's bytes), read raw: the
    gguf package's GGUFReader takes ~15 s over gemma-4's 777,000 strings, this ~0.5 s."""
    out: list[tuple[str, int, RawValue]] = []
    data = memoryview(vocab.read_bytes())
    if bytes(data[:4]) != b"GGUF" or int.from_bytes(data[4:8], "little") != 3:
        raise ValueError(f"{vocab}: not a GGUF v3 file")
    n_kv, pos = int.from_bytes(data[16:24], "little"), 24
    for _ in range(n_kv):
        key_end = pos + 8 + int.from_bytes(data[pos : pos + 8], "little")
        key = bytes(data[pos + 8 : key_end]).decode()
        kind = int.from_bytes(data[key_end : key_end + 4], "little")
        start = key_end + 4
        pos = _skip_value(data, start, kind)
        if key.startswith("tokenizer.ggml."):
            out.append((key, kind, RawValue(data[start:pos])))
    return out


def _gguf_writer(path: Path, arch: str) -> Any:
    """gguf's writer, writing RawValue bytes as they are (its own packing of a 500,000-string
    array takes seconds)."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val: Any, vtype: Any, add_vtype: bool, sub_type: Any = None) -> bytes:
            if isinstance(val, RawValue):
                return (self._pack("I", vtype) if add_vtype else b"") + bytes(val)
            return bytes(super()._pack_val(val, vtype, add_vtype, sub_type))

    return Writer(str(path), arch)


def _copy_tokenizer(writer: Any, vocab: Path) -> int:
    """Every tokenizer.ggml.* key of the vocabulary GGUF, byte for byte; returns the vocabulary
    size."""
    import gguf

    n_vocab = 0
    for key, kind, raw in tokenizer_keys(vocab):
        writer.add_key_value(key, raw, gguf.GGUFValueType(kind))
        if key == "tokenizer.ggml.tokens":
            n_vocab = int.from_bytes(raw[4:12], "little")
    return n_vocab


def write_family(family: Family, path: Path, seed: int = 0) -> None:
    """A tiny random-weight model of `family` (not gemma3: that one is the embedded model)."""
    import gguf

    from llama_grpc_testkit import llama_sdist

    if not family.vocabulary:
        raise ValueError(f"{family.name} is the embedded model: nothing to write")
    writer = _gguf_writer(path, family.architecture)
    # The name is not decoration: llama.cpp's vocabulary load (llama-vocab.cpp) gives every
    # special token the RSTRIP attribute when general.name, lowercased, contains "phi-3" or
    # "phi3", so "<|user|>\nHi" tokenizes as "<|user|>" "Hi" (as HF's added tokens do for
    # Phi-3). phi-3's vocabulary GGUF is named "Phi3"; "synthetic phi3" keeps that behaviour.
    # (A real Phi-3.5 GGUF named "Phi 3.5 Mini Instruct" would not get it.)
    writer.add_name(f"synthetic {family.name} (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = _copy_tokenizer(writer, llama_sdist.vocab_path(family.vocabulary))
    writer.add_chat_template(llama_sdist.template(family.template))
    shape = dataclasses.replace(FAMILY_SHAPE, n_vocab=n_vocab)
    _hyperparameters(writer, family.architecture, shape)
    _write_tensors(writer, family_tensors(family.architecture, shape), seed)


def _write_tensors(writer: Any, tensors: list[Tensor], seed: int) -> None:
    """f16 matrices of random values, f32 vectors of constants (and the f32 tensors ggml needs:
    the convolution of ggml_ssm_conv, BERT's token types that ggml_add adds as they are)."""

    def dtype(name: str, dims: tuple[int, ...]) -> type:
        f32 = len(dims) == 1 or "ssm_conv1d" in name or name == "token_types.weight"
        return np.float32 if f32 else np.float16

    for name, dims, _ in tensors:
        n_bytes = int(np.prod(dims)) * np.dtype(dtype(name, dims)).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype(name, dims)), n_bytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(POOL, dtype=np.float32) * WEIGHT_STD
    for name, dims, fill in tensors:
        kind = dtype(name, dims)
        if fill is not None:
            writer.write_tensor_data(np.full(dims, fill, dtype=kind))
            continue
        start = int(rng.integers(POOL))
        data = np.resize(np.roll(pool, -start), int(np.prod(dims))).reshape(dims)
        writer.write_tensor_data(data.astype(kind))
    writer.close()


def doors_table() -> str:
    """Which door each family goes through, as docs/families.md's second table: ✔, or what
    holds instead (Family.limits; ✘ where it does not), and the SMG parsers `make gateway`
    picks from its template (deploy/smg_parsers.py)."""
    from deploy import smg_parsers  # the repository root's deploy/: run from the root

    from llama_grpc_server.core.reasoning.formats import reasoning_format_for
    from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES
    from llama_grpc_server.core.tools import formats

    rows = [
        "| family | "
        + " | ".join(DOORS.values())
        + " | v1 tool format | thinking | SMG parsers (tool, reasoning) |",
        "| --- |" + " --- |" * (len(DOORS) + 3),
    ]
    for f in FAMILIES.values():
        template = BUILTIN_TEMPLATES[f.server_template] if f.server_template else None
        if template is None:
            from llama_grpc_testkit import llama_sdist

            template = llama_sdist.template(f.template)
        parsers = smg_parsers.choose(template)
        cells = [f"`{f.name}`"]
        cells += [f.limit(door) or "✔" for door in DOORS]
        cells.append(f"`{formats.format_for(template).name}`")
        thinks = reasoning_format_for(template)
        cells.append(f"`{thinks.name}`" if thinks else "none")
        cells.append(f"`{parsers.tool}`, `{parsers.reasoning}`")
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def families_table() -> str:
    """FAMILIES as the Markdown table of docs/families.md (`--families-table` prints it)."""
    rows = [
        "| family | architecture | vocabulary | chat template | end of turn | notes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in FAMILIES.values():
        vocabulary = f"`ggml-vocab-{f.vocabulary}.gguf`" if f.vocabulary else "the embedded model's"
        template = f"`{f.template}.jinja`" if f.template else f"built-in `{f.server_template}`"
        ends = ", ".join(f"`{text}`" for text in f.end_of_turn)
        cells = (f"`{f.name}`", f"`{f.architecture}`", vocabulary, template, ends, f.note)
        # GitHub ends a table cell at any unescaped |, even inside backticks
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def models_dir() -> Path:
    """Where built test models are kept between sessions (models.built_models_dir)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "llama-grpc" / "test-models"


def family_model(name: str) -> Path:
    """The model file of family `name`: the embedded model for gemma3, else a synthetic one
    written once per machine, keyed by this generator's source (and so its shapes, layouts and
    the pinned llama.cpp's test data it reads); the write is atomic (temp file + rename)."""
    family = FAMILIES[name]
    if not family.vocabulary:
        from llama_grpc_server.models.files import default_model_path

        return Path(default_model_path())
    return _cached(f"family-{name}", lambda tmp: write_family(family, tmp))


def shape_model(name: str) -> Path:
    """The Gemma 3 model of shape `name` (SHAPES: `tiny` for tests, whose forward pass costs
    microseconds), written once per machine like family_model's."""
    shape = SHAPES[name]
    return _cached(f"gemma3-{name}", lambda tmp: write(shape, tmp))


def _cached(stem: str, write_to: Callable[[Path], None]) -> Path:
    """models_dir()/<stem>-<key>.gguf, written by `write_to` (into a temp file, then renamed)
    unless there; the key is this generator's source and the pinned llama.cpp's version."""
    from llama_grpc_testkit import llama_sdist

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(llama_sdist.VERSION.encode())
    path = models_dir() / f"{stem}-{digest.hexdigest()[:16]}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write_to(tmp)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


# -- an encoder: a random-weight BERT for embeddings ---------------------------------------------

# bge-small's layout (llama.cpp's src/models/bert.cpp: learned positions, post-norm layers, GELU
# FFN, biases everywhere), 64 wide, 2 layers of 2 heads, FFN 128, 512 positions; the
# `ggml-vocab-bert-bge.gguf` vocabulary (WordPiece, 30,522 tokens; 4 MiB of f16 embeddings).
BERT_SHAPE = Shape(64, 2, 2, 2, 32, 128, 0, n_ctx_train=512)
# llama.cpp's enum llama_pooling_type: bge-* pool the [CLS] token's output
BERT_POOLING = {"mean": 1, "cls": 2, "last": 3}


def bert_tensors(s: Shape) -> list[Tensor]:
    """llama_model_bert::load_arch_tensors's tensors: norms' weights 1, biases 0."""
    e = s.n_embd

    def norm(name: str) -> list[Tensor]:
        return [(name + ".weight", (e,), 1.0), (name + ".bias", (e,), 0.0)]

    out: list[Tensor] = [("token_embd.weight", (s.n_vocab, e), None),
                         ("token_types.weight", (2, e), None),
                         ("position_embd.weight", (s.n_ctx_train, e), None),
                         *norm("token_embd_norm")]  # fmt: skip
    for i in range(s.n_layer):
        b = f"blk.{i}."
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            out += [(b + proj + ".weight", (e, e), None), (b + proj + ".bias", (e,), 0.0)]
        out += norm(b + "attn_output_norm")
        out += [(b + "ffn_up.weight", (s.n_ff, e), None),
                (b + "ffn_up.bias", (s.n_ff,), 0.0),
                (b + "ffn_down.weight", (e, s.n_ff), None),
                (b + "ffn_down.bias", (e,), 0.0)]  # fmt: skip
        out += norm(b + "layer_output_norm")
    return out


def write_bert(path: Path, pooling: str = "cls", seed: int = 0) -> None:
    """A tiny random-weight BERT (arch `bert`, non-causal, `bert.pooling_type` = `pooling`) with
    the real bert-bge vocabulary: an encoder-only embedding model."""
    import gguf

    from llama_grpc_testkit import llama_sdist

    writer = _gguf_writer(path, "bert")
    writer.add_name("synthetic bert-bge (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = _copy_tokenizer(writer, llama_sdist.vocab_path("bert-bge"))
    s = dataclasses.replace(BERT_SHAPE, n_vocab=n_vocab)
    _shape_keys(writer, s)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(BERT_POOLING[pooling]))
    _write_tensors(writer, bert_tensors(s), seed)


def bert_model(pooling: str = "cls") -> Path:
    """The BERT model file (write_bert), written once per machine as family_model does."""
    return _cached(f"bert-{pooling}", lambda tmp: write_bert(tmp, pooling))


def quantize(binary: str, src: Path, dst: Path, kind: str = "Q4_K_M") -> None:
    subprocess.run([binary, str(src), str(dst), kind], check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="270m")
    parser.add_argument("--family", choices=sorted(FAMILIES), help="a family's model instead")
    parser.add_argument("--counting", action="store_true", help="the counting model instead")
    parser.add_argument(
        "--bert", choices=sorted(BERT_POOLING), help="a BERT encoder with this pooling instead"
    )
    parser.add_argument("--out", help="the f16 GGUF to write")
    parser.add_argument(
        "--list-families",
        action="store_true",
        help="print each family as a JSON line (name, model path, templates, end of turn), "
        "writing its model first if needed",
    )
    parser.add_argument("--families-table", action="store_true", help="docs/families.md's table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantize", metavar="LLAMA_QUANTIZE", help="then write *-q4_k_m.gguf")
    parser.add_argument("--keep-f16", action="store_true", help="keep the f16 file after that")
    args = parser.parse_args()
    if args.families_table:
        print(families_table(), end="")
        print()
        print(doors_table(), end="")
        return 0
    if args.list_families:
        for f in FAMILIES.values():
            line = {**dataclasses.asdict(f), "path": str(family_model(f.name))}
            print(json.dumps(line, ensure_ascii=False))
        return 0
    if not args.out:
        parser.error("--out is required")
    shape, out = SHAPES[args.shape], Path(args.out)
    t0 = time.perf_counter()
    if args.bert:
        write_bert(out, args.bert, args.seed)
        print(f"{out}: bert ({args.bert} pooling), {out.stat().st_size / 2**20:.0f} MiB")
        return 0
    if args.counting:
        write_counting(SHAPES["counting"], out, args.seed)
        print(f"{out}: counting model, {out.stat().st_size / 2**20:.1f} MiB")
        return 0
    if args.family:
        write_family(FAMILIES[args.family], out, args.seed)
        print(f"{out}: {args.family}, {out.stat().st_size / 2**20:.0f} MiB, "
              f"{time.perf_counter() - t0:.1f}s")  # fmt: skip
        return 0
    write(shape, out, args.seed)
    print(f"{out}: {shape.n_params / 1e6:.1f} M parameters (random), "
          f"{out.stat().st_size / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f}s")  # fmt: skip
    if args.quantize:
        dst = out.with_name(out.name.replace("-f16", "").removesuffix(".gguf") + "-q4_k_m.gguf")
        t0 = time.perf_counter()
        quantize(args.quantize, out, dst)
        print(f"{dst}: Q4_K_M, {dst.stat().st_size / 2**20:.0f} MiB, "
              f"{time.perf_counter() - t0:.1f}s")  # fmt: skip
        if not args.keep_f16:
            out.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
