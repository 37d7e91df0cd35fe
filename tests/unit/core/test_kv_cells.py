"""KV accounting: cells shared through seq_cp count once; a refused partial seq_rm makes the
request re-prefill from scratch instead of decoding over a stale cache."""

from __future__ import annotations

from llama_grpc_server.core.kv.cells import CellMap
from llama_grpc_server.core.requests.request import (
    Finished,
    GenerationRequest,
    Request,
    StoppingParams,
)
from llama_grpc_server.testing import FakeRunner
from tests.support.scheduler import GREEDY, drive, finals, make, outputs


def test_computed_cells_add_up_per_sequence() -> None:
    cells = CellMap()
    cells.computed(0, 0, 10)
    cells.computed(0, 10, 5)
    cells.computed(1, 0, 7)
    assert (cells.num_cells(0), cells.num_cells(1), cells.num_used()) == (15, 7, 22)


def test_copied_prefix_is_counted_once() -> None:
    cells = CellMap()
    cells.computed(0, 0, 100)
    cells.copied(0, 1, 60)
    assert cells.num_used() == 100
    cells.computed(1, 60, 10)  # the copy diverges: 10 new cells
    cells.computed(0, 100, 5)
    assert cells.num_used() == 115
    cells.cleared(0)  # seq 1 still uses the 60 shared cells
    assert cells.num_used() == 70


def test_recomputing_after_a_removal_makes_new_cells() -> None:
    """Positions computed again after seq_rm are new cells, even where a copy still holds the
    old ones at the same positions."""
    cells = CellMap()
    cells.computed(0, 0, 100)
    cells.copied(0, 1, 100)
    cells.removed(0, 50)
    cells.computed(0, 50, 10)
    assert cells.num_used() == 110


def test_cells_are_counted_once_per_change() -> None:
    """The drafts, the pads, the stats snapshot and the KV-event load record of one tick share
    one count; any edit makes it stale, and last_num_used keeps the latest for GetStats."""
    cells = CellMap()
    counts: list[int] = []
    count = cells._count

    def counting() -> int:
        counts.append(count())
        return counts[-1]

    cells._count = counting  # type: ignore[method-assign]
    cells.computed(0, 0, 10)
    assert (cells.num_used(), cells.num_used(), len(counts)) == (10, 10, 1)
    cells.copied(0, 1, 5)
    cells.computed(1, 5, 3)
    assert (cells.num_used(), cells.num_used(), len(counts)) == (13, 13, 2)
    cells.trimmed(1, 6)
    assert (cells.num_used(), cells.last_num_used, len(counts)) == (11, 11, 3)


def test_restore_and_partial_removal() -> None:
    cells = CellMap()
    cells.restored(2, 80)
    cells.removed(2, 30, 40)
    assert cells.num_used() == 70


def test_stats_count_shared_prefix_cells_once() -> None:
    """Four requests share a 200-token system prompt through seq_cp: GetStats' kv_cells_used is
    the distinct cells (200 shared + each one's own tail), not the sum over slots."""
    s, runner = make(n_parallel=4, n_batch=512, chunk=64), FakeRunner()
    system = tuple(range(1, 201))
    for i in range(4):
        s.add(Request(GenerationRequest(f"q{i}", (*system, 300 + i), GREEDY, StoppingParams(3))))
    drive(s, runner)
    snapshot = s.snapshot(kv_cells_total=4096)
    per_slot = sum(slot.cached_tokens for slot in snapshot.slots)
    # each slot holds 200 + 1 + 2 (its prompt's last token and two fed decode tokens)
    assert per_slot == 4 * 203
    assert snapshot.kv_cells_used == 200 + 4 * 3


def test_refused_partial_removal_reprefills_from_scratch() -> None:
    """If seq_rm refuses to drop a cache's tail, the request recomputes its whole prompt (and
    reports nothing cached) with the same output as a cold run."""
    s, runner = make(n_parallel=1, chunk=64), FakeRunner(refuse_partial_removal=True)
    first = tuple(range(1, 61))
    s.add(Request(GenerationRequest("a", first, GREEDY, StoppingParams(4))))
    drive(s, runner)
    diverging = (*first[:40], 90, 91, 92)  # reuses 40 tokens: the tail must be removed
    b = Request(GenerationRequest("b", diverging, GREEDY, StoppingParams(6)))
    s.add(b)
    events = drive(s, runner)
    done = finals(events)["b"]
    assert isinstance(done, Finished) and done.usage.cached_prompt_tokens == 0
    cold_s, cold_runner = make(n_parallel=1, chunk=64), FakeRunner()
    cold_s.add(Request(GenerationRequest("b", diverging, GREEDY, StoppingParams(6))))
    assert outputs(events)["b"] == outputs(drive(cold_s, cold_runner))["b"]
    assert runner.fed["b"] == len(diverging) + 6 - 1, "the whole prompt was fed again"
    assert s.counters.cached_prompt_tokens == 0
    assert s.snapshot(4096).kv_cells_used == len(runner.kv[0])
