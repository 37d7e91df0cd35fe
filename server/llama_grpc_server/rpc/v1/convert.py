"""core events and snapshots -> proto messages. Pure: no grpc, no engine calls.
A cancelled request has no finish reason: it ends with a status (a Failed event), not a result."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server.core.adapters import AdapterEntry
from llama_grpc_server.core.api import ModelInfo, StatsSnapshot
from llama_grpc_server.core.requests import request as core
from llama_grpc_server.core.stats import Load
from llama_grpc_server.core.tools.types import ToolCall, ToolCallDelta
from llama_grpc_server.models.pool import ModelState, ModelStatus

FINISH_REASONS: dict[core.FinishReason, pb.FinishReason.ValueType] = {
    core.FinishReason.EOS: pb.FINISH_REASON_EOS,
    core.FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    core.FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    core.FinishReason.MAX_TOKENS: pb.FINISH_REASON_MAX_TOKENS,
    core.FinishReason.CONTEXT_LENGTH: pb.FINISH_REASON_CONTEXT_LENGTH,
    core.FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
    core.FinishReason.EMBEDDED: pb.FINISH_REASON_EMBEDDED,
    core.FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}


def finish_reason(reason: core.FinishReason) -> pb.FinishReason.ValueType:
    return FINISH_REASONS[reason]


def usage(value: core.Usage) -> pb.Usage:
    return pb.Usage(**dataclasses.asdict(value))


def timings(value: core.Timings) -> pb.Timings:
    return pb.Timings(**dataclasses.asdict(value))


def finish_info(finished: core.Finished) -> pb.FinishInfo:
    return pb.FinishInfo(
        reason=finish_reason(finished.reason),
        matched_stop=finished.matched_stop,
        matched_token_id=finished.matched_token_id,
    )


def token_logprob(value: core.TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=value.token_id,
        token=value.token,
        logprob=value.logprob,
        top=[
            pb.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in value.top
        ],
    )


def tool_call(call: ToolCall) -> pb.ToolCall:
    return pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments)


def tool_call_delta(delta: ToolCallDelta) -> pb.ToolCallDelta:
    return pb.ToolCallDelta(
        index=delta.index, id=delta.id, name=delta.name, arguments=delta.arguments
    )


def generation_delta(delta: core.TokenDelta) -> pb.GenerationDelta:
    return pb.GenerationDelta(
        text=delta.text,
        token_ids=delta.token_ids,
        logprobs=[token_logprob(lp) for lp in delta.logprobs],
        tool_calls=[tool_call_delta(d) for d in delta.tool_calls],
        reasoning=delta.reasoning,
        index=delta.index,
    )


def generation_done(finished: core.Finished, request_id: str) -> pb.GenerationDone:
    return pb.GenerationDone(
        finish_reason=finish_reason(finished.reason),
        usage=usage(finished.usage),
        timings=timings(finished.timings),
        finish=finish_info(finished),
        request_id=request_id,
        seed=finished.seed,
        truncated=finished.usage.truncated_prompt_tokens > 0,
    )


def generate_response(
    request_id: str, deltas: Sequence[core.TokenDelta], finished: core.Finished
) -> pb.GenerateResponse:
    """All deltas joined into one result."""
    return pb.GenerateResponse(
        text="".join(delta.text for delta in deltas),
        token_ids=[token_id for delta in deltas for token_id in delta.token_ids],
        finish_reason=finish_reason(finished.reason),
        usage=usage(finished.usage),
        timings=timings(finished.timings),
        finish=finish_info(finished),
        request_id=request_id,
        seed=finished.seed,
        logprobs=[token_logprob(lp) for delta in deltas for lp in delta.logprobs],
        truncated=finished.usage.truncated_prompt_tokens > 0,
        tool_calls=[tool_call(call) for call in finished.tool_calls],
        reasoning="".join(delta.reasoning for delta in deltas),
    )


def stream_generate_response(
    event: core.TokenDelta | core.Finished, request_id: str
) -> pb.StreamGenerateResponse:
    if isinstance(event, core.TokenDelta):
        return pb.StreamGenerateResponse(delta=generation_delta(event))
    return pb.StreamGenerateResponse(done=generation_done(event, request_id))


def generate_tokens_response(
    event: core.TokenDelta | core.Finished, request_id: str
) -> pb.GenerateTokensResponse:
    if isinstance(event, core.TokenDelta):
        return pb.GenerateTokensResponse(delta=generation_delta(event))
    return pb.GenerateTokensResponse(done=generation_done(event, request_id))


DISK = "disk_cache_"  # GetStatsResponse's disk-tier fields: StatsSnapshot.disk_cache's, by name


def stats_response(
    snapshot: StatsSnapshot, model_name: str = "", adapters: Sequence[AdapterEntry] = ()
) -> pb.GetStatsResponse:
    """Field for field by name; snapshot fields the proto does not carry (yet) are left out.
    `adapters`: the model's loaded adapters, shown with their counters."""
    names = [f.name for f in pb.GetStatsResponse.DESCRIPTOR.fields if f.name not in NOT_SNAPSHOT]
    fields = {name: getattr(snapshot, name) for name in names if not name.startswith(DISK)}
    if snapshot.disk_cache is not None:
        fields |= {
            name: getattr(snapshot.disk_cache, name.removeprefix(DISK))
            for name in names
            if name.startswith(DISK)
        }
    slots = [pb.SlotStats(**dataclasses.asdict(slot)) for slot in snapshot.slots]
    shown = [adapter(a, model_name, snapshot) for a in adapters]
    return pb.GetStatsResponse(**fields, slots=slots, model_name=model_name, adapters=shown)


def adapter(entry: AdapterEntry, model_name: str, snapshot: StatsSnapshot | None) -> pb.Adapter:
    """A loaded adapter with its counters from `snapshot` (0 without one)."""
    usage = next((u for u in snapshot.adapters if u.name == entry.name), None) if snapshot else None
    return pb.Adapter(
        name=entry.name,
        path=entry.path,
        default_scale=entry.default_scale,
        rank=entry.rank,
        alpha=entry.alpha,
        num_tensors=entry.num_tensors,
        size_bytes=entry.size_bytes,
        sha256=entry.digest,
        model=model_name,
        requests=usage.requests if usage else 0,
        generated_tokens=usage.generated_tokens if usage else 0,
        passes=usage.passes if usage else 0,
    )


NOT_SNAPSHOT = frozenset(
    {"slots", "model_name", "adapters"}
)  # GetStatsResponse fields filled otherwise
MODEL_STATES = {
    state.value: pb.ModelState.Value("MODEL_STATE_" + state.name) for state in ModelState
}


def model_status(status: ModelStatus) -> pb.ModelStatus:
    """Field for field by name; the state as the enum."""
    fields = dataclasses.asdict(status) | {"state": MODEL_STATES[status.state]}
    return pb.ModelStatus(**fields)


def load_report(load: Load) -> pb.LoadReport:
    """The aggregate load (core.stats.load_of) as WatchLoad reports it."""
    return pb.LoadReport(
        queue_depth=load.queue_depth,
        active_slots=load.active_slots,
        n_parallel=load.n_parallel,
        kv_cells_used=load.kv_cells_used,
        kv_cells_total=load.kv_cells_total,
        kv_cache_usage=load.kv_cache_usage,
        prefix_cache_hit_rate=load.prefix_cache_hit_rate,
        requests_running=load.active_slots,
        engine_state=load.engine_state,
        serving=load.serving,
        timestamp_unix_ms=load.timestamp_unix_ms,
    )


def model_info_response(info: ModelInfo) -> pb.GetModelInfoResponse:
    """Field for field by name; unknown BOS/EOS ids stay unset."""
    fields = {f.name: getattr(info, f.name) for f in pb.GetModelInfoResponse.DESCRIPTOR.fields}
    return pb.GetModelInfoResponse(**{k: v for k, v in fields.items() if v is not None})
