"""`vllm.grpc.engine.VllmEngine` handlers, for the SMG gateway and other callers of the vLLM
engine protocol: validate (rpc.vllm.requests) -> submit the same GenerationRequests v1 builds
to the same engine -> convert (rpc.vllm.convert). Served beside LlmService on the same port,
behind the same interceptors, access rules and health; the default model answers.

The protocol names no model and has no LoRA field: a replica started with --engine-lora NAME
applies that adapter of the default model to every Generate (in the requests' cache scope too,
so slots, tiers and KV events keep it apart from the base model) and reports itself to the
gateway as model `<model>+NAME` (GetModelInfo), which SMG then routes by name; Embed is refused
there (embeddings apply no adapter).

State: the model pool (attached once the default model loads), the draining flag shared with
LlmService, and the calls in flight by (tenant, request_id), so that Abort reaches them and a
second call with an id in flight gets ALREADY_EXISTS. Never imports llama_cpp."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import time
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc_server import errors
from llama_grpc_server.config import Settings
from llama_grpc_server.config.settings import parse_engine_lora
from llama_grpc_server.core import stats
from llama_grpc_server.core.adapters import AdapterSet, scoped
from llama_grpc_server.core.api import EngineApi, ModelInfo, RequestStream
from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES
from llama_grpc_server.core.requests.request import (
    Finished,
    GenerationRequest,
    TokenDelta,
    request_key,
)
from llama_grpc_server.models import tokenizer_export
from llama_grpc_server.models.pool import ModelPool
from llama_grpc_server.rpc.plumbing.interceptors import current_principal, current_request_id
from llama_grpc_server.rpc.plumbing.status import ErrorsToStatus
from llama_grpc_server.rpc.shared import thinking
from llama_grpc_server.rpc.shared.running import (
    NO_RESULT,
    PoolServicer,
    deadline_of,
    run_request,
    tokenize_text,
)
from llama_grpc_server.rpc.vllm import convert, requests

VLLM_SERVICE_NAME: str = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_CHUNK_BYTES = 1 << 20  # GetTokenizer's zip, sent in pieces of at most this
KV_HEARTBEAT_S = 0.5
PROMPT_TAIL_TOKENS = 16  # the prompt's end read for an open or closed thinking section
"""A KV event stream with nothing to send sends its load this often: SMG counts a worker silent
for --worker-stall-secs (2 s) as stalled, and the stream is its contact while it routes."""

log = structlog.get_logger("llama_grpc.rpc")

if TYPE_CHECKING:  # generic only in grpc-stubs
    Context = grpc.aio.ServicerContext[Any, Any]

TokenizerZip = Callable[[], bytes]
Outcome = TokenDelta | Finished | None  # None: the sample was aborted


def _version() -> str:
    try:
        return f"llama-grpc {importlib.metadata.version('llama-grpc')}"
    except importlib.metadata.PackageNotFoundError:
        return "llama-grpc"


def exported_tokenizer(info: ModelInfo) -> TokenizerZip:
    """The zip of the model's tokenizer (models/tokenizer_export.py) with the chat template in use
    (a built-in's source, else the model file's own), kept in the exporter's disk cache so that a
    restart does not build it again."""
    template = BUILTIN_TEMPLATES.get(info.chat_template)  # None: the model file's own
    cache_dir = tokenizer_export.default_cache_dir()
    return lambda: tokenizer_export.tokenizer_zip(info.model_path, template, cache_dir=cache_dir)


class _Wake:
    """Wakes one KV event stream from the engine thread: at most one call_soon_threadsafe in
    flight per stream, however many batches the engine publishes meanwhile."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self._scheduled = False

    def notify(self) -> None:  # engine thread
        if not self._scheduled:
            self._scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                self.loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        self._scheduled = False
        self.event.set()


@dataclass(eq=False)
class _InFlight:
    """One Generate call's engine streams, so Abort can cancel them."""

    streams: list[RequestStream] = field(default_factory=list)
    is_aborted: bool = False

    def abort(self) -> None:
        self.is_aborted = True
        for stream in self.streams:
            stream.cancel()


async def _sample_events(
    engine: EngineApi, spec: GenerationRequest, call: _InFlight, context: Context
) -> AsyncGenerator[Outcome, None]:
    """One sample's deltas, then Finished, or None once Abort has ended it."""
    try:
        run = run_request(engine, spec, context, on_submit=call.streams.append)
        async with aclosing(run) as events:
            async for event in events:
                yield event
    except errors.DuplicateRequest as exc:
        raise errors.DuplicateRequest(exc.message, field="request_id") from None
    except errors.ServiceError:
        if not call.is_aborted:
            raise
        yield None


async def _merged(
    runs: Sequence[AsyncGenerator[Outcome, None]],
) -> AsyncGenerator[tuple[int, Outcome], None]:
    """(index, event) from every run as they come. One run is read directly; several each
    through a task, all cancelled (their engine requests with them) if this ends early."""
    if len(runs) == 1:
        async with aclosing(runs[0]) as events:
            async for event in events:
                yield 0, event
        return
    pending: dict[asyncio.Future[Outcome], int] = {
        asyncio.ensure_future(anext(run)): index for index, run in enumerate(runs)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    event = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(runs[index]))] = index
                yield index, event
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for run in runs:
            await run.aclose()


class VllmEngineServicer(PoolServicer, vpb_grpc.VllmEngineServicer):  # type: ignore[misc]
    """The VllmEngine service over the server's model pool (see the module docstring).
    `tokenizer_zip` builds GetTokenizer's archive; by default
    llama_grpc_server.models.tokenizer_export does, for the default model."""

    def __init__(
        self,
        settings: Settings,
        pool: ModelPool | None = None,
        *,
        draining: asyncio.Event | None = None,
        tokenizer_zip: TokenizerZip | None = None,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self.draining = draining if draining is not None else asyncio.Event()
        self._tokenizer_zip = tokenizer_zip
        self._in_flight: dict[str, _InFlight] = {}
        self._started = time.monotonic()
        self._last_receive = 0.0
        self._version = _version()
        # --engine-lora: (adapter name, scale or None for its default), or None
        engine_lora = settings.model.engine_lora
        self._engine_lora = parse_engine_lora(engine_lora) if engine_lora else None

    # -- the adapter of --engine-lora -------------------------------------------------------------

    def _engine_adapters(self, engine: EngineApi, *, check_tenant: bool = True) -> AdapterSet:
        """The adapter set every engine-protocol request applies: --engine-lora's, () without
        it. FAILED_PRECONDITION when that adapter is not loaded (an admin unloaded it),
        PERMISSION_DENIED when the caller's tenant may not use it (`check_tenant`)."""
        if self._engine_lora is None:
            return ()
        name, scale = self._engine_lora
        if engine.adapters.get(name) is None:
            raise errors.FailedPrecondition(
                f"this replica applies adapter {name!r} to the engine protocol (--engine-lora), "
                "and it is not loaded"
            )
        allowed = current_principal().adapters if check_tenant else None
        return engine.adapters.resolve([(name, scale)], allowed=allowed, field_name="engine_lora")

    def _served_name(self, info: ModelInfo) -> str:
        """The model id the gateway registers this worker under: the model's name, with
        `+NAME` for --engine-lora's adapter."""
        if self._engine_lora is None:
            return info.model_name
        return f"{info.model_name}+{self._engine_lora[0]}"

    # -- generation -------------------------------------------------------------------------------

    async def Generate(
        self, request: vpb.GenerateRequest, context: Context
    ) -> AsyncIterator[vpb.GenerateResponse]:
        request_id = request.request_id or current_request_id()
        async with (
            ErrorsToStatus(context, request_id),
            self._ready_pool().lease("", deadline_of(context)) as engine,
        ):
            self._last_receive = time.time()
            specs = await self._requests(request, request_id, engine, context)
            key = request_key(current_principal().tenant, request_id)
            if key in self._in_flight:
                raise errors.DuplicateRequest(
                    f"request id {request_id!r} is already in flight", field="request_id"
                )
            call = self._in_flight[key] = _InFlight()
            try:
                messages = self._generate(engine, specs, call, context, stream=request.stream)
                async for message in messages:
                    yield message
            finally:
                del self._in_flight[key]

    async def _requests(
        self, request: vpb.GenerateRequest, request_id: str, engine: EngineApi, context: Context
    ) -> list[GenerationRequest]:
        parsed = requests.parse_generate(
            request, engine.model_info, self._settings.scheduler, grammars=engine
        )
        adapters = self._engine_adapters(engine)
        tokens: Sequence[int] = parsed.checked.prompt_tokens
        if parsed.text is not None:  # as the gateway's tokenizer: BOS added, specials parsed
            tokens = await tokenize_text(engine, parsed.text, add_special=True, parse_special=True)
        thinks = self._thinking(engine, tokens)
        if thinks is not None:  # the constraint applies after the thinking (SMG reads it so)
            after = thinking.after_thinking(
                parsed.checked.constraint, thinks.fmt, engine, opened=thinks.params.opened
            )
            parsed = dataclasses.replace(
                parsed, checked=dataclasses.replace(parsed.checked, constraint=after)
            )
        specs = requests.generation_requests(
            parsed,
            tokens,
            request_id=request_id,
            deadline=deadline_of(context),
            tenant=current_principal().tenant,
            adapters=adapters,
        )
        if thinks is None:
            return specs
        return [dataclasses.replace(spec, reasoning=thinks.params) for spec in specs]

    def _thinking(self, engine: EngineApi, tokens: Sequence[int]) -> thinking.Thinking | None:
        """A prompt of a thinking model's template that thinks (its end read as text: the
        gateway renders the template): the server's reasoning budget applies."""
        template = engine.model_info.chat_template
        if not template or not tokens:
            return None
        tail = engine.detokenize(list(tokens[-PROMPT_TAIL_TOKENS:]), render_special=True)
        return thinking.thinking(engine, template, tail, None, self._settings.scheduler)

    async def _generate(
        self,
        engine: EngineApi,
        specs: list[GenerationRequest],
        call: _InFlight,
        context: Context,
        *,
        stream: bool,
    ) -> AsyncGenerator[vpb.GenerateResponse, None]:
        """Chunks as tokens come (streaming), and each sample's GenerateComplete as it ends."""
        samples = [
            convert.Sample(
                index,
                len(spec.prompt_tokens),
                spec.output.top_logprobs if spec.output.logprobs else None,
            )
            for index, spec in enumerate(specs)
        ]
        runs = [_sample_events(engine, spec, call, context) for spec in specs]
        async with aclosing(_merged(runs)) as events:
            async for index, event in events:
                sample = samples[index]
                if isinstance(event, TokenDelta):
                    sample.add(event)
                    if stream and event.token_ids:
                        yield convert.chunk(sample, event)
                else:
                    yield convert.complete(sample, event)

    async def Abort(self, request: vpb.AbortRequest, context: Context) -> vpb.AbortResponse:
        """End the caller's calls with these ids (finish reason "abort"); unknown or finished
        ids are ignored, so aborting twice is harmless."""
        tenant = current_principal().tenant
        for request_id in request.request_ids:
            call = self._in_flight.get(request_key(tenant, request_id))
            if call is not None:
                call.abort()
        return vpb.AbortResponse()

    # -- the worker's state -----------------------------------------------------------------------

    async def HealthCheck(
        self, request: vpb.HealthCheckRequest, context: Context
    ) -> vpb.HealthCheckResponse:
        """Healthy while the default model's engine takes requests (running, or warming up with
        requests waiting for it) and the server is not draining."""
        engine = None if self._pool is None else self._pool.default_engine()
        if engine is None:
            return vpb.HealthCheckResponse(healthy=False, message="the model is still loading")
        snapshot = engine.stats()
        if snapshot.engine_state not in ("starting", "running"):
            why = snapshot.engine_error or snapshot.engine_state
            return vpb.HealthCheckResponse(healthy=False, message=f"the engine is down: {why}")
        if self.draining.is_set():
            return vpb.HealthCheckResponse(healthy=False, message="the server is draining")
        if self._engine_lora is not None and engine.adapters.get(self._engine_lora[0]) is None:
            why = f"adapter {self._engine_lora[0]!r} (--engine-lora) is not loaded"
            return vpb.HealthCheckResponse(healthy=False, message=why)
        return vpb.HealthCheckResponse(healthy=True, message="healthy")

    async def GetModelInfo(
        self, request: vpb.GetModelInfoRequest, context: Context
    ) -> vpb.GetModelInfoResponse:
        async with ErrorsToStatus(context, current_request_id()):
            engine = self._ready_pool().resident("", field=None)
            limits = self._settings.scheduler
            return convert.model_info(
                engine.model_info,
                limits.default_sampling,
                limits.default_max_tokens,
                self._served_name(engine.model_info),
            )

    async def GetServerInfo(
        self, request: vpb.GetServerInfoRequest, context: Context
    ) -> vpb.GetServerInfoResponse:
        async with ErrorsToStatus(context, current_request_id()):
            snapshot = self._ready_pool().load_snapshot()
            return vpb.GetServerInfoResponse(
                active_requests=snapshot.active_slots + snapshot.queue_depth,
                is_paused=self.draining.is_set(),
                last_receive_timestamp=self._last_receive,
                uptime_seconds=time.monotonic() - self._started,
                server_type=convert.SERVER_TYPE,
                data_parallel_size=1,
                max_num_seqs=snapshot.n_parallel,
            )

    async def GetLoads(
        self, request: vpb.GetLoadsRequest, context: Context
    ) -> vpb.GetLoadsResponse:
        """WatchLoad's figures: the resident models' load summed."""
        async with ErrorsToStatus(context, current_request_id()):
            snapshot = self._ready_pool().load_snapshot()
            load = stats.load_of(
                snapshot, is_draining=self.draining.is_set(), unix_ms=time.time_ns() // 1_000_000
            )
            return convert.loads(load, self._version)

    async def FlushCache(
        self, request: cpb.FlushCacheRequest, context: Context
    ) -> cpb.FlushCacheResponse:
        """ClearCache of the default model (admin only): idle slots' prefixes and the RAM, disk
        and response caches; running requests are never touched, so timeout_s is not needed."""
        async with ErrorsToStatus(context, current_request_id()):
            engine = self._ready_pool().resident("", field=None)
            cleared = await engine.clear_cache()
            fields = dataclasses.asdict(cleared)
            log.info("cache_cleared", model=engine.model_info.model_name, **fields)
            summary = ", ".join(f"{name}={value}" for name, value in fields.items())
            return cpb.FlushCacheResponse(success=True, message=summary)

    async def GetTokenizer(
        self, request: cpb.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[cpb.GetTokenizerChunk]:
        """The default model's tokenizer files as one zip, in chunks; the last carries the
        archive's sha256."""
        async with ErrorsToStatus(context, current_request_id()):
            engine = self._ready_pool().resident("", field=None)
            make = self._tokenizer_zip or exported_tokenizer(engine.model_info)
            try:
                data = await asyncio.to_thread(make)
            except (ValueError, OSError) as exc:  # a vocabulary it cannot export exactly, or
                # a model file it cannot read
                raise errors.FailedPrecondition(f"no tokenizer to export: {exc}") from None
            digest = hashlib.sha256(data).hexdigest()
            starts = range(0, max(len(data), 1), TOKENIZER_CHUNK_BYTES)
            for start in starts:
                end = start + TOKENIZER_CHUNK_BYTES
                yield cpb.GetTokenizerChunk(
                    data=data[start:end], sha256=digest if end >= len(data) else ""
                )

    async def SubscribeKvEvents(
        self, request: cpb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[cpb.KvEventBatch]:
        """The default model's KV cache as block events (core.kv.events): the batches after
        start_sequence_number, or a snapshot (cleared, then every block held) when it is 0, not
        kept any more, or from an earlier process; then each batch as the engine publishes it,
        and a load-only record when the load changes without KV events and every
        KV_HEARTBEAT_S while nothing else goes out. A subscriber sees its own tenant's blocks
        only. Ends when the server drains."""
        async with ErrorsToStatus(context, current_request_id()):
            engine = self._ready_pool().resident("", field=None)
            log = engine.kv_events
            # the scope of this replica's own engine-protocol requests goes out unsalted
            plain = scoped("", self._engine_adapters(engine, check_tenant=False))
            salt = convert.scope_salt(current_principal().tenant, plain)
            wake = _Wake(asyncio.get_running_loop())
            remove = log.add_listener(wake.notify)
            drained = asyncio.ensure_future(self.draining.wait())
            cursor, sample, sent_load = request.start_sequence_number, 0, -1
            try:
                while not self.draining.is_set():
                    wake.event.clear()
                    read = log.read(cursor)
                    for batch in read.batches:
                        sample += 1
                        yield convert.kv_event_batch(batch, salt, sample)
                    cursor = read.seq
                    if read.batches:
                        sent_load = read.load_version
                    elif read.load_version != sent_load and cursor > 0:
                        sample += 1
                        yield convert.load_only_batch(cursor, read.load, sample, time.time())
                        sent_load = read.load_version
                    woken = asyncio.ensure_future(wake.event.wait())
                    done, _ = await asyncio.wait(
                        (woken, drained), timeout=KV_HEARTBEAT_S, return_when=FIRST_COMPLETED
                    )
                    woken.cancel()
                    if not done:
                        sent_load = -1  # a heartbeat: the record again
            finally:
                remove()
                drained.cancel()

    # -- embeddings -------------------------------------------------------------------------------

    async def Embed(self, request: vpb.EmbedRequest, context: Context) -> vpb.EmbedResponse:
        """One tokenized input's vector (the gateway's /v1/embeddings sends one call per
        input): an embedding request of the shared scheduler, as a v1 Embed with its defaults
        (the model's pooling, else mean; L2-normalized). Abort cancels it (CANCELLED)."""
        request_id = request.request_id or current_request_id()
        async with (
            ErrorsToStatus(context, request_id),
            self._ready_pool().lease("", deadline_of(context)) as engine,
        ):
            self._last_receive = time.time()
            if self._engine_lora is not None:
                raise errors.FailedPrecondition(
                    f"this replica applies adapter {self._engine_lora[0]!r} to the engine "
                    "protocol (--engine-lora), and embeddings apply no adapter: ask a replica "
                    "of the base model"
                )
            tenant = current_principal().tenant
            spec = requests.embed_request(
                request.tokenized.input_ids,
                engine.model_info,
                request_id=request_id,
                deadline=deadline_of(context),
                tenant=tenant,
            )
            key = request_key(tenant, request_id)
            if key in self._in_flight:
                raise errors.DuplicateRequest(
                    f"request id {request_id!r} is already in flight", field="request_id"
                )
            call = self._in_flight[key] = _InFlight()
            try:
                run = run_request(
                    engine, spec, context, "embeddings", on_submit=call.streams.append
                )
                async with aclosing(run) as events:
                    async for event in events:
                        if isinstance(event, Finished):
                            return convert.embed_response(event)
                raise errors.EngineError(NO_RESULT)
            finally:
                del self._in_flight[key]

    # -- not served -------------------------------------------------------------------------------

    async def StartProfile(
        self, request: cpb.StartProfileRequest, context: Context
    ) -> cpb.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not supported")
        raise AssertionError("context.abort returned")  # pragma: no cover

    async def StopProfile(
        self, request: cpb.StopProfileRequest, context: Context
    ) -> cpb.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not supported")
        raise AssertionError("context.abort returned")  # pragma: no cover


__all__ = ["KV_HEARTBEAT_S", "VLLM_SERVICE_NAME", "VllmEngineServicer", "exported_tokenizer"]
