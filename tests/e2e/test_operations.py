"""What an operator and a grpcurl user see: reflection, health, a full queue, stream close."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from llama_grpc import AsyncClient, Delta, QueueFullError
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from tests.support.grpcurl import grpcurl_run

from .conftest import settings


async def test_grpcurl_lists_describes_and_streams(server: RunningServer, grpcurl: str) -> None:
    """Reflection lets grpcurl list and describe the service and call StreamGenerate."""
    target = f"127.0.0.1:{server.port}"
    services = await grpcurl_run(grpcurl, "-plaintext", target, "list")
    assert "llama_grpc.v1.LlmService" in services and "grpc.health.v1.Health" in services
    described = await grpcurl_run(
        grpcurl, "-plaintext", target, "describe", "llama_grpc.v1.LlmService"
    )
    for rpc in ("Generate", "StreamGenerate", "GenerateTokens", "Tokenize", "GetStats"):
        assert f"rpc {rpc}" in described
    body = json.dumps({"prompt": "Hello", "params": {"stopping": {"max_tokens": 5}}})
    out = await grpcurl_run(
        grpcurl, "-plaintext", "-d", body, target, "llama_grpc.v1.LlmService/StreamGenerate"
    )
    messages = [json.loads(m) for m in out.replace("}\n{", "}\x00{").split("\x00")]
    assert "delta" in messages[0] and "done" in messages[-1]
    done = messages[-1]["done"]  # grpcurl prints the proto field names
    assert done["finish_reason"] in ("FINISH_REASON_MAX_TOKENS", "FINISH_REASON_EOS")
    assert done["usage"]["completion_tokens"] == len(messages) - 1


async def test_full_queue_is_resource_exhausted_with_retry_info() -> None:
    """One slot, a queue of one: a third request is refused at once with QUEUE_FULL and a
    RetryInfo delay; the others finish normally."""
    conf = settings(n_parallel=1, max_queue=1)
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        async with AsyncClient(f"127.0.0.1:{running.port}", timeout=60) as client:
            first = client.stream("One", max_tokens=40, ignore_eos=True)
            it = first.__aiter__()
            assert isinstance(await it.__anext__(), Delta)  # running on the only slot
            second = asyncio.ensure_future(client.generate("Two", max_tokens=4))
            for _ in range(100):
                if (await client.stats()).queue_depth == 1:
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(QueueFullError) as refused:
                await client.generate("Three", max_tokens=4)
            assert refused.value.code == "RESOURCE_EXHAUSTED"
            assert refused.value.reason == "QUEUE_FULL"
            assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
            async for _ in it:
                pass
            assert (await second).usage.completion_tokens >= 1
            assert (await client.stats()).requests_rejected >= 1


async def test_without_reflection_the_descriptor_set_serves_grpcurl(
    grpcurl: str, tiny_model_path: Path
) -> None:
    """--no-reflection hides the schema; proto/llama_grpc_v1.binpb (make proto) gives it back to
    tools: grpcurl -protoset describes and calls the service."""
    from dataclasses import replace

    protoset = str(Path(__file__).resolve().parents[2] / "proto" / "llama_grpc_v1.binpb")
    conf = settings(str(tiny_model_path), n_parallel=1)
    conf = replace(conf, server=replace(conf.server, reflection=False))
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        target = f"127.0.0.1:{running.port}"
        proc = await asyncio.create_subprocess_exec(
            grpcurl, "-plaintext", target, "list",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode != 0 and b"reflection" in err.lower()
        described = await grpcurl_run(
            grpcurl, "-protoset", protoset, "describe", "llama_grpc.v1.LlmService"
        )
        assert "rpc ClearCache" in described and "rpc WatchLoad" in described
        out = await grpcurl_run(
            grpcurl, "-plaintext", "-protoset", protoset, "-d", '{"text": "Hello"}', target,
            "llama_grpc.v1.LlmService/Tokenize",
        )  # fmt: skip
        assert json.loads(out)["tokenIds"]
