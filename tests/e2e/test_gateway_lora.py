"""A LoRA adapter through the SMG gateway as a model of its own. The vLLM engine protocol has no
LoRA field (nor a model name): deploy.gateway's `loras` starts a replica with `--engine-lora a`,
which applies adapter a to every engine-protocol request and reports itself as model `base+a`
(GetModelInfo); SMG registers each worker under the name it reports and routes a request's `model`
to that name's workers. The synthetic f32 llama base and adapter a of llama_grpc_testkit.synth_lora
(test_lora.py checks that their greedy output is the merged model's); one replica per model."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from deploy.cluster import free_port
from deploy.gateway import NO_WARM_UP, QUICK_EXIT, Gateway, _http
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc import AsyncClient, Delta
from llama_grpc_server.rpc.vllm.convert import BASE_MODEL_SALT
from llama_grpc_testkit import synth_lora
from llama_grpc_testkit.threads import TEST_THREADS
from tests.support.vllm_engine_fake import announces, kv_until, stored_blocks

from .conftest import NO_DRAIN

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
MAX_TOKENS = 12
BLOCK = 16  # the KV events' block size (core.kv.events.BLOCK_SIZE)


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    base, adapter = synth_lora.lora_base_model(), synth_lora.lora_adapter("a")
    args = ("--model", str(base), "--model-name", "base", "--lora", f"a={adapter}",
            "--n-ctx", "2048", *NO_DRAIN)  # fmt: skip
    with Gateway(
        replicas=1,
        port=free_port(),
        server_args=args,
        loras=("a",),
        smg_args=(*NO_WARM_UP, *QUICK_EXIT),
        threads=TEST_THREADS,
    ) as gw:
        yield gw


def event_branches(gateway: Gateway) -> dict[str, float]:
    """SMG's cache_aware decisions so far, by branch (event_hit, event_miss, ...)."""
    prefix = 'smg_cache_aware_policy_branch_total{branch="'
    return {k[len(prefix) : -2]: v for k, v in gateway.metrics().items() if k.startswith(prefix)}


async def test_each_model_name_is_its_own_worker(gateway: Gateway) -> None:
    """The adapter's replica reports `base+a`, the base model's `base`; SMG lists both models
    and registers each worker under its own."""
    assert gateway.models == ("base", "base+a")
    [base_replica], [adapter_replica] = gateway.cluster.members, gateway.adapter_members
    names = {}
    for replica in (base_replica, adapter_replica):
        async with grpc.aio.insecure_channel(replica.target) as channel:
            info = await vpb_grpc.VllmEngineStub(channel).GetModelInfo(vpb.GetModelInfoRequest())
            names[replica.target] = info.served_model_name
    assert names == {base_replica.target: "base", adapter_replica.target: "base+a"}
    workers = _http(f"http://127.0.0.1:{gateway.port}/workers")["workers"]
    by_url = {w["url"]: w for w in workers}
    assert set(by_url) == {f"grpc://{r.target}" for r in gateway.members}
    assert by_url[f"grpc://{adapter_replica.target}"]["model_id"] == "base+a"
    assert by_url[f"grpc://{base_replica.target}"]["model_id"] == "base"


async def test_the_adapters_name_answers_as_v1_with_the_adapter(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """A greedy completion through SMG for `base+a` is v1's with params.lora = [a] (the same
    prompt ids: the gateway tokenizes as v1 does), and for `base` v1's without; the adapter
    changes the answer."""
    ids = await direct.tokenize(PROMPT)
    texts = {}
    for model, lora in (("base", None), ("base+a", "a")):
        expected: list[int] = []
        async for event in direct.generate_tokens(
            ids, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora=lora
        ):
            if isinstance(event, Delta):
                expected += event.token_ids
        answer = await sdk.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert answer.model == model
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
            len(ids),
            MAX_TOKENS,
        )
        texts[model] = answer.choices[0].text
        assert texts[model] == await direct.detokenize(expected), model
    assert texts["base"] != texts["base+a"]


async def test_the_adapters_prefixes_are_announced_as_the_models_own(
    sdk: Any, gateway: Gateway
) -> None:
    """The adapter replica's engine-protocol requests run under the adapter's cache scope; their
    blocks go out without a cache_salt, as the gateway's requests carry none, and a v1 request
    of the base model on that replica goes out salted BASE_MODEL_SALT. So SMG finds a repeated
    `base+a` prompt cached (an event hit), and the worker serves it from cache."""
    [adapter_replica] = gateway.adapter_members
    prompt = f"{uuid.uuid4().hex} The history of the primary colors, told rule by rule. " * 6
    before = event_branches(gateway)
    cached = []
    for _ in range(2):
        answer = await sdk.completions.create(
            model="base+a", prompt=prompt, max_tokens=1, temperature=0
        )
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] < BLOCK and cached[1] > 4 * BLOCK
    after = event_branches(gateway)
    assert after.get("event_hit", 0) - before.get("event_hit", 0) == 1

    async with (
        grpc.aio.insecure_channel(adapter_replica.target) as channel,
        AsyncClient(adapter_replica.target, timeout=60) as v1,
    ):
        stub = vpb_grpc.VllmEngineStub(channel)
        events = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
        await kv_until(events, lambda b: b.HasField("snapshot"))  # what it holds, then live
        base_ids = (await v1.tokenize(f"{uuid.uuid4().hex} " * 20))[: 2 * BLOCK + 3]
        async for _ in v1.generate_tokens(base_ids, max_tokens=1, temperature=0):
            pass
        adapter_ids = (await v1.tokenize(f"{uuid.uuid4().hex} " * 20))[: 2 * BLOCK + 3]
        request = vpb.GenerateRequest(
            request_id=uuid.uuid4().hex,
            tokenized=vpb.TokenizedInput(input_ids=adapter_ids),
            sampling_params=vpb.SamplingParams(temperature=0, max_tokens=1),
        )
        async for _ in stub.Generate(request):
            pass
        seen = await kv_until(events, announces(adapter_ids[BLOCK : 2 * BLOCK]))
        events.cancel()
    salts = {tuple(block.token_ids): stored.cache_salt for stored, block in stored_blocks(seen)}
    assert salts[tuple(base_ids[BLOCK : 2 * BLOCK])] == BASE_MODEL_SALT
    assert salts[tuple(adapter_ids[BLOCK : 2 * BLOCK])] == ""


async def test_embed_is_refused_on_an_adapter_replica(gateway: Gateway) -> None:
    """Embeddings apply no adapter: the adapter's replica refuses them rather than answer the
    base model's vector under the adapter's name."""
    [adapter_replica] = gateway.adapter_members
    async with grpc.aio.insecure_channel(adapter_replica.target) as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(
                vpb.EmbedRequest(request_id="e1", tokenized=vpb.TokenizedInput(input_ids=[1, 2]))
            )
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--engine-lora" in (caught.value.details() or "")
