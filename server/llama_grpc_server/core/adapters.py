"""LoRA adapters, as the scheduler and the caches see them: which adapters a request applies (an
AdapterSet, fixed for its whole answer), what the caches key them by, and the catalog of a
model's loaded adapters that requests are resolved against. Pure Python; the llama.cpp handles
live in engine/adapters.py.

llama.cpp applies adapters to a whole context (llama_set_adapters_lora), so one forward pass runs
one adapter set: the scheduler groups each pass by set (core.scheduling.scheduler) and the
runner switches the context's set between passes. A prefix computed under one set is another
KV than the same tokens under another set, so the set is part of the request's cache scope
(scoped()): slots, the RAM and disk tiers, the response cache and the KV events all key by scope
already, and never share across scopes."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llama_grpc_server import errors

MAX_SCALE = 16.0
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """One adapter a request applies: its name, its scale, and its file's digest (the caches key
    the digest, so an adapter reloaded from another file under the same name shares nothing)."""

    name: str
    scale: float
    digest: str


# The adapters of a request, sorted by name; () is the base model.
AdapterSet = tuple[AdapterRef, ...]


def cache_key(adapters: AdapterSet) -> str:
    """What the caches key an adapter set by ("" for the base model): digests and scales, not
    names (a name is a label; equal files at equal scales compute the same KV)."""
    return "+".join(f"{a.digest}*{a.scale!r}" for a in adapters)


def scoped(scope: str, adapters: AdapterSet) -> str:
    """The cache scope a request with `adapters` uses. A caller's own scope is printable text
    (rpc validation), so the unit separator never occurs in it and no scope can be chosen to
    equal an adapter set's."""
    return f"{scope}\x1flora={cache_key(adapters)}" if adapters else scope


def describe(adapters: AdapterSet) -> str:
    """For logs and metric labels: "name*scale+..." ("" for the base model)."""
    return "+".join(f"{a.name}*{a.scale:g}" for a in adapters)


@dataclass(frozen=True, slots=True)
class AdapterEntry:
    """A loaded adapter of a model."""

    name: str
    path: str
    default_scale: float
    digest: str
    rank: int
    alpha: float
    num_tensors: int
    size_bytes: int


@dataclass(frozen=True, slots=True)
class AdapterUsage:
    """An adapter's counters in a StatsSnapshot."""

    name: str
    requests: int
    generated_tokens: int
    passes: int


@dataclass(slots=True)
class AdapterCounters:
    """Per adapter since start (GetStats, Prometheus): requests that applied it, the tokens they
    generated, the forward passes run with it."""

    requests: int = 0
    generated_tokens: int = 0
    passes: int = 0


def check_scale(scale: float, where: str) -> float:
    if not math.isfinite(scale) or abs(scale) > MAX_SCALE:
        raise errors.InvalidRequest(
            f"{where}: scale must be finite and within [-{MAX_SCALE:g}, {MAX_SCALE:g}], "
            f"got {scale}",
            field=where,
        )
    return float(scale)


def check_name(name: str, where: str) -> str:
    if not NAME.fullmatch(name):
        raise errors.InvalidRequest(
            f"{where}: an adapter name is 1-64 letters, digits, '.', '_' or '-' (starting with a "
            f"letter or digit), got {name!r}",
            field=where,
        )
    return name


@dataclass
class AdapterCatalog:
    """A model's loaded adapters by name. Read by the rpc threads (resolve, list), written by
    load and unload (under the lock); the engine thread keeps the llama.cpp handles."""

    _entries: dict[str, AdapterEntry] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, entry: AdapterEntry) -> None:
        with self._lock:
            self._entries[entry.name] = entry

    def remove(self, name: str) -> AdapterEntry | None:
        with self._lock:
            return self._entries.pop(name, None)

    def get(self, name: str) -> AdapterEntry | None:
        with self._lock:
            return self._entries.get(name)

    def entries(self) -> list[AdapterEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.name)

    def resolve(
        self,
        requested: Sequence[tuple[str, float | None]],
        *,
        allowed: Iterable[str] | None = None,
        field_name: str = "params.lora",
    ) -> AdapterSet:
        """The adapter set a request names, as (name, scale or None for the adapter's default).
        INVALID_ARGUMENT naming the entry for an unknown or repeated name or a bad scale;
        PERMISSION_DENIED for an adapter the caller's tenant may not use (`allowed`: None, any).
        Scale 0 entries are dropped: they are the base model."""
        permitted = None if allowed is None else frozenset(allowed)
        seen: set[str] = set()
        refs: list[AdapterRef] = []
        with self._lock:
            known = dict(self._entries)
        for i, (name, scale) in enumerate(requested):
            where = f"{field_name}[{i}]"
            if name in seen:
                raise errors.InvalidRequest(
                    f"{where}.name: adapter {name!r} is named twice", field=f"{where}.name"
                )
            seen.add(name)
            entry = known.get(name)
            if entry is None:
                names = ", ".join(sorted(known)) or "none"
                raise errors.InvalidRequest(
                    f"{where}.name: unknown adapter {name!r} (this model serves: {names})",
                    field=f"{where}.name",
                )
            if permitted is not None and name not in permitted:
                raise errors.PermissionDenied(
                    f"{where}.name: this caller's tenant may not use adapter {name!r}",
                    field=f"{where}.name",
                )
            value = entry.default_scale if scale is None else check_scale(scale, f"{where}.scale")
            if value != 0.0:
                refs.append(AdapterRef(name, value, entry.digest))
        return tuple(sorted(refs, key=lambda r: r.name))
