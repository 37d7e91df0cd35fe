"""Every RPC through a real grpc.aio server and the real client, with the embedded model (the
tests that do not read the words: the tiny synthetic one)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from llama_grpc import (
    AsyncClient,
    ContextLengthExceededError,
    DeadlineExceededError,
    Delta,
    Done,
    InvalidArgumentError,
    LlamaGrpcError,
    ModelNotFoundError,
    RequestIdInFlightError,
)
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer

PROMPT = "The three primary colors are"


async def collect(stream: Any) -> tuple[str, list[int], Done]:
    text, ids, done = "", [], None
    async for event in stream:
        if isinstance(event, Delta):
            text += event.text
            ids += event.token_ids
        else:
            done = event
    assert isinstance(done, Done)
    return text, ids, done


async def idle_slots(client: AsyncClient, n: int, within_s: float = 10.0) -> bool:
    for _ in range(int(within_s / 0.05)):
        if (await client.stats()).active_slots == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_unary_equals_stream(tiny_client: AsyncClient) -> None:
    """Generate and StreamGenerate give the same text, tokens, finish reason and usage. (Both
    uncached: the same forward passes, so the tiny model's near ties fall the same way.)"""
    client, same = tiny_client, {"max_tokens": 16, "ignore_eos": True, "cache_prompt": False}
    whole = await client.generate(PROMPT, **same)
    text, ids, done = await collect(client.stream(PROMPT, **same))
    assert whole.text == text and list(whole.token_ids) == ids and len(ids) == 16
    assert whole.finish_reason == done.finish_reason == "max_tokens"
    assert whole.usage.prompt_tokens == done.usage.prompt_tokens > 0
    assert whole.usage.completion_tokens == done.usage.completion_tokens == 16
    assert whole.request_id and done.request_id and whole.request_id != done.request_id


async def test_generate_tokens_equals_stream(tiny_client: AsyncClient) -> None:
    """The pre-tokenized path (client-side token ids) gives the text path's tokens."""
    client = tiny_client
    ids = await client.tokenize(PROMPT, add_special=True)
    assert ids[0] == (await client.model_info()).bos_token_id
    same = {"max_tokens": 12, "ignore_eos": True, "cache_prompt": False}  # the same passes
    _, via_text, _ = await collect(client.stream(PROMPT, **same))
    text, via_ids, done = await collect(client.generate_tokens(ids, **same))
    assert via_ids == via_text and done.usage.prompt_tokens == len(ids)
    assert text == await client.detokenize(via_ids)


async def test_cancel_mid_stream_frees_slot_and_keeps_serving(client: AsyncClient) -> None:
    """Closing a stream after a few deltas frees its slot promptly; others are served."""
    before = (await client.stats()).requests_cancelled
    stream = client.stream(PROMPT, max_tokens=2000, ignore_eos=True)
    seen = 0
    async for event in stream:
        assert isinstance(event, Delta)
        seen += 1
        if seen == 3:
            break
    await stream.aclose()
    assert await idle_slots(client, 0, within_s=5.0), "slot freed after cancel"
    stats = await client.stats()
    assert stats.requests_cancelled == before + 1
    assert stats.generated_tokens < 2000 * 2
    assert (await client.generate(PROMPT, max_tokens=4)).usage.completion_tokens >= 1


async def test_deadline_exceeded_then_healthy(client: AsyncClient) -> None:
    """A deadline shorter than the work ends the call with DEADLINE_EXCEEDED; serving goes on."""
    with pytest.raises(DeadlineExceededError):
        await client.generate(PROMPT, max_tokens=3000, ignore_eos=True, timeout=0.5)
    assert await idle_slots(client, 0), "the expired request's slot was freed"
    assert await client.health() == "SERVING"


@pytest.mark.parametrize(
    ("params", "error", "field"),
    [
        ({"temperature": -1.0}, InvalidArgumentError, "params.sampling.temperature"),
        ({"top_p": 1.5}, InvalidArgumentError, "params.sampling.top_p"),
        ({"max_tokens": 0}, InvalidArgumentError, "params.stopping.max_tokens"),
        ({"stop": ["x"] * 17}, InvalidArgumentError, "params.stopping.stop"),
        ({"stop": ["ok", ""]}, InvalidArgumentError, "params.stopping.stop[1]"),
        ({"stop_token_ids": [10**7]}, InvalidArgumentError, "params.stopping.stop_token_ids[0]"),
        ({"max_tokens": 4000}, ContextLengthExceededError, "params.stopping.max_tokens"),
        ({"model": "no-such-model"}, ModelNotFoundError, "model"),
        ({"session_id": "s" * 1000}, InvalidArgumentError, "session_id"),
    ],
)
async def test_bad_input_gets_clear_status(
    client: AsyncClient, params: dict[str, Any], error: type[LlamaGrpcError], field: str
) -> None:
    """Each bad field: the right code, the field named in BadRequest, for unary and stream."""
    with pytest.raises(error) as unary:
        await client.generate(PROMPT * 40, **params)
    assert unary.value.field == field, unary.value
    assert unary.value.code != "UNKNOWN"
    with pytest.raises(error) as streamed:
        await collect(client.stream(PROMPT * 40, **params))
    assert streamed.value.field == field


async def test_bad_token_ids_and_too_long_prompt(client: AsyncClient) -> None:
    """Out-of-vocabulary ids name token_ids; a prompt filling the context names both numbers."""
    with pytest.raises(InvalidArgumentError) as bad:
        await collect(client.generate_tokens([2, 262144]))
    assert bad.value.field == "token_ids[1]"
    with pytest.raises(ContextLengthExceededError) as long:
        await collect(client.generate_tokens([2] + [1000] * 4200))
    assert "4201" in long.value.message and "4096" in long.value.message
    assert await client.health() == "SERVING"


async def test_empty_nan_and_oversize_inputs(client: AsyncClient) -> None:
    """An empty prompt, a NaN temperature and a message over the size limit get clear codes."""
    with pytest.raises(InvalidArgumentError) as empty:
        await client.generate("")
    assert empty.value.field == "prompt"
    with pytest.raises(InvalidArgumentError) as nan:
        await client.generate(PROMPT, temperature=float("nan"))
    assert nan.value.field == "params.sampling.temperature"
    with pytest.raises(LlamaGrpcError) as huge:
        await client.generate("x" * (17 * 1024 * 1024))
    assert huge.value.code == "RESOURCE_EXHAUSTED"
    assert (await client.generate(PROMPT, max_tokens=2)).usage.completion_tokens >= 1


async def test_concurrent_streams_share_the_batch(tiny_client: AsyncClient) -> None:
    """16 streams on 4 slots: all finish with exact counts; ticks carried several requests.
    (The tiny model decodes a token in well under a millisecond: 256 tokens each keep the 16
    requests, sent together, overlapping.)"""
    client, n = tiny_client, 256
    before = await client.stats()
    results = await asyncio.gather(
        *(
            collect(client.stream(f"Story number {i}:", max_tokens=n, ignore_eos=True))
            for i in range(16)
        )
    )
    assert [len(ids) for _, ids, _ in results] == [n] * 16
    assert all(done.finish_reason == "max_tokens" for _, _, done in results)
    after = await client.stats()
    ticks = after.ticks - before.ticks
    tokens = after.generated_tokens - before.generated_tokens
    assert tokens == 16 * n
    assert tokens / ticks > 2, "decode tokens of several slots share a forward pass"


async def test_multi_turn_chat_reuses_growing_prefix(tiny_client: AsyncClient) -> None:
    """A 4-turn chat resending the whole history: cached_prompt_tokens grows every turn."""
    client = tiny_client
    history = "A conversation between a curious user and a helpful assistant.\n"
    cached = []
    for turn in ["Hi!", "What is a star?", "How far is the nearest one?", "Thanks!"]:
        history += f"User: {turn}\nAssistant:"
        result = await client.generate(history, max_tokens=16, stop=["\n"], session_id="chat-e2e")
        cached.append(result.usage.cached_prompt_tokens)
        history += result.text + "\n"
    assert all(b > a for a, b in itertools.pairwise(cached)), cached
    assert cached[-1] > 40


async def test_stats_model_info_and_health(client: AsyncClient, server: RunningServer) -> None:
    info = await client.model_info()
    assert info.n_vocab == 262144 and info.n_ctx == 4096
    stats = await client.stats()
    assert stats.n_parallel == 4 and len(stats.slots) == 4
    assert stats.batch_strategy == "decode_maximal"
    assert await client.health() == "SERVING"
    assert await client.health("llama_grpc.v1.LlmService") == "SERVING"


async def test_reused_request_id_in_flight_is_already_exists(client: AsyncClient) -> None:
    """A caller reusing one x-request-id on two concurrent calls: the second is refused with
    ALREADY_EXISTS, the first completes, and the id is free again afterwards."""
    metadata = [("x-request-id", "dup-e2e-1")]
    first = client.stream(PROMPT, max_tokens=24, ignore_eos=True, metadata=metadata)
    events = [await first.__anext__()]
    with pytest.raises(RequestIdInFlightError) as dup:
        await client.generate(PROMPT, max_tokens=4, metadata=metadata)
    assert dup.value.code == "ALREADY_EXISTS" and dup.value.reason == "REQUEST_ID_IN_FLIGHT"
    assert dup.value.field == "x-request-id"
    events += [event async for event in first]
    assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 24
    again = await client.generate(PROMPT, max_tokens=4, metadata=metadata)
    assert again.request_id == "dup-e2e-1"
