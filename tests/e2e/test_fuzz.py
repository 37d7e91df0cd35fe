"""Protocol fuzzing through a real server with the tiny synthetic model (statuses, not words; its
forward passes cost microseconds, so long fuzzed prompts cost nothing): generated requests for every
RPC of LlmService and of the vLLM engine protocol's VllmEngine, served on the same port (random
field values, extreme numbers, NaN/inf, huge repeated fields, unknown enum values, invalid UTF-8
and corrupt wire bytes, oversize messages).

Invariant: every answer is OK or a deliberate status (never UNKNOWN or INTERNAL); a status about
the request names the field at fault in a google.rpc BadRequest, and that field exists (VllmEngine:
INVALID_ARGUMENT names one; its FAILED_PRECONDITION may be about the server, such as a tokenizer
it cannot export); after the run the server answers a known greedy request identically, and
GetStats shows no busy slot, no queued request and the same KV cells as before.

KV cells: every fuzzed generation request is sent with cache_prompt=false, and the server's
default is off too for the vLLM protocol, which has no such field (a request's KV must then be
freed however it ends: finished, rejected, cancelled, past its deadline), so the cells in
use after the run must equal those before it, slot by slot. Prefix caching keeps idle slots' KV
on purpose and is tested elsewhere; here it would make "the same cells" depend on which slot the
last requests happened to take.

`FUZZ_EXAMPLES=N` runs N examples per RPC (default sized for `make test`); `FUZZ_REPORT=path`
writes the statuses seen as JSON. Most requests are "tamed" field by field so that they get past
the first check and reach the engine (max_tokens clamped to MAX_TOKENS, token ids inside the
vocabulary, valid sampling); each field is left wild in some examples.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llama_grpc.errors import from_rpc_error
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server.config import ModelSettings, SchedulerSettings, ServerSettings, Settings
from llama_grpc_server.core.requests.request import SamplingParams
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_server.rpc.vllm.engine import VLLM_SERVICE_NAME  # the vLLM servicer: only here
from llama_grpc_testkit.models import TINY_N_VOCAB, tiny_model_file
from llama_grpc_testkit.threads import TEST_THREADS
from tests.support.pb_strategies import messages, wire_string
from tests.support.regex_grammar import REGEX_CASES

SERVICE = pb.DESCRIPTOR.services_by_name["LlmService"]
VLLM = descriptor_pool.Default().FindServiceByName(VLLM_SERVICE_NAME)  # what the servicer serves
METHODS = list(SERVICE.methods) + list(VLLM.methods)


def label(method: MethodDescriptor) -> str:
    """LlmService's methods by name, VllmEngine's as VllmEngine.NAME (both have a Generate)."""
    service = method.containing_service
    return (
        method.name if service.full_name == SERVICE.full_name else f"{service.name}.{method.name}"
    )


# Streams with no end of their own (one report per interval, or a KV event batch or heartbeat,
# until the client leaves): read the first message, then cancel, whatever the example asked for.
ENDLESS = frozenset({"WatchLoad", "VllmEngine.SubscribeKvEvents"})
N_CTX = 2048
N_PARALLEL = 4
N_VOCAB = TINY_N_VOCAB  # checked against GetModelInfo when the server starts
MAX_TOKENS = 4  # what a tamed max_tokens is clamped to
DEFAULT_MAX_TOKENS = 4  # the fuzz server's default, for requests that set none
MAX_MESSAGE_BYTES = 1 << 20
CALL_TIMEOUT_S = 60.0  # a hang shows up as DEADLINE_EXCEEDED from this, and fails
SHORT_TIMEOUTS_S = (0.001, 0.02, 0.2)  # deliberately short deadlines: DEADLINE_EXCEEDED is fine
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0")) or 25  # per RPC, in each fuzz test

# pytest-timeout limits a whole test, every example of it: scale it (a hang in one call is caught
# by CALL_TIMEOUT_S anyway).
WHOLE_RUN = pytest.mark.timeout(max(300, 3 * EXAMPLES * len(METHODS)))
FUZZ = settings(
    max_examples=EXAMPLES * len(METHODS),
    deadline=None,
    database=None,
    derandomize="FUZZ_EXAMPLES" not in os.environ,  # make test: the same examples every run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

DELIBERATE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # queue/KV full, or grpc's own message size limit
    grpc.StatusCode.ALREADY_EXISTS,  # VllmEngine: a request_id still in flight
}
ABOUT_A_FIELD = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
}
VLLM_ABOUT_A_FIELD = {grpc.StatusCode.INVALID_ARGUMENT}
# methods refused whatever the request: profiling (the vLLM protocol's) is not supported
UNSUPPORTED = frozenset({"VllmEngine.StartProfile", "VllmEngine.StopProfile"})
SEEN: Counter[tuple[str, str]] = Counter()  # (method, status) over the whole module
FIELDS: Counter[str] = Counter()  # the fields named by errors (indexes left out)
SLOWEST: list[tuple[float, str, str, bytes]] = []  # the 5 slowest calls, for the report

REFERENCE = pb.GenerateRequest(
    prompt="The three primary colors are",
    params=pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=16, ignore_eos=True),
        cache_prompt=False,
    ),
)


# -- the server and raw calls ----------------------------------------------------------------------


@dataclass(repr=False)
class Fuzzed:
    """The fuzz server, a raw channel to it, and what it answered before any fuzzing."""

    channel: grpc.aio.Channel
    reference: pb.GenerateResponse
    stats_before: pb.GetStatsResponse


def _identity(data: bytes) -> bytes:
    return data


async def call(
    channel: grpc.aio.Channel,
    method: MethodDescriptor,
    request: bytes,
    *,
    timeout: float = CALL_TIMEOUT_S,
    cancel_after: int | None = None,
) -> list[Message]:
    """The responses of one call with the request's wire bytes as they are (a stream is read to
    its end, or cancelled after `cancel_after` messages: after the first for an ENDLESS one).
    Raises grpc.aio.AioRpcError."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    if label(method) in ENDLESS:
        cancel_after = 1
    decode = GetMessageClass(method.output_type).FromString
    if not method.server_streaming:
        unary = channel.unary_unary(
            path, request_serializer=_identity, response_deserializer=decode
        )
        return [await unary(request, timeout=timeout)]
    stream = channel.unary_stream(path, request_serializer=_identity, response_deserializer=decode)
    responses: list[Message] = []
    streaming = stream(request, timeout=timeout)
    async for response in streaming:
        responses.append(response)
        if cancel_after is not None and len(responses) >= cancel_after:
            streaming.cancel()
            break
    return responses


def _method(name: str) -> MethodDescriptor:
    return SERVICE.methods_by_name[name]


def _vllm_method(name: str) -> MethodDescriptor:
    return VLLM.methods_by_name[name]


async def _stats(channel: grpc.aio.Channel) -> pb.GetStatsResponse:
    (stats,) = await call(channel, _method("GetStats"), b"")
    assert isinstance(stats, pb.GetStatsResponse)
    return stats


async def _settled_stats(channel: grpc.aio.Channel) -> pb.GetStatsResponse:
    """GetStats once no slot is busy and nothing is queued (a cancelled or timed-out request is
    dropped at the engine's next tick), or the last snapshot after 30 s."""
    stats = await _stats(channel)
    for _ in range(300):
        if stats.active_slots == 0 and stats.queue_depth == 0:
            break
        await asyncio.sleep(0.1)
        stats = await _stats(channel)
    return stats


async def _generate(channel: grpc.aio.Channel, request: pb.GenerateRequest) -> pb.GenerateResponse:
    (response,) = await call(channel, _method("Generate"), request.SerializeToString())
    assert isinstance(response, pb.GenerateResponse)
    return response


def _fuzz_settings() -> Settings:
    return Settings(
        model=ModelSettings(
            model_path=str(tiny_model_file()), n_ctx=N_CTX, n_batch=512, n_threads=TEST_THREADS
        ),
        scheduler=SchedulerSettings(
            n_parallel=N_PARALLEL,
            max_queue=64,
            cache_prompt=False,  # the vLLM protocol's requests: see the module docstring
            default_max_tokens=DEFAULT_MAX_TOKENS,
            default_sampling=SamplingParams(temperature=0.0),
        ),
        server=ServerSettings(port=0, grace_s=1.0, max_message_bytes=MAX_MESSAGE_BYTES),
    )


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def fuzzed() -> AsyncIterator[Fuzzed]:
    """A server of its own, so that whatever the fuzzer does cannot poison other tests."""
    conf = _fuzz_settings()
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        options = [("grpc.max_receive_message_length", -1)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}", options=options) as ch:
            (info,) = await call(ch, _method("GetModelInfo"), b"")
            assert isinstance(info, pb.GetModelInfoResponse)
            assert (info.n_vocab, info.n_ctx) == (N_VOCAB, N_CTX)
            reference = await _generate(ch, REFERENCE)
            assert len(reference.token_ids) == 16
            yield Fuzzed(ch, reference, await _settled_stats(ch))
            _report(await _stats(ch))


ENGINE_FIGURES = ("requests_started", "requests_finished", "requests_failed",
                  "requests_cancelled", "requests_deadline_exceeded", "requests_rejected",
                  "prompt_tokens", "generated_tokens", "ticks")  # fmt: skip


def _report(stats: pb.GetStatsResponse) -> None:
    """What the run did: printed (pytest -s), and written to FUZZ_REPORT when set."""
    by_status = Counter[str]()
    for (_, status), n in SEEN.items():
        by_status[status] += n
    engine = {name: getattr(stats, name) for name in ENGINE_FIGURES}
    print(f"\nfuzz: {sum(SEEN.values())} calls; statuses: {dict(by_status.most_common())}")
    print(f"fuzz: engine {engine}")
    path = os.environ.get("FUZZ_REPORT")
    if path:
        report = {
            "calls": sum(SEEN.values()),
            "statuses": dict(by_status.most_common()),
            "per_method": {f"{m} {s}": n for (m, s), n in sorted(SEEN.items())},
            "fields_named": dict(FIELDS.most_common()),
            "engine": engine,
            "slowest": [f"{t:.2f} s {m} {s} {r!r}" for t, m, s, r in SLOWEST],
        }
        with open(path, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)


# -- the invariant ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    method: MethodDescriptor
    responses: list[Message] = field(default_factory=list)
    error: grpc.aio.AioRpcError | None = None

    @property
    def status(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK if self.error is None else self.error.code()


def resolves(descriptor: Descriptor, path: str) -> bool:
    """Whether a BadRequest field path such as "params.stopping.stop[3]" names a field of
    `descriptor` (map keys and list indexes in brackets), or ends in a oneof ("input": a
    VllmEngine request with neither of its prompt fields)."""
    current: Descriptor | None = descriptor
    parts = path.split(".")
    for i, part in enumerate(parts):
        name = part.split("[", 1)[0]
        if current is not None and i == len(parts) - 1 and name in current.oneofs_by_name:
            return True
        if current is None or name not in current.fields_by_name:
            return False
        current = current.fields_by_name[name].message_type
    return True


def check(
    outcome: Outcome,
    *,
    may_time_out: bool = False,
    cancelled: bool = False,
    is_unparsable: bool = False,
) -> None:
    """OK, or a deliberate status; a status about the request names one of its fields (bytes
    that do not parse at all may have no field to blame)."""
    status, error = outcome.status, outcome.error
    name = label(outcome.method)
    SEEN[(name, status.name)] += 1
    if error is None:
        if not cancelled:
            _check_responses(outcome)
        return
    allowed = set(DELIBERATE)
    if may_time_out:
        allowed.add(grpc.StatusCode.DEADLINE_EXCEEDED)
    if cancelled:
        allowed.add(grpc.StatusCode.CANCELLED)
    if name in UNSUPPORTED:
        allowed.add(grpc.StatusCode.UNIMPLEMENTED)
    assert status in allowed, f"{status.name}: {error.details()}"
    typed = from_rpc_error(error)
    vllm = name.startswith("VllmEngine.")
    if status in (VLLM_ABOUT_A_FIELD if vllm else ABOUT_A_FIELD) and not (
        is_unparsable and not typed.field
    ):
        assert typed.field, f"{status.name} names no field: {error.details()}"
    if typed.field:
        assert resolves(outcome.method.input_type, typed.field), typed.field
        FIELDS[name + " " + re.sub(r"\[[^\]]*\]", "[]", typed.field)] += 1


def _check_responses(outcome: Outcome) -> None:
    """A stream ends with exactly one `done`; a generation reports a finish reason (VllmEngine:
    its Generate ends with a `complete`, one per sample at most, each with a finish reason)."""
    responses = outcome.responses
    if outcome.method.full_name == _vllm_method("Generate").full_name:
        kinds = [r.WhichOneof("response") for r in responses]
        assert kinds and kinds[-1] == "complete" and None not in kinds, kinds
        completes = [r.complete for r in responses if r.WhichOneof("response") == "complete"]  # type: ignore[attr-defined]
        assert len({c.index for c in completes}) == len(completes), completes
        assert all(c.finish_reason for c in completes), completes
        return
    if outcome.method.server_streaming and "event" in outcome.method.output_type.oneofs_by_name:
        events = [r.WhichOneof("event") for r in responses]
        assert events and events[-1] == "done" and events.count("done") == 1, events
        responses = [responses[-1].done]  # type: ignore[attr-defined]
    for response in responses:
        if "finish_reason" in response.DESCRIPTOR.fields_by_name:
            assert response.finish_reason != pb.FINISH_REASON_UNSPECIFIED  # type: ignore[attr-defined]


async def outcome_of(
    channel: grpc.aio.Channel, method: MethodDescriptor, request: bytes, **kwargs: Any
) -> Outcome:
    start = time.perf_counter()
    try:
        outcome = Outcome(method, await call(channel, method, request, **kwargs))
    except grpc.aio.AioRpcError as error:
        outcome = Outcome(method, error=error)
    SLOWEST.append((time.perf_counter() - start, method.name, outcome.status.name, request[:300]))
    SLOWEST.sort(key=lambda item: -item[0])
    del SLOWEST[5:]
    return outcome


# -- requests --------------------------------------------------------------------------------------


@dataclass
class Call:
    """One fuzzed call: the RPC, its request and how the client behaves."""

    method: MethodDescriptor
    request: Message
    timeout: float = CALL_TIMEOUT_S
    cancel_after: int | None = None

    def __repr__(self) -> str:  # short enough to read in a failure report
        text = str(self.request)
        text = text if len(text) < 2000 else f"{text[:2000]}... ({len(text)} chars)"
        head = f"{self.method.name}, timeout={self.timeout}, cancel_after={self.cancel_after}"
        return f"Call({head}):\n{text}"


WILD = st.sampled_from([False] * 7 + [True])  # 1 in 8: leave this part as generated

GRAMMARS = [
    pb.Grammar(gbnf='root ::= "yes" | "no"'),
    pb.Grammar(gbnf='root ::= [0-9]+ "."', root=""),
    pb.Grammar(gbnf='answer ::= "a" | "b"', root="answer"),
    pb.Grammar(gbnf="root ::= undefined_rule"),
]
SCHEMAS = ['{"type": "integer"}', '{"type": "object", "properties": {"a": {"type": "string"}}}']


def _valid_floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, width=32)


# What the README calls valid sampling; validation must accept it and the engine must run it.
VALID_SAMPLING = st.builds(
    pb.SamplingParams,
    temperature=_valid_floats(0.0, 100.0),
    top_k=st.sampled_from([0, 1, 40, 2**31 - 1]) | st.integers(0, 2**31 - 1),
    top_p=_valid_floats(0.0, 1.0).filter(lambda p: p > 0),
    min_p=_valid_floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
    repeat_penalty=_valid_floats(0.0, 10.0).filter(lambda p: p > 0),
    frequency_penalty=_valid_floats(-2.0, 2.0),
    presence_penalty=_valid_floats(-2.0, 2.0),
    penalty_last_n=st.sampled_from([-1, 0, 64, N_CTX]) | st.integers(-1, N_CTX),
    logit_bias=st.dictionaries(
        st.integers(0, N_VOCAB - 1),
        _valid_floats(-100.0, 100.0) | st.just(-math.inf),
        max_size=8,
    ),
)


def _tame_params(draw: Callable[..., Any], params: pb.GenerationParams) -> None:
    params.cache_prompt = False  # see the module docstring: the KV check depends on it
    stopping = params.stopping
    if 1 <= stopping.max_tokens <= N_CTX:  # always: a valid max_tokens only costs time
        stopping.max_tokens = min(stopping.max_tokens, MAX_TOKENS)
    elif stopping.HasField("max_tokens") and not draw(WILD):  # 0 or > n_ctx: refused if wild
        stopping.max_tokens = draw(st.integers(1, MAX_TOKENS))
    if not draw(WILD):
        stopping.stop_token_ids[:] = [t % N_VOCAB for t in stopping.stop_token_ids]
        stopping.stop[:] = [s for s in stopping.stop if 0 < len(s) <= 64][:4]
    if not draw(WILD):
        params.sampling.CopyFrom(draw(st.sampled_from([pb.SamplingParams()]) | VALID_SAMPLING))
    if not draw(WILD):
        constraint = draw(st.sampled_from(["none", "grammar", "json_schema"]))
        if constraint == "grammar":
            params.grammar.CopyFrom(draw(st.sampled_from(GRAMMARS)))
        elif constraint == "json_schema":
            params.json_schema = draw(st.sampled_from(SCHEMAS))
        else:
            params.ClearField(params.WhichOneof("constraint") or "grammar")
    if not draw(WILD):
        params.output.top_logprobs %= 21
    if not draw(WILD):
        overflow = params.context_overflow
        overflow.policy = draw(st.sampled_from(sorted(pb.OverflowPolicy.values())))
        overflow.n_keep = overflow.n_keep % 32 if overflow.policy == 2 else 0


VLLM_REFUSED = ("kv_transfer_params", "mm_inputs", "extra_mm_inputs", "kv_transfer_params_json",
                "data_parallel_rank", "media_refs")  # fmt: skip
VLLM_CONSTRAINTS: list[tuple[str, Any]] = [
    *(("regex", pattern) for pattern, _ in REGEX_CASES),
    ("choice", ["yes", "no", "é"]),
    ("json_object", True),
    *(("json_schema", schema) for schema in SCHEMAS),
    *(("grammar", grammar.gbnf) for grammar in GRAMMARS if grammar.root in ("", "root")),
]


def _tame_vllm_sampling(draw: Callable[..., Any], params: Any) -> None:
    """VllmEngine's SamplingParams, as _tame_params does LlmService's."""
    if 1 <= params.max_tokens <= N_CTX:
        params.max_tokens = min(params.max_tokens, MAX_TOKENS)
    elif params.HasField("max_tokens") and not draw(WILD):
        params.max_tokens = draw(st.integers(1, MAX_TOKENS))
    if not draw(WILD):
        params.n = draw(st.integers(0, 2))
        params.min_tokens %= MAX_TOKENS + 1
    if not draw(WILD):
        params.stop_token_ids[:] = [t % N_VOCAB for t in params.stop_token_ids]
        params.stop[:] = [s for s in params.stop if 0 < len(s) <= 64][:4]
    if not draw(WILD):
        params.temperature = draw(_valid_floats(0.0, 2.0))
        params.top_p = draw(_valid_floats(0.0, 1.0))
        params.top_k = draw(st.integers(0, 100))
        params.min_p = draw(_valid_floats(0.0, 1.0))
        params.frequency_penalty = draw(_valid_floats(-2.0, 2.0))
        params.presence_penalty = draw(_valid_floats(-2.0, 2.0))
        params.repetition_penalty = draw(_valid_floats(0.0, 2.0))
        params.ClearField("logit_bias")
    if not draw(WILD):
        for name in ("prompt_logprobs", "truncate_prompt_tokens"):
            params.ClearField(name)
        if params.HasField("logprobs"):
            params.logprobs %= 6
    if not draw(WILD):
        constraint = draw(st.sampled_from([("", None), *VLLM_CONSTRAINTS]))
        params.ClearField(params.WhichOneof("constraint") or "regex")
        if constraint[0] == "choice":
            params.choice.choices[:] = constraint[1]
        elif constraint[0]:
            setattr(params, *constraint)


def _tame_vllm(draw: Callable[..., Any], request: Message) -> None:
    """VllmEngine's requests: a fresh request_id, a prompt inside the vocabulary, the fields this
    engine refuses cleared, sampling tamed; each part stays as generated in 1 of 8 examples."""
    fields = request.DESCRIPTOR.fields_by_name
    if "request_id" in fields and not draw(WILD):
        request.request_id = draw(st.uuids()).hex  # type: ignore[attr-defined]
    if "tokenized" in fields and not draw(WILD):
        if "text" in fields and draw(st.booleans()):
            request.text = draw(st.text(min_size=1, max_size=64))  # type: ignore[attr-defined]
        else:
            ids = request.tokenized.input_ids  # type: ignore[attr-defined]
            ids[:] = [t % N_VOCAB for t in ids][:256] or draw(
                st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=64)
            )
    if "sampling_params" in fields:
        if not draw(WILD):
            for name in VLLM_REFUSED:
                request.ClearField(name)
        _tame_vllm_sampling(draw, request.sampling_params)  # type: ignore[attr-defined]


def _tame(draw: Callable[..., Any], request: Message) -> None:
    """Make most parts of the request pass validation so that later checks and the engine are
    reached; each part stays as generated in 1 of 8 examples."""
    if request.DESCRIPTOR.file.package != pb.DESCRIPTOR.package:
        _tame_vllm(draw, request)
        return
    fields = request.DESCRIPTOR.fields_by_name
    if "model" in fields and not draw(WILD):
        request.model = ""  # type: ignore[attr-defined]
    if "token_ids" in fields and not draw(WILD):
        ids = request.token_ids  # type: ignore[attr-defined]
        in_vocabulary = st.lists(st.integers(0, N_VOCAB - 1), min_size=1)
        ids[:] = [t % N_VOCAB for t in ids] or draw(in_vocabulary)
    if "params" in fields:
        _tame_params(draw, request.params)  # type: ignore[attr-defined]
    if "messages" in fields:
        mode = draw(st.sampled_from(["prompt", "prompt", "chat", "wild"]))
        if mode == "prompt":
            request.ClearField("messages")
            request.chat_template = ""  # type: ignore[attr-defined]
            if not request.prompt:  # type: ignore[attr-defined]
                request.prompt = draw(st.text(min_size=1, max_size=64))  # type: ignore[attr-defined]
        elif mode == "chat":
            request.prompt = ""  # type: ignore[attr-defined]
            if not request.messages:  # type: ignore[attr-defined]
                request.messages.add(content=draw(st.text(max_size=64)))  # type: ignore[attr-defined]
            request.chat_template = draw(st.sampled_from(["gemma", "chatml", "gguf", ""]))  # type: ignore[attr-defined]
            for message in request.messages:  # type: ignore[attr-defined]
                message.role = draw(st.sampled_from(["system", "user", "assistant"]))


@st.composite
def calls(draw: Callable[..., Any], method: MethodDescriptor) -> Call:
    request = draw(messages(method.input_type))
    _tame(draw, request)
    timeout = CALL_TIMEOUT_S if not draw(WILD) else draw(st.sampled_from(SHORT_TIMEOUTS_S))
    cancel_after = None
    if method.server_streaming and draw(WILD):
        cancel_after = draw(st.integers(1, 3))
    return Call(method, request, timeout, cancel_after)


# -- the tests -------------------------------------------------------------------------------------


# Inputs that once broke the server (see the commits that fixed them).
STALLED_THE_ENGINE = Call(  # a 2**31-token penalty history allocated on the engine thread
    _method("StreamGenerate"),
    pb.StreamGenerateRequest(
        prompt="Hello",
        params=pb.GenerationParams(
            sampling=pb.SamplingParams(repeat_penalty=1.5, penalty_last_n=2**31 - 1),
            stopping=pb.StoppingCriteria(max_tokens=2),
            cache_prompt=False,
        ),
    ),
)


@WHOLE_RUN
@FUZZ
@given(fuzz=st.sampled_from(METHODS).flatmap(calls))
@example(fuzz=STALLED_THE_ENGINE)
async def test_fuzzed_requests_get_ok_or_a_deliberate_status(fuzzed: Fuzzed, fuzz: Call) -> None:
    outcome = await outcome_of(
        fuzzed.channel,
        fuzz.method,
        fuzz.request.SerializeToString(),
        timeout=fuzz.timeout,
        cancel_after=fuzz.cancel_after,
    )
    check(
        outcome,
        may_time_out=fuzz.timeout < CALL_TIMEOUT_S,
        cancelled=fuzz.cancel_after is not None,
    )


@WHOLE_RUN
@FUZZ
@given(method=st.sampled_from(METHODS), data=st.binary(max_size=512))
@example(method=_method("Tokenize"), data=b"\x12\x02\xff\xfe")  # was UNKNOWN: DecodeError
@example(method=_method("GetStats"), data=b"\x00")  # was UNKNOWN: corrupt wire format
async def test_raw_bytes_get_ok_or_a_deliberate_status(
    fuzzed: Fuzzed, method: MethodDescriptor, data: bytes
) -> None:
    """Arbitrary bytes as a request: what protobuf cannot parse is INVALID_ARGUMENT; what it can
    (unknown fields included) is served, with cache_prompt off and max_tokens (and n) clamped."""
    try:
        parsed = GetMessageClass(method.input_type).FromString(data)
    except DecodeError:
        parsed = None
    if parsed is not None and "params" in parsed.DESCRIPTOR.fields_by_name:
        params: pb.GenerationParams = parsed.params  # type: ignore[attr-defined]
        params.cache_prompt = False
        if params.stopping.max_tokens:
            params.stopping.max_tokens = min(params.stopping.max_tokens, MAX_TOKENS)
        data = parsed.SerializeToString()
    if parsed is not None and "sampling_params" in parsed.DESCRIPTOR.fields_by_name:
        sampling = parsed.sampling_params  # type: ignore[attr-defined]
        if sampling.max_tokens:
            sampling.max_tokens = min(sampling.max_tokens, MAX_TOKENS)
        sampling.n = min(sampling.n, 2)
        data = parsed.SerializeToString()
    outcome = await outcome_of(fuzzed.channel, method, data)
    check(outcome, is_unparsable=parsed is None)
    if parsed is None:
        assert outcome.status == grpc.StatusCode.INVALID_ARGUMENT


def string_paths(descriptor: Descriptor, depth: int = 3) -> list[tuple[FieldDescriptor, ...]]:
    """Every chain of fields from `descriptor` down to a string field (nested messages to
    `depth`)."""
    paths: list[tuple[FieldDescriptor, ...]] = []
    for f in descriptor.fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            paths.append((f,))
        elif f.message_type is not None and depth > 1:
            paths += [(f, *rest) for rest in string_paths(f.message_type, depth - 1)]
    return paths


def _path_name(chain: tuple[FieldDescriptor, ...]) -> str:
    """The path the server names: a repeated field's first element [0]; a map's too, its first
    entry on the wire (VllmEngine's flat_keys[0].key: a key that is not UTF-8 names no key)."""
    parts = []
    for f in chain:
        repeated = getattr(f, "is_repeated", None)
        is_repeated = f.label == f.LABEL_REPEATED if repeated is None else repeated
        parts.append(f"{f.name}[0]" if is_repeated else f.name)
    return ".".join(parts)


STRING_PATHS = [(m, chain) for m in METHODS for chain in string_paths(m.input_type)]
BAD_UTF8 = st.builds(
    lambda head, bad, tail: head.encode() + bad + tail.encode(),
    st.text(max_size=8),
    st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf"]),
    st.text(max_size=8),
)


@WHOLE_RUN
@FUZZ
@given(target=st.sampled_from(STRING_PATHS), bad=BAD_UTF8)
async def test_invalid_utf8_is_invalid_argument_naming_the_field(
    fuzzed: Fuzzed, target: tuple[MethodDescriptor, tuple[FieldDescriptor, ...]], bad: bytes
) -> None:
    """Python protobuf cannot hold invalid UTF-8 in a string field, so the wire bytes are built
    by hand: the field, nested in its parents, after an otherwise valid request."""
    method, chain = target
    data = bad
    for f in reversed(chain):
        data = wire_string(f.number, data)
    base = GetMessageClass(method.input_type)()
    if "prompt" in base.DESCRIPTOR.fields_by_name:
        base.prompt = "Hello"  # type: ignore[attr-defined]
    outcome = await outcome_of(fuzzed.channel, method, base.SerializeToString() + data)
    check(outcome)
    assert outcome.status == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(outcome.error).field == _path_name(chain)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", METHODS, ids=label)
async def test_oversize_request_is_resource_exhausted(
    fuzzed: Fuzzed, method: MethodDescriptor
) -> None:
    """A message over max_message_bytes is refused by grpc itself (an unknown field is enough)."""
    oversize = wire_string(1000, b"x" * (MAX_MESSAGE_BYTES + 1))
    outcome = await outcome_of(fuzzed.channel, method, oversize)
    check(outcome)
    assert outcome.status == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_server_is_unharmed_after_the_fuzzing(fuzzed: Fuzzed) -> None:
    """Runs last in this module: no busy slot, nothing queued, the same KV cells in use as
    before the fuzzing, and the known greedy request answered identically."""
    stats = await _settled_stats(fuzzed.channel)
    assert (stats.active_slots, stats.queue_depth) == (0, 0), stats
    before = fuzzed.stats_before
    assert stats.kv_cells_used == before.kv_cells_used
    assert [s.cached_tokens for s in stats.slots] == [s.cached_tokens for s in before.slots]
    assert all(s.state == "idle" and not s.request_id for s in stats.slots)
    again = await _generate(fuzzed.channel, REFERENCE)
    assert (list(again.token_ids), again.text) == (
        list(fuzzed.reference.token_ids),
        fuzzed.reference.text,
    )
    after = await _settled_stats(fuzzed.channel)
    assert after.kv_cells_used == before.kv_cells_used and after.active_slots == 0
