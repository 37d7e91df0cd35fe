"""Resuming a generation stream whose replica went away (docs/resume-client.md).

A stream cut by UNAVAILABLE (a drain's GOAWAY, a reset connection, a stopped or hung replica) is
called again, through the same channel, with params.resume.token_ids = every token received so
far; what the new call sends is lined up with what the caller already has by
GenerationDelta.index, so that each position of the answer is yielded once. `Resumption` is the
bookkeeping of one stream (no I/O): client.py's streams read, sleep and call again, sync or async.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable

from llama_grpc.errors import (
    REQUEST_ID_KEY,
    InternalError,
    LlamaGrpcError,
    RequestIdInFlightError,
    UnavailableError,
)
from llama_grpc.v1 import llm_service_pb2 as pb

DEFAULT_RESUME_ATTEMPTS = 3
# The wait before the n-th call again (0-based) of a run of failures: a random point between half
# and all of min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**n), so that the callers of a drained replica do
# not all arrive at once. 50-100 ms, 100-200 ms, 200-400 ms...
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 1.0
# The most recent delta starts remembered (besides position 0) for lining up a server that sends
# positions again from one of them: bounded, as a stream may have many thousands of deltas.
MARKS = 64

# UNAVAILABLE statuses about the model rather than the replica: an admin unloaded it with force
# (calling again would load it back), or loading it failed. Not resumed.
NOT_RESUMED_REASONS = frozenset({"MODEL_UNLOADED", "MODEL_LOAD_FAILED"})

Metadata = tuple[tuple[str, str], ...]
GenerationRequest = pb.StreamGenerateRequest | pb.GenerateTokensRequest
# A run of text in the answer: "text", "reasoning", or a tool call's arguments (by its index).
_Key = str | int


def is_resumable(error: LlamaGrpcError, *, recalled: bool) -> bool:
    """Whether a stream that ended with `error` is called again: UnavailableError (UNAVAILABLE,
    or a proxy's reset stream) but for a model unloaded or failing to load; and on a call that
    is itself a resumption, REQUEST_ID_IN_FLIGHT (the replica has not yet seen that the earlier
    call with the same x-request-id is gone)."""
    if isinstance(error, UnavailableError):
        return error.reason not in NOT_RESUMED_REASONS
    return recalled and isinstance(error, RequestIdInFlightError)


def backoff_s(failures: int) -> float:
    """The wait before calling again after `failures` failures in a row (1 or more)."""
    ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (failures - 1))
    return random.uniform(ceiling / 2, ceiling)  # jitter, not a secret


def check_attempts(attempts: int) -> int:
    """`attempts` as given: an int of 0 or more (ValueError, TypeError otherwise)."""
    if isinstance(attempts, bool) or not isinstance(attempts, int):
        raise TypeError(f"resume_attempts must be an int, not {attempts!r}")
    if attempts < 0:
        raise ValueError(f"resume_attempts must be 0 (off) or more, not {attempts}")
    return attempts


class Resumption:
    """One stream's resumption: what of the answer the caller has had (its tokens, and the
    length of its text, thinking and each tool call's arguments), the failures since the
    answer last moved on, and the request, deadline and metadata of the calls again.

    take() passes each delta through, trimmed to what the caller has not had; after() decides,
    when a call ends with an error, whether to call again (and after how long) or to raise;
    next_call() gives that call's request, timeout and metadata."""

    def __init__(
        self,
        request: GenerationRequest,
        timeout: float | None,
        metadata: Metadata | None,
        attempts: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.attempts = attempts
        self.resumptions = 0
        self._request = request
        self._metadata = metadata or ()
        self._clock = clock
        self._deadline = None if timeout is None else clock() + timeout
        self._request_id: str | None = None  # sent with the calls again, unless metadata has one
        self._failures: list[LlamaGrpcError] = []  # since the answer last moved on: the cut first
        # What the caller has had.
        self._tokens: list[int] = []
        self._chars: dict[_Key, int] = {}
        self._named_calls: set[int] = set()  # tool calls whose id and name it has had
        # _chars as it was before each of the last MARKS deltas, by the position it started at
        # (where a server that sends positions again may start; position 0: nothing).
        self._marks: dict[int, dict[_Key, int]] = {}
        # The current call: its next position (None before its first delta), the _chars of the
        # answer at its first delta's position, and what it sent of each run of text.
        self._next: int | None = None
        self._base: dict[_Key, int] = {}
        self._sent: dict[_Key, int] = {}
        self._trimmed = False

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token of the answer the caller has had."""
        return tuple(self._tokens)

    def take(self, delta: pb.GenerationDelta) -> pb.GenerationDelta | None:
        """The part of `delta` the caller has not had: `delta` itself when all of it is new,
        a trimmed copy when the server sent some of it again, None when it has had all of it.
        InternalError when the server skips positions, sends a position again with another
        token (a server that ignores resume, with a request neither greedy nor seeded), or
        starts again inside an earlier delta."""
        have = len(self._tokens)
        if not self.resumptions:  # the first call: all of it is new, whatever its indexes say
            start = have
        elif self._next is None:  # a call again: its first delta says where the server went on
            start = delta.index
        else:  # (an index left 0 by a server that does not resume: the next position)
            start = delta.index or self._next
        if start > have:
            raise InternalError(
                f"the stream went on at position {start} with {have} tokens received: "
                "positions are missing"
            )
        ids = list(delta.token_ids)
        skip = min(have - start, len(ids))
        if ids[:skip] != self._tokens[start : start + skip]:
            raise InternalError(
                f"the resumed stream sent positions {start} to {start + skip - 1} again with "
                "other tokens than those received (a server that does not resume streams "
                "replays only greedy or seeded answers)"
            )
        if self._next is None:
            self._base = self._chars_at(start)
        self._next = start + len(ids)
        before = dict(self._chars)
        self._trimmed = skip > 0
        text = self._fresh("text", delta.text)
        reasoning = self._fresh("reasoning", delta.reasoning)
        fresh_calls = (self._fresh_call(call) for call in delta.tool_calls)
        calls = [call for call in fresh_calls if call is not None]
        if not self._trimmed:
            kept = delta
        else:
            kept = pb.GenerationDelta(
                text=text,
                token_ids=ids[skip:],
                logprobs=delta.logprobs[skip:],
                tool_calls=calls,
                reasoning=reasoning,
                index=start + skip,
            )
            if not (text or reasoning or calls or kept.token_ids):
                return None
        if skip < len(ids):
            self._mark(have, before)
            self._tokens.extend(ids[skip:])
        self._failures.clear()  # the answer moved on: the next cut gets every attempt again
        return kept

    def after(self, error: LlamaGrpcError) -> float:
        """A call of the stream ended with `error`: the seconds to wait before calling again.
        Raises the error the stream ends with instead: `error` itself when it is not resumable;
        the error that cut the stream (with the later ones as notes) when the attempts since
        the answer last moved on are spent, or when the deadline leaves no time."""
        if not is_resumable(error, recalled=self.resumptions > 0):
            if self._failures:
                error.add_note(f"while resuming a stream cut by: {self._failures[0]}")
            raise error
        self._failures.append(error)
        if not self._request_id and error.request_id and _sendable(error.request_id):
            self._request_id = error.request_id
        if len(self._failures) > self.attempts:
            raise self._cut(f"not resumed: {self.attempts} attempts in a row failed")
        delay = backoff_s(len(self._failures))
        if self._deadline is not None and self._deadline - self._clock() <= delay:
            raise self._cut("not resumed: the call's deadline leaves no time")
        return delay

    def next_call(self) -> tuple[GenerationRequest, float | None, Metadata | None]:
        """(request, timeout, metadata) of the next call: the same request with the tokens
        received so far as params.resume (none yet: the same request), the time left of the
        first call's deadline, the same metadata with the x-request-id of the earlier calls."""
        self.resumptions += 1
        self._next, self._base, self._sent = None, {}, {}
        request = copy.deepcopy(self._request)
        if self._tokens:
            request.params.resume.token_ids[:] = self._tokens
        timeout = None if self._deadline is None else max(self._deadline - self._clock(), 0.0)
        metadata = self._metadata
        if self._request_id and all(key != REQUEST_ID_KEY for key, _ in metadata):
            metadata = (*metadata, (REQUEST_ID_KEY, self._request_id))
        return request, timeout, metadata or None

    def _cut(self, why: str) -> LlamaGrpcError:
        """The error that cut the stream, noting the failed attempts since and `why`."""
        cut = self._failures[0]
        for number, later in enumerate(self._failures[1:], start=1):
            cut.add_note(f"resume attempt {number} failed: {later}")
        cut.add_note(why)
        return cut

    def _mark(self, position: int, chars: dict[_Key, int]) -> None:
        """Remember `chars` as what the caller had before the delta starting at `position`."""
        self._marks[position] = chars
        if len(self._marks) > MARKS:
            del self._marks[next(iter(self._marks))]  # the oldest (positions only grow)

    def _chars_at(self, start: int) -> dict[_Key, int]:
        """What the caller had had of each run of text when it had `start` tokens."""
        if start == len(self._tokens):
            return dict(self._chars)
        if start == 0:
            return {}
        if start not in self._marks:
            raise InternalError(
                f"the resumed stream started again at position {start}, which is neither 0 "
                "nor the start of a recent delta: it cannot be lined up with the answer so far"
            )
        return self._marks[start]

    def _fresh(self, key: _Key, piece: str) -> str:
        """The end of `piece` (the current call's next text on run `key`) the caller has not
        had."""
        start = self._base.get(key, 0) + self._sent.get(key, 0)
        self._sent[key] = self._sent.get(key, 0) + len(piece)
        had = self._chars.get(key, 0)
        self._chars[key] = max(had, start + len(piece))
        if had <= start:
            return piece
        self._trimmed = True
        return piece[had - start :]

    def _fresh_call(self, call: pb.ToolCallDelta) -> pb.ToolCallDelta | None:
        """The part of a tool-call piece the caller has not had: its id and name once, and the
        new end of its arguments; None when nothing is left."""
        arguments = self._fresh(call.index, call.arguments)
        has_name = bool(call.id or call.name)
        named = has_name and call.index not in self._named_calls
        if named:
            self._named_calls.add(call.index)
        if named == has_name and arguments == call.arguments:
            return call
        self._trimmed = True
        if not (named or arguments):
            return None
        return pb.ToolCallDelta(
            index=call.index,
            id=call.id if named else "",
            name=call.name if named else "",
            arguments=arguments,
        )


def _sendable(request_id: str) -> bool:
    """Whether an id can go back as an x-request-id header (printable ASCII, as the server's)."""
    return request_id.isascii() and request_id.isprintable() and " " not in request_id
