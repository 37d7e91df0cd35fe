"""CellMap: which KV cells each sequence references, so that cells shared through seq_cp are
counted once. Pure bookkeeping mirroring the KV edits the scheduler queues (in plan order).

llama.cpp's unified KV cache tags a cell with every sequence that uses it: seq_cp(src, dst, 0, n)
adds dst to src's cells at positions [0, n) without copying anything. Each computed range gets
an origin id; a cell is (origin, position). A sequence is a list of runs (origin, start, end);
the cells in use are the union of all runs per origin."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Run:
    origin: int
    start: int
    end: int  # exclusive


class CellMap:
    def __init__(self) -> None:
        self._runs: dict[int, list[Run]] = defaultdict(list)
        # The origin a sequence may keep extending: created by its own computation since its
        # last removal (positions it re-computes after a removal are new cells).
        self._open: dict[int, int] = {}
        self._origins = itertools.count()
        # num_used() counts once per change, not once per reader: the scheduler counts after
        # each tick's update, and the next plan's drafts and pads, the stats snapshot and the
        # KV-event load record share that count. None: stale.
        self._num_used: int | None = 0
        self.last_num_used = 0  # the latest count (GetStats reads it live, from any thread)

    def computed(self, seq_id: int, start: int, n: int) -> None:
        """The sequence computed n new cells at positions start .. start + n - 1."""
        if n <= 0:
            return
        self._num_used = None
        runs = self._runs[seq_id]
        origin = self._open.get(seq_id)
        if origin is not None and runs and runs[-1].origin == origin and runs[-1].end == start:
            runs[-1] = Run(origin, runs[-1].start, start + n)
            return
        origin = next(self._origins)
        self._open[seq_id] = origin
        runs.append(Run(origin, start, start + n))

    def removed(self, seq_id: int, p0: int, p1: int = -1) -> None:
        """seq_rm(seq_id, p0, p1): the sequence no longer uses cells in [p0, p1) (-1 = end)."""
        end = p1 if p1 >= 0 else None
        self._num_used = None
        kept: list[Run] = []
        for run in self._runs[seq_id]:
            if run.end <= p0 or (end is not None and run.start >= end):
                kept.append(run)
                continue
            if run.start < p0:
                kept.append(Run(run.origin, run.start, p0))
            if end is not None and run.end > end:
                kept.append(Run(run.origin, end, run.end))
        self._runs[seq_id] = kept
        self._open.pop(seq_id, None)

    def trimmed(self, seq_id: int, p0: int) -> None:
        """seq_rm(seq_id, p0, -1) of cells only this sequence has seen (rejected draft tokens,
        computed in the last tick): like removed(), but the sequence keeps extending the same
        origin, so speculating does not split its cells into a run per tick."""
        origin = self._open.get(seq_id)
        self.removed(seq_id, p0)
        runs = self._runs[seq_id]
        if origin is not None and runs and runs[-1].origin == origin and runs[-1].end == p0:
            self._open[seq_id] = origin

    def copied(self, src_seq_id: int, dst_seq_id: int, n: int) -> None:
        """seq_cp(src, dst, 0, n): dst now also uses src's cells at positions [0, n)."""
        self.removed(dst_seq_id, 0, n)  # marks the count stale
        shared = [
            Run(r.origin, r.start, min(r.end, n)) for r in self._runs[src_seq_id] if r.start < n
        ]
        self._runs[dst_seq_id] = sorted(shared + self._runs[dst_seq_id], key=lambda r: r.start)

    def restored(self, seq_id: int, n: int) -> None:
        """A saved state of n cells was loaded into the (emptied) sequence."""
        self.removed(seq_id, 0)
        self.computed(seq_id, 0, n)

    def cleared(self, seq_id: int) -> None:
        self.removed(seq_id, 0)

    def num_cells(self, seq_id: int) -> int:
        return sum(r.end - r.start for r in self._runs[seq_id])

    def num_used(self) -> int:
        """Distinct cells referenced by any sequence."""
        if self._num_used is None:
            self._num_used = self.last_num_used = self._count()
        return self._num_used

    def _count(self) -> int:
        spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for runs in self._runs.values():
            for r in runs:
                spans[r.origin].append((r.start, r.end))
        total = 0
        for ranges in spans.values():
            ranges.sort()
            cur_start, cur_end = ranges[0]
            for start, end in ranges[1:]:
                if start > cur_end:
                    total += cur_end - cur_start
                    cur_start, cur_end = start, end
                else:
                    cur_end = max(cur_end, end)
            total += cur_end - cur_start
        return total
