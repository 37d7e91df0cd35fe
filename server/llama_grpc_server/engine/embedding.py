"""Embedder: an embedding request's per-token outputs, gathered over the passes that feed it,
pooled (mean / cls / last / none), truncated to `dimensions` and L2-normalized in numpy once its
last token is fed. Used by the runner on the engine thread; imports no llama_cpp itself (the
fake runner uses it too)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llama_grpc_server.core.requests.embedding import EmbeddingParams, Pooling, Vectors
from llama_grpc_server.core.scheduling.plan import Chunk

Rows = np.ndarray[Any, np.dtype[np.float32]]  # (tokens, n_embd)


def pool(rows: Rows, params: EmbeddingParams) -> Rows:
    """The vectors of an input's outputs: pooled (mean in float64, like llama.cpp's sum then
    scale), truncated to `dimensions` (Matryoshka), then L2-normalized when asked (a zero
    vector stays zero)."""
    if params.pooling is Pooling.MEAN:
        out: Rows = rows.mean(axis=0, keepdims=True, dtype=np.float64).astype(np.float32)
    elif params.pooling is Pooling.CLS:
        out = rows[:1]
    elif params.pooling is Pooling.LAST:
        out = rows[-1:]
    else:
        out = rows
    if params.dimensions:
        out = out[:, : params.dimensions]
    if params.normalize:
        norms = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
        out = (out / np.where(norms > 0, norms, 1.0)).astype(np.float32)
    return np.ascontiguousarray(out, dtype=np.float32)


class Embedder:
    """The rows of the embedding requests being fed, by request key."""

    def __init__(self) -> None:
        self._rows: dict[str, list[Rows]] = {}

    def add(self, chunk: Chunk, rows: Rows) -> Vectors | None:
        """Take a chunk's outputs (copied); the request's vectors when it was the input's last
        chunk. A chunk at position 0 starts the input afresh (a preempted request re-feeds)."""
        params = chunk.embedding
        if params is None:
            raise RuntimeError(
                f"chunk of {chunk.request_id!r} in an embedding pass is no embedding"
            )
        gathered = self._rows.setdefault(chunk.request_id, [])
        if chunk.start_pos == 0:
            gathered.clear()
        gathered.append(rows.copy())
        if chunk.start_pos + len(chunk.tokens) < chunk.num_input:
            return None
        del self._rows[chunk.request_id]
        whole = gathered[0] if len(gathered) == 1 else np.concatenate(gathered)
        vectors = pool(whole, params)
        return Vectors(vectors.shape[1], vectors.tobytes())

    def forget(self, request_id: str) -> None:
        """Drop a request's rows (it ended before its last chunk: cancelled, failed)."""
        self._rows.pop(request_id, None)

    def clear(self) -> None:
        self._rows.clear()
