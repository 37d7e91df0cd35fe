"""Per-request samplers: a llama_sampler chain built from SamplingParams (logit bias first), or a
numpy argmax fast path for plain greedy requests (0.04 ms vs 0.44 ms per token for 262k tokens).
A grammar-constrained request keeps its grammar sampler outside the chain: the chain proposes a
token, the grammar checks just that one, and only when it is refused does the grammar mask the
whole vocabulary (llama.cpp's own trick: a full mask costs milliseconds at 262k tokens). The
grammar is only ever told about tokens it allowed, so llama.cpp never aborts on it. A lazy
grammar (a structural tag) allows everything until its trigger, so before it a
core.constrained.structural_tag.TriggerGuard vets the token instead: the one that sets the grammar
off must hand it text it accepts (llama.cpp replays that text unchecked and aborts on a refusal)."""

from __future__ import annotations

import ctypes
import math
from typing import Any

import llama_cpp
import numpy as np

from llama_grpc_server.core.constrained.structural_tag import TriggerGuard
from llama_grpc_server.core.reasoning.budget import ReasoningParams, ThinkingBudget
from llama_grpc_server.core.requests.request import Constraint, SamplingParams
from llama_grpc_server.engine.grammar import init_grammar, token_piece

NO_TOKEN = -1
_DEAD_END = "the grammar allows no token here that the sampler can pick (logit_bias may ban them)"
# Before a lazy grammar's trigger: how many proposed tokens the guard may refuse in one step
# before the request fails (each refusal re-runs the chain without that token; a refusal needs a
# token that completes a trigger and goes on with other text in its own piece, so one is rare).
MAX_GUARD_REFUSALS = 64
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


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
    """One request's sampler state (penalty history, RNG, grammar). Free with close().
    sample() returns NO_TOKEN (with `error` set) when a constraint allows no token at all."""

    __slots__ = (
        "_budget",
        "_candidates",
        "_chain",
        "_grammar",
        "_guard",
        "_min_tokens",
        "_n_vocab",
        "_num_sampled",
        "_suppressed",
        "_vocab",
        "error",
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
    ) -> None:
        self._n_vocab = n_vocab
        # a reasoning budget: the end of thinking is forced once it is spent (needs `vocab`)
        has_budget = reasoning is not None and reasoning.budget is not None
        self._budget = ThinkingBudget(reasoning) if has_budget and reasoning else None
        # min_tokens: `suppressed` get -inf logits until this many tokens have been sampled
        self._min_tokens = min_tokens if suppressed else 0
        self._suppressed = np.array(suppressed, dtype=np.int64)
        self._num_sampled = 0
        self._chain: Any = None
        self._grammar: Any = None
        self._guard: TriggerGuard | None = None
        self._vocab = vocab
        self._candidates = candidates
        self.error = ""
        if constraint is not None:
            self._grammar = init_grammar(
                vocab, constraint.gbnf, constraint.root, constraint.triggers
            )
            if constraint.triggers:
                self._guard = TriggerGuard(constraint.triggers, constraint.starts)
            if not self._grammar:
                self._grammar = None
                self.error = "the grammar could not be compiled"
        elif params.is_greedy and not params.has_penalties and not params.logit_bias:
            return
        self._chain = _chain(params, seed, n_vocab)

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
        budget = self._budget
        if budget is None or budget.is_done:
            return self._sample(ctx, batch_index, row)
        forced = budget.forced()
        if forced is None or not self._accept_forced(forced):
            return self._observe(self._sample(ctx, batch_index, row))
        return self._observe(forced)

    def _accept_forced(self, token: int) -> bool:
        """Take `token` as if sampled (the chain's penalties, the grammar, min_tokens see it);
        False, and the budget dropped, when an active grammar refuses it (llama.cpp aborts on a
        refused accept: never)."""
        grammar = self._grammar
        if grammar is not None:
            guard = self._guard
            if guard is not None and guard.is_awaiting:
                piece = token_piece(self._vocab, token)
                if not guard.allows(piece):
                    self._budget = None
                    return False
                guard.accept(piece)
            elif self._candidates is None or not self._candidates.allows(grammar, token):
                self._budget = None
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
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
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


def _chain(params: SamplingParams, seed: int, n_vocab: int) -> Any:
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
        return chain
    if params.top_k > 0:
        add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
    add(chain, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return chain


def _logit_bias_sampler(bias: tuple[tuple[int, float], ...], n_vocab: int) -> Any:
    """llama.cpp copies the array, so it may go out of scope after init."""
    entries = (llama_cpp.llama_logit_bias * len(bias))()
    for entry, (token, value) in zip(entries, bias, strict=True):
        entry.token, entry.bias = token, value
    return llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(bias), entries)
