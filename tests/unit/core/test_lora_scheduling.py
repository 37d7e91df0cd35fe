"""LoRA adapters in the scheduler and the catalog (no model): a pass runs one adapter set, sets
take strict turns, a request keeps its set, the prefix cache never crosses sets, the counters
count; the catalog resolves names, scales and permissions with the field named."""

from __future__ import annotations

import dataclasses

import pytest

from llama_grpc_server import errors
from llama_grpc_server.config.settings import LoraSpec, parse_lora
from llama_grpc_server.core.adapters import (
    AdapterCatalog,
    AdapterEntry,
    AdapterRef,
    AdapterSet,
    cache_key,
    scoped,
)
from llama_grpc_server.core.requests.request import Finished, GenerationRequest, Request
from llama_grpc_server.testing import FakeRunner
from tests.support.scheduler import GREEDY, drive, finals, make, outputs, req

A: AdapterSet = (AdapterRef("a", 1.0, "aaaa"),)
B: AdapterSet = (AdapterRef("b", 0.5, "bbbb"),)
AB: AdapterSet = (AdapterRef("a", 1.0, "aaaa"), AdapterRef("b", 0.5, "bbbb"))


def with_adapters(request: Request, adapters: AdapterSet) -> Request:
    spec = dataclasses.replace(
        request.spec, adapters=adapters, cache_scope=scoped(request.spec.cache_scope, adapters)
    )
    return Request(spec)


def test_every_pass_runs_one_adapter_set_and_the_sets_take_strict_turns() -> None:
    s, runner = make(n_parallel=6, n_batch=256), FakeRunner()
    sets = [(), A, B]
    for i in range(6):
        s.add(with_adapters(req(f"r{i}", 20, 12), sets[i % 3]))
    events = drive(s, runner)
    assert {rid: type(e) for rid, e in finals(events).items()} == {
        f"r{i}": Finished for i in range(6)
    }
    passes = [p for p in runner.plans if p.chunks]
    for plan in passes:
        owners = {c.request_id for c in plan.chunks}
        assert {sets[int(rid[1:]) % 3] for rid in owners} == {plan.adapters}
    # sets take strict turns: never-served sets first (by the earliest arrival), then the set
    # whose last pass is oldest; each set needs 2 prompt passes (chunks of 16) and 11 decodes
    assert [p.adapters for p in passes] == [(), A, B] * 13


def test_a_set_alone_runs_like_the_base_model_and_outputs_do_not_depend_on_neighbours() -> None:
    alone_s, alone_runner = make(n_parallel=1, n_batch=256), FakeRunner()
    alone_s.add(with_adapters(req("x", 20, 10), A))
    expected = outputs(drive(alone_s, alone_runner))["x"]
    s, runner = make(n_parallel=3, n_batch=256), FakeRunner()
    s.add(with_adapters(req("x", 20, 10), A))
    s.add(with_adapters(req("y", 25, 10), B))
    s.add(req("z", 30, 10))
    got = outputs(drive(s, runner))
    assert got["x"] == expected
    assert {p.adapters for p in alone_runner.plans if p.chunks} == {A}


def test_counters_per_adapter_and_switches() -> None:
    s, runner = make(n_parallel=4, n_batch=256), FakeRunner()
    s.add(with_adapters(req("x", 20, 5), A))
    s.add(with_adapters(req("y", 20, 7), AB))
    s.add(req("z", 20, 3))
    drive(s, runner)
    passes = [p.adapters for p in runner.plans if p.chunks]
    usage = {u.name: u for u in s.snapshot(512).adapters}
    assert usage["a"].requests == 2
    assert usage["b"].requests == 1
    assert usage["a"].generated_tokens == 5 + 7
    assert usage["b"].generated_tokens == 7
    assert usage["a"].passes == passes.count(A) + passes.count(AB)
    assert usage["b"].passes == passes.count(AB)
    switches = sum(1 for before, now in zip([(), *passes], passes, strict=False) if before != now)
    assert s.snapshot(512).adapter_switches == switches
    # z needs 4 passes, x 6, y 8 (2 prompt passes each): turns while three, then two, then one
    assert passes == [A, AB, ()] * 4 + [A, AB] * 2 + [AB] * 2
    assert switches == 16


def test_the_prefix_cache_is_never_shared_between_adapter_sets() -> None:
    s, runner = make(n_parallel=1, n_batch=256, chunk=64), FakeRunner()
    prompt = tuple(range(1, 41))

    def run(rid: str, adapters: AdapterSet) -> int:
        base = GenerationRequest(rid, prompt, GREEDY, req("_", 1, 4).spec.stopping)
        request = with_adapters(Request(base), adapters)
        s.add(request)
        drive(s, runner)
        return request.num_cached_prompt

    assert run("first", A) == 0
    assert run("other-set", B) == 0  # the slot held A's prefix: not B's to reuse
    assert run("base", ()) == 0
    assert run("again-b", B) == 0  # the slot's cache is the base model's now
    assert run("b-twice", B) == len(prompt) - 1  # B's own prefix: reused


def test_adapter_users_counts_queued_and_running_requests() -> None:
    s, runner = make(n_parallel=1, n_batch=256), FakeRunner()
    s.add(with_adapters(req("x", 20, 50), A))
    s.add(with_adapters(req("y", 20, 5), AB))
    plan, _ = s.schedule()
    assert plan is not None
    s.update(plan, runner.execute(plan))
    assert s.adapter_users("a") == 2  # one running, one queued
    assert s.adapter_users("b") == 1
    assert s.adapter_users("c") == 0


def test_cache_keys_and_scopes() -> None:
    assert cache_key(()) == ""
    assert cache_key(AB) == "aaaa*1.0+bbbb*0.5"
    assert scoped("s", ()) == "s"
    assert scoped("s", A) == "s\x1flora=aaaa*1.0"
    assert scoped("s", A) != scoped("s", (AdapterRef("a", 0.5, "aaaa"),))
    # the name is a label: equal files at equal scales share
    assert scoped("", A) == scoped("", (AdapterRef("renamed", 1.0, "aaaa"),))


def catalog() -> AdapterCatalog:
    cat = AdapterCatalog()
    cat.add(AdapterEntry("sql", "/x/sql.gguf", 1.0, "d1", 8, 16.0, 48, 1000))
    cat.add(AdapterEntry("chat", "/x/chat.gguf", 0.5, "d2", 4, 8.0, 24, 500))
    return cat


def test_resolve_sorts_fills_default_scales_and_drops_zero_scales() -> None:
    got = catalog().resolve([("sql", 2.0), ("chat", None)])
    assert got == (AdapterRef("chat", 0.5, "d2"), AdapterRef("sql", 2.0, "d1"))
    assert catalog().resolve([("sql", 0.0)]) == ()


@pytest.mark.parametrize(
    ("requested", "field", "message"),
    [
        ([("nope", None)], "params.lora[0].name", "unknown adapter 'nope' (this model serves: "),
        ([("sql", None), ("sql", 1.0)], "params.lora[1].name", "adapter 'sql' is named twice"),
        ([("sql", 17.0)], "params.lora[0].scale", "scale must be finite and within [-16, 16]"),
        ([("sql", float("nan"))], "params.lora[0].scale", "got nan"),
    ],
)
def test_resolve_refuses_with_the_entry_named(
    requested: list[tuple[str, float | None]], field: str, message: str
) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        catalog().resolve(requested)
    assert caught.value.field == field
    assert message in caught.value.message


def test_resolve_refuses_an_adapter_the_tenant_may_not_use() -> None:
    assert catalog().resolve([("sql", None)], allowed={"sql"}) == (AdapterRef("sql", 1.0, "d1"),)
    with pytest.raises(errors.PermissionDenied) as caught:
        catalog().resolve([("sql", None), ("chat", None)], allowed={"sql"})
    assert caught.value.field == "params.lora[1].name"
    assert caught.value.code == "PERMISSION_DENIED"


@pytest.mark.parametrize(
    ("entry", "spec"),
    [
        ("sql=/a/sql.gguf", LoraSpec("sql", "/a/sql.gguf", 1.0, "")),
        ("sql=/a/sql.gguf:0.25", LoraSpec("sql", "/a/sql.gguf", 0.25, "")),
        ("coder/sql=/a/sql.gguf:-1", LoraSpec("sql", "/a/sql.gguf", -1.0, "coder")),
        ("sql=/a:b/sql.gguf", LoraSpec("sql", "/a:b/sql.gguf", 1.0, "")),
    ],
)
def test_parse_lora(entry: str, spec: LoraSpec) -> None:
    assert parse_lora(entry) == spec


@pytest.mark.parametrize("entry", ["sql", "=/a.gguf", "sql="])
def test_parse_lora_refuses(entry: str) -> None:
    with pytest.raises(ValueError, match=r"NAME=PATH"):
        parse_lora(entry)
