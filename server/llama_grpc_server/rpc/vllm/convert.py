"""core events and snapshots -> vLLM engine protocol messages. Pure: no grpc, no engine calls.

A stream chunk carries the tokens new since the last one (completion_tokens counts them) and
the request's prompt and cached-prompt counts; GenerateComplete repeats the totals: every output
id, the counts, the finish reason ("stop", "length" or "abort") and what stopped it. Output ids
are the tokens v1 streams: an end-of-generation or stop token ends the output without being
part of it (matched_token_id names a stop token)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from llama_grpc_server.auth import scoped_cache_scope
from llama_grpc_server.core.api import ModelInfo
from llama_grpc_server.core.kv.events import (
    BLOCK_SIZE,
    AllBlocksCleared,
    BlocksStored,
    EventBatch,
    KvEvent,
    LoadRecord,
)
from llama_grpc_server.core.requests.request import (
    Finished,
    FinishReason,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
)
from llama_grpc_server.core.stats import Load

STOP, LENGTH, ABORT = "stop", "length", "abort"
FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.EOS: STOP,
    FinishReason.STOP_SEQUENCE: STOP,
    FinishReason.STOP_TOKEN: STOP,
    FinishReason.MAX_TOKENS: LENGTH,
    FinishReason.CONTEXT_LENGTH: LENGTH,
    FinishReason.TIME_LIMIT: LENGTH,
    FinishReason.EMBEDDED: STOP,  # an embedding input is done (Embed answers no finish reason)
    FinishReason.TOOL_CALLS: STOP,  # never here: the engine protocol parses no tools (SMG does)
}
SERVER_TYPE = "vllm-grpc"  # the protocol this service speaks, as vLLM's own servicer names it
# The cache_salt of the base model's blocks on a replica whose engine-protocol requests apply an
# adapter (--engine-lora; scope_salt): core.adapters.scoped's form for no adapters, which no
# request's scope can equal (a caller's scope is printable).
BASE_MODEL_SALT = "\x1flora="


@dataclass(slots=True)
class Sample:
    """What one of a request's n samples has produced so far."""

    index: int
    num_prompt: int
    top_logprobs: int | None  # None: no logprobs asked for
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_tokens: int = 0
    is_done: bool = False

    def add(self, delta: TokenDelta) -> None:
        self.output_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.cached_tokens = max(self.cached_tokens, delta.cached_prompt_tokens)


def output_logprobs(
    logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...], top_logprobs: int | None
) -> vpb.OutputLogProbs | None:
    if top_logprobs is None or not logprobs:
        return None
    return vpb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs],
        token_ids=[lp.token_id for lp in logprobs],
        top_logprobs=[
            vpb.TopLogProbs(
                values=[t.logprob for t in lp.top], token_ids=[t.token_id for t in lp.top]
            )
            for lp in logprobs
        ]
        if top_logprobs > 0
        else [],
    )


def chunk(sample: Sample, delta: TokenDelta) -> vpb.GenerateResponse:
    """A stream chunk of `delta` (already added to `sample`)."""
    return vpb.GenerateResponse(
        chunk=vpb.GenerateStreamChunk(
            token_ids=delta.token_ids,
            prompt_tokens=sample.num_prompt,
            completion_tokens=len(delta.token_ids),
            cached_tokens=sample.cached_tokens,
            output_logprobs=output_logprobs(delta.logprobs, sample.top_logprobs),
            index=sample.index,
        )
    )


def complete(sample: Sample, finished: Finished | None) -> vpb.GenerateResponse:
    """The sample's GenerateComplete; `finished` None means it was aborted."""
    message = vpb.GenerateComplete(
        output_ids=sample.output_ids,
        finish_reason=ABORT if finished is None else FINISH_REASONS[finished.reason],
        prompt_tokens=sample.num_prompt,
        completion_tokens=len(sample.output_ids),
        cached_tokens=sample.cached_tokens,
        output_logprobs=output_logprobs(sample.logprobs, sample.top_logprobs),
        index=sample.index,
    )
    if finished is not None:
        usage = finished.usage
        message.prompt_tokens = usage.prompt_tokens
        message.cached_tokens = usage.cached_prompt_tokens
        message.spec_draft_tokens = usage.draft_tokens
        message.spec_accepted_tokens = usage.accepted_draft_tokens
        if finished.reason is FinishReason.STOP_SEQUENCE:
            message.matched_stop_str = finished.matched_stop
        elif finished.reason is FinishReason.STOP_TOKEN and finished.matched_token_id is not None:
            message.matched_token_id = finished.matched_token_id
    return vpb.GenerateResponse(complete=message)


def model_info(
    info: ModelInfo,
    defaults: SamplingParams,
    default_max_tokens: int,
    served_name: str | None = None,
) -> vpb.GetModelInfoResponse:
    """The model as the gateway sees it, named `served_name` (default: the model's name; the
    gateway registers the worker under it); the default sampling is the server's."""
    sampling = {
        "temperature": defaults.temperature,
        "top_k": defaults.top_k,
        "top_p": defaults.top_p,
        "min_p": defaults.min_p,
        "repetition_penalty": defaults.repeat_penalty,
        "max_tokens": default_max_tokens,
    }
    message = vpb.GetModelInfoResponse(
        model_path=info.model_path,
        # an encoder-only embedding model (BERT, nomic-bert) cannot generate: the gateway is told
        is_generation=not info.is_encoder,
        max_context_length=info.n_ctx,
        vocab_size=info.n_vocab,
        supports_vision=False,
        served_model_name=info.model_name if served_name is None else served_name,
        eos_token_ids=list(info.eog_token_ids),
        max_req_input_len=info.n_ctx - 1,  # a prompt leaves room for one generated token
        default_sampling_params_json=json.dumps(sampling, sort_keys=True),
    )
    if info.bos_token_id is not None:
        message.bos_token_id = info.bos_token_id
    return message


def loads(load: Load, version: str) -> vpb.GetLoadsResponse:
    """WatchLoad's numbers (one rank): running and waiting requests, KV use, prefix hits; the
    token usage is the share running requests hold (`active_cells`, core.stats.active_cells),
    as vLLM reports it, while num_used_tokens counts idle slots' kept prefixes too."""
    running, waiting = load.active_slots, load.queue_depth
    message = vpb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_total_reqs=running + waiting,
        num_used_tokens=load.kv_cells_used,
        max_total_num_tokens=load.kv_cells_total,
        token_usage=load.active_cells / load.kv_cells_total if load.kv_cells_total else 0.0,
        cache_hit_rate=load.prefix_cache_hit_rate,
        max_running_requests=load.n_parallel,
        utilization=running / load.n_parallel if load.n_parallel else 0.0,
    )
    stamp = datetime.fromtimestamp(load.timestamp_unix_ms / 1000, UTC).isoformat()
    return vpb.GetLoadsResponse(timestamp=stamp, version=version, dp_rank_count=1, loads=[message])


# -- KV cache events (SubscribeKvEvents) ---------------------------------------------------------


def scope_salt(tenant: str, plain: str = "") -> Callable[[str], str | None]:
    """What a subscriber of `tenant` sees of a block's cache scope: None for another tenant's
    block (never sent: its token ids are that tenant's prompt), else the scope the tenant chose
    (\"\" for none), which goes out as the blocks' cache_salt when set. An anonymous subscriber
    (no authentication configured) sees every scope.

    `plain`: the scope (after the tenant's prefix) of the engine-protocol requests themselves,
    whose blocks go out unsalted, as the gateway's requests carry no salt and SMG keeps salted
    blocks apart from them: "" on a plain replica; on one with --engine-lora, its adapter set's
    (core.adapters.scoped("", adapters)), and the base model's blocks then go out salted
    BASE_MODEL_SALT, so that SMG never takes them for the adapter's."""
    prefix = scoped_cache_scope(tenant, "")

    def salt(scope: str) -> str | None:
        if not scope.startswith(prefix):
            return None
        own = scope[len(prefix) :]
        if not plain:
            return own
        if own == plain:
            return ""
        return BASE_MODEL_SALT if own == "" else own

    return salt


def engine_load(load: LoadRecord, sample: int, *, load_only: bool) -> cpb.EngineLoad:
    return cpb.EngineLoad(
        running_requests=load.running,
        waiting_requests=load.waiting,
        token_usage=load.token_usage,
        active_token_usage=load.token_usage,
        max_running_requests=load.max_running,
        sample=sample,
        load_only=load_only,
        num_used_tokens=load.used_cells,
        max_total_num_tokens=load.total_cells,
    )


def _kv_event(
    event: KvEvent, salt: Callable[[str], str | None], event_id: int
) -> cpb.KvCacheEvent | None:
    if isinstance(event, AllBlocksCleared):
        return cpb.KvCacheEvent(event_id=event_id, cleared=cpb.KvCacheCleared())
    scope_salt_ = salt(event.scope)
    if scope_salt_ is None:
        return None
    level = int(event.tier) - 1  # KvBlock.cache_level: 0 device, 1 host, 2 disk
    local = cpb.KV_CACHE_LOCALITY_LOCAL
    if isinstance(event, BlocksStored):
        stored = cpb.KvBlocksStored(
            blocks=[
                cpb.KvBlock(
                    block_hash=b.hash, token_ids=b.tokens, block_size=BLOCK_SIZE, cache_level=level
                )
                for b in event.blocks
            ],
            tier=int(event.tier),
            locality=local,
        )
        if event.parent is not None:
            stored.parent_block_hash = event.parent
        if scope_salt_:
            stored.cache_salt = scope_salt_
        return cpb.KvCacheEvent(event_id=event_id, stored=stored)
    removed = cpb.KvBlocksRemoved(
        block_hashes=event.hashes, cache_level=level, tier=int(event.tier), locality=local
    )
    return cpb.KvCacheEvent(event_id=event_id, removed=removed)


def kv_event_batch(
    batch: EventBatch, salt: Callable[[str], str | None], sample: int
) -> cpb.KvEventBatch:
    """A batch of the engine's KV event log as the subscriber may see it (scope_salt). Events
    are numbered seq << 16 | index + 1 (a batch of a tick holds far fewer); a snapshot's are 0,
    as the protocol asks of synthesized events, and it goes out as a one-chunk snapshot."""
    events = []
    for i, event in enumerate(batch.events):
        event_id = 0 if batch.is_snapshot else batch.seq << 16 | (i + 1)
        converted = _kv_event(event, salt, event_id)
        if converted is not None:
            events.append(converted)
    out = cpb.KvEventBatch(
        sequence_number=batch.seq,
        timestamp=batch.timestamp,
        events=events,
        load=engine_load(batch.load, sample, load_only=False),
    )
    if batch.is_snapshot:
        blocks = sum(len(e.stored.blocks) for e in events if e.WhichOneof("data") == "stored")
        out.snapshot.CopyFrom(cpb.KvSnapshotChunk(index=0, count=1, blocks=blocks))
    return out


def load_only_batch(seq: int, load: LoadRecord, sample: int, timestamp: float) -> cpb.KvEventBatch:
    """A heartbeat, or a load change without KV events: no events, the last sequence sent."""
    return cpb.KvEventBatch(
        sequence_number=seq,
        timestamp=timestamp,
        load=engine_load(load, sample, load_only=True),
    )


def embed_response(finished: Finished) -> vpb.EmbedResponse:
    """A finished embedding input as the protocol's EmbedResponse (its one vector)."""
    vectors = finished.embedding
    if vectors is None or vectors.num_vectors != 1:
        raise ValueError("an engine-protocol embedding has exactly one vector")
    return vpb.EmbedResponse(
        embedding=vectors.rows()[0],
        prompt_tokens=finished.usage.prompt_tokens,
        embedding_dim=vectors.dimensions,
    )
