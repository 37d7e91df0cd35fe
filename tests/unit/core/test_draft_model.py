"""Draft-model speculation, the pure parts (core.speculation.draft_model): the vocabulary check,
keeping a slot's draft KV in step (what is removed, what is fed), the draft pass's feed batches,
the drafted token's cost; and the Speculator with a fake draft model: ON drafts with it, AUTO
weighs its drafting cost and picks it, the lookup or nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from llama_grpc_server.core.requests.request import (
    GenerationRequest,
    Request,
    SamplingParams,
    SpeculativeMode,
    SpeculativeParams,
    StoppingParams,
)
from llama_grpc_server.core.scheduling.plan import Chunk
from llama_grpc_server.core.speculation.draft_model import (
    DraftCosts,
    DraftPass,
    DraftWant,
    VocabView,
    catch_up,
    common_prefix,
    feed_passes,
    vocab_mismatch,
)
from llama_grpc_server.core.speculation.policy import DraftOption, choose_drafts
from llama_grpc_server.core.speculation.speculator import MODEL, MODEL_PRIOR, Speculator
from tests.support.speculative import BOX

# -- the vocabulary check ------------------------------------------------------------------------

TEXTS = [b"<pad>", b"<s>", b"</s>", b"a", b"b", b"ab"]
SPECIAL = {"bos": 1, "eos": 2, "pad": 0, "add_bos": 1}


def vocab(texts: Sequence[bytes] = TEXTS, **special: int) -> VocabView:
    return VocabView(len(texts), list(texts), {**SPECIAL, **special})


def test_the_same_vocabulary_agrees() -> None:
    assert vocab_mismatch(vocab(), vocab()) is None


def test_a_token_count_that_differs_is_named_first() -> None:
    problem = vocab_mismatch(vocab(), vocab([*TEXTS, b"c"], bos=3))
    assert problem == "n_vocab differs: target 6, draft 7"


def test_a_special_id_that_differs_is_named() -> None:
    assert vocab_mismatch(vocab(), vocab(eos=5)) == "special token eos differs: target 2, draft 5"
    assert vocab_mismatch(vocab(), vocab(eot=4)) == "special token eot differs: target -1, draft 4"


def test_the_first_token_text_that_differs_is_named() -> None:
    other = [*TEXTS[:3], b"x", b"y", TEXTS[5]]
    assert vocab_mismatch(vocab(), vocab(other)) == "token 3 differs: target b'a', draft b'x'"


# -- keeping in step -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        ([], [1, 2], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 5, 6, 7, 8], 3),
        ([5], [1], 0),
        (list(range(1000)), [*range(617), -1, *range(618, 1000)], 617),
    ],
)
def test_common_prefix(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix(a, b) == common_prefix(b, a) == n


def test_a_slot_the_draft_never_saw_feeds_every_token() -> None:
    assert catch_up([], [1, 2, 3]) == (0, (1, 2, 3))


def test_after_a_draft_all_accepted_the_last_draft_token_and_the_bonus_are_fed() -> None:
    """The draft KV holds the tokens and d1 .. d(k-1) (dk was drafted, never fed); the target
    accepted all k and sampled one more."""
    tokens, draft = [1, 2, 3], [7, 8, 9]
    held = tokens + draft[:-1]
    assert catch_up(held, [*tokens, *draft, 4]) == (5, (9, 4))


def test_after_a_rejection_the_rejected_tail_is_removed() -> None:
    """d1 accepted, d2 rejected (the target sampled 5 instead): keep tokens + d1, remove d2,
    feed 5."""
    assert catch_up([1, 2, 3, 7, 8], [1, 2, 3, 7, 5]) == (4, (5,))


def test_another_request_in_the_slot_keeps_only_the_shared_prefix() -> None:
    """Cancel, preemption, a new request whose prefix the target restored from a tier: only the
    tokens both hold from position 0 are kept."""
    assert catch_up([1, 2, 3, 4, 5, 6], [1, 2, 9, 9]) == (2, (9, 9))
    assert catch_up([1, 2, 3], [4, 5]) == (0, (4, 5))


def test_a_slot_whose_tokens_the_draft_already_holds_feeds_its_last_token_again() -> None:
    """Its logits are what drafts: a draft KV holding all of the tokens (or more, as after a
    resume with fewer) gives up the last one to feed it."""
    assert catch_up([1, 2, 3], [1, 2, 3]) == (2, (3,))
    assert catch_up([1, 2, 3, 4], [1, 2]) == (1, (2,))


def test_feed_passes_split_a_long_catch_up_across_batches() -> None:
    chunks = [Chunk(0, "", 0, tuple(range(10)), True), Chunk(1, "", 4, (1, 2, 3), True)]
    passes = feed_passes(chunks, 4)
    assert [[(c.slot_id, c.start_pos, c.tokens, c.wants_logits) for c in p] for p in passes] == [
        [(0, 0, (0, 1, 2, 3), False)],
        [(0, 4, (4, 5, 6, 7), False)],
        [(0, 8, (8, 9), True), (1, 4, (1, 2), False)],
        [(1, 6, (3,), True)],
    ]


def test_feed_passes_of_small_feeds_are_one_batch() -> None:
    chunks = [Chunk(s, "", 5, (s,), True) for s in range(3)]
    assert feed_passes(chunks, 512) == [chunks]


def test_a_drafted_tokens_cost_follows_the_passes_within_limits() -> None:
    costs = DraftCosts()
    assert costs.token_ms is None
    costs.calibrate(10.0)
    costs.observe(4, 48.0)  # 12 ms a token
    assert costs.token_ms == pytest.approx(10.4)
    costs.observe(1, 2000.0)  # a long catch-up: counted as 3x at most
    assert costs.token_ms == pytest.approx(10.4 + 0.2 * (31.2 - 10.4))


# -- the policy's drafting cost ------------------------------------------------------------------


def test_a_draft_models_cost_per_token_counts_against_its_drafts() -> None:
    """At the box's costs a sure draft of 3 pays when drafting is free, and not when each token
    costs as much as a decode of one row."""
    sure = DraftOption(0, 3, 1.0, p_next=1.0)
    assert choose_drafts(1, [sure], BOX.get, 8) == {0: 3}
    dear = DraftOption(0, 3, 1.0, p_next=1.0, token_ms=BOX[1])
    assert choose_drafts(1, [dear], BOX.get, 8) == {}


# -- the Speculator with a draft model -----------------------------------------------------------


@dataclass
class FakeDraft:
    """Drafts token 100 + i at draft position i; remembers what it was asked."""

    asked: list[list[DraftWant]] = field(default_factory=list)
    ms: float = 1.0

    def draft(self, wants: Sequence[DraftWant]) -> DraftPass:
        self.asked.append(list(wants))
        drafts = {w.slot_id: tuple(100 + i for i in range(w.k)) for w in wants}
        return DraftPass(drafts, ms=self.ms * sum(w.k for w in wants))


def request(slot_id: int, mode: SpeculativeMode, prompt: Sequence[int] = (1, 2, 3)) -> Request:
    stop = StoppingParams(max_tokens=40)
    r = Request(
        GenerationRequest(
            f"r{slot_id}",
            tuple(prompt),
            SamplingParams(),
            stop,
            speculative=SpeculativeParams(mode, draft_max=4),
        )
    )
    r.slot_id = slot_id
    return r


def speculator(token_ms: float) -> tuple[Speculator, FakeDraft]:
    drafter = FakeDraft(ms=token_ms)
    spec = Speculator(drafter=drafter)
    spec.costs.calibrate(BOX.items())
    spec.draft_costs.calibrate(token_ms)
    return spec, drafter


def test_on_drafts_with_the_draft_model_for_every_stream_in_one_pass() -> None:
    spec, drafter = speculator(5.0)
    requests = [request(s, SpeculativeMode.ON) for s in range(3)]
    drafts = spec.propose(requests, num_rows=3, room=64, n_ctx=4096, has_prefill=True)
    assert drafts == dict.fromkeys(range(3), (100, 101, 102, 103))
    assert len(drafter.asked) == 1
    assert [(w.slot_id, list(w.tokens), w.k) for w in drafter.asked[0]] == [
        (s, [1, 2, 3], 4) for s in range(3)
    ]


def test_verified_model_drafts_teach_the_request_and_the_servers_estimate() -> None:
    spec, _ = speculator(5.0)
    r = request(0, SpeculativeMode.ON)
    spec.propose([r], num_rows=1, room=64, n_ctx=4096, has_prefill=False)
    assert spec.verified(r, 4, 1) is True
    assert spec._states[r.key].of(MODEL).n == 1
    assert spec.model_acceptance.n == 1
    assert spec.model_acceptance.p > MODEL_PRIOR  # the first token was accepted
    # a later request starts from the server's estimate
    later = request(1, SpeculativeMode.AUTO)
    spec.propose([later], num_rows=1, room=64, n_ctx=4096, has_prefill=False)
    assert spec._states[later.key].of(MODEL).p == spec.model_acceptance.p


def test_auto_picks_none_when_drafting_costs_as_much_as_the_target() -> None:
    """A draft model as dear per token as the target's one-row decode (a model drafting for
    itself) never pays: AUTO drafts nothing and runs no draft pass."""
    spec, drafter = speculator(BOX[1])
    r = request(0, SpeculativeMode.AUTO)
    assert spec.propose([r], num_rows=1, room=64, n_ctx=4096, has_prefill=False) == {}
    assert drafter.asked == []


def test_auto_picks_a_cheap_draft_model_once_its_acceptance_is_high() -> None:
    spec, drafter = speculator(0.5)
    spec.model_acceptance.p = spec.model_acceptance.p_next = 0.95
    r = request(0, SpeculativeMode.AUTO)
    drafts = spec.propose([r], num_rows=1, room=64, n_ctx=4096, has_prefill=False)
    assert drafts and drafts[0] == tuple(100 + i for i in range(len(drafts[0])))
    assert len(drafter.asked) == 1


def test_auto_prefers_a_free_lookup_to_an_equally_good_draft_model() -> None:
    """A request copying its prompt: its long lookup is as likely as the draft model's draft and
    costs nothing to make."""
    spec, drafter = speculator(2.0)
    spec.model_acceptance.p = spec.model_acceptance.p_next = 0.8
    gram = [10, 11, 12, 13]
    r = request(0, SpeculativeMode.AUTO, [*gram, *range(20, 36), 5, *gram])
    drafts = spec.propose([r], num_rows=1, room=64, n_ctx=4096, has_prefill=False)
    assert drafts and drafts[0][0] == 20
    assert drafter.asked == []


def test_auto_never_drafts_with_the_model_beside_a_prompt_chunk() -> None:
    spec, drafter = speculator(0.5)
    spec.model_acceptance.p = spec.model_acceptance.p_next = 0.95
    r = request(0, SpeculativeMode.AUTO)
    assert spec.propose([r], num_rows=1, room=64, n_ctx=4096, has_prefill=True) == {}
    assert drafter.asked == []
