"""The `llama-grpc` CLI against a scripted in-process sync gRPC server on 127.0.0.1:0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

import llama_grpc
from llama_grpc import cli
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

_DONE = pb.GenerationDone(
    finish_reason=pb.FINISH_REASON_MAX_TOKENS,
    usage=pb.Usage(prompt_tokens=3, completion_tokens=2),
    timings=pb.Timings(ttft_ms=1.25, total_ms=4.5),
    request_id="cli-1",
    seed=5,
)


def _queue_full() -> grpc.Status:
    info, retry = any_pb2.Any(), any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason="QUEUE_FULL", domain="llama-grpc"))
    retry.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1)))
    code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    status = status_pb2.Status(code=code, message="queue is full", details=[info, retry])
    return rpc_status.to_status(status)


class ScriptedServicer(pb_grpc.LlmServiceServicer):
    """Sync servicer replaying fixed answers; records the last request and its deadline."""

    def __init__(self) -> None:
        self.request: Any = None
        self.time_remaining: float | None = None

    def _record(self, request: Any, context: grpc.ServicerContext) -> None:
        self.request, self.time_remaining = request, context.time_remaining()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Any:
        """Fail with QUEUE_FULL for the prompt "busy"; else answer fixed text."""
        self._record(request, context)
        if request.prompt == "busy":
            context.abort_with_status(_queue_full())
        return pb.GenerateResponse(text="Hello world", finish_reason=pb.FINISH_REASON_EOS)

    def StreamGenerate(
        self, request: pb.StreamGenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StreamGenerateResponse]:
        """Two deltas then done."""
        self._record(request, context)
        for text in ("Hel", "lo"):
            yield pb.StreamGenerateResponse(delta=pb.GenerationDelta(text=text, token_ids=[1]))
        yield pb.StreamGenerateResponse(done=_DONE)

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> Any:
        """One id per character, plus 2 when add_special."""
        self._record(request, context)
        ids = [2] * request.add_special + [ord(c) for c in request.text]
        pieces = [chr(i) for i in ids] if request.return_pieces else []
        return pb.TokenizeResponse(token_ids=ids, pieces=pieces)

    def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.ServicerContext) -> Any:
        """Characters of the ids."""
        self._record(request, context)
        return pb.DetokenizeResponse(text="".join(chr(i) for i in request.token_ids))

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> Any:
        """Fixed stats with one slot."""
        return pb.GetStatsResponse(n_parallel=2, queue_depth=1, slots=[pb.SlotStats(slot_id=0)])

    def WatchLoad(
        self, request: pb.WatchLoadRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.LoadReport]:
        """Two reports, the second a draining server's last."""
        self._record(request, context)
        yield pb.LoadReport(queue_depth=2, n_parallel=4, serving=True, timestamp_unix_ms=1)
        yield pb.LoadReport(queue_depth=0, n_parallel=4, serving=False, timestamp_unix_ms=2)

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> Any:
        """Fixed model info without a BOS token."""
        return pb.GetModelInfoResponse(model_name="gemma-3-270m", n_ctx=4096, eos_token_id=1)

    def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext) -> Any:
        """The adapter asked for, with fixed figures."""
        self._record(request, context)
        adapter = pb.Adapter(
            name=request.name, path=request.path, model=request.model or "gemma", rank=8
        )
        return pb.LoadAdapterResponse(adapter=adapter)

    def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext) -> Any:
        """Two requests still using it."""
        self._record(request, context)
        return pb.UnloadAdapterResponse(in_flight=2)

    def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext) -> Any:
        """Two adapters."""
        self._record(request, context)
        return pb.ListAdaptersResponse(
            adapters=[pb.Adapter(name="sql", rank=8), pb.Adapter(name="chat", rank=16)]
        )


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ScriptedServicer, health.HealthServicer]]:
    """A sync grpc server on 127.0.0.1:0 with the scripted servicer and health (SERVING)."""
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = ScriptedServicer()
    pb_grpc.add_LlmServiceServicer_to_server(servicer, grpc_server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}", servicer, health_servicer
    grpc_server.stop(None)


@pytest.fixture
def target(
    server: tuple[str, ScriptedServicer, health.HealthServicer], monkeypatch: pytest.MonkeyPatch
) -> str:
    """The server address, also exported as LLAMA_GRPC_TARGET."""
    monkeypatch.setenv(cli.TARGET_ENV, server[0])
    return server[0]


@pytest.fixture
def servicer(server: tuple[str, ScriptedServicer, health.HealthServicer]) -> ScriptedServicer:
    """The scripted servicer, to inspect what the CLI sent."""
    return server[1]


def test_generate_prints_the_text(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`generate` prints the completion on stdout and exits 0."""
    assert cli.main(["generate", "Hi", "--target", target]) == 0
    assert capsys.readouterr().out == "Hello world\n"


def test_sampling_flags_reach_the_request(
    target: str, servicer: ScriptedServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sampling flags and --timeout become request fields and a deadline; others stay unset."""
    argv = ["generate", "Hi", "--max-tokens", "7", "--temperature", "0", "--seed", "3"]
    argv += ["--top-k", "20", "--top-p", "0.5", "--stop", "\n", "--stop", "END", "--timeout", "9"]
    assert cli.main(argv) == 0
    sampling, stopping = servicer.request.params.sampling, servicer.request.params.stopping
    assert (stopping.max_tokens, list(stopping.stop)) == (7, ["\n", "END"])
    assert sampling.HasField("temperature")
    assert sampling.temperature == 0.0
    assert (sampling.seed, sampling.top_k, sampling.top_p) == (3, 20, 0.5)
    assert not sampling.HasField("min_p")
    assert not stopping.ignore_eos
    assert servicer.time_remaining == pytest.approx(9, abs=0.5)  # grpc rounds deadlines up


@pytest.mark.parametrize("command", ["generate", "stream"])
def test_priority_flag_reaches_the_request(
    target: str, servicer: ScriptedServicer, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """--priority high is sent as PRIORITY_HIGH; left out, the request says nothing."""
    assert cli.main([command, "Hi", "--priority", "high"]) == 0
    assert servicer.request.params.priority == pb.PRIORITY_HIGH
    assert cli.main([command, "Hi"]) == 0
    assert servicer.request.params.priority == pb.PRIORITY_UNSPECIFIED


def test_unknown_priority_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--priority takes only low, normal or high."""
    with pytest.raises(SystemExit) as caught:
        cli.main(["generate", "Hi", "--priority", "urgent"])
    assert caught.value.code == 2
    assert "--priority" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "stream", "chat"])
def test_lora_flags_reach_the_request(
    target: str, servicer: ScriptedServicer, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """--lora NAME[:SCALE] (repeatable) becomes params.lora in order, a bare NAME without a
    scale; left out, the request names no adapter."""
    assert cli.main([command, "Hi", "--lora", "sql:0.5", "--lora", "chat", "--lora", "x:-1"]) == 0
    assert list(servicer.request.params.lora) == [
        pb.LoraAdapter(name="sql", scale=0.5),
        pb.LoraAdapter(name="chat"),
        pb.LoraAdapter(name="x", scale=-1.0),
    ]
    assert not servicer.request.params.lora[1].HasField("scale")
    assert cli.main([command, "Hi"]) == 0
    assert list(servicer.request.params.lora) == []


@pytest.mark.parametrize("flag", ["sql:half", ":0.5", "sql:"])
def test_a_bad_lora_flag_is_a_usage_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--lora takes NAME or NAME:SCALE with a number as SCALE."""
    with pytest.raises(SystemExit) as caught:
        cli.main(["generate", "Hi", "--lora", flag])
    assert caught.value.code == 2
    assert "--lora" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora", "sql", "--lora", "sql:0.5"], "lora names adapter 'sql' twice"),
        (["--lora", "sql:nan"], "the scale of lora adapter 'sql' must be a finite number"),
    ],
)
def test_lora_flags_the_client_refuses_are_a_usage_error(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An adapter named twice, or a scale that is not finite, exits 2 before any call (the
    target here serves nothing)."""
    assert cli.main(["generate", "Hi", *flags, "--target", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --lora: {message}")


def test_adapter_commands_send_their_fields_and_print_json(
    target: str, servicer: ScriptedServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    """load-adapter, unload-adapter and list-adapters call their RPCs with NAME, PATH,
    --scale and --model, and print JSON."""
    assert cli.main(["load-adapter", "sql", "/a/sql.gguf", "--scale", "0.5", "--model", "q"]) == 0
    assert servicer.request == pb.LoadAdapterRequest(
        model="q", name="sql", path="/a/sql.gguf", default_scale=0.5
    )
    loaded = json.loads(capsys.readouterr().out)
    assert (loaded["name"], loaded["path"], loaded["model"], loaded["rank"]) == (
        "sql",
        "/a/sql.gguf",
        "q",
        8,
    )
    assert cli.main(["load-adapter", "sql", "/a/sql.gguf"]) == 0
    assert servicer.request == pb.LoadAdapterRequest(name="sql", path="/a/sql.gguf")
    assert not servicer.request.HasField("default_scale")
    capsys.readouterr()
    assert cli.main(["unload-adapter", "sql", "--model", "q"]) == 0
    assert servicer.request == pb.UnloadAdapterRequest(model="q", name="sql")
    assert json.loads(capsys.readouterr().out) == {"in_flight": 2}
    assert cli.main(["list-adapters"]) == 0
    assert servicer.request == pb.ListAdaptersRequest()
    listed = json.loads(capsys.readouterr().out)
    assert [(a["name"], a["rank"]) for a in listed] == [("sql", 8), ("chat", 16)]
    assert set(listed[0]) == set(pb.Adapter.DESCRIPTOR.fields_by_name)


def test_generate_json_prints_the_whole_result(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate --json` prints every result field as JSON."""
    assert cli.main(["generate", "Hi", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["text"], result["finish_reason"]) == ("Hello world", "eos")
    assert set(result["usage"]) == {
        "prompt_tokens",
        "completion_tokens",
        "cached_prompt_tokens",
        "truncated_prompt_tokens",
        "cached_response",
        "draft_tokens",
        "accepted_draft_tokens",
    }


def test_prompt_dash_reads_stdin(
    target: str,
    servicer: ScriptedServicer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A prompt of "-" is read from stdin."""
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(read=lambda: "from stdin"))
    assert cli.main(["generate", "-"]) == 0
    assert servicer.request.prompt == "from stdin"


def test_stream_prints_deltas_then_a_summary_on_stderr(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stream` writes the text as it arrives and the finish summary to stderr."""
    assert cli.main(["stream", "Hi", "--max-tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello\n"
    assert captured.err.startswith("[done] finish_reason=max_tokens prompt_tokens=3")
    assert "ttft_ms=1.2" in captured.err
    assert "request_id=cli-1" in captured.err


def test_tokenize_prints_ids_as_json(
    target: str, servicer: ScriptedServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tokenize` prints a JSON list; --no-add-special is sent as add_special=false."""
    assert cli.main(["tokenize", "ab"]) == 0
    assert json.loads(capsys.readouterr().out) == [2, 97, 98]
    assert cli.main(["tokenize", "ab", "--no-add-special"]) == 0
    assert json.loads(capsys.readouterr().out) == [97, 98]
    assert servicer.request.HasField("add_special")
    assert not servicer.request.add_special


def test_tokenize_pieces(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`tokenize --pieces` prints ids and pieces."""
    assert cli.main(["tokenize", "a", "--pieces"]) == 0
    assert json.loads(capsys.readouterr().out) == {"token_ids": [2, 97], "pieces": ["\x02", "a"]}


def test_detokenize_prints_text(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`detokenize` prints the text of the ids."""
    assert cli.main(["detokenize", "104", "105"]) == 0
    assert capsys.readouterr().out == "hi\n"


def test_stats_and_info_print_json(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`stats` and `info` print parseable JSON with the server's values."""
    assert cli.main(["stats"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["n_parallel"], stats["queue_depth"], len(stats["slots"])) == (2, 1, 1)
    assert cli.main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["model_name"], info["bos_token_id"], info["eos_token_id"]) == (
        "gemma-3-270m",
        None,
        1,
    )


def test_load_prints_one_json_line_per_report(
    target: str, servicer: ScriptedServicer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`load --interval 0.25` asks for 250 ms and prints each report as one JSON line; the
    stream ending (a drained server) ends the command with 0."""
    assert cli.main(["load", "--interval", "0.25"]) == 0
    lines = capsys.readouterr().out.splitlines()
    reports = [json.loads(line) for line in lines]
    assert servicer.request.interval_ms == 250
    assert [(r["queue_depth"], r["serving"]) for r in reports] == [(2, True), (0, False)]
    assert reports[0]["n_parallel"] == 4


def test_health_prints_status_and_exits_by_it(
    server: tuple[str, ScriptedServicer, health.HealthServicer],
    target: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`health` prints SERVING (exit 0) or NOT_SERVING (exit 1)."""
    health_servicer = server[2]
    assert cli.main(["health"]) == 0
    assert capsys.readouterr().out == "SERVING\n"
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        assert cli.main(["health"]) == 1
        assert capsys.readouterr().out == "NOT_SERVING\n"
    finally:
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)


def test_errors_print_code_reason_message_and_exit_1(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failed call prints `error: CODE REASON: message` on stderr and exits 1."""
    assert cli.main(["generate", "busy"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "error: RESOURCE_EXHAUSTED QUEUE_FULL: queue is full\n"
    assert captured.out == ""


def test_explicit_target_wins_over_the_environment(
    target: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--target overrides LLAMA_GRPC_TARGET (here pointing at nothing)."""
    monkeypatch.setenv(cli.TARGET_ENV, "127.0.0.1:1")
    assert cli.main(["detokenize", "104", "--target", target]) == 0
    assert cli.main(["detokenize", "104", "--timeout", "5"]) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE")


def test_serve_without_the_server_extra_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`serve` explains how to install the server extra when it cannot import it."""
    monkeypatch.setitem(sys.modules, "llama_grpc_server.cli", None)
    assert cli.main(["serve", "--port", "1"]) == 2
    assert capsys.readouterr().err.startswith(cli.SERVE_HINT)


def test_serve_hands_the_remaining_arguments_to_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`serve ARGS` calls llama_grpc_server.cli.main(ARGS) and returns its status."""
    received: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        received.append(argv)
        return 3

    fake = types.ModuleType("llama_grpc_server.cli")
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_grpc_server.cli", fake)
    assert cli.main(["serve", "--port", "0", "--n-parallel", "2"]) == 3
    assert received == [["--port", "0", "--n-parallel", "2"]]


def test_missing_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """No subcommand exits 2 with argparse's usage message."""
    with pytest.raises(SystemExit) as caught:
        cli.main([])
    assert caught.value.code == 2
    assert "usage: llama-grpc" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli() -> None:
    """`python -m llama_grpc --help` lists the subcommands."""
    package_root = Path(llama_grpc.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_root), *sys.path])}
    completed = subprocess.run(
        [sys.executable, "-m", "llama_grpc", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    assert completed.returncode == 0
    for command in ("generate", "stream", "tokenize", "detokenize", "stats", "info", "health"):
        assert command in completed.stdout
    assert "serve" in completed.stdout


def test_health_without_grpc_health_explains_what_to_install(
    target: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without grpcio-health-checking, `health` names the package to install and exits 2."""
    monkeypatch.setitem(sys.modules, "grpc_health.v1", None)
    assert cli.main(["health"]) == 2
    assert "pip install grpcio-health-checking" in capsys.readouterr().err
