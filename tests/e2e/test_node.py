"""The Node.js example client (examples/node/client.js) against the real server: concurrent greedy
streams, unary calls, a decoded BadRequest and a client-side cancel, each compared with what the
Python client gets from the same server. Its resumption of a cut stream runs against a scripted
grpc.aio server (no model): a real server's side of resume is checked by its own tests.

Needs `node` (>= 20) and `npm`; skipped without them. The npm packages are installed once per
package-lock.json (`npm ci`) into a cache outside the checkout, and client.js finds them through
NODE_PATH."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from llama_grpc import AsyncClient, InvalidArgumentError
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from tests.support.greedy import assert_text_greedy_equal

NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node"
CLIENT_JS = NODE_DIR / "client.js"
MIN_NODE_MAJOR = 20
NPM_TIMEOUT_S = 240
NODE_TIMEOUT_S = 120  # one client.js run; every call in it has a 60 s deadline
PROMPT = "The three primary colors are"


@dataclass(frozen=True)
class Node:
    executable: str
    env: dict[str, str]


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llama-grpc" / "node"


def _installed_packages(npm: str) -> Path:
    """node_modules for examples/node's lockfile, installed by `npm ci` on the first run into
    ~/.cache/llama-grpc/node/<sha256 of package-lock.json>/ and reused after. The install goes to
    a temporary folder that is renamed into place, so a finished folder is a complete one."""
    lockfile = NODE_DIR / "package-lock.json"
    key = hashlib.sha256(lockfile.read_bytes()).hexdigest()
    root = _cache_root()
    done = root / key
    if not (done / "node_modules").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=root))
        try:
            for name in ("package.json", "package-lock.json"):
                shutil.copy2(NODE_DIR / name, work / name)
            run = subprocess.run(
                [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                cwd=work, capture_output=True, text=True, timeout=NPM_TIMEOUT_S, check=False,
            )  # fmt: skip
            if run.returncode != 0:
                pytest.fail(f"npm ci for examples/node failed ({run.returncode}):\n{run.stderr}")
            try:
                work.rename(done)
            except OSError:  # another run finished the same install first: use that one
                if not (done / "node_modules").is_dir():
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return done / "node_modules"


@pytest.fixture(scope="session")
def node() -> Node:
    executable, npm = shutil.which("node"), shutil.which("npm")
    if executable is None:
        pytest.skip(f"node not found: install Node.js >= {MIN_NODE_MAJOR} to test examples/node")
    if npm is None:
        pytest.skip("npm not found: it comes with Node.js and installs examples/node's packages")
    version = subprocess.run(
        [executable, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < MIN_NODE_MAJOR:
        pytest.skip(f"node too old: {version} at {executable}, examples/node needs >= 20")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GRPC_")}
    env["NODE_PATH"] = str(_installed_packages(npm))
    return Node(executable, env)


async def run_client(
    node: Node, server: RunningServer | str, *args: str
) -> tuple[int, list[dict[str, Any]]]:
    """Run client.js against the server (or a HOST:PORT target), bounded: its exit status and
    its JSON lines."""
    target = server if isinstance(server, str) else f"127.0.0.1:{server.port}"
    proc = await asyncio.create_subprocess_exec(
        node.executable, str(CLIENT_JS), "--target", target, *args,
        env=node.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), NODE_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"client.js {' '.join(args)} still running after {NODE_TIMEOUT_S} s")
    assert proc.returncode is not None
    assert proc.returncode in (0, 1), f"client.js {args} exited {proc.returncode}: {err.decode()}"
    return proc.returncode, [json.loads(line) for line in out.decode().splitlines()]


async def test_concurrent_node_streams_match_python_greedy(
    node: Node, server: RunningServer, client: AsyncClient
) -> None:
    """4 Node streams of one greedy request at once: each one's text, rebuilt from its deltas
    too, is the Python client's greedy Generate (up to a near-tie, tests/support/greedy.py: the
    streams
    are decoded in one batch, the Python request alone); the streams' deltas interleave; each
    stream's x-request-id is the one it sent."""
    expected = await client.generate(PROMPT, max_tokens=24, temperature=0.0, top_logprobs=2)
    request_id = f"node-{uuid.uuid4().hex}"
    status, lines = await run_client(
        node, server, "stream", PROMPT, "--max-tokens", "24", "--concurrency", "4",
        "--request-id", request_id,
    )  # fmt: skip
    assert status == 0, lines
    dones = [line for line in lines if line["event"] == "done"]
    assert sorted(done["stream"] for done in dones) == [0, 1, 2, 3]
    streamed: dict[int, str] = {}
    positions: dict[int, list[int]] = {}  # line numbers of each stream's deltas
    for number, line in enumerate(lines):
        if line["event"] == "delta":
            streamed[line["stream"]] = streamed.get(line["stream"], "") + line["text"]
            positions.setdefault(line["stream"], []).append(number)
    for done in dones:
        assert done["text"] == streamed[done["stream"]], done
        assert_text_greedy_equal(expected.text, expected.logprobs, done["text"], str(done))
        if done["text"] == expected.text:  # past a near-tie, one side may meet EOS first
            assert done["usage"]["completion_tokens"] == expected.usage.completion_tokens
            assert done["finish_reason"] == f"FINISH_REASON_{expected.finish_reason.upper()}"
        assert done["request_id"] == f"{request_id}-{done['stream']}"
    # Concurrent, not one after another: every stream had begun before any one ended.
    assert max(p[0] for p in positions.values()) < min(p[-1] for p in positions.values())


async def test_node_unary_generate_and_tokenize_match_python(
    node: Node, server: RunningServer, client: AsyncClient
) -> None:
    """Generate (with the caller's x-request-id echoed) and Tokenize of non-ASCII text give the
    Python client's ids and text."""
    request_id = f"node-{uuid.uuid4().hex}"
    expected = await client.generate(PROMPT, max_tokens=16, temperature=0.0)
    status, [result] = await run_client(
        node, server, "generate", PROMPT, "--max-tokens", "16", "--request-id", request_id
    )
    assert status == 0, result
    assert result["text"] == expected.text
    assert result["token_ids"] == list(expected.token_ids)
    assert result["usage"]["prompt_tokens"] == expected.usage.prompt_tokens
    assert result["request_id"] == request_id
    text = "Grüße aus Köln, 世界! Primary colors: red"
    status, [tokens] = await run_client(node, server, "tokenize", text)
    assert status == 0 and tokens["token_ids"] == await client.tokenize(text)


async def test_node_decodes_bad_request_details(
    node: Node, server: RunningServer, client: AsyncClient
) -> None:
    """temperature -1: INVALID_ARGUMENT with BadRequest naming the field the Python client names,
    ErrorInfo's domain and RequestInfo's request id, all from grpc-status-details-bin."""
    request_id = f"node-{uuid.uuid4().hex}"
    status, [error] = await run_client(node, server, "bad-request", "--request-id", request_id)
    assert status == 0, error
    with pytest.raises(InvalidArgumentError) as python:
        await client.generate("Hello", temperature=-1.0)
    assert error["code"] == "INVALID_ARGUMENT"
    assert [v["field"] for v in error["field_violations"]] == ["params.sampling.temperature"]
    assert python.value.field == "params.sampling.temperature"
    assert error["domain"] == "llama-grpc" and error["reason"]
    assert error["request_id"] == request_id
    status, [empty] = await run_client(node, server, "generate", "")
    assert status == 1 and empty["code"] == "INVALID_ARGUMENT"
    assert [v["field"] for v in empty["field_violations"]] == ["prompt"]


async def test_node_cancel_frees_the_slot(
    node: Node, server: RunningServer, client: AsyncClient
) -> None:
    """Node cancels a 2000-token stream after its first delta: the slot is freed while its channel
    is still open (client.js watches GetStats), then GetStats via Python shows no active slot
    within 5 s and one more cancelled request."""
    before = await client.stats()
    status, [cancelled] = await run_client(node, server, "cancel")
    assert status == 0, cancelled
    assert cancelled["code"] == "CANCELLED" and cancelled["deltas"] == 1
    assert cancelled["request_id"] and cancelled["slot_freed"], cancelled
    for _ in range(100):
        stats = await client.stats()
        if stats.active_slots == 0:
            break
        await asyncio.sleep(0.05)
    assert stats.active_slots == 0, "a slot still busy 5 s after the Node client cancelled"
    assert stats.requests_cancelled == before.requests_cancelled + 1
    assert stats.generated_tokens - before.generated_tokens < 2000


def _delta(text: str, index: int, token_id: int) -> pb.StreamGenerateResponse:
    return pb.StreamGenerateResponse(
        delta=pb.GenerationDelta(text=text, index=index, token_ids=[token_id])
    )


class CutOnce(pb_grpc.LlmServiceServicer):
    """The answer "abcde" (tokens 1-5): the first call sends "abc" and ends UNAVAILABLE (a
    drained replica); a call with params.resume sends the rest from its position, then done.
    Each call's request and x-request-id are kept."""

    def __init__(self) -> None:
        self.requests: list[pb.StreamGenerateRequest] = []
        self.request_ids: list[str | None] = []

    async def StreamGenerate(
        self, request: pb.StreamGenerateRequest, context: Any
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        self.requests.append(request)
        self.request_ids.append(dict(context.invocation_metadata()).get("x-request-id"))
        await context.send_initial_metadata((("x-request-id", "srv-1"),))
        have = len(request.params.resume.token_ids)
        for index, text in enumerate("abcde"):
            if index >= have:
                yield _delta(text, index, index + 1)
            if index == 2 and not have:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        usage = pb.Usage(prompt_tokens=4, completion_tokens=5)
        done = pb.GenerationDone(
            finish_reason=pb.FINISH_REASON_EOS, usage=usage, request_id="srv-1"
        )
        yield pb.StreamGenerateResponse(done=done)


@contextlib.asynccontextmanager
async def scripted(servicer: pb_grpc.LlmServiceServicer) -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_LlmServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_node_resumes_a_cut_stream(node: Node) -> None:
    """The stream is cut after 3 deltas: client.js calls again with their tokens as
    params.resume (the request otherwise the same) and the server's x-request-id, prints each
    delta once and a done line with the whole text and resumptions 1. With --resume-attempts 0
    the cut is its error."""
    servicer = CutOnce()
    async with scripted(servicer) as target:
        status, lines = await run_client(node, target, "stream", "hi", "--max-tokens", "5")
        off_status, off_lines = await run_client(
            node, target, "stream", "hi", "--resume-attempts", "0"
        )
    assert status == 0, lines
    *deltas, done = lines
    assert [line["text"] for line in deltas] == list("abcde")
    assert (done["event"], done["text"], done["resumptions"]) == ("done", "abcde", 1)
    assert done["usage"]["completion_tokens"] == 5
    first, again = servicer.requests[:2]
    assert list(again.params.resume.token_ids) == [1, 2, 3]
    again.params.ClearField("resume")
    assert again == first
    assert servicer.request_ids[:2] == [None, "srv-1"]
    assert off_status == 1
    assert [line.get("text") for line in off_lines[:3]] == list("abc")
    assert (off_lines[3]["event"], off_lines[3]["code"]) == ("error", "UNAVAILABLE")
    assert len(servicer.requests) == 3
