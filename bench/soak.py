"""Soak benchmark: 64 concurrent streams against a real `llama-grpc serve` subprocess on
127.0.0.1 for --minutes, with mixed prompt lengths, random client cancels and deadlines.

Every minute the load pauses: no new call starts, the calls in flight get --drain-s to end and
are then cancelled, and once the server reports no active slot and an empty queue its RSS and
open file descriptors (/proc/PID) and GetStats' kv_cells_used are read. Per minute: calls by
status, tokens received per second, RSS, fds, idle KV, load average.

Expected statuses: OK (with exactly one `done`), CANCELLED for the bench's own cancels (random or
at a pause), DEADLINE_EXCEEDED for the calls given a short deadline on purpose, and
RESOURCE_EXHAUSTED carrying RetryInfo (queue full: the caller waits retry_after_s, then retries
the same request). Anything else is unexpected. Every call has a deadline and a client-side
backstop 30 s after it; a call still running then is a hung call.

Pass: 0 unexpected statuses, 0 hung calls, idle RSS at the end within ±5 % of minute 2, and at
every pause the idle KV is the cached-prefix baseline (see KV_CHECK). After the last minute, a
prompt of nearly n_ctx tokens must succeed: the cells idle slots keep are really reclaimable.

    make bench-soak                   # or: python bench/soak.py --minutes 10
    python bench/soak.py --minutes 2 --minute-s 20    # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DEFAULT_THREADS,
    finish_facts,
    free_port,
    machine_facts,
    progress,
    prompt_of,
    pyplot,
    save_figure,
    seeded_text,
    wait_serving,
    write_json,
)

from llama_grpc.errors import QueueFullError, from_rpc_error
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

STREAMS = 64
BACKSTOP_S = 30.0  # a call still running this long after its own deadline is hung
PROMPT_WORDS = (8, 32, 128, 512, 1024)  # mixed prompt lengths (words; ~1.1 tokens each)
PROMPT_WEIGHTS = (30, 30, 25, 12, 3)  # mostly short, some long: prefill must not starve decode
MAX_TOKENS = (8, 16, 32, 64, 128)
SYSTEM_WORDS = 200  # a quarter of the prompts start with this shared prefix
POOL = 240  # distinct prompts, drawn again and again (so prefixes repeat, as in real traffic)
EXPECTED = ("OK", "CANCELLED", "CANCELLED_AT_PAUSE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
KV_CHECK = (
    "At every pause (no call in flight, GetStats: 0 active slots, empty queue) the KV cells in "
    "use must be exactly the prefix cache the idle slots keep: between the largest slot's "
    "cached_tokens and their sum (cells shared between slots through seq_cp count once), and "
    "that baseline is bounded by min(n_ctx, n_parallel x the longest "
    "request the bench sends), so it cannot grow with time. After the last minute a prompt of "
    "n_ctx - probe_margin tokens must then run to completion: it only fits if every cell that "
    "idle slots held is really given back when needed (llama.cpp would fail the decode if a "
    "leaked sequence still held cells). llama.cpp's 'decode: failed to find a memory slot' "
    "warnings during that probe are the designed reclaim path: the scheduler then drops the "
    "least recently used idle cache and decodes again."
)


@dataclass
class Plan:
    """One request as drawn: what to send and how the caller treats it."""

    prompt: str
    ids: list[int]
    use_ids: bool  # GenerateTokens with ids instead of StreamGenerate with text
    max_tokens: int
    temperature: float
    ignore_eos: bool
    mode: str  # normal | cancel | deadline
    timeout_s: float
    cancel_after_tokens: int = 0
    cancel_after_s: float = 0.0


@dataclass
class Tally:
    """What one minute saw, from the client side."""

    statuses: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    tokens: int = 0
    tokens_in_window: int = 0
    calls_started: int = 0
    calls_ended: int = 0
    retries_honoured: int = 0
    retry_wait_s: float = 0.0


class Live:
    """A call in flight, so that a pause can cancel it and the caller knows who did."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.cancelled_by = ""

    def cancel(self, by: str) -> None:
        if not self.cancelled_by:
            self.cancelled_by = by
            self.call.cancel()


class Load:
    """64 workers drawing requests from a seeded pool; pausable between calls."""

    def __init__(self, stub: Any, pool: list[tuple[str, list[int]]], args: argparse.Namespace):
        self.stub = stub
        self.pool = pool
        self.args = args
        self.running = asyncio.Event()
        self.stopping = False
        self.live: set[Live] = set()
        self.tally = Tally()
        self.all_started = 0
        self.all_ended = 0
        self.hung = 0

    def draw(self, rng: random.Random) -> Plan:
        prompt, ids = rng.choice(self.pool)
        mode = rng.choices(("normal", "cancel", "deadline"), (70, 15, 15))[0]
        plan = Plan(
            prompt=prompt,
            ids=ids,
            use_ids=rng.random() < 0.25,
            max_tokens=rng.choice(MAX_TOKENS),
            temperature=rng.choice((0.0, 0.8)),
            ignore_eos=rng.random() < 0.5,
            mode=mode,
            timeout_s=self.args.bound_s,
        )
        if mode == "deadline":
            plan.timeout_s = rng.uniform(0.2, 6.0)
        elif mode == "cancel" and rng.random() < 0.5:
            plan.cancel_after_tokens = rng.randint(1, 16)
        elif mode == "cancel":
            plan.cancel_after_s = rng.uniform(0.05, 5.0)
        return plan

    async def worker(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while not self.stopping:
            await self.running.wait()
            if self.stopping:
                return
            await self.request(self.draw(rng), rng)

    async def request(self, plan: Plan, rng: random.Random) -> None:
        """One request: retried after RetryInfo's delay while the queue is full."""
        for _ in range(self.args.max_attempts):
            await self.running.wait()
            if self.stopping:
                return
            status, retry_after_s = await self.attempt(plan, rng)
            if status != "RESOURCE_EXHAUSTED":
                return
            self.tally.retries_honoured += 1
            self.tally.retry_wait_s += retry_after_s
            await asyncio.sleep(retry_after_s)

    def _message(self, plan: Plan, rng: random.Random) -> Any:
        params = pb.GenerationParams(
            sampling=pb.SamplingParams(temperature=plan.temperature, seed=rng.getrandbits(31)),
            stopping=pb.StoppingCriteria(max_tokens=plan.max_tokens, ignore_eos=plan.ignore_eos),
        )
        if plan.use_ids:
            request = pb.GenerateTokensRequest(token_ids=plan.ids, params=params)
            return self.stub.GenerateTokens(request, timeout=plan.timeout_s)
        request = pb.StreamGenerateRequest(prompt=plan.prompt, params=params)
        return self.stub.StreamGenerate(request, timeout=plan.timeout_s)

    async def attempt(self, plan: Plan, rng: random.Random) -> tuple[str, float]:
        """One call to its end; returns the status recorded and RetryInfo's delay."""
        live = Live(self._message(plan, rng))
        self.live.add(live)
        self.tally.calls_started += 1
        self.all_started += 1
        timer = None
        if plan.cancel_after_s:
            timer = asyncio.get_running_loop().call_later(plan.cancel_after_s, live.cancel, "own")
        try:
            async with asyncio.timeout(plan.timeout_s + BACKSTOP_S):
                dones, error = await self._consume(live, plan)
            status, retry_after_s = await self._classify(live, plan, dones, error)
        except TimeoutError:
            live.cancel("backstop")
            self.hung += 1
            status, retry_after_s = "HUNG", 0.0
            self.tally.unexpected.append(f"HUNG after {plan.timeout_s + BACKSTOP_S:.1f} s")
        finally:
            if timer is not None:
                timer.cancel()
            self.live.discard(live)
            self.tally.calls_ended += 1
            self.all_ended += 1
        self.tally.statuses[status] += 1
        return status, retry_after_s

    async def _consume(self, live: Live, plan: Plan) -> tuple[int, grpc.aio.AioRpcError | None]:
        received = dones = 0
        try:
            async for message in live.call:
                if message.HasField("delta"):
                    n = len(message.delta.token_ids)
                    received += n
                    self.tally.tokens += n
                    if plan.cancel_after_tokens and received >= plan.cancel_after_tokens:
                        live.cancel("own")
                elif message.HasField("done"):
                    dones += 1
        except asyncio.CancelledError:
            if not live.cancelled_by:
                raise  # not ours: let the task be cancelled
        except grpc.aio.AioRpcError as error:
            return dones, error
        return dones, None

    async def _classify(
        self, live: Live, plan: Plan, dones: int, error: grpc.aio.AioRpcError | None
    ) -> tuple[str, float]:
        code = error.code() if error is not None else await live.call.code()
        name = code.name
        if name == "OK" and dones == 1:
            return "OK", 0.0
        if name == "CANCELLED" and live.cancelled_by == "own":
            return "CANCELLED", 0.0
        if name == "CANCELLED" and live.cancelled_by == "pause":
            return "CANCELLED_AT_PAUSE", 0.0
        if name == "DEADLINE_EXCEEDED" and plan.mode == "deadline":
            return "DEADLINE_EXCEEDED", 0.0
        if error is not None and name == "RESOURCE_EXHAUSTED":
            typed = from_rpc_error(error)
            if isinstance(typed, QueueFullError) and typed.retry_after_s is not None:
                return "RESOURCE_EXHAUSTED", typed.retry_after_s
        detail = error.details() if error is not None else f"{dones} done messages"
        why = f"{name} ({plan.mode}, timeout {plan.timeout_s:.1f} s): {detail}"
        self.tally.unexpected.append(why)
        return f"UNEXPECTED_{name}", 0.0

    async def pause(self, drain_s: float) -> dict[str, Any]:
        """Stop starting calls; let those in flight end for drain_s, then cancel the rest."""
        self.running.clear()
        t0 = time.monotonic()
        while self.live and time.monotonic() - t0 < drain_s:
            await asyncio.sleep(0.1)
        cancelled = len(self.live)
        for live in list(self.live):
            live.cancel("pause")
        while self.live and time.monotonic() - t0 < drain_s + BACKSTOP_S:
            await asyncio.sleep(0.05)
        return {
            "drained_s": time.monotonic() - t0,
            "cancelled_at_pause": cancelled,
            "still_in_flight": len(self.live),
        }


class Server:
    """`llama-grpc serve` as a subprocess on a free loopback port; /proc readings of its PID."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("llama-grpc")
        self.cmd = [
            str(exe),
            "serve",
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--threads", str(args.threads), "--threads-batch", str(args.threads)),
            *("--n-parallel", str(args.n_parallel), "--n-ctx", str(args.n_ctx)),
            *("--max-queue", str(args.max_queue), "--log-level", "warning"),
        ]
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - open for the server's lifetime
            prefix="soak-server-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        wait_serving(self.target, self.proc, 180.0)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def threads(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
        return -1

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> dict[str, Any]:
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return {"exit_code": code, **log_summary(Path(self.log.name))}


def log_summary(path: Path) -> dict[str, Any]:
    """Server log lines by level (it logs at warning and above), the first few kept."""
    levels: Counter[str] = Counter()
    first: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            level = str(json.loads(line).get("level", "?"))
        except (json.JSONDecodeError, AttributeError):
            level = "unparsed"
        levels[level] += 1
        if len(first) < 10:
            first.append(line[:400])
    with contextlib.suppress(OSError):
        path.unlink()
    return {"log_lines_by_level": dict(levels), "log_first_lines": first}


async def build_pool(stub: Any, seed: int) -> list[tuple[str, list[int]]]:
    """POOL prompts of mixed lengths, a quarter behind a shared system prefix, with their ids."""
    rng = random.Random(seed)
    system = seeded_text(SYSTEM_WORDS, seed + 1) + "\n\n"
    pool = []
    for i in range(POOL):
        words = rng.choices(PROMPT_WORDS, PROMPT_WEIGHTS)[0]
        text = seeded_text(words, seed * 7919 + i)
        if rng.random() < 0.25:
            text = system + text
        reply = await stub.Tokenize(pb.TokenizeRequest(text=text))
        pool.append((text, list(reply.token_ids)))
    return pool


async def stats(stub: Any) -> Any:
    return await stub.GetStats(pb.GetStatsRequest(), timeout=10)


async def wait_idle(stub: Any, bound_s: float = 60.0) -> tuple[Any, float]:
    """GetStats once the server has no active slot and an empty queue (bounded wait)."""
    t0 = time.monotonic()
    reply = await stats(stub)
    while (reply.active_slots or reply.queue_depth) and time.monotonic() - t0 < bound_s:
        await asyncio.sleep(0.1)
        reply = await stats(stub)
    return reply, time.monotonic() - t0


def kv_reading(reply: Any, bound: int) -> dict[str, Any]:
    cached = sum(s.cached_tokens for s in reply.slots)
    idle = reply.active_slots == 0 and reply.queue_depth == 0
    return {
        "idle": idle,
        "kv_cells_used": reply.kv_cells_used,
        "kv_cells_total": reply.kv_cells_total,
        "slots_cached_tokens": [s.cached_tokens for s in reply.slots],
        "baseline_cached_prefix": cached,
        "baseline_bound": bound,
        "ok": idle
        and max((s.cached_tokens for s in reply.slots), default=0)
        <= reply.kv_cells_used
        <= cached
        <= bound,
    }


def server_deltas(before: Any, window_end: Any, after: Any, seconds: float) -> dict[str, Any]:
    """GetStats counters over the minute (pause included); generated tok/s over the window."""
    keys = (
        "requests_started",
        "requests_finished",
        "requests_failed",
        "requests_cancelled",
        "requests_deadline_exceeded",
        "requests_rejected",
        "generated_tokens",
        "prompt_tokens",
        "cached_prompt_tokens",
        "preemptions",
    )
    out: dict[str, Any] = {k: getattr(after, k) - getattr(before, k) for k in keys}
    generated = window_end.generated_tokens - before.generated_tokens
    out["generated_tok_s"] = generated / seconds if seconds else 0.0
    return out


async def one_minute(
    load: Load, server: Server, minute: int, bound: int, args: argparse.Namespace
) -> dict[str, Any]:
    before = await stats(load.stub)
    load.tally = tally = Tally()
    t0 = time.monotonic()
    load.running.set()
    await asyncio.sleep(args.minute_s)
    window_s = time.monotonic() - t0
    tally.tokens_in_window = tally.tokens
    window_end = await stats(load.stub)
    busy = {"rss_bytes": server.rss_bytes(), "fds": server.fds(), "threads": server.threads()}
    drain = await load.pause(args.drain_s)
    reply, idle_wait_s = await wait_idle(load.stub)
    row = {
        "minute": minute,
        "window_s": window_s,
        "statuses": dict(sorted(tally.statuses.items())),
        "unexpected": tally.unexpected[:20],
        "calls_started": tally.calls_started,
        "calls_ended": tally.calls_ended,
        "retries_honoured": tally.retries_honoured,
        "retry_wait_s": tally.retry_wait_s,
        "tokens_received": tally.tokens,
        "tok_s": tally.tokens_in_window / window_s,
        "busy": busy,
        "pause": {**drain, "idle_wait_s": idle_wait_s},
        "idle": {
            "rss_bytes": server.rss_bytes(),
            "fds": server.fds(),
            "threads": server.threads(),
            "kv": kv_reading(reply, bound),
        },
        "server": server_deltas(before, window_end, reply, window_s),
        "load_average": list(os.getloadavg()),
    }
    progress(
        f"minute {minute}: {row['statuses']} tok/s {row['tok_s']:.1f} "
        f"RSS {row['idle']['rss_bytes'] / 2**20:.1f} MiB fds {row['idle']['fds']} "
        f"idle KV {reply.kv_cells_used} (cached {row['idle']['kv']['baseline_cached_prefix']})"
    )
    return row


async def probe(stub: Any, n_ctx: int, margin: int) -> dict[str, Any]:
    """A prompt of n_ctx - margin tokens plus 8 generated: fits only if the KV is all free."""
    n_prompt = n_ctx - margin
    ids = await prompt_of(stub, n_prompt, 4242)
    params = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=8, ignore_eos=True),
    )
    t0 = time.monotonic()
    tokens = dones = 0
    code = "OK"
    try:
        call = stub.GenerateTokens(
            pb.GenerateTokensRequest(token_ids=ids, params=params), timeout=300
        )
        async for message in call:
            if message.HasField("delta"):
                tokens += len(message.delta.token_ids)
            elif message.HasField("done"):
                dones += 1
    except grpc.aio.AioRpcError as error:
        code = f"{error.code().name}: {error.details()}"
    return {
        "prompt_tokens": n_prompt,
        "generated": tokens,
        "status": code,
        "seconds": time.monotonic() - t0,
        "ok": code == "OK" and tokens == 8 and dones == 1,
    }


async def soak(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        pool = await build_pool(stub, args.seed)
        longest = max(len(ids) for _, ids in pool) + max(MAX_TOKENS)
        bound = min(args.n_ctx, args.n_parallel * longest)
        load = Load(stub, pool, args)
        workers = [asyncio.create_task(load.worker(i)) for i in range(args.streams)]
        initial, _ = await wait_idle(stub)
        idle_start = {"rss_bytes": server.rss_bytes(), "fds": server.fds()}
        rows = []
        for minute in range(1, args.minutes + 1):
            rows.append(await one_minute(load, server, minute, bound, args))
        load.stopping = True
        load.running.set()
        _, pending = await asyncio.wait(workers, timeout=args.bound_s + 2 * BACKSTOP_S)
        for task in pending:
            task.cancel()
        end_check = {
            "calls_started": load.all_started,
            "calls_ended": load.all_ended,
            "workers_not_ended": len(pending),
            "hung": load.hung,
        }
        final = await probe(stub, args.n_ctx, args.probe_margin)
        after_probe, _ = await wait_idle(stub)
        return {
            "pool": pool_facts(pool, longest),
            "kv_bound": bound,
            "initial": {**idle_start, "kv": kv_reading(initial, bound)},
            "minutes": rows,
            "end": end_check,
            "probe": {**final, "kv_after": kv_reading(after_probe, args.n_ctx)},
            "after_probe": {"rss_bytes": server.rss_bytes(), "fds": server.fds()},
        }


def pool_facts(pool: list[tuple[str, list[int]]], longest: int) -> dict[str, Any]:
    lengths = sorted(len(ids) for _, ids in pool)
    return {
        "prompts": len(pool),
        "prompt_tokens_min": lengths[0],
        "prompt_tokens_median": lengths[len(lengths) // 2],
        "prompt_tokens_max": lengths[-1],
        "longest_request_tokens": longest,
    }


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["minutes"]
    totals: Counter[str] = Counter()
    for row in rows:
        totals.update(row["statuses"])
    unexpected = sum(n for status, n in totals.items() if status not in EXPECTED)
    ref = rows[1] if len(rows) > 1 else rows[0]
    rss_ref, rss_end = ref["idle"]["rss_bytes"], rows[-1]["idle"]["rss_bytes"]
    end = result["end"]
    checks = {
        "no_unexpected_status": unexpected == 0,
        "no_hung_call": end["hung"] == 0
        and end["calls_started"] == end["calls_ended"]
        and end["workers_not_ended"] == 0
        and all(r["pause"]["still_in_flight"] == 0 for r in rows),
        "rss_end_within_5pct_of_minute_2": abs(rss_end - rss_ref) <= 0.05 * rss_ref,
        "idle_kv_is_cached_prefix_baseline": all(r["idle"]["kv"]["ok"] for r in rows),
        "full_context_probe_ok": result["probe"]["ok"],
    }
    return {
        "statuses_total": dict(sorted(totals.items())),
        "unexpected_total": unexpected,
        "rss_minute_2_bytes": rss_ref,
        "rss_end_bytes": rss_end,
        "rss_change": (rss_end - rss_ref) / rss_ref,
        "fds_minute_2": ref["idle"]["fds"],
        "fds_end": rows[-1]["idle"]["fds"],
        "idle_kv_per_minute": [r["idle"]["kv"]["kv_cells_used"] for r in rows],
        "tok_s_per_minute": [r["tok_s"] for r in rows],
        "checks": checks,
        "passed": all(checks.values()),
    }


def plot(result: dict[str, Any], settings: dict[str, Any]) -> None:
    plt = pyplot()
    rows = result["minutes"]
    xs = [r["minute"] for r in rows]
    fig, (ax_rss, ax_tok, ax_fd) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    mib = 2**20
    ax_rss.plot(xs, [r["idle"]["rss_bytes"] / mib for r in rows], "o-", label="idle (at pause)")
    ax_rss.plot(xs, [r["busy"]["rss_bytes"] / mib for r in rows], "s--", label="under load")
    ref = result["verdict"]["rss_minute_2_bytes"] / mib
    ax_rss.axhspan(ref * 0.95, ref * 1.05, color="tab:green", alpha=0.12, label="±5 % of minute 2")
    ax_rss.set_ylabel("server RSS (MiB)")
    ax_rss.legend(fontsize=8)
    ax_rss.set_title(
        f"soak: {settings['streams']} streams, {settings['n_parallel']} slots, "
        f"max_queue {settings['max_queue']}: "
        + ("passed" if result["verdict"]["passed"] else "FAILED")
    )
    ax_tok.plot(xs, [r["tok_s"] for r in rows], "o-", label="tokens received / s")
    ax_tok.plot(
        xs, [r["server"]["generated_tok_s"] for r in rows], "x:", label="server generated / s"
    )
    ax_tok.set_ylabel("tokens/s")
    ax_tok.legend(fontsize=8)
    ax_fd.plot(xs, [r["idle"]["fds"] for r in rows], "o-", label="open fds (idle)")
    ax_kv = ax_fd.twinx()
    ax_kv.plot(
        xs, [r["idle"]["kv"]["kv_cells_used"] for r in rows], "^:", color="tab:red", label="idle KV"
    )
    ax_fd.set_ylabel("open fds")
    ax_kv.set_ylabel("idle KV cells", color="tab:red")
    ax_fd.set_xlabel("minute")
    ax_fd.set_xticks(xs)
    for ax in (ax_rss, ax_tok, ax_fd):
        ax.grid(alpha=0.3)
    save_figure(fig, "soak")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=10)
    parser.add_argument("--minute-s", type=float, default=60.0, help="seconds of load a minute")
    parser.add_argument("--streams", type=int, default=STREAMS)
    parser.add_argument("--n-parallel", type=int, default=8)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--max-queue", type=int, default=48, help="below streams: queue fills")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--drain-s", type=float, default=15.0)
    parser.add_argument("--bound-s", type=float, default=300.0, help="deadline of normal calls")
    parser.add_argument("--max-attempts", type=int, default=100, help="per request, queue full")
    parser.add_argument("--probe-margin", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.minutes < 1:
        parser.error("--minutes must be at least 1")
    facts = machine_facts(args.threads)  # the load average before the run
    server = Server(args)
    progress(f"starting {' '.join(server.cmd[1:])} (pid {server.proc.pid})")
    try:
        server.wait_ready()
        result = asyncio.run(soak(server, args))
    finally:
        stopped = server.stop()
    result["verdict"] = verdict(result)
    data = {
        "benchmark": "soak",
        "command": "python bench/soak.py " + " ".join(sys.argv[1:]),
        "server_command": " ".join(["llama-grpc", *server.cmd[1:]]),
        "workload": {
            "streams": args.streams,
            "prompt_words": list(PROMPT_WORDS),
            "prompt_weights": list(PROMPT_WEIGHTS),
            "shared_system_prefix_words": SYSTEM_WORDS,
            "max_tokens": list(MAX_TOKENS),
            "modes": "70 % normal (deadline --bound-s), 15 % cancel (after 1-16 tokens or "
            "0.05-5 s), 15 % short deadline (0.2-6 s); 25 % GenerateTokens, else StreamGenerate",
            "expected_statuses": list(EXPECTED),
            "kv_check": KV_CHECK,
        },
        "settings": vars(args),
        "machine": facts,
        "server_exit": stopped,
        **result,
    }
    write_json("soak", finish_facts(data))
    plot(data, vars(args))
    v = data["verdict"]
    print(f"statuses {v['statuses_total']}  unexpected {v['unexpected_total']}")
    print(
        f"RSS minute 2 {v['rss_minute_2_bytes'] / 2**20:.1f} MiB -> end "
        f"{v['rss_end_bytes'] / 2**20:.1f} MiB ({v['rss_change']:+.2%}); fds "
        f"{v['fds_minute_2']} -> {v['fds_end']}; idle KV {v['idle_kv_per_minute']}"
    )
    print(f"checks {v['checks']}  passed: {v['passed']}")
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
