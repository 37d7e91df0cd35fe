"""core.requests.embedding (pooling, dimensions, normalisation, a pass's share) and embedding
requests in the scheduler over the fake runner: their own passes, alternating with generation,
chunked, preempted, their KV cleared after; an encoder-only model's whole inputs and refused
generation (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from llama_grpc_server import errors
from llama_grpc_server.core.kv.events import Tier
from llama_grpc_server.core.requests import embedding
from llama_grpc_server.core.requests.embedding import EmbeddingParams, Pooling, Vectors
from llama_grpc_server.core.requests.request import (
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    Request,
)
from llama_grpc_server.core.scheduling.plan import Chunk, SeqOp, SeqOpKind, StepResult
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.engine.embedding import Embedder, pool
from llama_grpc_server.testing import FakeRunner
from tests.support.scheduler import PIECES, alone, drive, finals, make, outputs, req

ROWS = np.array([[3.0, 0.0, 0.0, 4.0], [1.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)


def embed_req(rid: str, tokens: tuple[int, ...], **params: object) -> Request:
    return Request(GenerationRequest(rid, tokens, embedding=EmbeddingParams(**params)))  # type: ignore[arg-type]


def expected(tokens: tuple[int, ...], params: EmbeddingParams) -> np.ndarray:
    return pool(FakeRunner.embedding_rows([], tokens), params)


def array_of(vectors: Vectors | None) -> np.ndarray:
    assert vectors is not None
    return np.array(vectors.rows(), dtype=np.float32)


@pytest.mark.parametrize(
    ("pooling", "want"),
    [
        (Pooling.MEAN, [[4 / 3, 2 / 3, 2 / 3, 4 / 3]]),
        (Pooling.CLS, [[3.0, 0.0, 0.0, 4.0]]),
        (Pooling.LAST, [[0.0, 0.0, 0.0, 0.0]]),
        (Pooling.NONE, ROWS.tolist()),
    ],
)
def test_pooling_without_normalisation(pooling: Pooling, want: list[list[float]]) -> None:
    """mean / cls / last / none of the per-token rows, unnormalised."""
    got = pool(ROWS, EmbeddingParams(pooling, normalize=False))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np.array(want, np.float32), rtol=1e-6)


def test_normalize_and_dimensions() -> None:
    """L2 per vector (a zero vector stays zero); dimensions truncates before normalising."""
    got = pool(ROWS, EmbeddingParams(Pooling.NONE))
    np.testing.assert_allclose(got[:2], [[0.6, 0, 0, 0.8], [1 / 3, 2 / 3, 2 / 3, 0]], rtol=1e-6)
    assert not got[2].any()
    short = pool(ROWS, EmbeddingParams(Pooling.CLS, dimensions=2))
    np.testing.assert_allclose(short, [[1.0, 0.0]])


def test_embedder_pools_an_input_fed_in_several_chunks() -> None:
    """The Embedder pools an input's rows once its last chunk is in, as if fed at once; a
    chunk at position 0 starts the input afresh (a preemption re-feeds it)."""
    params = EmbeddingParams()
    embedder = Embedder()

    def chunk(start: int, n: int) -> Chunk:
        tokens = tuple(range(start, start + n))
        return Chunk(0, "e", start, tokens, wants_logits=False, embedding=params, num_input=3)

    assert embedder.add(chunk(0, 1), ROWS[:1] * 9) is None
    assert embedder.add(chunk(0, 2), ROWS[:2]) is None  # preempted: fed again from 0
    got = embedder.add(chunk(2, 1), ROWS[2:])
    assert got is not None
    assert got.num_vectors == 1
    assert got.dimensions == 4
    np.testing.assert_array_equal(array_of(got), pool(ROWS, params))


def test_default_pooling_and_reranker() -> None:
    """The model's own pooling, else mean; a reranker's is no embedding."""
    assert embedding.default_pooling("cls") is Pooling.CLS
    assert embedding.default_pooling("last") is Pooling.LAST
    assert embedding.default_pooling("") is Pooling.MEAN
    assert embedding.default_pooling("none") is Pooling.MEAN
    assert not embedding.can_embed("rank")
    assert embedding.can_embed("")


def test_share_pass() -> None:
    """Oldest first, each up to chunk_size, within the budget."""
    assert embedding.share_pass([(2, 5), (0, 40), (1, 9)], 30, 16) == {2: 5, 0: 16, 1: 9}
    assert embedding.share_pass([(0, 40), (1, 9)], 20, 16) == {0: 16, 1: 4}


def test_pass_budget_from_measured_costs() -> None:
    """Alone: MAX_PASS_TOKENS. Beside streams: the tokens whose marginal cost (learned beside
    decode rows, from one token) is half a decode tick, within [MIN_PASS_TOKENS,
    MAX_PASS_TOKENS]; MIN_PASS_TOKENS until both are measured, whatever passes of embedding
    tokens alone cost (under MIN_COST_SAMPLE_TOKENS they teach nothing)."""
    costs = embedding.PassCosts()
    assert costs.budget(0.0, is_generating=False) == embedding.MAX_PASS_TOKENS
    costs.observe(2, 100.0)
    assert costs.token_ms == 0.0
    costs.observe(100, 50.0)
    assert costs.token_ms == 0.5
    assert costs.budget(40.0, is_generating=True) == embedding.MIN_PASS_TOKENS
    costs.observe(1, 0.5, is_marginal=True)  # 0.5 ms per token beside decode rows
    assert costs.budget(40.0, is_generating=True) == 40  # 20 ms of a 40 ms decode tick
    assert costs.budget(0.0, is_generating=True) == embedding.MIN_PASS_TOKENS
    assert costs.budget(10_000.0, is_generating=True) == embedding.MAX_PASS_TOKENS
    costs.observe(2, 2.0, is_marginal=True)  # 1 ms per token: a fifth of the way
    assert costs.marginal_ms == pytest.approx(0.6)
    assert costs.token_ms == 0.5


def test_embedding_request_gets_its_vectors_and_clears_its_kv() -> None:
    """An input longer than chunk_size is fed in several embedding passes; its vector is the
    one of all its rows at once; nothing is sampled and its slot keeps no cache."""
    s, runner = make(n_parallel=2, chunk=16), FakeRunner()
    tokens = tuple(range(5, 45))
    s.add(embed_req("e", tokens))
    events = drive(s, runner)
    done = finals(events)["e"]
    assert isinstance(done, Finished)
    assert done.reason is FinishReason.EMBEDDED
    np.testing.assert_allclose(
        array_of(done.embedding), expected(tokens, EmbeddingParams()), rtol=1e-6
    )
    assert done.usage.prompt_tokens == 40
    assert done.usage.completion_tokens == 0
    assert [len(p.chunks[0].tokens) for p in runner.plans if p.chunks] == [16, 16, 8]
    assert all(p.is_embedding for p in runner.plans if p.chunks)
    assert not runner.samplers
    assert not runner.kv[done.slot_id]
    assert all(not slot.idle_cache for slot in s.slots)


def test_decode_rows_ride_in_embedding_passes() -> None:
    """Beside a generating request, an embedding pass carries its decode row (sampled from the
    pass's logits) and never a prompt chunk: the prompt gets a generation pass of its own, then
    every pass is an embedding pass with the decode row, within the budget (nothing measured
    here: MIN_PASS_TOKENS). The stream's tokens are those it gets alone."""
    s, runner = make(n_parallel=3, chunk=16), FakeRunner()
    s.add(req("g", 20, 12))
    for i in range(2):
        s.add(embed_req(f"e{i}", tuple(range(10 + i, 18 + i))))
    events = drive(s, runner)
    passes = [p for p in runner.plans if p.chunks]
    for plan in passes:
        generation = [c for c in plan.chunks if c.embedding is None]
        if plan.is_embedding:
            assert all(c.is_decode for c in generation), "a prompt chunk in an embedding pass"
        else:
            assert all(c.embedding is None for c in plan.chunks)
    g_passes = [i for i, p in enumerate(passes) if any(c.request_id == "g" for c in p.chunks)]
    riding = [passes[i] for i in g_passes if passes[i].is_embedding]
    assert riding, "no decode row rode in an embedding pass"
    for plan in riding:
        assert sum(len(c.tokens) for c in plan.chunks if c.embedding) == (embedding.MIN_PASS_TOKENS)
    solo, solo_runner = make(n_parallel=1, chunk=16), FakeRunner()
    solo.add(req("g", 20, 12))
    assert outputs(events)["g"] == outputs(drive(solo, solo_runner))["g"]
    for i in range(2):
        got = finals(events)[f"e{i}"]
        assert isinstance(got, Finished)
        want = expected(tuple(range(10 + i, 18 + i)), EmbeddingParams())
        np.testing.assert_allclose(array_of(got.embedding), want, rtol=1e-6)


def test_embedding_cost_is_learned_beside_decode_rows() -> None:
    """A pass of embedding tokens alone teaches its time per token; a pass with decode rows
    teaches its time less a decode tick's (the fake runner's cost: 1 ms per token)."""
    s, runner = make(n_parallel=2, chunk=16), FakeRunner()
    runner.cost_ms = float
    s.add(embed_req("e", tuple(range(5, 45))))
    drive(s, runner)
    assert s.passes.embedding_costs.token_ms == pytest.approx(1.0)


def test_preempted_embedding_request_starts_its_rows_again() -> None:
    """A KV-full pass preempts the youngest request; an embedding request fed again from
    position 0 gets the same vector (its earlier rows are not pooled twice)."""
    s, runner = make(n_parallel=2, chunk=16, n_ctx=512), FakeRunner()
    runner.kv_cells = 50  # each fits alone (40 cells), not both
    s.add(req("g", 20, 20))
    s.add(embed_req("e", tuple(range(5, 45))))
    events = drive(s, runner)
    done = finals(events)["e"]
    assert isinstance(done, Finished)
    np.testing.assert_allclose(
        array_of(done.embedding), expected(tuple(range(5, 45)), EmbeddingParams())
    )
    assert s.counters.preemptions >= 1


def test_input_over_the_context_is_refused() -> None:
    """An input longer than n_ctx is refused at add with both numbers; one of n_ctx fits."""
    s = make(n_ctx=64)
    with pytest.raises(errors.PromptTooLong, match=r"input \(65 tokens\) exceeds the context"):
        s.add(embed_req("long", tuple(range(1, 66))))
    s.add(embed_req("fits", tuple(range(1, 65))))


def test_embedding_spec_never_uses_the_caches() -> None:
    """An embedding request neither reuses prefix KV nor goes to the response cache."""
    spec = GenerationRequest("e", (1, 2), embedding=EmbeddingParams())
    assert not spec.cache_prompt
    assert not spec.cache_response


def test_embedding_kv_is_never_announced_as_a_prefix() -> None:
    """The KV events (SubscribeKvEvents) never announce an embedding request's blocks: its KV
    is cleared when it ends, so a router must not route to it; a generation request's blocks
    are announced as before."""
    s, runner = make(n_parallel=2, chunk=16), FakeRunner()
    s.add(embed_req("e", tuple(range(5, 69))))
    s.add(req("g", 40, 4))
    while s.has_work:
        plan, _ = s.schedule()
        if plan is not None:
            s.update(plan, runner.execute(plan))
        s.publish_kv_events(0.0)
        held = s.kv.events.tiers[Tier.DEVICE].keys()
        embedding_slot = next(
            (x.slot_id for x in s.slots if x.request and x.request.spec.is_embedding), None
        )
        assert embedding_slot not in held
    assert s.kv.events.log.num_logged_blocks > 0  # g's prompt blocks were announced


def test_share_whole() -> None:
    """An encoder's pass: inputs whole, in order, each that fits; the first always goes."""
    assert embedding.share_whole([(2, 5), (0, 40), (1, 9)], 64) == {2: 5, 0: 40, 1: 9}
    assert embedding.share_whole([(2, 5), (0, 60), (1, 9)], 64) == {2: 5, 1: 9}
    assert embedding.share_whole([(0, 64), (1, 1)], 64) == {0: 64}


def encoder(n_ctx: int = 64) -> Scheduler:
    """A scheduler of an encoder-only model as engine/build.py makes it: the batch and the
    chunk are the context."""
    limits = SchedulerLimits(3, n_ctx, n_ctx, n_ctx, 8, encoder="bert")
    return Scheduler(limits, pieces=PIECES, eog_ids=frozenset())


def test_encoder_feeds_each_input_whole_in_one_pass() -> None:
    """Inputs of 40, 30 and 20 tokens on a 64-token encoder: never split, never more than the
    pass holds (40 | 20 then 30), each vector that of all its rows."""
    s, runner = encoder(), FakeRunner()
    inputs = {"a": tuple(range(5, 45)), "b": tuple(range(7, 37)), "c": tuple(range(3, 23))}
    for rid, tokens in inputs.items():
        s.add(embed_req(rid, tokens))
    events = drive(s, runner)
    passes = [[(c.request_id, c.start_pos, len(c.tokens)) for c in p.chunks] for p in runner.plans]
    assert [p for p in passes if p] == [[("a", 0, 40), ("c", 0, 20)], [("b", 0, 30)]]
    for rid, tokens in inputs.items():
        got = finals(events)[rid]
        assert isinstance(got, Finished)
        np.testing.assert_allclose(array_of(got.embedding), expected(tokens, EmbeddingParams()))


def test_encoder_refuses_generation() -> None:
    """A generation request on an encoder is refused at add (FAILED_PRECONDITION, field
    model, saying why); an embedding request is taken."""
    s = encoder()
    with pytest.raises(errors.FailedPrecondition, match=r"encoder-only embedding model \(bert\)"):
        s.add(req("g", 5, 4))
    assert s.counters.rejected == 1
    s.add(embed_req("e", (1, 2, 3)))
    error = embedding.refuse_generation("bge", "bert")
    assert error.field == "model"
    assert error.metadata == {"model": "bge", "architecture": "bert"}
    assert str(error).startswith("model 'bge' is an encoder-only embedding model (bert)")


def test_failed_embedding_pass_fails_only_its_embedding_requests() -> None:
    """An embedding pass whose llama_decode fails (status -3, nothing computed) fails its
    embedding request with EngineError; the decode row that rode in it is fed again (its KV
    from there dropped first) and the stream's tokens are those it gets alone."""
    s, runner = make(n_parallel=2, chunk=16), FakeRunner()
    g = req("g", 20, 12)
    s.add(g)
    events: list[tuple[Request, Event]] = []
    while g.num_output < 2:
        plan, emitted = s.schedule()
        assert plan is not None
        events += emitted + s.update(plan, runner.execute(plan))
    s.add(embed_req("e", tuple(range(10, 18))))
    plan, emitted = s.schedule()
    assert plan is not None and plan.is_embedding
    assert {c.request_id for c in plan.chunks} == {"g", "e"}
    computed = g.num_computed
    failed = s.update(plan, StepResult(status=-3))
    assert [(r.request_id, type(e)) for r, e in failed] == [("e", Failed)]
    error = failed[0][1].error  # type: ignore[union-attr]
    assert isinstance(error, errors.EngineError)
    assert str(error) == "llama_decode failed with status -3"
    assert g.num_computed == computed
    events += emitted + failed + drive(s, runner)
    assert outputs(events)["g"] == alone(20, 12, "g")
    assert isinstance(finals(events)["g"], Finished)
    next_plan = next(p for p in runner.plans if p.tick > plan.tick)
    assert SeqOp(SeqOpKind.REMOVE, g.slot_id, computed, -1) in next_plan.seq_ops
