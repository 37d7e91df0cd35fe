"""Speculative decoding at the edges: params.speculative validation (field-named errors), the
proto fields in usage and stats, the client's keyword arguments and result fields, the server's
options, and the response cache key (which speculation does not change)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from llama_grpc import Client
from llama_grpc.client import build_request
from llama_grpc.types import stats_from_proto, usage_from_proto
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.config.loading import ConfigError, load_settings
from llama_grpc_server.core import response_cache
from llama_grpc_server.core.api import StatsSnapshot
from llama_grpc_server.core.requests.request import (
    Finished,
    GenerationRequest,
    SamplingParams,
    SpeculativeMode,
    SpeculativeParams,
    StoppingParams,
    Usage,
)
from llama_grpc_server.observability.metrics import Metrics
from llama_grpc_server.observability.telemetry import Bus, Telemetry, TickEvent
from llama_grpc_server.rpc.v1 import convert
from llama_grpc_server.testing import FakeRunner
from tests.support.client import UnaryScript, channel, client, executor, unary
from tests.support.convert import make_snapshot
from tests.support.speculative_scheduler import echo_model, prompt_of
from tests.support.speculative_scheduler import make as scheduler_for_tests
from tests.support.speculative_scheduler import req as spec_request
from tests.support.validation import text_request

__all__ = ["channel", "client", "executor", "unary"]  # fixtures

from ...conftest import samples, value


def speculative(**fields: Any) -> dict[str, Any]:
    return {"params": pb.GenerationParams(speculative=pb.SpeculativeParams(**fields))}


# -- validation ------------------------------------------------------------------------------------


def test_unset_speculative_takes_the_server_defaults() -> None:
    """Nothing set: every field None (the scheduler resolves them with --speculative etc.)."""
    assert text_request().speculative == SpeculativeParams()


def test_set_fields_pass_through() -> None:
    got = text_request(
        **speculative(mode=pb.SPECULATIVE_MODE_ON, draft_max=32, ngram_min=1, ngram_max=16)
    ).speculative
    assert got == SpeculativeParams(SpeculativeMode.ON, 32, 1, 16)
    auto = text_request(**speculative(mode=pb.SPECULATIVE_MODE_AUTO)).speculative
    assert auto.mode is SpeculativeMode.AUTO
    off = text_request(**speculative(mode=pb.SPECULATIVE_MODE_OFF)).speculative
    assert off.mode is SpeculativeMode.OFF


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"mode": 7}, "params.speculative.mode", "unknown speculative mode 7"),
        ({"draft_max": 0}, "params.speculative.draft_max", "between 1 and 32, got 0"),
        ({"draft_max": 33}, "params.speculative.draft_max", "between 1 and 32, got 33"),
        ({"ngram_min": 0}, "params.speculative.ngram_min", "between 1 and 16, got 0"),
        ({"ngram_max": 17}, "params.speculative.ngram_max", "between 1 and 16, got 17"),
        ({"ngram_min": 4, "ngram_max": 3}, "params.speculative.ngram_min", "(4) must be at most"),
        # against the server's ngram_max (4)
        ({"ngram_min": 5}, "params.speculative.ngram_min", "server's (2, 4)"),
        # against the server's ngram_min (2)
        ({"ngram_max": 1}, "params.speculative.ngram_max", "ngram_max (1)"),
    ],
)
def test_bad_speculative_fields_name_the_field(
    fields: dict[str, int], field: str, message: str
) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        text_request(**speculative(**fields))
    assert caught.value.field == field
    assert message in str(caught.value)


# -- wire ------------------------------------------------------------------------------------------


def test_usage_carries_draft_counts() -> None:
    usage = convert.usage(Usage(3, 10, 0, draft_tokens=12, accepted_draft_tokens=9))
    assert (usage.draft_tokens, usage.accepted_draft_tokens) == (12, 9)
    back = usage_from_proto(usage)
    assert (back.draft_tokens, back.accepted_draft_tokens) == (12, 9)


def spec_snapshot() -> StatsSnapshot:
    """A stats snapshot with speculation totals: 40 drafted, 30 accepted, in 5 ticks."""
    return dataclasses.replace(
        make_snapshot(),
        spec_draft_tokens=40,
        spec_accepted_tokens=30,
        spec_acceptance_rate=0.75,
        spec_ticks=5,
    )


def test_stats_carry_speculation_totals() -> None:
    snapshot = spec_snapshot()
    message = convert.stats_response(snapshot)
    assert (message.spec_draft_tokens, message.spec_accepted_tokens) == (40, 30)
    assert (message.spec_acceptance_rate, message.spec_ticks) == (0.75, 5)
    stats = stats_from_proto(message)
    assert (stats.spec_draft_tokens, stats.spec_accepted_tokens, stats.spec_ticks) == (40, 30, 5)
    assert stats.spec_acceptance_rate == 0.75


# -- client ----------------------------------------------------------------------------------------


def test_client_sends_speculative_only_when_given() -> None:
    request = build_request(
        pb.GenerateTokensRequest(token_ids=[1]),
        {"speculative": "auto", "draft_max": 6, "ngram_min": 1, "ngram_max": 3},
    )
    spec = request.params.speculative
    assert spec.mode == pb.SPECULATIVE_MODE_AUTO and spec.draft_max == 6
    assert (spec.ngram_min, spec.ngram_max) == (1, 3)
    plain = build_request(pb.GenerateTokensRequest(token_ids=[1]), {})
    assert not plain.params.HasField("speculative")
    with pytest.raises(ValueError, match="speculative must be"):
        build_request(pb.GenerateTokensRequest(token_ids=[1]), {"speculative": "sometimes"})


def test_client_result_exposes_draft_counts(
    client: Client,
    unary: UnaryScript,
) -> None:
    response = pb.GenerateResponse(usage=pb.Usage(draft_tokens=8, accepted_draft_tokens=5))
    _, request, result = unary(lambda: client.generate("p", speculative="on"), "Generate", response)
    assert request.params.speculative.mode == pb.SPECULATIVE_MODE_ON
    assert (result.usage.draft_tokens, result.usage.accepted_draft_tokens) == (8, 5)


# -- server options --------------------------------------------------------------------------------


def test_server_options_reach_the_scheduler_settings() -> None:
    settings = load_settings(
        ["--speculative", "auto", "--draft-max", "12", "--ngram-min", "1", "--ngram-max", "6"],
        {},
    )
    sched = settings.scheduler
    assert (sched.speculative, sched.draft_max, sched.ngram_min, sched.ngram_max) == (
        "auto",
        12,
        1,
        6,
    )
    assert load_settings([], {}).scheduler.speculative == "off"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--speculative", "maybe"], "--speculative='maybe'"),
        (["--draft-max", "33"], "between 1 and 32"),
        (["--ngram-min", "5", "--ngram-max", "3"], "--ngram-min=5"),
    ],
)
def test_bad_server_options_are_refused(argv: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[")):
        load_settings(argv, {})


def test_a_smaller_ngram_max_shrinks_the_default_ngram_min() -> None:
    """Only --ngram-max 1 given: the defaulted --ngram-min follows it down."""
    sched = load_settings(["--ngram-max", "1"], {}).scheduler
    assert (sched.ngram_min, sched.ngram_max) == (1, 1)


# -- response cache --------------------------------------------------------------------------------


def test_speculation_does_not_change_the_response_cache_key() -> None:
    """Exact-match verification keeps the sampler's tokens, so a request with and without
    speculation may share a cached result."""
    base = GenerationRequest("r", (1, 2, 3), SamplingParams(temperature=0.0), StoppingParams())
    on = dataclasses.replace(base, speculative=SpeculativeParams(SpeculativeMode.ON, 4))
    assert response_cache.response_key("m", base) == response_cache.response_key("m", on)


# -- metrics and tick events -----------------------------------------------------------------------


def test_prometheus_series_read_the_snapshot() -> None:
    snapshot = spec_snapshot()
    metrics = Metrics()
    metrics.watch(lambda: {"m": snapshot})
    got = samples(metrics.render())
    assert value(got, "llama_grpc:spec_decode_num_draft_tokens_total", model="m") == 40
    assert value(got, "llama_grpc:spec_decode_num_accepted_tokens_total", model="m") == 30
    assert value(got, "llama_grpc:spec_decode_num_ticks_total", model="m") == 5
    assert value(got, "llama_grpc:spec_decode_acceptance_rate", model="m") == 0.75


def test_tick_events_count_drafts_and_accepted_tokens() -> None:
    """Summed over a request's ticks, the tick events' draft counts are its usage's."""
    seen: list[TickEvent] = []
    bus = Bus()
    bus.attach("tick", lambda name, event: seen.append(event))  # type: ignore[arg-type]
    telemetry = Telemetry(bus=bus)
    s = scheduler_for_tests(n_parallel=1)
    runner = FakeRunner(eos_id=2)
    runner.next_token = echo_model()  # type: ignore[method-assign]
    s.add(spec_request("r", prompt_of(4), max_tokens=60))
    usage = None
    while s.has_work:
        plan, _ = s.schedule()
        if plan is None:
            continue
        result = runner.execute(plan)
        for _, event in s.update(plan, result):
            if isinstance(event, Finished):
                usage = event.usage
        if plan.chunks:
            telemetry.on_tick(plan, result, s)
    assert usage is not None and usage.draft_tokens > 0
    assert sum(e.draft_tokens for e in seen) == usage.draft_tokens
    assert sum(e.accepted_draft_tokens for e in seen) == usage.accepted_draft_tokens
    assert all(e.batch_size == e.decode_tokens + e.prefill_tokens + e.draft_tokens for e in seen)
