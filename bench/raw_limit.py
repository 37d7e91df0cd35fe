"""The hardware limit: an in-process loop over llama_cpp's low-level API with B sequences —
one batched prefill, then one decode step per token with numpy argmax. No scheduler, no gRPC."""

from __future__ import annotations

import time
from collections.abc import Callable

import llama_cpp
import numpy as np

from llama_grpc_server.config import ModelSettings
from llama_grpc_server.engine import logs
from llama_grpc_server.engine.llama import LlamaModel


class RawLoop:
    """`batched_argmax`: one argmax over every row's logits per step (bench/gpu_bench.py, where
    B rows of 262,144 logits one by one cost more than the forward pass) instead of one per
    row; the same tokens."""

    def __init__(
        self,
        model_path: str,
        n_ctx: int,
        n_seq_max: int,
        threads: int,
        *,
        n_gpu_layers: int = 0,
        batched_argmax: bool = False,
    ) -> None:
        logs.install(debug=False)
        settings = ModelSettings(
            n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_gpu_layers=n_gpu_layers
        )
        self.model = LlamaModel(settings, model_path, n_seq_max)
        self.batch = llama_cpp.llama_batch_init(self.model.n_batch, 0, 1)
        self.batched_argmax = batched_argmax

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(entries)
        rc = llama_cpp.llama_decode(self.model.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, index: int) -> int:
        row = llama_cpp.llama_get_logits_ith(self.model.ctx, index)
        return int(np.ctypeslib.as_array(row, shape=(self.model.n_vocab,)).argmax())

    def _argmax_all(self, indices: list[int]) -> list[int]:
        """The greedy token of each row at these batch indices (the decode's only outputs, in
        batch order)."""
        if not self.batched_argmax:
            return [self._argmax(i) for i in indices]
        rows = llama_cpp.llama_get_logits(self.model.ctx)
        shape = (len(indices), self.model.n_vocab)
        return [int(t) for t in np.ctypeslib.as_array(rows, shape=shape).argmax(axis=1)]

    def _prefill(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        self._decode(entries)
        return self._argmax_all([i for i, e in enumerate(entries) if e[3]])

    def run(
        self,
        prompts: list[list[int]],
        n_generate: int,
        on_step: Callable[[list[int]], None] | None = None,
    ) -> float:
        """Wall seconds to prefill every prompt and generate n_generate tokens for each;
        `on_step` gets each step's tokens, one per prompt (grpc_ceiling.py streams them)."""
        llama_cpp.llama_memory_clear(self.model.memory, True)
        t0 = time.perf_counter()
        last: list[int] = []
        entries: list[tuple[int, int, int, bool]] = []
        for seq, prompt in enumerate(prompts):  # whole prompts, n_batch tokens per decode at most
            if entries and len(entries) + len(prompt) > self.model.n_batch:
                last += self._prefill(entries)
                entries = []
            entries += [(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)]
        last += self._prefill(entries)
        if on_step is not None:
            on_step(last)
        pos = [len(p) for p in prompts]
        for _ in range(n_generate - 1):
            self._decode([(last[s], pos[s], s, True) for s in range(len(prompts))])
            last = self._argmax_all(list(range(len(prompts))))
            if on_step is not None:
                on_step(last)
            pos = [p + 1 for p in pos]
        return time.perf_counter() - t0

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        self.model.close()
