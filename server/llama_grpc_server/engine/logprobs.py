"""Log-probabilities straight from a logits row in llama.cpp's memory: a numpy view over the
ctypes pointer (no copy to Python), a stable log-softmax and argpartition for the top k."""

from __future__ import annotations

import math
from typing import Any

import llama_cpp
import numpy as np

from llama_grpc_server.core.scheduling.plan import SampledLogprob

MAX_TOP_LOGPROBS = 20


class LogprobComputer:
    """Reused by the engine thread for every request that asked for logprobs."""

    __slots__ = ("_n_vocab", "_scratch")

    def __init__(self, n_vocab: int) -> None:
        self._n_vocab = n_vocab
        self._scratch = np.empty(n_vocab, dtype=np.float32)

    def row(self, ctx: Any, batch_index: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The logits of `batch_index` as a read-only view into the context's buffer."""
        pointer = llama_cpp.llama_get_logits_ith(ctx, batch_index)
        view: np.ndarray[Any, np.dtype[np.float32]] = np.ctypeslib.as_array(
            pointer, shape=(self._n_vocab,)
        )
        return view

    def compute(self, ctx: Any, batch_index: int, token: int, k: int) -> SampledLogprob:
        return self.from_row(self.row(ctx, batch_index), token, k)

    def from_row(
        self, row: np.ndarray[Any, np.dtype[np.float32]], token: int, k: int
    ) -> SampledLogprob:
        """log softmax(row)[token] and the k largest entries, largest first (ties: lower id)."""
        peak = float(row.max())
        np.subtract(row, peak, out=self._scratch)
        np.exp(self._scratch, out=self._scratch)
        log_norm = peak + math.log(float(self._scratch.sum(dtype=np.float64)))
        logprob = float(row[token]) - log_norm
        if k <= 0:
            return SampledLogprob(logprob)
        k = min(k, self._n_vocab)
        ids = np.argpartition(row, self._n_vocab - k)[self._n_vocab - k :]
        values = row[ids]
        order = np.lexsort((ids, -values))
        top = tuple((int(ids[i]), float(values[i]) - log_norm) for i in order)
        return SampledLogprob(logprob, top)
