"""A stream survives its replica (issue 52), measured: `python bench/resume_chaos.py` (or `make
bench-resume-chaos`) writes bench/results/resume_chaos.json.

Kill: three replicas behind Envoy (deploy/cluster.py), the Python client with its automatic
resumption, --streams streams of --tokens tokens on prompts of --prompt-tokens (half greedy, half
seeded at temperature 4 over the top 5), each prompt cached once beforehand under its session;
SIGKILL of the replica holding the most of them once all are in flight. Each replica has a slot
for every stream (with fewer, a stream the ring or the resumption puts on a full replica waits
in its queue: 12 and 19 s to the first token after the cut were seen with 8 slots). Per rep:
the streams in flight at the kill (and the victim's), those completed (max_tokens, every
token), the tokens lost and repeated on the wire (every call's delta indexes, tests/support/
wire.py: must be 0 and 0), the greedy streams that differ from the model's known answer, how
every failed call ended, and for each resumed stream the time from the kill to the first token
of the call that resumed it (detection of the cut, the client's back-off, Envoy's retry past
the dead replica, the new replica's prefill of prompt + answer so far or its restore, the first
decode). Without and with a shared disk tier (--kv-cache-dir, one directory for the three,
--session-idle-s 1: the prompts' caches are written, and indexed by every replica, before the
streams start (without the wait for the index, the survivors of the first rep restored none of
the victim's files: they index another replica's within a second); an in-flight
answer's own cache is never written, so the resumed tokens are computed again either way).
Medians over --reps.

Hang: one replica (llama_grpc_testkit.hanging_runner, HANG_FILE) whose next forward pass never
returns, --watchdog-s auto: the time from the hang to the stream's UNAVAILABLE (ENGINE_HUNG), in a
1-token decode pass (the floor bound) and in a --long-prompt-token prefill pass, each token
--slow-token-s slower (so that the pass is long on the tiny model: the bound is 10 x the pass's
predicted cost), with the bound the server named.

The replicas run the tiny counting model (llama_grpc_testkit.models; --model FILE for another) under
llama_grpc_testkit.hanging_runner with every pass --paced-pass-s slower, so that streams are in
flight when the kill comes; one llama.cpp thread each."""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import grpc
from common import finish_facts, machine_facts, progress, write_json
from deploy.cluster import Cluster, wait_for
from tests.support.wire import WireRecorder, positions

from llama_grpc import AsyncClient, Delta, Done, UnavailableError
from llama_grpc_testkit.models import TINY_BOS, counting, tiny_model_file
from llama_grpc_testkit.server_process import server_env, server_process

SEEDED: dict[str, Any] = {"temperature": 4.0, "top_k": 5, "top_p": 1.0, "min_p": 0.0}
BOUND = re.compile(r"past the watchdog's ([0-9.]+) s")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class Stream:
    def __init__(self, prompt: list[int], sampling: dict[str, Any], session: str) -> None:
        self.prompt, self.sampling, self.session = prompt, sampling, session
        self.tokens: list[int] = []
        self.done: Done | None = None
        self.error: str | None = None
        self.resumptions = 0

    async def run(self, client: AsyncClient, tokens: int) -> None:
        stream = client.generate_tokens(
            self.prompt, max_tokens=tokens, ignore_eos=True, session_id=self.session,
            metadata=(("x-request-id", self.session),), **self.sampling,
        )  # fmt: skip
        try:
            async for event in stream:
                if isinstance(event, Delta):
                    self.tokens += event.token_ids
                else:
                    self.done = event
        except Exception as exc:  # counted, not raised: a figure of the run
            self.error = repr(exc)
        self.resumptions = stream.resumptions


async def holders(cluster: Cluster, sessions: set[str]) -> dict[str, int]:
    """The replica of each session's request in flight (GetStats slots; a stream's x-request-id
    is its session id)."""
    out: dict[str, int] = {}
    for index, replica in enumerate(cluster.members):
        async with AsyncClient(replica.target, timeout=10) as direct:
            stats = await direct.stats()
        out.update({s.request_id: index for s in stats.slots if s.request_id in sessions})
    return out


async def disk_counts(cluster: Cluster, skip: int = -1) -> list[tuple[int, int]]:
    """(disk tier writes, hits) of each replica ((0, 0) for replica `skip`)."""
    out = []
    for replica in cluster.members:
        if replica.index == skip:
            out.append((0, 0))
            continue
        async with AsyncClient(replica.target, timeout=10) as direct:
            stats = await direct.stats()
        out.append((stats.disk_cache_writes, stats.disk_cache_hits))
    return out


async def kill_rep(cluster: Cluster, args: argparse.Namespace, disk: bool) -> dict[str, Any]:
    run = uuid.uuid4().hex[:6]
    offset = int(run, 16) % 1000
    streams = []
    for i in range(args.streams):  # prompts of their own, new each rep
        ids = range(args.prompt_tokens - 1)
        prompt = [TINY_BOS] + [10 + (offset + i * 37 + j * 7) % 1000 for j in ids]
        sampling = {"temperature": 0.0} if i % 2 == 0 else {**SEEDED, "seed": 100 + i}
        streams.append(Stream(prompt, sampling, f"rc-{run}-{i}"))
    recorder = WireRecorder()
    async with (
        grpc.aio.insecure_channel(cluster.target, interceptors=[recorder]) as channel,
        AsyncClient(channel=channel, timeout=120) as client,
    ):
        before = await disk_counts(cluster)
        writes = sum(w for w, _ in before)

        async def warm(s: Stream) -> None:  # its prompt cached under its session
            async for _ in client.generate_tokens(s.prompt, max_tokens=1, session_id=s.session):
                pass

        await asyncio.gather(*(warm(s) for s in streams))
        for _ in range(200 if disk else 0):  # the prompts' caches written (--session-idle-s)
            if sum(w for w, _ in await disk_counts(cluster)) - writes >= len(streams):
                break
            await asyncio.sleep(0.1)
        written = sum(w for w, _ in await disk_counts(cluster)) - writes
        if disk:  # every replica has indexed the others' files (core/kv/disk.py REFRESH_S: 1 s)
            await asyncio.sleep(2.5)
        recorder.calls.clear()
        tasks = [asyncio.create_task(s.run(client, args.tokens)) for s in streams]
        sessions = {s.session for s in streams}
        for _ in range(400):
            if all(s.tokens for s in streams):
                held = await holders(cluster, sessions)
                if len(held) == len(streams):
                    break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError(f"not all in flight: {[len(s.tokens) for s in streams]}")
        per = [list(held.values()).count(i) for i in range(len(cluster.members))]
        victim = cluster.members[per.index(max(per))]
        in_flight = sum(1 for s in streams if len(s.tokens) < args.tokens)
        killed_at = time.monotonic()
        victim.stop(signal.SIGKILL)
        at_kill = {s.session: len(s.tokens) for s in streams}
        await asyncio.gather(*tasks)
    after = await disk_counts(cluster, skip=victim.index)  # the survivors' hits
    hits = sum(h - b[1] for (_, h), b in zip(after, before, strict=True) if h)
    victims = [s for s in streams if held[s.session] == victim.index]
    lost, repeated, resume_ms, cached = wire_figures(streams, victims, recorder, killed_at, args)
    greedy_wrong = sum(
        1
        for s in streams
        if s.sampling["temperature"] == 0.0 and s.tokens != counting_answer(s, args)
    )
    victim.start()
    await asyncio.to_thread(victim.wait_serving)
    await asyncio.to_thread(wait_for, lambda: cluster.healthy_count() == 3, 60, "routing")
    row = {
        "disk_tier": disk,
        "in_flight_at_kill": in_flight,
        "victim_streams": len(victims),
        "victim_tokens_at_kill": sorted(at_kill[s.session] for s in victims),
        "completed": sum(
            1
            for s in streams
            if s.done is not None
            and s.done.finish_reason == "max_tokens"
            and len(s.tokens) == args.tokens
        ),
        "errors": [s.error for s in streams if s.error],
        "tokens_lost": lost,
        "tokens_repeated": repeated,
        "greedy_differing": greedy_wrong,
        "resumptions": sorted(s.resumptions for s in streams),
        "resume_ttft_ms": sorted(resume_ms),
        "resumed_cached_prompt_tokens": sorted(cached),
        "cut_calls": cut_calls(streams, recorder),
        "disk_writes_before_streams": written,
        "disk_hits_during_streams": hits,
    }
    progress(
        f"kill (disk {disk}): {row['victim_streams']} of {in_flight} streams cut, "
        f"{row['completed']} completed, lost {lost}, repeated {repeated}, resume TTFT "
        f"{[round(v) for v in resume_ms]} ms, cached {cached}"
    )
    return row


def wire_figures(
    streams: list[Stream],
    victims: list[Stream],
    recorder: WireRecorder,
    killed_at: float,
    args: argparse.Namespace,
) -> tuple[int, int, list[float], list[int]]:
    """Tokens lost and repeated on the wire; each resumed stream's time from the kill to the
    first token of a call after the cut (ms) and its prompt tokens found cached there."""
    lost = repeated = 0
    resume_ms, cached = [], []
    for s in streams:
        calls = recorder.calls.get(tuple(s.prompt), [])
        carried = positions(calls)
        lost += args.tokens - len(set(carried) & set(range(args.tokens)))
        repeated += len(carried) - len(set(carried))
        if s in victims:
            firsts = [c.first_at for c in calls[1:] if c.first_at is not None]
            if firsts:
                resume_ms.append((firsts[0] - killed_at) * 1000)
            if s.done is not None:
                cached.append(s.done.usage.cached_prompt_tokens)
    return lost, repeated, resume_ms, cached


def cut_calls(streams: list[Stream], recorder: WireRecorder) -> list[str]:
    """How each call that ended in error ended (its stream, its number, tokens it carried)."""
    out = []
    for i, s in enumerate(streams):
        for number, call in enumerate(recorder.calls.get(tuple(s.prompt), [])):
            if call.error is not None:
                carried = sum(n for _, n, _ in call.deltas)
                first = str(call.error).splitlines()[0][:160]
                out.append(f"stream {i} call {number} ({carried} tokens): {first}")
    return out


def counting_answer(s: Stream, args: argparse.Namespace) -> list[int]:
    return counting(s.prompt[-1], args.tokens) if args.model is None else s.tokens


async def kill_config(args: argparse.Namespace, disk: bool, model: str) -> dict[str, Any]:
    # a slot for every stream on every replica: no stream, first or resumed, waits for one
    slots = max(args.streams, 1)
    extra = ["--n-ctx", str(4096 * slots), "--n-parallel", str(slots), "--grace-s", "15"]
    if disk:
        extra += ["--kv-cache-dir", str(args.scratch / "kv"), "--session-idle-s", "1"]
    env = server_env(SLOW_PASS_S=str(args.paced_pass_s))
    with Cluster(
        3,
        server_args=(*extra, "--model", model),
        threads=1,
        module="llama_grpc_testkit.hanging_runner",
        env=env,
    ) as cluster:
        rows = [await kill_rep(cluster, args, disk) for _ in range(args.reps)]
    ttft = [v for r in rows for v in r["resume_ttft_ms"]]
    return {
        "disk_tier": disk,
        "reps": rows,
        "resume_ttft_ms_median": median(ttft),
        "resume_ttft_ms_rep_medians": [median(r["resume_ttft_ms"]) for r in rows],
        "tokens_lost": sum(r["tokens_lost"] for r in rows),
        "tokens_repeated": sum(r["tokens_repeated"] for r in rows),
        "streams_in_flight_at_kill": sum(r["in_flight_at_kill"] for r in rows),
        "streams_cut": sum(r["victim_streams"] for r in rows),
        "streams_completed": sum(r["completed"] for r in rows),
    }


async def hang_once(args: argparse.Namespace, model: str, long: bool) -> dict[str, Any]:
    """Seconds from the hang to the stream's UNAVAILABLE, and the bound the server named."""
    hang_file = args.scratch / f"hang-{uuid.uuid4().hex[:6]}"
    env = server_env(HANG_FILE=str(hang_file), SLOW_TOKEN_S=str(args.slow_token_s))
    extra = ["--n-ctx", "8192", "--n-parallel", "2", "--grace-s", "1"]
    if long:
        extra += ["--chunk-size", str(args.long_prompt_tokens)]
    async with server_process(
        "--model", model, *extra, "--threads", "1", env=env,
        module="llama_grpc_testkit.hanging_runner",
    ) as proc:  # fmt: skip
        async with AsyncClient(f"127.0.0.1:{proc.port}", timeout=600, resume_attempts=0) as c:
            # both kinds of pass timed (the bound follows them), then the hang
            await c.generate("Count to 3:", max_tokens=4, ignore_eos=True)
            prompt = [TINY_BOS] + [10 + i % 1000 for i in range(args.long_prompt_tokens - 1)]
            if long:
                hang_file.write_text(str(proc.proc.pid))
                hung_at = time.monotonic()
                stream = c.generate_tokens(prompt, max_tokens=2, ignore_eos=True)
            else:
                stream = c.generate_tokens(prompt[:8], max_tokens=1000, ignore_eos=True)
                first = await stream.__anext__()
                assert isinstance(first, Delta)
                hang_file.write_text(str(proc.proc.pid))
                hung_at = time.monotonic()  # the next decode pass (within one pass) hangs
            try:
                async for _ in stream:
                    pass
                error: Exception | None = None
            except UnavailableError as exc:
                error = exc
            declared_s = time.monotonic() - hung_at
        code = await proc.wait(30)
    bound = BOUND.search(str(error)) if error is not None else None
    row = {
        "pass": f"prefill of {args.long_prompt_tokens} tokens" if long else "decode of 1 token",
        "declared_s": declared_s,
        "reason": getattr(error, "reason", None),
        "bound_s": float(bound[1]) if bound else None,
        "message": str(error).splitlines()[0] if error is not None else None,
        "exit_code": code,
    }
    progress(f"hang ({row['pass']}): declared after {declared_s:.2f} s: {row['message']}")
    return row


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or str(tiny_model_file())
    data: dict[str, Any] = {
        "benchmark": "resume_chaos",
        "command": "python bench/resume_chaos.py " + " ".join(sys.argv[1:]),
        "machine": machine_facts(threads=1),
        "loadavg_at_start": Path("/proc/loadavg").read_text().strip(),
        "settings": {k: v for k, v in vars(args).items() if k != "scratch"},
        "model": Path(model).name,
    }
    data["kill"] = [await kill_config(args, disk == "on", model) for disk in args.disk]
    hangs = []
    for _ in range(args.hang_reps):
        hangs.append(await hang_once(args, model, long=False))
    long = [await hang_once(args, model, long=True)] if args.long_prompt_tokens else []
    data["hang"] = {
        "rows": hangs + long,
        "short_declared_s_median": median([h["declared_s"] for h in hangs]),
        "long_declared_s": long[0]["declared_s"] if long else None,
    }
    data["loadavg_at_end"] = Path("/proc/loadavg").read_text().strip()
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: the tiny counting model)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--paced-pass-s", type=float, default=0.002)
    parser.add_argument("--disk", nargs="*", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--hang-reps", type=int, default=3)
    parser.add_argument("--long-prompt-tokens", type=int, default=1024, help="0: no long-pass hang")
    parser.add_argument("--slow-token-s", type=float, default=0.003)
    parser.add_argument("--name", default="resume_chaos")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="resume-chaos-") as scratch:  # disk tier, hang files
        args.scratch = Path(scratch)
        data = asyncio.run(main_async(args))
    write_json(args.name, finish_facts(data))


if __name__ == "__main__":
    main()
