"""LoRA adapters: read an adapter GGUF's header and check it against its base model's header,
as llama.cpp's loader would (the pinned llama.cpp's src/llama-adapter.cpp,
llama_adapter_lora_init_impl), without llama.cpp and without reading any weights.

The layout llama.cpp loads (what convert_lora_to_gguf.py writes):

- metadata: `general.type` = "adapter", `adapter.type` = "lora", `general.architecture` the
  base model's, `adapter.lora.alpha` a float32 (absent: 0, and llama.cpp then scales by the
  adapter's scale alone instead of scale * alpha / rank);
- for each base weight W it modifies, two tensors named `<W's name>.lora_a` and `.lora_b`;
  tensors named `*_norm.weight` are ignored, any other name is refused;
- shapes, in GGUF order (ne: ne[0] is a row's length, so W is [n_in, n_out]): lora_a is
  [n_in, rank] and lora_b [rank, n_out], and a pass computes W x + scale * alpha / rank *
  B (A x). The token embedding is the exception (llm_graph_context::build_inp_embd): its rows
  are looked up, so token_embd.weight ([n_embd, n_vocab]) takes lora_a [rank, n_vocab] and
  lora_b [rank, n_embd]. rank is lora_b's ne[0] for every tensor (llama_adapter_lora_weight::
  get_scale), and may differ between tensors.

Beyond llama.cpp's own checks (which it reports by returning NULL), this refuses what would
make llama.cpp abort the process instead: a metadata key of the wrong type (gguf_get_val_str and
gguf_get_val_f32 assert the type), an embedding pair whose ranks disagree (not checked at load;
the first decode's ggml_mul_mat asserts), a pair with more than two dimensions on a
two-dimensional weight, and a token_embd.weight pair on a model whose output layer is the
token embedding itself (no output.weight: the output matmul then finds the embedding-layout
pair and asserts)."""

from __future__ import annotations

import bisect
import errno
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType

from llama_grpc_server.models.gguf_header import (
    MAGIC,
    STRING,
    TYPE_NAMES,
    VERSIONS,
    GGUFError,
    MetaValue,
    _Reader,  # the header reader's bounds-checked cursor: one parser of GGUF's encoding
)

FLOAT32 = GGUFValueType.FLOAT32.value  # the metadata value type of adapter.lora.alpha
DEFAULT_ALIGNMENT = 32  # general.alignment when the file does not say
MAX_DIMS = 4  # GGML_MAX_DIMS
LORA_A, LORA_B = ".lora_a", ".lora_b"
IGNORED_SUFFIX = "_norm.weight"  # llama.cpp skips these (mergekit-extract-lora's layer norms)
TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One entry of a GGUF file's tensor table."""

    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is a row's length (a weight's input dimension)
    ggml_type: int
    offset: int  # of its data, from the start of the data section
    n_bytes: int  # up to the next tensor's data or the end of the file: its size, aligned


@dataclass(frozen=True, slots=True)
class GGUFTables:
    """A GGUF file's metadata (with each key's value type) and tensor table, in file order."""

    path: Path
    metadata: Mapping[str, MetaValue]
    kinds: Mapping[str, int]  # key -> GGUF value type (6 float32, 8 string, 9 array...)
    tensors: Mapping[str, TensorInfo]


def read_tables(path: str | os.PathLike[str]) -> GGUFTables:
    """The metadata and tensor table of the GGUF file at `path` (long arrays summarized, as
    read_header does); GGUFError naming the file when it is missing, not GGUF or truncated."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GGUFError(f"{path}: not a GGUF file (empty)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse_tables(path, size, _Reader(data))
    except OSError as exc:
        raise GGUFError(f"{path}: {exc.strerror or exc}") from None
    except EOFError as exc:
        raise GGUFError(f"{path}: truncated GGUF header ({exc})") from None
    except RecursionError:
        raise GGUFError(f"{path}: metadata arrays nested too deep") from None
    except ValueError as exc:
        if isinstance(exc, GGUFError):
            raise
        raise GGUFError(f"{path}: {exc}") from None


def _parse_tables(path: Path, size: int, reader: _Reader) -> GGUFTables:
    if bytes(reader.data[:4]) != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    reader.pos = 4
    version = reader.u32()
    if version not in VERSIONS:
        raise ValueError(f"unsupported GGUF version {version} (supported: 2, 3)")
    tensor_count, kv_count = reader.u64(), reader.u64()
    metadata: dict[str, MetaValue] = {}
    kinds: dict[str, int] = {}
    for _ in range(kv_count):
        key = reader.string()
        kind = reader.u32()
        kinds[key] = kind
        metadata[key] = reader.value(kind)
    entries: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = reader.string()
        n_dims = reader.u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        ne = tuple(reader.u64() for _ in range(n_dims))
        entries.append((name, ne, reader.u32(), reader.u64()))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}")
    data_start = -(-reader.pos // alignment) * alignment
    data_size = max(0, size - data_start)
    ends = sorted({offset for *_, offset in entries} | {data_size})
    tensors: dict[str, TensorInfo] = {}
    for name, ne, ggml_type, offset in entries:
        i = bisect.bisect_right(ends, offset)
        end = ends[i] if i < len(ends) else offset  # data past the end of the file: none
        tensors[name] = TensorInfo(name, ne, ggml_type, offset, end - offset)
    return GGUFTables(path, metadata, kinds, tensors)


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter as llama.cpp will load it."""

    path: Path
    architecture: str
    alpha: float  # 0.0 when the file has none: llama.cpp then scales by the adapter scale alone
    rank: int  # the largest rank of its pairs (PEFT's rank_pattern lets them differ)
    targets: tuple[str, ...]  # the base tensors it modifies, in the adapter's file order
    n_bytes: int  # its lora_a and lora_b tensors' data (each aligned): what llama.cpp allocates


class AdapterMismatch(ValueError):
    """An adapter llama.cpp would refuse (or crash on) with this base model; the message names
    the adapter and the exact mismatch, `reason` is the same without the path."""

    def __init__(self, path: Path, reason: str, *, joiner: str = ": ") -> None:
        super().__init__(f"adapter {path}{joiner}{reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Pair:
    target: str  # the base tensor's name
    a: TensorInfo
    b: TensorInfo

    @property
    def is_token_embd(self) -> bool:
        return self.target.endswith(TOKEN_EMBD)  # llama.cpp's test (str_endswith)

    @property
    def rank(self) -> int:
        return self.b.ne[0]


def _shape(ne: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(n) for n in ne) + "]"


def _padded(ne: tuple[int, ...]) -> tuple[int, ...]:
    """ne as ggml holds it: four dimensions, the missing ones 1."""
    return ne + (1,) * (MAX_DIMS - len(ne))


def _kind_name(kind: int) -> str:
    return TYPE_NAMES.get(kind, f"type {kind}")


def _string_key(tables: GGUFTables, key: str) -> str:
    """A string key's value ("" when absent); a key of another type is refused (gguf_get_val_str
    asserts the type: llama.cpp would abort)."""
    kind = tables.kinds.get(key)
    if kind is None:
        return ""
    value = tables.metadata[key]
    if kind != STRING or not isinstance(value, str):
        reason = f"{key} is a {_kind_name(kind)}, not a string (llama.cpp would abort reading it)"
        raise AdapterMismatch(tables.path, reason)
    return value


def _alpha(tables: GGUFTables) -> float:
    key = "adapter.lora.alpha"
    kind = tables.kinds.get(key)
    if kind is None:
        return 0.0
    value = tables.metadata[key]
    if kind != FLOAT32 or not isinstance(value, float):
        reason = f"{key} is a {_kind_name(kind)}, not a float32 (llama.cpp would abort reading it)"
        raise AdapterMismatch(tables.path, reason)
    return value


def _pairs(tables: GGUFTables) -> list[_Pair]:
    """The (lora_a, lora_b) pairs by target, in the order their first tensor comes."""
    halves: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tables.tensors.items():
        suffix = name[-len(LORA_A) :]
        if suffix in (LORA_A, LORA_B):
            halves.setdefault(name[: -len(suffix)], {})[suffix] = info
        elif not name.endswith(IGNORED_SUFFIX):
            reason = f"tensor {name} is neither a {LORA_A} nor a {LORA_B} tensor"
            raise AdapterMismatch(tables.path, reason)
    pairs: list[_Pair] = []
    for target, half in halves.items():
        for have, lack in ((LORA_A, LORA_B), (LORA_B, LORA_A)):
            if lack not in half:
                reason = f"tensor {target}{have} has no {target}{lack}"
                raise AdapterMismatch(tables.path, reason)
        pairs.append(_Pair(target, half[LORA_A], half[LORA_B]))
    return pairs


def _check_ranks(path: Path, pair: _Pair) -> None:
    """lora_a's rank dimension equals lora_b's ne[0] (ne[1] of lora_a, or its ne[0] for the
    token embedding, whose lora_a is stored transposed)."""
    a, b = pair.a, pair.b
    rank_a = a.ne[0] if pair.is_token_embd else _padded(a.ne)[1]
    if rank_a != b.ne[0]:
        reason = (
            f"{a.name} has rank {rank_a} ({_shape(a.ne)}) but {b.name} has rank {b.ne[0]} "
            f"({_shape(b.ne)})"
        )
        raise AdapterMismatch(path, reason)


def read_adapter(path: str | os.PathLike[str]) -> AdapterInfo:
    """The adapter at `path`, checked on its own (its type, keys and pairs); check_adapter also
    checks it against a base model. FileNotFoundError when there is no such file, GGUFError (a
    ValueError) when it is not a readable GGUF file, AdapterMismatch when it is not a LoRA
    adapter llama.cpp can load."""
    return _read_adapter(Path(path))[0]


def _read_adapter(path: Path) -> tuple[AdapterInfo, list[_Pair]]:
    if not path.is_file():
        raise FileNotFoundError(errno.ENOENT, "LoRA adapter not found", str(path))
    tables = read_tables(path)
    general_type = _string_key(tables, "general.type")
    if general_type != "adapter":
        got = f"'{general_type}'" if general_type else "not set"
        raise AdapterMismatch(path, f"general.type is {got}, not 'adapter'")
    adapter_type = _string_key(tables, "adapter.type")
    if adapter_type != "lora":
        got = f"'{adapter_type}'" if adapter_type else "not set"
        raise AdapterMismatch(path, f"adapter.type is {got}, not 'lora'")
    architecture = _string_key(tables, "general.architecture")
    if not architecture:
        raise AdapterMismatch(path, "general.architecture is not set")
    alpha = _alpha(tables)
    pairs = _pairs(tables)
    if not pairs:
        raise AdapterMismatch(path, f"has no {LORA_A}/{LORA_B} tensors: it modifies nothing")
    for pair in pairs:
        _check_ranks(path, pair)
        for half in (pair.a, pair.b):
            if half.n_bytes == 0:
                raise GGUFError(f"{path}: truncated (no data for tensor {half.name})")
    info = AdapterInfo(
        path=path,
        architecture=architecture,
        alpha=alpha,
        rank=max(p.rank for p in pairs),
        targets=tuple(p.target for p in pairs),
        n_bytes=sum(p.a.n_bytes + p.b.n_bytes for p in pairs),
    )
    return info, pairs


def _expected(pair: _Pair, base: TensorInfo) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes lora_a and lora_b must have on `base`, each with its own rank (so that a
    message names the one that is wrong)."""
    rest = base.ne[2:]
    if pair.is_token_embd:  # base [n_embd, n_vocab]: a [rank, n_vocab], b [rank, n_embd]
        n_embd, n_vocab = _padded(base.ne)[:2]
        return (pair.a.ne[0], n_vocab, *rest), (pair.b.ne[0], n_embd, *rest)
    n_in, n_out = _padded(base.ne)[:2]
    return (n_in, _padded(pair.a.ne)[1], *rest), (pair.b.ne[0], n_out, *rest)


def check_adapter(adapter: str | os.PathLike[str], base: str | os.PathLike[str]) -> AdapterInfo:
    """The adapter at `adapter`, checked as llama.cpp's llama_adapter_lora_init would check it
    against the model loaded from `base` (and for what would crash llama.cpp later: see the
    module's docstring). Raises FileNotFoundError (either file missing), GGUFError (a
    ValueError: either file not GGUF) or AdapterMismatch, whose message names the mismatch."""
    info, pairs = _read_adapter(Path(adapter))
    path, base = info.path, Path(base)
    if not base.is_file():
        raise FileNotFoundError(errno.ENOENT, "base model not found", str(base))
    base_tables = read_tables(base)
    base_arch = base_tables.metadata.get("general.architecture")
    if info.architecture != base_arch:
        reason = f"is for architecture '{info.architecture}', the base model is '{base_arch}'"
        raise AdapterMismatch(path, reason, joiner=" ")
    for pair in pairs:
        weight = base_tables.tensors.get(pair.target)
        if weight is None:
            reason = f"modifies {pair.target}, which the base model does not have"
            raise AdapterMismatch(path, reason)
        for half, want in zip((pair.a, pair.b), _expected(pair, weight), strict=True):
            if _padded(half.ne) != _padded(want):
                suffix = half.name[len(pair.target) + 1 :]
                reason = (
                    f"tensor {half.name} has shape {_shape(half.ne)}; base {pair.target} is "
                    f"{_shape(weight.ne)} so {suffix} must be {_shape(want)}"
                )
                raise AdapterMismatch(path, reason)
        if pair.is_token_embd and OUTPUT not in base_tables.tensors:
            reason = (
                f"modifies {pair.target}, which this base model also uses as its output layer "
                f"(it has no {OUTPUT}): llama.cpp would abort in the first decode"
            )
            raise AdapterMismatch(path, reason)
    return info
