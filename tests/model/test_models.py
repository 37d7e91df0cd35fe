"""The model catalog on real files: the embedded model's header, and the second test model
(the embedded one re-quantized to Q8_0) read by header and run by `models verify`; an engine's
forward passes leave a loading model a core."""

from __future__ import annotations

from pathlib import Path

import pytest

from llama_grpc_server.config import ModelSettings, num_cpus
from llama_grpc_server.core.scheduling.plan import Chunk, StepPlan
from llama_grpc_server.engine import cpu_share, offload
from llama_grpc_server.engine.llama import LlamaModel
from llama_grpc_server.engine.runner import Runner
from llama_grpc_server.models import cli as models_cli
from llama_grpc_server.models.files import default_model_path, file_sha256
from llama_grpc_server.models.gguf_header import read_header


def test_embedded_model_header() -> None:
    """gemma3, a 32k training context, Q4_K_M, 268M parameters (llama.cpp counts the same:
    see the verify test). This GGUF carries no chat template (nor does ModelInfo say so)."""
    header = read_header(default_model_path())
    assert header.architecture == "gemma3"
    assert header.context_length == 32768
    assert header.quantization == "Q4_K_M"
    assert header.n_params == 268_098_176
    assert not header.has_chat_template


def test_second_model_is_a_requantized_copy(second_model_path: Path) -> None:
    embedded, second = read_header(default_model_path()), read_header(second_model_path)
    assert second.quantization == "Q8_0"
    assert second.architecture == embedded.architecture
    assert second.n_params == embedded.n_params
    assert second.file_size != embedded.file_size


@pytest.mark.usefixtures("restore_logging")
def test_verify_runs_the_second_model_with_auto_gpu_layers(
    second_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`models verify PATH --sha256 ... --n-gpu-layers auto`: hash matches, loads, generates 4
    tokens, exit 0; llama.cpp counts the parameters the header reader does; auto resolves to 0
    layers on a CPU-only build of llama.cpp."""
    argv = ["verify", str(second_model_path), "--sha256", file_sha256(second_model_path)]
    assert models_cli.main([*argv, "--n-gpu-layers", "auto"]) == 0
    out = capsys.readouterr().out
    assert "(matches)" in out and out.endswith("ok\n")
    assert f"{read_header(second_model_path).n_params} parameters)" in out
    tokens = next(line for line in out.splitlines() if line.startswith("tokens:"))
    assert len(tokens.split(",")) == 4
    if not offload.llama_cpp.llama_supports_gpu_offload():
        assert "(n_gpu_layers=0, " in out


def test_forward_passes_leave_a_loading_model_a_core() -> None:
    """With a thread per CPU (the default), a forward pass while a load is in progress runs
    with one thread fewer (at least one), and the first one after the load with all again."""
    model = LlamaModel(ModelSettings(n_ctx=512, n_batch=512), str(default_model_path()), 1)
    runner = Runner(model)
    cpus = num_cpus()
    tokens = tuple(model.tokenize("Hello there", add_special=True, parse_special=False))

    def feed(pos: int) -> None:
        runner.execute(
            StepPlan(tick=pos, chunks=(Chunk(0, "", pos, tokens[pos : pos + 1], False),))
        )

    try:
        assert model.current_threads() == (cpus, cpus)
        feed(0)
        assert model.current_threads() == (cpus, cpus)
        with cpu_share.loading():
            assert model.current_threads() == (cpus, cpus)  # applied at the next pass
            feed(1)
            assert model.current_threads() == (max(1, cpus - 1),) * 2
        feed(2)
        assert model.current_threads() == (cpus, cpus)
    finally:
        runner.close()
        model.close()
