"""Draft-model speculation on a real draft pair (issue 53): Qwen 2.5 Coder 1.5B Instruct as the
target, its 0.5B sibling as the draft (same vocabulary), one stream, greedy, code prompts.

llama-grpc in process, one engine at a time: the target alone, with --draft-model and
--speculative on (the draft model drafts every tick), and with --speculative auto (the policy
picks lookup, the draft model or nothing per request from measured acceptance and costs); then
the pinned llama-server build with -md and --spec-type draft-simple, and without, over HTTP.
Per configuration: generated tokens, target passes (llama-grpc: GetStats ticks; llama-server:
its decode count is not exposed, so tokens per pass is (drafted accepted + tokens) / tokens
there), accepted / drafted, wall decode tok/s and CPU ms per token (the whole process's CPU
time, every llama.cpp thread and the draft model's passes included).

    python bench/draft_pair.py --threads 1 --gen-tokens 48

With one thread the CPU time per token is the work done: with two on a busy box, OpenMP's
barrier spinning while one thread waits for the CPU counts as CPU time too.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port, machine_facts, progress, write_json

from llama_grpc_server.config import ModelSettings, SchedulerSettings, Settings
from llama_grpc_server.core.requests.request import (
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
    TokenDelta,
)
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.models import assemble, trained

LLAMA_SERVER = Path.home() / ".cache" / "llama-grpc" / "llama-server-cpu" / "llama-server"
PROMPTS = {
    "quicksort": "def quicksort(items: list[int]) -> list[int]:\n",
    "linked_list": "class LinkedList:\n    def __init__(self):\n",
    "http_get": "import urllib.request\n\n\ndef fetch_json(url: str) -> dict:\n",
}


def model_path(model: trained.TrainedModel) -> str:
    return str(assemble.fetch(model))


async def one(engine: Any, prompt: str, gen: int, n: int) -> dict[str, Any]:
    tokens = engine.tokenize(prompt, add_special=True, parse_special=False)
    request = GenerationRequest(
        request_id=f"b{n}",
        prompt_tokens=tuple(tokens),
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=gen, ignore_eos=True),
        cache_prompt=False,
    )
    stats0 = engine.stats()
    cpu0, t0 = time.process_time(), time.perf_counter()
    first = 0.0
    out: list[int] = []
    final = None
    async for event in engine.submit(request):
        if isinstance(event, TokenDelta):
            if not out:
                first = time.perf_counter()
                cpu_first = time.process_time()
                ticks_first = engine.stats().ticks
            out += event.token_ids
        else:
            final = event
    cpu1, t1 = time.process_time(), time.perf_counter()
    stats1 = engine.stats()
    if not isinstance(final, Finished) or final.reason is not FinishReason.MAX_TOKENS:
        raise RuntimeError(f"the request did not run to max_tokens: {final}")
    decoded = len(out) - 1  # tokens after the first (the prompt's pass gives the first)
    return {
        "tokens": len(out),
        "token_ids": out,
        "decode_tok_s": decoded / (t1 - first),
        "cpu_ms_per_token": (cpu1 - cpu_first) * 1000 / decoded,
        "cpu_ms_per_token_total": (cpu1 - cpu0) * 1000 / len(out),
        "target_passes": stats1.ticks - ticks_first,
        "tokens_per_target_pass": decoded / max(1, stats1.ticks - ticks_first),
        "drafted": stats1.spec_draft_tokens - stats0.spec_draft_tokens,
        "accepted": stats1.spec_accepted_tokens - stats0.spec_accepted_tokens,
        "model_drafted": stats1.spec_model_draft_tokens - stats0.spec_model_draft_tokens,
        "model_accepted": stats1.spec_model_accepted_tokens - stats0.spec_model_accepted_tokens,
        "wall_s": t1 - t0,
    }


def llama_grpc(name: str, args: argparse.Namespace, draft: str, mode: str) -> dict[str, Any]:
    settings = Settings(
        model=ModelSettings(
            model_path=model_path(trained.QWEN_CODER_15B),
            n_ctx=1024,
            n_batch=512,
            n_threads=args.threads,
            draft_model=draft,
        ),
        scheduler=SchedulerSettings(
            n_parallel=1,
            speculative=mode,
            draft_max=args.draft_max,
            prompt_cache_ram_mb=0,
            # a box shared with other work stretches passes past the auto bound's margin
            watchdog_s=600.0,
        ),
    )
    progress(f"{name}: loading")
    engine = build_engine(settings)
    try:
        runs = {}
        for i, (key, prompt) in enumerate(PROMPTS.items()):
            runs[key] = asyncio.run(one(engine, prompt, args.gen_tokens, i))
            r = runs[key]
            progress(
                f"{name} {key}: {r['decode_tok_s']:.2f} tok/s, {r['cpu_ms_per_token']:.0f} CPU "
                f"ms/token, {r['tokens_per_target_pass']:.2f} tokens/pass, model drafts "
                f"{r['model_accepted']}/{r['model_drafted']}, all drafts "
                f"{r['accepted']}/{r['drafted']}"
            )
        return runs
    finally:
        engine.close()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def llama_server(args: argparse.Namespace, draft: bool) -> Iterator[tuple[int, int]]:
    port = free_port()
    cmd = [
        str(LLAMA_SERVER),
        "-m",
        model_path(trained.QWEN_CODER_15B),
        "--port",
        str(port),
        "-t",
        str(args.threads),
        "-c",
        "1024",
        "-np",
        "1",
        "--no-webui",
    ]
    if draft:
        cmd += ["-md", model_path(trained.QWEN_CODER_05B), "--spec-type", "draft-simple"]
        cmd += ["--spec-draft-n-max", str(args.draft_max), "-td", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            time.sleep(1)
        yield port, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def server_run(port: int, pid: int, prompt: str, gen: int) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "n_predict": gen,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        got = json.loads(r.read())
    cpu1, t1 = _cpu_s(pid), time.perf_counter()
    timings = got.get("timings", {})
    n = int(timings.get("predicted_n", gen))
    drafted = int(timings.get("draft_n", 0))
    accepted = int(timings.get("draft_n_accepted", 0))
    return {
        "tokens": n,
        "token_ids": got.get("tokens", []),
        "decode_tok_s": float(timings.get("predicted_per_second", 0.0)),
        "cpu_ms_per_token_total": (cpu1 - cpu0) * 1000 / n,
        "drafted": drafted,
        "accepted": accepted,
        # one target pass per token not drafted-and-accepted (llama-server's passes are not
        # exposed: every pass yields its accepted drafts plus one token)
        "tokens_per_target_pass": n / max(1, n - accepted),
        "wall_s": t1 - t0,
    }


def server_config(name: str, args: argparse.Namespace, draft: bool) -> dict[str, Any]:
    progress(f"{name}: starting llama-server")
    runs = {}
    with llama_server(args, draft) as (port, pid):
        server_run(port, pid, "def f():\n", 4)  # warm-up
        for key, prompt in PROMPTS.items():
            runs[key] = r = server_run(port, pid, prompt, args.gen_tokens)
            progress(
                f"{name} {key}: {r['decode_tok_s']:.2f} tok/s, {r['cpu_ms_per_token_total']:.0f} "
                f"CPU ms/token (prompt included), drafts {r['accepted']}/{r['drafted']}"
            )
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--draft-max", type=int, default=8)
    parser.add_argument("--only", default="", help="comma-separated configurations to run")
    parser.add_argument("--name", default="draft_pair")
    args = parser.parse_args()
    draft = model_path(trained.QWEN_CODER_05B)
    configs: dict[str, Any] = {
        "llama_grpc_target_alone": lambda: llama_grpc("target alone", args, "", "off"),
        "llama_grpc_draft_on": lambda: llama_grpc("draft on", args, draft, "on"),
        "llama_grpc_draft_auto": lambda: llama_grpc("draft auto", args, draft, "auto"),
        "llama_server_target_alone": lambda: server_config("llama-server alone", args, False),
        "llama_server_draft": lambda: server_config("llama-server -md", args, True),
    }
    wanted = [c for c in args.only.split(",") if c] or list(configs)
    data: dict[str, Any] = {"machine": machine_facts(args.threads), "args": vars(args)}
    for name in wanted:
        data[name] = configs[name]()
    data["load_average_at_end"] = list(os.getloadavg())
    path = write_json(args.name, data)
    progress(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
