"""What other threads ask of the engine thread: one typed command each, queued in EngineLoop's
inbox (under its lock) and applied by the engine thread between two ticks, in order."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llama_grpc_server import errors
from llama_grpc_server.core.api import CacheCleared
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.engine.streams import EngineStream


@dataclass(frozen=True, slots=True)
class Add:
    """A submitted request: the scheduler takes it (or it fails: an adapter unloaded since)."""

    stream: EngineStream


@dataclass(frozen=True, slots=True)
class Cancel:
    """Drop a request; `deadline_exceeded` ends it as DeadlineExceeded."""

    request_id: str
    tenant: str
    deadline_exceeded: bool = False


@dataclass(frozen=True, slots=True)
class EndAll:
    """End every queued and running request with `error`."""

    error: errors.ServiceError


@dataclass(frozen=True, slots=True)
class ClearCache:
    """Clear the idle caches; the answer goes to `done` (which the caller may have cancelled)."""

    done: concurrent.futures.Future[CacheCleared]


@dataclass(frozen=True, slots=True)
class Call:
    """Run `fn` on the engine thread; its result or its exception goes to `done`."""

    fn: Callable[[], Any]
    done: concurrent.futures.Future[Any]

    def run(self) -> None:
        """A ServiceError is the caller's answer; anything else is also the engine's failure
        (raised on, as a failing ClearCache is)."""
        if not self.done.set_running_or_notify_cancel():
            return
        try:
            self.done.set_result(self.fn())
        except errors.ServiceError as exc:
            self.done.set_exception(exc)
        except BaseException as exc:
            self.done.set_exception(
                errors.EngineFailed(f"the engine failed: {errors.describe(exc)}")
            )
            raise


@dataclass(frozen=True, slots=True)
class SetTenantLimits:
    """New tenant limits, before any request submitted after them."""

    limits: Mapping[str, TenantLimits]


Command = Add | Cancel | EndAll | ClearCache | Call | SetTenantLimits


def refuse(commands: Sequence[Command], error: errors.ServiceError) -> None:
    """The engine is gone: the callers still waiting on a command's answer get `error`."""
    for command in commands:
        if isinstance(command, ClearCache | Call) and not command.done.done():
            command.done.set_exception(error)
