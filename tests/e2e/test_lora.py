"""LoRA adapters over gRPC on a real llama.cpp model, no download: a synthetic llama-architecture
model in f32 (llama_grpc_testkit.synth_lora), random adapters in convert_lora_to_gguf.py's layout,
and the same low-rank updates merged into copies of the base. Greedy output with adapter X at scale
s is the merged model's, token for token, alone and in a batch beside base-model streams and another
adapter's; a prefix computed under one adapter set is never served to another (slots and the RAM
tier), and is reused for its own; adapters load, list, count and unload over the admin RPCs."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.config.settings import LoraSpec
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_testkit import synth_gguf, synth_lora

from .conftest import loaded_server, settings

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 16
# Prompts of ordinary token ids of the Llama 3 vocabulary (the base is random: any ids will do).
PROMPTS = [
    [128000, *range(1000, 1012)],
    [128000, *range(5000, 5020, 2)],
    [128000, *range(20000, 20016)],
]
LONG_PROMPT = list(range(30000, 30065))  # no BOS: no prefix shared with other tests' prompts


@dataclasses.dataclass(frozen=True)
class Case:
    adapter: str  # "" = the base model
    scale: float | None = None  # None: the adapter's default


def lora_models() -> dict[str, Path]:
    return {
        "base": synth_lora.lora_base_model(),
        "a": synth_lora.lora_adapter("a"),
        "b": synth_lora.lora_adapter("b"),
    }


def params(case: Case, max_tokens: int = MAX_TOKENS) -> pb.GenerationParams:
    message = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )
    if case.adapter:
        entry = message.lora.add(name=case.adapter)
        if case.scale is not None:
            entry.scale = case.scale
    return message


async def generate(
    stub: pb_grpc.LlmServiceStub, prompt: list[int], case: Case, max_tokens: int = MAX_TOKENS
) -> tuple[list[int], pb.GenerationDone]:
    request = pb.GenerateTokensRequest(token_ids=prompt, params=params(case, max_tokens))
    tokens: list[int] = []
    done = pb.GenerationDone()
    async for message in stub.GenerateTokens(request):
        if message.HasField("delta"):
            tokens += message.delta.token_ids
        else:
            done = message.done
    assert len(tokens) == max_tokens
    return tokens, done


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    return lora_models()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def lora_server(models: dict[str, Path]) -> AsyncIterator[RunningServer]:
    conf = settings(str(models["base"]), n_parallel=4, n_ctx=2048, prompt_cache_ram_mb=0)
    loras = (LoraSpec("a", str(models["a"])), LoraSpec("b", str(models["b"]), 1.0))
    conf = dataclasses.replace(conf, model=dataclasses.replace(conf.model, loras=loras))
    async with loaded_server(conf) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def stub(lora_server: RunningServer) -> AsyncIterator[pb_grpc.LlmServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{lora_server.port}") as channel:
        yield pb_grpc.LlmServiceStub(channel)


async def reference(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of `path` (no adapters), one prompt at a time."""
    async with (
        loaded_server(settings(str(path), n_parallel=1, n_ctx=2048)) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        stub = pb_grpc.LlmServiceStub(channel)
        return [(await generate(stub, p, Case("")))[0] for p in prompts]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def merged() -> dict[tuple[str, float], list[list[int]]]:
    """The merged models' greedy outputs for PROMPTS: adapter a at 1 and 0.5, b at 1."""
    out: dict[tuple[str, float], list[list[int]]] = {}
    for name, scale in (("a", 1.0), ("a", 0.5), ("b", 1.0)):
        out[name, scale] = await reference(synth_lora.lora_merged(name, scale), PROMPTS)
    return out


async def test_adapter_output_is_the_merged_models_alone(
    stub: pb_grpc.LlmServiceStub, merged: dict[tuple[str, float], list[list[int]]]
) -> None:
    base = [(await generate(stub, p, Case("")))[0] for p in PROMPTS]
    for (name, scale), expected in merged.items():
        got = [(await generate(stub, p, Case(name, scale)))[0] for p in PROMPTS]
        assert got == expected, (name, scale)
        assert got != base, (name, scale)  # the adapter changes the answer
    # the adapter's default scale (1 for both): the same as naming it
    assert [(await generate(stub, p, Case("a")))[0] for p in PROMPTS] == merged["a", 1.0]


async def test_adapter_output_is_the_merged_models_in_a_batch(
    stub: pb_grpc.LlmServiceStub, merged: dict[tuple[str, float], list[list[int]]]
) -> None:
    base = [(await generate(stub, p, Case("")))[0] for p in PROMPTS]
    cases = [
        (0, Case("a", 1.0), merged["a", 1.0][0]),
        (1, Case(""), base[1]),
        (2, Case("b", 1.0), merged["b", 1.0][2]),
        (0, Case("b", 1.0), merged["b", 1.0][0]),
        (1, Case("a", 0.5), merged["a", 0.5][1]),
        (2, Case(""), base[2]),
        (2, Case("a", 1.0), merged["a", 1.0][2]),
        (0, Case(""), base[0]),
    ]
    got = await asyncio.gather(*(generate(stub, PROMPTS[i], case) for i, case, _ in cases))
    assert [tokens for tokens, _ in got] == [expected for _, _, expected in cases]


async def test_a_prefix_cached_under_one_adapter_set_is_reused_by_that_set_only(
    stub: pb_grpc.LlmServiceStub,
) -> None:
    cached = []
    for case in (Case("a"), Case("b"), Case(""), Case("a", 0.5), Case("a"), Case("b")):
        _, done = await generate(stub, LONG_PROMPT, case, max_tokens=2)
        cached.append(done.usage.cached_prompt_tokens)
    # a, b, base and a at another scale each compute the prompt; a and b again reuse theirs
    assert cached == [0, 0, 0, 0, len(LONG_PROMPT) - 1, len(LONG_PROMPT) - 1]


async def test_the_ram_tier_keeps_adapter_sets_apart(models: dict[str, Path]) -> None:
    """One slot: each request evicts the last one's cache into the RAM tier, from where only a
    request of the same adapter set restores it."""
    conf = settings(str(models["base"]), n_parallel=1, n_ctx=2048, prompt_cache_ram_mb=64)
    loras = (LoraSpec("a", str(models["a"])), LoraSpec("b", str(models["b"])))
    conf = dataclasses.replace(conf, model=dataclasses.replace(conf.model, loras=loras))
    async with (
        loaded_server(conf) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        ram_stub = pb_grpc.LlmServiceStub(channel)
        cached = []
        for case in (Case("a"), Case("b"), Case("a"), Case("b"), Case("")):
            _, done = await generate(ram_stub, LONG_PROMPT, case, max_tokens=2)
            cached.append(done.usage.cached_prompt_tokens)
        stats = await ram_stub.GetStats(pb.GetStatsRequest())
    n = len(LONG_PROMPT) - 1
    assert cached == [0, 0, n, n, 0]
    assert stats.ram_cache_hits == 2


async def test_unknown_adapters_and_bad_scales_name_the_field(
    stub: pb_grpc.LlmServiceStub,
) -> None:
    for case, field, words in (
        (Case("nope"), "params.lora[0].name", "unknown adapter 'nope' (this model serves: a, b)"),
        (Case("a", 40.0), "params.lora[0].scale", "within [-16, 16]"),
        (Case("bad name"), "params.lora[0].name", "an adapter name is 1-64 letters"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate(stub, PROMPTS[0], case)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (caught.value.details() or "")
        assert field in str(caught.value.trailing_metadata())


async def test_load_list_use_count_and_unload_an_adapter(
    stub: pb_grpc.LlmServiceStub, merged: dict[tuple[str, float], list[list[int]]]
) -> None:
    path = str(synth_lora.lora_adapter("a"))
    loaded = await stub.LoadAdapter(pb.LoadAdapterRequest(name="a2", path=path, default_scale=0.5))
    assert (loaded.adapter.name, loaded.adapter.rank, loaded.adapter.alpha) == ("a2", 4, 8.0)
    assert loaded.adapter.default_scale == 0.5
    listed = await stub.ListAdapters(pb.ListAdaptersRequest())
    assert [a.name for a in listed.adapters] == ["a", "a2", "b"]
    # a2 is a's file: at its default scale 0.5 it is merged a at 0.5
    got, _ = await generate(stub, PROMPTS[1], Case("a2"))
    assert got == merged["a", 0.5][1]
    stats = await stub.GetStats(pb.GetStatsRequest())
    a2 = next(a for a in stats.adapters if a.name == "a2")
    assert (a2.requests, a2.generated_tokens) == (1, MAX_TOKENS)
    assert a2.passes == MAX_TOKENS  # one prompt pass (whose logits gave the first token) + 15

    # unloaded while a stream runs: that stream finishes with it, later requests are refused
    stream = asyncio.ensure_future(generate(stub, PROMPTS[2], Case("a2"), max_tokens=64))
    while not (await stub.GetStats(pb.GetStatsRequest())).active_slots:
        await asyncio.sleep(0.01)
    unloaded = await stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a2"))
    assert unloaded.in_flight == 1
    tokens, done = await stream
    assert done.finish_reason == pb.FINISH_REASON_MAX_TOKENS and len(tokens) == 64
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub, PROMPTS[0], Case("a2"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    listed = await stub.ListAdapters(pb.ListAdaptersRequest())
    assert [a.name for a in listed.adapters] == ["a", "b"]
    # the name is free again
    again = await stub.LoadAdapter(pb.LoadAdapterRequest(name="a2", path=path))
    assert again.adapter.default_scale == 1.0
    await stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a2"))


def other_architecture_adapter(tmp: Path) -> Path:
    """An adapter written for the tiny Gemma 3 model: another architecture."""
    path = tmp / "gemma-adapter.gguf"
    synth_lora.write_lora(synth_gguf.shape_model("tiny"), path, rank=2, alpha=2.0)
    return path


async def test_an_adapter_of_another_model_is_refused_naming_the_mismatch(
    stub: pb_grpc.LlmServiceStub, tmp_path: Path
) -> None:
    path = other_architecture_adapter(tmp_path)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.LoadAdapter(pb.LoadAdapterRequest(name="g", path=str(path)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "gemma3" in (caught.value.details() or "")
    assert "llama" in (caught.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.LoadAdapter(pb.LoadAdapterRequest(name="g", path=str(tmp_path / "none")))
    assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not found" in (missing.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as taken:
        await stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path=str(path)))
    assert taken.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # and the server serves on
    assert len((await generate(stub, PROMPTS[0], Case("a")))[0]) == MAX_TOKENS
