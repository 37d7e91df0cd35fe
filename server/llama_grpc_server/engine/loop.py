"""EngineLoop: the engine thread. Submissions and cancellations arrive through one inbox of typed
commands (engine/inbox.py); each tick is schedule -> execute -> update -> publish stats ->
deliver; events reach each request's asyncio queue (engine/streams.py) with one
call_soon_threadsafe per event loop per tick. It sleeps when idle, never busy-waits, and waits
out an admission window when a burst starts (engine/burst.py). If the thread dies or a tick
hangs, the engine ends as engine/containment.py says."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TypeVar

import structlog

from llama_grpc_server import errors
from llama_grpc_server.core.adapters import AdapterCatalog, AdapterEntry
from llama_grpc_server.core.api import CacheCleared, ModelInfo, StatsSnapshot, Vocabulary
from llama_grpc_server.core.kv.events import KvEventLog
from llama_grpc_server.core.requests.request import (
    Emitted,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Request,
    TokenDelta,
)
from llama_grpc_server.core.scheduling.plan import StepPlan, StepResult, StepRunner
from llama_grpc_server.core.scheduling.scheduler import Scheduler
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.engine import containment, inbox, streams
from llama_grpc_server.engine.adapters import AdapterLoadError, LoraAdapters
from llama_grpc_server.engine.burst import BurstDetector
from llama_grpc_server.engine.containment import FailureListener, TickGuard
from llama_grpc_server.engine.streams import Deliveries, EngineStream
from llama_grpc_server.engine.thread_names import (
    DECODE_THREAD_NAME,
    ENGINE_THREAD_NAME,
    set_native_thread_name,
)
from llama_grpc_server.engine.vocabulary import VocabularyFacade
from llama_grpc_server.watchdog import PassBounds

log = structlog.get_logger("llama_grpc.engine")

TickHook = Callable[[StepPlan, StepResult, Scheduler], None]
DoneHook = Callable[[Request, Event], None]
T = TypeVar("T")

ADMISSION_WINDOWS_MAX = 5  # a burst waits at most this many admission windows in all
# An engine idle this long calls on_idle once (engine/openmp.py: its llama.cpp helper threads
# are released, so they no longer make libgomp throttle a busy engine beside it).
IDLE_RELEASE_S = 0.05
# A running engine publishes its stats snapshot (and KV events) when a request is admitted,
# ends or is preempted, and otherwise at most this often (stats() reads the counters live).
PUBLISH_EVERY_S = 0.1


class EngineState(enum.Enum):
    STARTING = "starting"  # the warm-up decode runs; submissions wait in the inbox
    RUNNING = "running"
    FAILED = "failed"  # the engine thread died: nothing is served any more
    STOPPED = "stopped"  # close() was called


class EngineLoop(VocabularyFacade):
    """Owns the scheduler, the runner and the thread that drives them."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,
        model_info: ModelInfo,
        *,
        tokenizer: Vocabulary,
        kv_cells_total: int,
        on_tick: TickHook | None = None,
        on_done: DoneHook | None = None,
        on_close: Callable[[], None] | None = None,
        on_start: Callable[[], None] | None = None,
        on_idle: Callable[[], None] | None = None,
        admission_window_s: float = 0.0,
        overlap_decode: bool = False,
        watchdog_s: Callable[[], float | PassBounds | None] | None = None,
        lora: LoraAdapters | None = None,
    ) -> None:
        super().__init__(tokenizer)
        self._scheduler = scheduler
        # LoRA adapters: the catalog requests are resolved against (any thread), the llama.cpp
        # handles (engine thread), and unloaded adapters freed once no request holds them.
        self.adapters = AdapterCatalog()
        self._lora = lora
        self._unloaded: set[str] = set()
        self._admission_window_s = admission_window_s
        # whether an idle start waits out the window: not for a caller sending one at a time
        self._burst = BurstDetector(horizon_s=ADMISSION_WINDOWS_MAX * admission_window_s)
        # Deliver a tick's events (and publish its stats) while the next tick's forward pass
        # runs: see _tick. _held is that tick's events, written and read by the engine thread.
        self._overlap_decode = overlap_decode
        self._held: Emitted = []
        self._runner = runner
        self._model_info = model_info
        self._kv_cells_total = kv_cells_total
        self._on_tick = on_tick
        self._on_done = on_done
        self._on_close = on_close
        self._on_start = on_start
        self._on_idle = on_idle
        # on_idle ran and nothing decoded since: the next decode makes llama.cpp's helpers anew
        self._released = False
        self._inbox: list[inbox.Command] = []
        self._num_rejected_at_submit = 0
        self._num_failed_by_death = 0  # requests _end_engine ended (written once)
        self._guard = TickGuard(watchdog_s, self._on_hung)  # the tick watchdog
        self._is_hung = False  # the watchdog tripped: the engine thread is stuck in a tick
        self._wake = threading.Condition()  # guards inbox, streams, state, error, listeners
        self._streams: dict[str, EngineStream] = {}  # by request key: (tenant, request id)
        self._is_stopping = False
        self._state = EngineState.STARTING
        self._error = ""
        self._failure_listeners: list[FailureListener] = []
        self._started = time.monotonic()
        # Written by the engine thread only (one reference assignment), read by stats().
        self._published = scheduler.snapshot(kv_cells_total)
        self._published_at = time.monotonic()
        self._published_changes = scheduler.num_changes
        # The disk tier's I/O thread wakes this one when a read comes back.
        scheduler.set_wakeup(self.wake)
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()

    # -- EngineApi --------------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def state(self) -> EngineState:
        return self._state

    def submit(self, request: GenerationRequest) -> EngineStream:
        with self._wake:
            self._check_accepting()
        try:
            self._scheduler.check_fits(request)
        except errors.ServiceError:
            self._num_rejected_at_submit += 1  # only this (event-loop) thread writes it
            raise
        live = Request(request, arrival_ns=time.perf_counter_ns())
        stream = EngineStream(self, live, asyncio.get_running_loop())
        with self._wake:
            self._check_accepting()  # again: the engine may have died meanwhile
            if request.key in self._streams:
                # a caller reusing x-request-id on concurrent calls: with the tenant it keys the
                # sampler, the detokenizer and the stream, so a second one in flight cannot be
                # accepted (another tenant's request with the same id can)
                raise errors.DuplicateRequest(
                    f"request id {request.request_id!r} is already in flight",
                    field="x-request-id",
                )
            self._streams[request.key] = stream
            self._inbox.append(inbox.Add(stream))
            self._wake.notify()
        return stream

    def wake(self) -> None:
        """Wake the engine thread (from another thread) to look at the scheduler again: a disk
        read came back, a slow reader read."""
        with self._wake:
            self._wake.notify()

    def _check_accepting(self) -> None:
        """Raise unless the engine thread is alive and accepting work (call with _wake held)."""
        if self._is_hung:
            raise errors.EngineHung(f"the engine has hung: {self._error}")
        if self._state is EngineState.FAILED or (
            not self._thread.is_alive() and not self._is_stopping
        ):
            cause = self._error or "the engine thread is not running"
            raise errors.EngineUnavailable(f"the engine has failed: {cause}")
        if self._is_stopping:
            raise errors.ShuttingDown("server is shutting down")

    def on_failure(self, listener: FailureListener) -> None:
        """Call `listener(cause)` once if the engine thread dies (on that thread); at once if it
        already has."""
        with self._wake:
            if self._state is not EngineState.FAILED:
                self._failure_listeners.append(listener)
                return
            cause = self._error
        listener(cause)

    def cancel(self, request_id: str, tenant: str = "", *, deadline_exceeded: bool = False) -> None:
        """Drop the request at the next tick; `deadline_exceeded` ends it as DeadlineExceeded."""
        with self._wake:
            self._inbox.append(inbox.Cancel(request_id, tenant, deadline_exceeded))
            self._wake.notify()

    async def clear_cache(self) -> CacheCleared:
        """Clear between two ticks on the engine thread; the answer comes back as a future
        (a concurrent one: the engine thread may also fail it, see _fail)."""
        done: concurrent.futures.Future[CacheCleared] = concurrent.futures.Future()
        with self._wake:
            self._check_accepting()
            self._inbox.append(inbox.ClearCache(done))
            self._wake.notify()
        return await asyncio.wrap_future(done)

    def end_all(self, error: errors.ServiceError) -> None:
        """End every queued and running request with `error` at the next tick."""
        with self._wake:
            self._inbox.append(inbox.EndAll(error))
            self._wake.notify()

    def set_tenant_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """New tenant limits, applied by the engine thread (which owns the scheduler) when it
        drains the inbox: before any request submitted after this call."""
        with self._wake:
            self._inbox.append(inbox.SetTenantLimits(dict(limits)))
            self._wake.notify()

    def stats(self) -> StatsSnapshot:
        """The snapshot the engine thread published last (never the live scheduler, which that
        thread is mutating) with the counters read now, and this thread's own figures.

        The engine thread publishes a whole snapshot when a request is admitted, ends or is
        preempted, when the cache is cleared, when it goes idle and before it answers anything
        from its inbox; between those, at most every PUBLISH_EVERY_S (a tick does not pay for
        one). What moves every tick without such an event, the token, tick and decode-time
        counters and the KV cells in use, is read live (stats.live), so GetStats is exact for
        them at any time; only the per-slot views may be up to PUBLISH_EVERY_S old while
        requests decode. A caller that saw its request end reads stats that agree."""
        # the disk tier's I/O threads save, fail and read between ticks (an idle session's save;
        # an idle engine publishes nothing): its figures are read now too
        snapshot = self._scheduler.live_stats(self._published)
        return dataclasses.replace(
            snapshot,
            requests_rejected=snapshot.requests_rejected + self._num_rejected_at_submit,
            requests_failed=snapshot.requests_failed + self._num_failed_by_death,
            uptime_s=time.monotonic() - self._started,
            engine_state=self._state.value,
            engine_error=self._error,
            watchdog_trips=int(self._is_hung),
        )

    @property
    def kv_events(self) -> KvEventLog:
        return self._scheduler.kv_event_log

    def close(self) -> None:
        with self._wake:
            self._is_stopping = True
            if self._state is not EngineState.FAILED:
                self._state = EngineState.STOPPED
            self._wake.notify()
        self._guard.stop()
        if self._is_hung:
            # The engine thread is stuck inside a tick: joining would wait for ever and freeing
            # the model under it could crash the process, which is about to exit anyway.
            return
        self._thread.join(timeout=30)
        if self._on_close is not None and not self._thread.is_alive():
            self._on_close()

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            # llama.cpp's OpenMP helper threads are made by the first decode (the warm-up, in
            # on_start) and inherit this thread's name: they read "llama-decode" in top -H, ps
            # and py-spy, and bench/overhead.py counts their CPU time as the forward passes'.
            set_native_thread_name(DECODE_THREAD_NAME)
            if self._on_start is not None:  # before any request: they wait in the inbox
                self._on_start()
            set_native_thread_name(ENGINE_THREAD_NAME)
            self._guard.start()
            with self._wake:
                if self._state is EngineState.STARTING:
                    self._state = EngineState.RUNNING
            self._publish()  # the first KV event batch: a clear, then the disk tier's files
            while not self._is_hung and self._drain_inbox():
                self._guard.run(self._tick_once)
            if self._is_hung:
                return  # a tick came back after the watchdog tripped: the engine is gone
            self._flush_held()
            self._deliver(self._scheduler.fail_all(errors.ShuttingDown("engine stopped")))
            if self._scheduler.persist_idle(everything=True):
                self._tick()  # the disk tier's saves of every idle cache (a plan of KV ops)
        except BaseException as exc:  # the thread must not die silently, whatever it was
            self._fail(exc)
        finally:
            self._guard.stop()

    def _tick_once(self) -> None:
        if self._released:
            self._tick_after_release()
        else:
            self._tick()

    def expect_inner_pass(self, is_prefill: bool, tokens: int) -> None:
        """A forward pass inside the tick that is not its plan's (engine/draft.py's draft pass):
        the watchdog gives the tick that much more time (TickGuard.expect_inner_pass)."""
        self._guard.expect_inner_pass(is_prefill, tokens)

    def _on_hung(self, cause: str) -> None:
        """On the watchdog's thread, once the engine thread's stack is logged (TickGuard): end
        the engine as _fail does, callers hearing UNAVAILABLE."""
        self._is_hung = True  # before the listeners: they read watchdog_trips
        self._end_engine(cause, errors.EngineHung(f"the engine has hung: {cause}"))

    def _fail(self, exc: BaseException) -> None:
        """The engine thread died: log why and end the engine (_end_engine)."""
        cause = containment.log_failure(exc)
        self._end_engine(cause, errors.EngineFailed(f"the engine failed: {cause}"))

    def _end_engine(self, cause: str, error: errors.ServiceError) -> None:
        """The engine is dead or stuck: end every request it owed an answer with `error`,
        refuse new ones, tell the listeners (engine/containment.py). Reads nothing from the
        scheduler, whose state may be what broke (or which the stuck engine thread still
        holds)."""
        with self._wake:
            self._state = EngineState.FAILED
            self._error = cause
            owed = list(self._streams.values())
            self._streams.clear()
            commands, self._inbox = self._inbox, []
            listeners, self._failure_listeners = self._failure_listeners, []
        # first: health is NOT_SERVING before callers hear why
        containment.tell_listeners(listeners, cause)
        inbox.refuse(commands, containment.refusal(cause, error))
        self._num_failed_by_death = len(owed)  # counted in stats().requests_failed
        self._post(containment.fail_streams(owed, error, self._notify_done))

    def _tick_after_release(self) -> None:
        """A tick whose decode recreates llama.cpp's helper threads: they inherit this thread's
        name, so it reads "llama-decode" meanwhile, as during the warm-up."""
        set_native_thread_name(DECODE_THREAD_NAME)
        try:
            self._released = not self._tick()
        finally:
            set_native_thread_name(ENGINE_THREAD_NAME)

    def _drain_inbox(self) -> bool:
        """Apply submissions and cancellations; sleep while there is nothing to do."""
        with self._wake:
            self._sleep_while_idle()
            if self._admission_window_s > 0 and not self._scheduler.has_work:
                self._gather_burst()
            elif self._burst.skipped_at is not None:  # busy since a start that did not wait
                for command in self._inbox:
                    if isinstance(command, inbox.Add):
                        self._burst.arrived(command.stream.request.arrival_ns / 1e9)
            commands, self._inbox = self._inbox, []
            if self._is_stopping:
                commands += [
                    inbox.Cancel(s.request_id, s.request.spec.tenant)
                    for s in self._streams.values()
                ]
        events: Emitted = []
        for command in commands:
            events += self._apply(command)
        if self._unloaded:
            self._free_unused_adapters()
        if commands:
            self._publish()
        if events:  # after those an overlapped tick held, if any (_deliver)
            self._deliver(events)
        return not self._is_stopping

    def _apply(self, command: inbox.Command) -> Emitted:
        """One inbox command, on the engine thread; the events it makes."""
        match command:
            case inbox.Add(stream):
                return self._add(stream)
            case inbox.EndAll(error):
                return self._scheduler.fail_all(error)
            case inbox.ClearCache(done):
                self._clear_cache(done)
            case inbox.Call():
                command.run()
            case inbox.SetTenantLimits(limits):
                self._scheduler.set_tenant_limits(limits)
            case inbox.Cancel(request_id, tenant, deadline_exceeded):
                return self._scheduler.cancel(
                    request_id, tenant, deadline_exceeded=deadline_exceeded
                )
        return []

    # -- LoRA adapters ----------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str, default_scale: float) -> AdapterEntry:
        """Load an adapter on the engine thread, between two passes (llama_adapter_lora_init
        reads the file and allocates its tensors); it is in the catalog when this returns.
        FailedPrecondition for a name in use or a model that cannot take adapters;
        InvalidRequest naming the mismatch for a file that does not fit the model."""
        lora = self._lora
        if lora is None:
            raise errors.FailedPrecondition("this model cannot take LoRA adapters")
        if self.adapters.get(name) is not None or name in self._unloaded:
            raise errors.FailedPrecondition(
                f"adapter {name!r} is loaded already: unload it first", field="name"
            )

        def load() -> AdapterEntry:
            try:
                entry = lora.load(name, path, default_scale)
            except AdapterLoadError as exc:
                raise errors.InvalidRequest(str(exc), field="path") from None
            self.adapters.add(entry)
            return entry

        return await self._on_engine(load)

    async def unload_adapter(self, name: str) -> int:
        """Take an adapter out of the catalog now (requests naming it are refused from here on)
        and free it on the engine thread once no queued or running request holds it; the number
        of those holding it now. InvalidRequest for a name not loaded."""
        if self.adapters.remove(name) is None:
            raise errors.InvalidRequest(f"no adapter {name!r} is loaded", field="name")
        self._unloaded.add(name)

        def unload() -> int:
            users = self._scheduler.adapter_users(name)
            self._free_unused_adapters()
            return users

        return await self._on_engine(unload)

    def _free_unused_adapters(self) -> None:
        """Engine thread: free the unloaded adapters no request holds any more."""
        for name in [n for n in list(self._unloaded) if not self._scheduler.adapter_users(n)]:
            if self._lora is not None:
                self._lora.free(name)
            self._unloaded.discard(name)

    async def _on_engine(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between two ticks; its result or its exception."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._wake:
            self._check_accepting()
            self._inbox.append(inbox.Call(fn, done))
            self._wake.notify()
        return await asyncio.wrap_future(done)

    def _sleep_while_idle(self) -> None:
        """With _wake held: sleep until something arrives, a read or a reader wakes it, or a
        timer of the scheduler is due (never a busy wait)."""
        if not self._inbox and not self._scheduler.has_work and not self._is_stopping:
            self._publish()  # the state it sleeps in (a request paused for its reader)
        while not self._inbox and not self._scheduler.has_work and not self._is_stopping:
            timeout = self._scheduler.idle_wait_s()
            release = self._on_idle is not None and not self._released
            if release:
                timeout = IDLE_RELEASE_S if timeout is None else min(timeout, IDLE_RELEASE_S)
            if not self._wake.wait(timeout) and release and self._on_idle is not None:
                self._on_idle()  # idle for a while: a no-op for the requests, none wait
                self._released = True
            self._scheduler.persist_idle()  # an idle session due for the disk tier

    def _clear_cache(self, done: concurrent.futures.Future[CacheCleared]) -> None:
        # The caller may have given up (a deadline cancels the future through wrap_future): then
        # nobody waits for the clear, so skip it; once running the future cannot be cancelled.
        if not done.set_running_or_notify_cancel():
            return
        try:
            cleared = self._scheduler.clear_idle_cache()
        except BaseException as exc:  # the caller hears why, then the engine fails as usual
            cause = errors.describe(exc)
            done.set_exception(errors.EngineFailed(f"clearing the cache failed: {cause}"))
            raise
        self._publish()  # before the answer: the caller's next GetStats sees the cleared cache
        done.set_result(cleared)

    def _gather_burst(self) -> None:
        """The engine was idle and something arrived: wait (with _wake held) until arrivals
        pause for one admission window, at most ADMISSION_WINDOWS_MAX windows in all, so a burst
        of requests starts as one batch. Without it the first arrival's prefill starts at once
        and the rest of the burst, accepted by grpc one call at a time while that forward pass
        holds both cores, joins one or more passes later: measured with 16 streams sent within
        1 ms, 80-98 forward passes for 64 tokens each instead of 65, and every straggling wave
        is one more partly filled pass at the end (~10 % of the run). A caller that sends one
        request at a time stops paying the window after a few (engine.burst.BurstDetector)."""
        if not self._burst.should_wait(time.perf_counter()):
            return
        self._wait_for_burst()
        self._burst.gathered(sum(isinstance(c, inbox.Add) for c in self._inbox))

    def _wait_for_burst(self) -> None:
        window = self._admission_window_s
        deadline = time.monotonic() + ADMISSION_WINDOWS_MAX * window
        seen = len(self._inbox)
        while not self._is_stopping:
            timeout = min(window, deadline - time.monotonic())
            if timeout <= 0:
                return
            self._wake.wait(timeout)
            if len(self._inbox) == seen:
                return  # a whole window without a new arrival
            seen = len(self._inbox)

    def _add(self, stream: EngineStream) -> Emitted:
        gone = [
            a.name
            for a in stream.request.spec.adapters
            if self._lora is None
            or a.name in self._unloaded
            or not self._lora.has(a.name, a.digest)
        ]
        if gone:
            error = errors.InvalidRequest(
                f"adapter {gone[0]!r} was unloaded before this request started",
                field="params.lora",
            )
            return [(stream.request, Failed(error))]
        try:
            self._scheduler.add(stream.request)
        except errors.ServiceError as exc:
            return [(stream.request, Failed(exc))]
        return []

    def _tick(self) -> bool:
        """One scheduling step; True if it ran a forward pass.

        With overlap_decode, the events of a tick that ran a forward pass are held while more
        work is waiting (unless one is a request's first token or its end: those go out at once,
        they are the caller's time to first token and to the result), and published and
        delivered during the next tick's forward pass: after
        its llama_decode has returned and before its logits are read, which is when a GPU
        backend computes (on the CPU llama_decode returns when the pass is done, so nothing
        overlaps and delivery only comes later). The next plan needs this tick's tokens, so it
        cannot overlap; the outputs are the same either way, only their delivery moves. Events
        are held only while the scheduler has work, so the thread never sleeps on them."""
        plan, events = self._scheduler.schedule()
        ran = plan is not None and bool(plan.chunks)
        if plan is not None:
            self._guard.expect(plan)
            if self._overlap_decode:
                collect = self._runner.launch(plan)
                self._flush_held()  # the previous tick's, while this pass computes
                result = collect()
            else:
                result = self._runner.execute(plan)
            events += self._scheduler.update(plan, result)
            if self._on_tick is not None and plan.chunks:
                self._on_tick(plan, result, self._scheduler)
        if self._overlap_decode and ran and self._scheduler.has_work and _holdable(events):
            self._held += events
            return True
        if plan is not None or events or self._held:  # e.g. a queued request whose deadline passed
            self._publish(when_due=True)
        self._deliver(events)
        return ran

    def _flush_held(self) -> None:
        """Publish and deliver the events an overlapped tick held back (see _tick)."""
        if self._held:
            self._publish(when_due=True)
            self._deliver([])

    def _publish(self, *, when_due: bool = False) -> None:
        """Before delivering: a caller that saw its request end then reads stats that agree.
        `when_due`: only if a request was admitted, ended or preempted since the last publish
        or PUBLISH_EVERY_S has passed (see stats())."""
        changes, now = self._scheduler.num_changes, time.monotonic()
        is_recent = now - self._published_at < PUBLISH_EVERY_S
        if when_due and changes == self._published_changes and is_recent:
            return
        self._published_at, self._published_changes = now, changes
        self._published = self._scheduler.snapshot(self._kv_cells_total)
        self._scheduler.publish_kv_events(time.time())

    def _deliver(self, events: Emitted) -> None:
        """One call_soon_threadsafe per event loop for the whole tick; events held back by an
        overlapped tick go first (a caller publishes the stats before)."""
        events, self._held = self._held + events, []
        if not events:
            return
        by_loop: Deliveries = defaultdict(list)
        ended: list[tuple[Request, Event]] = []
        with self._wake:
            for request, event in events:
                stream = self._streams.get(request.key)
                if stream is None:
                    continue
                if isinstance(event, Finished | Failed):
                    del self._streams[request.key]
                    ended.append((request, event))
                by_loop[stream.loop].append((stream, event))
        for request, event in ended:
            self._notify_done(request, event)
        self._post(by_loop)

    def _notify_done(self, request: Request, event: Event) -> None:
        if self._on_done is not None:
            self._on_done(request, event)

    @staticmethod
    def _post(by_loop: Deliveries) -> None:
        streams.post(by_loop)


def _holdable(events: Emitted) -> bool:
    """Whether an overlapped tick may hold these events until the next forward pass: later
    tokens of running requests only (a delta carrying all of a request's new output, its
    resumed tokens aside, is its first)."""
    return all(
        isinstance(event, TokenDelta)
        and request.num_output - request.num_resumed > len(event.token_ids)
        for request, event in events
    )
