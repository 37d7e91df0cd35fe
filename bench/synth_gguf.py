"""A Gemma 3 GGUF with random weights, for benchmarks where nothing large may travel (the GPU
machine fetches nothing): written here in f16 (norms f32), then quantized with llama-quantize
from the same llama.cpp tree if asked. A forward pass costs the same whatever the weights are, so
its timings stand for a real model of the same shape; its outputs are noise, so benchmarks run
with ignore_eos and token-id prompts.

The vocabulary is synthetic but complete for llama.cpp's SentencePiece ("llama") tokenizer, laid
out like Gemma 3's: <pad> 0, <eos> 1, <bos> 2, <unk> 3, the 256 byte tokens, then pieces "▁a",
"▁b", ..., with descending scores, so text tokenizes (bytes at worst) and every id detokenizes.

    python bench/synth_gguf.py --shape 270m --out /tmp/g270m-f16.gguf \\
        --quantize build/bin/llama-quantize            # -> /tmp/g270m-q4_k_m.gguf
    python bench/synth_gguf.py --shape tiny --out /tmp/tiny.gguf   # for tests

Shapes: `270m` is the embedded Gemma 3 270M's (hyperparameters read off its GGUF), `1b` Gemma 3
1B's (~1.0 B parameters, 262,144-token vocabulary), `tiny` a few hundred kB for tests."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

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
}


def vocabulary(n_vocab: int) -> tuple[list[bytes], list[float], list[int]]:
    if n_vocab < FIRST_PIECE + 1:
        raise ValueError(f"n_vocab must be at least {FIRST_PIECE + 1}")
    tokens = [b"<pad>", b"<eos>", b"<bos>", b"<unk>"]
    types = [TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_UNKNOWN]
    tokens += [f"<0x{b:02X}>".encode() for b in range(256)]
    types += [TOKEN_BYTE] * 256
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    for i in range(n_vocab - FIRST_PIECE):
        word, n = "", i
        while True:  # bijective base 26: a .. z, aa .. zz, aaa ..
            word = alphabet[n % 26] + word
            n = n // 26 - 1
            if n < 0:
                break
        tokens.append(("\u2581" + word).encode())
        types.append(TOKEN_NORMAL)
    scores = [0.0] * FIRST_PIECE + [-float(i) for i in range(n_vocab - FIRST_PIECE)]
    return tokens, scores, types


def write(shape: Shape, path: Path, seed: int = 0) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_name(f"synthetic gemma3 {shape.n_params / 1e6:.0f}M (random weights)")
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(shape.sliding_window)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, scores, types = vocabulary(shape.n_vocab)
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
    tensors = shape.tensors()
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        n_bytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), n_bytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
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


def quantize(binary: str, src: Path, dst: Path, kind: str = "Q4_K_M") -> None:
    subprocess.run([binary, str(src), str(dst), kind], check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="270m")
    parser.add_argument("--out", required=True, help="the f16 GGUF to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantize", metavar="LLAMA_QUANTIZE", help="then write *-q4_k_m.gguf")
    parser.add_argument("--keep-f16", action="store_true", help="keep the f16 file after that")
    args = parser.parse_args()
    shape, out = SHAPES[args.shape], Path(args.out)
    t0 = time.perf_counter()
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
