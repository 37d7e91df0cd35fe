"""Embeddings: what a caller asked for (`EmbeddingParams`), which pooling a model gets by
default, how one embedding pass's token budget is shared, and the vectors a request ends with
(`Vectors`: float32 bytes). Pure Python: engine/embedding.py pools the per-token outputs in
numpy on the engine thread.

Why per-token outputs pooled by us rather than llama.cpp's own pooling: the context is created
with pooling NONE, so one context serves generation and embeddings with every pooling per
request, and a long input can be fed in chunks across passes (a causal model's token output does
not depend on what follows it). mean / cls / last are what llama.cpp computes (the mean of the
sequence's outputs, the first one, the last one)."""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from llama_grpc_server import errors

# Tokens one embedding pass feeds at most. llama.cpp computes the logits of every token of an
# embedding pass whatever the pooling (llama_context::decode: `output_all = cparams.embeddings`,
# and the graph ends in the output matrix), and keeps an n_vocab-float row per output: for
# Gemma 3's 262,144-token vocabulary 1 MiB per token, a buffer that never shrinks. 128 tokens
# hold it at 128 MiB. The logits make an embedding token dear: on the shared 2-core box (Gemma 3
# 270M Q4_K_M, 1 thread, load ~4) a 128-token embedding pass took 1.28 s against 0.58 s for a
# prefill of the same tokens (bench/embeddings.py: 1.9-2.2x at 16-128 tokens).
MAX_PASS_TOKENS = 128
# Beside generating streams, decode rows ride in the embedding pass (Passes.compose) and its
# embedding tokens may add this share of a decode tick, so a stream's inter-token time is about
# (1 + STREAM_SHARE) x its time alone (issue 41's target: p95 within 1.5x). Passes of their own,
# alternating with decode ticks, could not get there: any pass costs about a decode tick of
# weight reads before its first token (measured: 2.6x at p95 with 4-token passes).
STREAM_SHARE = 0.5
MIN_PASS_TOKENS = 1
# A pass of embedding tokens alone teaches their cost from this many tokens (fewer: mostly the
# pass's fixed cost). A pass with decode rows teaches from one token: its marginal cost (the
# pass less a decode tick) is what the budget bounds, and there llama.cpp's matmul makes some
# row counts dear (3 rows cost ~10 ms more than 4 on the x86-64-v3 build; core.speculation.drafts
# pads for it): measured, a 1-row stream with 2 embedding tokens per pass ran at 2.0x, not 1.5x,
# while the budget had learned only from 128-token passes.
MIN_COST_SAMPLE_TOKENS = 4


class Pooling(enum.Enum):
    """How a request's per-token outputs become its vectors."""

    NONE = "none"  # one vector per token
    MEAN = "mean"
    CLS = "cls"  # the first token's
    LAST = "last"


# llama.cpp's pooling names (GGUF `<arch>.pooling_type`) that an embedding request may use as
# the model's own; "rank" (a reranker's classifier head) is not an embedding.
_MODEL_POOLINGS = {"mean": Pooling.MEAN, "cls": Pooling.CLS, "last": Pooling.LAST}


def default_pooling(model_pooling: str) -> Pooling:
    """The pooling of a request that names none: the model's own (GGUF pooling_type), or MEAN
    for a model without one. A generation model such as Gemma 3 has no pooling_type, so
    llama.cpp's default for it is NONE (a vector per token); one vector per input is what
    /v1/embeddings callers expect (llama-server refuses pooling none there)."""
    return _MODEL_POOLINGS.get(model_pooling, Pooling.MEAN)


def can_embed(model_pooling: str) -> bool:
    """Whether the model's outputs are embeddings at all: a reranker's (pooling "rank") are
    relevance scores from a classifier head that per-token pooling cannot reproduce."""
    return model_pooling != "rank"


def refuse_generation(model: str = "", architecture: str = "") -> errors.FailedPrecondition:
    """The error of a generation request to an encoder-only model (BERT: llama.cpp runs it
    with llama_encode, no KV cache, no output head to sample from)."""
    name = f"model {model!r}" if model else "the model"
    arch = f" ({architecture})" if architecture else ""
    return errors.FailedPrecondition(
        f"{name} is an encoder-only embedding model{arch}: it cannot generate text; call Embed",
        field="model",
        metadata={"model": model, "architecture": architecture},
    )


def share_whole(pending: Sequence[tuple[int, int]], budget: int) -> dict[int, int]:
    """One pass of an encoder-only model: inputs whole (a non-causal pass sees the whole
    sequence, so an input cannot be split over passes), in the order served, each that fits
    what is left of the budget (the ubatch: llama_encode runs one). The first always goes
    (admission bounds an input by the context, and the ubatch is the context), so one left out
    is first in the next pass."""
    out: dict[int, int] = {}
    for slot_id, num_pending in pending:
        if out and num_pending > budget:
            continue
        out[slot_id] = num_pending
        budget -= num_pending
    return out


@dataclass(frozen=True, slots=True)
class EmbeddingParams:
    """What an embedding request asked for; dimensions 0 keeps the model's."""

    pooling: Pooling = Pooling.MEAN
    normalize: bool = True
    dimensions: int = 0


def share_pass(pending: Sequence[tuple[int, int]], budget: int, chunk_size: int) -> dict[int, int]:
    """One embedding pass's tokens by slot id: `pending` is (slot id, tokens still to feed) in
    the order served (oldest first); each takes what it needs up to chunk_size while the budget
    lasts, so short inputs finish in one pass and a long one cannot hold the others back."""
    out: dict[int, int] = {}
    for slot_id, num_pending in pending:
        n = min(num_pending, chunk_size, budget)
        if n <= 0:
            break
        out[slot_id] = n
        budget -= n
    return out


@dataclass(slots=True)
class PassCosts:
    """Moving averages of an embedding token's milliseconds: in passes of embedding tokens
    alone (token_ms), and beside decode rows, the pass less a decode tick (marginal_ms); the
    budget beside streams comes from the second only. Learning it from the first made the
    first mixed passes too large until the average caught up, and those showed in a stream's
    p95 (measured: 1.95x once, 1.42x in another run)."""

    token_ms: float = 0.0
    marginal_ms: float = 0.0

    def observe(self, num_tokens: int, eval_ms: float, *, is_marginal: bool = False) -> None:
        """`eval_ms` of `num_tokens` embedding tokens: a whole pass's, or with is_marginal the
        part of a pass beyond its decode rows' tick."""
        if num_tokens < (1 if is_marginal else MIN_COST_SAMPLE_TOKENS) or eval_ms <= 0:
            return
        sample = eval_ms / num_tokens
        if is_marginal:
            self.marginal_ms = _average(self.marginal_ms, sample)
        else:
            self.token_ms = _average(self.token_ms, sample)

    def budget(self, decode_tick_ms: float, *, is_generating: bool) -> int:
        """MAX_PASS_TOKENS on an engine that generates nothing; beside decode rows the tokens
        that add STREAM_SHARE of a decode tick (MIN_PASS_TOKENS while either cost is
        unmeasured), within [MIN_PASS_TOKENS, MAX_PASS_TOKENS]."""
        if not is_generating:
            return MAX_PASS_TOKENS
        if decode_tick_ms <= 0 or self.marginal_ms <= 0:
            return MIN_PASS_TOKENS
        n = int(STREAM_SHARE * decode_tick_ms / self.marginal_ms)
        return max(MIN_PASS_TOKENS, min(MAX_PASS_TOKENS, n))


def _average(old: float, sample: float, alpha: float = 0.2) -> float:
    return sample if old <= 0 else old + alpha * (sample - old)


@dataclass(frozen=True, slots=True)
class Vectors:
    """A request's vectors: float32, row after row, in native byte order (little-endian on
    every platform llama.cpp runs on); bytes so the engine thread hands them over with one copy
    and nothing here needs numpy."""

    dimensions: int
    data: bytes

    @property
    def num_vectors(self) -> int:
        return len(self.data) // (4 * self.dimensions) if self.dimensions else 0

    def rows(self) -> list[list[float]]:
        """Each vector as Python floats."""
        values = array("f", self.data)
        if sys.byteorder != "little":
            values.byteswap()
        d = self.dimensions
        return [values[i : i + d].tolist() for i in range(0, len(values), d)]
