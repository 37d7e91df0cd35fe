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
    def __init__(self, model_path: str, n_ctx: int, n_seq_max: int, threads: int) -> None:
        logs.install(debug=False)
        settings = ModelSettings(n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads)
        self.model = LlamaModel(settings, model_path, n_seq_max)
        self.batch = llama_cpp.llama_batch_init(self.model.n_batch, 0, 1)

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
        entries = []
        for seq, prompt in enumerate(prompts):
            entries += [(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)]
        self._decode(entries)
        out_idx = [i for i, e in enumerate(entries) if e[3]]
        last = [self._argmax(i) for i in out_idx]
        if on_step is not None:
            on_step(last)
        pos = [len(p) for p in prompts]
        for _ in range(n_generate - 1):
            self._decode([(last[s], pos[s], s, True) for s in range(len(prompts))])
            last = [self._argmax(s) for s in range(len(prompts))]
            if on_step is not None:
                on_step(last)
            pos = [p + 1 for p in pos]
        return time.perf_counter() - t0

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        self.model.close()
