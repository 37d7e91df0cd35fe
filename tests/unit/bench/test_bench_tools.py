"""bench/tools.py's checker (BFCL's AST checking on JSON calls) and its cases: exact verdicts on
hand-made answers, no model and no server."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load() -> ModuleType:
    # by path, under its own name: the repository root has a tools/ folder too
    spec = importlib.util.spec_from_file_location("bench_tools", BENCH / "tools.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_tools"] = module
    spec.loader.exec_module(module)
    return module


bt = _load()
Call, Verdict = bt.Call, bt.Verdict

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
}
CONVERT = {
    "name": "convert_currency",
    "parameters": {
        "type": "object",
        "properties": {
            "amount": {"type": "number"},
            "from_currency": {"type": "string"},
            "to_currency": {"type": "string"},
        },
        "required": ["amount", "from_currency", "to_currency"],
    },
}
FLIGHT = {
    "name": "book_flight",
    "parameters": {
        "type": "object",
        "properties": {
            "origin": {"type": "string"},
            "passengers": {
                "type": "object",
                "properties": {"adults": {"type": "integer"}, "children": {"type": "integer"}},
                "required": ["adults"],
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                },
            },
            "tags": {"type": "array", "items": {"type": "string"}},
            "flexible": {"type": "boolean"},
        },
        "required": ["origin", "passengers"],
    },
}


def case(
    category: str,
    functions: list[dict[str, Any]],
    truth: list[dict[str, dict[str, list[Any]]]],
    answer_contains: tuple[str, ...] = (),
) -> Any:
    tools = [{"type": "function", "function": f} for f in functions]
    messages = [{"role": "user", "content": "q"}]
    return bt.Case("c", category, messages, tools, truth, answer_contains)


def call(name: str, **args: Any) -> Any:
    return Call(name, json.dumps(args))


SIMPLE = case("simple", [WEATHER], [{"get_weather": {"city": ["Tokyo"], "unit": ["", "celsius"]}}])
PARALLEL = case(
    "parallel",
    [WEATHER],
    [
        {"get_weather": {"city": ["Paris"], "unit": [""]}},
        {"get_weather": {"city": ["London"], "unit": [""]}},
    ],
)


def verdict(c: Any, calls: list[Any], text: str = "") -> tuple[bool, str]:
    v = bt.check_case(c, calls, text)
    return v.passed, v.error_type


# -- simple calls: a pass and each kind of failure ---------------------------------------------


def test_simple_pass_with_and_without_optional() -> None:
    assert verdict(SIMPLE, [call("get_weather", city="Tokyo")]) == (True, "")
    assert verdict(SIMPLE, [call("get_weather", city="Tokyo", unit="celsius")]) == (True, "")


def test_strings_standardized_like_bfcl() -> None:
    assert bt.standardize_string("New York, N.Y.") == "newyorkny"
    assert bt.standardize_string("It's") == 'it"s'
    assert verdict(SIMPLE, [call("get_weather", city=" tokyo.")]) == (True, "")
    assert verdict(SIMPLE, [call("get_weather", city="Kyoto")]) == (False, "value_error")


def test_wrong_name_missing_required_unexpected_param() -> None:
    assert verdict(SIMPLE, [call("get_forecast", city="Tokyo")]) == (False, "wrong_func_name")
    assert verdict(SIMPLE, [call("get_weather", unit="celsius")]) == (False, "missing_required")
    assert verdict(SIMPLE, [call("get_weather", city="Tokyo", days=3)]) == (
        False,
        "unexpected_param",
    )


def test_parameter_in_schema_but_not_accepted_is_unexpected() -> None:
    c = case("simple", [WEATHER], [{"get_weather": {"city": ["Tokyo"]}}])
    assert verdict(c, [call("get_weather", city="Tokyo", unit="celsius")]) == (
        False,
        "unexpected_param",
    )


def test_empty_string_for_an_optional_parameter_passes_like_bfcl() -> None:
    assert verdict(SIMPLE, [call("get_weather", city="Tokyo", unit="")]) == (True, "")
    assert verdict(SIMPLE, [call("get_weather", city="")]) == (False, "value_error")


def test_optional_value_expected_must_be_given() -> None:
    c = case("simple", [WEATHER], [{"get_weather": {"city": ["Tokyo"], "unit": ["celsius"]}}])
    assert verdict(c, [call("get_weather", city="Tokyo")]) == (False, "missing_optional")
    assert verdict(c, [call("get_weather", city="Tokyo", unit="fahrenheit")]) == (
        False,
        "value_error",
    )


def test_types_int_for_number_but_not_string_or_bool() -> None:
    c = case(
        "simple",
        [CONVERT],
        [
            {
                "convert_currency": {
                    "amount": [250.0],
                    "from_currency": ["USD"],
                    "to_currency": ["EUR"],
                }
            }
        ],
    )
    ok = {"from_currency": "USD", "to_currency": "EUR"}
    assert verdict(c, [call("convert_currency", amount=250, **ok)]) == (True, "")
    assert verdict(c, [call("convert_currency", amount=250.0, **ok)]) == (True, "")
    assert verdict(c, [call("convert_currency", amount="250", **ok)]) == (False, "type_error")
    assert verdict(c, [call("convert_currency", amount=True, **ok)]) == (False, "type_error")


def test_float_for_integer_is_a_type_error() -> None:
    c = case(
        "nested", [FLIGHT], [{"book_flight": {"origin": ["SFO"], "passengers": [{"adults": [2]}]}}]
    )
    assert verdict(c, [call("book_flight", origin="SFO", passengers={"adults": 2})]) == (True, "")
    assert verdict(c, [call("book_flight", origin="SFO", passengers={"adults": 2.5})]) == (
        False,
        "type_error",
    )


def test_invalid_json_and_non_object_arguments_fail() -> None:
    assert verdict(SIMPLE, [Call("get_weather", '{"city": "Tokyo"')]) == (False, "invalid_json")
    assert verdict(SIMPLE, [Call("get_weather", '["Tokyo"]')]) == (False, "invalid_json")


def test_wrong_count() -> None:
    assert verdict(SIMPLE, []) == (False, "wrong_count")
    two = [call("get_weather", city="Tokyo"), call("get_weather", city="Tokyo")]
    assert verdict(SIMPLE, two) == (False, "wrong_count")


# -- parallel: any order, each call to a distinct expected call --------------------------------


def test_parallel_any_order() -> None:
    paris, london = call("get_weather", city="Paris"), call("get_weather", city="London")
    assert verdict(PARALLEL, [paris, london]) == (True, "")
    assert verdict(PARALLEL, [london, paris]) == (True, "")


def test_parallel_duplicate_call_cannot_match_twice() -> None:
    paris = call("get_weather", city="Paris")
    assert verdict(PARALLEL, [paris, paris]) == (False, "value_error")


def test_parallel_matching_is_not_greedy() -> None:
    # call 0 fits both expected calls, call 1 only the first: a greedy first-fit would give
    # call 0 to the first and fail; a matching finds call 0 -> second, call 1 -> first
    c = case(
        "parallel",
        [WEATHER],
        [
            {"get_weather": {"city": ["Paris"], "unit": ["", "celsius"]}},
            {"get_weather": {"city": ["Paris"], "unit": ["celsius"]}},
        ],
    )
    calls = [call("get_weather", city="Paris", unit="celsius"), call("get_weather", city="Paris")]
    assert verdict(c, calls) == (True, "")


def test_parallel_multiple_wrong_function() -> None:
    c = case(
        "parallel_multiple",
        [WEATHER, CONVERT],
        [
            {"get_weather": {"city": ["Berlin"]}},
            {
                "convert_currency": {
                    "amount": [50],
                    "from_currency": ["EUR"],
                    "to_currency": ["USD"],
                }
            },
        ],
    )
    good = call("convert_currency", amount=50, from_currency="EUR", to_currency="USD")
    assert verdict(c, [good, call("get_weather", city="Berlin")]) == (True, "")
    assert verdict(c, [good, good]) == (False, "wrong_func_name")


# -- irrelevance and final answers -------------------------------------------------------------


def test_irrelevance_passes_only_without_a_call() -> None:
    c = case("irrelevance", [WEATHER], [])
    assert verdict(c, [], "Why did the cat...") == (True, "")
    assert verdict(c, [call("get_weather", city="Paris")]) == (False, "unexpected_call")
    assert verdict(c, [Call("get_weather", "not json")]) == (False, "unexpected_call")


def test_final_answer_must_use_the_result() -> None:
    c = case("multi_turn", [WEATHER], [], ("18",))
    assert verdict(c, [], "It is 18°C and raining in Tokyo.") == (True, "")
    assert verdict(c, [], "It is raining in Tokyo.") == (False, "answer_missing")
    assert verdict(c, [call("get_weather", city="Tokyo")], "18") == (False, "unexpected_call")
    echoed = '{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n{"temperature_c": 18}'
    assert verdict(c, [], echoed) == (False, "call_in_text")
    irrelevance = case("irrelevance", [WEATHER], [])
    assert verdict(irrelevance, [], echoed) == (True, "")  # BFCL: no call was parsed


# -- nested objects, arrays, enums, booleans ---------------------------------------------------


NESTED = case(
    "nested",
    [FLIGHT],
    [
        {
            "book_flight": {
                "origin": ["SFO"],
                "passengers": [{"adults": [2], "children": ["", 0]}],
                "items": [
                    "",
                    [{"sku": ["A-1"], "qty": [2]}, {"sku": ["B-2"], "qty": [1]}],
                ],
                "tags": ["", ["work", "travel"]],
                "flexible": ["", True],
            }
        }
    ],
)


def test_nested_object_recursive() -> None:
    base = {"origin": "SFO"}
    assert verdict(NESTED, [call("book_flight", **base, passengers={"adults": 2})]) == (True, "")
    assert verdict(
        NESTED, [call("book_flight", **base, passengers={"adults": 2, "children": 0})]
    ) == (True, "")
    assert verdict(
        NESTED, [call("book_flight", **base, passengers={"adults": 2, "children": 1})]
    ) == (False, "value_error")
    assert verdict(NESTED, [call("book_flight", **base, passengers={"children": 1})]) == (
        False,
        "missing_required",
    )
    assert verdict(NESTED, [call("book_flight", **base, passengers={"adults": 2, "pets": 1})]) == (
        False,
        "unexpected_param",
    )
    assert verdict(NESTED, [call("book_flight", **base, passengers=2)]) == (False, "type_error")


def test_arrays_in_order_and_of_objects() -> None:
    p = {"origin": "SFO", "passengers": {"adults": 2}}
    items = [{"sku": "a-1", "qty": 2}, {"sku": "B-2", "qty": 1}]
    assert verdict(NESTED, [call("book_flight", **p, items=items)]) == (True, "")
    assert verdict(NESTED, [call("book_flight", **p, items=items[::-1])]) == (False, "value_error")
    assert verdict(NESTED, [call("book_flight", **p, items=items[:1])]) == (False, "value_error")
    bad_type = [{"sku": "A-1", "qty": "2"}, {"sku": "B-2", "qty": 1}]
    assert verdict(NESTED, [call("book_flight", **p, items=bad_type)]) == (False, "type_error")
    assert verdict(NESTED, [call("book_flight", **p, tags=["Work", "travel"])]) == (True, "")
    assert verdict(NESTED, [call("book_flight", **p, tags=["travel", "work"])]) == (
        False,
        "value_error",
    )
    assert verdict(NESTED, [call("book_flight", **p, tags="work")]) == (False, "type_error")


def test_booleans_exact() -> None:
    p = {"origin": "SFO", "passengers": {"adults": 2}}
    assert verdict(NESTED, [call("book_flight", **p, flexible=True)]) == (True, "")
    assert verdict(NESTED, [call("book_flight", **p, flexible=False)]) == (False, "value_error")
    assert verdict(NESTED, [call("book_flight", **p, flexible=1)]) == (False, "type_error")
    assert verdict(NESTED, [call("book_flight", **p, flexible="true")]) == (False, "type_error")


# -- the cases file, rates, requests -----------------------------------------------------------


def test_cases_file_categories_and_own_answers() -> None:
    cases = bt.load_cases()
    assert len(cases) >= 40
    counts = {c: sum(x.category == c for x in cases) for c in bt.CATEGORIES}
    assert all(n >= 5 for n in counts.values()), counts
    assert all(not c.ground_truth for c in cases if c.category == "irrelevance")
    parallel = [c for c in cases if c.category in ("parallel", "parallel_multiple")]
    assert all(len(c.ground_truth) >= 2 for c in parallel)
    multi = [c for c in cases if c.category == "multiple"]
    assert all(len(c.tools) >= 2 and len(c.ground_truth) == 1 for c in multi)
    for c in cases:
        text = " ".join(c.answer_contains)
        assert bt.check_case(c, bt.canonical_calls(c), text).passed, c.id
        if c.ground_truth:
            assert not bt.check_case(c, [], text).passed, c.id


def test_multi_turn_cases_hold_a_call_and_its_result() -> None:
    for c in bt.load_cases():
        if c.category != "multi_turn":
            continue
        roles = [m["role"] for m in c.messages]
        assert roles[-2:] == ["assistant", "tool"], c.id
        call_id = c.messages[-2]["tool_calls"][0]["id"]
        assert c.messages[-1]["tool_call_id"] == call_id
        json.loads(c.messages[-2]["tool_calls"][0]["function"]["arguments"])


def test_load_cases_rejects_a_ground_truth_outside_the_tools(tmp_path: Path) -> None:
    data = {
        "functions": {"get_weather": {k: v for k, v in WEATHER.items() if k != "name"}},
        "cases": [
            {
                "id": "x",
                "category": "simple",
                "messages": [],
                "tools": ["get_weather"],
                "ground_truth": [{"get_weather": {"town": ["Paris"]}}],
            }
        ],
    }
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not in the schema"):
        bt.load_cases(path)


def test_select_cases() -> None:
    cases = bt.load_cases()
    assert {c.category for c in bt.select_cases(cases, "parallel")} == {"parallel"}
    ids = [c.id for c in bt.select_cases(cases, "simple_weather_tokyo,irrelevance")]
    assert ids[0] == "simple_weather_tokyo" and len(ids) == 1 + sum(
        c.category == "irrelevance" for c in cases
    )
    with pytest.raises(ValueError, match="matches no case"):
        bt.select_cases(cases, "nothing")


def test_rates() -> None:
    a = bt.Case("a", "simple", [], [], [])
    b = bt.Case("b", "simple", [], [], [])
    d = bt.Case("d", "irrelevance", [], [], [])
    table = bt.rates(
        [a, b, d],
        {"s": {"a": Verdict(True), "b": Verdict(False, "value_error"), "d": Verdict(True)}},
    )["s"]
    assert table["simple"] == {"passed": 1, "total": 2, "rate": 0.5}
    assert table["irrelevance"]["rate"] == 1.0
    assert table["overall"] == {"passed": 2, "total": 3, "rate": 2 / 3}
    assert "parallel" not in table


def test_call_in_text_diagnostic() -> None:
    text = '```json\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n```'
    assert bt.call_in_text(text, ["get_weather"])
    assert not bt.call_in_text(text, ["convert_currency"])
    assert not bt.call_in_text("It is sunny.", ["get_weather"])


def test_openai_request_shape() -> None:
    c = next(x for x in bt.load_cases() if x.category == "multi_turn")
    kwargs = bt.openai_request(c, "m", 64)
    assert kwargs["tools"][0]["type"] == "function"
    assert kwargs["temperature"] == 0.0 and kwargs["max_tokens"] == 64
    assert kwargs["tool_choice"] == "auto" and kwargs["parallel_tool_calls"] is True


def test_v1_request_against_the_stubs() -> None:
    from llama_grpc.v1 import llm_service_pb2 as pb

    if not hasattr(pb, "Tool"):
        pytest.skip("the generated v1 stubs have no tools yet")
    c = next(x for x in bt.load_cases() if x.id == "multi_turn_rate_then_convert")
    req = bt.v1_request(c, 64, pb)
    assert [t.name for t in req.tools] == ["get_exchange_rate", "convert_currency"]
    assert json.loads(req.tools[1].parameters)["required"] == ["amount", "from_currency",
                                                               "to_currency"]  # fmt: skip
    assert req.tool_choice.mode == pb.TOOL_CHOICE_MODE_AUTO and req.parallel_tool_calls
    assert req.params.sampling.temperature == 0.0 and req.params.stopping.max_tokens == 64
    assistant, result = req.messages[1], req.messages[2]
    assert assistant.tool_calls[0].name == "get_exchange_rate"
    assert json.loads(assistant.tool_calls[0].arguments) == {"base": "GBP", "target": "JPY"}
    assert result.role == "tool" and result.tool_call_id == assistant.tool_calls[0].id
