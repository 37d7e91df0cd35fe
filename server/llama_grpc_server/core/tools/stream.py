"""One chat request's output with tools: its events run through the format's parser, so text
deltas carry the answer's text and tool-call deltas, and the last event the complete calls
(finish reason TOOL_CALLS when the model ended its turn after calling). Call ids are given
here: "call_" and 24 letters and digits, a hash of the request id and the call's index (so a
replayed response has the same ids). Pure."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import AsyncIterator

from llama_grpc_server.core.requests.request import Finished, FinishReason, TokenDelta
from llama_grpc_server.core.tools.types import Parsed, ToolCall, ToolCallDelta, ToolCallParser

_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
ID_CHARS = 24
# A turn that ends by itself after its calls is a tool-call turn; one cut short is not.
_TURN_ENDS = frozenset({FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.STOP_SEQUENCE})


def call_id(request_id: str, index: int) -> str:
    digest = int.from_bytes(hashlib.sha256(f"{request_id}/{index}".encode()).digest(), "big")
    chars = []
    for _ in range(ID_CHARS):
        digest, rest = divmod(digest, len(_ALPHABET))
        chars.append(_ALPHABET[rest])
    return "call_" + "".join(chars)


class ToolSession:
    """The parser of one request, with ids on its calls."""

    def __init__(self, parser: ToolCallParser, request_id: str, *, parallel: bool = True) -> None:
        self._parser = parser
        self._request_id = request_id
        self._parallel = parallel  # False: the first call only (later ones are dropped)
        self._named: set[int] = set()

    def push(self, text: str) -> Parsed:
        return self._with_ids(self._parser.push(text))

    def finish(self) -> Parsed:
        return self._with_ids(self._parser.finish())

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        calls = [c for c in self._parser.calls if self._parallel or c.index == 0]
        # by the index its deltas carried (a broken call before it keeps its number)
        return tuple(
            dataclasses.replace(call, id=call_id(self._request_id, call.index)) for call in calls
        )

    def _with_ids(self, parsed: Parsed) -> Parsed:
        if not parsed.calls:
            return parsed
        deltas = []
        for piece in parsed.calls:
            if piece.index > 0 and not self._parallel:
                continue
            if piece.index in self._named:
                deltas.append(piece)
                continue
            self._named.add(piece.index)
            deltas.append(dataclasses.replace(piece, id=call_id(self._request_id, piece.index)))
        return Parsed(parsed.text, tuple(_merged(deltas)))


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call in one delta (fewer, larger messages)."""
    out: list[ToolCallDelta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and last.index == delta.index and not delta.name and not delta.id:
            out[-1] = dataclasses.replace(last, arguments=last.arguments + delta.arguments)
        else:
            out.append(delta)
    return out


async def with_tool_calls(
    events: AsyncIterator[TokenDelta | Finished], session: ToolSession
) -> AsyncIterator[TokenDelta | Finished]:
    """The request's events with tool calls parsed out of the text."""
    async for event in events:
        if isinstance(event, TokenDelta):
            parsed = session.push(event.text)
            yield dataclasses.replace(event, text=parsed.text, tool_calls=parsed.calls)
            continue
        parsed = session.finish()
        if parsed.text or parsed.calls:
            index = event.usage.completion_tokens  # after the answer's last token
            yield TokenDelta((), parsed.text, tool_calls=parsed.calls, index=index)
        calls = session.calls
        reason = FinishReason.TOOL_CALLS if calls and event.reason in _TURN_ENDS else event.reason
        yield dataclasses.replace(event, reason=reason, tool_calls=calls)
        return
