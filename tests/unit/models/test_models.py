"""models.ModelPool with FakeEngines built by a scripted factory (no model, no grpc): names,
single-flight loads, LRU within the limits, busy models never evicted, draining against
starvation, deadlines while loading, UnloadModel refusals and force, failed loads and engines."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from llama_grpc_server import errors
from llama_grpc_server.config import ModelSettings, PoolSettings, Settings
from llama_grpc_server.core import stats
from llama_grpc_server.core.requests.request import (
    Failed,
    Finished,
    GenerationRequest,
    StoppingParams,
)
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME
from llama_grpc_server.models.pool import (
    RESCAN_INTERVAL_S,
    ModelPool,
    ModelSpec,
    PoolLimits,
    directory_models,
    model_specs,
    settings_for,
)
from llama_grpc_server.testing import FakeEngine, encode, fake_model_info
from tests.support.scheduler import GREEDY

SPECS = [
    ModelSpec("a", "/models/a.gguf", 100),
    ModelSpec("b", "/models/b.gguf", 200),
    ModelSpec("c", "/models/c.gguf", 300),
]


class Factory:
    """Builds a FakeEngine per load (named after its spec), counting loads; a load blocks while
    `gate` is closed, and raises `fail` when set."""

    def __init__(self, token_delay_s: float = 0.0) -> None:
        self.loads: list[str] = []
        self.engines: dict[str, list[FakeEngine]] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Exception | None = None
        self.token_delay_s = token_delay_s

    def __call__(self, spec: ModelSpec) -> FakeEngine:
        self.loads.append(spec.name)
        assert self.gate.wait(10), "the test never opened the gate"
        if self.fail is not None:
            raise self.fail
        info = dataclasses.replace(fake_model_info(), model_name=spec.name, model_path=spec.path)
        engine = FakeEngine(info, token_delay_s=self.token_delay_s)
        self.engines.setdefault(spec.name, []).append(engine)
        return engine

    def engine(self, name: str) -> FakeEngine:
        return self.engines[name][-1]


@pytest.fixture
def factory() -> Factory:
    return Factory()


def make_pool(factory: Factory, max_models: int = 0, max_bytes: int = 0) -> ModelPool:
    return ModelPool(SPECS, factory, PoolLimits(max_models, max_bytes))


@pytest.fixture
async def pool(factory: Factory) -> AsyncIterator[ModelPool]:
    made = make_pool(factory, max_models=1)
    yield made
    await made.close()


def states(pool: ModelPool) -> dict[str, str]:
    return {s.name: s.state for s in pool.statuses()}


def soon(seconds: float) -> float:
    return time.monotonic() + seconds


async def settle(condition: Callable[[], bool], polls: int = 200) -> None:
    """Let other tasks (and load threads) run until `condition` holds."""
    for _ in range(polls):
        if condition():
            return
        await asyncio.sleep(0.01)
    assert condition()


def generation(rid: str, text: str = "hello", max_tokens: int = 50) -> GenerationRequest:
    return GenerationRequest(rid, tuple(encode(text)), GREEDY, StoppingParams(max_tokens))


# -- names ----------------------------------------------------------------------------------------


async def test_unknown_model_is_not_found_listing_the_names(pool: ModelPool) -> None:
    with pytest.raises(errors.ModelNotFound) as caught:
        async with pool.lease("gpt-5"):
            pass
    assert caught.value.field == "model"
    assert "available: a, b, c" in caught.value.message
    assert caught.value.metadata == {"model": "gpt-5", "available": "a, b, c"}


async def test_a_model_put_into_models_dir_after_start_is_served(
    factory: Factory, tmp_path: Path
) -> None:
    """A *.gguf copied into --models-dir and a catalog.toml name added after start are found
    by ListModels and by a request naming them; names and paths already served are not added
    twice; an unknown name still gets NOT_FOUND, listing the new names."""
    (tmp_path / "b.gguf").write_bytes(b"b")
    scan = directory_models(str(tmp_path))
    pool = ModelPool([SPECS[0], *scan()], factory, PoolLimits(1), discover=scan)
    try:
        assert [s.name for s in pool.statuses()] == ["a", "b"]
        (tmp_path / "late.gguf").write_bytes(b"late model")
        async with pool.lease("late") as engine:
            assert engine.model_info.model_path == str(tmp_path / "late.gguf")
        (tmp_path / "catalog.toml").write_text(
            f'[models.other]\npath = "{tmp_path / "elsewhere.gguf"}"\n'
        )
        listed = {s.name: s for s in pool.statuses()}
        assert list(listed) == ["a", "b", "late", "other"]
        assert listed["late"].size_bytes == len(b"late model")
        assert listed["other"].state == "unloaded"
        await asyncio.sleep(RESCAN_INTERVAL_S)  # the last miss rescanned: the next may again
        with pytest.raises(errors.ModelNotFound) as caught:
            async with pool.lease("never"):
                pass
        assert "available: a, b, late, other" in caught.value.message
    finally:
        await pool.close()


async def test_unknown_names_rescan_at_most_once_a_second(factory: Factory) -> None:
    """A flood of requests for unknown models lists the directory once, not per request; an
    unreadable directory is a NOT_FOUND like any unknown name, never an error of its own."""
    scans: list[float] = []

    def scan() -> list[ModelSpec]:
        scans.append(time.monotonic())
        raise OSError("gone")

    pool = ModelPool(SPECS, factory, discover=scan)
    try:
        for i in range(50):
            with pytest.raises(errors.ModelNotFound):
                pool.status(f"unknown-{i}")
        assert len(scans) == 1
    finally:
        await pool.close()


@pytest.mark.parametrize("name", ["", "a", "/models/a.gguf", "a.gguf"])
async def test_a_model_is_named_by_name_path_or_file_name(pool: ModelPool, name: str) -> None:
    """Empty means the default (the first) model."""
    async with pool.lease(name) as engine:
        assert engine.model_info.model_name == "a"


async def test_resident_does_not_load(pool: ModelPool, factory: Factory) -> None:
    """GetStats/ClearCache read a loaded model only: MODEL_NOT_LOADED names its state."""
    with pytest.raises(errors.ModelNotLoaded, match="'b' is unloaded"):
        pool.resident("b")
    assert factory.loads == []
    await pool.load("b")
    assert pool.resident("b") is factory.engine("b")


# -- loading --------------------------------------------------------------------------------------


async def test_requests_for_one_unloaded_model_share_one_load(
    pool: ModelPool, factory: Factory
) -> None:
    """Two requests (and a third while loading) for the same model: one load, all served."""
    factory.gate.clear()
    got: list[str] = []

    async def use() -> None:
        async with pool.lease("b") as engine:
            got.append(engine.model_info.model_name)

    tasks = [asyncio.create_task(use()) for _ in range(2)]
    await settle(lambda: factory.loads == ["b"])
    assert states(pool)["b"] == "loading"
    assert pool.status("b").waiting == 2
    load = pool._find("b").load_task
    assert load is not None and not load.done()
    tasks.append(asyncio.create_task(use()))
    # the third request waits for the load under way (not one of its own, nor after it): the
    # same load task, still blocked on the gate, and nobody served before it opens
    await settle(lambda: pool.status("b").waiting == 3)
    assert pool._find("b").load_task is load and not load.done() and factory.loads == ["b"]
    assert not any(task.done() for task in tasks)
    factory.gate.set()
    await asyncio.gather(*tasks)
    assert got == ["b", "b", "b"] and factory.loads == ["b"]
    assert pool.status("b").loads == 1 and pool.status("b").load_seconds > 0


async def test_deadline_while_loading_is_deadline_exceeded(
    pool: ModelPool, factory: Factory
) -> None:
    """The wait is bounded by the request's deadline; the load itself goes on and serves the
    next request."""
    factory.gate.clear()
    started = time.monotonic()
    with pytest.raises(errors.DeadlineExceeded, match="waiting for model 'b' to load"):
        async with pool.lease("b", soon(0.2)):
            pass
    assert 0.15 < time.monotonic() - started < 2
    assert states(pool)["b"] == "loading"
    factory.gate.set()
    async with pool.lease("b", soon(5)) as engine:
        assert engine.model_info.model_name == "b"
    assert factory.loads == ["b"]


async def test_a_failed_load_reaches_every_waiter_and_the_next_request_retries(
    pool: ModelPool, factory: Factory
) -> None:
    factory.gate.clear()
    factory.fail = OSError("bad file")

    async def use() -> None:
        async with pool.lease("b"):
            pass

    tasks = [asyncio.create_task(use()) for _ in range(2)]
    await settle(lambda: factory.loads == ["b"])
    factory.gate.set()
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        assert isinstance(outcome, errors.ModelLoadFailed)
        assert "OSError: bad file" in outcome.message
    status = pool.status("b")
    assert (status.state, status.last_error) == ("unloaded", "OSError: bad file")
    factory.fail = None
    async with pool.lease("b") as engine:
        assert engine.model_info.model_name == "b"
    assert factory.loads == ["b", "b"]


async def test_a_model_larger_than_max_loaded_bytes_is_refused(factory: Factory) -> None:
    pool = make_pool(factory, max_bytes=250)
    try:
        with pytest.raises(errors.FailedPrecondition, match="larger than --max-loaded-bytes"):
            await pool.load("c")
        assert factory.loads == []
    finally:
        await pool.close()


# -- room -----------------------------------------------------------------------------------------


async def test_lru_evicts_the_least_recently_used_idle_model(factory: Factory) -> None:
    """max 2: a, b loaded; a used again; c's load unloads b (the least recently used)."""
    pool = make_pool(factory, max_models=2)
    try:
        await pool.load("a")
        await pool.load("b")
        async with pool.lease("a"):
            pass
        await pool.load("c")
        assert states(pool) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert factory.engine("b").is_closed and not factory.engine("a").is_closed
    finally:
        await pool.close()
    assert all(e.is_closed for engines in factory.engines.values() for e in engines)


async def test_max_loaded_bytes_evicts_until_the_model_fits(factory: Factory) -> None:
    """500 bytes: a (100) + b (200) fit; c (300) needs b gone too (a + c = 400)."""
    pool = make_pool(factory, max_bytes=500)
    try:
        await pool.load("b")
        await pool.load("a")
        await pool.load("c")
        assert states(pool) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    finally:
        await pool.close()


async def test_a_busy_model_is_never_evicted(pool: ModelPool, factory: Factory) -> None:
    """max 1: while a request holds a, b's load waits (here past its deadline) and a stays."""
    async with pool.lease("a"):
        with pytest.raises(errors.DeadlineExceeded):
            await pool.load("b", soon(0.3))
        assert states(pool)["a"] == "loaded"
        assert not factory.engine("a").is_closed
    # nobody waits for b any more: its load is abandoned before reading anything
    await settle(lambda: states(pool) == {"a": "loaded", "b": "unloaded", "c": "unloaded"})
    assert factory.loads == ["a"]


async def test_alternating_requests_with_one_slot_for_models_all_succeed(
    pool: ModelPool, factory: Factory
) -> None:
    """max 1, requests alternating a, b, a, b concurrently: every one is served, by its own
    model, and at most one model is resident at any time."""
    resident_counts: list[int] = []

    async def use(name: str) -> str:
        async with pool.lease(name, soon(20)) as engine:
            resident_counts.append(sum(1 for s in pool.statuses() if s.state == "loaded"))
            stream = engine.submit(generation(f"{name}-{time.monotonic_ns()}", name * 3))
            async for event in stream:
                if isinstance(event, Finished):
                    return engine.model_info.model_name
        raise AssertionError("no Finished")

    names = ["a", "b"] * 6
    served = await asyncio.gather(*(use(n) for n in names))
    assert served == names
    assert max(resident_counts) == 1


async def test_draining_lets_a_waiting_model_in_under_steady_traffic(
    pool: ModelPool, factory: Factory
) -> None:
    """max 1, a busy without pause (a new lease always taken before the last is released): a
    load of b drains a (new requests for a wait), so b is served instead of starving."""
    stop = asyncio.Event()
    a_leases = 0

    async def steady_a() -> None:
        """Leases of a that overlap: the next is asked for before the current is released."""
        nonlocal a_leases
        current = contextlib.AsyncExitStack()
        await current.enter_async_context(pool.lease("a"))
        while not stop.is_set():
            following = contextlib.AsyncExitStack()
            taking = asyncio.create_task(following.enter_async_context(pool.lease("a", soon(30))))
            await asyncio.sleep(0.02)
            await current.aclose()
            await taking
            current = following
            a_leases += 1
        await current.aclose()

    traffic = asyncio.create_task(steady_a())
    await settle(lambda: a_leases >= 2)
    async with pool.lease("b", soon(10)) as engine:
        assert engine.model_info.model_name == "b"
        assert factory.engines["a"][0].is_closed
        assert states(pool)["a"] == "loading"  # its waiting request's load waits for room
    stop.set()
    await asyncio.wait_for(traffic, 10)  # a's waiting request got a again after b
    assert factory.loads == ["a", "b", "a"]


# -- unloading ------------------------------------------------------------------------------------


async def test_unload_refuses_a_busy_model_unless_forced(factory: Factory) -> None:
    """A request in flight: MODEL_BUSY; force ends it with MODEL_UNLOADED and unloads."""
    factory.token_delay_s = 0.05
    pool = make_pool(factory)
    try:
        async with pool.lease("b") as engine:
            stream = engine.submit(generation("r1", max_tokens=200))
            first = await anext(aiter(stream))
            assert not isinstance(first, Failed)
            with pytest.raises(errors.ModelBusy, match="1 request"):
                await pool.unload("b")
            unloading = asyncio.create_task(pool.unload("b", force=True))
            events = [event async for event in stream]
        status, cancelled = await asyncio.wait_for(unloading, 10)
        assert isinstance(events[-1], Failed)
        assert isinstance(events[-1].error, errors.ModelUnloaded)
        assert (status.state, cancelled) == ("unloaded", 1)
        assert factory.engine("b").is_closed
    finally:
        await pool.close()


async def test_unload_idle_and_unloaded_models(pool: ModelPool, factory: Factory) -> None:
    await pool.load("b")
    status, cancelled = await pool.unload("b")
    assert (status.state, cancelled) == ("unloaded", 0)
    assert await pool.unload("b") == (status, 0)  # a no-op
    async with pool.lease("b"):  # loads it again
        pass
    assert factory.loads == ["b", "b"]


async def test_unload_while_loading_is_busy(pool: ModelPool, factory: Factory) -> None:
    factory.gate.clear()
    loading = asyncio.create_task(pool.load("b"))
    await settle(lambda: factory.loads == ["b"])
    with pytest.raises(errors.ModelBusy, match="loading"):
        await pool.unload("b", force=True)
    factory.gate.set()
    await loading


# -- failures -------------------------------------------------------------------------------------


class Dying(Factory):
    """Engines whose failure listeners the test calls (as a dying engine thread would)."""

    def __init__(self) -> None:
        super().__init__()
        self.listeners: dict[str, list[Callable[[str], None]]] = {}

    def __call__(self, spec: ModelSpec) -> FakeEngine:
        engine = super().__call__(spec)
        engine.on_failure = lambda listener: self.listeners.setdefault(spec.name, []).append(
            listener
        )  # type: ignore[method-assign]
        return engine


async def test_a_failed_non_default_engine_is_unloaded_and_reloaded_on_demand() -> None:
    factory = Dying()
    pool = ModelPool(SPECS, factory, PoolLimits())
    try:
        await pool.load("a")
        await pool.load("b")
        assert "a" not in factory.listeners, "the default's failure is the server's"
        (listener,) = factory.listeners["b"]
        threading.Thread(target=listener, args=("RuntimeError: boom",)).start()
        await settle(lambda: states(pool)["b"] == "unloaded")
        assert pool.status("b").last_error == "RuntimeError: boom"
        assert states(pool)["a"] == "loaded"
        async with pool.lease("b") as engine:
            assert engine is factory.engine("b") and not engine.is_closed  # type: ignore[comparison-overlap]
    finally:
        await pool.close()


# -- configuration and stats ----------------------------------------------------------------------


def test_model_specs_default_first() -> None:
    settings = Settings(pool=PoolSettings(models=(("b", "/m/b.gguf"),)))
    assert model_specs(settings) == [ModelSpec(DEFAULT_MODEL_NAME, ""), ModelSpec("b", "/m/b.gguf")]
    named = Settings(model=ModelSettings(model_path="/m/x.gguf"))
    assert model_specs(named)[0].name == "x"
    spec = ModelSpec("b", "/m/b.gguf")
    assert settings_for(settings, spec).model == ModelSettings(
        model_path="/m/b.gguf", model_name="b"
    )


def test_the_draft_model_is_the_default_models_alone() -> None:
    """--draft-model drafts for the default model; the other models load without it (its
    vocabulary would not be theirs)."""
    settings = Settings(
        model=ModelSettings(draft_model="/m/draft.gguf"),
        pool=PoolSettings(models=(("b", "/m/b.gguf"),)),
    )
    default, other = model_specs(settings)
    assert settings_for(settings, default).model.draft_model == "/m/draft.gguf"
    assert settings_for(settings, other).model.draft_model == ""


def test_combined_load_sums_the_engines() -> None:
    """WatchLoad's figures over several engines; one engine's snapshot comes back as is."""
    engine = FakeEngine()
    one = dataclasses.replace(engine.stats(), engine_state="running")
    engine.close()
    assert stats.combined_load([one]) is one
    two = stats.combined_load([one, dataclasses.replace(one, queue_depth=3, engine_state="failed")])
    assert (two.n_parallel, two.queue_depth, two.engine_state) == (8, 3, "running")
    assert stats.combined_load([]).n_parallel == 0


async def test_snapshots_and_statuses(pool: ModelPool) -> None:
    await pool.load("a")
    assert set(pool.snapshots()) == {"a"}
    by_name = {s.name: s for s in pool.statuses()}
    assert by_name["a"].is_default and by_name["a"].state == "loaded"
    assert by_name["a"].last_used_unix_ms > 0 and by_name["a"].size_bytes == 100
    assert (by_name["b"].state, by_name["b"].last_used_unix_ms) == ("unloaded", 0)


async def test_reloaded_tenant_limits_reach_resident_and_later_engines(factory: Factory) -> None:
    """set_tenant_limits (SIGHUP): the resident engine's scheduler gets them through its inbox,
    and a model loaded afterwards starts with them, not with those of the settings."""
    pool = make_pool(factory)
    try:
        await pool.load("a")
        limits = {"t": TenantLimits(max_concurrent=2, max_queued=3, weight=0.5)}
        pool.set_tenant_limits(limits)
        scheduler = factory.engine("a").loop._scheduler
        await settle(lambda: scheduler.limits.tenants == limits)
        await pool.load("b")
        later = factory.engine("b").loop._scheduler
        await settle(lambda: later.limits.tenants == limits)
        assert later.admission.fair_share.limits("t") == limits["t"]
    finally:
        await pool.close()
