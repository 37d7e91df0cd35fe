"""`make gateway` end to end: the official `openai` SDK through SMG to two real replicas over the
vLLM engine protocol (deploy/gateway.py), routed by SMG's cache_aware policy on the replicas'
own KV events (SubscribeKvEvents). The `gateway` group (smg, openai) comes with the dev group;
the gateway fetches the workers' exported tokenizer (llama_grpc_server.models.tokenizer_export)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from deploy.cluster import free_port
from deploy.gateway import NO_WARM_UP, QUICK_EXIT, Gateway
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc import AsyncClient, Delta
from llama_grpc_testkit.threads import TEST_THREADS

from ..conftest import PERSON_SCHEMA, check_person
from .conftest import NO_DRAIN

DOCS = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name three primary colors."}]
BLOCK = 16  # the KV events' block size (core.kv.events.BLOCK_SIZE), SMG's --block-size
QUESTIONS = ["What is two plus two?", "Name a color.", "Say hello.", "Count to three.",
             "Which planet is red?"]  # fmt: skip


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    # make gateway as it comes (the embedded model's family template), but SMG's mistral tool
    # parser, which sends structural tags for tools (test_structural_tag_* below)
    with Gateway(
        replicas=2,
        port=free_port(),
        # --batch-invariant: a greedy answer is the same through SMG and through v1 whatever
        # the replica's cache state and pass shapes (the gateway's readiness probe leaves a BOS
        # cached: without the mode the two doors' " red, ..." near tie went either way)
        server_args=(*NO_DRAIN, "--batch-invariant"),
        smg_args=(*NO_WARM_UP, *QUICK_EXIT),
        tool_parser="mistral",
        threads=TEST_THREADS,
    ) as gw:
        assert gw.policy == "cache_aware"  # make gateway's default
        yield gw


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def event_branches(gateway: Gateway) -> dict[str, float]:
    """SMG's cache_aware decisions so far, by branch (event_hit, event_miss, ...)."""
    prefix = 'smg_cache_aware_policy_branch_total{branch="'
    return {k[len(prefix) : -2]: v for k, v in gateway.metrics().items() if k.startswith(prefix)}


async def test_chat_plain_and_streamed_agree(sdk: Any, gateway: Gateway) -> None:
    params = {"model": gateway.model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    whole = await sdk.chat.completions.create(**params)
    assert whole.choices[0].message.content
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
    parts = []
    stream = await sdk.chat.completions.create(**params, stream=True)
    async for event in stream:
        if event.choices and event.choices[0].delta.content:
            parts.append(event.choices[0].delta.content)
    assert len(parts) > 1 and "".join(parts) == whole.choices[0].message.content


async def test_chat_prompt_is_the_one_v1_renders(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """The gateway renders the exported template: the same prompt tokens, so the same greedy
    answer, as v1 rendering the same messages."""
    ours = await direct.chat(MESSAGES, max_tokens=16, temperature=0, chat_template="gemma")
    theirs = await sdk.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=16, temperature=0
    )
    assert theirs.usage.prompt_tokens == ours.usage.prompt_tokens
    assert theirs.choices[0].message.content == ours.text


async def test_completions_give_v1s_greedy_text(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """The gateway tokenizes the prompt as v1 does (the exported tokenizer), so the greedy text
    is what v1 GenerateTokens makes of v1's ids (SMG takes no token-id prompts)."""
    ids = await direct.tokenize(PROMPT)
    expected: list[int] = []
    async for event in direct.generate_tokens(ids, max_tokens=16, temperature=0, ignore_eos=True):
        if isinstance(event, Delta):
            expected += event.token_ids
    answer = await sdk.completions.create(
        model=gateway.model,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].text == await direct.detokenize(expected)
    assert (answer.choices[0].finish_reason, answer.usage.completion_tokens) == ("length", 16)


async def test_stop_string_and_length(sdk: Any, gateway: Gateway) -> None:
    base = await sdk.completions.create(
        model=gateway.model, prompt=PROMPT, max_tokens=24, temperature=0
    )
    text = base.choices[0].text
    words = [w for w in text.split() if len(w) > 3]
    assert words, text
    stop = words[0]
    stopped = await sdk.completions.create(
        model=gateway.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    short = await sdk.completions.create(
        model=gateway.model, prompt=PROMPT, max_tokens=3, temperature=0
    )
    assert (short.choices[0].finish_reason, short.usage.completion_tokens) == ("length", 3)


async def test_json_schema_response_format(sdk: Any, gateway: Gateway) -> None:
    answer = await sdk.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=120,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
        },
    )
    check_person(json.loads(answer.choices[0].message.content))


async def test_logprobs_and_n(sdk: Any, gateway: Gateway) -> None:
    answer = await sdk.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    two = await sdk.completions.create(
        model=gateway.model, prompt=PROMPT, max_tokens=6, temperature=0.9, seed=3, n=2
    )
    assert sorted(c.index for c in two.choices) == [0, 1]


async def test_completion_logprobs_are_dropped_by_smg(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """Pins SMG 1.13.0's limitation (docs/deployment.md): it asks the worker for the logprobs
    (sampling_params.logprobs 2) and gets them, 2 alternatives per token, but its /v1/completions
    answer has none (`logprobs: None`, a TODO in its completion processor)."""
    answer = await sdk.completions.create(
        model=gateway.model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2
    )
    # The words are not pinned: with logprobs asked, SMG's greedy answers were " red, yellow"
    # and " red, blue" (unary and streamed, two replicas) even with --batch-invariant, where
    # v1 gave " red, blue" (left for a later look: docs/batch-invariance.md's uncovered case?)
    assert answer.choices[0].text.startswith(" red,")
    assert answer.choices[0].logprobs is None
    stream = await sdk.completions.create(
        model=gateway.model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, stream=True
    )
    chunks = [chunk async for chunk in stream if chunk.choices]
    assert "".join(c.choices[0].text for c in chunks).startswith(" red,")
    assert [c.choices[0].logprobs for c in chunks] == [None] * len(chunks)
    ids = await direct.tokenize(PROMPT)
    async with grpc.aio.insecure_channel(gateway.cluster.members[0].target) as channel:
        request = vpb.GenerateRequest(
            request_id=uuid.uuid4().hex,
            tokenized=vpb.TokenizedInput(input_ids=ids),
            sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=3, logprobs=2),
        )
        [message] = [m async for m in vpb_grpc.VllmEngineStub(channel).Generate(request)]
    logprobs = message.complete.output_logprobs
    assert len(logprobs.token_logprobs) == 3
    assert [len(top.values) for top in logprobs.top_logprobs] == [2, 2, 2]


async def test_tool_choice_required_is_a_structural_tag_the_worker_obeys(
    sdk: Any, gateway: Gateway
) -> None:
    """SMG's mistral tool parser turns tool_choice "required" into a structural_tag (triggered
    tags "[TOOL_CALLS] [" + calls + "]", at_least_one): the worker's grammar starts the answer
    with a call whose arguments follow the tool's schema. Greedy Gemma 3 270M would call the
    tool again and again (the separator is always allowed), so the stop string cuts after the
    first call; SMG's parser wants the closing "]", so the call stays in `content`."""
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    answer = await sdk.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": weather}}],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        stop=[", {"],
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}'
    )


async def test_a_repeated_long_prefix_is_cached(sdk: Any, gateway: Gateway) -> None:
    """Of replicas + 1 identical requests, every one after the first goes where the prompt is
    cached (the first finds at most the BOS the worker puts in front and the uuid's first tokens,
    which an earlier prompt can share by chance); the worker computes at least the last prompt
    token again."""
    prompt = f"{uuid.uuid4().hex} " + PROMPT * 30
    cached, lengths = [], []
    for _ in range(gateway.replicas + 1):
        answer = await sdk.completions.create(
            model=gateway.model, prompt=prompt, max_tokens=2, temperature=0
        )
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        lengths.append(answer.usage.prompt_tokens)
    assert cached[0] < BLOCK
    assert cached[1:] == [lengths[0] - 1] * gateway.replicas


def gemma_prompt(system: str, question: str) -> str:
    """What the gemma template (core.requests.chat.GEMMA) renders for a system message and a
    question."""
    return f"<bos><start_of_turn>user\n{system}\n\n{question}<end_of_turn>\n<start_of_turn>model\n"


async def test_chats_go_where_their_system_prompt_is_cached(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """No session header: a chat with a long system prompt, then more with the same system
    prompt and other questions. cache_aware on the workers' KV events sends each later one to
    the replica holding the system prompt, so each finds every token it shares with an earlier
    one cached (round robin would send every other one to the replica without it); SMG's own
    counters show one event hit per later request."""
    system = f"{uuid.uuid4().hex} " + " ".join(
        f"Rule {i}: answer politely and mention the number {i * 7} when it helps."
        for i in range(20)
    )
    before = event_branches(gateway)
    seen: list[list[int]] = []
    for i, question in enumerate(QUESTIONS):
        ids = await direct.tokenize(
            gemma_prompt(system, question), add_special=False, parse_special=True
        )
        answer = await sdk.chat.completions.create(
            model=gateway.model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=1,
            temperature=0,
        )
        assert answer.usage.prompt_tokens == len(ids)  # the rendering above is SMG's
        cached = answer.usage.prompt_tokens_details.cached_tokens
        if i == 0:
            assert cached < BLOCK  # the template's first tokens, shared with earlier chats
        else:
            expected = max(common_prefix(ids, earlier) for earlier in seen)
            assert expected >= len(system) // 8  # the whole system prompt, about 300 tokens
            assert cached == expected, (i, cached, expected)
        seen.append(ids)
    after = event_branches(gateway)
    assert after.get("event_hit", 0) - before.get("event_hit", 0) == len(QUESTIONS) - 1
    assert sum(after.values()) - sum(before.values()) == len(QUESTIONS)


async def test_completions_go_where_their_prefix_is_cached(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """The same for /v1/completions, whose ids SMG sends without the BOS the worker puts in
    front: the workers announce every BOS-led sequence without its BOS too, so SMG's blocks of
    [t1 ..] match (core.kv.events.KvEventPublisher)."""
    head = f"{uuid.uuid4().hex} The history of the primary colors, told rule by rule. " * 12
    before = event_branches(gateway)
    seen: list[list[int]] = []
    for i, question in enumerate(QUESTIONS):
        prompt = f"{head}Question: {question} Answer:"
        ids = await direct.tokenize(prompt)  # with the BOS, as the worker runs it
        answer = await sdk.completions.create(
            model=gateway.model, prompt=prompt, max_tokens=1, temperature=0
        )
        assert answer.usage.prompt_tokens == len(ids)
        cached = answer.usage.prompt_tokens_details.cached_tokens
        if i == 0:
            # the BOS and, by chance, the uuid's first token, shared with an earlier prompt
            assert cached < BLOCK
        else:
            expected = max(common_prefix(ids, earlier) for earlier in seen)
            assert expected > 10 * BLOCK
            assert cached == expected, (i, cached, expected)
        seen.append(ids)
    after = event_branches(gateway)
    assert after.get("event_hit", 0) - before.get("event_hit", 0) == len(QUESTIONS) - 1
    assert sum(after.values()) - sum(before.values()) == len(QUESTIONS)


async def test_closing_a_stream_frees_the_slot(sdk: Any, gateway: Gateway) -> None:
    stream = await sdk.completions.create(
        model=gateway.model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    received = 0
    async for _ in stream:
        received += 1
        if received == 3:
            break
    await stream.close()
    clients = [AsyncClient(r.target, timeout=10) for r in gateway.cluster.members]
    try:
        for _ in range(40):
            busy = [(await c.stats()).active_slots for c in clients]
            if not any(busy):
                break
            await asyncio.sleep(0.05)
        assert not any(busy), busy
    finally:
        for client in clients:
            await client.aclose()


async def test_bad_input_is_a_400_naming_it_and_the_gateway_keeps_serving(
    sdk: Any, gateway: Gateway
) -> None:
    """Through the gateway's door: a constraint the worker refuses (INVALID_ARGUMENT) reaches the
    SDK as a 400 with the worker's words; the same replicas answer the next request."""
    for _ in range(gateway.replicas):
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(
                model=gateway.model, messages=MESSAGES, max_tokens=4,
                extra_body={"regex": "a(?=b)"},
            )  # fmt: skip
        assert caught.value.body["message"].endswith(
            "the regex uses a lookahead at position 1, which cannot be compiled to a grammar"
        )
    answer = await sdk.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=3, temperature=0
    )
    assert answer.usage.completion_tokens == 3


async def test_smg_holds_one_event_stream_per_worker(gateway: Gateway) -> None:
    """After every test above (run last in this module): SMG subscribed to each worker's
    SubscribeKvEvents once, has never had to reconnect, resync (but for the first snapshot) or
    recover a gap, applied batches with blocks from both, and logged no error.

    Each worker first gets a prompt of its own, sent to it directly: the tests above go through
    SMG's routing, which on a loaded machine (another test worker beside this one) once sent
    every one of them to the same replica, and the other had published no block at all."""
    applied = 'smg_kv_event_batches_total{{worker="grpc://{}",disposition="applied"}}'
    for replica in gateway.cluster.members:
        async with AsyncClient(replica.target, timeout=60) as client:
            prompt = f"{uuid.uuid4().hex} A prompt of a few blocks for this worker alone. " * 4
            await client.generate(prompt, max_tokens=1)
        for _ in range(200):  # SMG applies the batch a moment later
            if gateway.metrics().get(applied.format(replica.target), 0) > 0:
                break
            await asyncio.sleep(0.05)
    metrics = gateway.metrics()
    for replica in gateway.cluster.members:
        worker = f'worker="grpc://{replica.target}"'

        def sample(name: str, labels: str = "", worker: str = worker) -> float:
            return metrics[f"{name}{{{worker}{labels}}}"]

        assert sample("smg_kv_event_subscriptions_total") == 1
        for reason in ("intern_failed", "join_error", "panic"):
            assert sample("smg_kv_event_subscription_failures_total", f',reason="{reason}"') == 0
        for reason in ("data_loss", "gap_cleared", "out_of_range", "publisher_restart"):
            assert sample("smg_kv_event_resyncs_total", f',reason="{reason}"') == 0
        assert sample("smg_kv_event_resyncs_total", ',reason="snapshot"') == 1
        assert sample("smg_kv_event_missed_batches_total") == 0
        assert sample("smg_kv_event_batches_total", ',disposition="applied"') > 0
        assert sample("smg_kv_event_batches_total", ',disposition="load_only"') > 0
    raw = (gateway.workdir / "smg.log").read_bytes()[gateway.ready_log_offset :]
    log = re.sub(r"\x1b\[[0-9;]*m", "", raw.decode(errors="replace"))
    # SMG logs each 400 it answers (the bad-input test's refusals) as an error; nothing else
    # since the gateway was ready (its 503s to the readiness probe before are not errors here)
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert [line for line in errors if "status=400 Bad Request" not in line] == []


def test_the_docs_chat_example_runs_as_written(gateway: Gateway) -> None:
    """docs/deployment.md's OpenAI chat example, after a plain `make gateway` (no
    --chat-template: the embedded model gets its family's built-in), run as a user would, the
    only change being the gateway's port; it prints the answer and its usage."""
    text = DOCS.read_text()
    after = text[text.index("```sh\nmake gateway   #") :]
    code = re.search(r"```python\n(.*?)```", after, re.S)
    assert code is not None and "127.0.0.1:8080" in code.group(1)
    script = code.group(1).replace("127.0.0.1:8080", f"127.0.0.1:{gateway.port}")
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "CompletionUsage(completion_tokens=" in done.stdout
    assert "prompt_tokens=" in done.stdout
