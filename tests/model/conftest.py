"""One real engine (embedded Gemma 3 270M) shared by the model tests."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from llama_grpc_server.config import ModelSettings, SchedulerSettings, Settings
from llama_grpc_server.core.requests.request import (
    Event,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
    TokenDelta,
    TokenLogprob,
)
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_testkit.models import tiny_model_file
from llama_grpc_testkit.threads import TEST_THREADS

_ids = itertools.count()

# Test-only: run the model tier with layers offloaded to a GPU (e.g. -1 = all) on a CUDA build of
# llama-cpp-python. Unset (CI, CPU-only): 0, the ModelSettings default.
N_GPU_LAYERS = int(os.environ.get("LLAMA_GRPC_TEST_N_GPU_LAYERS", "0"))


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: Event | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked

    @property
    def finished(self) -> Finished:
        assert isinstance(self.final, Finished), self.final
        return self.final


def make_engine(
    model_path: str = "",
    n_threads: int = TEST_THREADS,
    *,
    draft_model: str = "",
    batch_invariant: bool = False,
    **scheduler: object,
) -> EngineLoop:
    """An engine on the embedded model (or model_path), llama.cpp on TEST_THREADS threads (0: the
    default, one per CPU), with a draft model if given. The RAM tier is 512 MiB unless given
    (tests/e2e/conftest.settings: the automatic size is per engine, and a worker holds several
    engines)."""
    scheduler.setdefault("prompt_cache_ram_mb", 512)
    settings = Settings(
        model=ModelSettings(
            model_path=model_path,
            n_ctx=scheduler.pop("n_ctx", 4096),  # type: ignore[arg-type]
            n_batch=512,
            n_threads=n_threads,
            n_gpu_layers=N_GPU_LAYERS,
            draft_model=draft_model,
            batch_invariant=batch_invariant,
        ),
        scheduler=SchedulerSettings(**scheduler),  # type: ignore[arg-type]
    )
    return build_engine(settings)


@pytest.fixture(scope="session")
def engine() -> Iterator[EngineLoop]:
    eng = make_engine(n_parallel=4)
    yield eng
    eng.close()


def make_tiny_engine(*, draft_model: str = "", **scheduler: object) -> EngineLoop:
    """An engine on the tiny synthetic model (llama_grpc_testkit.models.tiny_model_file): for the
    tests of token flow, limits and cancellation, which do not read the words."""
    return make_engine(str(tiny_model_file()), draft_model=draft_model, **scheduler)


@pytest.fixture(scope="session")
def tiny_engine() -> Iterator[EngineLoop]:
    eng = make_tiny_engine(n_parallel=4)
    yield eng
    eng.close()


def request(
    engine: EngineLoop,
    prompt: str | list[int],
    *,
    max_tokens: int = 24,
    temperature: float = 0.0,
    seed: int | None = None,
    stop: tuple[str, ...] = (),
    cache_prompt: bool = True,
    cache_scope: str = "",
    ignore_eos: bool = True,
) -> GenerationRequest:
    tokens = (
        engine.tokenize(prompt, add_special=True, parse_special=False)
        if isinstance(prompt, str)
        else prompt
    )
    return GenerationRequest(
        request_id=f"t{next(_ids)}",
        prompt_tokens=tuple(tokens),
        sampling=SamplingParams(temperature=temperature, seed=seed),
        stopping=StoppingParams(max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos),
        cache_prompt=cache_prompt,
        cache_scope=cache_scope,
    )


async def run(engine: EngineLoop, req: GenerationRequest) -> Outcome:
    out = Outcome()
    async for event in engine.submit(req):
        if isinstance(event, TokenDelta):
            out.token_ids += event.token_ids
            out.text += event.text
            out.logprobs += event.logprobs
        else:
            out.final = event
    return out


async def run_all(engine: EngineLoop, reqs: list[GenerationRequest]) -> list[Outcome]:
    return list(await asyncio.gather(*(run(engine, r) for r in reqs)))


async def wait_idle(engine: EngineLoop, within_s: float = 60.0) -> None:
    """Until no slot is active (a cancelled or finished request's slot is released on the
    engine thread's next tick: polled, never assumed after a fixed sleep)."""
    for _ in range(int(within_s / 0.02)):
        if engine.stats().active_slots == 0 and engine.stats().queue_depth == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine was still busy after {within_s} s")


__all__ = [
    "Failed",
    "Outcome",
    "make_engine",
    "make_tiny_engine",
    "request",
    "run",
    "run_all",
    "wait_idle",
]
