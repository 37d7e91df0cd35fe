"""Test doubles that run the real engine code without llama.cpp, for tests and embedders.

FakeRunner: a StepRunner keeping per-sequence token lists like a KV cache, enforcing
llama_decode's rules (contiguous positions, capacity, a sampler before sampling). It samples a
request's script when it has one, else a deterministic function of the sequence's whole context
(so a preempted-and-resumed request must produce the same tokens).

FakeEngine: the real EngineLoop and Scheduler over a FakeRunner and a byte-level vocabulary:
0 = <pad>, 1 = <s> (BOS), 2 = </s> (EOS), and byte b is token b + 3 (259 tokens), so
tokenize("hi") == [1, 107, 108]. A request generates its script (by default the prompt's byte
tokens reversed), then EOS; stop strings, max_tokens, deadlines, cancellation, queueing and
stats are the real scheduler's. No llama_cpp, no grpc.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from llama_grpc_server import errors
from llama_grpc_server.core.adapters import AdapterCatalog, AdapterEntry
from llama_grpc_server.core.api import CacheCleared, ModelInfo, StatsSnapshot
from llama_grpc_server.core.kv.events import KvEventLog
from llama_grpc_server.core.requests.chat import ROLES, ChatMessage
from llama_grpc_server.core.requests.embedding import Vectors
from llama_grpc_server.core.requests.request import Event, Failed, GenerationRequest, TokenDelta
from llama_grpc_server.core.scheduling.plan import (
    DECODE_KV_FULL,
    Chunk,
    Collect,
    SeqOpKind,
    StepPlan,
    StepResult,
)
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.core.speculation import acceptance
from llama_grpc_server.core.tools.types import ToolSpec
from llama_grpc_server.engine.embedding import Embedder
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.engine.streams import EngineStream

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
N_VOCAB = 256 + BYTE_OFFSET
SPECIAL_PIECES = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}
PIECES: tuple[bytes, ...] = (b"", b"", b"", *(bytes([b]) for b in range(256)))

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
        n_embd=4,  # FakeRunner.embedding_rows
    )


class FakeRunner:
    """A StepRunner without a model (see the module docstring)."""

    def __init__(
        self,
        n_vocab: int = 97,
        kv_cells: int = 1_000_000,
        *,
        refuse_partial_removal: bool = False,
        eos_id: int | None = None,
    ) -> None:
        self.n_vocab = n_vocab
        self.kv_cells = kv_cells
        # Like recurrent memory: seq_rm(seq, p0 > 0) fails; the runner empties the sequence.
        self.refuse_partial_removal = refuse_partial_removal
        self.eos_id = eos_id  # sampled once a script is exhausted
        self.delay_s = 0.0  # slept per forward pass, on the engine thread, like a decode
        self.scripts: dict[str, list[int]] = {}  # request key -> tokens to sample, in order
        # Scripts of submitted requests, taken up when their sampler opens: a request submitted
        # with the key of one that has just ended must not lose its script to the older one's
        # close_samplers, which the next plan carries (a reused request id, seen flaky).
        self.pending_scripts: dict[str, list[int]] = {}
        self.kv: dict[int, list[int]] = defaultdict(list)
        self.samplers: set[str] = set()
        self.plans: list[StepPlan] = []
        self.fed: dict[str, int] = defaultdict(int)  # request key -> tokens fed
        self.num_sampled: dict[str, int] = defaultdict(int)
        # eval_ms reported for a forward pass of this many tokens (None: 0, nothing measured),
        # e.g. to drive the speculation cost model.
        self.cost_ms: Callable[[int], float] | None = None
        self.embedder = Embedder()  # the real pooling (engine/embedding.py: numpy only)

    def next_token(self, context: list[int]) -> int:
        return (sum(context) * 31 + len(context) * 7) % self.n_vocab

    def _sample(self, request_id: str, context: list[int]) -> int:
        script = self.scripts.get(request_id)
        if script is None:
            return self.next_token(context)
        n = self.num_sampled[request_id]
        self.num_sampled[request_id] = n + 1
        if n < len(script):
            return script[n]
        return self.eos_id if self.eos_id is not None else self.next_token(context)

    def launch(self, plan: StepPlan) -> Collect:
        """The whole pass at once (its result is ready before the engine asks for it)."""
        result = self.execute(plan)
        return lambda: result

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for request_id in plan.close_samplers:
            self.samplers.discard(request_id)
            self.embedder.forget(request_id)
            self.scripts.pop(request_id, None)
            self.num_sampled.pop(request_id, None)
        for spec in plan.open_samplers:
            assert spec.request_id not in self.samplers
            self.samplers.add(spec.request_id)
            if spec.request_id in self.pending_scripts:
                self.scripts[spec.request_id] = self.pending_scripts.pop(spec.request_id)
            if spec.resumed:  # a resumed answer's script goes on after its resumed tokens
                self.num_sampled[spec.request_id] = len(spec.resumed)
        saved: dict[int, bytes] = {}
        restored: dict[int, bool] = {}
        reset = self._edit_kv(plan, saved, restored)
        used = sum(len(v) for v in self.kv.values())
        if used + plan.num_tokens > self.kv_cells:
            return StepResult(
                status=DECODE_KV_FULL, saved=saved, restored=restored, reset=frozenset(reset)
            )
        if plan.chunks and self.delay_s > 0:
            time.sleep(self.delay_s)
        sampled: dict[int, int] = {}
        more: dict[int, tuple[int, ...]] = {}
        embeddings: dict[int, Vectors] = {}
        for chunk in plan.chunks:
            if chunk.slot_id in reset:
                continue
            seq = self.kv[chunk.slot_id]
            assert chunk.start_pos == len(seq), "positions must continue the sequence"
            if chunk.embedding is not None:
                assert plan.is_embedding, "an embedding chunk outside an embedding pass"
                assert not chunk.wants_logits, "an embedding chunk samples nothing"
                rows = self.embedding_rows(seq, chunk.tokens)
                vectors = self.embedder.add(chunk, rows)
                if vectors is not None:
                    embeddings[chunk.slot_id] = vectors
            seq.extend(chunk.tokens)
            self.fed[chunk.request_id] += len(chunk.tokens)
            if chunk.wants_logits:
                assert chunk.request_id in self.samplers, "sampling without a sampler"
                tokens = self._verify(chunk, seq)
                sampled[chunk.slot_id] = tokens[0]
                if len(tokens) > 1:
                    more[chunk.slot_id] = tokens[1:]
        eval_ms = self.cost_ms(plan.num_tokens) if self.cost_ms and plan.chunks else 0.0
        return StepResult(
            sampled=sampled,
            saved=saved,
            restored=restored,
            reset=frozenset(reset),
            draft_sampled=more,
            eval_ms=eval_ms,
            embeddings=embeddings,
        )

    @staticmethod
    def embedding_rows(context: Sequence[int], tokens: Sequence[int]) -> np.ndarray[Any, Any]:
        """A token's output is a function of it, its position and everything before it (a
        causal model's): [token, position, sum of the tokens up to it, 1]."""
        rows = np.empty((len(tokens), 4), dtype=np.float32)
        total = sum(context)
        for i, token in enumerate(tokens):
            total += token
            rows[i] = (token, len(context) + i, total, 1.0)
        return rows

    def _verify(self, chunk: Chunk, seq: list[int]) -> tuple[int, ...]:
        """Sample each output position in order (for a speculative decode: while the draft
        agrees), each from the context up to its position, like the real runner."""
        first = len(seq) - chunk.num_outputs  # the context of output i ends at first + i + 1
        tokens: list[int] = []
        for i in range(chunk.num_outputs):
            token = self._sample(chunk.request_id, seq[: first + i + 1])
            tokens.append(token)
            if not acceptance.accepts(chunk, i, token):
                break
        return tuple(tokens)

    def _edit_kv(
        self, plan: StepPlan, saved: dict[int, bytes], restored: dict[int, bool]
    ) -> set[int]:
        reset: set[int] = set()
        for op in plan.seq_ops:
            if op.seq_id in reset:
                continue
            if op.kind is SeqOpKind.REMOVE:
                is_partial = 0 < op.p0 < len(self.kv[op.seq_id])
                if is_partial and self.refuse_partial_removal:
                    self.kv[op.seq_id].clear()
                    reset.add(op.seq_id)
                del self.kv[op.seq_id][op.p0 :]
            elif op.kind is SeqOpKind.COPY and op.src_seq_id in reset:
                self.kv[op.seq_id].clear()
                reset.add(op.seq_id)
            elif op.kind is SeqOpKind.COPY:
                assert not self.kv[op.seq_id], "copy into a non-empty sequence"
                self.kv[op.seq_id] = list(self.kv[op.src_seq_id][: op.p1])
            elif op.kind is SeqOpKind.SAVE:
                saved[op.seq_id] = ",".join(map(str, self.kv[op.seq_id])).encode()
            else:
                assert not self.kv[op.seq_id], "restore into a non-empty sequence"
                self.kv[op.seq_id] = [int(t) for t in op.data.decode().split(",")]
                restored[op.seq_id] = True
        return reset


class HangingRunner(FakeRunner):
    """A FakeRunner whose forward pass number `hang_at` (1-based) blocks until `release` is set:
    a llama_decode that never returns, for the watchdog. `hanging` is set once it blocks."""

    def __init__(self, hang_at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hang_at = hang_at
        self.num_passes = 0
        self.hanging = threading.Event()
        self.release = threading.Event()

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_passes += 1
        if self.num_passes == self.hang_at:
            self.hanging.set()
            self.release.wait()
        return super().execute(plan)


class FakeVocabulary:
    """The byte-level vocabulary with stand-in grammar and chat-template checks."""

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

    def special_piece(self, token_id: int) -> bytes:
        if token_id < BYTE_OFFSET:
            return SPECIAL_PIECES[token_id].encode()
        return PIECES[token_id]

    def check_grammar(self, gbnf: str, root: str) -> None:
        """A stand-in parser: every line needs "::=" and the root rule must exist."""
        rules = [line.split("::=")[0].strip() for line in gbnf.splitlines() if line.strip()]
        if not rules or any("::=" not in line for line in gbnf.splitlines() if line.strip()):
            raise ValueError("invalid grammar: expecting ::=")
        if root not in rules:
            raise ValueError(f"invalid grammar: grammar does not contain a '{root}' symbol")

    def json_schema_to_grammar(self, schema: str) -> str:
        """Any JSON object schema becomes a grammar for "{}"; anything else is invalid."""
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"JSONDecodeError: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("the schema must be a JSON object")
        return 'root ::= "{}"'

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        template: str,
        tools: Sequence[ToolSpec] = (),
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """A stand-in template: "<tools>names" when tools are offered, "<role>content" per
        message, then "<assistant>"."""
        if any(m.role not in ROLES for m in messages):
            raise ValueError("unknown role")
        offered = f"<tools>{','.join(t.name for t in tools)}" if tools else ""
        return offered + "".join(f"<{m.role}>{m.content}" for m in messages) + "<assistant>"

    def tool_format(self, template: str) -> str:
        return "generic"

    def reasoning_format(self, template: str) -> str:
        return ""


class FakeStream:
    """The engine's stream of one request, with the failure a test injected (fail_with after
    fail_after deltas: the engine request is cancelled and the caller gets Failed)."""

    def __init__(self, engine: FakeEngine, inner: EngineStream) -> None:
        self._engine = engine
        self._inner = inner
        self._fail_with = engine.fail_with
        self._fail_after = engine.fail_after

    async def __aiter__(self) -> AsyncIterator[Event]:
        deltas = 0
        async for event in self._inner:
            if self._fail_with is not None and deltas >= self._fail_after:
                self._inner.cancel()
                yield Failed(self._fail_with)
                return
            deltas += isinstance(event, TokenDelta)
            yield event

    def cancel(self, *, deadline_exceeded: bool = False) -> None:
        self._engine._on_cancel(self._inner.request_id)
        self._inner.cancel(deadline_exceeded=deadline_exceeded)


class FakeEngine:
    """An EngineApi: EngineLoop + Scheduler + FakeRunner. Knobs are plain attributes tests may
    change between requests:

    script: the output tokens of a request (then EOS), computed at submit.
    token_delay_s: sleep per forward pass (a "decode" time).
    stream_buffer_tokens / stalled_reader_s: the scheduler's back-pressure (0: off).
    fail_with / fail_after: end a stream with Failed(fail_with) after `fail_after` deltas.
    submit_error: raised by submit() itself (as PromptTooLong or ShuttingDown would be).
    max_queue: submit() raises Overloaded while this many requests are unfinished.
    runner, watchdog_s: the runner (e.g. a HangingRunner) and the watchdog's bound (0 = none),
    read when the engine loop starts (the first use).
    """

    def __init__(
        self,
        info: ModelInfo | None = None,
        script: Script = reversed_prompt,
        *,
        token_delay_s: float = 0.0,
        stream_buffer_tokens: int = 0,
        stalled_reader_s: float = 0.0,
    ) -> None:
        self.info = info if info is not None else fake_model_info()
        self.stream_buffer_tokens = stream_buffer_tokens
        self.stalled_reader_s = stalled_reader_s
        self.script = script
        self.fail_with: errors.ServiceError | None = None
        self.fail_after = 0
        self.submit_error: errors.ServiceError | None = None
        self.max_queue: int | None = None
        # What happened, for assertions:
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.is_closed = False
        self.runner = FakeRunner(N_VOCAB, eos_id=EOS_ID)
        self.runner.delay_s = token_delay_s
        self.watchdog_s = 0.0
        self._cancel_seen: asyncio.Event | None = None
        self._loop: EngineLoop | None = None  # started on first use

    @property
    def token_delay_s(self) -> float:
        return self.runner.delay_s

    @token_delay_s.setter
    def token_delay_s(self, value: float) -> None:
        self.runner.delay_s = value

    @property
    def loop(self) -> EngineLoop:
        if self._loop is None:
            limits = SchedulerLimits(
                self.info.n_parallel,
                self.info.n_ctx,
                self.info.n_batch,
                stream_buffer_tokens=self.stream_buffer_tokens,
                stalled_reader_s=self.stalled_reader_s,
            )
            scheduler = Scheduler(limits, pieces=PIECES, eog_ids=frozenset(self.info.eog_token_ids))
            self._loop = EngineLoop(
                scheduler,
                self.runner,
                self.info,
                tokenizer=FakeVocabulary(),
                kv_cells_total=self.info.n_ctx,
                watchdog_s=lambda: self.watchdog_s,
            )
        return self._loop

    # -- EngineApi --------------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self.info

    def submit(self, request: GenerationRequest) -> FakeStream:
        if self.is_closed:
            raise errors.ShuttingDown("server is shutting down")
        if self.submit_error is not None:
            raise self.submit_error
        done = self.stats()
        ended = (
            done.requests_finished
            + done.requests_failed
            + done.requests_cancelled
            + done.requests_deadline_exceeded
        )
        unfinished = len(self.submitted) - ended
        if self.max_queue is not None and unfinished >= self.max_queue:
            raise errors.Overloaded(
                f"queue is full ({unfinished} waiting, max_queue={self.max_queue})",
                retry_after_s=1.0,
            )
        script = list(self.script(request))
        self.runner.pending_scripts[request.key] = script
        inner = self.loop.submit(request)
        self.submitted.append(request)
        return FakeStream(self, inner)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return FakeVocabulary().tokenize(text, add_special=add_special, parse_special=False)

    def detokenize(self, token_ids: Sequence[int], *, render_special: bool) -> str:
        return FakeVocabulary().detokenize(token_ids, render_special=render_special)

    def token_piece(self, token_id: int) -> str:
        return FakeVocabulary().special_piece(token_id).decode("utf-8", errors="replace")

    def check_grammar(self, gbnf: str, root: str) -> None:
        FakeVocabulary().check_grammar(gbnf, root)

    def json_schema_to_grammar(self, schema: str) -> str:
        return FakeVocabulary().json_schema_to_grammar(schema)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        template: str,
        tools: Sequence[ToolSpec] = (),
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        return FakeVocabulary().render_chat(messages, template, tools, variables)

    def tool_format(self, template: str) -> str:
        return FakeVocabulary().tool_format(template)

    def reasoning_format(self, template: str) -> str:
        return ""

    def stats(self) -> StatsSnapshot:
        return self.loop.stats()

    @property
    def kv_events(self) -> KvEventLog:
        return self.loop.kv_events

    def on_failure(self, listener: Callable[[str], None]) -> None:
        self.loop.on_failure(listener)

    def end_all(self, error: errors.ServiceError) -> None:
        self.loop.end_all(error)

    def set_tenant_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        self.loop.set_tenant_limits(limits)

    @property
    def adapters(self) -> AdapterCatalog:
        """The fake runner applies no adapters: the catalog stays empty unless a test fills it."""
        return self.loop.adapters

    async def load_adapter(self, name: str, path: str, default_scale: float) -> AdapterEntry:
        return await self.loop.load_adapter(name, path, default_scale)

    async def unload_adapter(self, name: str) -> int:
        return await self.loop.unload_adapter(name)

    async def clear_cache(self) -> CacheCleared:
        return await self.loop.clear_cache()

    def close(self) -> None:
        self.is_closed = True
        if self._loop is not None:
            self._loop.close()

    # -- helpers for tests ------------------------------------------------------------------------

    async def wait_for_cancel(self, timeout_s: float = 5.0) -> str:
        """The first cancelled request id, waiting for it up to `timeout_s`."""
        if self._cancel_seen is None:
            self._cancel_seen = asyncio.Event()
        if not self.cancelled:
            await asyncio.wait_for(self._cancel_seen.wait(), timeout_s)
        return self.cancelled[0]

    def _on_cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        if self._cancel_seen is not None:
            self._cancel_seen.set()


__all__ = [
    "BOS_ID",
    "EOS_ID",
    "N_VOCAB",
    "FakeEngine",
    "FakeRunner",
    "FakeVocabulary",
    "encode",
    "fake_model_info",
    "reversed_prompt",
]
