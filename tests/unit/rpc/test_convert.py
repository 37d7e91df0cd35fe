"""rpc.v1.convert: core events and snapshots -> proto messages."""

from __future__ import annotations

import dataclasses

import pytest

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server.core import stats
from llama_grpc_server.core.api import DiskTierStats, StatsSnapshot
from llama_grpc_server.core.requests.request import FinishReason, TokenDelta
from llama_grpc_server.rpc.v1 import convert
from llama_grpc_server.testing import fake_model_info
from tests.support.convert import finished, make_snapshot

DELTAS = [TokenDelta((10, 11), "he"), TokenDelta((), ""), TokenDelta((12,), "llo")]


@pytest.mark.parametrize("reason", list(FinishReason))
def test_every_finish_reason_has_a_wire_value(reason: FinishReason) -> None:
    """Each core finish reason maps to the proto enum value of the same name."""
    assert pb.FinishReason.Name(convert.finish_reason(reason)) == f"FINISH_REASON_{reason.name}"


def test_every_wire_finish_reason_is_produced() -> None:
    """The proto has no finish reason the core never produces (besides UNSPECIFIED)."""
    wire = set(pb.FinishReason.values()) - {pb.FINISH_REASON_UNSPECIFIED}
    assert set(convert.FINISH_REASONS.values()) == wire


def test_generate_response_joins_deltas() -> None:
    """The unary response carries all text and token ids, the finish, usage, timings and seed."""
    response = convert.generate_response("req-1", DELTAS, finished(FinishReason.MAX_TOKENS))
    assert response.text == "hello"
    assert list(response.token_ids) == [10, 11, 12]
    assert response.finish_reason == pb.FINISH_REASON_MAX_TOKENS
    assert response.finish.reason == pb.FINISH_REASON_MAX_TOKENS
    assert response.request_id == "req-1"
    assert response.seed == 1234
    assert response.usage == pb.Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=2)
    assert response.timings.ttft_ms == 10.0
    assert response.timings.total_ms == 30.0


def test_matched_stop_and_token_are_reported() -> None:
    """A stop string or stop token is carried in FinishInfo; token id 0 is still 'set'."""
    by_string = convert.finish_info(finished(FinishReason.STOP_SEQUENCE, matched_stop="\n\n"))
    by_token = convert.finish_info(finished(FinishReason.STOP_TOKEN, matched_token_id=0))
    assert by_string.matched_stop == "\n\n"
    assert not by_string.HasField("matched_token_id")
    assert by_token.HasField("matched_token_id")
    assert by_token.matched_token_id == 0


def test_stream_messages_are_delta_then_done() -> None:
    """A TokenDelta becomes a `delta` event and Finished a `done` event with the request id."""
    delta = convert.stream_generate_response(DELTAS[0], "req-2")
    done = convert.stream_generate_response(finished(), "req-2")
    assert delta.WhichOneof("event") == "delta"
    assert (delta.delta.text, list(delta.delta.token_ids)) == ("he", [10, 11])
    assert done.WhichOneof("event") == "done"
    assert done.done.request_id == "req-2"
    assert done.done.finish_reason == pb.FINISH_REASON_EOS
    assert done.done.usage.completion_tokens == 3


def test_generate_tokens_messages_match_stream_messages() -> None:
    """GenerateTokens events carry the same delta and done payloads as StreamGenerate."""
    for event in (DELTAS[2], finished()):
        tokens = convert.generate_tokens_response(event, "r")
        stream = convert.stream_generate_response(event, "r")
        assert tokens.WhichOneof("event") == stream.WhichOneof("event")
        assert tokens.SerializeToString() == stream.SerializeToString()


def test_stats_round_trip_every_field() -> None:
    """Every snapshot field, slots included, arrives under the same name (the disk tier's as
    disk_cache_<name>); the snapshot's DiskTierStats fields the proto lacks are named here."""
    snapshot = make_snapshot()
    message = convert.stats_response(snapshot, "m")
    assert message.model_name == "m"
    carried = set()
    for f in pb.GetStatsResponse.DESCRIPTOR.fields:
        if f.name.startswith("disk_cache_"):
            name = f.name.removeprefix("disk_cache_")
            assert getattr(message, f.name) == getattr(snapshot.disk_cache, name), f.name
            carried.add(name)
        elif f.name not in convert.NOT_SNAPSHOT:
            assert getattr(message, f.name) == getattr(snapshot, f.name), f.name
    assert {f.name for f in dataclasses.fields(DiskTierStats)} - carried == {"read_bytes"}
    assert [(s.slot_id, s.state, s.request_id, s.cached_tokens) for s in message.slots] == [
        (0, "generating", "req-9", 40),
        (1, "idle", "", 12),
    ]


def test_every_stats_proto_field_comes_from_the_snapshot() -> None:
    """Each GetStatsResponse field has a snapshot field of the same name, or a DiskTierStats
    field for disk_cache_<name> (none left at zero); only the model's name and the slots are
    filled otherwise."""
    proto_fields = {f.name for f in pb.GetStatsResponse.DESCRIPTOR.fields} - {"model_name"}
    sources = {f.name for f in dataclasses.fields(StatsSnapshot)}
    sources |= {"disk_cache_" + f.name for f in dataclasses.fields(DiskTierStats)}
    assert proto_fields <= sources


def test_model_info_round_trip() -> None:
    """Model facts arrive by name; eog ids as a list."""
    info = fake_model_info(n_ctx=1024)
    message = convert.model_info_response(info)
    assert message.model_name == "fake"
    assert message.n_ctx == 1024
    assert message.bos_token_id == info.bos_token_id
    assert list(message.eog_token_ids) == list(info.eog_token_ids)
    assert message.add_bos is True


def test_model_info_unknown_special_ids_stay_unset() -> None:
    """A model without BOS/EOS ids leaves the optional fields unset, not 0."""
    info = dataclasses.replace(fake_model_info(), bos_token_id=None, eos_token_id=None)
    message = convert.model_info_response(info)
    assert not message.HasField("bos_token_id")
    assert not message.HasField("eos_token_id")


def test_every_model_info_proto_field_comes_from_model_info() -> None:
    """Each GetModelInfoResponse field has a ModelInfo field of the same name."""
    proto_fields = {f.name for f in pb.GetModelInfoResponse.DESCRIPTOR.fields}
    assert proto_fields <= {f.name for f in dataclasses.fields(fake_model_info())}


@pytest.mark.parametrize(
    ("engine_state", "is_draining", "serving"),
    [("running", False, True), ("running", True, False), ("failed", False, False)],
)
def test_load_report_is_the_aggregate_of_the_snapshot(
    engine_state: str, is_draining: bool, serving: bool
) -> None:
    """Counts copied, KV usage as a fraction, running = active slots; serving only while the
    engine runs and the server is not draining; no request id anywhere."""
    snapshot = dataclasses.replace(make_snapshot(), kv_cells_used=3, kv_cells_total=12)
    snapshot = dataclasses.replace(snapshot, engine_state=engine_state)
    load = stats.load_of(snapshot, is_draining=is_draining, unix_ms=1_700_000_000_123)
    report = convert.load_report(load)
    for name in ("queue_depth", "active_slots", "n_parallel", "prefix_cache_hit_rate"):
        assert getattr(report, name) == getattr(snapshot, name), name
    assert (report.kv_cells_used, report.kv_cells_total, report.kv_cache_usage) == (3, 12, 0.25)
    assert report.requests_running == snapshot.active_slots
    assert (report.engine_state, report.serving) == (engine_state, serving)
    assert report.timestamp_unix_ms == 1_700_000_000_123
    assert "req-9" not in str(report)


def test_load_report_without_kv_cells_has_zero_usage() -> None:
    snapshot = dataclasses.replace(make_snapshot(), kv_cells_used=0, kv_cells_total=0)
    load = stats.load_of(snapshot, is_draining=False, unix_ms=0)
    assert convert.load_report(load).kv_cache_usage == 0.0
