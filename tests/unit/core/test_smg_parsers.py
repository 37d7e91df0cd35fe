"""deploy/smg_parsers.py: the SMG tool-call and reasoning parsers `make gateway` picks from the chat
templates of real models (llama.cpp's own copies, llama_grpc_testkit.llama_sdist), each one a name
SMG's own argument parser accepts; and deploy.gateway's check of a model before it starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from deploy import smg_parsers
from deploy.gateway import check_model

from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES
from llama_grpc_testkit import llama_sdist

# llama.cpp's template file -> (tool parser, reasoning parser)
EXPECTED = {
    "Qwen-Qwen3-0.6B": ("qwen", "qwen3"),
    "Qwen-Qwen2.5-7B-Instruct": ("qwen", "passthrough"),
    "Qwen3.5-4B": ("qwen_xml", "qwen3"),
    "Qwen3-Coder": ("qwen_xml", "passthrough"),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama", "passthrough"),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama", "passthrough"),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama", "passthrough"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("deepseek", "deepseek_r1"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("deepseek", "deepseek_r1"),
    "microsoft-Phi-3.5-mini-instruct": ("json", "passthrough"),
    "google-gemma-4-31B-it": ("gemma4", "gemma4"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", "passthrough"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("qwen", "passthrough"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parsers_read_off_real_templates(name: str) -> None:
    chosen = smg_parsers.choose(llama_sdist.template(name))
    assert (chosen.tool, chosen.reasoning) == EXPECTED[name]
    assert chosen.why


def test_builtin_gemma_template_and_no_template() -> None:
    gemma = smg_parsers.choose(BUILTIN_TEMPLATES["gemma"])
    assert (gemma.tool, gemma.reasoning) == ("json", "passthrough")
    none = smg_parsers.choose(None)
    assert (none.tool, none.reasoning) == ("json", "passthrough")
    assert smg_parsers.choose(None).smg_args() == [
        "--tool-call-parser", "json", "--reasoning-parser", "passthrough",
    ]  # fmt: skip


def test_every_choice_is_a_parser_smg_accepts() -> None:
    """SMG's own argument parser (the smg wheel) takes each name the module can choose."""
    from smg.launch_router import parse_router_args

    names = {(p.tool, p.reasoning) for p in map(smg_parsers.choose, (
        llama_sdist.template(n) for n in EXPECTED))}  # fmt: skip
    for tool, reasoning in names:
        assert tool is not None and reasoning is not None
        args = parse_router_args(["--tool-call-parser", tool, "--reasoning-parser", reasoning])
        assert (args.tool_call_parser, args.reasoning_parser) == (tool, reasoning)


def test_overrides() -> None:
    chosen = smg_parsers.choose(llama_sdist.template("Qwen-Qwen3-0.6B"))
    assert smg_parsers.with_overrides(chosen, None, None) is chosen
    forced = smg_parsers.with_overrides(chosen, "hermes", "none")
    assert (forced.tool, forced.reasoning) == ("hermes", None)
    assert forced.smg_args() == ["--tool-call-parser", "hermes"]
    assert forced.why.endswith("overridden")


def _unexportable(path: Path) -> Path:
    """A GGUF whose tokenizer model llama.cpp knows but no HuggingFace export can be (RWKV's
    trie tokenizer), with nothing else in it."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_tokenizer_model("rwkv")
    writer.add_token_list([b"a", b"b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def test_check_model_refuses_an_unexportable_tokenizer_by_name(tmp_path: Path) -> None:
    model = _unexportable(tmp_path / "rwkv.gguf")
    with pytest.raises(RuntimeError, match=r"rwkv\.gguf: its tokenizer cannot be exported for "
                       r"the gateway.*'rwkv' is not supported"):  # fmt: skip
        check_model(["--model", str(model)], {"XDG_CACHE_HOME": str(tmp_path)})


def test_check_model_names_bad_options() -> None:
    with pytest.raises(RuntimeError, match="the replicas' options"):
        check_model(["--no-such-option"], {})


def test_make_gateway_stops_at_once_naming_the_reason(tmp_path: Path) -> None:
    """`make gateway MODEL=FILE` on a model whose tokenizer cannot be exported exits 1 with the
    reason, before any replica or SMG starts (it used to wait 180 s, then say only that the
    gateway was not ready: the subprocess's 120 s timeout would fail this test)."""
    model = _unexportable(tmp_path / "rwkv.gguf")
    done = subprocess.run(
        [sys.executable, "-m", "deploy.gateway", "--replicas", "1", "--", "--model", str(model)],
        check=False, capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[3], env={"XDG_CACHE_HOME": str(tmp_path),
                                                     "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "not started: " in done.stderr
    assert "its tokenizer cannot be exported for the gateway" in done.stderr
    assert "'rwkv' is not supported" in done.stderr
