"""Soak benchmark: 64 concurrent streams against a real `llama-grpc serve` subprocess on
127.0.0.1 for --minutes, with mixed prompt lengths, random client cancels and deadlines.

Every minute the load pauses: no new call starts, the calls in flight get --drain-s to end and
are then cancelled, and once the server reports no active slot and an empty queue its RSS and
open file descriptors (/proc/PID) and GetStats' kv_cells_used are read. Per minute: calls by
status, tokens received per second, RSS, fds, idle KV, load average.

Injected stalls, alongside that traffic (issue 34):
- slow readers: a stream whose client stops reading mid-stream for a while under the server's
  --stalled-reader-s, then reads to the end (over its own channel with a small HTTP/2 receive
  window, so the server's --stream-buffer-tokens back-pressure engages), must end OK with exactly
  its max_tokens; now and then one stops for longer than --stalled-reader-s and must end
  RESOURCE_EXHAUSTED with reason STALLED_READER;
- a slow disk: the server runs with the disk tier on (--kv-cache-dir, the RAM tier off so that
  evicted caches go to disk and come back from it) through bench/soak_faults.py, whose disk reads
  stall --slow-disk-read-s (on the tier's reader thread: the requests restoring wait, RESTORING,
  and nothing else): the first read after every --slow-disk-period-s, since the tier has one
  reader thread and the soak restores a few files a second, so a stall on every read would queue
  each restore behind the one before and leave the 64 callers waiting on the disk rather than
  loading the engine (--slow-disk-period-s 0 does that); the tier's GetStats figures are read
  every minute and the tokens per second must not collapse;
- one engine hang, in a separate replica started at --hang-minute (bench/soak_faults.py with
  HANG_AT_PASS, --watchdog-s 5 --grace-s 2): every stream sent to it must end UNAVAILABLE with
  reason ENGINE_HUNG within the watchdog's bound plus a slack, its health must turn NOT_SERVING
  (GetStats: one watchdog trip), and the process must exit with code 71.

Expected statuses: OK (with exactly one `done`), CANCELLED for the bench's own cancels (random or
at a pause), DEADLINE_EXCEEDED for the calls given a short deadline on purpose,
RESOURCE_EXHAUSTED carrying RetryInfo (queue full: the caller waits retry_after_s, then retries
the same request), OK_SLOW_READER (a slow reader's exact output) and STALLED_READER (a stalled
reader ended). Anything else is unexpected. Every call has a deadline and a client-side backstop
30 s after it; a call still running then is a hung call.

Pass: 0 unexpected statuses, 0 hung calls, idle RSS at the end within ±5 % of minute 2 and open
fds within FD_SLACK of it, at every pause the idle KV is the cached-prefix baseline (see
KV_CHECK), every minute's tokens/s at least half the median minute's, slow readers served and
stalled ones ended, the slow disk really read from, and the hang replica caught as above. After
the last minute, a prompt of nearly n_ctx tokens must succeed: the cells idle slots keep are
really reclaimable.

    make bench-soak                   # or: python bench/soak.py --minutes 10
    python bench/soak.py --minutes 2 --minute-s 30 --hang-minute 1 --name soak_smoke  # a look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
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

from llama_grpc import AsyncClient, Done
from llama_grpc.errors import QueueFullError, UnavailableError, from_rpc_error
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

STREAMS = 64
BACKSTOP_S = 30.0  # a call still running this long after its own deadline is hung
PROMPT_WORDS = (8, 32, 128, 512, 1024)  # mixed prompt lengths (words; ~1.1 tokens each)
PROMPT_WEIGHTS = (30, 30, 25, 12, 3)  # mostly short, some long: prefill must not starve decode
MAX_TOKENS = (8, 16, 32, 64, 128)
SYSTEM_WORDS = 200  # a quarter of the prompts start with this shared prefix
POOL = 240  # distinct prompts, drawn again and again (so prefixes repeat, as in real traffic)
MODES = ("normal", "cancel", "deadline", "slow_reader", "stalled_reader")
MODE_WEIGHTS = (64, 14, 14, 6, 2)
SLOW_MODES = ("slow_reader", "stalled_reader")
SLOW_READER_MAX_TOKENS = 128  # well past the receive window + --stream-buffer-tokens: it pauses
STALLED_MAX_TOKENS = 256
STALL_EXTRA_S = 20.0  # a stalled reader stops this much longer than --stalled-reader-s: the
# server's clock starts once the receive window and the stream buffer are full (~12 s at the
# soak's ~6 tokens/s a stream)
# A slow reader's channel: a small receive window, so the server's writes wait for the reader
# within a few dozen tokens (by default HTTP/2 lets ~2,000 small deltas through unread).
SLOW_OPTIONS = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))
EXPECTED = (
    "OK",
    "CANCELLED",
    "CANCELLED_AT_PAUSE",
    "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED",
    "OK_SLOW_READER",
    "STALLED_READER",
)
FD_SLACK = 4  # open fds at the end within this of minute 2 (a disk write may hold one)
COLLAPSE = 0.5  # every minute's tokens/s at least this fraction of the median minute's
FAULTS = Path(__file__).resolve().parent / "soak_faults.py"
EXIT_ENGINE_HUNG = 71
HANG_SLACK_S = 10.0  # a hang replica's stream ends within the watchdog's bound plus this
HANG_AT_PASS = 3  # the warm-up's pass is the first: the replica's first decode pass hangs
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
    mode: str  # MODES
    timeout_s: float
    cancel_after_tokens: int = 0
    cancel_after_s: float = 0.0
    stall_after_tokens: int = 0  # slow and stalled readers stop reading after these tokens
    stall_s: float = 0.0  # for this long


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
        self.cancelled = asyncio.Event()  # ends a reader's stop early

    def cancel(self, by: str) -> None:
        if not self.cancelled_by:
            self.cancelled_by = by
            self.call.cancel()
            self.cancelled.set()


class Load:
    """64 workers drawing requests from a seeded pool; pausable between calls."""

    def __init__(
        self, stub: Any, target: str, pool: list[tuple[str, list[int]]], args: argparse.Namespace
    ):
        self.stub = stub
        self.target = target
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
        mode = rng.choices(MODES, MODE_WEIGHTS)[0]
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
        elif mode in SLOW_MODES:
            plan.ignore_eos = True  # the exact number of tokens is known: max_tokens
            plan.stall_after_tokens = rng.randint(1, 16)
            if mode == "slow_reader":
                plan.max_tokens = SLOW_READER_MAX_TOKENS
                plan.stall_s = rng.uniform(0.3, 0.9) * self.args.stalled_reader_s
            else:
                plan.max_tokens = STALLED_MAX_TOKENS
                plan.stall_s = self.args.stalled_reader_s + STALL_EXTRA_S
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

    def _message(self, stub: Any, plan: Plan, rng: random.Random) -> Any:
        params = pb.GenerationParams(
            sampling=pb.SamplingParams(temperature=plan.temperature, seed=rng.getrandbits(31)),
            stopping=pb.StoppingCriteria(max_tokens=plan.max_tokens, ignore_eos=plan.ignore_eos),
        )
        if plan.use_ids:
            by_ids = pb.GenerateTokensRequest(token_ids=plan.ids, params=params)
            return stub.GenerateTokens(by_ids, timeout=plan.timeout_s)
        by_text = pb.StreamGenerateRequest(prompt=plan.prompt, params=params)
        return stub.StreamGenerate(by_text, timeout=plan.timeout_s)

    async def attempt(self, plan: Plan, rng: random.Random) -> tuple[str, float]:
        """One call to its end; returns the status recorded and RetryInfo's delay. A slow or
        stalled reader has a channel of its own (its small receive window is per connection)."""
        channel = None
        stub = self.stub
        if plan.mode in SLOW_MODES:
            channel = grpc.aio.insecure_channel(self.target, options=SLOW_OPTIONS)
            stub = pb_grpc.LlmServiceStub(channel)
        live = Live(self._message(stub, plan, rng))
        self.live.add(live)
        self.tally.calls_started += 1
        self.all_started += 1
        timer = None
        if plan.cancel_after_s:
            timer = asyncio.get_running_loop().call_later(plan.cancel_after_s, live.cancel, "own")
        try:
            async with asyncio.timeout(plan.timeout_s + BACKSTOP_S):
                received, dones, error = await self._consume(live, plan)
            status, retry_after_s = await self._classify(live, plan, received, dones, error)
        except TimeoutError:
            live.cancel("backstop")
            self.hung += 1
            status, retry_after_s = "HUNG", 0.0
            self.tally.unexpected.append(f"HUNG after {plan.timeout_s + BACKSTOP_S:.1f} s")
        finally:
            if timer is not None:
                timer.cancel()
            if channel is not None:
                await channel.close(None)
            self.live.discard(live)
            self.tally.calls_ended += 1
            self.all_ended += 1
        self.tally.statuses[status] += 1
        return status, retry_after_s

    async def _consume(
        self, live: Live, plan: Plan
    ) -> tuple[int, int, grpc.aio.AioRpcError | None]:
        """(tokens received, done messages, the error the call ended with)."""
        received = dones = 0
        stopped = False
        try:
            async for message in live.call:
                if message.HasField("delta"):
                    n = len(message.delta.token_ids)
                    received += n
                    self.tally.tokens += n
                    if plan.cancel_after_tokens and received >= plan.cancel_after_tokens:
                        live.cancel("own")
                    if plan.stall_s and not stopped and received >= plan.stall_after_tokens:
                        stopped = True  # a slow reader: no read for stall_s (or to a cancel)
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(plan.stall_s):
                                await live.cancelled.wait()
                elif message.HasField("done"):
                    dones += 1
        except asyncio.CancelledError:
            if not live.cancelled_by:
                raise  # not ours: let the task be cancelled
        except grpc.aio.AioRpcError as error:
            return received, dones, error
        return received, dones, None

    async def _classify(
        self,
        live: Live,
        plan: Plan,
        received: int,
        dones: int,
        error: grpc.aio.AioRpcError | None,
    ) -> tuple[str, float]:
        code = error.code() if error is not None else await live.call.code()
        name = code.name
        typed = from_rpc_error(error) if error is not None else None
        reader = reader_status(plan, name, received, dones, typed)
        if reader:
            return reader, 0.0
        if name == "OK" and dones == 1 and plan.mode not in SLOW_MODES:
            return "OK", 0.0
        if name == "CANCELLED" and live.cancelled_by in ("own", "pause"):
            return ("CANCELLED" if live.cancelled_by == "own" else "CANCELLED_AT_PAUSE"), 0.0
        if name == "DEADLINE_EXCEEDED" and plan.mode == "deadline":
            return "DEADLINE_EXCEEDED", 0.0
        if isinstance(typed, QueueFullError) and typed.retry_after_s is not None:
            return "RESOURCE_EXHAUSTED", typed.retry_after_s
        detail = (
            error.details() if error is not None else f"{dones} done, {received} tokens received"
        )
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


def reader_status(plan: Plan, name: str, received: int, dones: int, typed: Any) -> str:
    """A slow reader's exact output (OK_SLOW_READER) or a stalled reader ended by the server
    (STALLED_READER); "" for anything else (the other rules then apply). A stalled reader that
    gets its exact output is a slow reader: it read again before its stream had been stopped
    --stalled-reader-s (its buffer filled late), and the server rightly waited."""
    if plan.mode in SLOW_MODES and (name, dones, received) == ("OK", 1, plan.max_tokens):
        return "OK_SLOW_READER"
    if plan.mode == "stalled_reader" and getattr(typed, "reason", "") == "STALLED_READER":
        return "STALLED_READER"
    return ""


class Server:
    """`llama-grpc serve` with the faults of bench/soak_faults.py (`faults`: its environment
    variables) as a subprocess on a free loopback port; /proc readings of its PID."""

    def __init__(self, options: list[str], faults: dict[str, str], name: str = "server") -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.options = [
            *("--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"),
            *options,
        ]
        self.cmd = [sys.executable, str(FAULTS), *self.options]
        self.faults = faults
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - open for the server's lifetime
            prefix=f"soak-{name}-", suffix=".log", delete=False
        )
        env = {**os.environ, **faults}
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def command(self) -> str:
        """The command line as a reader would type it (the faults in the environment)."""
        env = " ".join(f"{k}={v}" for k, v in self.faults.items())
        return f"{env} python bench/soak_faults.py {' '.join(self.options)}".strip()

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


def server_options(args: argparse.Namespace, kv_dir: str) -> list[str]:
    """The soak's server: back-pressure for slow readers, the disk tier on and the RAM tier off
    (evicted caches go to the disk and are restored from it: every restore reads the disk)."""
    return [
        *("--threads", str(args.threads), "--threads-batch", str(args.threads)),
        *("--n-parallel", str(args.n_parallel), "--n-ctx", str(args.n_ctx)),
        *("--max-queue", str(args.max_queue)),
        *("--stream-buffer-tokens", str(args.stream_buffer_tokens)),
        *("--stalled-reader-s", f"{args.stalled_reader_s:g}"),
        *("--kv-cache-dir", kv_dir, "--kv-cache-disk-mb", str(args.kv_cache_disk_mb)),
        *("--prompt-cache-ram-mb", "0"),
    ]


def log_summary(path: Path) -> dict[str, Any]:
    """Server log lines by level (it logs at warning and above), the first few kept, and the
    events counted."""
    levels: Counter[str] = Counter()
    events: Counter[str] = Counter()
    first: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
            level = str(entry.get("level", "?"))
            events[str(entry.get("event", "?"))] += 1
        except (json.JSONDecodeError, AttributeError):
            level = "unparsed"
        levels[level] += 1
        if len(first) < 10:
            first.append(line[:400])
    with contextlib.suppress(OSError):
        path.unlink()
    return {
        "log_lines_by_level": dict(levels),
        "log_events": dict(events),
        "log_first_lines": first,
    }


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
        "stalled_readers",
        "stream_pauses",
    )
    out: dict[str, Any] = {k: getattr(after, k) - getattr(before, k) for k in keys}
    generated = window_end.generated_tokens - before.generated_tokens
    out["generated_tok_s"] = generated / seconds if seconds else 0.0
    return out


DISK_COUNTERS = (
    "hits",
    "misses",
    "writes",
    "evictions",
    "verify_failures",
    "read_failures",
    "write_failures",
)


def disk_figures(before: Any, after: Any) -> dict[str, Any]:
    """The disk tier over the minute (GetStats disk_cache_*): counters as deltas, the files and
    bytes held at the pause, the seconds its reader spent reading (the injected stalls in)."""
    out: dict[str, Any] = {
        k: getattr(after, f"disk_cache_{k}") - getattr(before, f"disk_cache_{k}")
        for k in DISK_COUNTERS
    }
    out["read_seconds"] = after.disk_cache_read_seconds - before.disk_cache_read_seconds
    out["entries"] = after.disk_cache_entries
    out["bytes"] = after.disk_cache_bytes
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
    row: dict[str, Any] = {
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
        "disk": disk_figures(before, reply),
        "load_average": list(os.getloadavg()),
    }
    disk = row["disk"]
    progress(
        f"minute {minute}: {row['statuses']} tok/s {row['tok_s']:.1f} "
        f"RSS {row['idle']['rss_bytes'] / 2**20:.1f} MiB fds {row['idle']['fds']} "
        f"idle KV {reply.kv_cells_used} (cached {row['idle']['kv']['baseline_cached_prefix']}) "
        f"disk hits {disk['hits']} writes {disk['writes']} read {disk['read_seconds']:.1f} s "
        f"failures {disk['read_failures']}/{disk['write_failures']}"
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


def hang_options(args: argparse.Namespace) -> list[str]:
    """The hang replica: small, one thread (beside the soak's server on the same cores)."""
    return [
        *("--threads", "1", "--threads-batch", "1", "--n-parallel", "2", "--n-ctx", "2048"),
        *("--watchdog-s", f"{args.hang_watchdog_s:g}", "--grace-s", f"{args.hang_grace_s:g}"),
    ]


async def hang_stream(client: AsyncClient, i: int, bound_s: float) -> dict[str, Any]:
    """One stream to the hang replica: how it ended, after how long, with how many tokens."""
    t0 = time.monotonic()
    got = 0
    outcome: BaseException | Done | None = None
    try:
        async for event in client.stream(
            f"Replica request {i}: tell a long story about the sea.",
            max_tokens=400,
            ignore_eos=True,
        ):
            if isinstance(event, Done):
                outcome = event
                break
            got += len(event.token_ids)
    except Exception as exc:  # the outcome looked for: UnavailableError (ENGINE_HUNG)
        outcome = exc
    seconds = time.monotonic() - t0
    reason = getattr(outcome, "reason", type(outcome).__name__)
    return {
        "tokens": got,
        "code": getattr(outcome, "code", "OK" if isinstance(outcome, Done) else "?"),
        "reason": reason,
        "message": str(outcome)[:300],
        "seconds": seconds,
        "ok": isinstance(outcome, UnavailableError)
        and reason == "ENGINE_HUNG"
        and seconds <= bound_s,
    }


async def watch_replica(client: AsyncClient, t0: float, bound_s: float) -> dict[str, Any]:
    """Health and GetStats polled until health is NOT_SERVING with the trip counted (or the
    process is gone, or bound_s)."""
    seen: dict[str, Any] = {"health_before": await client.health()}
    while time.monotonic() - t0 < bound_s:
        try:
            health = await client.health()
            stats = await client.stats()
        except Exception as exc:  # the process exited (after --grace-s)
            seen["ended_by"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            break
        seen["watchdog_trips"] = stats.watchdog_trips
        seen["engine_state"] = stats.engine_state
        seen["engine_error"] = stats.engine_error[:300]
        if health == "NOT_SERVING" and "not_serving_after_s" not in seen:
            seen["not_serving_after_s"] = time.monotonic() - t0
        if "not_serving_after_s" in seen and stats.watchdog_trips:
            break
        await asyncio.sleep(0.1)
    return seen


async def hang_replica(args: argparse.Namespace) -> dict[str, Any]:
    """A second server whose forward pass HANG_AT_PASS never returns: every stream sent to it
    ends UNAVAILABLE (ENGINE_HUNG) within --watchdog-s + HANG_SLACK_S, health turns NOT_SERVING
    and the process exits 71 after --grace-s."""
    replica = Server(hang_options(args), {"HANG_AT_PASS": str(HANG_AT_PASS)}, "hang-replica")
    progress(f"minute {args.hang_minute}: hang replica {replica.command()} ({replica.proc.pid})")
    t_start = time.monotonic()
    bound_s = args.hang_watchdog_s + HANG_SLACK_S
    out: dict[str, Any] = {"command": replica.command(), "stream_bound_s": bound_s}
    try:
        await asyncio.to_thread(replica.wait_ready)
        out["ready_after_s"] = time.monotonic() - t_start
        async with AsyncClient(replica.target, timeout=bound_s + 30) as client:
            t0 = time.monotonic()
            watch = asyncio.create_task(watch_replica(client, t0, bound_s + args.hang_grace_s))
            streams = await asyncio.gather(
                *(hang_stream(client, i, bound_s) for i in range(args.hang_streams))
            )
            out["streams"] = streams
            out["watch"] = await watch
        out["exit_code"] = await asyncio.to_thread(replica.proc.wait, 60)
        out["exited_after_s"] = time.monotonic() - t0
    except Exception as exc:  # recorded: the check fails, the soak goes on
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        out["server_exit"] = await asyncio.to_thread(replica.stop)  # at once if it exited
    watch_seen = out.get("watch", {})
    out["checks"] = {
        "every_stream_engine_hung_in_bound": bool(out.get("streams"))
        and all(st["ok"] for st in out["streams"]),
        "health_not_serving": "not_serving_after_s" in watch_seen
        and watch_seen.get("health_before") == "SERVING",
        "one_watchdog_trip": watch_seen.get("watchdog_trips") == 1,
        "exit_code_71": out.get("exit_code") == EXIT_ENGINE_HUNG,
        "engine_hung_logged": out["server_exit"]["log_events"].get("engine_hung", 0) == 1,
    }
    out["ok"] = all(out["checks"].values())
    ends = [(st["code"], st["reason"], round(st["seconds"], 1)) for st in out.get("streams", [])]
    progress(
        f"hang replica: streams {ends} health {watch_seen} exit {out.get('exit_code')}: "
        + ("ok" if out["ok"] else "FAILED")
    )
    return out


async def soak(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        pool = await build_pool(stub, args.seed)
        longest = max(len(ids) for _, ids in pool) + max(*MAX_TOKENS, STALLED_MAX_TOKENS)
        bound = min(args.n_ctx, args.n_parallel * longest)
        load = Load(stub, server.target, pool, args)
        workers = [asyncio.create_task(load.worker(i)) for i in range(args.streams)]
        initial, _ = await wait_idle(stub)
        idle_start = {"rss_bytes": server.rss_bytes(), "fds": server.fds()}
        rows = []
        hang: asyncio.Task[dict[str, Any]] | None = None
        for minute in range(1, args.minutes + 1):
            if minute == args.hang_minute:
                hang = asyncio.create_task(hang_replica(args))
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
            "hang_replica": await hang if hang is not None else None,
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
    tok_s = [r["tok_s"] for r in rows]
    disk: Counter[str] = Counter()
    for row in rows:
        disk.update({k: row["disk"][k] for k in (*DISK_COUNTERS, "read_seconds")})
    slow_disk_s = result["slow_disk_read_s"]
    hang = result.get("hang_replica")
    checks = {
        "no_unexpected_status": unexpected == 0,
        "no_hung_call": end["hung"] == 0
        and end["calls_started"] == end["calls_ended"]
        and end["workers_not_ended"] == 0
        and all(r["pause"]["still_in_flight"] == 0 for r in rows),
        "rss_end_within_5pct_of_minute_2": abs(rss_end - rss_ref) <= 0.05 * rss_ref,
        f"fds_end_within_{FD_SLACK}_of_minute_2": abs(rows[-1]["idle"]["fds"] - ref["idle"]["fds"])
        <= FD_SLACK,
        "idle_kv_is_cached_prefix_baseline": all(r["idle"]["kv"]["ok"] for r in rows),
        "tok_s_never_below_half_median": min(tok_s) >= COLLAPSE * statistics.median(tok_s),
        "slow_readers_served_exactly": totals["OK_SLOW_READER"] > 0
        and sum(r["server"]["stream_pauses"] for r in rows) > 0,
        "stalled_readers_ended": sum(r["server"]["stalled_readers"] for r in rows) > 0,
        "slow_disk_read_from": disk["hits"] > 0
        and (slow_disk_s <= 0 or disk["read_seconds"] >= slow_disk_s),
        "full_context_probe_ok": result["probe"]["ok"],
    }
    if hang is not None:
        checks["hang_replica_caught_exit_71"] = hang["ok"]
    return {
        "statuses_total": dict(sorted(totals.items())),
        "unexpected_total": unexpected,
        "rss_minute_2_bytes": rss_ref,
        "rss_end_bytes": rss_end,
        "rss_change": (rss_end - rss_ref) / rss_ref,
        "fds_minute_2": ref["idle"]["fds"],
        "fds_end": rows[-1]["idle"]["fds"],
        "idle_kv_per_minute": [r["idle"]["kv"]["kv_cells_used"] for r in rows],
        "tok_s_per_minute": tok_s,
        "tok_s_min_over_median": min(tok_s) / statistics.median(tok_s) if any(tok_s) else 0.0,
        "disk_total": dict(disk),
        "stalled_readers_server": sum(r["server"]["stalled_readers"] for r in rows),
        "stream_pauses_server": sum(r["server"]["stream_pauses"] for r in rows),
        "checks": checks,
        "passed": all(checks.values()),
    }


def plot(result: dict[str, Any], settings: dict[str, Any]) -> None:
    plt = pyplot()
    rows = result["minutes"]
    xs = [r["minute"] for r in rows]
    fig, (ax_rss, ax_tok, ax_fd, ax_stall) = plt.subplots(4, 1, figsize=(7, 10), sharex=True)
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
    hang = result.get("hang_replica")
    if hang is not None:
        ax_tok.axvline(
            settings["hang_minute"],
            color="tab:red",
            alpha=0.4,
            label=f"hang replica (exit {hang.get('exit_code')})",
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
    width = 0.25
    slow = [r["statuses"].get("OK_SLOW_READER", 0) for r in rows]
    stalled = [r["server"]["stalled_readers"] for r in rows]  # some cancelled at a pause after
    hits = [r["disk"]["hits"] for r in rows]
    ax_stall.bar([x - width for x in xs], slow, width, label="slow readers OK (exact)")
    ax_stall.bar(xs, stalled, width, label="stalled readers ended (server)")
    ax_stall.bar([x + width for x in xs], hits, width, label="disk restores")
    ax_stall.set_ylabel("calls / minute")
    ax_stall.legend(fontsize=8)
    ax_stall.set_xlabel("minute")
    ax_stall.set_xticks(xs)
    for ax in (ax_rss, ax_tok, ax_fd, ax_stall):
        ax.grid(alpha=0.3)
    save_figure(fig, settings["name"])


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--stream-buffer-tokens", type=int, default=32)
    parser.add_argument("--stalled-reader-s", type=float, default=8.0)
    parser.add_argument(
        "--kv-cache-disk-mb", type=int, default=1024, help="the disk tier's budget (a temp dir)"
    )
    parser.add_argument(
        "--slow-disk-read-s", type=float, default=2.0, help="a disk-tier read stalls this long"
    )
    parser.add_argument(
        "--slow-disk-period-s",
        type=float,
        default=8.0,
        help="the first disk read after every this many seconds stalls (0 = every read)",
    )
    parser.add_argument(
        "--hang-minute", type=int, default=3, help="start the hang replica then (0 = none)"
    )
    parser.add_argument("--hang-streams", type=int, default=3)
    parser.add_argument("--hang-watchdog-s", type=float, default=5.0)
    parser.add_argument("--hang-grace-s", type=float, default=2.0)
    parser.add_argument("--name", default="soak", help="results file name (a smoke: another)")
    args = parser.parse_args()
    if args.minutes < 1:
        parser.error("--minutes must be at least 1")
    if args.stalled_reader_s <= 0 or args.stream_buffer_tokens <= 0:
        parser.error("the slow readers need --stalled-reader-s and --stream-buffer-tokens > 0")
    if args.hang_minute > args.minutes:
        parser.error("--hang-minute is past the last minute")
    return args


def workload(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "streams": args.streams,
        "prompt_words": list(PROMPT_WORDS),
        "prompt_weights": list(PROMPT_WEIGHTS),
        "shared_system_prefix_words": SYSTEM_WORDS,
        "max_tokens": list(MAX_TOKENS),
        "modes": "64 % normal (deadline --bound-s), 14 % cancel (after 1-16 tokens or "
        "0.05-5 s), 14 % short deadline (0.2-6 s), 6 % slow reader (stops reading after "
        f"1-16 tokens for 0.3-0.9 x --stalled-reader-s, {SLOW_READER_MAX_TOKENS} tokens), "
        f"2 % stalled reader (stops for --stalled-reader-s + {STALL_EXTRA_S:.0f} s, "
        f"{STALLED_MAX_TOKENS} tokens); 25 % GenerateTokens, else StreamGenerate",
        "slow_disk": f"every disk-tier read stalls {args.slow_disk_read_s:g} s"
        if args.slow_disk_period_s <= 0
        else f"the first disk-tier read after every {args.slow_disk_period_s:g} s stalls "
        f"{args.slow_disk_read_s:g} s (the tier has one reader thread)",
        "hang_replica": f"minute {args.hang_minute}: {args.hang_streams} streams to a "
        f"replica whose forward pass {HANG_AT_PASS} never returns"
        if args.hang_minute
        else "none",
        "expected_statuses": list(EXPECTED),
        "kv_check": KV_CHECK,
    }


def main() -> int:
    args = parse_args()
    facts = machine_facts(args.threads)  # the load average before the run
    kv_dir = tempfile.mkdtemp(prefix="soak-kv-")
    slow_disk = {"SLOW_DISK_READ_S": f"{args.slow_disk_read_s:g}"}
    if args.slow_disk_period_s > 0:
        slow_disk["SLOW_DISK_PERIOD_S"] = f"{args.slow_disk_period_s:g}"
    server = Server(server_options(args, kv_dir), slow_disk)
    progress(f"starting {server.command()} (pid {server.proc.pid})")
    try:
        server.wait_ready()
        result = asyncio.run(soak(server, args))
    finally:
        stopped = server.stop()
        shutil.rmtree(kv_dir, ignore_errors=True)
    result["slow_disk_read_s"] = args.slow_disk_read_s
    result["verdict"] = verdict(result)
    data = {
        "benchmark": "soak",
        "command": "python bench/soak.py " + " ".join(sys.argv[1:]),
        "server_command": server.command(),
        "workload": workload(args),
        "settings": vars(args),
        "machine": facts,
        "server_exit": stopped,
        **result,
    }
    write_json(args.name, finish_facts(data))
    plot(data, vars(args))
    v = data["verdict"]
    print(f"statuses {v['statuses_total']}  unexpected {v['unexpected_total']}")
    print(
        f"RSS minute 2 {v['rss_minute_2_bytes'] / 2**20:.1f} MiB -> end "
        f"{v['rss_end_bytes'] / 2**20:.1f} MiB ({v['rss_change']:+.2%}); fds "
        f"{v['fds_minute_2']} -> {v['fds_end']}; idle KV {v['idle_kv_per_minute']}"
    )
    print(f"disk tier {v['disk_total']}; tok/s {[round(t, 1) for t in v['tok_s_per_minute']]}")
    if data.get("hang_replica") is not None:
        print(f"hang replica {data['hang_replica']['checks']}")
    print(f"checks {v['checks']}  passed: {v['passed']}")
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
