"""models.adapters: a LoRA adapter's header checked against its base model's as llama.cpp's loader
checks it (and for what would abort llama.cpp instead), with the exact message for each mismatch;
and llama_grpc_testkit.synth_lora's adapters and merged models. Tiny GGUF files written with the
gguf package into tmp_path, no llama.cpp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from llama_grpc_server.models.adapters import (
    AdapterInfo,
    AdapterMismatch,
    check_adapter,
    read_adapter,
)
from llama_grpc_server.models.gguf_header import GGUFError
from llama_grpc_testkit import synth_lora

N_EMBD, N_KV, N_FF, N_VOCAB, N_LAYER = 8, 4, 16, 32, 2
Q = "blk.0.attn_q.weight"


def base_tensors(*, output: bool = False) -> dict[str, np.ndarray[Any, Any]]:
    """A llama's tensors in numpy's shapes ((n_out, n_in) for a matrix), f32 random values."""
    rng = np.random.default_rng(7)
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (N_VOCAB, N_EMBD)}
    for i in range(N_LAYER):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (N_EMBD,),
            b + "attn_q.weight": (N_EMBD, N_EMBD),
            b + "attn_k.weight": (N_KV, N_EMBD),
            b + "attn_v.weight": (N_KV, N_EMBD),
            b + "attn_output.weight": (N_EMBD, N_EMBD),
            b + "ffn_gate.weight": (N_FF, N_EMBD),
            b + "ffn_up.weight": (N_FF, N_EMBD),
            b + "ffn_down.weight": (N_EMBD, N_FF),
        }
    shapes["output_norm.weight"] = (N_EMBD,)
    if output:
        shapes["output.weight"] = (N_VOCAB, N_EMBD)
    return {name: rng.standard_normal(s).astype(np.float32) for name, s in shapes.items()}


def write_gguf(
    path: Path, arch: str, tensors: dict[str, np.ndarray[Any, Any]], meta: dict[str, Any]
) -> Path:
    """meta: key -> (gguf.GGUFValueType, value)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (kind, value) in meta.items():
        writer.add_key_value(key, value, kind)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


F32, STR = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
ADAPTER_META = {
    "general.type": (STR, "adapter"),
    "adapter.type": (STR, "lora"),
    "adapter.lora.alpha": (F32, 8.0),
}


@pytest.fixture
def base(tmp_path: Path) -> Path:
    meta = {
        "general.name": (STR, "tiny llama"),
        "general.file_type": (gguf.GGUFValueType.UINT32, 0),
    }
    return write_gguf(tmp_path / "base.gguf", "llama", base_tensors(), meta)


def lora_pair(target: str, n_in: int, n_out: int, rank: int = 4) -> dict[str, np.ndarray[Any, Any]]:
    """numpy (rank, n_in) and (n_out, rank): GGUF [n_in, rank] and [rank, n_out]."""
    return {
        target + ".lora_a": np.full((rank, n_in), 0.1, np.float32),
        target + ".lora_b": np.full((n_out, rank), 0.1, np.float32),
    }


def adapter(
    tmp_path: Path,
    tensors: dict[str, np.ndarray[Any, Any]] | None = None,
    *,
    arch: str = "llama",
    drop: tuple[str, ...] = (),
    **meta: tuple[gguf.GGUFValueType, Any],
) -> Path:
    """An adapter GGUF: ADAPTER_META but for the `drop`ped keys and with `meta` (dots spelled
    as __) over it; by default one rank-4 pair on blk.0.attn_q.weight."""
    keys = {k: v for k, v in ADAPTER_META.items() if k not in drop}
    keys |= {k.replace("__", "."): v for k, v in meta.items()}
    tensors = lora_pair(Q, N_EMBD, N_EMBD) if tensors is None else tensors
    return write_gguf(tmp_path / "adapter.gguf", arch, tensors, keys)


def refused(adapter_path: Path, base_path: Path) -> str:
    with pytest.raises(AdapterMismatch) as caught:
        check_adapter(adapter_path, base_path)
    assert caught.value.path == adapter_path
    message = str(caught.value)
    assert message.startswith(f"adapter {adapter_path}")
    return message.removeprefix(f"adapter {adapter_path}")


# -- accepted -------------------------------------------------------------------------------------


def test_a_generated_adapter_is_accepted_with_its_rank_alpha_and_targets(
    tmp_path: Path, base: Path
) -> None:
    path = tmp_path / "a.gguf"
    synth_lora.write_lora(base, path, rank=3, alpha=6.0, targets=("attn_q", "ffn_down"), seed=1)
    info = check_adapter(path, base)
    # f32 a [n_in, 3] + b [3, n_out], each padded to 32 bytes: q 8x3 + 3x8 -> 96 + 96,
    # ffn_down (n_in 16) 16x3 -> 192 and 3x8 -> 96
    assert info == AdapterInfo(
        path=path,
        architecture="llama",
        alpha=6.0,
        rank=3,
        targets=(
            "blk.0.attn_q.weight",
            "blk.0.ffn_down.weight",
            "blk.1.attn_q.weight",
            "blk.1.ffn_down.weight",
        ),
        n_bytes=2 * (96 + 96 + 192 + 96),
    )
    assert read_adapter(path) == info


def test_write_lora_writes_convert_lora_to_ggufs_keys_and_layout(
    tmp_path: Path, base: Path
) -> None:
    path = tmp_path / "a.gguf"
    synth_lora.write_lora(base, path, rank=2, alpha=4.0, targets=("attn_v",), seed=3, std=0.5)
    reader = gguf.GGUFReader(path)

    def value(key: str) -> Any:
        return reader.fields[key].contents()

    assert (value("general.architecture"), value("general.type"), value("adapter.type")) == (
        "llama",
        "adapter",
        "lora",
    )
    assert value("adapter.lora.alpha") == 4.0
    assert reader.fields["adapter.lora.alpha"].types == [gguf.GGUFValueType.FLOAT32]
    layout = {t.name: ([int(n) for n in t.shape], t.tensor_type) for t in reader.tensors}
    f32 = gguf.GGMLQuantizationType.F32
    assert layout == {
        f"blk.{i}.attn_v.weight.lora_{half}": (shape, f32)
        for i in range(N_LAYER)
        for half, shape in (("a", [N_EMBD, 2]), ("b", [2, N_KV]))
    }
    values = np.concatenate([np.asarray(t.data).ravel() for t in reader.tensors])
    assert 0.3 < float(values.std()) < 0.7  # std=0.5 as asked


def test_default_std_moves_the_weights_by_delta_std() -> None:
    rank, alpha = 8, 16.0
    std = synth_lora.default_std(rank, alpha)
    # alpha / rank * (B @ A): each element a sum of `rank` products of two N(0, std) values
    assert alpha / rank * np.sqrt(rank) * std**2 == pytest.approx(synth_lora.DELTA_STD)


def test_norm_tensors_are_ignored_as_llama_cpp_ignores_them(tmp_path: Path, base: Path) -> None:
    tensors = lora_pair(Q, N_EMBD, N_EMBD) | {"blk.0.attn_norm.weight": np.ones(N_EMBD, np.float32)}
    info = check_adapter(adapter(tmp_path, tensors), base)
    assert (info.targets, info.rank, info.n_bytes) == ((Q,), 4, 128 + 128)


def test_an_adapter_without_alpha_has_alpha_zero(tmp_path: Path, base: Path) -> None:
    """llama.cpp reads a missing alpha as 0 and then scales by the adapter scale alone."""
    assert check_adapter(adapter(tmp_path, drop=("adapter.lora.alpha",)), base).alpha == 0.0


def test_ranks_may_differ_between_pairs_and_rank_is_the_largest(tmp_path: Path, base: Path) -> None:
    tensors = lora_pair(Q, N_EMBD, N_EMBD, rank=2) | lora_pair(
        "blk.1.ffn_up.weight", N_EMBD, N_FF, rank=6
    )
    info = check_adapter(adapter(tmp_path, tensors), base)
    assert (info.rank, info.targets) == (6, (Q, "blk.1.ffn_up.weight"))


def test_a_token_embd_pair_has_the_embedding_layout(tmp_path: Path) -> None:
    """token_embd.weight [n_embd, n_vocab] takes lora_a [rank, n_vocab] (stored transposed,
    its rows looked up per token) and lora_b [rank, n_embd]; fine on a base with output.weight."""
    base = write_gguf(tmp_path / "base.gguf", "llama", base_tensors(output=True), {})
    tensors = {
        "token_embd.weight.lora_a": np.zeros((N_VOCAB, 4), np.float32),
        "token_embd.weight.lora_b": np.zeros((N_EMBD, 4), np.float32),
    }
    info = check_adapter(adapter(tmp_path, tensors), base)
    assert (info.targets, info.rank) == (("token_embd.weight",), 4)


# -- refused --------------------------------------------------------------------------------------


def test_another_architecture_is_refused(tmp_path: Path, base: Path) -> None:
    assert refused(adapter(tmp_path, arch="qwen2"), base) == (
        " is for architecture 'qwen2', the base model is 'llama'"
    )


def test_a_model_is_not_an_adapter(tmp_path: Path, base: Path) -> None:
    path = adapter(tmp_path, general__type=(STR, "model"))
    assert refused(path, base) == ": general.type is 'model', not 'adapter'"


def test_a_file_without_general_type_is_not_an_adapter(tmp_path: Path, base: Path) -> None:
    path = adapter(tmp_path, drop=("general.type",))
    assert refused(path, base) == ": general.type is not set, not 'adapter'"


def test_a_control_vector_is_not_a_lora(tmp_path: Path, base: Path) -> None:
    path = adapter(tmp_path, adapter__type=(STR, "control_vector"))
    assert refused(path, base) == ": adapter.type is 'control_vector', not 'lora'"


def test_a_lora_b_of_the_wrong_shape_is_refused(tmp_path: Path, base: Path) -> None:
    tensors = lora_pair(Q, N_EMBD, N_EMBD) | {Q + ".lora_b": np.zeros((N_FF, 4), np.float32)}
    assert refused(adapter(tmp_path, tensors), base) == (
        ": tensor blk.0.attn_q.weight.lora_b has shape [4, 16]; base blk.0.attn_q.weight is "
        "[8, 8] so lora_b must be [4, 8]"
    )


def test_a_lora_a_of_the_wrong_shape_is_refused(tmp_path: Path, base: Path) -> None:
    """Another model's adapter of the same architecture: its n_in differs."""
    tensors = lora_pair("blk.0.attn_v.weight", 896, N_KV, rank=8)
    assert refused(adapter(tmp_path, tensors), base) == (
        ": tensor blk.0.attn_v.weight.lora_a has shape [896, 8]; base blk.0.attn_v.weight is "
        "[8, 4] so lora_a must be [8, 8]"
    )


def test_a_tensor_the_base_does_not_have_is_refused(tmp_path: Path, base: Path) -> None:
    tensors = lora_pair("blk.9.attn_q.weight", N_EMBD, N_EMBD)
    assert refused(adapter(tmp_path, tensors), base) == (
        ": modifies blk.9.attn_q.weight, which the base model does not have"
    )


def test_lora_a_without_lora_b_is_refused(tmp_path: Path, base: Path) -> None:
    tensors = {Q + ".lora_a": lora_pair(Q, N_EMBD, N_EMBD)[Q + ".lora_a"]}
    assert refused(adapter(tmp_path, tensors), base) == (
        ": tensor blk.0.attn_q.weight.lora_a has no blk.0.attn_q.weight.lora_b"
    )


def test_lora_b_without_lora_a_is_refused(tmp_path: Path, base: Path) -> None:
    tensors = {Q + ".lora_b": lora_pair(Q, N_EMBD, N_EMBD)[Q + ".lora_b"]}
    assert refused(adapter(tmp_path, tensors), base) == (
        ": tensor blk.0.attn_q.weight.lora_b has no blk.0.attn_q.weight.lora_a"
    )


def test_ranks_of_a_and_b_must_agree(tmp_path: Path, base: Path) -> None:
    tensors = lora_pair(Q, N_EMBD, N_EMBD, rank=4)
    tensors[Q + ".lora_b"] = np.zeros((N_EMBD, 8), np.float32)
    assert refused(adapter(tmp_path, tensors), base) == (
        ": blk.0.attn_q.weight.lora_a has rank 4 ([8, 4]) but blk.0.attn_q.weight.lora_b has "
        "rank 8 ([8, 8])"
    )


def test_a_tensor_that_is_no_lora_half_is_refused(tmp_path: Path, base: Path) -> None:
    tensors = lora_pair(Q, N_EMBD, N_EMBD) | {"blk.0.attn_q.weight": np.zeros((8, 8), np.float32)}
    assert refused(adapter(tmp_path, tensors), base) == (
        ": tensor blk.0.attn_q.weight is neither a .lora_a nor a .lora_b tensor"
    )


def test_an_adapter_with_no_pairs_is_refused(tmp_path: Path, base: Path) -> None:
    tensors = {"blk.0.attn_norm.weight": np.ones(N_EMBD, np.float32)}
    assert refused(adapter(tmp_path, tensors), base) == (
        ": has no .lora_a/.lora_b tensors: it modifies nothing"
    )


def test_an_alpha_that_is_not_float32_is_refused(tmp_path: Path, base: Path) -> None:
    """llama.cpp's gguf_get_val_f32 asserts the type: a float64 alpha aborts the process."""
    path = adapter(tmp_path, adapter__lora__alpha=(gguf.GGUFValueType.FLOAT64, 8.0))
    assert refused(path, base) == (
        ": adapter.lora.alpha is a float64, not a float32 (llama.cpp would abort reading it)"
    )


def test_a_general_type_that_is_not_a_string_is_refused(tmp_path: Path, base: Path) -> None:
    path = adapter(tmp_path, general__type=(gguf.GGUFValueType.UINT32, 7))
    assert refused(path, base) == (
        ": general.type is a uint32, not a string (llama.cpp would abort reading it)"
    )


def test_a_token_embd_pair_on_a_tied_output_is_refused(tmp_path: Path, base: Path) -> None:
    """Without output.weight the output matmul is token_embd.weight's, and finds the embedding
    layout's pair: ggml_mul_mat asserts in the first decode (seen with the pinned llama.cpp)."""
    tensors = {
        "token_embd.weight.lora_a": np.zeros((N_VOCAB, 4), np.float32),
        "token_embd.weight.lora_b": np.zeros((N_EMBD, 4), np.float32),
    }
    assert refused(adapter(tmp_path, tensors), base) == (
        ": modifies token_embd.weight, which this base model also uses as its output layer (it "
        "has no output.weight): llama.cpp would abort in the first decode"
    )


def test_a_token_embd_pair_with_disagreeing_ranks_is_refused(tmp_path: Path) -> None:
    """llama.cpp does not check these ranks at load; the first decode would assert."""
    base = write_gguf(tmp_path / "base.gguf", "llama", base_tensors(output=True), {})
    tensors = {
        "token_embd.weight.lora_a": np.zeros((N_VOCAB, 4), np.float32),
        "token_embd.weight.lora_b": np.zeros((N_EMBD, 2), np.float32),
    }
    assert refused(adapter(tmp_path, tensors), base) == (
        ": token_embd.weight.lora_a has rank 4 ([4, 32]) but token_embd.weight.lora_b has rank 2 "
        "([2, 8])"
    )


def test_a_three_dimensional_pair_on_a_matrix_is_refused(tmp_path: Path, base: Path) -> None:
    """llama.cpp loads it (it checks ne[0] and ne[1] only) and asserts in the first decode."""
    tensors = {
        Q + ".lora_a": np.zeros((2, 4, N_EMBD), np.float32),
        Q + ".lora_b": np.zeros((2, N_EMBD, 4), np.float32),
    }
    assert refused(adapter(tmp_path, tensors), base) == (
        ": tensor blk.0.attn_q.weight.lora_a has shape [8, 4, 2]; base blk.0.attn_q.weight is "
        "[8, 8] so lora_a must be [8, 4]"
    )


# -- not there, not GGUF --------------------------------------------------------------------------


def test_a_missing_adapter_or_base_is_file_not_found(tmp_path: Path, base: Path) -> None:
    missing = tmp_path / "none.gguf"
    with pytest.raises(FileNotFoundError) as caught:
        check_adapter(missing, base)
    assert str(caught.value) == f"[Errno 2] LoRA adapter not found: '{missing}'"
    with pytest.raises(FileNotFoundError) as caught:
        check_adapter(adapter(tmp_path), missing)
    assert str(caught.value) == f"[Errno 2] base model not found: '{missing}'"


def test_a_file_that_is_not_gguf_is_a_value_error(tmp_path: Path, base: Path) -> None:
    path = tmp_path / "adapter.safetensors"
    path.write_bytes(b'{"__metadata__": {}}' + bytes(64))
    with pytest.raises(GGUFError) as caught:
        check_adapter(path, base)
    assert isinstance(caught.value, ValueError)
    assert str(caught.value) == f"{path}: not a GGUF file (bad magic)"


def test_a_truncated_adapter_is_a_value_error(tmp_path: Path, base: Path) -> None:
    path = adapter(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 128])  # lora_b's data (8 x 4 f32) gone
    with pytest.raises(GGUFError) as caught:
        check_adapter(path, base)
    assert str(caught.value) == f"{path}: truncated (no data for tensor {Q}.lora_b)"


# -- merged models --------------------------------------------------------------------------------


def test_write_merged_adds_scale_alpha_over_rank_b_a_to_each_target(
    tmp_path: Path, base: Path
) -> None:
    lora = tmp_path / "a.gguf"
    synth_lora.write_lora(base, lora, rank=2, alpha=6.0, targets=("attn_q", "ffn_up"), seed=4)
    merged = tmp_path / "merged.gguf"
    synth_lora.write_merged(base, lora, 0.5, merged)
    weights = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(merged).tensors}
    halves = {t.name: np.asarray(t.data, np.float64) for t in gguf.GGUFReader(lora).tensors}
    originals = base_tensors()
    assert list(weights) == list(originals)  # every tensor, in the base's order
    for name, original in originals.items():
        want = original.astype(np.float64)
        if name in {f"blk.{i}.{t}.weight" for i in range(N_LAYER) for t in ("attn_q", "ffn_up")}:
            # numpy's B (n_out, 2) @ A (2, n_in): the weight's (n_out, n_in)
            want = want + 0.5 * 6.0 / 2 * (halves[name + ".lora_b"] @ halves[name + ".lora_a"])
        assert weights[name].dtype == np.float32
        np.testing.assert_allclose(weights[name], want, rtol=1e-6, atol=1e-7)
    fields = gguf.GGUFReader(merged).fields
    assert fields["general.name"].contents() == "tiny llama"
    assert fields["general.architecture"].contents() == "llama"


def test_write_f32_widens_f16_tensors_and_keeps_everything_else(tmp_path: Path) -> None:
    tensors = {k: v.astype(np.float16) if v.ndim == 2 else v for k, v in base_tensors().items()}
    src = write_gguf(tmp_path / "f16.gguf", "llama", tensors, {})
    dst = tmp_path / "f32.gguf"
    synth_lora.write_f32(src, dst)
    reader = gguf.GGUFReader(dst)
    assert {t.name: t.tensor_type for t in reader.tensors} == dict.fromkeys(
        tensors, gguf.GGMLQuantizationType.F32
    )
    for t in reader.tensors:
        np.testing.assert_array_equal(np.asarray(t.data), tensors[t.name].astype(np.float32))
    assert reader.fields["general.file_type"].contents() == 0  # LLAMA_FTYPE_ALL_F32
