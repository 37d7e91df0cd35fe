"""Per-request samplers: a llama_sampler chain built from SamplingParams, or a numpy argmax fast
path for plain greedy requests (0.04 ms vs 0.44 ms per token for a 262k vocabulary)."""

from __future__ import annotations

from typing import Any

import llama_cpp
import numpy as np

from llama_grpc_server.core.request import SamplingParams


class RequestSampler:
    """One request's sampler state (penalty history, RNG). Free with close()."""

    __slots__ = ("_chain", "_n_vocab")

    def __init__(self, params: SamplingParams, seed: int, n_vocab: int) -> None:
        self._n_vocab = n_vocab
        self._chain: Any = None
        if params.is_greedy and not params.has_penalties:
            return
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = llama_cpp.llama_sampler_chain_add
        if params.has_penalties:
            add(
                chain,
                llama_cpp.llama_sampler_init_penalties(
                    n_vocab,
                    params.penalty_last_n,
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                ),
            )
        if params.is_greedy:
            add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
            add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
            add(chain, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        self._chain = chain

    def sample(self, ctx: Any, batch_index: int) -> int:
        """Sample from the logits of `batch_index`, which must be an output of the last decode.
        llama_sampler_sample accepts the token itself; never accept it again."""
        if self._chain is None:
            row = llama_cpp.llama_get_logits_ith(ctx, batch_index)
            return int(np.ctypeslib.as_array(row, shape=(self._n_vocab,)).argmax())
        return int(llama_cpp.llama_sampler_sample(self._chain, ctx, batch_index))

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
