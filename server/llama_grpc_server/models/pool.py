"""ModelPool: the models one server serves, by name, and the engines of those resident.

Each resident model has its own engine (context, slots, scheduler, thread), built by a factory
in a worker thread so that a load never blocks the event loop or another engine's thread. The
pool runs on the event loop; its only other readers are /metrics scrapes (snapshots()).

- A request names a model (empty = the default); an unknown name is NOT_FOUND listing the names.
- A request for a model that is not resident loads it and waits (bounded by its deadline); the
  requests for one model share one load.
- A load needs room (--max-loaded-models, --max-loaded-bytes): it unloads the least recently
  used idle model. A model is busy while requests hold a lease on it (queued or running in its
  engine) or wait for it, and a busy model is never unloaded for room. When every resident model
  is busy, the load marks the least recently used one draining: it takes no new requests (they
  wait, then load it again), and is unloaded once what it runs has finished. So models swap
  in turn and none starves under steady traffic to another.
- UnloadModel refuses a busy model unless forced; force ends its requests with MODEL_UNLOADED.
- With --models-dir, models put there after start (a copied *.gguf, a `llama-grpc models add`)
  are found without a restart: ListModels rescans the directory, and so does a request naming
  an unknown model (at most once a second, so unknown names cannot make every request list a
  directory). A model never disappears from the pool: one whose file was removed fails to load.
- A non-default model whose engine thread dies is unloaded (its requests got ENGINE_FAILED; the
  next request loads it afresh). The default model's engine failure is the server's business
  (health NOT_SERVING, exit: rpc/plumbing/health.py, rpc/plumbing/lifecycle.py), exactly as with
  a single model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from llama_grpc_server import errors
from llama_grpc_server.config import Settings
from llama_grpc_server.core import stats
from llama_grpc_server.core.api import EngineApi, StatsSnapshot
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.models import catalog
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME

log = structlog.get_logger("llama_grpc.models")

# UnloadModel(force): how long to wait for the cancelled requests to end (then close anyway),
# and how often to end what a lease holder submitted meanwhile.
FORCE_UNLOAD_TIMEOUT_S = 30.0
FORCE_UNLOAD_RETRY_S = 0.2
# A request naming an unknown model rescans --models-dir at most this often.
RESCAN_INTERVAL_S = 1.0


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"  # waiting for room, or being built in a thread
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model the server may serve. path "" is the embedded model."""

    name: str
    path: str
    size_bytes: int = 0  # the file's size (0: unknown until loaded)


ModelFactory = Callable[[ModelSpec], EngineApi]
Discover = Callable[[], Sequence[ModelSpec]]
LoadedHook = Callable[[ModelSpec, EngineApi], None]


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """What may be resident at once; 0 = no limit."""

    max_loaded_models: int = 0
    max_loaded_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model as ListModels shows it."""

    name: str
    path: str
    size_bytes: int
    state: str  # a ModelState value
    is_default: bool
    last_used_unix_ms: int  # 0 = never used
    slots_busy: int  # its engine's active slots (0 unless resident)
    in_flight: int  # requests holding a lease: queued or running in its engine
    waiting: int  # requests waiting for it to be loaded
    loads: int  # times loaded since start
    load_seconds: float  # how long its last load took
    last_error: str  # why its last load or engine failed ("" = no failure)


def model_specs(settings: Settings) -> list[ModelSpec]:
    """The default model (ModelSettings) first, then PoolSettings.models."""
    path = settings.model.model_path
    name = settings.model.model_name or (Path(path).stem if path else DEFAULT_MODEL_NAME)
    pairs = [(name, path), *settings.pool.models]
    return [ModelSpec(n, p, _file_size(p)) for n, p in pairs]


def directory_models(models_dir: str) -> Discover:
    """What --models-dir holds now, as specs (catalog.toml names, then *.gguf files by stem; the
    embedded model, which the catalog always lists first, is left out). Raises CatalogError
    when the directory is gone."""

    def scan() -> list[ModelSpec]:
        found = catalog.list_models(Path(models_dir))[1:]
        return [ModelSpec(e.name, str(e.path), _file_size(str(e.path))) for e in found]

    return scan


def settings_for(settings: Settings, spec: ModelSpec) -> Settings:
    """The settings one model's engine is built with: the server's, naming that model, with
    the --lora adapters of that model ("" stands for the default model: model_specs' first)
    and, for the default model alone, the --draft-model."""
    default = model_specs(settings)[0].name
    loras = tuple(
        dataclasses.replace(lora, model=spec.name)
        for lora in settings.model.loras
        if (lora.model or default) == spec.name
    )
    draft = settings.model.draft_model if spec.name == default else ""  # the default's alone
    model = dataclasses.replace(
        settings.model, model_path=spec.path, model_name=spec.name, loras=loras, draft_model=draft
    )
    return dataclasses.replace(settings, model=model)


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size if path else 0
    except OSError:
        return 0


def _aliases(name: str, path: str) -> set[str]:
    """What a request may call a model: its name, its path or its file name."""
    return {name, path, os.path.basename(path)} - {""}


@dataclass(eq=False)
class _Entry:
    spec: ModelSpec
    is_default: bool
    aliases: set[str]
    size_bytes: int
    state: ModelState = ModelState.UNLOADED
    engine: EngineApi | None = None
    in_flight: int = 0  # leases held
    waiting: int = 0  # requests in acquire(), for a load or for the end of draining
    draining: bool = False  # a load waits for its room: admit nothing new
    has_room: bool = False  # LOADING and counted against the limits
    load_task: asyncio.Task[None] | None = None
    last_used: float = 0.0  # time.monotonic(), for LRU
    last_used_unix_ms: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    error: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_resident(self) -> bool:
        """Holding (or about to hold) memory: counted against the limits."""
        return self.state in (ModelState.LOADED, ModelState.UNLOADING) or (
            self.state is ModelState.LOADING and self.has_room
        )

    @property
    def is_busy(self) -> bool:
        """Not to be unloaded for room: requests hold it or wait for it (unless draining)."""
        return self.in_flight > 0 or (self.waiting > 0 and not self.draining)

    def touch(self) -> None:
        self.last_used = time.monotonic()
        self.last_used_unix_ms = time.time_ns() // 1_000_000


class ModelPool:
    """Name -> model, loading on demand within PoolLimits (see the module docstring). `specs[0]`
    is the default model. `on_loaded(spec, engine)` is called on the event loop after each load
    (the server watches the default model's engine with it)."""

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        factory: ModelFactory,
        limits: PoolLimits | None = None,
        *,
        on_loaded: LoadedHook | None = None,
        discover: Discover | None = None,
    ) -> None:
        if not specs:
            raise ValueError("a pool needs at least one model")
        self._entries = tuple(
            _Entry(spec, i == 0, _aliases(spec.name, spec.path), spec.size_bytes)
            for i, spec in enumerate(specs)
        )
        self._factory = factory
        self.limits = limits if limits is not None else PoolLimits()
        self._on_loaded = on_loaded
        self._discover = discover
        self._scanned_at = -RESCAN_INTERVAL_S  # time.monotonic() of the last rescan
        self._changed = asyncio.Event()
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._tenant_limits: Mapping[str, TenantLimits] | None = None  # set by a reload

    # -- lookups ----------------------------------------------------------------------------------

    @property
    def default_name(self) -> str:
        return self._entries[0].name

    @property
    def names(self) -> list[str]:
        return [e.name for e in self._entries]

    def _find(self, name: str) -> _Entry:
        """The entry a request's model field names ("" = the default); NOT_FOUND lists them."""
        if not name:
            return self._entries[0]
        for _ in range(2):
            for entry in self._entries:
                if name in entry.aliases:
                    return entry
            if not self.rescan(force=False):
                break
        available = ", ".join(self.names)
        raise errors.ModelNotFound(
            f"model {name!r} is not served here; available: {available}",
            field="model",
            metadata={"model": name, "available": available},
        )

    def rescan(self, *, force: bool) -> bool:
        """Add the models `discover` finds under names and paths not served yet; True if any
        was. Unforced rescans (a request naming an unknown model) happen at most once per
        RESCAN_INTERVAL_S. An unreadable directory is
        logged and changes nothing: the pool keeps serving what it has."""
        now = time.monotonic()
        if self._discover is None or (not force and now - self._scanned_at < RESCAN_INTERVAL_S):
            return False
        if not force:  # only misses are rate-limited (ListModels is an admin call)
            self._scanned_at = now
        try:
            found = self._discover()
        except (OSError, catalog.CatalogError) as exc:
            log.warning("models_dir_unreadable", error=errors.describe(exc))
            return False
        taken = {alias for entry in self._entries for alias in entry.aliases}
        added: list[_Entry] = []
        for spec in found:
            aliases = _aliases(spec.name, spec.path)
            if spec.name in taken or spec.path in taken:
                continue
            added.append(_Entry(spec, False, aliases, spec.size_bytes))
            taken |= aliases
        if added:
            # A new tuple, never an append: /metrics scrapes iterate it from another thread.
            self._entries = (*self._entries, *added)
            log.info("models_discovered", names=[e.name for e in added])
        return bool(added)

    def resident(self, name: str, *, field: str | None = "model") -> EngineApi:
        """The engine of a loaded model, without loading it: ModelNotLoaded otherwise, naming
        `field` (None: a protocol whose request has no model field, the vLLM engine's)."""
        entry = self._find(name)
        if entry.state is not ModelState.LOADED or entry.engine is None:
            raise errors.ModelNotLoaded(
                f"model {entry.name!r} is {entry.state.value}, not loaded; a generation request "
                "or LoadModel loads it",
                field=field,
                metadata={"model": entry.name, "state": entry.state.value},
            )
        return entry.engine

    def default_engine(self) -> EngineApi | None:
        entry = self._entries[0]
        return entry.engine if entry.state is ModelState.LOADED else None

    def status(self, name: str) -> ModelStatus:
        return self._status(self._find(name))

    def statuses(self) -> list[ModelStatus]:
        self.rescan(force=True)
        return [self._status(entry) for entry in self._entries]

    @staticmethod
    def _status(entry: _Entry) -> ModelStatus:
        engine = entry.engine
        path = entry.spec.path or (engine.model_info.model_path if engine is not None else "")
        return ModelStatus(
            name=entry.name,
            path=path,
            size_bytes=entry.size_bytes,
            state=entry.state.value,
            is_default=entry.is_default,
            last_used_unix_ms=entry.last_used_unix_ms,
            slots_busy=engine.stats().active_slots if engine is not None else 0,
            in_flight=entry.in_flight,
            waiting=entry.waiting,
            loads=entry.loads,
            load_seconds=entry.load_seconds,
            last_error=entry.error,
        )

    def snapshots(self) -> dict[str, StatsSnapshot]:
        """Every engine's stats by model name (for /metrics: safe from another thread)."""
        out = {}
        for entry in self._entries:
            engine = entry.engine
            if engine is not None:
                out[entry.name] = engine.stats()
        return out

    def load_snapshot(self) -> StatsSnapshot:
        """The resident engines' load as one snapshot (WatchLoad): the default model's own
        while it is the only one resident."""
        return stats.combined_load(list(self.snapshots().values()))

    # -- leases -----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, name: str, deadline: float | None = None) -> AsyncIterator[EngineApi]:
        """The named model's engine, loaded if need be, held (never unloaded for room) until
        the block ends. `deadline` (time.monotonic()) bounds the wait: DeadlineExceeded."""
        entry = self._find(name)
        engine = await self._acquire(entry, deadline)
        try:
            yield engine
        finally:
            entry.in_flight -= 1
            entry.touch()
            if entry.in_flight == 0:
                self._notify()

    async def load(self, name: str, deadline: float | None = None) -> ModelStatus:
        """LoadModel: make the model resident (no-op when it is)."""
        async with self.lease(name, deadline):
            pass
        return self.status(name)

    async def _acquire(self, entry: _Entry, deadline: float | None) -> EngineApi:
        loop = asyncio.get_running_loop()
        when = None if deadline is None else loop.time() + deadline - time.monotonic()
        entry.waiting += 1
        try:
            async with asyncio.timeout_at(when):
                while entry.state is not ModelState.LOADED or entry.draining:
                    if entry.state is ModelState.UNLOADED:
                        self._start_load(entry)
                    task = entry.load_task
                    if entry.state is ModelState.LOADING and task is not None:
                        await asyncio.shield(task)
                    else:
                        await self._changed.wait()
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"the deadline passed while waiting for model {entry.name!r} to load",
                metadata={"model": entry.name},
            ) from None
        finally:
            entry.waiting -= 1
            self._notify()
        assert entry.engine is not None
        entry.in_flight += 1
        entry.touch()
        return entry.engine

    # -- loading ----------------------------------------------------------------------------------

    def _start_load(self, entry: _Entry) -> None:
        if self._closing:
            raise errors.ShuttingDown("server is shutting down")
        bound = self.limits.max_loaded_bytes
        if bound and entry.size_bytes > bound:
            raise errors.FailedPrecondition(
                f"model {entry.name!r} ({entry.size_bytes} bytes) is larger than "
                f"--max-loaded-bytes ({bound})",
                field="model",
            )
        entry.state = ModelState.LOADING
        entry.has_room = False
        task = asyncio.create_task(self._load(entry), name=f"load-model-{entry.name}")
        task.add_done_callback(_retrieve)
        entry.load_task = task
        self._notify()

    async def _load(self, entry: _Entry) -> None:
        """Make room, build the engine in a thread, publish it. Waiters see the outcome
        through this task (ModelLoadFailed) and the state."""
        try:
            await self._make_room(entry)
            log.info("model_loading", model=entry.name, path=entry.spec.path or "(embedded)")
            started = time.monotonic()
            engine = await asyncio.to_thread(self._factory, entry.spec)
        except BaseException as exc:
            entry.state, entry.has_room, entry.load_task = ModelState.UNLOADED, False, None
            self._notify()
            if isinstance(exc, errors.ServiceError | asyncio.CancelledError):
                raise
            entry.error = errors.describe(exc)
            log.error("model_load_failed", model=entry.name, error=entry.error)
            raise errors.ModelLoadFailed(
                f"model {entry.name!r} failed to load: {entry.error}",
                metadata={"model": entry.name},
            ) from exc
        entry.load_seconds = time.monotonic() - started
        if self._tenant_limits is not None:  # reloaded since the settings were read
            engine.set_tenant_limits(self._tenant_limits)
        entry.engine, entry.state, entry.load_task = engine, ModelState.LOADED, None
        entry.loads += 1
        info = engine.model_info
        entry.aliases |= _aliases(info.model_name, info.model_path)
        entry.size_bytes = entry.size_bytes or info.size_bytes
        log.info(
            "model_loaded",
            model=entry.name,
            seconds=round(entry.load_seconds, 3),
            chat_template=info.chat_template or "none",
            chat_template_origin=info.chat_template_origin,
        )
        self._watch(entry, engine)
        if self._on_loaded is not None:
            self._on_loaded(entry.spec, engine)
        self._notify()
        if self._closing:  # the server stopped while this load ran in its thread
            await self._unload(entry, "shutdown")

    async def _make_room(self, entry: _Entry) -> None:
        """Unload idle models (least recently used first) until `entry` fits; while every
        resident model is busy, drain one and wait. Gives up when nobody waits any more."""
        victim: _Entry | None = None
        try:
            while not self._fits(entry):
                if self._closing:
                    raise errors.ShuttingDown("server is shutting down")
                if entry.waiting == 0:
                    raise errors.Cancelled(f"nobody waits for model {entry.name!r} any more")
                idle = self._evictable(entry)
                if idle is not None:
                    await self._unload(idle, "evicted")
                    continue
                if victim is None or victim.state is not ModelState.LOADED:
                    victim = self._victim(entry)
                    if victim is not None:
                        victim.draining = True
                        log.info("model_draining", model=victim.name, for_model=entry.name)
                await self._changed.wait()
            entry.has_room = True
        finally:
            if victim is not None and victim.draining and victim.state is ModelState.LOADED:
                victim.draining = False
                self._notify()

    def _fits(self, entry: _Entry) -> bool:
        others = [e for e in self._entries if e is not entry and e.is_resident]
        count, size = self.limits.max_loaded_models, self.limits.max_loaded_bytes
        if count and len(others) + 1 > count:
            return False
        return not size or sum(e.size_bytes for e in others) + entry.size_bytes <= size

    def _loaded_others(self, entry: _Entry) -> Iterator[_Entry]:
        return (e for e in self._entries if e is not entry and e.state is ModelState.LOADED)

    def _evictable(self, entry: _Entry) -> _Entry | None:
        """An idle loaded model: a drained one first, then the least recently used."""
        idle = [e for e in self._loaded_others(entry) if not e.is_busy]
        return min(idle, key=lambda e: (not e.draining, e.last_used), default=None)

    def _victim(self, entry: _Entry) -> _Entry | None:
        """The model to drain: the least recently used. Not one with waiters: a loaded model
        that is not draining has waiters only just after its load, about to take their leases
        (draining it then would swap models back and forth without serving anyone)."""
        loaded = [e for e in self._loaded_others(entry) if not e.draining and not e.waiting]
        return min(loaded, key=lambda e: e.last_used, default=None)

    # -- unloading --------------------------------------------------------------------------------

    async def unload(self, name: str, *, force: bool = False) -> tuple[ModelStatus, int]:
        """UnloadModel: (the model's status after, requests cancelled). A model with requests
        in flight is refused (ModelBusy) unless `force`, which ends them with ModelUnloaded."""
        entry = self._find(name)
        while entry.state is ModelState.UNLOADING:
            await self._changed.wait()
        if entry.state is ModelState.LOADING:
            raise errors.ModelBusy(
                f"model {entry.name!r} is loading; unload it once loaded",
                metadata={"model": entry.name},
            )
        if entry.state is ModelState.UNLOADED:
            return self._status(entry), 0
        busy = entry.in_flight
        if busy and not force:
            raise errors.ModelBusy(
                f"model {entry.name!r} has {busy} request(s) in flight; force cancels them",
                metadata={"model": entry.name, "in_flight": str(busy)},
            )
        await self._unload(entry, "admin", cancel=force)
        return self._status(entry), busy

    async def _unload(self, entry: _Entry, reason: str, *, cancel: bool = False) -> None:
        """Close the engine in a thread; the model counts as resident until it is closed."""
        engine = entry.engine
        assert engine is not None
        entry.state = ModelState.UNLOADING
        self._notify()
        started = time.monotonic()
        try:
            if cancel:
                await self._end_requests(entry, engine)
            await asyncio.to_thread(engine.close)
        except Exception:
            log.exception("model_close_failed", model=entry.name)
        finally:
            entry.engine, entry.state, entry.draining = None, ModelState.UNLOADED, False
            self._notify()
        seconds = round(time.monotonic() - started, 3)
        log.info("model_unloaded", model=entry.name, reason=reason, seconds=seconds)

    async def _end_requests(self, entry: _Entry, engine: EngineApi) -> None:
        """End the model's requests until no lease is left (a lease holder may submit after an
        end_all: it is ended at the next round), FORCE_UNLOAD_TIMEOUT_S at most."""
        error = errors.ModelUnloaded(f"model {entry.name!r} was unloaded (UnloadModel force)")
        give_up = time.monotonic() + FORCE_UNLOAD_TIMEOUT_S
        while entry.in_flight and time.monotonic() < give_up:
            engine.end_all(error)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FORCE_UNLOAD_RETRY_S):
                    await self._changed.wait()

    def _watch(self, entry: _Entry, engine: EngineApi) -> None:
        """A non-default model whose engine dies is unloaded (the default's death is the
        server's: health, exit)."""
        if entry.is_default:
            return
        loop = asyncio.get_running_loop()

        def on_loop(cause: str) -> None:
            if entry.engine is not engine or entry.state is not ModelState.LOADED:
                return
            entry.error = cause
            log.error("model_engine_failed", model=entry.name, error=cause)
            self._spawn(self._unload(entry, "engine failed"))

        def on_engine_thread(cause: str) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                loop.call_soon_threadsafe(on_loop, cause)

        engine.on_failure(on_engine_thread)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the whole pool ---------------------------------------------------------------------------

    def end_all(self, error: errors.ServiceError) -> None:
        """End every request of every resident engine (a drain's grace period is over)."""
        for entry in self._entries:
            if entry.engine is not None:
                entry.engine.end_all(error)

    def set_tenant_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """New tenant limits (SIGHUP reloaded the tokens file): for every resident engine now,
        and for every engine loaded later instead of those its settings were built with."""
        self._tenant_limits = dict(limits)
        for entry in self._entries:
            if entry.engine is not None:
                entry.engine.set_tenant_limits(self._tenant_limits)

    async def close(self) -> None:
        """Refuse new loads, let loads under way finish, close every engine (in threads)."""
        self._closing = True
        self._notify()
        for entry in self._entries:
            if entry.load_task is not None:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(entry.load_task)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        loaded = [e for e in self._entries if e.state is ModelState.LOADED]
        await asyncio.gather(*(self._unload(e, "shutdown") for e in loaded))

    def _notify(self) -> None:
        """Wake everything waiting for a change of any entry."""
        self._changed.set()
        self._changed = asyncio.Event()


def _retrieve(task: asyncio.Task[None]) -> None:
    """Waiters hear a load's failure; a load nobody awaited any more must not warn."""
    if not task.cancelled():
        task.exception()
