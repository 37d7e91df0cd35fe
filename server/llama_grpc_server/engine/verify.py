"""`llama-grpc models verify`: prove a GGUF file works with this engine, not just that it parses.
Loads it the way serve does (LlamaModel + Runner, one slot, a small context), prefills a short
prompt and greedily decodes a few tokens through the same StepPlan path as real requests; an
encoder-only model (BERT), which cannot generate, embeds the prompt in one embedding pass
instead."""

from __future__ import annotations

import time
from dataclasses import dataclass

from llama_grpc_server.config import GpuLayers, ModelSettings
from llama_grpc_server.core.requests import embedding
from llama_grpc_server.core.requests.request import SamplingParams
from llama_grpc_server.core.scheduling.plan import DECODE_OK, Chunk, SamplerSpec, StepPlan
from llama_grpc_server.engine import logs
from llama_grpc_server.engine.llama import LlamaModel
from llama_grpc_server.engine.runner import Runner

PROMPT = "The capital of France is"
_REQUEST = "verify"


class VerifyError(RuntimeError):
    """The model loaded but could not decode or sample."""


@dataclass(frozen=True, slots=True)
class VerifyResult:
    prompt: str
    prompt_tokens: int
    token_ids: tuple[int, ...]
    text: str
    n_params: int  # llama.cpp's count, to compare with the header's
    n_gpu_layers: int  # what was loaded with (auto resolved)
    load_ms: float
    prompt_ms: float  # prefill, including the first token's sampling
    decode_ms: float  # the remaining tokens, one forward pass each
    embedding_dim: int = 0  # an encoder's: its vector's dimension (no tokens generated)

    @property
    def tokens_per_s(self) -> float:
        rest = len(self.token_ids) - 1
        return rest / (self.decode_ms / 1000) if rest > 0 and self.decode_ms > 0 else 0.0


def verify_model(
    path: str,
    *,
    prompt: str = PROMPT,
    n_tokens: int = 4,
    n_ctx: int = 256,
    n_gpu_layers: GpuLayers = 0,
) -> VerifyResult:
    """Load, prefill `prompt`, greedy-generate n_tokens. ModelLoadError when llama.cpp cannot
    load the file or create a context, VerifyError when a decode or a sample fails."""
    logs.install(debug=False)
    settings = ModelSettings(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_gpu_layers=n_gpu_layers)
    t0 = time.perf_counter()
    model = LlamaModel(settings, path, n_seq_max=1)
    runner = Runner(model)
    try:
        load_ms = (time.perf_counter() - t0) * 1000
        tokens = model.tokenize(prompt, add_special=True, parse_special=False)
        if not tokens or len(tokens) + n_tokens > model.n_ctx:
            raise VerifyError(f"prompt of {len(tokens)} tokens does not fit n_ctx={model.n_ctx}")
        if model.is_encoder:
            return _verify_encoder(model, runner, prompt, tokens, load_ms)
        sampler = SamplerSpec(_REQUEST, SamplingParams(temperature=0.0), seed=0)
        out: list[int] = []
        times: list[float] = []
        pos, chunk = 0, tuple(tokens)
        for tick in range(n_tokens):
            plan = StepPlan(
                tick=tick,
                chunks=(Chunk(0, _REQUEST, pos, chunk, True),),
                open_samplers=(sampler,) if tick == 0 else (),
            )
            t = time.perf_counter()
            result = runner.execute(plan)
            times.append((time.perf_counter() - t) * 1000)
            if result.status != DECODE_OK:
                raise VerifyError(f"llama_decode returned {result.status} at token {tick}")
            if 0 not in result.sampled:
                raise VerifyError(f"no token sampled at token {tick}: {result.failed.get(0, '')}")
            out.append(result.sampled[0])
            pos, chunk = pos + len(chunk), (out[-1],)
        return VerifyResult(
            prompt=prompt,
            prompt_tokens=len(tokens),
            token_ids=tuple(out),
            text=model.detokenize(out, render_special=False),
            n_params=model.info("").n_params,
            n_gpu_layers=model.n_gpu_layers,
            load_ms=load_ms,
            prompt_ms=times[0],
            decode_ms=sum(times[1:]),
        )
    finally:
        runner.close()
        model.close()


def _verify_encoder(
    model: LlamaModel, runner: Runner, prompt: str, tokens: list[int], load_ms: float
) -> VerifyResult:
    """The prompt in one embedding pass, pooled as the model's own pooling says: one vector of
    the model's dimension."""
    params = embedding.EmbeddingParams(embedding.default_pooling(model.pooling))
    chunk = Chunk(0, _REQUEST, 0, tuple(tokens), False, embedding=params, num_input=len(tokens))
    t = time.perf_counter()
    result = runner.execute(StepPlan(tick=0, chunks=(chunk,), is_embedding=True))
    elapsed_ms = (time.perf_counter() - t) * 1000
    if result.status != DECODE_OK:
        raise VerifyError(f"llama_decode returned {result.status} embedding the prompt")
    vectors = result.embeddings.get(0)
    if vectors is None or vectors.num_vectors != 1 or vectors.dimensions != model.n_embd:
        raise VerifyError(f"no {model.n_embd}-dimensional vector from the embedding pass")
    return VerifyResult(
        prompt=prompt,
        prompt_tokens=len(tokens),
        token_ids=(),
        text="",
        n_params=model.info("").n_params,
        n_gpu_layers=model.n_gpu_layers,
        load_ms=load_ms,
        prompt_ms=elapsed_ms,
        decode_ms=0.0,
        embedding_dim=vectors.dimensions,
    )
