"""Collect bench/results/*.json into bench/results/SUMMARY.md: one table per benchmark, the
targets checked, the machine and the command behind every figure. Reads only what exists.

    python bench/summary.py           # make bench runs it last
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, progress


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def ok(flag: bool) -> str:
    return "**met**" if flag else "**missed**"


def header(data: dict[str, Any], title: str, png: str | None) -> list[str]:
    m = data.get("machine", {})
    load_avg = m.get("load_average_at_start", [None])[0]
    load_end = m.get("load_average_at_end", [None])[0]
    lines = [f"## {title}", ""]
    lines.append(
        f"`{data.get('command', '')}` — {m.get('date', '?')}, load average (1 min) "
        f"{_f(load_avg)} at start, {_f(load_end)} at end."
    )
    lines.append("")
    if png and (RESULTS / png).exists():
        lines += [f"![{title}]({png})", ""]
    return lines


def _f(v: Any, digits: int = 2) -> str:
    return "?" if v is None else f"{v:.{digits}f}"


def single(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Single request", "single.png")
    lines += [
        "| prompt tokens | TTFT median (min–max) ms | prefill tok/s | decode tok/s median "
        "(min–max) |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        t, d = r["ttft_ms"], r["decode_tok_s"]
        lines.append(
            f"| {r['prompt_tokens']} | {t['median']:.0f} ({t['min']:.0f}–{t['max']:.0f}) | "
            f"{r['prefill_tok_s']:.0f} | {d['median']:.1f} ({d['min']:.1f}–{d['max']:.1f}) |"
        )
    return [*lines, ""]


def concurrency(data: dict[str, Any], name: str = "concurrency") -> list[str]:
    title = "Concurrency: llama-grpc vs the raw llama.cpp loop"
    if name != "concurrency":
        title += " (the same command, run again)"
    lines = header(data, title, f"{name}.png")
    w = data["workload"]
    lines += [
        f"{w['prompt_tokens']}-token prompts, {w['generated_tokens']} greedy tokens each.",
        "",
        "| B | raw tok/s | llama-grpc tok/s | fraction of raw (medians) | fraction (best runs) "
        "| per repetition |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in data["rows"]:
        reps = ", ".join(f"{e:.2f}" for e in r.get("efficiency_per_rep", []))
        lines.append(
            f"| {r['batch']} | {r['raw_tok_s']:.1f} | {r['llama_grpc_tok_s']:.1f} | "
            f"{r['efficiency']:.3f} | {_f(r.get('efficiency_best'), 3)} | {reps} |"
        )
    met = all(r["efficiency"] >= 0.95 for r in data["rows"])
    lines += ["", f"Target ≥ 0.95 of the raw limit at every B: {ok(met)}.", ""]
    return lines


def concurrency_rerun(data: dict[str, Any]) -> list[str]:
    return concurrency(data, "concurrency_rerun")


def overhead(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Per-token overhead: CPU per streamed token", "overhead.png")
    lines += [
        "The concurrency workload again; for each llama-grpc run the server's CPU time per "
        "thread: llama.cpp's helper threads and the engine thread's time inside llama_decode "
        "are the forward passes, the rest is overhead: the engine thread outside llama_decode "
        "(sampling included: the same argmax the raw loop does), the asyncio event loop "
        "(servicer, interceptor, grpc's Python/Cython send path) and grpc's C-core threads. "
        "µs per streamed token, medians (min–max) over the repetitions.",
        "",
        "| B | efficiency (median) | server outside decode | engine | event loop | grpc threads "
        "| bench client | forward passes: server (raw) tokens/pass |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        us = r["us_per_token"]

        def cell(key: str, us: dict[str, Any] = us) -> str:
            v = us[key]
            return f"{v['median']:.0f} ({v['min']:.0f}–{v['max']:.0f})"

        lines.append(
            f"| {r['batch']} | {r['efficiency']:.3f} | {cell('server_outside_decode')} | "
            f"{cell('engine')} | {cell('event_loop')} | {cell('grpc_threads')} | "
            f"{cell('client')} | {us['tokens_per_forward_pass']['median']:.1f} "
            f"({r['batch']}) |"
        )
    b16 = [r for r in data["rows"] if r["batch"] == 16]
    if b16:
        got = b16[0]["us_per_token"]["server_outside_decode"]["median"]
        lines += [
            "",
            f"Target: server CPU outside llama_decode ≤ 150 µs per token at B = 16: "
            f"{ok(got <= 150)} ({got:.0f} µs).",
        ]
    spy = data.get("profile")
    if spy:
        lines += [
            "",
            f"py-spy profile at B = {spy['batch']}: "
            + ", ".join(f"[{f}]({f})" for f in spy["files"])
            + " (top costs in the notes below).",
        ]
    return [*lines, ""]


def grpc_ceiling(data: dict[str, Any], name: str = "grpc_ceiling") -> list[str]:
    title = "The grpc.aio ceiling: raw loop vs a bare grpc.aio server vs llama-grpc"
    if name != "grpc_ceiling":
        title += " (the same command, run again)"
    lines = header(data, title, None)
    lines += [
        "The concurrency workload (41-token prompts, 64 greedy tokens) three ways, alternating "
        "in every repetition: the raw llama.cpp loop in the benchmark process; the same raw "
        "loop inside a bare grpc.aio server (its own process; each step's tokens streamed at "
        "once, one delta per token; no scheduler, validation, interceptor, telemetry or text); "
        "and llama-grpc with its defaults. The bench client is the same for the last two. "
        "bare / raw is the best any grpc.aio server can do here with its client on the same "
        "2 cores; llama-grpc / bare is what llama-grpc costs on top. Medians, then the "
        "per-repetition ratios (min–max).",
        "",
        "| B | raw tok/s | bare tok/s | llama-grpc tok/s | bare / raw | llama-grpc / raw "
        "| llama-grpc / bare |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        t, per = r["tok_s"], r["per_rep"]

        def cell(key: str, median: float, per: dict[str, list[float]] = per) -> str:
            return f"{median:.3f} ({min(per[key]):.2f}–{max(per[key]):.2f})"

        lines.append(
            f"| {r['batch']} | {t['raw']:.1f} | {t['bare']:.1f} | {t['llama_grpc']:.1f} | "
            f"{cell('bare_vs_raw', r['bare_vs_raw'])} | "
            f"{cell('llama_grpc_vs_raw', r['llama_grpc_vs_raw'])} | "
            f"{cell('llama_grpc_vs_bare', r['llama_grpc_vs_bare'])} |"
        )
    met = all(r["llama_grpc_vs_raw"] >= 0.95 for r in data["rows"])
    lines += ["", f"Target ≥ 0.95 of the raw loop at every B: {ok(met)}.", ""]
    return lines


def grpc_ceiling_rerun(data: dict[str, Any]) -> list[str]:
    return grpc_ceiling(data, "grpc_ceiling_rerun")


def strategies(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Batch strategies (mixed workload)", "strategies.png")
    w = data["workload"]
    lines += [
        f"{w['interactive_streams']} interactive streams ({w['short_prompt_tokens']}-token "
        f"prompts) generating while {w['long_prompts']} prompts of {w['long_prompt_tokens']} "
        f"tokens arrive ({w['n_parallel']} slots).",
        "",
        "| strategy @ chunk | ITL idle p50/p95 ms | ITL during prefill p50/p95 ms | p95 ratio | "
        "long TTFT median s | generated tok/s | all tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        i, b = r["itl_idle_ms"], r["itl_during_prefill_ms"]
        lines.append(
            f"| {r['config']} | {i['p50']:.0f} / {i['p95']:.0f} | {b['p50']:.0f} / "
            f"{b['p95']:.0f} | {r['p95_ratio_prefill_vs_idle']:.1f}× | "
            f"{r['long_ttft_s']['median']:.2f} | {r['generated_tok_s']['median']:.1f} | "
            f"{r['all_tok_s']['median']:.1f} |"
        )
    dm = [r for r in data["rows"] if r["config"] == "decode_maximal@512"]
    if dm:
        met = dm[0]["p95_ratio_prefill_vs_idle"] <= 2.0
        lines += [
            "",
            f"Target (decode_maximal, default chunk 512): running streams' p95 ITL during a "
            f"2,048-token prefill ≤ 2× idle: {ok(met)} "
            f"({dm[0]['p95_ratio_prefill_vs_idle']:.1f}×).",
        ]
    return [*lines, ""]


def prefix(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Prefix cache", "prefix_cache.png")
    lines += prefix_tables({"llama-grpc": data["llama_grpc"]}, data["workload"])
    res = data["llama_grpc"]
    sp, ch = res["shared_prompt"], res["chat"]
    if "warm_speedup_p50" in sp:
        lines.append(
            f"Target warm TTFT ≥ 10× lower than cold: {ok(sp['warm_speedup_p50'] >= 10)} "
            f"(p50 ×{sp['warm_speedup_p50']:.1f}, p95 ×{sp['warm_speedup_p95']:.1f})."
        )
    if "speedup" in ch:
        lines.append(
            f"Target multi-turn ≥ 2× faster with the cache: {ok(ch['speedup'] >= 2)} "
            f"(×{ch['speedup']:.2f})."
        )
    return [*lines, ""]


def prefix_tables(results: dict[str, dict[str, Any]], w: dict[str, Any]) -> list[str]:
    lines = [
        f"Shared system prompt of {w['system_prompt_tokens']} tokens + {w['questions']} short "
        f"questions sent together over {w['slots']} slots, {w['answer_tokens']} tokens each. "
        "cold = cache_prompt false; warm = system prompt seen before; together = cache on, "
        "never seen, all arrive at once.",
        "",
        "| server | mode | TTFT p50 ms | TTFT p95 ms | cached prompt tokens (median) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for server, res in results.items():
        sp = res["shared_prompt"]
        for mode in ("cold", "together", "warm"):
            if mode in sp:
                t = sp[mode]["ttft_ms"]
                c = sp[mode]["cached_prompt_tokens"]["median"]
                lines.append(f"| {server} | {mode} | {t['p50']:.0f} | {t['p95']:.0f} | {c:.0f} |")
    lines += [
        "",
        f"{w['chat_turns']}-turn chat, {w['chat_system_tokens']}-token system prompt, each turn "
        f"resends the whole history, {w['chat_answer_tokens']} tokens per answer.",
        "",
        "| server | with cache s (median) | without cache s (median) | speedup |",
        "| --- | ---: | ---: | ---: |",
    ]
    for server, res in results.items():
        ch = res["chat"]
        wc = ch.get("with_cache", {}).get("total_s", {}).get("median")
        nc = ch.get("without_cache", {}).get("total_s", {}).get("median")
        sp_ = ch.get("speedup")
        lines.append(
            f"| {server} | {_f(wc)} | {_f(nc)} | {'×' + _f(sp_) if sp_ is not None else 'n/a'} |"
        )
    return [*lines, ""]


def tokenize(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Tokenization overhead", "tokenize_overhead.png")
    w = data["workload"]
    lines += [
        f"{w['callers']} concurrent callers, ~{w.get('prompt_tokens_median') or '300'}-token "
        f"prompts, {w['generated_tokens']} tokens each.",
        "",
        "| path | round s median (min–max) | tok/s | TTFT p50 ms | TTFT p95 ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for mode, label in (("text", "StreamGenerate (text)"), ("ids", "GenerateTokens (ids)")):
        r = data["rows"][mode]
        ws = r["wall_s"]
        lines.append(
            f"| {label} | {ws['median']:.3f} ({ws['min']:.3f}–{ws['max']:.3f}) | "
            f"{r['tok_s']:.1f} | {r['ttft_ms']['p50']:.0f} | {r['ttft_ms']['p95']:.0f} |"
        )
    s = data["ids_speedup_over_text"]
    lines += ["", f"Target pre-tokenized at least as fast as text: {ok(s >= 1.0)} (×{s:.3f}).", ""]
    return lines


def security(data: dict[str, Any]) -> list[str]:
    lines = header(
        data, "Security overhead: plaintext vs TLS vs TLS + token", "security_overhead.png"
    )
    w = data["workload"]
    lines += [
        f"B = {w['batch']} concurrent GenerateTokens streams ({w['prompt_tokens']}-token prompts, "
        f"{w['generated_tokens']} tokens each) against three servers side by side, taking turns "
        "in every repetition. Ratio: plaintext wall time / this mode's, per repetition. CPU: µs "
        "per streamed token, medians.",
        "",
        "| mode | tok/s (median) | ratio to plaintext median (min–max) | server CPU outside "
        "llama_decode | of which event loop + grpc threads | bench client CPU |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        ratio = r["ratio_to_plaintext"]
        lines.append(
            f"| {r['mode']} | {r['tok_s']:.1f} | {ratio['median']:.3f} ({ratio['min']:.2f}–"
            f"{ratio['max']:.2f}) | {r['server_outside_decode_us']['median']:.0f} | "
            f"{r['event_loop_and_grpc_us']['median']:.0f} | {r['client_us']['median']:.0f} |"
        )
    worst = min(r["ratio_to_plaintext"]["median"] for r in data["rows"] if r["mode"] != "plaintext")
    lines += [
        "",
        f"Target ≥ 0.97 of plaintext (median ratio): {ok(worst >= 0.97)} ({worst:.3f}).",
        "",
    ]
    return lines


def kv_tiers(data: dict[str, Any]) -> list[str]:
    lines = header(data, "KV cache tiers: where a 2,000-token history comes from", "kv_tiers.png")
    w = data["workload"]
    lines += [
        f"A follow-up ({w['tail_tokens']} new tokens, {w['gen_tokens']} greedy tokens) to a "
        f"{w['history_tokens']}-token history whose KV is recomputed (cold), still in its slot, "
        "restored from the RAM tier after an eviction, or restored from the disk tier by a new "
        "server process (SIGTERM, start again on the same --kv-cache-dir). The four take turns "
        "in every repetition, each with a new history.",
        "",
        "| tier | TTFT median (min–max) ms | server TTFT ms | cached prompt tokens | "
        "× faster than cold |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        t = r["ttft_ms"]
        lines.append(
            f"| {r['tier']} | {t['median']:.0f} ({t['min']:.0f}–{t['max']:.0f}) | "
            f"{r['server_ttft_ms']['median']:.0f} | {r['cached_prompt_tokens']['median']:.0f} | "
            f"×{r['speedup_vs_cold']:.1f} |"
        )
    disk = next(r for r in data["rows"] if r["tier"] == "disk")
    lines += [
        "",
        f"Disk: files of {disk['file_mb']['median']:.1f} MiB, read and verified at "
        f"{disk['read_verify_mb_s']['median']:.0f} MiB/s (GetStats disk_cache_read_seconds); a "
        f"SIGTERM with the save took {disk['shutdown_s']['median']:.1f} s, the restarted server "
        f"was SERVING after {disk['restart_to_serving_s']['median']:.1f} s.",
        "",
        f"Target: disk restore ≥ 10× faster than recomputing: "
        f"{ok(data['targets']['disk_restore_vs_recompute_10x'])} "
        f"(×{disk['speedup_vs_cold']:.1f}).",
        "",
    ]
    return lines


def chat_turns(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Multi-turn chat: what the cache can and cannot remove", None)
    w = data["workload"]
    a = data["analysis"]
    lines += [
        f"A {w['system_tokens']}-token system prompt, {w['turns']} turns of {w['user_words']} "
        f"user words, {w['answer_tokens']}-token answers, the whole history resent each turn as "
        "token ids; the three modes alternate in every repetition. Ceiling: the no-cache time "
        "over this mode's decode time alone, i.e. every prompt token free (even the new user "
        "tokens no cache can hold): the most any cache can give, since decoding stays.",
        "",
        "| mode | total s median (min–max) | speedup | ceiling | turns 2–4 speedup | turns 2–4 "
        "ceiling | decode share of the time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, m in a["modes"].items():
        t = m["total_s"]
        lines.append(
            f"| {mode} | {t['median']:.2f} ({t['min']:.2f}–{t['max']:.2f}) | "
            f"×{m['speedup']:.2f} | ×{m['bound']:.2f} | ×{m['speedup_turns_2_to_4']:.2f} | "
            f"×{m['bound_turns_2_to_4']:.2f} | {m['decode_share']:.0%} |"
        )
    chat = data["result"]["chat_api"]
    cached = ", ".join(f"{t['cached_prompt_tokens']}/{t['prompt_tokens']}" for t in chat)
    lines += [
        "",
        f"Through the chat API (messages re-rendered by the template, earlier answers sent back "
        f"as text), cached/prompt tokens per turn: {cached}: re-tokenizing the history keeps "
        "every earlier token, including the previous answer.",
        "",
    ]
    return lines


def chat_turns_shared(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Many chat sessions on one system prompt", None)
    w = data["workload"]
    lines += [
        f"{w['sessions']} sessions share one {w['system_tokens']}-token system prompt and take "
        f"turns on {w['slots']} slots ({w['turns']} turns each, {w['user_words']} user words, "
        f"{w['answer_tokens']}-token answers, the whole history resent as token ids with a "
        "session id); the servers alternate in every repetition, each with its own text. "
        "History cached: per later turn, the share of the previous prompt + answer found "
        "cached; whole: the turns that found all of it.",
        "",
        "| server | total s median (min–max) | vs llama-grpc without cache | history cached | "
        "whole history | TTFT p50 later turns ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, a in data["analysis"].items():
        t = a["total_s"]
        lines.append(
            f"| {name} | {t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f}) | "
            f"×{a['speedup_vs_no_cache']:.2f} | {a['later_turns_history_cached']:.0%} | "
            f"{a['later_turns_full_history']:.0%} | {a['ttft_ms_later_turns']['median']:.0f} |"
        )
    if data.get("llama_server_version"):
        version = data["llama_server_version"].splitlines()[0]
        lines += ["", f"llama-server: `{version}` ({data.get('llama_server', '')})."]
    for name, why in data.get("skipped", {}).items():
        lines += ["", f"{name}: skipped, {why}."]
    return [*lines, ""]


def models(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Multi-model serving: load, swap, response-cache hit", "models.png")
    w = data["workload"]["models"]
    lines += [
        f"Two models: {', '.join(f'{k} = {v}' for k, v in w.items())}. Cold: LoadModel with "
        "nothing resident. Swap: --max-loaded-models 1, the other model resident and idle, "
        "time to the first token of a 1-token stream (unload + load + prefill); warm: the same "
        "once resident. Medians (min–max).",
        "",
        "| model | size MiB | cold LoadModel s | server load s | first token after swap s "
        "| first token resident s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, cold in data["cold_load"].items():
        swap = data["swap"][name]
        lines.append(
            f"| {name} | {cold['size_bytes'] / 2**20:.0f} | {_range(cold['wall_s'])} | "
            f"{_range(cold['server_load_s'])} | {_range(swap['swap_ttft_s'])} | "
            f"{_range(swap['warm_ttft_s'], 3)} |"
        )
    cache, idle = data["response_cache"], data["idle_threads"]
    busy = idle["other_generating"]
    lines += [
        "",
        f"Response cache ({cache['gen_tokens']} greedy tokens): hit "
        f"{cache['hit_s']['median'] * 1e3:.2f} ms vs {cache['miss_s']['median'] * 1e3:.0f} ms "
        "through the engine.",
        f"An idle second engine's {idle['idle_threads']} threads used "
        f"{busy['idle_engine_cpu_per_s']['median']:.4f} CPU s per s while the other engine "
        f"generated (the busy one's: {busy['busy_engine_cpu_per_s']['median']:.2f}); the whole "
        f"process {idle['all_idle_process_cpu_per_s']:.4f} with both idle. The busy model's "
        f"{idle['gen_tokens']}-token generation: {_range(idle['alone_tok_s'], 1)} tok/s alone, "
        f"{_range(idle['beside_idle_engine_tok_s'], 1)} with the idle engine resident.",
        "",
    ]
    return lines


def _range(s: dict[str, Any], digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def cluster(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Scale-out: routing through Envoy and through SMG", "cluster.png")
    w = data["workload"]
    lines += [
        f"{w['sessions']} chat sessions at once, {w['turns']} turns each resending the history, "
        f"{w['max_tokens']} tokens per answer; {w['replicas']} replicas (1 llama.cpp thread "
        "each) behind Envoy with ring hash on x-session-id or round robin, behind SMG "
        "(cache_aware on the replicas' KV events, or round_robin; no session header), and one "
        "replica with both threads. Hit rate and TTFT over turns 2..T; the setups alternate in "
        "every "
        "repetition with new sessions. The replicas share the same 2 cores: this shows "
        "affinity and latency, not throughput scaling.",
        "",
        "| setup | hit rate (median; per rep) | TTFT p50 ms | TTFT p95 ms | workload wall s "
        "(median) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        reps = ", ".join(f"{h:.2f}" for h in r["hit_rate_per_rep"])
        lines.append(
            f"| {r['setup']} | {r['hit_rate']:.2f} ({reps}) | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p95_ms']:.0f} | {r['wall_s_median']:.1f} |"
        )
    if "shared_rows" not in data:  # a run from before the gateway setups
        return [*lines, ""]
    rows = {r["setup"]: r for r in data["rows"]}
    shared = {r["setup"]: r for r in data["shared_rows"]}
    lines += [
        "",
        f"Shared prefixes: {w['prompts']} system prompts of {w['system_tokens']} tokens x "
        f"{w['users']} users with one question each, {w['concurrency']} at a time (ring hash: "
        "one session per user). Replicas per prompt: on how many replicas a system prompt got "
        "computed (their own KV events), mean over the prompts.",
        "",
        "| setup | hit rate (median; per rep) | replicas per prompt | TTFT p50 ms | wall s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in data["shared_rows"]:
        reps = ", ".join(f"{h:.2f}" for h in r["hit_rate_per_rep"])
        lines.append(
            f"| {r['setup']} | {r['hit_rate']:.2f} ({reps}) | {r['replicas_per_prompt']:.1f} | "
            f"{r['ttft_p50_ms']:.0f} | {r['wall_s_median']:.1f} |"
        )
    events, ring = rows["smg_cache_aware"], rows["ring_hash"]
    gain = shared["smg_cache_aware"]["hit_rate"] - shared["ring_hash"]["hit_rate"]
    lines += [
        "",
        f"- Chat, SMG on KV events vs ring hash: hit rate {events['hit_rate']:.2f} vs "
        f"{ring['hit_rate']:.2f} (target >=): {ok(events['hit_rate'] >= ring['hit_rate'])}; "
        f"TTFT p50 {events['ttft_p50_ms']:.0f} vs {ring['ttft_p50_ms']:.0f} ms (target <=): "
        f"{ok(events['ttft_p50_ms'] <= ring['ttft_p50_ms'])}.",
        f"- Shared prefixes, SMG on KV events vs ring hash: hit rate {gain * 100:+.0f} points "
        f"(target >= +20): {ok(gain >= 0.2)}.",
    ]
    return [*lines, ""]


def gateway(data: dict[str, Any]) -> list[str]:
    """Issue 31: one replica direct (v1) against the same replica through SMG; targets >= 0.95x
    direct tok/s at B = 8 and 16, added TTFT p50 <= 5 ms."""
    lines = header(data, "Through the SMG gateway: one replica, direct v1 vs OpenAI completions",
                   "gateway.png")  # fmt: skip
    w, m = data["workload"], data.get("machine", {})
    lines += [
        f"{w['prompt_tokens']}-token prompts (no BOS, as SMG encodes completions), "
        f"{w['generated_tokens']} greedy tokens each, ignore_eos; the two paths alternate in every "
        f"repetition; the replica runs `{' '.join(w['replica_args'])}` on {m.get('cores', '?')} "
        "cores shared with SMG and this client. CPU from /proc/<pid>/stat around each run; SMG "
        "cores = its CPU seconds / the run's wall seconds.",
        "",
        "| B | direct tok/s | through SMG tok/s | SMG / direct (medians; per rep) | TTFT p50 "
        "direct ms | added TTFT p50 / p95 ms | SMG CPU ms/token (cores) | replica CPU ms/token "
        "direct / SMG | same text | load (1 min) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        reps = ", ".join(f"{x:.2f}" for x in r["ratio_per_rep"])
        cpu = r["replica_cpu_ms_per_token"]
        lines.append(
            f"| {r['batch']} | {r['direct_tok_s']:.1f} | {r['gateway_tok_s']:.1f} | "
            f"{r['ratio']:.3f} ({reps}) | {r['direct_ttft_ms']['p50']:.1f} | "
            f"{r['added_ttft_p50_ms']:+.1f} / {r['added_ttft_p95_ms']:+.1f} | "
            f"{r['smg_cpu_ms_per_token']:.3f} ({r['smg_cores']:.3f}) | {cpu['direct']:.1f} / "
            f"{cpu['gateway']:.1f} | {r['same_text']}/{r['streams']} | "
            f"{_range(r['load_1m'])} |"
        )
    big = [r for r in data["rows"] if r["batch"] in (8, 16)]
    met = ok(all(r["ratio"] >= 0.95 for r in big)) if big else "not measured"
    ratio_line = f"Target through SMG ≥ 0.95x direct tok/s at B = 8 and 16: {met}"
    worst = max(data["rows"], key=lambda r: r["smg_cores"])
    added = data.get("added_ttft")
    if added:  # single-stream pairs: the rows' TTFTs at B > 1 are the batch's queueing
        a = added["added_ttft_ms"]
        ttft_line = (
            f"added TTFT p50 ≤ 5 ms, over {added['pairs']} back-to-back single-stream pairs: "
            f"{a['p50']:+.1f} ms (quartiles {a['p25']:+.1f} / {a['p75']:+.1f}; direct "
            f"{added['direct_ttft_ms_p50']:.1f} ms, SMG {added['smg_cpu_ms_per_request']:.1f} "
            f"CPU ms per request, load {added['load_1m']:.2f}): {ok(a['p50'] <= 5)}"
        )
    else:
        ttft_line = "added TTFT p50 ≤ 5 ms at every B: " + ok(
            all(r["added_ttft_p50_ms"] <= 5 for r in data["rows"])
        )
    lines += [
        "",
        f"{ratio_line}; {ttft_line}.",
        "",
        f"On this box SMG took up to {worst['smg_cores']:.3f} cores (B = {worst['batch']}) from "
        "llama.cpp and this client; the tok/s ratio is what that cost. On its own machine the "
        "gateway would need its CPU per token times the tokens it carries: "
        + ", ".join(
            f"{r['smg_cores_at_direct_tok_s']:.3f} cores for B = {r['batch']}'s direct "
            f"{r['direct_tok_s']:.0f} tok/s"
            for r in data["rows"]
        )
        + ".",
        "",
    ]
    return lines


def aiperf(data: dict[str, Any]) -> list[str]:
    """Issue 40: aiperf against llama-grpc through SMG and against llama-server (and the same
    prompts to the replica over v1); targets: SMG's output tok/s >= 1.0x llama-server's, TTFT
    p50 and ITL p50 <= llama-server's, no failed request."""
    name = data.get("settings", {}).get("name", "aiperf")
    title = f"aiperf ({name}): llama-grpc through SMG vs llama-server"
    lines = header(data, title, f"{name}.png")
    lines += [
        "NVIDIA aiperf, streaming /v1/completions, exact prompt and answer lengths (ignore_eos), "
        "4 slots, 8,192 context, no prompt cache on either server; the targets alternate in "
        "every repetition; the direct column is the same prompts to the same replica over v1 "
        "(this script's client, not aiperf). Medians over repetitions. Passes: prompt + decode "
        "tokens per llama_decode (llama-server's /metrics, the replica's GetStats); CPU ms per "
        "token: the server process's CPU over prompt + generated tokens.",
        "",
        "| threads | prompt/answer | c | tok/s SMG / llama-server / direct | SMG ÷ llama-server | "
        "TTFT p50 ms SMG / llama-server | ITL p50 ms SMG / llama-server | errors SMG / "
        "llama-server | tokens per pass SMG / llama-server | CPU ms per token SMG / llama-server "
        "| load (1 min) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    met = True
    for r in data["rows"]:
        s, p, d = r.get("smg"), r.get("llama-server"), r.get("direct")
        if s is None or p is None:
            continue
        direct = f" / {d['output_tok_s']:.1f}" if d else ""
        sp, pp = s.get("passes", {}), p.get("passes", {})
        loads = s.get("load_1m", []) + p.get("load_1m", [])
        lines.append(
            f"| {r['threads']} | {r['prompt_tokens']}/{r['answer_tokens']} | {r['concurrency']} "
            f"| {s['output_tok_s']:.1f} / {p['output_tok_s']:.1f}{direct} | "
            f"{r.get('smg_ratio', float('nan')):.2f} | {s['ttft_p50_ms']:.0f} / "
            f"{p['ttft_p50_ms']:.0f} | {s['itl_p50_ms']:.1f} / {p['itl_p50_ms']:.1f} | "
            f"{s['errors']} / {p['errors']} | {_f(sp.get('tokens_per_pass'), 1)} / "
            f"{_f(pp.get('tokens_per_pass'), 1)} | {_f(sp.get('cpu_ms_per_token'))} / "
            f"{_f(pp.get('cpu_ms_per_token'))} | {_f(min(loads, default=None))}–"
            f"{_f(max(loads, default=None))} |"
        )
        met = met and (
            r.get("smg_ratio", 0.0) >= 1.0
            and s["ttft_p50_ms"] <= p["ttft_p50_ms"]
            and s["itl_p50_ms"] <= p["itl_p50_ms"]
            and s["errors"] == 0
        )
    lines += [
        "",
        "Target (every row): SMG's output tok/s ≥ 1.0x llama-server's, TTFT p50 and ITL p50 ≤ "
        f"llama-server's, 0 errors: {ok(met)}.",
        "",
    ]
    return lines


def peers(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Peers", "peers_concurrency.png")
    for name, why in data.get("skipped", {}).items():
        lines.append(f"- {name} skipped: {why}")
    if data.get("skipped"):
        lines.append("")
    rows = data.get("concurrency")
    for part in ("concurrency", "prefix_cache"):
        src = data.get(f"{part}_from")
        if src:
            lines += [f"The {part} part comes from `{src['command']}` ({src['date']}).", ""]
    if rows:
        names = [k for k in rows[0] if k != "batch"]
        lines += [
            "| B | "
            + " | ".join(f"{n} tok/s (fraction of raw: medians; best runs)" for n in names)
            + " |",
            "| ---: | " + " | ".join("---:" for _ in names) + " |",
        ]
        for r in rows:
            cells = [
                f"{r[n]['tok_s']:.1f} ({r[n]['fraction_of_raw']:.2f}; best "
                f"{r[n].get('fraction_of_raw_best', float('nan')):.2f})"
                for n in names
            ]
            lines.append(f"| {r['batch']} | " + " | ".join(cells) + " |")
        lines.append("")
        others = [n for n in names if n not in ("raw", "llama-grpc")]
        if others and "llama-grpc" in names:
            ahead = all(r["llama-grpc"]["tok_s"] > r[n]["tok_s"] for r in rows for n in others)
            lines += [f"Target llama-grpc ahead of every peer at every B: {ok(ahead)}.", ""]
    if data.get("prefix_cache"):
        if (RESULTS / "peers_prefix_cache.png").exists():
            lines += ["![peers prefix cache](peers_prefix_cache.png)", ""]
        lines += prefix_tables(data["prefix_cache"], data["workload"]["prefix_cache"])
    return lines


def soak(data: dict[str, Any]) -> list[str]:
    lines = header(data, "Soak", "soak.png")
    w, st, v = data["workload"], data["settings"], data["verdict"]
    pool = data["pool"]
    lines += [
        f"{w['streams']} concurrent streams for {st['minutes']} × {st['minute_s']:.0f} s against "
        f"`{data['server_command']}`: prompts of {pool['prompt_tokens_min']}–"
        f"{pool['prompt_tokens_max']} tokens (median {pool['prompt_tokens_median']}), "
        f"{w['modes']}. Each minute ends with a pause (in-flight calls get {st['drain_s']:.0f} s, "
        "then are cancelled) and idle readings of the server process.",
        "",
    ]
    if "slow_disk" in w:  # the injected stalls (issue 34)
        lines += [
            f"Injected stalls: slow readers (--stream-buffer-tokens {st['stream_buffer_tokens']}, "
            f"--stalled-reader-s {st['stalled_reader_s']:g}); a slow disk: {w['slow_disk']} "
            f"(disk tier on, RAM tier off); engine hang: {w['hang_replica']}.",
            "",
        ]
    lines += [
        "| minute | OK | cancelled (own / at pause) | deadline (own) | queue full, retried | "
        "slow readers OK / stalled ended (server) | unexpected | tok/s | idle RSS MiB | fds | "
        "idle KV cells (cached prefix) | disk restores / writes / read s | load 1 min |",
        "|" + " ---: |" * 13,
    ]
    expected = set(w["expected_statuses"])
    for r in data["minutes"]:
        s_ = r["statuses"]
        bad = sum(n for k, n in s_.items() if k not in expected)
        kv = r["idle"]["kv"]
        d = r.get("disk", {})
        disk = f"{d['hits']} / {d['writes']} / {d['read_seconds']:.1f}" if d else "–"
        lines.append(
            f"| {r['minute']} | {s_.get('OK', 0)} | {s_.get('CANCELLED', 0)} / "
            f"{s_.get('CANCELLED_AT_PAUSE', 0)} | {s_.get('DEADLINE_EXCEEDED', 0)} | "
            f"{s_.get('RESOURCE_EXHAUSTED', 0)} | {s_.get('OK_SLOW_READER', 0)} / "
            f"{r['server'].get('stalled_readers', 0)} | {bad} | {r['tok_s']:.1f} | "
            f"{r['idle']['rss_bytes'] / 2**20:.1f} | {r['idle']['fds']} | "
            f"{kv['kv_cells_used']} ({kv['baseline_cached_prefix']}) | {disk} | "
            f"{r['load_average'][0]:.2f} |"
        )
    c = v["checks"]
    probe = data["probe"]
    lines += [
        "",
        f"Totals: {', '.join(f'{k} {n}' for k, n in v['statuses_total'].items())}.",
        "",
        f"- 0 unexpected statuses: {ok(c['no_unexpected_status'])} ({v['unexpected_total']}).",
        f"- No hung call (every call ended, each bounded by a deadline): {ok(c['no_hung_call'])}.",
        f"- Idle RSS at the end within ±5 % of minute 2: "
        f"{ok(c['rss_end_within_5pct_of_minute_2'])} ({v['rss_minute_2_bytes'] / 2**20:.1f} → "
        f"{v['rss_end_bytes'] / 2**20:.1f} MiB, {v['rss_change']:+.2%}); open fds "
        f"{v['fds_minute_2']} → {v['fds_end']}.",
        f"- Idle KV is the cached-prefix baseline at every pause: "
        f"{ok(c['idle_kv_is_cached_prefix_baseline'])}; then a {probe['prompt_tokens']}-token "
        f"prompt (n_ctx − {st['probe_margin']}) ran to completion: "
        f"{ok(c['full_context_probe_ok'])} ({probe['seconds']:.0f} s).",
    ]
    lines += soak_stalls(data)
    return [*lines, ""]


def soak_stalls(data: dict[str, Any]) -> list[str]:
    """The soak's checks of its injected stalls (absent from results before issue 34)."""
    v = data["verdict"]
    c = v["checks"]
    if "slow_disk_read_from" not in c:
        return []
    fds = next(k for k in c if k.startswith("fds_end_within_"))
    disk = v["disk_total"]
    tok_s = ", ".join(f"{t:.0f}" for t in v["tok_s_per_minute"])
    lines = [
        f"- Open fds flat ({fds.split('_')[3]} at most apart): {ok(c[fds])}.",
        f"- Tokens/s never below half the median minute's (slow disk, hang replica): "
        f"{ok(c['tok_s_never_below_half_median'])} ({tok_s}; lowest "
        f"{v['tok_s_min_over_median']:.2f} × median).",
        f"- Slow readers got their exact output: {ok(c['slow_readers_served_exactly'])} "
        f"({v['statuses_total'].get('OK_SLOW_READER', 0)}; the server paused streams "
        f"{v['stream_pauses_server']} times); stalled readers ended (RESOURCE_EXHAUSTED, "
        f"STALLED_READER): {ok(c['stalled_readers_ended'])} ({v['stalled_readers_server']} by the "
        f"server's count, {v['statuses_total'].get('STALLED_READER', 0)} of them read to that "
        "status before a pause cancelled them).",
        f"- The slow disk was read from: {ok(c['slow_disk_read_from'])} ({disk['hits']} restores, "
        f"{disk['read_seconds']:.1f} s reading, {disk['writes']} writes, {disk['evictions']} "
        f"evictions, {disk['read_failures']} read / {disk['write_failures']} write failures, "
        f"{disk['verify_failures']} verify failures).",
    ]
    hang = data.get("hang_replica")
    if hang is not None:
        streams = hang.get("streams", [])
        ends = ", ".join(f"{s['code']} {s['reason']} in {s['seconds']:.1f} s" for s in streams)
        watch = hang.get("watch", {})
        lines.append(
            f"- Hang replica caught: {ok(c['hang_replica_caught_exit_71'])} ({ends or 'no stream'}"
            f" (bound {hang['stream_bound_s']:.0f} s); NOT_SERVING after "
            f"{watch.get('not_serving_after_s', float('nan')):.1f} s, watchdog trips "
            f"{watch.get('watchdog_trips')}; exit code {hang.get('exit_code')})."
        )
    return lines


def decode_cost_shape(data: dict[str, Any]) -> list[str]:
    """The cost of one forward pass of N tokens of one sequence, by N: the source of the
    speculation cost model's prior shape (core/speculation/policy.py)."""
    avx512 = "AVX512 = 1" in data["machine"].get("llama_system_info", "")
    build = "AVX-512 build" if avx512 else "x86-64-v3 build"
    lines = header(data, f"Forward-pass cost by row count, {build} (the cost model's prior)", None)
    all_ms = {r["extra_tokens"] + 1: r["ms_median"] for r in data["rows"]["all_logits"]}
    last_ms = {r["extra_tokens"] + 1: r["ms_median"] for r in data["rows"]["last_logits"]}
    dear = (
        "Counts that are not a multiple of 4 cost more than the next multiple"
        if avx512
        else "An odd number of logits rows (3 or more) costs more than one row more"
    )
    lines += [
        "Median llama_decode ms of N tokens after a 50-token prompt, with logits for every row "
        f"(verifying a draft) and for the last one only. {dear}.",
        "",
    ]
    ns = sorted(all_ms)
    for start in range(0, len(ns), 16):
        group = ns[start : start + 16]
        lines += [
            "| N | " + " | ".join(str(n) for n in group) + " |",
            "| --- |" + " ---: |" * len(group),
            "| all rows | " + " | ".join(f"{all_ms[n]:.1f}" for n in group) + " |",
            "| last row | " + " | ".join(f"{last_ms[n]:.1f}" for n in group) + " |",
            "",
        ]
    return lines


def build_isa(data: dict[str, Any]) -> list[str]:
    """Two llama.cpp builds side by side in the raw loop (`make install` picks the second where
    the CPU has AVX-512 and no AMX)."""
    names = [data["baseline"], data["candidate"]]
    base, cand = (data["builds"][n] for n in names)
    lines = header(data, f"llama.cpp build: {names[0]} vs {names[1]}", None)
    rows = sorted(int(n) for n in base["rows_ms"])
    lines += [
        "Median over interleaved reps (each rep a fresh process) of the median llama_decode ms: "
        "N tokens with logits for every row (a B = N decode tick, or a draft of N - 1 tokens "
        "verified), and a 256-token prompt with logits for the last row.",
        "",
        "| N | " + " | ".join(str(n) for n in rows) + " | prefill 256 |",
        "| --- |" + " ---: |" * (len(rows) + 1),
    ]
    for name, got in ((names[0], base), (names[1], cand)):
        cells = [f"{got['rows_ms'][str(n)]['median']:.1f}" for n in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {got['prefill_ms']['median']:.0f} |")
    speed = data["speedup"]
    cells = [f"{speed['rows'][str(n)]:.2f}" for n in rows]
    lines += ["| speed-up | " + " | ".join(cells) + f" | {speed['prefill']:.2f} |", ""]
    return lines


def pad_odd(data: dict[str, Any]) -> list[str]:
    """Padding decode ticks to a cheaper row count: two servers, alternating."""
    lines = header(data, "Padding decode ticks (--pad-odd-ticks vs --no-pad-odd-ticks)", None)
    lines += [
        "| B | padded tok/s | not padded tok/s | padded / not (paired median; reps) "
        "| passes/token padded / not | server CPU ms/token padded / not |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        reps = ", ".join(f"{x:.2f}" for x in r["speedup_per_rep"])
        lines.append(
            f"| {r['batch']} | {_range(r['padded_tok_s'], 1)} | {_range(r['plain_tok_s'], 1)} | "
            f"{r['speedup']:.2f} ({reps}) | {r['padded_passes_per_token']['median']:.3f} / "
            f"{r['plain_passes_per_token']['median']:.3f} | "
            f"{r['padded_cpu_ms_per_token']['median']:.1f} / "
            f"{r['plain_cpu_ms_per_token']['median']:.1f} |"
        )
    return [*lines, ""]


def backpressure(data: dict[str, Any]) -> list[str]:
    """Three readers alone, beside a paused reader, and beside one that decodes unbounded."""
    lines = header(data, "Back-pressure: three readers beside a client that stopped reading", None)
    lines += [
        "| condition | readers' tok/s | / alone (paired median; reps) | passes/token "
        "| server CPU ms/token | stopped stream: tokens generated / unread | RSS MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, got in data["conditions"].items():
        ratio = ""
        if name != "alone":
            reps = ", ".join(f"{x:.2f}" for x in data[f"{name}_over_alone_per_rep"])
            ratio = f"{data[f'{name}_over_alone']:.3f} ({reps})"
        stopped = ""
        if "stopped_generated_tokens" in got:
            stopped = (
                f"{got['stopped_generated_tokens']['median']:.0f} / "
                f"{got['stopped_unread_tokens']['median']:.0f}"
            )
        lines.append(
            f"| {name} | {_range(got['tok_s'], 1)} | {ratio} | "
            f"{got['passes_per_token']['median']:.3f} | {got['cpu_ms_per_token']['median']:.1f} | "
            f"{stopped} | {got['rss_mib']['max']:.0f} |"
        )
    return [*lines, ""]


def _paired(row: dict[str, Any]) -> float:
    """AUTO/off as the median of the per-rep paired ratios."""
    return float(statistics.median(row["speedup_per_rep"]))


def _of_medians(row: dict[str, Any]) -> float:
    """AUTO/off as the ratio of the medians (`speedup` in runs before the paired one)."""
    return float(row.get("speedup_of_medians", row["speedup"]))


def speculative(data: dict[str, Any]) -> list[str]:
    """Issue 17's targets: AUTO >= 1.5x the raw B = 1 decode rate on the input-grounded set;
    never below 0.97x of off on the control or at any B."""
    lines = header(data, "Speculative decoding (prompt lookup, AUTO vs off)", "speculative.png")
    raw = data["raw_b1_decode_tok_s"]
    lines += [
        f"Raw llama.cpp B = 1 decode: {raw['median']:.1f} tok/s ({raw['min']:.1f}–"
        f"{raw['max']:.1f}). Server totals: {data['server_spec']}.",
        "",
        "AUTO/off is the median of the interleaved reps' paired ratios (the ratio of the "
        "medians in brackets).",
        "",
        "| prompt | kind | off tok/s median (min–max) | AUTO tok/s median (min–max) | AUTO/off "
        "| AUTO/raw B=1 | passes/token off / AUTO | TTFT off / AUTO ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["single"]:
        o, a = r["off"]["decode_tok_s"], r["auto"]["decode_tok_s"]
        lines.append(
            f"| {r['prompt']} | {r['kind']} | {_range(o, 1)} | {_range(a, 1)} | "
            f"{_paired(r):.2f} ({_of_medians(r):.2f}) | {r['auto_vs_raw_b1']:.2f} | "
            f"{r['off']['passes_per_token']['median']:.2f} / "
            f"{r['auto']['passes_per_token']['median']:.2f} | "
            f"{r['off']['ttft_ms']['median']:.0f} / {r['auto']['ttft_ms']['median']:.0f} |"
        )
    grounded = data["grounded_set"]
    lines += [
        "",
        f"The grounded set as one workload (all its tokens over all its decode time): off "
        f"{_range(grounded['off_tok_s'], 1)}, AUTO {_range(grounded['auto_tok_s'], 1)} tok/s, "
        f"{grounded['auto_vs_raw_b1']:.2f}x the raw B = 1 rate.",
        "",
        "| B | kind | off tok/s | AUTO tok/s | AUTO/off (per rep) | passes/token off / AUTO "
        "| server CPU ms/token off / AUTO |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["aggregate"]:
        reps = ", ".join(f"{x:.2f}" for x in r["speedup_per_rep"])
        lines.append(
            f"| {r['batch']} | {r['kind']} | {_range(r['off_tok_s'], 1)} | "
            f"{_range(r['auto_tok_s'], 1)} | "
            f"{_paired(r):.2f} ({_of_medians(r):.2f}; reps {reps}) | "
            f"{r['off_passes_per_token']['median']:.3f} / "
            f"{r['auto_passes_per_token']['median']:.3f} | "
            f"{r['off_cpu_ms_per_token']['median']:.1f} / "
            f"{r['auto_cpu_ms_per_token']['median']:.1f} |"
        )
    floor = [_paired(r) for r in data["single"] if r["kind"] == "control"]
    floor += [_paired(r) for r in data["aggregate"]]
    lines += [
        "",
        f"Target ≥ 1.5x raw B = 1 on the grounded set ({grounded['auto_vs_raw_b1']:.2f}x): "
        f"{ok(grounded['auto_vs_raw_b1'] >= 1.5)}; never below 0.97x of off (lowest median "
        f"{min(floor):.2f}x): {ok(min(floor) >= 0.97)}.",
    ]
    return [*lines, ""]


def tools(data: dict[str, Any]) -> list[str]:
    """Issue 49: tool calls judged like BFCL's AST checker, v1 vs SMG vs llama-server."""
    model = Path(data.get("model", {}).get("path", "?")).name
    lines = header(data, "Tool calling: llama-grpc v1, through SMG, llama-server --jinja",
                   "tools.png")  # fmt: skip
    s = data["settings"]
    lines += [
        f"{s['case_count']} cases (bench/tool_cases.json), {model}, greedy, max_tokens "
        f"{s['max_tokens']}, {s['threads']} threads, tool_choice {s['tool_choice']}; passed / "
        "cases per category, judged like BFCL's AST checker.",
        "",
    ]
    rates = data["rates"]
    systems = list(data["systems"])
    order = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance", "multi_turn",
             "nested", "overall")  # bench/tools.py's CATEGORIES  # fmt: skip
    groups = [g for g in order if any(g in rates[name] for name in systems)]
    lines += ["| system | " + " | ".join(g.replace("_", " ") for g in groups)
              + " | mean wall s per case | mean server CPU s per case |",
              "| --- |" + " ---: |" * (len(groups) + 2)]  # fmt: skip
    for name in systems:
        cells = []
        for g in groups:
            c = rates[name].get(g)
            cells.append(f"{c['passed']}/{c['total']}" if c else "–")
        cost = data["costs"][name]
        cells += [f"{cost['wall_s_mean']:.2f}", f"{cost['cpu_s_mean']:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ratios = data.get("paired_ratios") or {}
    if ratios:
        pairs = "; ".join(f"{p} {r['wall']:.2f} / {r['cpu']:.2f}" for p, r in ratios.items())
        lines += ["", f"Per-case ratios (medians over the same cases), wall / server CPU: {pairs}."]
    if data.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in data["skipped"].items())]
    if data.get("notes"):
        lines += ["", data["notes"]]
    return [*lines, ""]


def main() -> int:
    parts = ["# Benchmark summary", ""]
    first = None
    sections = (
        ("single", single),
        ("concurrency", concurrency),
        ("concurrency_rerun", concurrency_rerun),
        ("overhead", overhead),
        ("grpc_ceiling", grpc_ceiling),
        ("grpc_ceiling_rerun", grpc_ceiling_rerun),
        ("strategies", strategies),
        ("prefix_cache", prefix),
        ("tokenize_overhead", tokenize),
        ("security_overhead", security),
        ("models", models),
        ("cluster", cluster),
        ("gateway", gateway),
        ("tools", tools),
        ("kv_tiers", kv_tiers),
        ("chat_turns", chat_turns),
        ("chat_turns_shared", chat_turns_shared),
        ("build_isa", build_isa),
        ("decode_cost_shape", decode_cost_shape),
        ("decode_cost_shape_avx512", decode_cost_shape),
        ("pad_odd", pad_odd),
        ("speculative", speculative),
        ("peers", peers),
        ("aiperf", aiperf),
        ("aiperf_c4", aiperf),
        ("aiperf_c4_stall8", aiperf),
        ("aiperf_c4_prefill_priority", aiperf),
        ("aiperf_c4_t2", aiperf),
        ("soak", soak),
        ("backpressure", backpressure),
    )
    body: list[str] = []
    for name, render in sections:
        data = load(name)
        if data is None:
            continue
        first = first or data.get("machine")
        body += render(data)
    if first:
        parts += [
            f"Machine: {first.get('cpu')}, {first.get('cores')} cores, {first.get('threads')} "
            f"llama.cpp threads, Python {first.get('python')}, llama-cpp-python "
            f"{first.get('llama_cpp_python')} ({first.get('llama_system_info', '').strip()}). "
            "Model: Gemma 3 270M Q4_K_M (embedded). Every ratio below comes from one run that "
            "alternates the configurations it compares; load averages show how busy the machine "
            "was (other work ran on it).",
            "",
        ]
    notes = RESULTS / "NOTES.md"  # hand-written caveats of the committed run, if any
    if notes.exists():
        body += ["## Notes on this run", "", notes.read_text().strip(), ""]
    text = "\n".join(parts + body).rstrip() + "\n"
    out = RESULTS / "SUMMARY.md"
    out.write_text(text)
    progress(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
