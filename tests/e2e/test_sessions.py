"""Chat sessions sharing a long system prompt, through a real server with default flags (4 slots,
the RAM tier on by default): every later turn finds its whole history cached, whether the
sessions fit the slots (3) or not (12, restored from the RAM tier). Cache accounting, not words:
on the tiny synthetic model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from llama_grpc import AsyncClient, Delta, Done
from llama_grpc_server.config import ModelSettings, ServerSettings, Settings
from llama_grpc_server.core.kv.prefix_cache import common_prefix_length
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_testkit.threads import TEST_THREADS

SYSTEM = (
    "You are the support assistant of a small bakery. Answer politely and briefly, in plain "
    "sentences. Opening hours: Monday to Friday 7 to 18, Saturday 8 to 13, closed on Sunday. "
    "We sell sourdough, rye, spelt and white bread, croissants, cinnamon rolls and three cakes "
    "of the day. Orders for more than ten items need a day's notice. "
)
QUESTIONS = ("When do you open?", "Do you have rye?", "Can I order cakes?", "Thanks, bye!")
ANSWER_TOKENS = 8
# Customers' names start their turns with different tokens, so a first turn shares exactly the
# system prompt and the turn header with every other conversation, wherever that is cached.
NAMES = ("Anna", "Boris", "Chen", "Dmitri", "Emma", "Farid", "Greta", "Hiro", "Ines", "Jonas",
         "Kira", "Liam")  # fmt: skip


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def client(tiny_model_path: Path) -> AsyncIterator[AsyncClient]:
    # default flags but the model and llama.cpp's threads (TEST_THREADS)
    model = ModelSettings(model_path=str(tiny_model_path), n_threads=TEST_THREADS)
    conf = Settings(model=model, server=ServerSettings(port=0, grace_s=1.0))
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        async with AsyncClient(f"127.0.0.1:{running.port}", timeout=300) as c:
            yield c


async def turn(client: AsyncClient, session: str, prompt: list[int]) -> tuple[list[int], int]:
    ids: list[int] = []
    done = None
    stream = client.generate_tokens(
        prompt, session_id=session, max_tokens=ANSWER_TOKENS, ignore_eos=True, temperature=0.0
    )
    async for event in stream:
        if isinstance(event, Delta):
            ids += event.token_ids
        else:
            done = event
    assert isinstance(done, Done) and len(ids) == ANSWER_TOKENS
    return ids, done.usage.cached_prompt_tokens


async def chat(client: AsyncClient, num_sessions: int) -> None:
    """Sessions take turns (s0, s1, ..., then s0's second turn, ...), each resending its whole
    history as token ids. A first turn finds the longest prefix any earlier turn computed (the
    system prompt: copied, never taking another session's slot); every later turn finds its
    whole history: the previous prompt and answer but the answer's last token (sampled, never
    decoded)."""
    system = await client.tokenize(SYSTEM * 4, add_special=True)  # the tiny model's tokens
    assert 900 <= len(system) <= 1200, len(system)
    history = [list(system) for _ in range(num_sessions)]
    computed: list[list[int]] = []  # every turn's computed tokens so far
    for t, question in enumerate(QUESTIONS):
        for n in range(num_sessions):
            text = f"<start_of_turn>user\n{NAMES[n]}: {question}<end_of_turn>\n"
            user = await client.tokenize(text + "<start_of_turn>model\n", add_special=False)
            prompt = history[n] + user
            answer, cached = await turn(client, f"s{n}", prompt)
            if t == 0:
                expected = max((common_prefix_length(c, prompt) for c in computed), default=0)
            else:
                expected = len(history[n]) - 1
            assert cached == expected, (n, t, cached, expected, len(prompt))
            history[n] = prompt + answer
            computed.append(history[n][:-1])


async def test_three_sessions_sharing_a_system_prompt_keep_their_histories(
    client: AsyncClient,
) -> None:
    """Fewer sessions than slots: each keeps a slot of its own (the RAM tier is not needed)."""
    await client.clear_cache()
    hits = (await client.stats()).ram_cache_hits
    await chat(client, 3)
    assert (await client.stats()).ram_cache_hits == hits


async def test_twelve_sessions_on_four_slots_get_their_histories_back_from_ram(
    client: AsyncClient,
) -> None:
    """Three times more sessions than slots: each later turn's history comes back whole from the
    RAM tier (on by default), 3 later turns x 12 sessions."""
    await client.clear_cache()
    hits = (await client.stats()).ram_cache_hits
    await chat(client, 12)
    assert (await client.stats()).ram_cache_hits - hits == 3 * 12
