"""FakeEngine: an EngineApi without llama.cpp, for tests and embedders.

Vocabulary: 0 = <pad>, 1 = <s> (BOS), 2 = </s> (EOS), and byte b is token b + 3 (259 tokens), so
tokenize("hi") == [1, 107, 108]. A request "generates" its script one token per `token_delay_s`:
by default the prompt's byte tokens reversed. Pure Python and asyncio; no llama_cpp, no grpc.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from llama_grpc_server import errors
from llama_grpc_server.core.api import ModelInfo, StatsSnapshot
from llama_grpc_server.core.chat import ROLES, ChatMessage
from llama_grpc_server.core.request import (
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    Timings,
    TokenDelta,
    Usage,
)

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
N_VOCAB = 256 + BYTE_OFFSET
SPECIAL_PIECES = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}
FAKE_SEED = 42

Script = Callable[[GenerationRequest], Sequence[int]]


def encode(text: str) -> list[int]:
    """Text as byte tokens, without BOS."""
    return [b + BYTE_OFFSET for b in text.encode("utf-8")]


def reversed_prompt(request: GenerationRequest) -> Sequence[int]:
    """The default script: the prompt's byte tokens, reversed."""
    return [t for t in reversed(request.prompt_tokens) if t >= BYTE_OFFSET]


def fake_model_info(n_ctx: int = 512, n_parallel: int = 4) -> ModelInfo:
    return ModelInfo(
        model_name="fake",
        model_path="/models/fake.gguf",
        n_ctx_train=n_ctx,
        n_ctx=n_ctx,
        n_vocab=N_VOCAB,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        eog_token_ids=(EOS_ID,),
        has_chat_template=False,
        n_parallel=n_parallel,
        n_batch=512,
        description="fake byte-level model",
        size_bytes=0,
        n_params=0,
        add_bos=True,
    )


@dataclass(slots=True)
class _Counters:
    started: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class FakeStream:
    """The events of one fake request; cancel() stops it at its next token."""

    def __init__(self, engine: FakeEngine, request: GenerationRequest) -> None:
        self.request = request
        self.is_finished = False  # a Finished or Failed event was delivered
        self.is_cancelled = False
        self._engine = engine

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            async for event in self._engine._events(self):
                self.is_finished = isinstance(event, Finished | Failed)
                yield event
        finally:
            self._engine.active.discard(self.request.request_id)

    def cancel(self) -> None:
        """Idempotent; a no-op once the request has finished."""
        if not (self.is_finished or self.is_cancelled):
            self.is_cancelled = True
            self._engine._on_cancel(self.request.request_id)


@dataclass
class FakeEngine:
    """Scripted EngineApi. Every knob is a plain attribute tests may change between requests.

    script: the output tokens of a request (default: its prompt reversed), cut at max_tokens
        (MAX_TOKENS), at a stop token (STOP_TOKEN) or at EOS (EOS); else `finish_reason`.
    fail_with / fail_after: end with Failed(fail_with) after `fail_after` tokens.
    submit_error: raised by submit() itself (as PromptTooLong or ShuttingDown would be).
    max_queue: submit() raises Overloaded while this many requests are unfinished.
    """

    info: ModelInfo = field(default_factory=fake_model_info)
    script: Script = reversed_prompt
    token_delay_s: float = 0.0
    finish_reason: FinishReason = FinishReason.EOS
    fail_with: errors.ServiceError | None = None
    fail_after: int = 0
    submit_error: errors.ServiceError | None = None
    max_queue: int | None = None
    # What happened, for assertions:
    submitted: list[GenerationRequest] = field(default_factory=list, init=False)
    cancelled: list[str] = field(default_factory=list, init=False)
    active: set[str] = field(default_factory=set, init=False)
    is_closed: bool = field(default=False, init=False)
    counters: _Counters = field(default_factory=_Counters, init=False)
    started_at: float = field(default_factory=time.monotonic, init=False)
    _cancel_seen: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _failure_listeners: list[Callable[[str], None]] = field(
        default_factory=list, init=False, repr=False
    )

    # -- EngineApi --------------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self.info

    def submit(self, request: GenerationRequest) -> FakeStream:
        if self.is_closed:
            raise errors.ShuttingDown("server is shutting down")
        if self.submit_error is not None:
            self.counters.rejected += 1
            raise self.submit_error
        if self.max_queue is not None and len(self.active) >= self.max_queue:
            self.counters.rejected += 1
            raise errors.Overloaded(
                f"queue is full ({len(self.active)} waiting, max_queue={self.max_queue})",
                retry_after_s=1.0,
            )
        self.submitted.append(request)
        self.active.add(request.request_id)
        self.counters.started += 1
        self.counters.prompt_tokens += len(request.prompt_tokens)
        return FakeStream(self, request)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return ([BOS_ID] if add_special else []) + encode(text)

    def detokenize(self, token_ids: Sequence[int], *, render_special: bool) -> str:
        out = bytearray()
        for token_id in token_ids:
            if token_id >= BYTE_OFFSET:
                out.append(token_id - BYTE_OFFSET)
            elif render_special:
                out += SPECIAL_PIECES[token_id].encode()
        return out.decode("utf-8", errors="replace")

    def token_piece(self, token_id: int) -> str:
        if token_id < BYTE_OFFSET:
            return SPECIAL_PIECES[token_id]
        return bytes([token_id - BYTE_OFFSET]).decode("utf-8", errors="replace")

    def check_grammar(self, gbnf: str, root: str) -> None:
        """A stand-in parser: every line needs "::=" and the root rule must exist."""
        rules = [line.split("::=")[0].strip() for line in gbnf.splitlines() if line.strip()]
        if not rules or any("::=" not in line for line in gbnf.splitlines() if line.strip()):
            raise ValueError("invalid grammar: expecting ::=")
        if root not in rules:
            raise ValueError(f"invalid grammar: grammar does not contain a '{root}' symbol")

    def render_chat(self, messages: Sequence[ChatMessage], template: str) -> str:
        """A stand-in template: "<role>content" per message, then "<assistant>"."""
        if any(m.role not in ROLES for m in messages):
            raise ValueError("unknown role")
        return "".join(f"<{m.role}>{m.content}" for m in messages) + "<assistant>"

    def json_schema_to_grammar(self, schema: str) -> str:
        """Any JSON object schema becomes a grammar for "{}"; anything else is invalid."""
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"JSONDecodeError: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("the schema must be a JSON object")
        return 'root ::= "{}"'

    def stats(self) -> StatsSnapshot:
        c, n_parallel = self.counters, self.info.n_parallel
        active = min(len(self.active), n_parallel)
        return StatsSnapshot(
            n_parallel=n_parallel,
            active_slots=active,
            idle_slots=n_parallel - active,
            prefilling_slots=0,
            generating_slots=active,
            queue_depth=max(0, len(self.active) - n_parallel),
            kv_cells_used=0,
            kv_cells_total=self.info.n_ctx,
            requests_started=c.started,
            requests_finished=c.finished,
            requests_failed=c.failed,
            requests_cancelled=c.cancelled,
            requests_rejected=c.rejected,
            prompt_tokens=c.prompt_tokens,
            generated_tokens=c.generated_tokens,
            cached_prompt_tokens=0,
            ticks=c.generated_tokens,
            avg_batch_size=1.0,
            preemptions=0,
            uptime_s=time.monotonic() - self.started_at,
            slots=(),
            batch_strategy="fake",
            prefix_cache_hit_rate=0.0,
        )

    def on_failure(self, listener: Callable[[str], None]) -> None:
        self._failure_listeners.append(listener)

    def close(self) -> None:
        self.is_closed = True

    # -- helpers for tests ------------------------------------------------------------------------

    async def wait_for_cancel(self, timeout_s: float = 5.0) -> str:
        """The first cancelled request id, waiting for it up to `timeout_s`."""
        await asyncio.wait_for(self._cancel_seen.wait(), timeout_s)
        return self.cancelled[0]

    # -- internals --------------------------------------------------------------------------------

    def _on_cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self.counters.cancelled += 1
        self.active.discard(request_id)
        self._cancel_seen.set()

    async def _events(self, stream: FakeStream) -> AsyncIterator[Event]:
        request, start = stream.request, time.perf_counter()
        tokens = list(self.script(request))
        produced: list[int] = []
        for token_id in tokens:
            if len(produced) >= request.stopping.max_tokens:
                break
            if self.fail_with is not None and len(produced) >= self.fail_after:
                break
            stop_reason = _stop_reason(request, token_id)
            if stop_reason is not None:
                yield self._finished(request, produced, stop_reason, start, token_id)
                return
            await asyncio.sleep(self.token_delay_s)
            if stream.is_cancelled:  # cancelled while "decoding"
                return
            produced.append(token_id)
            self.counters.generated_tokens += 1
            yield TokenDelta((token_id,), self.token_piece(token_id))
        if self.fail_with is not None:
            self.counters.failed += 1
            yield Failed(self.fail_with)
            return
        is_cut = len(produced) >= request.stopping.max_tokens
        reason = FinishReason.MAX_TOKENS if is_cut else self.finish_reason
        yield self._finished(request, produced, reason, start, None)

    def _finished(
        self,
        request: GenerationRequest,
        produced: list[int],
        reason: FinishReason,
        start: float,
        matched_token_id: int | None,
    ) -> Finished:
        self.counters.finished += 1
        elapsed_ms = (time.perf_counter() - start) * 1000
        seed = request.sampling.seed
        return Finished(
            reason=reason,
            usage=Usage(len(request.prompt_tokens), len(produced), 0),
            timings=Timings(0.0, elapsed_ms, 0.0, elapsed_ms, elapsed_ms),
            seed=FAKE_SEED if seed is None else seed,
            matched_token_id=matched_token_id,
        )


def _stop_reason(request: GenerationRequest, token_id: int) -> FinishReason | None:
    if token_id in request.stopping.stop_token_ids:
        return FinishReason.STOP_TOKEN
    if token_id == EOS_ID and not request.stopping.ignore_eos:
        return FinishReason.EOS
    return None
