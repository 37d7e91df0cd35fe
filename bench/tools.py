"""Tool-use benchmark (issue 49): the cases of bench/tool_cases.json, in the Berkeley Function
Calling Leaderboard's categories (simple, multiple, parallel, parallel_multiple, irrelevance)
plus multi_turn (the conversation already holds a call and its result: the right next step is a
given call or a final answer with no call) and nested (object, array-of-object and enum
arguments), asked of three systems on the same GGUF in one run:

  - v1: llama-grpc's own API (`Generate` with `messages`, `tools`, `tool_choice` AUTO,
    `parallel_tool_calls`), over gRPC;
  - gateway: the same llama-grpc replica through the SMG gateway (deploy/gateway.py, what
    `make gateway` starts), the openai SDK's chat.completions.create with `tools`;
  - llama-server: llama.cpp's own server, `--jinja`, on the same GGUF
    (bench/build_llama_server.sh builds it from the pinned sdist; bench/peers.py finds it), its
    OpenAI /v1/chat/completions with `tools`.

Every system answers greedily (temperature 0, seed 1234) with the same max_tokens, the same
llama.cpp threads and no prompt cache (llama-grpc: --no-cache-prompt and params.cache_prompt
false; llama-server: --cache-ram 0 and cache_prompt false), one request at a time, the
systems interleaved by case (their order rotates from one case to the next).

Each answer is judged as BFCL's AST checker judges (ast_checker.py; our own code): the exact
function name, every required parameter present, no parameter outside the schema or the
accepted answer, JSON types checked (an int is accepted for a number; arrays and objects
recursively), strings compared after BFCL's standardize_string (case, spaces and ,./-_*^
ignored), an optional parameter left out only where its accepted values hold "", parallel calls
matched in any order (each call to a distinct expected call, by a matching where BFCL takes
the first fit), irrelevance passed only by an
answer with no call, a call whose arguments are not a JSON object failed. A multi_turn case
whose right step is a final answer also needs each `answer_contains` string in the text, and
no call of an offered tool written as text there (an unparsed call is not an answer).

Results: bench/results/tools.json (rates per category and overall per system, every case's
verdict, calls, text, wall and server CPU seconds) and tools.png.

    make bench-tools                                   # all cases, all systems
    make bench-tools ARGS="--model PATH --systems v1,llama-server --cases simple,multi_turn"
    python bench/tools.py --self-check                 # every case's own answer passes (no model)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

CASES_FILE = Path(__file__).resolve().parent / "tool_cases.json"
CATEGORIES = (
    "simple",
    "multiple",
    "parallel",
    "parallel_multiple",
    "irrelevance",
    "multi_turn",
    "nested",
)
SYSTEMS = ("v1", "gateway", "llama-server")
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
DEFAULT_MAX_TOKENS = 256
N_CTX = 8192
SEED = 1234
REQUEST_TIMEOUT_S = 300.0
TEXT_KEEP = 600  # characters of each answer's text kept in the JSON


# -- cases -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    id: str
    category: str
    messages: list[dict[str, Any]]  # OpenAI chat messages (assistant tool_calls, tool results)
    tools: list[dict[str, Any]]  # OpenAI shape: {"type": "function", "function": {...}}
    # BFCL's possible answer: one {name: {parameter: [accepted values]}} per expected call
    ground_truth: list[dict[str, dict[str, list[Any]]]]
    answer_contains: tuple[str, ...] = ()

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        """The offered functions by name (name, description, parameters)."""
        return {t["function"]["name"]: t["function"] for t in self.tools}


def load_cases(path: Path = CASES_FILE) -> list[Case]:
    """The cases of a cases file, their `tools` names expanded from its function library.
    ValueError for an unknown category or function, a duplicate id, or a ground truth naming
    a function or parameter the case does not offer."""
    data = json.loads(path.read_text(encoding="utf-8"))
    library: dict[str, dict[str, Any]] = data["functions"]
    cases, seen = [], set()
    for raw in data["cases"]:
        cid = raw["id"]
        if cid in seen:
            raise ValueError(f"duplicate case id {cid!r}")
        seen.add(cid)
        if raw["category"] not in CATEGORIES:
            raise ValueError(f"{cid}: unknown category {raw['category']!r}")
        tools = []
        for tool in raw["tools"]:
            function = tool
            if isinstance(tool, str):
                if tool not in library:
                    raise ValueError(f"{cid}: unknown function {tool!r}")
                function = {"name": tool, **library[tool]}
            tools.append({"type": "function", "function": function})
        case = Case(
            cid,
            raw["category"],
            raw["messages"],
            tools,
            raw["ground_truth"],
            tuple(raw.get("answer_contains", ())),
        )
        for expected in case.ground_truth:
            ((name, params),) = expected.items()
            if name not in case.functions:
                raise ValueError(f"{cid}: the answer calls {name!r}, which is not offered")
            props = case.functions[name]["parameters"].get("properties", {})
            for param in params:
                if param not in props:
                    raise ValueError(f"{cid}: {name}.{param} is not in the schema")
        if case.category == "irrelevance" and case.ground_truth:
            raise ValueError(f"{cid}: an irrelevance case expects no call")
        cases.append(case)
    return cases


def select_cases(cases: Sequence[Case], spec: str) -> list[Case]:
    """--cases: comma-separated categories, case ids or id prefixes ("" or "all": every case;
    a category name selects that category, not the ids it prefixes)."""
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    if not wanted or wanted == ["all"]:
        return list(cases)

    def wanted_by(case: Case, w: str) -> bool:
        if w in CATEGORIES:  # a category name is never read as an id prefix
            return w == case.category
        return case.id.startswith(w)

    chosen = [c for c in cases if any(wanted_by(c, w) for w in wanted)]
    if not chosen:
        raise ValueError(f"--cases {spec!r} matches no case")
    return chosen


# -- the checker (pure: BFCL's AST checker, judged on JSON values) -----------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """A call as a system returned it: the arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Verdict:
    passed: bool
    error_type: str = ""  # "" when passed; else e.g. "wrong_count", "value_error"
    error: str = ""


PASS = Verdict(True)
_PUNCTUATION = re.compile(r"[ ,./\-_*^]")


def standardize_string(text: str) -> str:
    """BFCL's standardize_string: spaces and ,./-_*^ removed, lower case, ' read as "."""
    return _PUNCTUATION.sub("", text).lower().replace("'", '"')


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# JSON-schema type names (and BFCL's own: float, tuple, dict): an int is a number, a bool is not
_TYPE_CHECKS: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": _is_number,
    "float": _is_number,
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "tuple": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "dict": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _json_type_ok(value: Any, type_name: str) -> bool:
    """A value against one type name ("any" or an unknown name accepts everything)."""
    check = _TYPE_CHECKS.get(type_name)
    return True if check is None else bool(check(value))


def type_error(path: str, value: Any, schema: Mapping[str, Any]) -> Verdict | None:
    """Where `value` breaks `schema`'s types (arrays' items and objects' properties
    recursively, unknown or missing nested keys included), or None."""
    declared = schema.get("type")
    names = declared if isinstance(declared, list) else [declared] if declared else []
    if names and not any(_json_type_ok(value, str(n)) for n in names):
        return Verdict(
            False,
            "type_error",
            f"{path}: expected {'/'.join(map(str, names))}, got {type(value).__name__} {value!r}",
        )
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found = type_error(f"{path}[{i}]", item, schema["items"])
            if found:
                return found
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        props: dict[str, Any] = schema["properties"]
        for key in schema.get("required", ()):
            if key not in value:
                return Verdict(False, "missing_required", f"{path}: missing required {key!r}")
        for key, item in value.items():
            if key not in props:
                return Verdict(False, "unexpected_param", f"{path}: unexpected key {key!r}")
            found = type_error(f"{path}.{key}", item, props[key])
            if found:
                return found
    return None


def value_matches(value: Any, accepted: Any) -> bool:
    """One value against one accepted value: strings standardized, numbers by value (int ==
    float), bools exactly, a dict against a {key: [accepted values]} spec, a list element by
    element in order."""
    if isinstance(accepted, dict):
        return isinstance(value, dict) and dict_matches(value, accepted)
    if isinstance(value, bool) or isinstance(accepted, bool):
        return isinstance(value, bool) and isinstance(accepted, bool) and value == accepted
    if isinstance(value, str):
        return isinstance(accepted, str) and standardize_string(value) == standardize_string(
            accepted
        )
    if isinstance(value, int | float):
        return isinstance(accepted, int | float) and float(value) == float(accepted)
    if isinstance(value, list):
        return (
            isinstance(accepted, list)
            and len(value) == len(accepted)
            and all(value_matches(v, a) for v, a in zip(value, accepted, strict=True))
        )
    return bool(value == accepted)


def dict_matches(value: Mapping[str, Any], spec: Mapping[str, Sequence[Any]]) -> bool:
    """A nested object against a spec: every key of it accepted by the spec, every key of the
    spec present unless its accepted values hold ""."""
    for key, item in value.items():
        if key not in spec or not any_accepted(item, spec[key]):
            return False
    return all(key in value or "" in accepted for key, accepted in spec.items())


def any_accepted(value: Any, accepted: Sequence[Any]) -> bool:
    """One of the accepted values matches. "" marks an optional parameter, yet a string that
    standardizes to "" matches it, as in BFCL's string_checker (an empty `directory` given for
    an optional one passes)."""
    if isinstance(value, str) and not standardize_string(value) and "" in accepted:
        return True
    return any(value_matches(value, a) for a in accepted if not (isinstance(a, str) and a == ""))


def check_call(
    function: Mapping[str, Any], arguments: Mapping[str, Any], expected: Mapping[str, Sequence[Any]]
) -> Verdict:
    """BFCL's simple_function_checker, the name already matched: required parameters present,
    none outside the schema or the accepted answer, types, values, optional ones left out only
    where "" is accepted."""
    schema = function.get("parameters") or {}
    props: dict[str, Any] = schema.get("properties", {})
    for param in schema.get("required", ()):
        if param not in arguments:
            return Verdict(False, "missing_required", f"missing required parameter {param!r}")
    for param, value in arguments.items():
        if param not in props or param not in expected:
            return Verdict(False, "unexpected_param", f"unexpected parameter {param!r}")
        found = type_error(param, value, props[param])
        if found:
            return found
        if not any_accepted(value, expected[param]):
            return Verdict(
                False,
                "value_error",
                f"{param}={value!r}, expected one of {list(expected[param])!r}",
            )
    for param, accepted in expected.items():
        if param not in arguments and "" not in accepted:
            return Verdict(
                False, "missing_optional", f"parameter {param!r} left out (it is expected here)"
            )
    return PASS


def parse_arguments(call: Call) -> dict[str, Any] | Verdict:
    """A call's arguments as a JSON object, or the invalid_json verdict."""
    try:
        args = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError as exc:
        return Verdict(False, "invalid_json", f"{call.name}: arguments are not JSON ({exc})")
    if not isinstance(args, dict):
        return Verdict(False, "invalid_json", f"{call.name}: arguments are not a JSON object")
    return args


def _call_verdict(
    functions: Mapping[str, Mapping[str, Any]],
    name: str,
    args: Mapping[str, Any],
    expected: Mapping[str, Mapping[str, Sequence[Any]]],
) -> Verdict:
    ((want, params),) = expected.items()
    if name != want:
        return Verdict(False, "wrong_func_name", f"called {name!r}, expected {want!r}")
    return check_call(functions[want], args, params)


def _perfect_matching(ok: Sequence[Sequence[bool]]) -> list[int] | None:
    """Kuhn's augmenting paths: for each expected call j, the call index matched to it, when
    every expected call gets a distinct call; None otherwise (n is small)."""
    n_calls = len(ok)
    n_expected = len(ok[0]) if ok else 0
    owner: list[int | None] = [None] * n_expected  # expected j -> call i

    def augment(i: int, seen: set[int]) -> bool:
        for j in range(n_expected):
            if ok[i][j] and j not in seen:
                seen.add(j)
                current = owner[j]
                if current is None or augment(current, seen):
                    owner[j] = i
                    return True
        return False

    for i in range(n_calls):
        if not augment(i, set()):
            return None
    if any(o is None for o in owner):
        return None
    return [o for o in owner if o is not None]


def check_case(case: Case, calls: Sequence[Call], text: str = "") -> Verdict:
    """The verdict on one answer (its calls and its text) to one case."""
    if not case.ground_truth:
        return _no_call_verdict(case, calls, text)
    return _calls_verdict(case, calls, text)


def _no_call_verdict(case: Case, calls: Sequence[Call], text: str) -> Verdict:
    """Irrelevance, or a final answer: no call; a final answer (answer_contains) also holds
    those strings and no call of an offered tool written as text (a call the system did not
    parse is not an answer; irrelevance stays BFCL's: any answer without a parsed call)."""
    if calls:
        names = ", ".join(c.name for c in calls)
        return Verdict(False, "unexpected_call", f"no call was right; it called {names}")
    if case.answer_contains and call_in_text(text, list(case.functions)):
        return Verdict(False, "call_in_text", f"the answer writes a call as text: {text[:200]!r}")
    missing = [s for s in case.answer_contains if s.lower() not in text.lower()]
    if missing:
        return Verdict(
            False, "answer_missing", f"the answer does not contain {missing!r}: {text[:200]!r}"
        )
    return PASS


def _calls_verdict(case: Case, calls: Sequence[Call], text: str) -> Verdict:
    """BFCL's simple / multiple / parallel checkers in one: the count, then a matching of the
    calls to the expected calls in any order."""
    if len(calls) != len(case.ground_truth):
        return Verdict(
            False,
            "wrong_count",
            f"{len(calls)} call(s), expected {len(case.ground_truth)}"
            + (f": {text[:120]!r}" if not calls else ""),
        )
    parsed: list[dict[str, Any]] = []
    for call in calls:
        args = parse_arguments(call)
        if isinstance(args, Verdict):
            return args
        parsed.append(args)
    functions = case.functions
    verdicts = [
        [_call_verdict(functions, c.name, a, e) for e in case.ground_truth]
        for c, a in zip(calls, parsed, strict=True)
    ]
    ok = [[v.passed for v in row] for row in verdicts]
    if _perfect_matching(ok) is not None:
        return PASS
    # the first expected call left unmatched, with the error of a call to that function
    for j, expected in enumerate(case.ground_truth):
        if not any(row[j] for row in ok):
            (want,) = expected
            for i, call in enumerate(calls):
                if call.name == want:
                    return verdicts[i][j]
            names = [c.name for c in calls]
            return Verdict(False, "wrong_func_name", f"no call of {want!r} (called {names})")
    return Verdict(False, "no_matching", "the calls cannot each match a distinct expected call")


def canonical_calls(case: Case) -> list[Call]:
    """One answer the ground truth accepts: each parameter's first accepted value ("" only:
    left out). The checker must pass it (--self-check, the unit tests)."""

    def first(accepted: Sequence[Any]) -> tuple[bool, Any]:
        for a in accepted:
            if not (isinstance(a, str) and a == ""):
                return True, build(a)
        return False, None

    def build(accepted: Any) -> Any:
        if isinstance(accepted, dict):
            out = {}
            for key, values in accepted.items():
                present, value = first(values)
                if present:
                    out[key] = value
            return out
        if isinstance(accepted, list):
            return [build(a) for a in accepted]
        return accepted

    calls = []
    for expected in case.ground_truth:
        ((name, params),) = expected.items()
        calls.append(Call(name, json.dumps(build(params))))
    return calls


_CALL_IN_TEXT = re.compile(r'"name"\s*:\s*"([^"]+)"')


def call_in_text(text: str, tool_names: Sequence[str]) -> bool:
    """Whether answer text holds what looks like a call of an offered tool (bare or fenced JSON,
    or a tagged call, the system did not parse): recorded for every answer without calls, and
    failing a final answer (irrelevance does not look at it, as in BFCL)."""
    return any(m.group(1) in tool_names for m in _CALL_IN_TEXT.finditer(text))


def rates(
    cases: Sequence[Case], verdicts: Mapping[str, Mapping[str, Verdict]]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per system, per category and overall: passed, total, rate. `verdicts`: system -> case id
    -> verdict (a case a system has no verdict for is left out of its totals)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for system, by_case in verdicts.items():
        table: dict[str, dict[str, float]] = {}
        for group in (*CATEGORIES, "overall"):
            chosen = [c for c in cases if group in ("overall", c.category) and c.id in by_case]
            if not chosen:
                continue
            passed = sum(by_case[c.id].passed for c in chosen)
            table[group] = {"passed": passed, "total": len(chosen), "rate": passed / len(chosen)}
        out[system] = table
    return out


# -- the systems -------------------------------------------------------------------------------


@dataclass
class Answer:
    calls: list[Call] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    error: str = ""  # the request failed (the case fails with error_type "error")
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the server side's CPU seconds (replica, and SMG for the gateway)
    prompt_tokens: int = 0
    completion_tokens: int = 0


def v1_messages(messages: Sequence[Mapping[str, Any]], pb: Any) -> list[Any]:
    """OpenAI chat messages as v1 ChatMessages (assistant tool_calls, tool results)."""
    out = []
    for m in messages:
        calls = [
            pb.ToolCall(
                id=tc.get("id", ""),
                name=tc["function"]["name"],
                arguments=tc["function"].get("arguments") or "",
            )
            for tc in m.get("tool_calls") or ()
        ]
        out.append(
            pb.ChatMessage(
                role=m["role"],
                content=m.get("content") or "",
                tool_calls=calls,
                tool_call_id=m.get("tool_call_id", ""),
                name=m.get("name", ""),
            )
        )
    return out


def v1_request(case: Case, max_tokens: int, pb: Any) -> Any:
    """The case as a v1 GenerateRequest: greedy, no prompt cache, tool_choice AUTO, parallel
    calls allowed."""
    tools = [
        pb.Tool(
            name=f["name"],
            description=f.get("description", ""),
            parameters=json.dumps(f.get("parameters") or {}),
        )
        for f in case.functions.values()
    ]
    params = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0, seed=SEED),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens),
        cache_prompt=False,
    )
    return pb.GenerateRequest(
        messages=v1_messages(case.messages, pb),
        tools=tools,
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_AUTO),
        parallel_tool_calls=True,
        params=params,
    )


def openai_request(case: Case, model: str, max_tokens: int) -> dict[str, Any]:
    """The case as chat.completions.create keyword arguments (gateway and llama-server)."""
    return {
        "model": model,
        "messages": case.messages,
        "tools": case.tools,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "temperature": 0.0,
        "seed": SEED,
        "max_tokens": max_tokens,
    }


class CpuMeter:
    """Server-side CPU seconds of some processes (and their children) over one request."""

    def __init__(self, *pids: int) -> None:
        self.pids = pids

    def read(self) -> float:
        from gateway import cpu_seconds  # bench/gateway.py: /proc accounting

        return sum(cpu_seconds(p) for p in self.pids)


class V1System:
    name = "v1"

    def __init__(self, target: str, pid: int, max_tokens: int) -> None:
        import grpc

        from llama_grpc.v1 import llm_service_pb2 as pb
        from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

        self.pb: Any = pb
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.LlmServiceStub(self.channel)
        self.cpu = CpuMeter(pid)
        self.max_tokens = max_tokens

    def warm_up(self) -> None:
        pb = self.pb
        self.stub.Generate(
            pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content="Hi")],
                params=pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=2)),
            ),
            timeout=REQUEST_TIMEOUT_S,
        )

    def ask(self, case: Case) -> Answer:
        import grpc

        answer = Answer()
        try:
            request = v1_request(case, self.max_tokens, self.pb)
        except (AttributeError, ValueError, TypeError) as exc:  # stubs without v1 tools
            answer.error = f"this client's v1 stubs cannot ask for tools: {exc}"
            return answer
        reply = None
        cpu0, t0 = self.cpu.read(), time.perf_counter()
        try:
            reply = self.stub.Generate(request, timeout=REQUEST_TIMEOUT_S)
        except grpc.RpcError as exc:
            answer.error = f"{exc.code().name}: {exc.details()}"
        answer.wall_s = time.perf_counter() - t0
        answer.cpu_s = self.cpu.read() - cpu0
        if reply is not None:
            answer.calls = [Call(tc.name, tc.arguments) for tc in reply.tool_calls]
            answer.text = reply.text
            answer.finish_reason = self.pb.FinishReason.Name(reply.finish_reason)
            answer.prompt_tokens = reply.usage.prompt_tokens
            answer.completion_tokens = reply.usage.completion_tokens
        return answer

    def close(self) -> None:
        self.channel.close()


class OpenAISystem:
    """An OpenAI-compatible chat endpoint through the openai SDK (SMG, llama-server)."""

    def __init__(
        self,
        name: str,
        base_url: str,
        model: str,
        *,
        pids: Sequence[int],
        max_tokens: int,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        from openai import OpenAI

        self.name = name
        self.client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
        self.model = model
        self.cpu = CpuMeter(*pids)
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})

    def warm_up(self) -> None:
        self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            timeout=REQUEST_TIMEOUT_S,
            extra_body=self.extra_body or None,
        )

    def ask(self, case: Case) -> Answer:
        import openai

        answer = Answer()
        kwargs = openai_request(case, self.model, self.max_tokens)
        reply = None
        cpu0, t0 = self.cpu.read(), time.perf_counter()
        try:
            reply = self.client.chat.completions.create(
                **kwargs, timeout=REQUEST_TIMEOUT_S, extra_body=self.extra_body or None
            )
        except openai.OpenAIError as exc:
            answer.error = f"{type(exc).__name__}: {str(exc)[:500]}"
        answer.wall_s = time.perf_counter() - t0
        answer.cpu_s = self.cpu.read() - cpu0
        if reply is not None and reply.choices:
            message = reply.choices[0].message
            answer.calls = [
                Call(tc.function.name, tc.function.arguments or "")
                for tc in message.tool_calls or ()
                if getattr(tc, "function", None) is not None
            ]
            answer.text = message.content or ""
            answer.finish_reason = str(reply.choices[0].finish_reason or "")
            if reply.usage is not None:
                answer.prompt_tokens = reply.usage.prompt_tokens
                answer.completion_tokens = reply.usage.completion_tokens
        return answer

    def close(self) -> None:
        self.client.close()


# -- model and processes -----------------------------------------------------------------------


def resolve_model(name_or_path: str) -> Path:
    """--model: a GGUF path, or a catalog name (the models directory of --models-dir /
    $LLAMA_GRPC_MODELS_DIR, as `llama-grpc serve --model NAME` resolves it)."""
    from llama_grpc_server.models import catalog

    try:
        return catalog.resolve(name_or_path, catalog.models_dir_from(None, os.environ))
    except catalog.CatalogError as exc:
        raise SystemExit(
            f"--model {name_or_path}: {exc}. Give --model PATH to a GGUF (e.g. the trained "
            "Qwen2.5-Coder-0.5B-Instruct Q4_K_M)."
        ) from None


def replica_args(model: Path) -> list[str]:
    """llama-grpc's options beside the threads: one slot, the same context as llama-server, no
    prompt cache (the engine protocol cannot ask for that per request)."""
    return ["--model", str(model), "--n-parallel", "1", "--n-ctx", str(N_CTX), "--no-cache-prompt"]


@contextlib.contextmanager
def llama_server_process(binary: str, model: Path, threads: int) -> Iterator[tuple[int, int]]:
    """llama-server --jinja on a free loopback port (bench/peers.py's options: one slot, the
    same context, no RAM cache); yields (port, pid)."""
    from common import free_port
    from peers import N_BATCH, N_UBATCH, wait_http

    port = free_port()
    cmd = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", str(N_CTX)]
    cmd += ["-np", "1", "-kvu", "--swa-full", "--no-webui", "--cache-ram", "0", "--jinja"]
    cmd += ["-t", str(threads), "-tb", str(threads), "-b", str(N_BATCH), "-ub", str(N_UBATCH)]
    cmd += ["--fit", "off", "--log-disable"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_http(port, "/health", proc, 180)
        if proc.stderr is not None:  # read only on a failed start; never let it fill
            proc.stderr.close()
        yield port, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- the run -----------------------------------------------------------------------------------


def case_record(case: Case, answer: Answer, verdict: Verdict) -> dict[str, Any]:
    names = list(case.functions)
    return {
        "passed": verdict.passed,
        "error_type": verdict.error_type,
        "error": verdict.error,
        "calls": [{"name": c.name, "arguments": c.arguments} for c in answer.calls],
        "text": answer.text[:TEXT_KEEP],
        "call_in_text": call_in_text(answer.text, names) if not answer.calls else False,
        "finish_reason": answer.finish_reason,
        "wall_s": answer.wall_s,
        "cpu_s": answer.cpu_s,
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
    }


def judge(case: Case, answer: Answer) -> Verdict:
    if answer.error:
        return Verdict(False, "error", answer.error)
    return check_case(case, answer.calls, answer.text)


def run_cases(
    systems: Sequence[Any],
    cases: Sequence[Case],
    checkpoint: Path | None = None,
    done: Mapping[str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every case on every system, interleaved: case i starts with system i mod n. The records
    so far go to `checkpoint` (JSON) after every case, so a run cut short leaves its answers;
    `done` (a checkpoint read back, --resume) holds cases answered already by every system."""
    for system in systems:
        system.warm_up()
    progress("warm-up done")
    records: dict[str, dict[str, Any]] = {}
    for i, case in enumerate(cases):
        earlier = (done or {}).get(case.id)
        if earlier is not None and all(s.name in earlier for s in systems):
            records[case.id] = earlier
            continue
        k = i % len(systems)
        order = [*systems[k:], *systems[:k]]
        row: dict[str, Any] = {"category": case.category}
        for system in order:
            answer = system.ask(case)
            verdict = judge(case, answer)
            row[system.name] = case_record(case, answer, verdict)
        row["load_1m"] = os.getloadavg()[0]
        records[case.id] = row
        if checkpoint is not None:
            checkpoint.write_text(json.dumps(records, indent=1))
        marks = "  ".join(
            f"{s.name} {'pass' if row[s.name]['passed'] else row[s.name]['error_type']}"
            f" {row[s.name]['wall_s']:.1f}s"
            for s in systems
        )
        progress(f"[{i + 1}/{len(cases)}] {case.id}: {marks}  load {os.getloadavg()[0]:.2f}")
    return records


def progress(message: str) -> None:
    from common import progress as say

    say(message)


def per_system_costs(records: Mapping[str, Mapping[str, Any]], system: str) -> dict[str, float]:
    rows = [r[system] for r in records.values() if system in r]
    wall = [r["wall_s"] for r in rows]
    cpu = [r["cpu_s"] for r in rows]
    return {
        "wall_s_mean": statistics.fmean(wall),  # every system answers the same cases
        "cpu_s_mean": statistics.fmean(cpu),
        "wall_s_median": statistics.median(wall),
        "wall_s_total": sum(wall),
        "cpu_s_median": statistics.median(cpu),
        "cpu_s_total": sum(cpu),
        "completion_tokens_total": sum(r["completion_tokens"] for r in rows),
    }


def paired_ratios(
    records: Mapping[str, Mapping[str, Any]], names: Sequence[str]
) -> dict[str, dict[str, float]]:
    """For each pair of systems "a/b": the median over cases of a's wall (server CPU) seconds
    over b's on the same case: the fair comparison on a shared, noisy machine."""
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            rows = [r for r in records.values() if a in r and b in r]
            walls = [r[a]["wall_s"] / r[b]["wall_s"] for r in rows if r[b]["wall_s"] > 0]
            cpus = [r[a]["cpu_s"] / r[b]["cpu_s"] for r in rows if r[b]["cpu_s"] > 0]
            if walls and cpus:
                out[f"{a}/{b}"] = {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}
    return out


def run(args: argparse.Namespace, cases: Sequence[Case]) -> dict[str, Any]:
    from common import free_port, llama_grpc_process, server_args, spread
    from peers import llama_server_binary

    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown} (known: {', '.join(SYSTEMS)})")
    model = resolve_model(args.model)
    skipped: dict[str, str] = {}
    binary = llama_server_binary() if "llama-server" in wanted else None
    if "llama-server" in wanted and binary is None:
        skipped["llama-server"] = "not built (bench/build_llama_server.sh)"
    systems: list[Any] = []
    with contextlib.ExitStack() as stack:
        replica_target, replica_pid = "", 0
        if "gateway" in wanted:
            from deploy.gateway import Gateway

            progress("starting one llama-grpc replica and SMG in front of it")
            gw = stack.enter_context(
                Gateway(
                    replicas=1,
                    port=free_port(),
                    server_args=replica_args(model),
                    threads=args.threads,
                )
            )
            replica = gw.cluster.members[0]
            if gw.smg is None or replica.proc is None:
                raise RuntimeError("the gateway is not running")
            replica_target, replica_pid = replica.target, replica.proc.pid
            systems.append(
                OpenAISystem(
                    "gateway",
                    gw.base_url,
                    gw.model,
                    pids=[gw.smg.pid, replica_pid],
                    max_tokens=args.max_tokens,
                )
            )
        if "v1" in wanted:
            if not replica_target:  # no gateway: a replica of its own, the same options
                progress("starting llama-grpc")
                replica_target, proc = stack.enter_context(
                    llama_grpc_process(
                        *server_args(args.threads, *replica_args(model)), timeout_s=300
                    )
                )
                replica_pid = proc.pid
            systems.insert(0, V1System(replica_target, replica_pid, args.max_tokens))
        if binary is not None:
            progress(f"starting llama-server --jinja ({binary})")
            port, pid = stack.enter_context(llama_server_process(binary, model, args.threads))
            systems.append(
                OpenAISystem(
                    "llama-server",
                    f"http://127.0.0.1:{port}/v1",
                    model.stem,
                    pids=[pid],
                    max_tokens=args.max_tokens,
                    extra_body={"cache_prompt": False},
                )
            )
        if not systems:
            raise SystemExit("no system to run")
        done = None
        if args.resume and args.checkpoint.exists():
            done = json.loads(args.checkpoint.read_text())
            progress(f"resuming: {len(done)} case(s) answered in {args.checkpoint.name}")
        try:
            records = run_cases(systems, cases, args.checkpoint, done)
        finally:
            for system in systems:
                system.close()
    names = [s.name for s in systems]
    loads = [r["load_1m"] for r in records.values() if "load_1m" in r]
    verdicts = {
        n: {
            cid: Verdict(r[n]["passed"], r[n]["error_type"], r[n]["error"])
            for cid, r in records.items()
        }
        for n in names
    }
    return {
        "model": {"path": str(model), "bytes": model.stat().st_size},
        "systems": names,
        "skipped": skipped,
        "rates": rates(cases, verdicts),
        "costs": {n: per_system_costs(records, n) for n in names},
        "paired_ratios": paired_ratios(records, names),
        "resumed_cases": sorted(done or {}),  # answered by an earlier, cut-short run
        # the 1-minute load average after each case (other work on the machine)
        "load_1m_per_case": spread(loads) if loads else {},
        "cases": records,
    }


def plot(result: Mapping[str, Any], name: str, title: str) -> None:
    from common import pyplot, save_figure

    plt = pyplot()
    table: Mapping[str, Mapping[str, Mapping[str, float]]] = result["rates"]
    systems = list(result["systems"])
    groups = [g for g in (*CATEGORIES, "overall") if any(g in table[s] for s in systems)]
    fig, (bars, cost) = plt.subplots(
        1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [3.2, 1]}
    )
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(groups))]
        ys = [table[system].get(g, {}).get("rate", 0.0) for g in groups]
        bars.bar(xs, ys, width, label=system, color=f"C{k}")
        for x, g in zip(xs, groups, strict=True):
            cell = table[system].get(g)
            if cell:
                bars.annotate(f"{int(cell['passed'])}/{int(cell['total'])}", (x, cell["rate"]),
                              textcoords="offset points", xytext=(0, 2), ha="center",
                              fontsize=7)  # fmt: skip
    bars.set_xticks(range(len(groups)), [g.replace("_", "\n") for g in groups])
    bars.set_ylim(0, 1.1)
    bars.set_ylabel("cases passed (BFCL AST checking)")
    bars.legend(fontsize=8)
    bars.grid(alpha=0.3, axis="y")
    costs = result["costs"]
    at = range(len(systems))
    cost.bar([i - 0.2 for i in at], [costs[s]["wall_s_mean"] for s in systems], 0.4,
             label="wall s")  # fmt: skip
    cost.bar([i + 0.2 for i in at], [costs[s]["cpu_s_mean"] for s in systems], 0.4,
             label="server CPU s")  # fmt: skip
    cost.set_xticks(list(at), systems)
    cost.set_ylabel("mean per case (the same cases)")
    cost.legend(fontsize=8)
    cost.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    save_figure(fig, name)


def self_check(cases: Sequence[Case]) -> int:
    """Every case's canonical answer passes; an answer with no call passes exactly the cases
    that expect none (without answer_contains)."""
    bad = 0
    for case in cases:
        verdict = check_case(case, canonical_calls(case), " ".join(case.answer_contains))
        if not verdict.passed:
            bad += 1
            print(f"{case.id}: its own answer fails: {verdict.error}")
    counts = {c: sum(case.category == c for case in cases) for c in CATEGORIES}
    print(f"{len(cases)} cases ({', '.join(f'{k} {v}' for k, v in counts.items())}); "
          f"{bad} failing their own answer")  # fmt: skip
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF path or a catalog name")
    parser.add_argument("--systems", "--only", default=",".join(SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)}")  # fmt: skip
    parser.add_argument("--cases", default="all", help="categories, case ids or id prefixes")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases-file", type=Path, default=CASES_FILE)
    parser.add_argument("--name", default="tools", help="results file name (JSON and PNG)")
    parser.add_argument("--self-check", action="store_true", help="check the cases; no model")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the answers of a run cut short (bench/results/NAME.tmp), ask the rest",
    )
    args = parser.parse_args()
    cases = select_cases(load_cases(args.cases_file), args.cases)
    if args.self_check:
        return self_check(cases)
    from common import RESULTS, finish_facts, machine_facts, write_json

    def terminated(*_: object) -> None:
        # a SIGTERM unwinds like an exception: the servers are stopped, the checkpoint stays
        progress(f"SIGTERM: stopping (--resume goes on from {args.checkpoint.name})")
        sys.exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, terminated)
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.checkpoint = RESULTS / f"{args.name}.tmp"  # git-ignored; removed once the JSON is out

    facts = machine_facts(args.threads)  # the load average before the run
    result = run(args, cases)
    data = {
        "benchmark": "tools",
        "command": "python bench/tools.py " + " ".join(sys.argv[1:]),
        "settings": {
            "model": args.model,
            "max_tokens": args.max_tokens,
            "threads": args.threads,
            "n_ctx": N_CTX,
            "temperature": 0.0,
            "seed": SEED,
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "cases": args.cases,
            "case_count": len(cases),
            "systems": args.systems,
        },
        "machine": facts,
        **result,
    }
    write_json(args.name, finish_facts(data))
    args.checkpoint.unlink(missing_ok=True)
    plot(result, args.name,
         f"Tool calls, {Path(result['model']['path']).name}: {len(cases)} cases, greedy, "
         f"max_tokens {args.max_tokens}")  # fmt: skip
    for system in result["systems"]:
        table = result["rates"][system]
        cells = "  ".join(f"{g} {int(v['passed'])}/{int(v['total'])}" for g, v in table.items())
        costs = result["costs"][system]
        print(f"{system:>12}: {cells}  (mean wall {costs['wall_s_mean']:.2f}s, "
              f"server CPU {costs['cpu_s_mean']:.2f}s per case)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
