"""Random LoRA adapters for a GGUF model, and the model with an adapter merged in, for the tests
and benchmarks of LoRA serving (nothing is downloaded, nothing is trained).

An adapter is written as llama.cpp's convert_lora_to_gguf.py writes one, and as llama.cpp's
loader (src/llama-adapter.cpp) reads it: `general.architecture` the base's, `general.type` =
"adapter", `adapter.type` = "lora", `adapter.lora.alpha` (float32), and for each modified
weight W (GGUF shape [n_in, n_out]) an f32 `<W>.lora_a` of shape [n_in, rank] and an f32
`<W>.lora_b` of shape [rank, n_out]; with the adapter at scale s llama.cpp computes
W x + s * alpha / rank * B (A x) (A, B as numpy holds them: (rank, n_in), (n_out, rank)).

`write_merged` writes the base with W + s * alpha / rank * B @ A in float32 in place of each W:
for an f32 base, the same function as base + adapter at scale s up to float32 rounding. (With
f16 weights llama.cpp's CPU matmul rounds the activations to f16 for W x but not for the f32
adapter's B (A x), so the two would compute different things.) Hence `lora_base_model()`: the
synthetic `llama3` family model (synth_gguf.py) with every tensor converted to f32,
written once per machine, and `lora_adapter` / `lora_merged`, cached beside it.

    python -m llama_grpc_testkit.synth_lora --base X.gguf --rank 8 --out a.gguf \\
        [--merged m.gguf --scale 1]

A base's shapes come from its tensor table, whatever its quantization (the Qwen 2.5 Coder
0.5B's Q8_0 or Q4 files take an adapter as its f16 would); `--merged` needs f16/f32 weights.
The GGUF files are parsed here directly (metadata copied byte for byte): the gguf package's
GGUFReader takes ~28 s over the llama3 family's 128k-token vocabulary, this a fraction of one."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import mmap
import os
import re
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from llama_grpc_testkit import synth_gguf

LORA_BASE_FAMILY = "llama3"  # architecture `llama`: attn_q/k/v/output, ffn_gate/up/down
DEFAULT_TARGETS = ("attn_q", "attn_v", "ffn_up")
# The element std of alpha / rank * B @ A when `std` is not given: five times the synthetic
# models' weight std (synth_gguf.WEIGHT_STD). The f32 llama3 model's greedy output is its last
# token again and again (its output layer is its token embedding, tied), its logits span about
# +-1 with top-2 margins of ~1e-3 over 128k tokens; at 0.02 an adapter rarely changes that
# within 24 tokens, at 0.1 (both presets, seeds 0-2, two prompts) it changes one of the first
# three tokens, mostly the first, and nothing goes to NaN even at 1.0. On a real model (Qwen 2.5
# Coder 0.5B) it turns the output to noise, even at scale 0.25: pass a smaller `std` there when
# the text matters.
DELTA_STD = 0.1
GGML_F32, GGML_F16 = 0, 1
GGUF_FLOAT32 = 6  # metadata value type
LLAMA_FTYPE_ALL_F32 = 0
_LAYER_WEIGHT = re.compile(r"blk\.\d+\.(.+)\.weight")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A preset of lora_adapter(): what it modifies and how (the values come from the seed)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]


ADAPTERS = {
    "a": Adapter(rank=4, alpha=8.0, targets=DEFAULT_TARGETS),
    # another rank and other targets, for switching between two unlike adapters
    "b": Adapter(rank=8, alpha=16.0, targets=("attn_k", "attn_output", "ffn_down")),
}


# -- reading GGUF files ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is a row's length
    ggml_type: int
    start: int  # absolute offset of its data in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy's order (GGUF's reversed)."""
        return tuple(reversed(self.ne))


@dataclasses.dataclass
class GGUF:
    """A mapped GGUF file: metadata as (key, type, the value's bytes), tensors in file order."""

    path: Path
    data: memoryview
    keys: list[tuple[str, int, synth_gguf.RawValue]]
    tensors: list[Tensor]

    def raw(self, key: str) -> tuple[int, bytes] | None:
        for k, kind, value in self.keys:
            if k == key:
                return kind, bytes(value)
        return None

    def string(self, key: str) -> str:
        found = self.raw(key)
        if found is None or found[0] != synth_gguf._GGUF_STRING:
            raise ValueError(f"{self.path}: no string {key}")
        return found[1][8:].decode()

    def float32(self, key: str) -> float:
        found = self.raw(key)
        if found is None or found[0] != GGUF_FLOAT32:
            raise ValueError(f"{self.path}: no float32 {key}")
        return float(struct.unpack("<f", found[1])[0])

    @property
    def architecture(self) -> str:
        return self.string("general.architecture")

    def array(self, tensor: Tensor) -> np.ndarray[Any, Any]:
        """An f32 or f16 tensor's values in numpy's shape (a view of the mapped file)."""
        dtype = {GGML_F32: np.float32, GGML_F16: np.float16}.get(tensor.ggml_type)
        if dtype is None:
            raise ValueError(
                f"{self.path}: {tensor.name} is ggml type {tensor.ggml_type}, not f32/f16"
            )
        raw = self.data[tensor.start : tensor.start + tensor.n_bytes]
        return np.frombuffer(raw, dtype=dtype).reshape(tensor.shape)

    def bytes_of(self, tensor: Tensor) -> np.ndarray[Any, Any]:
        return np.frombuffer(self.data[tensor.start : tensor.start + tensor.n_bytes], np.uint8)


def _n_bytes(ne: tuple[int, ...], ggml_type: int) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    return math.prod(ne) // block * size


def open_gguf(path: Path) -> GGUF:
    """The file at `path`, mapped (unmapped when the last array viewing it is gone)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _parse(Path(path), memoryview(mapped))


def _parse(path: Path, data: memoryview) -> GGUF:
    if bytes(data[:4]) != b"GGUF" or int.from_bytes(data[4:8], "little") != 3:
        raise ValueError(f"{path}: not a GGUF v3 file")
    n_tensors = int.from_bytes(data[8:16], "little")
    n_kv, pos = int.from_bytes(data[16:24], "little"), 24
    keys: list[tuple[str, int, synth_gguf.RawValue]] = []
    for _ in range(n_kv):
        key_end = pos + 8 + int.from_bytes(data[pos : pos + 8], "little")
        key = bytes(data[pos + 8 : key_end]).decode()
        kind = int.from_bytes(data[key_end : key_end + 4], "little")
        pos = synth_gguf._skip_value(data, key_end + 4, kind)
        keys.append((key, kind, synth_gguf.RawValue(data[key_end + 4 : pos])))
    infos = []
    for _ in range(n_tensors):
        name_end = pos + 8 + int.from_bytes(data[pos : pos + 8], "little")
        name = bytes(data[pos + 8 : name_end]).decode()
        n_dims = int.from_bytes(data[name_end : name_end + 4], "little")
        pos = name_end + 4 + 8 * n_dims
        ne = struct.unpack_from(f"<{n_dims}Q", data, name_end + 4)
        ggml_type, offset = struct.unpack_from("<IQ", data, pos)
        pos += 12
        infos.append((name, tuple(ne), ggml_type, offset))
    alignment = 32
    for key, _, value in keys:
        if key == "general.alignment":
            alignment = int.from_bytes(value, "little")
    start = -(-pos // alignment) * alignment
    tensors = [Tensor(n, ne, t, start + off, _n_bytes(ne, t)) for n, ne, t, off in infos]
    return GGUF(path, data, keys, tensors)


def layer_targets(model: GGUF, targets: tuple[str, ...]) -> list[Tensor]:
    """The layers' weights `blk.N.<target>.weight` for the targets, in file order."""
    out = []
    for t in model.tensors:
        match = _LAYER_WEIGHT.fullmatch(t.name)
        if match and match.group(1) in targets:
            out.append(t)
    return out


# -- writing adapters and merged models ---------------------------------------------------------


def default_std(rank: int, alpha: float) -> float:
    """The std of A's and B's elements that gives alpha / rank * B @ A elements of std
    DELTA_STD (each is a sum of `rank` products of two such values)."""
    return math.sqrt(DELTA_STD / ((alpha / rank) * math.sqrt(rank)))


def write_lora(
    base: Path,
    dst: Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = DEFAULT_TARGETS,
    seed: int = 0,
    std: float | None = None,
) -> None:
    """A random LoRA adapter for `base`: for every layer weight named blk.N.<target>.weight,
    f32 lora_a [n_in, rank] and lora_b [rank, n_out] of normal values of std `std` (default:
    default_std(rank, alpha), so that the weights move by DELTA_STD)."""
    import gguf

    std = default_std(rank, alpha) if std is None else std
    model = open_gguf(Path(base))
    arch = model.architecture
    chosen = [(t.name, t.ne[0], t.ne[1]) for t in layer_targets(model, targets)]
    if not chosen:
        raise ValueError(f"{base} has no layer weight named blk.N.<{'|'.join(targets)}>.weight")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(dst), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    writer.add_name(f"synthetic LoRA rank {rank} ({', '.join(targets)}; seed {seed})")
    for name, n_in, n_out in chosen:
        # numpy shapes (rank, n_in) and (n_out, rank): GGUF's [n_in, rank] and [rank, n_out]
        a = (rng.standard_normal((rank, n_in)) * std).astype(np.float32)
        b = (rng.standard_normal((n_out, rank)) * std).astype(np.float32)
        writer.add_tensor(name + ".lora_a", a)
        writer.add_tensor(name + ".lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def lora_deltas(adapter: GGUF, scale: float) -> dict[str, np.ndarray[Any, Any]]:
    """Each target's scale * alpha / rank * B @ A (float64, numpy's (n_out, n_in)); alpha 0 or
    absent means scale alone, as llama.cpp has it."""
    try:
        alpha = adapter.float32("adapter.lora.alpha")
    except ValueError:
        alpha = 0.0
    by_name = {t.name: t for t in adapter.tensors}
    out = {}
    for t in adapter.tensors:
        if not t.name.endswith(".lora_a"):
            continue
        target = t.name.removesuffix(".lora_a")
        if target.endswith("token_embd.weight"):
            raise ValueError(f"{adapter.path}: merging token_embd.weight is not supported")
        a = adapter.array(t).astype(np.float64)
        b = adapter.array(by_name[target + ".lora_b"]).astype(np.float64)
        rank = b.shape[1]
        factor = scale * alpha / rank if alpha else scale
        out[target] = factor * (b @ a)
    return out


def _copy(
    src: Path,
    dst: Path,
    change: Callable[[GGUF, Tensor], np.ndarray[Any, Any] | None],
    *,
    file_type: int | None = None,
) -> None:
    """`src` with all its metadata and tensors, each tensor's data replaced by change(model, t)
    where that is not None (an f32 or f16 array of the tensor's shape)."""
    import gguf

    model = open_gguf(src)
    writer = synth_gguf._gguf_writer(dst, model.architecture)
    for key, kind, value in model.keys:
        if key in ("general.architecture", "general.alignment"):
            continue  # the writer writes the first, and aligns to its own default
        if key == "general.file_type" and file_type is not None:
            continue
        writer.add_key_value(key, value, gguf.GGUFValueType(kind))
    if file_type is not None:
        writer.add_file_type(file_type)
    data = []
    for t in model.tensors:
        new = change(model, t)
        if new is None:  # as it is, whatever its type
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*t.shape[:-1], t.shape[-1] // block * size)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.n_bytes, qtype)
            data.append(model.bytes_of(t).reshape(byte_shape))
        else:
            if new.shape != t.shape or new.dtype not in (np.float32, np.float16):
                raise ValueError(f"{t.name}: {new.dtype} {new.shape}, want f32/f16 {t.shape}")
            writer.add_tensor_info(t.name, t.shape, new.dtype, new.nbytes)
            data.append(new)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for array in data:
        writer.write_tensor_data(array)
    writer.close()


def write_merged(base: Path, adapter: Path, scale: float, dst: Path) -> None:
    """`base` with the adapter merged in at `scale`: each targeted W becomes
    W + scale * alpha / rank * B @ A, stored in float32; every other tensor and all metadata as
    they are. The targeted weights must be f16 or f32."""
    deltas = lora_deltas(open_gguf(Path(adapter)), scale)
    missing = set(deltas) - {t.name for t in open_gguf(Path(base)).tensors}
    if missing:
        raise ValueError(f"{base} has no {', '.join(sorted(missing))}")

    def merge(model: GGUF, t: Tensor) -> np.ndarray[Any, Any] | None:
        delta = deltas.get(t.name)
        if delta is None:
            return None
        merged: np.ndarray[Any, Any] = (model.array(t) + delta).astype(np.float32)
        return merged

    _copy(Path(base), Path(dst), merge)


def write_f32(src: Path, dst: Path) -> None:
    """`src` with every f16 tensor converted to f32 (general.file_type ALL_F32)."""

    def widen(model: GGUF, t: Tensor) -> np.ndarray[Any, Any] | None:
        return model.array(t).astype(np.float32) if t.ggml_type == GGML_F16 else None

    _copy(Path(src), Path(dst), widen, file_type=LLAMA_FTYPE_ALL_F32)


# -- cached test models -------------------------------------------------------------------------


def _source_key() -> str:
    """This file's and synth_gguf.py's sources and the pinned llama.cpp's version (what the
    family models are keyed by), read once: a process keeps the key of the code it runs, so one
    that imported an older version cannot write its output under a newer version's key."""
    from llama_grpc_testkit import llama_sdist

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(Path(synth_gguf.__file__).read_bytes())
    digest.update(llama_sdist.VERSION.encode())
    return digest.hexdigest()[:16]


_KEY = _source_key()


def _cached(stem: str, write_to: Callable[[Path], None]) -> Path:
    """synth_gguf.models_dir()/<stem>-<key>.gguf, written by `write_to` unless there (into a
    temp file, then renamed); the key is _source_key()'s."""
    path = synth_gguf.models_dir() / f"{stem}-{_KEY}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write_to(tmp)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def lora_base_model() -> Path:
    """The synthetic llama3 family model (architecture llama, 2 layers 64 wide, Llama 3's
    vocabulary) in f32, written once per machine (~40 MB)."""
    source = synth_gguf.family_model(LORA_BASE_FAMILY)
    return _cached(f"lora-base-{LORA_BASE_FAMILY}-f32", lambda tmp: write_f32(source, tmp))


def lora_adapter(name: str = "a", seed: int = 0) -> Path:
    """Adapter preset `name` (ADAPTERS) with the random values of `seed`, for
    lora_base_model(); cached."""
    spec, base = ADAPTERS[name], lora_base_model()

    def write(tmp: Path) -> None:
        write_lora(base, tmp, rank=spec.rank, alpha=spec.alpha, targets=spec.targets, seed=seed)

    return _cached(f"lora-{LORA_BASE_FAMILY}-{name}-seed{seed}", write)


def lora_merged(name: str = "a", scale: float = 1.0, seed: int = 0) -> Path:
    """lora_base_model() with lora_adapter(name, seed) merged in at `scale`; cached."""
    base, adapter = lora_base_model(), lora_adapter(name, seed)
    stem = f"lora-{LORA_BASE_FAMILY}-{name}-seed{seed}-merged-{scale:g}"
    return _cached(stem, lambda tmp: write_merged(base, adapter, scale, tmp))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the base model's GGUF")
    parser.add_argument("--out", type=Path, required=True, help="the adapter GGUF to write")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=8.0)
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help="comma-separated layer weights (blk.N.<target>.weight)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=None, help="of A's and B's elements")
    parser.add_argument("--merged", type=Path, help="also write the base with it merged in")
    parser.add_argument("--scale", type=float, default=1.0, help="the merged adapter's scale")
    args = parser.parse_args()
    targets = tuple(t for t in args.targets.split(",") if t)
    write_lora(args.base, args.out, rank=args.rank, alpha=args.alpha, targets=targets,
               seed=args.seed, std=args.std)  # fmt: skip
    print(args.out)
    if args.merged:
        write_merged(args.base, args.out, args.scale, args.merged)
        print(args.merged)
    return 0


if __name__ == "__main__":
    sys.exit(main())
