"""Where a multi-turn chat spends its time, with and without the prefix cache: the realistic
workload of issue 16 (a 500-token system prompt, 4 turns of ~30 user words, 64-token answers,
each turn resending the whole history as token ids), per turn: prompt tokens, cached tokens, and
the server's own prefill and decode times. Three modes take turns in every repetition, each with
its own text:

- cache: the prefix cache on (the default), the system prompt never seen before;
- cache_warm_system: the same, after one request carried the system prompt (what every
  conversation but the first sees when many share one system prompt);
- no_cache: cache_prompt=false on every turn.

Then one conversation through the chat API (messages rendered by the chat template on the server,
the assistant's earlier answers sent back as text): how many of each turn's prompt tokens were
cached, to show whether re-rendering and re-tokenizing the history changes earlier tokens.

The ceiling: no cache can remove decode time. If every prompt token were free (even the new
user tokens, which no cache can hold), a chat would take only its decode time; the no-cache
time over that is the most any cache could give here.

    python bench/chat_turns.py --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import (
    DEFAULT_THREADS,
    finish_facts,
    llama_grpc_server,
    machine_facts,
    progress,
    seeded_text,
    server_args,
    spread,
    write_json,
)

from llama_grpc import AsyncClient, Done

SYSTEM_TOKENS = 500
TURNS = 4
USER_WORDS = 30
ANSWER_TOKENS = 64
MODES = ("cache", "cache_warm_system", "no_cache")


async def answer(client: AsyncClient, ids: list[int], cache_prompt: bool) -> tuple[Done, list[int]]:
    done = None
    stream = client.generate_tokens(
        ids, max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True, cache_prompt=cache_prompt
    )
    tokens: list[int] = []
    async for event in stream:
        if isinstance(event, Done):
            done = event
        else:
            tokens += event.token_ids
    assert done is not None
    return done, tokens


async def system_prompt(client: AsyncClient, seed: int) -> list[int]:
    ids = await client.tokenize(seeded_text(SYSTEM_TOKENS, seed))
    return ids[:SYSTEM_TOKENS]


async def conversation(client: AsyncClient, mode: str, seed: int) -> dict[str, Any]:
    history = await system_prompt(client, seed)
    cache = mode != "no_cache"
    if mode == "cache_warm_system":
        await answer(client, history, True)  # another conversation with this system prompt
    turns = []
    for turn in range(TURNS):
        user = await client.tokenize(
            f"\nUser: {seeded_text(USER_WORDS, seed * 10 + turn)}\nAssistant:", add_special=False
        )
        history = history + user
        done, tokens = await answer(client, history, cache)
        t = done.timings
        turns.append(
            {
                "prompt_tokens": len(history),
                "cached_prompt_tokens": done.usage.cached_prompt_tokens,
                "queue_ms": t.queue_ms,
                "prefill_ms": t.prefill_ms,
                "decode_ms": t.decode_ms,
                "total_ms": t.total_ms,
            }
        )
        history = history + tokens
    return {"mode": mode, "turns": turns, "total_ms": sum(t["total_ms"] for t in turns)}


async def chat_api(client: AsyncClient, seed: int) -> list[dict[str, int]]:
    """The chat API: the history as messages, answers sent back as text."""
    messages = [{"role": "system", "content": seeded_text(350, seed)}]
    out = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": seeded_text(USER_WORDS, seed * 10 + turn)})
        result = await client.chat(
            messages,
            max_tokens=ANSWER_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            chat_template="gemma",  # the embedded model's GGUF carries none
        )
        out.append(
            {
                "prompt_tokens": result.usage.prompt_tokens,
                "cached_prompt_tokens": result.usage.cached_prompt_tokens,
            }
        )
        messages.append({"role": "assistant", "content": result.text})
    return out


async def measure(target: str, reps: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    async with AsyncClient(target, timeout=600) as client:
        await answer(client, await system_prompt(client, 1), True)  # warm-up
        for rep in range(reps):
            order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
            for i, mode in enumerate(order):
                run = await conversation(client, mode, seed=100 + rep * 10 + i)
                runs[mode].append(run)
                progress(f"rep {rep + 1}/{reps} {mode:<18}: {run['total_ms'] / 1000:.2f} s")
        chat = await chat_api(client, seed=999)
    return {"runs": runs, "chat_api": chat}


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    runs = result["runs"]
    no_cache = runs["no_cache"]
    prefill_rate = statistics.median(
        t["prompt_tokens"] / t["prefill_ms"] for r in no_cache for t in r["turns"]
    )  # tokens per ms, computing the whole prompt
    out: dict[str, Any] = {"prefill_tokens_per_s": prefill_rate * 1000, "modes": {}}
    base_total = statistics.median(r["total_ms"] for r in no_cache)
    base_later = statistics.median(sum(t["total_ms"] for t in r["turns"][1:]) for r in no_cache)
    for mode in MODES:
        rs = runs[mode]
        total = statistics.median(r["total_ms"] for r in rs)
        later = statistics.median(sum(t["total_ms"] for t in r["turns"][1:]) for r in rs)
        per_turn = [
            {key: statistics.median(r["turns"][i][key] for r in rs) for key in rs[0]["turns"][i]}
            for i in range(TURNS)
        ]
        # the ceiling: every prompt token free, only this mode's decoding left
        decode = [t["decode_ms"] for t in per_turn]
        out["modes"][mode] = {
            "total_s": spread([r["total_ms"] / 1000 for r in rs]),
            "speedup": base_total / total,
            "speedup_turns_2_to_4": base_later / later,
            "bound": base_total / sum(decode),
            "bound_turns_2_to_4": base_later / sum(decode[1:]),
            "decode_share": sum(t["decode_ms"] for t in per_turn)
            / sum(t["total_ms"] for t in per_turn),
            "per_turn": per_turn,
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = parser.parse_args()
    facts = machine_facts(args.threads)
    with llama_grpc_server(*server_args(args.threads, "--n-parallel", "4")) as target:
        result = asyncio.run(measure(target, args.reps))
    data = {
        "command": "python bench/chat_turns.py " + " ".join(sys.argv[1:]),
        "machine": facts,
        "workload": {
            "system_tokens": SYSTEM_TOKENS,
            "turns": TURNS,
            "user_words": USER_WORDS,
            "answer_tokens": ANSWER_TOKENS,
            "reps": args.reps,
        },
        "result": result,
        "analysis": analyse(result),
    }
    write_json("chat_turns", finish_facts(data))
    for mode, m in data["analysis"]["modes"].items():
        progress(
            f"{mode:<18} total {m['total_s']['median']:.2f} s  x{m['speedup']:.2f} "
            f"(turns 2-4 x{m['speedup_turns_2_to_4']:.2f}); bound x{m['bound']:.2f} "
            f"(turns 2-4 x{m['bound_turns_2_to_4']:.2f}); decode share {m['decode_share']:.0%}"
        )
    for i, t in enumerate(result["chat_api"]):
        progress(f"chat API turn {i + 1}: {t['cached_prompt_tokens']}/{t['prompt_tokens']} cached")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
