"""The one preallocated llama_batch, backed by numpy arrays so a tick fills it with a few slice
assignments instead of per-element ctypes writes (~0.55 ms per 512 tokens measured)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp
import numpy as np

from llama_grpc_server.core.scheduling.plan import Chunk

_I32P = ctypes.POINTER(ctypes.c_int32)


def needs_spare_row(n_rows: int, n_ubatch: int) -> bool:
    """Batch-invariant mode (engine/llama.py): whether a pass of n_rows would leave llama.cpp a
    micro-batch of one row, which flash attention computes another way (split over the KV
    cells in per-thread parts) once the KV view reaches 512 cells."""
    return n_rows % n_ubatch == 1


class Batch:
    """A llama_batch whose arrays are numpy-owned; never pass it to llama_batch_free."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        rows = capacity + 1  # room for a spare row (add_spare_row)
        self.token = np.zeros(rows, dtype=np.int32)
        self.pos = np.zeros(rows, dtype=np.int32)
        self.n_seq_id = np.ones(rows, dtype=np.int32)
        self.seq = np.zeros(rows, dtype=np.int32)
        self.logits = np.zeros(rows, dtype=np.int8)
        base = self.seq.ctypes.data
        self._seq_rows = (_I32P * rows)(*[ctypes.cast(base + 4 * i, _I32P) for i in range(rows)])
        self.struct = llama_cpp.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(_I32P),
            embd=None,
            pos=self.pos.ctypes.data_as(_I32P),
            n_seq_id=self.n_seq_id.ctypes.data_as(_I32P),
            seq_id=self._seq_rows,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def fill(self, chunks: Sequence[Chunk], *, every_output: bool = False) -> list[int]:
        """Write the chunks; returns the batch index of each chunk's first output (-1 when
        none). A speculative decode's outputs are its last num_draft + 1 positions, in order.
        `every_output` (an embedding pass) marks every token: llama.cpp outputs them all in an
        embedding pass anyway, and warns once per batch where they are not marked."""
        n = 0
        outputs: list[int] = []
        for chunk in chunks:
            k = len(chunk.tokens)
            if k == 1:
                self.token[n] = chunk.tokens[0]
                self.pos[n] = chunk.start_pos
                self.seq[n] = chunk.slot_id
            else:
                self.token[n : n + k] = chunk.tokens
                self.pos[n : n + k] = np.arange(
                    chunk.start_pos, chunk.start_pos + k, dtype=np.int32
                )
                self.seq[n : n + k] = chunk.slot_id
                self.logits[n : n + k - 1] = 0
            num_outputs = chunk.num_outputs
            if num_outputs:
                self.logits[n + k - num_outputs : n + k] = 1
            else:
                self.logits[n + k - 1] = 0
            outputs.append(n + k - num_outputs if num_outputs else -1)
            n += k
        self.struct.n_tokens = n
        if every_output:
            self.logits[:n] = 1
        return outputs

    def add_spare_row(self, n_ubatch: int, n_ctx: int) -> tuple[int, int] | None:
        """Batch-invariant mode: when the filled rows would leave a micro-batch of one row
        (needs_spare_row), one row more: the last row's sequence and token again at the next
        position, without logits. Causal attention keeps it from every other row; the caller
        removes its KV cell after the pass. Returns (sequence, position) of the spare, or None
        when none was needed (or the last row is at the end of the context)."""
        n = int(self.struct.n_tokens)
        if n == 0 or not needs_spare_row(n, n_ubatch):
            return None
        seq, pos = int(self.seq[n - 1]), int(self.pos[n - 1]) + 1
        if pos >= n_ctx:
            return None
        self.token[n], self.pos[n], self.seq[n], self.logits[n] = self.token[n - 1], pos, seq, 0
        self.struct.n_tokens = n + 1
        return seq, pos

    def drop_spare_row(self) -> None:
        """Take the spare row off again (its pass found no KV cell for it)."""
        self.struct.n_tokens = int(self.struct.n_tokens) - 1
