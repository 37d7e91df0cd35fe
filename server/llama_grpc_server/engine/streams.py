"""The asyncio side of the engine: each request's EngineStream (an api.RequestStream), and the
posting of a tick's events to the event loops their streams belong to, with one
call_soon_threadsafe per event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from llama_grpc_server.core.requests.request import (
    Event,
    Failed,
    Finished,
    ReaderProgress,
    Request,
    TokenDelta,
)

Deliveries = dict[asyncio.AbstractEventLoop, list[tuple["EngineStream", Event]]]


class StreamOwner(Protocol):
    """What a stream asks of its engine (engine.loop.EngineLoop), from the event loop."""

    def wake(self) -> None: ...

    def cancel(
        self, request_id: str, tenant: str = "", *, deadline_exceeded: bool = False
    ) -> None: ...


class EngineStream:
    """The asyncio side of one request (an api.RequestStream): an async iterator of events;
    cancel() is idempotent.

    Deltas that piled up while the consumer was busy (a client reading slower than the engine
    generates holds back each send) come out merged into one: a delta is never held back to
    wait for another, so a consumer that keeps up gets one delta per token. What it takes is
    counted in request.reader: with --stream-buffer-tokens unread the scheduler stops decoding
    the request, and the read that follows wakes the engine."""

    def __init__(self, engine: StreamOwner, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.reader = request.reader = ReaderProgress()
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._engine = engine
        self._is_done = False
        self._held: Event | None = None  # taken from the queue while merging, not yet yielded

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self._is_done:
            event = self._held if self._held is not None else await self.queue.get()
            self._held = None
            if isinstance(event, TokenDelta) and event.token_ids and not self.queue.empty():
                event = self._merge_queued(event)
            if isinstance(event, Finished | Failed):
                self._is_done = True
            elif isinstance(event, TokenDelta) and event.token_ids:
                self.reader.num_read += len(event.token_ids)
                if self.reader.is_paused:  # the engine skips the request until this read
                    self._engine.wake()
            yield event

    def _merge_queued(self, first: TokenDelta) -> TokenDelta:
        """`first` and the deltas with tokens queued right behind it, as one delta. A delta
        without tokens (the text held back until the end) stays apart: a caller resuming a
        cut stream keeps the text of the deltas that carried the tokens it sends back, and
        the resumed stream sends that end again (docs/api.md#resumable-streams)."""
        parts = [first]
        while not self.queue.empty():
            event = self.queue.get_nowait()
            if not isinstance(event, TokenDelta) or not event.token_ids:
                self._held = event
                break
            parts.append(event)
        if len(parts) == 1:
            return first
        return TokenDelta(
            tuple(t for part in parts for t in part.token_ids),
            "".join(part.text for part in parts),
            tuple(lp for part in parts for lp in part.logprobs),
            max(part.cached_prompt_tokens for part in parts),
            index=first.index,
        )

    def cancel(self, *, deadline_exceeded: bool = False) -> None:
        if not self._is_done:
            self._is_done = True
            self._engine.cancel(
                self.request_id, self.request.spec.tenant, deadline_exceeded=deadline_exceeded
            )


def post(by_loop: Deliveries) -> None:
    """Each event loop's events in one call_soon_threadsafe (from the engine thread)."""
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            continue


def _put_all(batch: list[tuple[EngineStream, Event]]) -> None:
    for stream, event in batch:
        stream.queue.put_nowait(event)
