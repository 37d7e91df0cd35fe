"""Speculator: speculative decoding for the scheduler, by prompt lookup (n-gram) and, with
--draft-model, by a draft model. Per request it keeps an n-gram index over the request's own
tokens (core.speculation.ngram) and acceptance estimates; per tick it proposes drafts for the
decoding slots (mode ON: the draft model's when there is one, else whatever the lookup finds;
AUTO: per request the lookup, the draft model or nothing, whichever core.speculation.policy says
pays at the measured tick costs, the draft model's drafting cost counted against it) and learns
from what the runner verified. The draft model drafts for all its slots in one batched pass
(DraftSource: engine/draft.py), inside the tick, before the target's pass verifies the drafts
beside the other streams' rows exactly as it verifies lookups.

AUTO also drafts in the shadow: a draft it did not send is compared with the tokens generated
next, so a request's acceptance stays measured while it does not speculate (a request that starts
to repeat its input starts to speculate; one that stops, stops) without spending a forward pass
on probes. Pure Python; used by the Scheduler on the engine thread only."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from llama_grpc_server.core.requests.request import (
    MAX_DRAFT_TOKENS,
    Request,
    SpeculativeConfig,
    SpeculativeMode,
)
from llama_grpc_server.core.speculation.draft_model import DraftCosts, DraftSource, DraftWant
from llama_grpc_server.core.speculation.ngram import NgramIndex
from llama_grpc_server.core.speculation.policy import (
    ACCEPT_PRIOR,
    Acceptance,
    DraftOption,
    TickCostModel,
    choose_drafts,
)

MAX_SHADOWS = 4  # shadow drafts of one request waiting to be settled at most
# A draft found by a suffix match of at least this many tokens is "long": such drafts are far
# likelier to be right (measured on bench/speculative.py's outputs: the first token of a draft
# matched on 8 tokens was accepted 97 % of the time and 12.4 of 16 tokens on average; matched
# on 1-2 tokens, 53 % and 1.5-3), so a request keeps one acceptance estimate for each kind.
# A third kind is a draft whose suffix was ambiguous, followed by other tokens elsewhere in the
# request's tokens: its first token was accepted 0-50 % of the time when matched on 2 tokens,
# 28-84 % on 4, against 65-100 % and 93-100 % for one whose suffix always had the same follower
# (drafts of bench/speculative.py's outputs and two sets of 8 other prompts).
LONG_MATCH = 3
LONG_PRIOR = 0.8  # a long draft's first-token acceptance before any evidence
LONG_PRIOR_NEXT = 0.9  # and its further tokens'
AMBIGUOUS_PRIOR = 0.3  # an ambiguous draft's first-token acceptance before any evidence
# A draft model's drafts: no shadow can measure them for free, so a request starts from the
# server's estimate for the draft model (every request's verified model drafts), itself starting
# from this prior: a draft model made for its target is accepted 0.6-0.8 of the time on code
# (llama-server's reports for Qwen 2.5 Coder 0.5B -> 1.5B), and AUTO tries it where it would pay
# at that rate.
MODEL_PRIOR = 0.7
# a draft's kind, each with its own acceptance estimate: lookups', and the draft model's
SHORT, LONG, AMBIGUOUS, MODEL = range(4)


@dataclass(slots=True)
class _State:
    """One speculating request's drafter and what it learned."""

    config: SpeculativeConfig
    index: NgramIndex
    # one acceptance estimate per kind of lookup, indexed by SHORT, LONG, AMBIGUOUS
    estimates: tuple[Acceptance, Acceptance, Acceptance, Acceptance] = field(
        default_factory=lambda: (
            Acceptance(),
            Acceptance(LONG_PRIOR, LONG_PRIOR_NEXT),
            Acceptance(AMBIGUOUS_PRIOR),
            Acceptance(MODEL_PRIOR, MODEL_PRIOR),
        )
    )
    # Drafts not sent, waiting for the tokens they predicted: (draft, where in the request's
    # tokens its first token would be, its kind, whether its first token was learned from).
    shadows: list[tuple[tuple[int, ...], int, int, bool]] = field(default_factory=list)
    # What this tick's draft is: NgramIndex.filler's padding (learned from by nobody), a
    # lookup of a kind (SHORT, LONG, AMBIGUOUS) or the draft model's (MODEL).
    is_filler: bool = False
    kind: int = SHORT

    def of(self, kind: int) -> Acceptance:
        return self.estimates[kind]

    def option(self, slot_id: int, length: int, is_forced: bool) -> DraftOption:
        """This tick's lookup as a draft option, with its kind's estimates. Those of a long or
        ambiguous lookup that no verification has moved yet are their priors scaled down by how
        the request's short lookups fared against theirs: in free writing short lookups fail
        (p 0.13-0.36 after 3-5 of them in the sampled control of bench/speculative.py) and so
        did the first long drafts, 11-15 tokens with one token or none accepted; a request that
        copies its input drafts long before any short lookup is settled. A copy that starts
        after failed short lookups drafts once its first long lookup has settled p_next, which
        a shadow does only when one of its tokens differs or all are there (up to draft_max
        tokens later): settling its further tokens one by one as they agree started such copies
        at once, but replayed worse on the tuning set (quoting QA 1.06 -> 0.92 at the x86-64-v3
        costs), the overlapping shadows of consecutive ticks then counting the same tokens as
        evidence several times over."""
        own = self.estimates[self.kind]
        p, p_next = own.p, own.p_next
        short = self.estimates[SHORT]
        if self.kind in (LONG, AMBIGUOUS) and short.n > 0:
            factor = min(1.0, short.p / ACCEPT_PRIOR)
            if own.n == 0:
                p *= factor
            if own.n_next == 0:
                p_next *= factor
        return DraftOption(slot_id, length, p, is_forced, p_next)


class Speculator:
    """The scheduler's speculation: drafts per tick, per-request state, the tick cost model."""

    def __init__(
        self, defaults: SpeculativeConfig | None = None, drafter: DraftSource | None = None
    ) -> None:
        self.defaults = defaults if defaults is not None else SpeculativeConfig()
        self.costs = TickCostModel()
        self._states: dict[str, _State] = {}
        self.drafter = drafter  # the draft model (--draft-model), None without one
        self.draft_costs = DraftCosts()  # its measured cost per drafted token
        self.model_acceptance = Acceptance(MODEL_PRIOR, MODEL_PRIOR)  # every request's
        self.model_ms = 0.0  # milliseconds spent in draft passes (GetStats' decode time)
        self.model_cpu_ms = 0.0

    def mode(self, request: Request) -> SpeculativeMode:
        asked = request.spec.speculative.mode
        return self.defaults.mode if asked is None else asked

    def propose(
        self,
        requests: Sequence[Request],
        *,
        num_rows: int,
        room: int,
        n_ctx: int,
        has_prefill: bool,
    ) -> dict[int, tuple[int, ...]]:
        """slot_id -> draft tokens for this tick's decoding requests that speculate. num_rows:
        the tick's decode rows (theirs and the others'); room: draft tokens the batch and the
        KV cache can take. AUTO drafts only in a tick without prompt chunks (its cost model is
        of decode-only ticks); ON drafts in any. The draft model's drafts are made here, in one
        batched draft pass for every request that takes one."""
        found: dict[int, tuple[int, ...]] = {}
        fillers: dict[int, tuple[int, ...]] = {}
        by_model: dict[int, Request] = {}
        options: list[DraftOption] = []
        states: list[tuple[Request, _State, tuple[int, ...], int]] = []
        token_ms = self.draft_costs.token_ms if self.drafter is not None else None
        for request in requests:
            state = self._state(request)
            if state is None:
                continue
            cap = min(
                state.config.draft_max,
                request.spec.stopping.max_tokens - request.num_output - 1,
                n_ctx - len(request.tokens),
            )
            draft, matched, is_ambiguous = state.index.lookup(request.tokens, cap)
            kind = AMBIGUOUS if is_ambiguous else LONG if matched >= LONG_MATCH else SHORT
            states.append((request, state, draft, kind))
            state.kind = kind
            is_forced = state.config.mode is SpeculativeMode.ON
            lookup = state.option(request.slot_id, len(draft), is_forced) if draft else None
            if token_ms is not None and cap > 0 and (is_forced or not has_prefill):
                state.kind = MODEL
                model = state.option(request.slot_id, cap, is_forced)
                model = dataclasses.replace(model, token_ms=token_ms)
                if (
                    is_forced
                    or lookup is None
                    or self._rate(model, num_rows) > self._rate(lookup, num_rows)
                ):
                    by_model[request.slot_id] = request
                    options.append(model)
                    continue
                state.kind = kind
            if draft:
                found[request.slot_id] = draft
                if is_forced or not has_prefill:
                    options.append(lookup)  # type: ignore[arg-type]  # set with draft
            elif cap > 0 and not is_forced and not has_prefill:
                # nothing to look up: a guess, sent only where one row more makes the tick cheaper
                fillers[request.slot_id] = (state.index.filler(request.tokens),)
                options.append(DraftOption(request.slot_id, 1, 0.0))
        chosen = choose_drafts(num_rows, options, self.costs.tick_ms, room) if options else {}
        for request, state, draft, kind in states:
            state.is_filler = request.slot_id in fillers and request.slot_id in chosen
            is_sent = request.slot_id in found and chosen.get(request.slot_id)
            if draft and not is_sent and len(state.shadows) < MAX_SHADOWS:
                state.shadows.append((draft, len(request.tokens), kind, False))
        found.update(fillers)
        wants = [
            DraftWant(slot_id, request.tokens, chosen[slot_id])
            for slot_id, request in by_model.items()
            if chosen.get(slot_id, 0) > 0
        ]
        if wants and self.drafter is not None:
            made = self.drafter.draft(wants)
            self.draft_costs.observe(made.num_drafted, made.ms)
            self.model_ms += made.ms
            self.model_cpu_ms += made.cpu_ms
            found.update(made.drafts)
        return {
            slot_id: found[slot_id][:k]
            for slot_id, k in chosen.items()
            if k > 0 and found.get(slot_id)
        }

    def _rate(self, option: DraftOption, num_rows: int) -> float:
        """The best expected tokens per millisecond of one request's option, alone: how AUTO
        picks between a request's lookup and the draft model."""
        best = 0.0
        value = 1.0
        for j in range(1, option.max_len + 1):
            value += option.gain(j)
            ms = self.costs.tick_ms(num_rows + j)
            if ms is not None and ms > 0:
                best = max(best, value / (ms + j * option.token_ms))
        return best

    def _state(self, request: Request) -> _State | None:
        state = self._states.get(request.key)
        if state is not None:
            return state
        if self.mode(request) is SpeculativeMode.OFF:
            return None
        asked = request.spec.speculative.resolve(self.defaults)
        ngram_min = max(1, asked.ngram_min)  # validated at the edge; never trusted here
        ngram_max = max(ngram_min, asked.ngram_max)
        draft_max = max(0, min(MAX_DRAFT_TOKENS, asked.draft_max))
        config = SpeculativeConfig(asked.mode, draft_max, ngram_min, ngram_max)
        state = _State(config, NgramIndex(ngram_min, ngram_max))
        shared = self.model_acceptance
        state.estimates[MODEL].p, state.estimates[MODEL].p_next = shared.p, shared.p_next
        self._states[request.key] = state
        return state

    def verified(self, request: Request, num_draft: int, num_accepted: int) -> bool:
        """The runner verified a draft of the request's: num_accepted of num_draft agreed. A
        filler's outcome says nothing about the request's lookups and is not learned from.
        True when it was the draft model's (also learned by the server's estimate)."""
        state = self._states.get(request.key)
        if state is None or state.is_filler:
            return False
        state.of(state.kind).record(num_accepted, num_draft)
        if state.kind == MODEL:
            self.model_acceptance.record(num_accepted, num_draft)
        return state.kind == MODEL

    def observe_tokens(self, request: Request) -> None:
        """The request took new tokens: settle what they decide of the shadow drafts. A
        shadow's first token is learned from as soon as it is generated (a request whose lookups
        start to be right sees it at the next tick), its further tokens once one differs or all
        are there."""
        state = self._states.get(request.key)
        if state is None or not state.shadows:
            return
        tokens, waiting = request.tokens, []
        for shadow, start, kind, is_first_settled in state.shadows:
            got = tokens[start : start + len(shadow)]
            if not got:
                waiting.append((shadow, start, kind, is_first_settled))
                continue
            acceptance = state.of(kind)
            if not is_first_settled:
                acceptance.record_first(got[0] == shadow[0])
                if got[0] != shadow[0]:
                    continue
            n = 1
            while n < len(got) and got[n] == shadow[n]:
                n += 1
            if n < len(got) or len(got) == len(shadow):
                acceptance.record_further(n - 1, is_rejected=n < len(got))
            else:
                waiting.append((shadow, start, kind, True))
        state.shadows = waiting

    def acceptance(self, key: str) -> float | None:
        """A request's first-token acceptance estimate for its short lookups (None when it does
        not speculate)."""
        state = self._states.get(key)
        return state.of(SHORT).p if state is not None else None

    def forget(self, key: str) -> None:
        self._states.pop(key, None)
