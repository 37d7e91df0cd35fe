"""Embedding throughput with a trained embedding model (issue 51): nomic-embed-text-v1.5 (F16,
nomic-bert, the catalog's: fetched once per machine) served by llama-grpc (a server process, one
v1 `Embed` call per batch) against llama.cpp's llama-server `--embedding` (the same GGUF, one
/v1/embeddings request per batch holding every input as token ids), in the same run: batches of
1, 16 and 64 inputs, short (~12 tokens) and long (~500 tokens), the two alternating rep by rep
(other work on a shared box moves any one run). Both get the same threads, 4 slots and a
2,048-token context per input, and the same token ids (English text: BERT's tokenizer and
llama.cpp's agree there). One vector of each is compared (cosine).

    python bench/embeddings_nomic.py [--threads 2] [--reps 3] [--batches 1,16,64] [--long-words 380]
    # bench/results/embeddings_nomic.json and embeddings_nomic.png

llama-server comes from $LLAMA_SERVER_BINARY, else bench/build_llama_server.sh's build
(bench/peers.py: llama_server_binary)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    finish_facts,
    free_port,
    llama_grpc_server,
    machine_facts,
    progress,
    pyplot,
    save_figure,
    seeded_text,
    spread,
    write_json,
)
from peers import llama_server_binary, peer_process

from llama_grpc import Client
from llama_grpc_server.models import assemble, trained

MODEL = trained.NOMIC_EMBED_TEXT_V15
SLOTS = 4
N_CTX = 2048  # nomic-embed-text-v1.5's trained context: one input per pass, at most this long
SHAPES = {"short": 8, "long": 380}  # words per input: ~17 and ~500 tokens (prefix, [CLS]/[SEP])
PREFIX = "search_document: "

Embed = Callable[[list[list[int]]], list[list[float]]]  # token id lists -> vectors


def llama_server_cmd(binary: str, model: str, port: int, threads: int) -> list[str]:
    """--embedding with mean pooling (the model's own), slots x N_CTX of context (a context
    per slot), a batch and ubatch of a whole input (non-causal: one ubatch holds it)."""
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "--embedding", "--pooling", "mean", "-c", str(SLOTS * N_CTX), "-np", str(SLOTS),
            "-b", str(N_CTX), "-ub", str(N_CTX), "-t", str(threads), "-tb", str(threads),
            "--no-webui", "--fit", "off", "--log-disable"]  # fmt: skip


def server_embed(port: int) -> Embed:
    url = f"http://127.0.0.1:{port}/v1/embeddings"

    def embed(inputs: list[list[int]]) -> list[list[float]]:
        body = json.dumps({"input": inputs, "encoding_format": "float"}).encode()
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as reply:
            data = json.loads(reply.read())["data"]
        if len(data) != len(inputs):
            raise RuntimeError(f"llama-server answered {len(data)} vectors for {len(inputs)}")
        return [row["embedding"] for row in sorted(data, key=lambda r: r["index"])]

    return embed


def grpc_embed(client: Client) -> Embed:
    def embed(inputs: list[list[int]]) -> list[list[float]]:
        return [list(e.vector) for e in client.embed(inputs).embeddings]

    return embed


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return float(dot / (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5)


def timed(embed: Embed, inputs: list[list[int]]) -> float:
    """Inputs per second of one call holding them all."""
    t0 = time.perf_counter()
    vectors = embed(inputs)
    wall = time.perf_counter() - t0
    if len(vectors) != len(inputs):
        raise RuntimeError(f"{len(vectors)} vectors for {len(inputs)} inputs")
    return len(inputs) / wall


def run(threads: int, reps: int, batches: Sequence[int], shapes: dict[str, int]) -> dict[str, Any]:
    path = str(assemble.fetch(MODEL))
    binary = llama_server_binary()
    if binary is None:
        raise SystemExit(
            "no llama-server: set $LLAMA_SERVER_BINARY or run bench/build_llama_server.sh"
        )
    port = free_port()
    args = ("--model", f"{MODEL.name}={path}", "--threads", str(threads), "--n-parallel",
            str(SLOTS), "--n-ctx", str(SLOTS * N_CTX))  # fmt: skip
    out: dict[str, Any] = {"model": MODEL.name, "llama_server": binary, "rows": []}
    with (
        llama_grpc_server(*args, timeout_s=300) as target,
        peer_process(llama_server_cmd(binary, path, port, threads), port, "/health"),
        Client(target, timeout=1800) as client,
    ):
        systems = {"llama_grpc": grpc_embed(client), "llama_server": server_embed(port)}
        probe = client.tokenize(PREFIX + seeded_text(20, 5), add_special=True)
        ours, theirs = (systems[name]([probe])[0] for name in systems)
        out["cosine_llama_grpc_llama_server"] = cosine(ours, theirs)
        progress(f"cosine {out['cosine_llama_grpc_llama_server']:.6f}")
        for shape, words in shapes.items():
            for batch in batches:
                texts = [
                    PREFIX + seeded_text(words, 1000 * batch + words + i) for i in range(batch)
                ]
                inputs = [client.tokenize(t, add_special=True) for t in texts]
                for embed in systems.values():
                    embed(inputs[:1])  # warm: the first pass of a shape allocates
                rates: dict[str, list[float]] = {name: [] for name in systems}
                for rep in range(reps):
                    for name, embed in systems.items():
                        rates[name].append(timed(embed, inputs))
                        progress(f"{shape} x{batch} rep {rep} {name}: {rates[name][-1]:.2f}/s")
                ratios = [
                    a / b for a, b in zip(rates["llama_grpc"], rates["llama_server"], strict=True)
                ]
                out["rows"].append({
                    "shape": shape,
                    "batch": batch,
                    "mean_tokens": statistics.fmean(len(i) for i in inputs),
                    **{f"{name}_inputs_per_s": spread(r) for name, r in rates.items()},
                    "ratio_llama_grpc_over_llama_server": spread(ratios),
                })  # fmt: skip
    return out


def plot(rows: Sequence[dict[str, Any]], threads: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(10, 4))
    for ax, shape in zip(axes, SHAPES, strict=True):
        got = [r for r in rows if r["shape"] == shape]
        xs = [r["batch"] for r in got]
        for key, style, label in (("llama_grpc", "o-", "llama-grpc v1 Embed"),
                                  ("llama_server", "s--", "llama-server --embedding")):  # fmt: skip
            ax.plot(xs, [r[f"{key}_inputs_per_s"]["median"] for r in got], style, label=label)
        for r in got:
            ax.annotate(
                f"{r['ratio_llama_grpc_over_llama_server']['median']:.2f}x",
                (r["batch"], r["llama_grpc_inputs_per_s"]["median"]),
                textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8,
            )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("inputs per call")
        ax.set_ylabel("inputs/s (median)")
        ax.set_title(f"{shape} (~{round(got[0]['mean_tokens'])} tokens)")
        ax.legend(fontsize=8)
    fig.suptitle(f"nomic-embed-text-v1.5 F16, {threads} threads, {SLOTS} slots")
    save_figure(fig, "embeddings_nomic")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument(
        "--long-words", type=int, default=SHAPES["long"], help="words per long input"
    )
    parser.add_argument("--out", default="embeddings_nomic")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    data: dict[str, Any] = {"machine": machine_facts(args.threads)}
    shapes = {**SHAPES, "long": args.long_words}
    data.update(run(args.threads, args.reps, batches, shapes))
    write_json(args.out, finish_facts(data))
    plot(data["rows"], args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
