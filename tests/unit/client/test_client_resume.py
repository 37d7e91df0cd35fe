"""Client-side resumption of generation streams (docs/resume-client.md), against scripted
grpc.aio servers on 127.0.0.1:0: a call cut by UNAVAILABLE is made again with the tokens received
so far, and the stream yields every position of the answer once, as if nothing happened.

Each call of a ScriptedServicer plays the next script of its list: deltas, a done, a failure.
Then Resumption alone, and a drain between two real servers (FakeEngine)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_status import rpc_status

from llama_grpc import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    Delta,
    Done,
    InternalError,
    InvalidArgumentError,
    LlamaGrpcError,
    QueueFullError,
    ReasoningDelta,
    RequestCancelledError,
    RequestIdInFlightError,
    ResourceExhaustedError,
    ToolCall,
    ToolCallDelta,
    UnavailableError,
    cli,
)
from llama_grpc import resume as resume_module
from llama_grpc.routing import LLM_SERVICE_NAME
from llama_grpc.types import TokenLogprob
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.config import SchedulerSettings, ServerSettings, Settings
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_server.testing import FakeEngine

Code = grpc.StatusCode


@dataclasses.dataclass(frozen=True)
class Fail:
    """End the call with this status (a llama-grpc ErrorInfo reason when given)."""

    code: grpc.StatusCode
    message: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Wait:
    """Sleep this long (cancellation or the server's stop ends it)."""

    seconds: float


Step = pb.GenerationDelta | pb.GenerationDone | Fail | Wait
Script = Sequence[Step]

CUT = Fail(Code.UNAVAILABLE, "replica went away")


def delta(text: str, index: int, *token_ids: int, **fields: Any) -> pb.GenerationDelta:
    return pb.GenerationDelta(text=text, index=index, token_ids=token_ids, **fields)


def done(completion_tokens: int = 5) -> pb.GenerationDone:
    return pb.GenerationDone(
        finish_reason=pb.FINISH_REASON_EOS,
        usage=pb.Usage(prompt_tokens=4, completion_tokens=completion_tokens),
        request_id="srv",
    )


# The answer "abcde" = tokens 1..5, one per delta.
ABC = [delta("a", 0, 1), delta("b", 1, 2), delta("c", 2, 3)]
DE = [delta("d", 3, 4), delta("e", 4, 5)]
ANSWER = [Delta(text, (token,)) for token, text in enumerate("abcde", start=1)]


def _status(failure: Fail) -> grpc.Status:
    details = []
    if failure.reason:
        info = error_details_pb2.ErrorInfo(reason=failure.reason, domain="llama-grpc")
        packed = any_pb2.Any()
        packed.Pack(info)
        details.append(packed)
    status = status_pb2.Status(code=failure.code.value[0], message=failure.message, details=details)
    return rpc_status.to_status(status)


class ScriptedServicer(pb_grpc.LlmServiceServicer):
    """Plays scripts[n] on the n-th generation call (the last one again past the end) and
    records each call's request, metadata and time left."""

    def __init__(self, scripts: Sequence[Script], request_id: str = "") -> None:
        self.scripts = scripts
        self.request_id = request_id  # sent as the x-request-id header of every call
        self.requests: list[Any] = []
        self.metadata: list[dict[str, str]] = []
        self.time_left: list[float | None] = []

    def _script(self, request: Any) -> Script:
        return self.scripts[min(len(self.requests), len(self.scripts)) - 1]

    async def _play(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        self.time_left.append(context.time_remaining())
        if self.request_id:
            await context.send_initial_metadata((("x-request-id", self.request_id),))
        for step in self._script(request):
            if isinstance(step, Fail):
                await context.abort_with_status(_status(step))
            elif isinstance(step, Wait):
                await asyncio.sleep(step.seconds)
            else:
                yield step

    async def StreamGenerate(
        self, request: pb.StreamGenerateRequest, context: Any
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        async for step in self._play(request, context):
            if isinstance(step, pb.GenerationDelta):
                yield pb.StreamGenerateResponse(delta=step)
            else:
                yield pb.StreamGenerateResponse(done=step)

    async def GenerateTokens(
        self, request: pb.GenerateTokensRequest, context: Any
    ) -> AsyncIterator[pb.GenerateTokensResponse]:
        async for step in self._play(request, context):
            if isinstance(step, pb.GenerationDelta):
                yield pb.GenerateTokensResponse(delta=step)
            else:
                yield pb.GenerateTokensResponse(done=step)


@contextlib.asynccontextmanager
async def serving(servicer: ScriptedServicer) -> AsyncIterator[tuple[str, grpc.aio.Server]]:
    """A grpc.aio server on 127.0.0.1:0 with `servicer` and LlmService health SERVING."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_LlmServiceServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    await health.set(LLM_SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", server
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def scripted(
    *scripts: Script, request_id: str = ""
) -> AsyncIterator[tuple[str, ScriptedServicer]]:
    servicer = ScriptedServicer(scripts, request_id)
    async with serving(servicer) as (target, _):
        yield target, servicer


@dataclasses.dataclass
class Outcome:
    """What a stream yielded, the error it ended with, and its resumptions."""

    events: list[Any]
    error: LlamaGrpcError | None
    resumptions: int
    text: str = ""


METHODS = ("stream", "generate_tokens", "stream_chat")


def _open(client: Client | AsyncClient, method: str, params: dict[str, Any]) -> Any:
    if method == "stream":
        return client.stream("prompt", **params)
    if method == "generate_tokens":
        return client.generate_tokens([7, 8], **params)
    return client.stream_chat([("user", "hi")], **params)


async def run_async(
    target: str | list[str],
    method: str = "stream",
    client_options: dict[str, Any] | None = None,
    **params: Any,
) -> Outcome:
    async with AsyncClient(target, **(client_options or {})) as client:
        stream = _open(client, method, params)
        events: list[Any] = []
        try:
            async for event in stream:
                events.append(event)
        except LlamaGrpcError as error:
            return Outcome(events, error, stream.resumptions)
        text = stream.text if method == "stream_chat" else ""
        return Outcome(events, None, stream.resumptions, text)


def run_sync(
    target: str | list[str],
    method: str = "stream",
    client_options: dict[str, Any] | None = None,
    **params: Any,
) -> Outcome:
    with Client(target, **(client_options or {})) as client:
        stream = _open(client, method, params)
        events: list[Any] = []
        try:
            for event in stream:
                events.append(event)
        except LlamaGrpcError as error:
            return Outcome(events, error, stream.resumptions)
        text = stream.text if method == "stream_chat" else ""
        return Outcome(events, None, stream.resumptions, text)


Runner = Callable[..., Any]


async def _sync(target: str | list[str], *args: Any, **kwargs: Any) -> Outcome:
    """run_sync in a thread (the servers share this event loop)."""
    return await asyncio.to_thread(run_sync, target, *args, **kwargs)


RUNNERS = pytest.mark.parametrize("run", [run_async, _sync], ids=["async", "sync"])


def _without_resume(request: Any) -> Any:
    copy = type(request)()
    copy.CopyFrom(request)
    copy.params.ClearField("resume")
    if not copy.params.ByteSize():  # params held nothing but resume
        copy.ClearField("params")
    return copy


# -- a cut stream goes on --------------------------------------------------------------------------


@RUNNERS
@pytest.mark.parametrize("method", METHODS)
async def test_a_cut_stream_goes_on_where_it_was(run: Runner, method: str) -> None:
    """3 deltas, then UNAVAILABLE: the stream calls again with the 3 tokens as params.resume
    and yields the rest and the server's Done, each delta once, in order, with no error."""
    async with scripted([*ABC, CUT], [*DE, done()]) as (target, servicer):
        outcome = await run(target, method)
    assert outcome.error is None
    assert outcome.events[:-1] == ANSWER
    last = outcome.events[-1]
    assert isinstance(last, Done)
    assert (last.usage.completion_tokens, last.request_id) == (5, "srv")
    assert outcome.resumptions == 1
    first, again = servicer.requests
    assert not first.params.HasField("resume")
    assert list(again.params.resume.token_ids) == [1, 2, 3]
    assert _without_resume(again) == first  # otherwise the very same request
    if method == "stream_chat":
        assert outcome.text == "abcde"


@RUNNERS
async def test_a_stream_cut_several_times_goes_on_each_time(run: Runner) -> None:
    """Every call that brings new tokens starts the count of attempts again: one attempt is
    enough for three cuts, each resume carrying all the tokens so far."""
    scripts = [[ABC[0], CUT], [ABC[1], CUT], [ABC[2], *DE[:1], CUT], [DE[1], done()]]
    async with scripted(*scripts) as (target, servicer):
        outcome = await run(target, client_options={"resume_attempts": 1})
    assert (outcome.error, outcome.events[:-1], outcome.resumptions) == (None, ANSWER, 3)
    resumed = [list(r.params.resume.token_ids) for r in servicer.requests]
    assert resumed == [[], [1], [1, 2], [1, 2, 3, 4]]


@RUNNERS
async def test_a_call_cut_before_any_delta_is_sent_again_as_it_was(run: Runner) -> None:
    """Nothing received yet: the same request again, without params.resume."""
    async with scripted([CUT], [*ABC, *DE, done()]) as (target, servicer):
        outcome = await run(target)
    assert (outcome.error, outcome.events[:-1], outcome.resumptions) == (None, ANSWER, 1)
    assert [r.params.HasField("resume") for r in servicer.requests] == [False, False]


# -- lining up what a server sends again -----------------------------------------------------------


@RUNNERS
async def test_a_delta_sent_again_is_dropped(run: Runner) -> None:
    """The second call starts again at position 2 (a delta already received): it is not
    yielded twice."""
    async with scripted([*ABC, CUT], [ABC[2], *DE, done()]) as (target, _):
        outcome = await run(target)
    assert (outcome.error, outcome.events[:-1]) == (None, ANSWER)


@RUNNERS
async def test_a_delta_overlapping_what_was_received_is_trimmed(run: Runner) -> None:
    """A delta from position 1 with tokens 2, 3, 4 (text "bcd", one logprob per token) yields
    only position 3: token 4, its text "d" and its logprob."""
    logprobs = [
        pb.TokenLogprob(token_id=i, token=c, logprob=-i)
        for i, c in zip((2, 3, 4), "bcd", strict=True)
    ]
    overlap = delta("bcd", 1, 2, 3, 4, logprobs=logprobs)
    async with scripted([*ABC, CUT], [overlap, DE[1], done()]) as (target, _):
        outcome = await run(target)
    assert outcome.error is None
    assert outcome.events[:-1] == [
        *ANSWER[:3],
        Delta("d", (4,), (TokenLogprob(4, "d", -4.0, ()),)),
        ANSWER[4],
    ]


@RUNNERS
async def test_a_server_that_ignores_resume_is_lined_up_from_the_start(run: Runner) -> None:
    """A server without resumption answers the whole request again, every index 0 (unset):
    a greedy answer replays the same tokens, so the stream skips what it had and goes on."""
    old = [delta("ab", 0, 1, 2), delta("cd", 0, 3, 4), delta("e", 0, 5)]
    first = [delta("a", 0, 1), delta("b", 0, 2), delta("c", 0, 3)]
    async with scripted([*first, CUT], [*old, done()]) as (target, _):
        outcome = await run(target)
    assert outcome.error is None
    assert outcome.events[:-1] == [*ANSWER[:3], Delta("d", (4,)), ANSWER[4]]


@RUNNERS
async def test_a_replay_with_other_tokens_ends_the_stream(run: Runner) -> None:
    """A replay whose tokens differ from those received (sampled again, without a seed) cannot
    go on as if nothing happened: InternalError, after the deltas already yielded."""
    async with scripted([*ABC, CUT], [delta("x", 0, 9), *DE, done()]) as (target, _):
        outcome = await run(target)
    assert isinstance(outcome.error, InternalError)
    assert "other tokens than those received" in outcome.error.message
    assert outcome.events == ANSWER[:3]


async def test_a_chat_replay_yields_thinking_text_and_tool_call_pieces_once() -> None:
    """A chat stream replayed from the start: its thinking, text and the tool call's id, name
    and arguments are each yielded once; the call's arguments go on where they were cut."""
    call_head = pb.ToolCallDelta(index=0, id="c1", name="f", arguments='{"a"')
    call_tail = pb.ToolCallDelta(index=0, arguments=": 1}")
    thinking = delta("", 0, 1, reasoning="hmm")
    text = delta("ok", 1, 2)
    call = delta("", 2, 3, tool_calls=[call_head])
    first = [thinking, text, call, CUT]
    replay = [thinking, text, call, delta("", 3, 4, tool_calls=[call_tail]), done(4)]
    async with scripted(first, replay) as (target, _), AsyncClient(target) as client:
        stream = client.stream_chat([("user", "hi")])
        events = [event async for event in stream]
    assert events[:-1] == [
        ReasoningDelta("hmm"),
        Delta("", (1,)),
        Delta("ok", (2,)),
        Delta("", (3,)),
        ToolCallDelta(0, "c1", "f", '{"a"'),
        Delta("", (4,)),
        ToolCallDelta(0, "", "", ": 1}"),
    ]
    assert (stream.reasoning, stream.text) == ("hmm", "ok")
    assert stream.tool_calls == (ToolCall("c1", "f", '{"a": 1}'),)


# -- bounds ----------------------------------------------------------------------------------------


@RUNNERS
async def test_attempts_are_bounded_and_the_cut_surfaces(run: Runner) -> None:
    """resume_attempts=2: the cut and two calls again that fail end the stream with the error
    that cut it (the attempts' errors as notes), after the deltas already yielded."""
    failing = [Fail(Code.UNAVAILABLE, "still gone")]
    async with scripted([*ABC, CUT], failing) as (target, servicer):
        outcome = await run(target, client_options={"resume_attempts": 2})
    assert len(servicer.requests) == 3
    assert outcome.events == ANSWER[:3]
    assert outcome.resumptions == 2
    error = outcome.error
    assert isinstance(error, UnavailableError)
    assert error.message == "replica went away"
    assert error.__notes__ == [
        "resume attempt 1 failed: UNAVAILABLE: still gone",
        "resume attempt 2 failed: UNAVAILABLE: still gone",
        "not resumed: 2 attempts in a row failed",
    ]


@RUNNERS
@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (Fail(Code.INVALID_ARGUMENT, "bad"), InvalidArgumentError),
        (Fail(Code.DEADLINE_EXCEEDED, "late"), DeadlineExceededError),
        (Fail(Code.CANCELLED, "gone"), RequestCancelledError),
        (Fail(Code.RESOURCE_EXHAUSTED, "full", "QUEUE_FULL"), QueueFullError),
        (Fail(Code.RESOURCE_EXHAUSTED, "stalled", "STALLED_READER"), ResourceExhaustedError),
        (Fail(Code.INTERNAL, "engine died", "ENGINE_FAILED"), InternalError),
        (Fail(Code.UNAVAILABLE, "unloaded", "MODEL_UNLOADED"), UnavailableError),
        (Fail(Code.ALREADY_EXISTS, "in flight", "REQUEST_ID_IN_FLIGHT"), RequestIdInFlightError),
    ],
)
async def test_other_errors_end_the_stream(
    run: Runner, failure: Fail, expected: type[LlamaGrpcError]
) -> None:
    """Not "the replica went away" (a model unloaded on purpose included): one call, its
    error raised after its deltas."""
    async with scripted([*ABC, failure], [*DE, done()]) as (target, servicer):
        outcome = await run(target)
    assert type(outcome.error) is expected
    assert (outcome.events, outcome.resumptions, len(servicer.requests)) == (ANSWER[:3], 0, 1)


@RUNNERS
@pytest.mark.parametrize("reason", ["SHUTTING_DOWN", "ENGINE_HUNG", "ENGINE_FAILED", "NOT_READY"])
async def test_the_servers_own_unavailable_statuses_are_resumed(run: Runner, reason: str) -> None:
    """A drain (SHUTTING_DOWN), a hung or dead engine (ENGINE_HUNG, ENGINE_FAILED as
    UNAVAILABLE), a server not ready yet."""
    cut = Fail(Code.UNAVAILABLE, "going", reason)
    async with scripted([*ABC, cut], [*DE, done()]) as (target, _):
        outcome = await run(target)
    assert (outcome.error, outcome.events[:-1], outcome.resumptions) == (None, ANSWER, 1)


@RUNNERS
async def test_a_request_id_still_in_flight_on_a_call_again_is_tried_again(run: Runner) -> None:
    """The replica has not yet seen that the cut call is gone: REQUEST_ID_IN_FLIGHT on a
    call again is one more failed attempt, not the end."""
    in_flight = Fail(Code.ALREADY_EXISTS, "in flight", "REQUEST_ID_IN_FLIGHT")
    async with scripted([*ABC, CUT], [in_flight], [*DE, done()]) as (target, servicer):
        outcome = await run(target)
    assert (outcome.error, outcome.events[:-1], outcome.resumptions) == (None, ANSWER, 2)
    resumed = [list(r.params.resume.token_ids) for r in servicer.requests]
    assert resumed == [[], [1, 2, 3], [1, 2, 3]]


@RUNNERS
async def test_resumption_off(run: Runner) -> None:
    """resume_attempts=0 on the client, or on the call: the cut is the stream's error."""
    cut, rest = [*ABC, CUT], [*DE, done()]
    off_for_the_client = {"resume_attempts": 0}
    async with scripted(cut, cut, cut, rest) as (target, servicer):
        off = await run(target, client_options=off_for_the_client)
        off_for_the_call = await run(target, resume_attempts=0)
        on_for_the_call = await run(target, client_options=off_for_the_client, resume_attempts=1)
    for outcome in (off, off_for_the_call):
        assert isinstance(outcome.error, UnavailableError)
        assert (outcome.events, outcome.resumptions) == (ANSWER[:3], 0)
    assert (on_for_the_call.error, on_for_the_call.events[:-1]) == (None, ANSWER)
    assert on_for_the_call.resumptions == 1
    assert len(servicer.requests) == 4


async def test_closing_during_the_wait_calls_no_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """aclose() while the stream waits to call again: iteration ends, no call again."""
    monkeypatch.setattr(resume_module, "BACKOFF_BASE_S", 1.0)
    async with (
        scripted([*ABC, CUT], [*DE, done()]) as (target, servicer),
        AsyncClient(target) as client,
    ):
        stream = client.stream("prompt")
        events = [await anext(stream) for _ in range(3)]
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.2)  # cut, and waiting 0.5-1 s before calling again
        await stream.aclose()
        with pytest.raises(StopAsyncIteration):
            await waiting
        await asyncio.sleep(1.0)
    assert (events, len(servicer.requests), stream.resumptions) == (ANSWER[:3], 1, 0)


def test_resume_attempts_is_checked() -> None:
    with pytest.raises(ValueError, match="0 \\(off\\) or more"):
        Client(resume_attempts=-1)
    with pytest.raises(TypeError, match="must be an int"):
        AsyncClient(resume_attempts=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="resume_attempts"):
        Client().generate("p", resume_attempts=1)  # type: ignore[call-arg]


# -- deadline and request id -----------------------------------------------------------------------


@RUNNERS
async def test_a_call_again_gets_the_time_left_of_the_deadline(run: Runner) -> None:
    """timeout=5 and the cut after 1 s: the call again has at most 4 s, not a fresh 5."""
    async with scripted([*ABC, Wait(1.0), CUT], [*DE, done()]) as (target, servicer):
        outcome = await run(target, timeout=5)
    assert outcome.error is None
    first, again = servicer.time_left
    assert first is not None
    assert again is not None
    assert first > 4.5
    assert again < 4.1


@RUNNERS
async def test_no_call_again_when_the_deadline_leaves_no_time(
    run: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait longer than the time left: the cut surfaces at once, noting why."""
    monkeypatch.setattr(resume_module, "BACKOFF_BASE_S", 60.0)
    monkeypatch.setattr(resume_module, "BACKOFF_CAP_S", 60.0)
    started = time.monotonic()
    async with scripted([*ABC, CUT], [*DE, done()]) as (target, servicer):
        outcome = await run(target, timeout=5)
    assert time.monotonic() - started < 3
    assert len(servicer.requests) == 1
    assert isinstance(outcome.error, UnavailableError)
    assert outcome.error.__notes__ == ["not resumed: the call's deadline leaves no time"]


@RUNNERS
async def test_a_call_again_carries_the_request_id_of_the_first(run: Runner) -> None:
    """The server's x-request-id of the cut call goes with the call again (one answer, one id
    in the logs); a caller's own x-request-id is sent as it was, once."""
    cut, rest = [*ABC, CUT], [*DE, done()]
    async with scripted(cut, rest, cut, rest, request_id="srv-1") as (target, servicer):
        await run(target)
        await run(target, metadata={"x-request-id": "mine"})
    sent = [metadata.get("x-request-id") for metadata in servicer.metadata]
    assert sent == [None, "srv-1", "mine", "mine"]


# -- a replica list: the call again reaches the other replica --------------------------------------


class ReplicaServicer(ScriptedServicer):
    """A replica of the same model: a request without resume gets 3 deltas, then nothing
    until the replica stops; one with resume the rest of the answer."""

    def __init__(self) -> None:
        super().__init__([[*ABC, Wait(30)], [*DE, done()]])

    def _script(self, request: Any) -> Script:
        return self.scripts[1 if request.params.HasField("resume") else 0]


@RUNNERS
async def test_a_stopped_replica_of_a_list_is_replaced_at_once(run: Runner) -> None:
    """Two replicas behind one client (a target list, round robin): the one streaming the
    answer stops after 3 deltas; the call again lands on the other at once (the dead one's
    subchannel is not waited on) and the answer is whole."""
    replicas = (ReplicaServicer(), ReplicaServicer())
    async with contextlib.AsyncExitStack() as stack:
        served = [await stack.enter_async_context(serving(replica)) for replica in replicas]
        targets = [target for target, _ in served]

        async def stop_the_streaming_one() -> float:
            while not any(len(r.requests) == 1 for r in replicas):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # its 3 deltas are on their way
            streaming = next(i for i, r in enumerate(replicas) if r.requests)
            await served[streaming][1].stop(None)
            return time.monotonic()

        stopper = asyncio.ensure_future(stop_the_streaming_one())
        outcome = await run(targets, client_options={"timeout": 30})
        stopped_at = await stopper
        elapsed = time.monotonic() - stopped_at
    assert (outcome.error, outcome.events[:-1], outcome.resumptions) == (None, ANSWER, 1)
    resumed = [list(r.requests[-1].params.resume.token_ids) for r in replicas if r.requests]
    assert sorted(resumed) == [[], [1, 2, 3]]  # the first call on one, the call again on the other
    assert elapsed < 1.0, elapsed


def test_the_cli_flag_sets_the_clients_attempts(capsys: pytest.CaptureFixture[str]) -> None:
    """--resume-attempts N (default 3) reaches Client; a negative N is a usage error."""
    parser = cli.build_parser("127.0.0.1:1")
    for argv, attempts in ((["stream", "p"], 3), (["stream", "p", "--resume-attempts", "0"], 0)):
        with cli._client(parser.parse_args(argv)) as client:
            assert client._defaults.resume_attempts == attempts
    assert cli.main(["stream", "p", "--resume-attempts", "-1"]) == cli.EXIT_USAGE
    assert "resume_attempts must be 0 (off) or more" in capsys.readouterr().err


# -- Resumption alone ------------------------------------------------------------------------------


def _received(count: int) -> resume_module.Resumption:
    """A resumption that has had `count` one-token deltas ("x" each) and was cut."""
    state = resume_module.Resumption(pb.StreamGenerateRequest(prompt="p"), None, None, 3)
    for position in range(count):
        assert state.take(delta("x", position, 100 + position)) is not None
    state.after(UnavailableError("cut"))
    request, timeout, metadata = state.next_call()
    assert list(request.params.resume.token_ids) == [100 + p for p in range(count)]
    assert (timeout, metadata) == (None, None)
    return state


def test_a_server_may_go_on_from_any_recent_delta() -> None:
    """From the start, or from one of the last MARKS deltas: lined up (nothing yielded twice);
    from an older one, or from inside a delta, or past the end: InternalError."""
    count = resume_module.MARKS + 36
    assert _received(count).take(delta("x" * count, 0, *range(100, 100 + count))) is None
    recent = count - resume_module.MARKS
    assert _received(count).take(delta("x", recent, 100 + recent)) is None
    state = _received(count)
    assert state.take(delta("xy", count - 1, 100 + count - 1, 7)) == delta("y", count, 7)
    assert state.token_ids[-2:] == (100 + count - 1, 7)
    for start, message in [
        (recent - 1, "nor the start of a recent delta"),
        (count + 1, "positions are missing"),
    ]:
        with pytest.raises(InternalError, match=message):
            _received(count).take(delta("x", start, 100 + start))


# -- real servers ----------------------------------------------------------------------------------

DRAINING = Settings(
    scheduler=SchedulerSettings(default_max_tokens=64),
    server=ServerSettings(host="127.0.0.1", port=0, grace_s=0.2),
)
LONG_PROMPT = "the quick brown fox jumps over the lazy dog"


async def test_a_replica_drained_mid_stream_costs_the_caller_nothing() -> None:
    """Two real servers (FakeEngine, one token per 20 ms) behind a target list; the one
    streaming a greedy answer drains after 10 tokens (the end of its grace period ends the
    stream UNAVAILABLE SHUTTING_DOWN): the stream goes on on the other, with the text, tokens
    and usage of the answer undisturbed. (A server that resumes goes on from the tokens sent;
    one that does not answers again from the start, which a greedy answer lines up with.)"""
    engines = [FakeEngine(token_delay_s=0.02), FakeEngine(token_delay_s=0.02)]
    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for engine in engines:
            running = await stack.enter_async_context(start_server(DRAINING, lambda e=engine: e))
            assert await running.wait_loaded()
            servers.append(running)
        targets = [f"127.0.0.1:{running.port}" for running in servers]
        async with AsyncClient(targets[0], timeout=30) as client:
            expected = await client.generate(LONG_PROMPT, temperature=0)
        before = [engine.stats().requests_started for engine in engines]
        events: list[Any] = []
        stopping: list[asyncio.Task[None]] = []
        async with AsyncClient(targets, timeout=30) as client:
            stream = client.stream(LONG_PROMPT, temperature=0)
            async for event in stream:
                events.append(event)
                if len(events) == 10:
                    started = [e.stats().requests_started for e in engines]
                    busy = servers[0 if started[0] > before[0] else 1]
                    stopping.append(asyncio.create_task(busy.stop()))
        await asyncio.gather(*stopping)
    *deltas, done = events
    assert "".join(d.text for d in deltas) == expected.text
    assert tuple(t for d in deltas for t in d.token_ids) == expected.token_ids
    assert isinstance(done, Done)
    assert done.usage.completion_tokens == expected.usage.completion_tokens
    assert stream.resumptions == 1
