"""Per-request samplers: a llama_sampler chain built from SamplingParams (logit bias first), or a
numpy argmax fast path for plain greedy requests (0.04 ms vs 0.44 ms per token for 262k tokens).
A grammar-constrained request keeps its grammar sampler outside the chain: the chain proposes a
token, the grammar checks just that one, and only when it is refused does the grammar mask the
whole vocabulary (llama.cpp's own trick: a full mask costs milliseconds at 262k tokens). The
grammar is only ever told about tokens it allowed, so llama.cpp never aborts on it. A lazy
grammar (a structural tag) allows everything until its trigger, so before it a
core.constrained.structural_tag.TriggerGuard vets the token instead: the one that sets the grammar
off must hand it text it accepts (llama.cpp replays that text unchecked and aborts on a refusal).

A sampling (temperature > 0) request's randomness is a function of its seed and the position in
the answer, never of what was drawn before: the chain ends in a PositionDraw instead of
llama.cpp's dist sampler (one RNG stream per request), so the token at position i is drawn with
u_i = position_uniform(seed, i), and a resumed answer (its tokens so far taken first, `resumed`)
draws its next token as the undisturbed answer would have (docs/api.md#resumable-streams)."""

from __future__ import annotations

import bisect
import ctypes
import math
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import llama_cpp
import numpy as np

from llama_grpc_server.core.constrained.structural_tag import TriggerGuard
from llama_grpc_server.core.reasoning.budget import ReasoningParams, ThinkingBudget
from llama_grpc_server.core.requests.request import Constraint, SamplingParams
from llama_grpc_server.engine.grammar import init_grammar, token_piece

NO_TOKEN = -1
RESUME_FIELD = "params.resume.token_ids"
_DEAD_END = "the grammar allows no token here that the sampler can pick (logit_bias may ban them)"
# Before a lazy grammar's trigger: how many proposed tokens the guard may refuse in one step
# before the request fails (each refusal re-runs the chain without that token; a refusal needs a
# token that completes a trigger and goes on with other text in its own piece, so one is rare).
MAX_GUARD_REFUSALS = 64
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment


def position_uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) of answer position `position` (0 for the answer's first
    token) of a request seeded with `seed`: output number `position` of SplitMix64 seeded with
    `seed` (its state after position + 1 increments, mixed), its top 53 bits as a double. A
    counter-based generator: any position's draw without the ones before it."""
    z = (seed + (position + 1) * _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


# Candidates up to this many are drawn from in plain Python (a chain with top-k or top-p leaves a
# few dozen: a few microseconds, where numpy's per-call overhead costs more); more with numpy.
SMALL_DRAW = 256
# The candidates' floats as one ctypes type (llama_token_data is {int32 id, float logit, float p}):
# a view of any array, sliced to its logits (the slice reads only inside it).
_FLOATS = ctypes.c_float * (3 << 20)
# One byte-array type over the same span as _FLOATS, viewed at any candidates array's address:
# ctypes caches every array type it makes (one per length), so a type per candidate count would
# grow without bound over a process's life.
_RAW = ctypes.c_char * (3 << 22)
_APPLY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)  # addresses: no ctypes objects


def draw(logits: Sequence[float] | np.ndarray[Any, np.dtype[np.float32]], u: float) -> int:
    """The index drawn from the softmax of `logits` (already temperature-scaled) with the
    uniform `u` in [0, 1): the first whose running sum of weights exp(logit - max), in double
    precision and in order, exceeds u times their total (a weight of 0, a -inf logit, is never
    drawn). llama.cpp's dist sampler draws the same way, with its RNG's u."""
    if len(logits) <= SMALL_DRAW:
        top = max(logits)
        running = list(accumulate([math.exp(x - top) for x in logits]))
        index = bisect.bisect_right(running, running[-1] * u)
    else:
        values = np.asarray(logits, dtype=np.float64)
        cumulative = np.cumsum(np.exp(values - values.max()))
        index = int(cumulative.searchsorted(cumulative[-1] * u, "right"))
    return min(index, len(logits) - 1)


class PositionDraw:
    """A llama.cpp sampler (a Python apply callback, llama_sampler_init) ending a sampling
    request's chain in place of llama_sampler_init_dist: it draws from the candidates the chain
    left (top-k, top-p, min-p, temperature applied), in the order the chain left them, with the
    draw of the answer position `position` (position_uniform), which the request's sampler sets
    before each sample. Applying the chain again for the same position (a token refused by a
    grammar or a trigger guard) draws with the same u. Keep the object alive while its sampler
    is in a chain (the chain frees the sampler, not the callback)."""

    __slots__ = ("_apply", "_iface", "failure", "position", "sampler", "seed")

    def __init__(self, seed: int) -> None:
        self.seed = seed & _MASK64
        self.position = 0
        self.failure = ""  # an exception in the callback (cannot propagate through C)
        self._apply = _APPLY(self._on_apply)
        self._iface = llama_cpp.llama_sampler_i()  # every other entry NULL: optional
        self._iface.apply = ctypes.cast(self._apply, llama_cpp.llama_sampler_i_apply)
        self.sampler = llama_cpp.llama_sampler_init(ctypes.byref(self._iface), None)

    def _on_apply(self, _sampler: int, cur_p: int) -> None:
        array = llama_cpp.llama_token_data_array.from_address(cur_p)
        size = int(array.size)
        if size <= 1:  # nothing to draw (no RNG stream to keep aligned either)
            array.selected = size - 1
            return
        try:
            data = ctypes.c_void_p.from_address(cur_p).value or 0  # the array's first field
            u = position_uniform(self.seed, self.position)
            if size <= SMALL_DRAW:
                array.selected = draw(_FLOATS.from_address(data)[1 : 3 * size : 3], u)
            else:
                raw = memoryview(_RAW.from_address(data))  # a view: nothing past `size` is read
                logits = np.frombuffer(raw, _TOKEN_DATA, count=size)["logit"]
                array.selected = draw(logits, u)
        except Exception as exc:  # a C callback: report, never raise
            self.failure = f"sampling failed: {type(exc).__name__}: {exc}"
            array.selected = 0


class Candidates:
    """A reusable llama_token_data_array over the whole vocabulary (numpy-owned memory), and a
    one-token array for asking a grammar about a single token. Engine thread only."""

    def __init__(self, n_vocab: int) -> None:
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._array = llama_cpp.llama_token_data_array()
        self.ref = ctypes.byref(self._array)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self._one_array = llama_cpp.llama_token_data_array()
        self._one_ref = ctypes.byref(self._one_array)

    def load(self, row: np.ndarray[Any, np.dtype[np.float32]]) -> None:
        """Every token with its logit, unsorted, nothing selected."""
        self.data["id"] = self._ids
        self.data["logit"] = row
        self.data["p"] = 0.0
        _reset(self._array, self.data)

    @property
    def selected(self) -> int:
        index, size = int(self._array.selected), int(self._array.size)
        return int(self._array.data[index].id) if 0 <= index < size else NO_TOKEN

    @property
    def has_allowed(self) -> bool:
        """After a grammar masked the array: is any token left?"""
        return bool(self.data["logit"].max() > -math.inf)

    def allows(self, grammar: Any, token: int) -> bool:
        """Whether the grammar accepts `token` next (it masks refused tokens with -inf)."""
        self._one[0] = (token, 0.0, 0.0)
        _reset(self._one_array, self._one)
        llama_cpp.llama_sampler_apply(grammar, self._one_ref)
        return bool(self._one["logit"][0] > -math.inf)


def _reset(array: Any, data: np.ndarray[Any, np.dtype[Any]]) -> None:
    array.data = data.ctypes.data_as(llama_cpp.llama_token_data_p)
    array.size = len(data)
    array.selected = -1
    array.sorted = False


class RequestSampler:
    """One request's sampler state (penalty history, grammar, the position of its next seeded
    draw). Free with close(). sample() returns NO_TOKEN (with `error` set, and `error_field`
    when the fault is not the constraint's) when a constraint allows no token at all, or
    refused one of the resumed tokens."""

    __slots__ = (
        "_budget",
        "_candidates",
        "_chain",
        "_draw",
        "_grammar",
        "_guard",
        "_min_tokens",
        "_n_vocab",
        "_num_sampled",
        "_position",
        "_suppressed",
        "_vocab",
        "error",
        "error_field",
    )

    def __init__(
        self,
        params: SamplingParams,
        seed: int,
        n_vocab: int,
        *,
        constraint: Constraint | None = None,
        vocab: Any = None,
        candidates: Candidates | None = None,
        min_tokens: int = 0,
        suppressed: tuple[int, ...] = (),
        reasoning: ReasoningParams | None = None,
        resumed: tuple[int, ...] = (),
    ) -> None:
        self._n_vocab = n_vocab
        # a reasoning budget: the end of thinking is forced once it is spent (needs `vocab`)
        has_budget = reasoning is not None and reasoning.budget is not None
        self._budget = ThinkingBudget(reasoning) if has_budget and reasoning else None
        # min_tokens: `suppressed` get -inf logits until this many tokens have been sampled
        self._min_tokens = min_tokens if suppressed else 0
        self._suppressed = np.array(suppressed, dtype=np.int64)
        self._num_sampled = 0
        self._position = 0  # the answer's tokens so far: the next one's position
        self._chain: Any = None
        self._draw: PositionDraw | None = None
        self._grammar: Any = None
        self._guard: TriggerGuard | None = None
        self._vocab = vocab
        self._candidates = candidates
        self.error = ""
        self.error_field = ""
        if constraint is not None:
            self._grammar = init_grammar(
                vocab, constraint.gbnf, constraint.root, constraint.triggers
            )
            if constraint.triggers:
                self._guard = TriggerGuard(constraint.triggers, constraint.starts)
            if not self._grammar:
                self._grammar = None
                self.error = "the grammar could not be compiled"
                return
        is_plain = params.is_greedy and not params.has_penalties and not params.logit_bias
        if constraint is not None or not is_plain:
            self._chain, self._draw = _chain(params, seed, n_vocab)
        for i, token in enumerate(resumed):
            if not self._resume(token):
                self.error = f"the constraint does not allow resumed token {token} here"
                self.error_field = f"{RESUME_FIELD}[{i}]"
                return

    def _resume(self, token: int) -> bool:
        """Take a resumed token as if this sampler had just produced it (sampled, or forced by
        the reasoning budget); False when the constraint refuses it."""
        budget = self._budget
        if budget is not None and not budget.is_done:
            forced = budget.forced()
            if forced is not None and forced != token:
                self._budget = None  # the grammar had refused the forced end: it was dropped
        if not self._take(token):
            return False
        self._observe(token)
        self._position += 1
        return True

    def _observe(self, token: int) -> int:
        if self._budget is not None and token != NO_TOKEN:
            self._budget.observe(token_piece(self._vocab, token))
        return token

    @property
    def is_plain_greedy(self) -> bool:
        """An argmax of the logits row, nothing else (the runner may hand in the row)."""
        return self._chain is None and self._grammar is None and not self.error

    def sample(
        self,
        ctx: Any,
        batch_index: int,
        row: np.ndarray[Any, np.dtype[np.float32]] | None = None,
    ) -> int:
        """Sample from the logits of `batch_index`, which must be an output of the last decode
        (a plain greedy sampler takes its argmax from `row`, that output's logits, when given).
        llama_sampler_sample accepts the token itself; never accept it again. While a
        reasoning budget forces the end of thinking, the forced token is taken instead."""
        if self.error:
            return NO_TOKEN
        if self._draw is not None:
            self._draw.position = self._position
        budget = self._budget
        if budget is None or budget.is_done:
            token = self._sample(ctx, batch_index, row)
        else:
            forced = budget.forced()
            if forced is None or not self._accept_forced(forced):
                token = self._observe(self._sample(ctx, batch_index, row))
            else:
                token = self._observe(forced)
        if self._draw is not None and self._draw.failure:
            self.error = self._draw.failure
            return NO_TOKEN
        if token != NO_TOKEN:
            self._position += 1
        return token

    def _accept_forced(self, token: int) -> bool:
        """Take `token` as if sampled (the chain's penalties, the grammar, min_tokens see it);
        False, and the budget dropped, when an active grammar refuses it (llama.cpp aborts on a
        refused accept: never)."""
        if not self._take(token):
            self._budget = None
            return False
        return True

    def _take(self, token: int) -> bool:
        """`token` told to the grammar (when it allows it: False otherwise, nothing told) and
        to the chain, and counted for min_tokens."""
        grammar = self._grammar
        if grammar is not None:
            guard = self._guard
            if guard is not None and guard.is_awaiting:
                piece = token_piece(self._vocab, token)
                if not guard.allows(piece):
                    return False
                guard.accept(piece)
            elif self._candidates is None or not self._candidates.allows(grammar, token):
                return False
            llama_cpp.llama_sampler_accept(grammar, token)
        if self._chain is not None:
            llama_cpp.llama_sampler_accept(self._chain, token)
        self._num_sampled += 1
        return True

    def _sample(
        self,
        ctx: Any,
        batch_index: int,
        row: np.ndarray[Any, np.dtype[np.float32]] | None,
    ) -> int:
        if self._num_sampled < self._min_tokens:
            self._num_sampled += 1
            # the row is the context's own logits buffer, which every path below reads
            if row is None:
                row = _row(ctx, batch_index, self._n_vocab)
            row[self._suppressed] = -math.inf
        if self._grammar is not None:
            return self._sample_constrained(ctx, batch_index)
        if self._chain is None:
            if row is None:
                row = _row(ctx, batch_index, self._n_vocab)
            return int(row.argmax())
        return int(llama_cpp.llama_sampler_sample(self._chain, ctx, batch_index))

    def _sample_constrained(self, ctx: Any, batch_index: int) -> int:
        cand, grammar = self._candidates, self._grammar
        if cand is None:
            raise RuntimeError("a constrained sampler needs Candidates")
        row = _row(ctx, batch_index, self._n_vocab)
        cand.load(row)
        llama_cpp.llama_sampler_apply(self._chain, cand.ref)
        token = cand.selected
        guard = self._guard
        if guard is not None and guard.is_awaiting:
            token = self._guarded(guard, row, token)
            if token == NO_TOKEN:
                self.error = _DEAD_END
                return NO_TOKEN
            guard.accept(token_piece(self._vocab, token))
        elif token == NO_TOKEN or not cand.allows(grammar, token):
            cand.load(row)
            llama_cpp.llama_sampler_apply(grammar, cand.ref)
            is_any_allowed = cand.has_allowed
            if is_any_allowed:
                llama_cpp.llama_sampler_apply(self._chain, cand.ref)
                token = cand.selected
            if not is_any_allowed or token == NO_TOKEN or not cand.allows(grammar, token):
                self.error = _DEAD_END
                return NO_TOKEN
        llama_cpp.llama_sampler_accept(grammar, token)
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def _guarded(
        self, guard: TriggerGuard, row: np.ndarray[Any, np.dtype[np.float32]], token: int
    ) -> int:
        """The chain's choice, or its next choice without the tokens the guard refused (the
        lazy grammar masks nothing yet, so the chain alone decides)."""
        cand, refused = self._candidates, []
        if cand is None:
            raise RuntimeError("a constrained sampler needs Candidates")
        while token != NO_TOKEN and not guard.allows(token_piece(self._vocab, token)):
            refused.append(token)
            if len(refused) > MAX_GUARD_REFUSALS:
                return NO_TOKEN
            cand.load(row)
            cand.data["logit"][refused] = -math.inf
            llama_cpp.llama_sampler_apply(self._chain, cand.ref)
            token = cand.selected
        return token

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)  # its PositionDraw's sampler too
            self._chain = None
        self._draw = None
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None


def logits_rows(ctx: Any, n_outputs: int, n_vocab: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Every logits row of the last decode, one per output in batch order (llama_get_logits):
    one view per tick instead of a llama_get_logits_ith call and a view per row."""
    pointer = llama_cpp.llama_get_logits(ctx)
    view: np.ndarray[Any, np.dtype[np.float32]] = np.ctypeslib.as_array(
        pointer, shape=(n_outputs, n_vocab)
    )
    return view


def _row(ctx: Any, batch_index: int, n_vocab: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    pointer = llama_cpp.llama_get_logits_ith(ctx, batch_index)
    view: np.ndarray[Any, np.dtype[np.float32]] = np.ctypeslib.as_array(pointer, shape=(n_vocab,))
    return view


def _chain(params: SamplingParams, seed: int, n_vocab: int) -> tuple[Any, PositionDraw | None]:
    """The request's chain, and its PositionDraw (None for a greedy chain)."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = llama_cpp.llama_sampler_chain_add
    if params.logit_bias:
        add(chain, _logit_bias_sampler(params.logit_bias, n_vocab))
    if params.has_penalties:
        add(
            chain,
            llama_cpp.llama_sampler_init_penalties(
                n_vocab,
                params.penalty_last_n,
                params.repeat_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            ),
        )
    if params.is_greedy:
        add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain, None
    if params.top_k > 0:
        add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
    position_draw = PositionDraw(seed)
    add(chain, position_draw.sampler)
    return chain, position_draw


def _logit_bias_sampler(bias: tuple[tuple[int, float], ...], n_vocab: int) -> Any:
    """llama.cpp copies the array, so it may go out of scope after init."""
    entries = (llama_cpp.llama_logit_bias * len(bias))()
    for entry, (token, value) in zip(entries, bias, strict=True):
        entry.token, entry.bias = token, value
    return llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(bias), entries)
