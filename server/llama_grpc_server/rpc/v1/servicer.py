"""LlmService handlers: validate -> submit -> convert -> yield. Nothing lives here beyond one
call's locals and the model pool (None while the default model loads at start: RPCs answer
NOT_READY). A call that needs a model's engine holds a lease on it from the pool for its whole
length (so the model is not unloaded under it). Never touches the scheduler thread directly;
never imports llama_cpp."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server import errors
from llama_grpc_server.config import Settings
from llama_grpc_server.core import adapters, stats
from llama_grpc_server.core.adapters import AdapterEntry, AdapterSet
from llama_grpc_server.core.api import EngineApi, StatsSnapshot
from llama_grpc_server.core.reasoning.split import ReasoningSplitter
from llama_grpc_server.core.reasoning.stream import with_reasoning
from llama_grpc_server.core.requests.request import (
    Finished,
    GenerationRequest,
    TokenDelta,
)
from llama_grpc_server.core.tools.stream import ToolSession, with_tool_calls
from llama_grpc_server.core.tools.types import ToolSpec
from llama_grpc_server.models.pool import ModelPool
from llama_grpc_server.rpc.plumbing.interceptors import (
    current_principal,
    current_request_id,
    new_request_id,
)
from llama_grpc_server.rpc.plumbing.status import ErrorsToStatus
from llama_grpc_server.rpc.shared import checks, thinking
from llama_grpc_server.rpc.shared.running import (
    NO_RESULT,
    PoolServicer,
    deadline_of,
    run_request,
    tokenize_text,
)
from llama_grpc_server.rpc.v1 import convert, embeddings, reasoning, tools, validation

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["LlmService"].full_name

log = structlog.get_logger("llama_grpc.rpc")

if TYPE_CHECKING:  # generic only in grpc-stubs
    Context = grpc.aio.ServicerContext[Any, Any]


async def _chat_tokens(
    engine: EngineApi,
    checked: checks.CheckedRequest,
    offered: Sequence[ToolSpec],
    variables: Mapping[str, Any],
    *,
    add_bos: bool,
) -> tuple[str, list[int]]:
    """Render the conversation (offering `offered`, with the template `variables`) and
    tokenize it: the prompt text and its tokens. The template writes the special tokens (parsed
    as such), so the only BOS is the template's (or one added here)."""
    try:
        text = engine.render_chat(checked.messages, checked.chat_template, offered, variables)
    except ValueError as exc:
        raise errors.InvalidRequest(str(exc), field="messages") from None
    tokens = await tokenize_text(engine, text, add_special=False, parse_special=True)
    return text, (validation.chat_prompt_tokens(tokens, engine.model_info) if add_bos else tokens)


def _adapters(engine: EngineApi, checked: checks.CheckedRequest) -> AdapterSet:
    """The LoRA adapters a request applies, resolved against its model's (INVALID_ARGUMENT for
    an unknown one, PERMISSION_DENIED for one its tenant may not use)."""
    if not checked.lora:
        return ()
    return engine.adapters.resolve(checked.lora, allowed=current_principal().adapters)


def _visible(engine: EngineApi, allowed: frozenset[str] | None) -> list[AdapterEntry]:
    """The model's adapters a caller may see: those its tenant may use."""
    return [e for e in engine.adapters.entries() if allowed is None or e.name in allowed]


def _request_id() -> str:
    """The interceptor's id; a fresh one when the servicer runs without it."""
    return current_request_id() or new_request_id()


def _operation(request: validation.TextRequest) -> str:
    """The GenAI operation name of a text request."""
    return "chat" if request.messages else "text_completion"


def _seen_by(snapshot: StatsSnapshot, tenant: str) -> StatsSnapshot:
    """The snapshot as a user of `tenant` may see it: other tenants' request ids are blanked
    (their slots' states and sizes stay: capacity is every tenant's business)."""
    slots = tuple(
        s if s.tenant == tenant else dataclasses.replace(s, request_id="", tenant="")
        for s in snapshot.slots
    )
    return dataclasses.replace(snapshot, slots=slots)


async def _collect(
    engine: EngineApi,
    spec: GenerationRequest,
    context: Context,
    operation: str,
    chat: _Chat | None = None,
) -> tuple[list[TokenDelta], Finished]:
    deltas: list[TokenDelta] = []
    async with aclosing(_events(engine, spec, context, operation, chat)) as events:
        async for event in events:
            if isinstance(event, Finished):
                return deltas, event
            deltas.append(event)
    raise errors.EngineError(NO_RESULT)  # unreachable: _run ends with Finished or raises


@dataclass(frozen=True, slots=True)
class _Chat:
    """What turns a chat request's output into its answer: thinking split from the text (a
    thinking model), then tool calls parsed out of the answer (a request offering tools)."""

    splitter: ReasoningSplitter | None = None
    session: ToolSession | None = None

    def resume(self, text: str) -> None:
        """A resumed request: what its resumed tokens' text did to the transforms, done again,
        their output dropped (the caller has it), so the answer goes on where the cut stream
        left off: thinking or answer, inside a tool call or not."""
        answer = self.splitter.push(text)[1] if self.splitter is not None else text
        if self.session is not None:
            self.session.push(answer)


async def _events(
    engine: EngineApi,
    spec: GenerationRequest,
    context: Context,
    operation: str,
    chat: _Chat | None,
) -> AsyncGenerator[TokenDelta | Finished, None]:
    """run_request's events, with thinking split from the text and tool calls parsed out of
    the answer (`chat`)."""
    on_resumed = chat.resume if chat is not None else None
    run = run_request(engine, spec, context, operation, on_resumed=on_resumed)
    async with aclosing(run) as events:
        source: AsyncIterator[TokenDelta | Finished] = events
        if chat is not None and chat.splitter is not None:
            source = with_reasoning(source, chat.splitter)
        if chat is not None and chat.session is not None:
            source = with_tool_calls(source, chat.session)
        async for event in source:
            yield event


async def embed_all(
    engine: EngineApi, specs: Sequence[GenerationRequest], context: Context, limit: int
) -> list[Finished]:
    """Run embedding requests, at most `limit` submitted at a time (a large batch waits here,
    not in the engine's queue, where it would meet max_queue and crowd out other callers);
    their Finished events in order. The first failure cancels the rest and raises."""
    gate = asyncio.Semaphore(max(1, limit))

    async def one(spec: GenerationRequest) -> Finished:
        async with gate:
            _deltas, done = await _collect(engine, spec, context, "embeddings")
            return done

    tasks = [asyncio.ensure_future(one(spec)) for spec in specs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _unix_ms() -> int:
    return time.time_ns() // 1_000_000


class LlmServicer(PoolServicer, pb_grpc.LlmServiceServicer):
    """The LlmService. `draining` is set when the server starts to stop (RunningServer.stop):
    WatchLoad streams then end at once instead of holding the grace period open."""

    def __init__(self, settings: Settings, pool: ModelPool | None = None) -> None:
        self._settings = settings
        self._pool = pool
        self.draining = asyncio.Event()

    def _engine(
        self, model: str, context: Context
    ) -> contextlib.AbstractAsyncContextManager[EngineApi]:
        """The named model's engine for the length of the call, loaded first if need be (the
        wait bounded by the call's deadline)."""
        return self._ready_pool().lease(model, deadline_of(context))

    async def _text_request(
        self, message: validation.TextRequest, engine: EngineApi, request_id: str, context: Context
    ) -> tuple[GenerationRequest, _Chat]:
        """The request to submit and what turns its output into its answer."""
        limits = self._settings.scheduler
        checked = validation.parse_text_request(message, engine.model_info, limits, grammars=engine)
        offered = tools.parse_tools(message)
        options = reasoning.parse_chat_options(message)
        session = None
        if offered.offered:
            fmt = tools.tool_format(engine, checked.chat_template)
            checked = dataclasses.replace(
                checked,
                constraint=tools.constraint(offered, fmt, engine) or checked.constraint,
                output=tools.with_shown(checked.output, tools.shown_specials(engine, fmt)),
                stopping=tools.with_stops(checked.stopping, fmt),
            )
            session = tools.session(offered, fmt, request_id)
        add_special = validation.add_special(message)
        thinks = None
        if checked.messages:
            text, tokens = await _chat_tokens(
                engine, checked, offered.offered, options.variables, add_bos=add_special
            )
            thinks = thinking.thinking(engine, checked.chat_template, text, options.budget, limits)
        else:
            tokens = await tokenize_text(
                engine, message.prompt, add_special=add_special, parse_special=False
            )
        if thinks is not None:
            after = thinking.after_thinking(
                checked.constraint, thinks.fmt, engine, opened=thinks.params.opened
            )
            shown = checked.output.shown_specials + thinking.shown_specials(engine, thinks.fmt)
            checked = dataclasses.replace(
                checked, constraint=after, output=tools.with_shown(checked.output, shown)
            )
        spec = checks.complete_request(
            checked,
            tokens,
            request_id=request_id,
            deadline=deadline_of(context),
            tenant=current_principal().tenant,
            adapters=_adapters(engine, checked),
        )
        if thinks is None:
            return spec, _Chat(session=session)
        spec = dataclasses.replace(spec, reasoning=thinks.params)
        return spec, _Chat(thinks.splitter(), session)

    # -- generation -------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        request_id = _request_id()
        async with (
            ErrorsToStatus(context, request_id),
            self._engine(request.model, context) as engine,
        ):
            spec, chat = await self._text_request(request, engine, request_id, context)
            deltas, finished = await _collect(engine, spec, context, _operation(request), chat)
            return convert.generate_response(request_id, deltas, finished)

    async def StreamGenerate(
        self, request: pb.StreamGenerateRequest, context: Context
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        request_id = _request_id()
        async with (
            ErrorsToStatus(context, request_id),
            self._engine(request.model, context) as engine,
        ):
            spec, chat = await self._text_request(request, engine, request_id, context)
            operation = _operation(request)
            async with aclosing(_events(engine, spec, context, operation, chat)) as events:
                async for event in events:
                    yield convert.stream_generate_response(event, request_id)

    async def GenerateTokens(
        self, request: pb.GenerateTokensRequest, context: Context
    ) -> AsyncIterator[pb.GenerateTokensResponse]:
        request_id = _request_id()
        async with (
            ErrorsToStatus(context, request_id),
            self._engine(request.model, context) as engine,
        ):
            limits = self._settings.scheduler
            checked = validation.parse_tokens_request(
                request, engine.model_info, limits, grammars=engine
            )
            spec = checks.complete_request(
                checked,
                checked.prompt_tokens,
                request_id=request_id,
                deadline=deadline_of(context),
                tenant=current_principal().tenant,
                adapters=_adapters(engine, checked),
            )
            async with aclosing(run_request(engine, spec, context)) as events:
                async for event in events:
                    yield convert.generate_tokens_response(event, request_id)

    # -- embeddings -------------------------------------------------------------------------------

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        request_id = _request_id()
        async with (
            ErrorsToStatus(context, request_id),
            self._engine(request.model, context) as engine,
        ):
            info = engine.model_info
            plan = embeddings.parse(request, info)
            deadline, tenant = deadline_of(context), current_principal().tenant
            specs: list[GenerationRequest] = []
            for index, item in enumerate(request.inputs):
                if item.WhichOneof("input") == "tokens":
                    tokens = list(item.tokens.ids)
                else:
                    tokens = await tokenize_text(
                        engine, item.text, add_special=plan.add_special, parse_special=False
                    )
                input_id = f"{request_id}/{index}"
                specs.append(
                    embeddings.request(
                        plan, index, tokens, request_id=input_id, deadline=deadline, tenant=tenant
                    )
                )
            finished = await embed_all(engine, specs, context, 2 * info.n_parallel)
            return embeddings.response(request_id, plan, finished, info.n_embd)

    # -- no scheduler: answered on the event loop -------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest, context: Context) -> pb.TokenizeResponse:
        async with (
            ErrorsToStatus(context, _request_id()),
            self._engine(request.model, context) as engine,
        ):
            token_ids = await tokenize_text(
                engine,
                request.text,
                add_special=validation.add_special(request),
                parse_special=request.parse_special,
            )
            pieces = [engine.token_piece(t) for t in token_ids] if request.return_pieces else []
            return pb.TokenizeResponse(token_ids=token_ids, pieces=pieces)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: Context
    ) -> pb.DetokenizeResponse:
        async with (
            ErrorsToStatus(context, _request_id()),
            self._engine(request.model, context) as engine,
        ):
            checks.check_token_ids(request.token_ids, engine.model_info.n_vocab)
            text = engine.detokenize(list(request.token_ids), render_special=request.render_special)
            return pb.DetokenizeResponse(text=text)

    async def GetStats(self, request: pb.GetStatsRequest, context: Context) -> pb.GetStatsResponse:
        async with ErrorsToStatus(context, _request_id()):
            engine = self._ready_pool().resident(request.model)
            snapshot = engine.stats()
            caller = current_principal()
            if not caller.is_admin:  # a user sees its own requests' ids only
                snapshot = _seen_by(snapshot, caller.tenant)
            name = engine.model_info.model_name
            return convert.stats_response(snapshot, name, _visible(engine, caller.adapters))

    async def WatchLoad(
        self, request: pb.WatchLoadRequest, context: Context
    ) -> AsyncIterator[pb.LoadReport]:
        """A report at once, then one per interval (a timed wait, never a poll); once draining,
        a last report with serving=false, then OK. Aggregate figures only: open to users."""
        async with ErrorsToStatus(context, _request_id()):
            interval_s = validation.watch_interval_s(request.interval_ms)
            pool = self._ready_pool()
            next_at = time.monotonic()
            while True:
                is_draining = self.draining.is_set()
                snapshot = pool.load_snapshot()
                load = stats.load_of(snapshot, is_draining=is_draining, unix_ms=_unix_ms())
                yield convert.load_report(load)
                if is_draining:
                    return
                # On schedule; after a stall (a slow reader) one report at once, never a burst.
                next_at = max(next_at + interval_s, time.monotonic())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(next_at - time.monotonic()):
                        await self.draining.wait()

    async def ClearCache(
        self, request: pb.ClearCacheRequest, context: Context
    ) -> pb.ClearCacheResponse:
        async with ErrorsToStatus(context, _request_id()):
            engine = self._ready_pool().resident(request.model)
            cleared = await engine.clear_cache()
            log.info(
                "cache_cleared", model=engine.model_info.model_name, **dataclasses.asdict(cleared)
            )
            return pb.ClearCacheResponse(**dataclasses.asdict(cleared))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Context
    ) -> pb.GetModelInfoResponse:
        async with (
            ErrorsToStatus(context, _request_id()),
            self._engine(request.model, context) as engine,
        ):
            return convert.model_info_response(engine.model_info)

    # -- LoRA adapters ----------------------------------------------------------------------------

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: Context
    ) -> pb.LoadAdapterResponse:
        async with (
            ErrorsToStatus(context, _request_id()),
            self._engine(request.model, context) as engine,
        ):
            name = adapters.check_name(request.name, "name")
            if not request.path:
                raise errors.InvalidRequest("path must name the adapter's GGUF file", field="path")
            scale = (
                adapters.check_scale(request.default_scale, "default_scale")
                if request.HasField("default_scale")
                else 1.0
            )
            entry = await engine.load_adapter(name, request.path, scale)
            model = engine.model_info.model_name
            log.info("adapter_added", model=model, name=name, path=request.path)
            return pb.LoadAdapterResponse(adapter=convert.adapter(entry, model, engine.stats()))

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: Context
    ) -> pb.UnloadAdapterResponse:
        async with ErrorsToStatus(context, _request_id()):
            engine = self._ready_pool().resident(request.model)
            in_flight = await engine.unload_adapter(request.name)
            return pb.UnloadAdapterResponse(in_flight=in_flight)

    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: Context
    ) -> pb.ListAdaptersResponse:
        async with (
            ErrorsToStatus(context, _request_id()),
            self._engine(request.model, context) as engine,
        ):
            model, snapshot = engine.model_info.model_name, engine.stats()
            shown = _visible(engine, current_principal().adapters)
            return pb.ListAdaptersResponse(
                adapters=[convert.adapter(e, model, snapshot) for e in shown]
            )

    # -- models (admin) ---------------------------------------------------------------------------

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsResponse:
        async with ErrorsToStatus(context, _request_id()):
            pool = self._ready_pool()
            return pb.ListModelsResponse(
                models=[convert.model_status(s) for s in pool.statuses()],
                max_loaded_models=pool.limits.max_loaded_models,
                max_loaded_bytes=pool.limits.max_loaded_bytes,
            )

    async def LoadModel(
        self, request: pb.LoadModelRequest, context: Context
    ) -> pb.LoadModelResponse:
        async with ErrorsToStatus(context, _request_id()):
            status = await self._ready_pool().load(request.model, deadline_of(context))
            return pb.LoadModelResponse(model=convert.model_status(status))

    async def UnloadModel(
        self, request: pb.UnloadModelRequest, context: Context
    ) -> pb.UnloadModelResponse:
        async with ErrorsToStatus(context, _request_id()):
            pool = self._ready_pool()
            status, cancelled = await pool.unload(request.model, force=request.force)
            return pb.UnloadModelResponse(
                model=convert.model_status(status), cancelled_requests=cancelled
            )
