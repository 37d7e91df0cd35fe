"""Batch strategies: pure functions deciding how one tick's token budget is split between
decode tokens and prompt chunks. No clock reads, no I/O; table-driven unit tests."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

MAX_DECODE_WAIT_TICKS = 3
"""Under any built-in strategy a generating slot waits at most this many ticks for a token."""
MAX_PREFILL_WAIT_TICKS = 8
"""A prompt that got no token for this many ticks goes before every other (_prefill_order)."""


@dataclass(frozen=True, slots=True)
class SlotView:
    """One active slot as a strategy sees it."""

    slot_id: int
    num_pending: int  # tokens to feed before its next sample (1 = a decode token)
    is_decoding: bool
    last_served_tick: int  # for round-robin: the oldest served goes first
    arrival_ns: int = 0  # when the request arrived: among equal prompts the oldest goes first


@dataclass(frozen=True, slots=True)
class BatchView:
    """A frozen picture of the tick to plan."""

    tick: int
    budget: int  # n_batch: tokens in this forward pass at most
    chunk_size: int  # one slot's prefill per tick at most
    queue_depth: int
    slots: tuple[SlotView, ...]
    # Prompt tokens a tick may add to the decode tokens and still take at most about twice a
    # decode-only tick, as the scheduler measured it; 0 = no limit (--prefill-stall 0, the
    # default, or not measured yet).
    prefill_allowance: int = 0

    def waited(self, slot: SlotView) -> int:
        return self.tick - slot.last_served_tick


Allocation = Mapping[int, int]  # slot_id -> tokens fed this tick

MIN_COST_SAMPLE_TOKENS = 32  # prompt tokens in a tick for it to measure the per-token cost
MIN_PREFILL_ALLOWANCE = 8  # prompts always progress, however slow a prompt token is
ALLOWANCE_SHARE = 0.8  # keep below the bound: at 2 (the p95 target), below one extra decode tick
INTERACTIVE_PREFILL_STALL = 2.0
"""--prefill-stall 2: a pass carrying prompt tokens while slots generate takes at most about two
decode-only passes' time, so a long prompt arriving stretches the running streams' inter-token
gaps by at most ~2x (bench/strategies.py), and its prompt goes in many small chunks."""
DEFAULT_PREFILL_STALL = 0.0
"""The default: no bound. Prompts take the pass's token budget after the decode tokens, at most
the chunk size each, as llama-server and vLLM do. On a CPU a forward pass costs about as much
for one decode row as for four (the weights are read once either way: ~70-90 ms of the
embedded model's pass at one thread); a prompt fed in k chunks beside generating slots keeps
its slot out of the decode batch for k passes, and closed-loop prompt-heavy traffic pays each
of them: 512/64-token requests at 4 concurrent cost 19 % more CPU per token at a bound of 2
than without one (bench/packing.py; aiperf saw the same, issue 40)."""


@dataclass(slots=True)
class TickCosts:
    """Moving averages of measured llama_decode times: a decode-only tick, and a prompt token in
    a prefill-heavy tick. They turn "at most ~2x a decode tick" into the prompt-token allowance
    the scheduler passes to strategies in BatchView.prefill_allowance."""

    decode_tick_ms: float = 0.0
    prefill_token_ms: float = 0.0

    def observe(self, num_decode: int, num_prefill: int, eval_ms: float) -> None:
        if eval_ms <= 0:
            return
        if num_prefill == 0 and num_decode > 0:
            self.decode_tick_ms = _ema(self.decode_tick_ms, eval_ms)
        elif num_prefill >= MIN_COST_SAMPLE_TOKENS:
            self.prefill_token_ms = _ema(
                self.prefill_token_ms, eval_ms / (num_prefill + num_decode)
            )

    def prefill_allowance(self, chunk_size: int, stall: float = DEFAULT_PREFILL_STALL) -> int:
        """Prompt tokens that make a tick last about `stall` decode ticks (at 2, they add about
        one decode tick); 0 = no limit: `stall` is 0 (the default) or the costs are not
        measured yet."""
        if stall <= 0 or self.decode_tick_ms <= 0 or self.prefill_token_ms <= 0:
            return 0
        n = int(ALLOWANCE_SHARE * (stall - 1) * self.decode_tick_ms / self.prefill_token_ms)
        return max(MIN_PREFILL_ALLOWANCE, min(chunk_size, n))


def _ema(old: float, new: float, alpha: float = 0.2) -> float:
    return new if old <= 0 else old + alpha * (new - old)


@runtime_checkable
class BatchStrategy(Protocol):
    @property
    def name(self) -> str: ...

    def allocate(self, view: BatchView) -> Allocation: ...


def _round_robin(slots: list[SlotView]) -> list[SlotView]:
    return sorted(slots, key=lambda s: (s.last_served_tick, s.slot_id))


def _give_decodes(view: BatchView, slots: list[SlotView], budget: int, out: dict[int, int]) -> int:
    for slot in _round_robin(slots):
        if budget <= 0:
            break
        out[slot.slot_id] = 1
        budget -= 1
    return budget


def _prefill_order(view: BatchView, slots: list[SlotView]) -> list[SlotView]:
    """Prompts in the order they take the pass's budget: the fewest tokens left first, the
    oldest first among equals, and a prompt kept waiting MAX_PREFILL_WAIT_TICKS ahead of all.
    Each takes what it needs (up to chunk_size) before the next gets any. Shortest remaining
    first is the order that minimizes the mean time to first token of prompts sharing passes
    (SRPT), and costs no pass more: the passes carry the same tokens. Four 2,048-token prompts
    arriving together used to take 512 tokens a pass each, round robin, and all finished in the
    fourth pass; now the first finishes after one (then two, three, four: mean TTFT 2.5 passes
    instead of 4), as in llama-server's slot order. A long prompt still fills what a pass
    leaves, and one that got nothing for MAX_PREFILL_WAIT_TICKS (short prompts filling every
    pass) goes first: none starves."""

    return sorted(slots, key=lambda slot: _prefill_rank(view, slot))


def _prefill_rank(view: BatchView, slot: SlotView) -> tuple[bool, int, int, int]:
    """A prompt's place in _prefill_order: the smallest goes first."""
    starving = view.waited(slot) >= MAX_PREFILL_WAIT_TICKS
    return (not starving, slot.num_pending, slot.arrival_ns, slot.slot_id)


def _give_prefills(view: BatchView, slots: list[SlotView], budget: int, out: dict[int, int]) -> int:
    for slot in _prefill_order(view, slots):
        if budget <= 0:
            break
        n = min(slot.num_pending, view.chunk_size, budget)
        out[slot.slot_id] = n
        budget -= n
    return budget


def _split(view: BatchView) -> tuple[list[SlotView], list[SlotView], list[SlotView]]:
    """(starving decoders, other decoders, prefilling slots)."""
    starving = [s for s in view.slots if s.is_decoding and view.waited(s) >= MAX_DECODE_WAIT_TICKS]
    decoders = [s for s in view.slots if s.is_decoding and view.waited(s) < MAX_DECODE_WAIT_TICKS]
    prefills = [s for s in view.slots if not s.is_decoding]
    return starving, decoders, prefills


@dataclass(frozen=True, slots=True)
class DecodeMaximal:
    """Every generating slot gets its token first; prompt chunks take the rest. With a prefill
    allowance (--prefill-stall 2: BatchView.prefill_allowance > 0), while slots are generating,
    prompt chunks get only that many tokens, so a long prompt arriving does not stretch the
    running streams' inter-token latency beyond ~2x (with whole 512-token chunks it went to 65x
    on 2 CPU cores: bench/strategies.py), at a cost in throughput (DEFAULT_PREFILL_STALL)."""

    name: str = "decode_maximal"

    def allocate(self, view: BatchView) -> Allocation:
        starving, decoders, prefills = _split(view)
        out: dict[int, int] = {}
        budget = _give_decodes(view, starving, view.budget, out)
        if view.prefill_allowance <= 0:  # the served longest ago keep their rows
            waiting = _rows_to_finish(view, prefills, budget, len(decoders))
            decoders = _round_robin(decoders)[: len(decoders) - waiting]
        budget = _give_decodes(view, decoders, budget, out)
        if out and view.prefill_allowance > 0:
            budget = min(budget, view.prefill_allowance)
        _give_prefills(view, prefills, budget, out)
        return out


def _rows_to_finish(view: BatchView, prefills: list[SlotView], budget: int, decoders: int) -> int:
    """Decode rows that wait a tick so that the first prompt in line finishes in this pass:
    those it lacks, when it fits the pass with them. Else a generating slot's row pushes the
    last tokens of a pass-sized prompt into the next pass, and every prompt behind it one pass
    later too (four 2,048-token prompts in passes of 2,048 got their first tokens after 1, 3, 4
    and 5 passes instead of 1, 2, 3, 4; on one CPU thread a pass of them is ~20 s). A decoder
    waits at most MAX_DECODE_WAIT_TICKS all the same (the starving ones are served before)."""
    if not prefills:
        return 0
    head = min(prefills, key=lambda slot: _prefill_rank(view, slot))  # no second sort
    if head.num_pending > min(view.chunk_size, budget):
        return 0
    return min(decoders, max(0, head.num_pending - max(0, budget - decoders)))


@dataclass(frozen=True, slots=True)
class PrefillPriority:
    """Prompt chunks first, decode tokens take the rest (batch throughput); a decoder that waited
    MAX_DECODE_WAIT_TICKS ticks is served before any prefill."""

    name: str = "prefill_priority"

    def allocate(self, view: BatchView) -> Allocation:
        starving, decoders, prefills = _split(view)
        out: dict[int, int] = {}
        budget = _give_decodes(view, starving, view.budget, out)
        budget = _give_prefills(view, prefills, budget, out)
        _give_decodes(view, decoders, budget, out)
        return out


@dataclass(frozen=True, slots=True)
class Balanced:
    """Half the budget for decode tokens, half for prompt chunks; either side lends what it does
    not use to the other."""

    name: str = "balanced"
    decode_share: float = 0.5

    def allocate(self, view: BatchView) -> Allocation:
        starving, decoders, prefills = _split(view)
        out: dict[int, int] = {}
        budget = _give_decodes(view, starving, view.budget, out)
        decode_budget = max(1, int(budget * self.decode_share)) if decoders else 0
        left = _give_decodes(view, decoders, min(decode_budget, budget), out)
        budget = budget - min(decode_budget, budget) + left
        budget = _give_prefills(view, prefills, budget, out)
        _give_decodes(view, [d for d in decoders if d.slot_id not in out], budget, out)
        return out


BUILTIN: dict[str, Callable[[], BatchStrategy]] = {
    "decode_maximal": DecodeMaximal,
    "prefill_priority": PrefillPriority,
    "balanced": Balanced,
}


def load_strategy(spec: str) -> BatchStrategy:
    """A built-in name, or `module:attr` naming a strategy object, class or factory."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        known = ", ".join(sorted(BUILTIN))
        raise ValueError(f"unknown batch strategy {spec!r}: use one of {known} or module:attr")
    module_name, attr = spec.split(":", 1)
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import batch strategy {spec!r}: {exc}") from exc
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "allocate")):
        obj = obj()
    if not isinstance(obj, BatchStrategy):
        raise ValueError(f"batch strategy {spec!r} has no allocate(view) method or name")
    return obj
