"""Telemetry: the engine's events (tick, request_done, request_failed), an in-process bus to
subscribe to them (like Erlang's :telemetry.attach), and structlog setup. Events are built on the
engine thread from EngineLoop's on_tick/on_done hooks, only when someone listens. Never imports
llama_cpp, grpc or prometheus_client (see metrics.py)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer

from llama_grpc_server.core.requests.request import Event, Failed, Finished, FinishReason, Request
from llama_grpc_server.core.scheduling.plan import DECODE_OK, StepPlan, StepResult

if TYPE_CHECKING:
    from llama_grpc_server.core.scheduling.scheduler import Scheduler

TICK = "tick"
REQUEST_DONE = "request_done"
REQUEST_FAILED = "request_failed"
EVENT_NAMES = (TICK, REQUEST_DONE, REQUEST_FAILED)

log = structlog.get_logger("llama_grpc.telemetry")


@dataclass(frozen=True, slots=True)
class TickEvent:
    """One forward pass. Counts are tokens; slots and queue are as the tick left them."""

    tick: int
    # tokens in the llama_decode batch: decode_tokens + prefill_tokens + draft_tokens + pad_tokens
    batch_size: int
    decode_tokens: int
    prefill_tokens: int
    num_sequences: int  # slots fed in this batch
    active_slots: int  # slots holding a request after the tick
    queue_depth: int  # requests waiting after the tick
    eval_ms: float  # llama_decode wall time alone
    sample_ms: float  # sampling of every row, after the decode
    is_ok: bool  # llama_decode returned 0 (a KV-full retry is not ok)
    inter_token_ms: tuple[float, ...] = ()  # one per request that sampled again this tick
    model: str = ""  # the engine's model name (Telemetry(model=...))
    # Speculative decoding: draft tokens verified in this pass, and those the sampler agreed
    # with (a request that finished inside its draft may not take them all).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Rows added to make the pass cheaper, never sampled (core.speculation.drafts.Drafts._pad)
    pad_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """How one request went. Times are from its arrival at the engine; rates are tokens/s."""

    request_id: str
    slot: int  # -1 when it never held a slot
    prompt_tokens: int
    generated_tokens: int
    prefix_cache_tokens: int  # prompt tokens whose KV was reused, not evaluated
    prefix_cache_ratio: float  # prefix_cache_tokens / prompt_tokens
    queue_ms: float
    duration_ms: float
    ttft_ms: float | None  # None when no token was sampled
    prompt_eval_rate: float  # evaluated (not cached) prompt tokens per second of prefill
    generation_rate: float  # tokens after the first per second of decoding
    finish_reason: str  # "eos", "max_tokens", ...; "" for a failed request
    error_reason: str = ""  # the ErrorInfo reason of a failed request ("CANCELLED", ...)
    preemptions: int = 0
    tenant: str = ""  # who asked ("" without authentication)
    model: str = ""  # the engine's model name (Telemetry(model=...))

    @property
    def is_failed(self) -> bool:
        return bool(self.error_reason)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TelemetryEvent = TickEvent | RequestEvent
Handler = Callable[[str, TelemetryEvent], None]
"""handler(event_name, event), called on the engine thread: keep it quick, never block."""


class Bus:
    """Handlers per event name. Emitting reads an immutable tuple, so attach/detach from any
    thread is safe while the engine emits; a handler that raises is detached and logged."""

    def __init__(self) -> None:
        self._handlers: dict[str, tuple[Handler, ...]] = {}
        self._lock = threading.Lock()

    def attach(self, event: str, handler: Handler) -> None:
        """Call `handler(event, payload)` on every `event`; attaching it twice is a no-op."""
        _check_name(event)
        with self._lock:
            current = self._handlers.get(event, ())
            if handler not in current:
                self._handlers[event] = (*current, handler)

    def detach(self, event: str, handler: Handler) -> bool:
        """Stop calling `handler` for `event`; False if it was not attached."""
        _check_name(event)
        with self._lock:
            current = self._handlers.get(event, ())
            if handler not in current:
                return False
            self._handlers[event] = tuple(h for h in current if h != handler)
            return True

    def has_handlers(self, event: str) -> bool:
        return bool(self._handlers.get(event))

    def handlers(self, event: str) -> tuple[Handler, ...]:
        return self._handlers.get(event, ())

    def emit(self, event: str, payload: TelemetryEvent) -> None:
        for handler in self._handlers.get(event, ()):
            try:
                handler(event, payload)
            except Exception:
                self.detach(event, handler)
                log.exception(
                    "telemetry_handler_detached", telemetry_event=event, handler=_name(handler)
                )


def _check_name(event: str) -> None:
    if event not in EVENT_NAMES:
        raise ValueError(f"unknown telemetry event {event!r}; expected one of {EVENT_NAMES}")


def _name(handler: Handler) -> str:
    return str(getattr(handler, "__qualname__", None) or repr(handler))


BUS = Bus()
"""The process-wide bus: what attach()/detach()/emit() use and servers publish to by default."""


def attach(event: str, handler: Handler) -> None:
    """Subscribe `handler(event_name, event)` to one of EVENT_NAMES on the process-wide bus."""
    BUS.attach(event, handler)


def detach(event: str, handler: Handler) -> bool:
    return BUS.detach(event, handler)


def emit(event: str, payload: TelemetryEvent) -> None:
    BUS.emit(event, payload)


# -- building events ------------------------------------------------------------------------------


def _rate(tokens: int, ms: float) -> float:
    return tokens * 1000.0 / ms if tokens > 0 and ms > 0 else 0.0


def request_event(
    request: Request, event: Finished | Failed, now_ns: int, model: str = ""
) -> RequestEvent:
    """The request_done / request_failed payload. A Finished event carries the scheduler's own
    usage and timings; a failed request's are taken from it at `now_ns`."""
    if isinstance(event, Finished):
        usage, timings = event.usage, event.timings
        slot, reason, error = event.slot_id, event.reason.value, ""
        # an embedding request generates no token: no time to first token, so the TTFT,
        # prefill and decode histograms stay generation's (its latency still counts)
        has_first_token = event.reason is not FinishReason.EMBEDDED
    else:
        usage, timings = request.usage(), request.timings(now_ns)
        slot, reason, error = request.slot_id, "", event.error.reason
        has_first_token = request.first_token_ns > 0
    cached = usage.cached_prompt_tokens
    evaluated = usage.prompt_tokens - cached
    return RequestEvent(
        request_id=request.request_id,
        slot=slot,
        prompt_tokens=usage.prompt_tokens,
        generated_tokens=usage.completion_tokens,
        prefix_cache_tokens=cached,
        prefix_cache_ratio=cached / usage.prompt_tokens if usage.prompt_tokens else 0.0,
        queue_ms=timings.queue_ms,
        duration_ms=timings.total_ms,
        ttft_ms=timings.ttft_ms if has_first_token else None,
        prompt_eval_rate=_rate(evaluated, timings.prefill_ms) if has_first_token else 0.0,
        generation_rate=_rate(usage.completion_tokens - 1, timings.decode_ms),
        finish_reason=reason,
        error_reason=error,
        preemptions=request.num_preemptions,
        tenant=request.spec.tenant,
        model=model,
    )


class EventSink(Protocol):
    """Something fed every event directly (the Prometheus exporter), before the bus handlers."""

    def on_tick(self, event: TickEvent) -> None: ...

    def on_request(self, event: RequestEvent) -> None: ...


class LogSink:
    """An EventSink writing one debug log line per event (--log-level debug)."""

    def on_tick(self, event: TickEvent) -> None:
        log.debug(TICK, **event.as_dict())

    def on_request(self, event: RequestEvent) -> None:
        log.debug(REQUEST_FAILED if event.is_failed else REQUEST_DONE, **event.as_dict())


class Sinks:
    """Several sinks as one."""

    def __init__(self, *sinks: EventSink) -> None:
        self._sinks = sinks

    def on_tick(self, event: TickEvent) -> None:
        for sink in self._sinks:
            sink.on_tick(event)

    def on_request(self, event: RequestEvent) -> None:
        for sink in self._sinks:
            sink.on_request(event)


class Telemetry:
    """One engine's telemetry: turns EngineLoop hooks into events for a sink (metrics, logs) and
    a bus (the process-wide one by default), each event naming `model`. Pass `on_tick`/`on_done`
    to build_engine. Costs a dict lookup per tick when nobody listens."""

    def __init__(
        self,
        *,
        bus: Bus | None = None,
        sink: EventSink | None = None,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        model: str = "",
    ) -> None:
        self.bus = bus if bus is not None else BUS
        self.sink = sink
        self.model = model
        self._clock_ns = clock_ns
        self._last_token_ns: dict[str, int] = {}  # request key -> when its last token was sampled

    @property
    def is_listened(self) -> bool:
        return self.sink is not None or self.bus.has_handlers(TICK)

    def on_tick(self, plan: StepPlan, result: StepResult, scheduler: Scheduler) -> None:
        """EngineLoop's tick hook (engine thread, after the scheduler's update). Never raises."""
        if not self.is_listened:
            return
        try:
            self._emit_tick(plan, result, scheduler)
        except Exception:
            self._drop_sink(TICK)

    def on_done(self, request: Request, event: Event) -> None:
        """EngineLoop's done hook: request_done for Finished, request_failed for Failed. Never
        raises."""
        if self._last_token_ns:
            self._last_token_ns.pop(request.key, None)
        if not isinstance(event, Finished | Failed):
            return
        name = REQUEST_DONE if isinstance(event, Finished) else REQUEST_FAILED
        if self.sink is None and not self.bus.has_handlers(name):
            return
        try:
            payload = request_event(request, event, self._clock_ns(), self.model)
            if self.sink is not None:
                self.sink.on_request(payload)
            self.bus.emit(name, payload)
        except Exception:
            self._drop_sink(name)

    def _drop_sink(self, event: str) -> None:
        """Bus handlers are guarded one by one; anything else that raises is the sink (or a
        bug building the event): log it once and go on without the sink, never stop the engine."""
        log.exception("telemetry_sink_dropped", telemetry_event=event)
        self.sink = None

    def _emit_tick(self, plan: StepPlan, result: StepResult, scheduler: Scheduler) -> None:
        now_ns = self._clock_ns()
        event = TickEvent(
            tick=plan.tick,
            batch_size=plan.num_tokens,
            decode_tokens=plan.num_decode,
            prefill_tokens=plan.num_prefill,
            num_sequences=len(plan.chunks),
            active_slots=sum(1 for slot in scheduler.slots if slot.request is not None),
            queue_depth=len(scheduler.queue),
            eval_ms=result.eval_ms,
            sample_ms=result.sample_ms,
            is_ok=result.status == DECODE_OK,
            inter_token_ms=self._inter_token_ms(plan, result, now_ns),
            model=self.model,
            draft_tokens=plan.num_draft - plan.num_pad,
            pad_tokens=plan.num_pad,
            accepted_draft_tokens=sum(
                c.num_accepted(result.tokens_of(c.slot_id)) for c in plan.chunks if c.num_draft
            ),
        )
        if self.sink is not None:
            self.sink.on_tick(event)
        self.bus.emit(TICK, event)

    def _inter_token_ms(self, plan: StepPlan, result: StepResult, now_ns: int) -> tuple[float, ...]:
        """Time since each sampling request's previous token (engine side, preemptions included)."""
        gaps: list[float] = []
        last = self._last_token_ns
        for chunk in plan.chunks:
            if chunk.slot_id not in result.sampled:
                continue
            previous = last.get(chunk.request_id)
            if previous is not None:
                gaps.append((now_ns - previous) / 1e6)
            last[chunk.request_id] = now_ns
        return tuple(gaps)


# -- structlog ------------------------------------------------------------------------------------


def log_format_for(log_format: str, stream: TextIO) -> str:
    """ "json" or "console" for a --log-format: "auto" is console lines for a person reading the
    log stream at a terminal, JSON lines for everything else (a file, a pipe, a log collector).
    The stream the logs go to decides, not stdout: `serve 2>log.jsonl` at a terminal is for
    machines."""
    if log_format != "auto":
        return log_format
    try:
        is_terminal = stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal
        is_terminal = False
    return "console" if is_terminal else "json"


def configure_logging(
    log_format: str, level: str, *, stream: TextIO | None = None, cache_loggers: bool = True
) -> None:
    """structlog to `stream` (stderr) as JSON lines (or the console renderer: log_format_for
    decides "auto") at `level`; stdlib logging (grpc, asyncio) goes through the same renderer.
    Every line carries the contextvars bound by the request interceptor (request_id). Tests
    pass cache_loggers=False so that structlog.testing.capture_logs keeps working after them."""
    out = stream if stream is not None else sys.stderr
    log_format = log_format_for(log_format, out)
    num_level = logging.getLevelNamesMapping()[level.upper()]
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Tracebacks never render frame locals (structlog's defaults do): locals hold requests, and
    # prompt or output text reaches the logs only with --log-payloads.
    renderer: structlog.types.Processor = structlog.dev.ConsoleRenderer(
        exception_formatter=structlog.dev.plain_traceback
    )
    if log_format == "json":
        shared.append(
            structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))
        )
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(num_level),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=cache_loggers,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(num_level)
