"""`make gateway REPLICAS=2`: N llama-grpc replicas on free loopback ports and the SMG gateway
(PyPI `smg`, the `gateway` dependency group) on 127.0.0.1:8080 in front of them, in the
foreground; one ready line once the gateway lists the model, every worker is healthy and a
one-token completion has gone through; Ctrl-C stops everything.

                                              ┌─ gRPC ─► replica 0 (127.0.0.1:p0)  llama-grpc
    any OpenAI SDK ── HTTP ─► SMG 127.0.0.1:8080 ─ gRPC ─► replica 1 (127.0.0.1:p1)  llama-grpc
    (chat, completions,       tokenizes (the workers' exported tokenizer), applies the chat
     responses, messages)     template, routes on the workers' KV events; vllm.grpc.engine

The replicas are deploy.cluster's (llama.cpp threads split across them); the gateway fetches
each worker's model info and tokenizer (GetTokenizer: llama_grpc_server.models.tokenizer_export) at
start. The default policy is SMG's `cache_aware`: with gRPC workers it subscribes to each
one's SubscribeKvEvents (nothing to switch on) and sends a request to the replica whose cache
holds the longest run of its 16-token blocks, the least loaded one on a miss; `--policy`
takes any other SMG policy (round_robin, power_of_two, ...). SMG's Prometheus metrics
(smg_kv_event_*, smg_cache_aware_policy_branch_total) are on a free port: `metrics_url`.

    python -m deploy.gateway --replicas 2 [--port 8080] [--policy P] [-- llama-grpc serve options]

LoRA adapters: the engine protocol has no LoRA field, so an adapter is a model of its own.
`--engine-lora NAME[:SCALE]` (repeatable) starts N more replicas for each, with the replicas'
options and `--engine-lora NAME[:SCALE]`: they apply the --lora adapter NAME to every request of
the engine protocol and register as model `<model>+NAME`, which SMG routes to them by name.

    python -m deploy.gateway --replicas 1 --engine-lora a -- --model base.gguf --lora a=a.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy import smg_parsers
from deploy.cluster import (
    DRAIN_DELAY_S,
    REPLICA_STOP_S,
    START_TIMEOUT_S,
    Cluster,
    Replica,
    Started,
    free_port,
    serve_foreground,
    terminate_all,
    venv_binary,
    wait_for,
)

DEFAULT_PORT = 8080
DEFAULT_POLICY = "cache_aware"
SMG_STOP_S = 15.0  # SMG takes several seconds to exit on SIGTERM
# SMG probes each worker's HealthCheck every 60 s and needs 3 failures by default: a dead or
# draining replica stays listed healthy in /workers for minutes (a broken KV-event stream or a
# transport failure excludes it from routing sooner, --worker-stall-secs). HEALTH_ARGS: one
# probe a second, one failure to leave and one success to come back, like Envoy's checks in
# deploy/cluster.py (within DRAIN_DELAY_S of a SIGTERM). Not on by default: with them SMG 1.13
# logs a worker's 400 (a refused constraint) as an ERROR "pipeline attempt failed", which
# test_gateway.py's clean-log check rejects; the chaos tests pass them in smg_args.
# Retries need nothing: SMG retries a failed attempt up to 5 times (--retry-max-retries) with
# backoff from 50 ms, on another worker, unless a token has reached the client.
HEALTH_INTERVAL_S = 1
# SMG vetoes a worker as "wedged" when the streams it has in flight there show no token for
# --worker-wedge-secs (3 s by default) while they pile up (four deep) or its waiting queue grows;
# it stretches that bound by the prefill in hand at a rate learnt from a prior of 10,000
# tokens/s, a GPU's. A 2-core CPU replica prefills a few hundred to ~1,000 tokens/s: six streams
# sharing a 1,100-token system prompt waited 7.5 s for their first tokens and SMG vetoed the one
# replica that held the prefix for 4 s mid-run (load 3, /tmp probe of 2026-11-26), so a cache-aware
# gateway steered traffic away from the cache it routes on; with 30 s, no veto. A really hung
# llama-grpc engine is caught by its own watchdog (--watchdog-s), which ends the process: SMG
# sees that at once as a transport failure (--worker-stall-secs), so the longer bound costs no
# detection of a hang. Always passed (before smg_args, which may override it).
CPU_LIVENESS_ARGS = ("--worker-wedge-secs", "30")
# SMG's warm-up slice sends some requests to a worker with a thin index on purpose (one miss in
# 4, one hit in 8, the first minute): tests and benchmarks turn it off so that every routing
# decision follows the cache.
NO_WARM_UP = ("--worker-warmup-secs", "0", "--worker-warmup-thin-ratio", "0",
              "--worker-warmup-divert-every", "0")  # fmt: skip
# SMG takes 5.1 s to exit on SIGTERM with nothing in flight under its default 180 s
# --shutdown-grace-period-secs, 0.7 s with 1 s (measured with one idle replica). The tests,
# which close their gateways with no call in flight, pass QUICK_EXIT; `make gateway` keeps
# SMG's default, so a Ctrl-C lets calls in flight finish.
QUICK_EXIT = ("--shutdown-grace-period-secs", "1")
HEALTH_ARGS = ("--health-check-interval-secs", str(HEALTH_INTERVAL_S),
               "--health-failure-threshold", "1", "--health-success-threshold", "1")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelCheck:
    """What the gateway needs to know of the replicas' default model before anything starts."""

    path: str
    chat_template: str | None  # the one the exported tokenizer carries (SMG renders chat with it)
    parsers: smg_parsers.Parsers
    # an encoder-only embedding model (`<arch>.attention.causal` false: BERT, nomic-bert, ...):
    # it answers /v1/embeddings only, so readiness is probed with an embedding, not a completion
    embeddings_only: bool = False
    name: str = ""  # the model id the replicas report (--model-name, else the file's stem)


def check_model(server_args: Sequence[str], environ: Mapping[str, str] = os.environ) -> ModelCheck:
    """Read the replicas' options and export their default model's tokenizer as a worker will
    (the same disk cache, so the workers find it built): RuntimeError naming the reason when
    the options are wrong or the tokenizer cannot be exported, at once, instead of a gateway
    that never becomes ready (SMG cannot register a worker without the tokenizer)."""
    from llama_grpc_server.config.loading import ConfigError, HelpRequested, load_settings
    from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES, template_in_use
    from llama_grpc_server.models import tokenizer_export
    from llama_grpc_server.models.files import DEFAULT_MODEL_NAME, default_model_path
    from llama_grpc_server.models.gguf_header import GGUFError, read_header

    try:
        settings = load_settings(server_args, environ)
    except (ConfigError, HelpRequested) as exc:
        raise RuntimeError(f"the replicas' options ({' '.join(server_args)}): {exc}") from None
    path = settings.model.model_path or str(default_model_path())
    try:
        header = read_header(path)
        # the template a replica will use (core.requests.chat.template_in_use, as engine/llama.py
        # does)
        name = template_in_use(
            settings.model.chat_template, header.has_chat_template, header.architecture
        )
        files = tokenizer_export.export_files(
            path, BUILTIN_TEMPLATES.get(name), cache_dir=tokenizer_export.default_cache_dir(environ)
        )
    except (tokenizer_export.TokenizerExportError, GGUFError, OSError) as exc:
        raise RuntimeError(
            f"{path}: its tokenizer cannot be exported for the gateway (SMG tokenizes with it): "
            f"{exc}"
        ) from None
    config = json.loads(files[tokenizer_export.TOKENIZER_CONFIG])
    template = config.get("chat_template") or None
    causal = header.metadata.get(f"{header.architecture}.attention.causal", True)
    stem = Path(settings.model.model_path).stem if settings.model.model_path else DEFAULT_MODEL_NAME
    return ModelCheck(
        path,
        template,
        smg_parsers.choose(template),
        embeddings_only=causal is False,
        name=settings.model.model_name or stem,
    )


def check_engine_lora(
    server_args: Sequence[str], spec: str, environ: Mapping[str, str] = os.environ
) -> str:
    """The model id SMG will serve the replicas of `--engine-lora spec` as (`<model>+NAME`):
    RuntimeError at once when the replicas' options do not take it (the adapter is not one of
    the default model's --lora adapters, a bad scale)."""
    from llama_grpc_server.config.loading import ConfigError, HelpRequested, load_settings
    from llama_grpc_server.config.settings import parse_engine_lora

    try:
        load_settings([*server_args, "--engine-lora", spec], environ)
    except (ConfigError, HelpRequested) as exc:
        raise RuntimeError(f"--engine-lora {spec}: {exc}") from None
    return parse_engine_lora(spec)[0]


def smg_binary() -> str:
    """The smg launcher from the smg wheel."""
    return venv_binary("smg", "the gateway group (make gateway installs it)")


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    """GET (or POST `body` as JSON) and parse the JSON answer; HTTPError on a non-2xx."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


@dataclass
class Gateway(Started):
    """N replicas and SMG. Use as a context manager, or start() / close()."""

    replicas: int = 2
    port: int = DEFAULT_PORT
    policy: str = DEFAULT_POLICY
    server_args: Sequence[str] = ()
    threads: int | None = None  # per replica (None: the CPUs split evenly, at least 1)
    smg_args: Sequence[str] = ()  # more `smg launch` options
    # SMG's parsers: None reads them off the model's chat template (deploy/smg_parsers.py),
    # "none" passes no flag (SMG guesses from the model id), a name passes that parser
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    # --engine-lora NAME[:SCALE] entries: for each, `replicas` more replicas applying that adapter
    # to the engine protocol, served by SMG as model `<model>+NAME` beside the base model
    loras: Sequence[str] = ()
    cluster: Cluster = field(init=False)
    adapter_members: list[Replica] = field(init=False, default_factory=list)
    metrics_port: int = field(init=False)
    smg: subprocess.Popen[bytes] | None = None
    model: str = ""  # the model id the gateway serves, once ready (the base model's)
    models: tuple[str, ...] = ()  # every model id it serves, once ready: the base model's first
    checked: ModelCheck | None = None  # the default model, checked before anything starts
    # smg.log's size once ready: SMG logs the readiness probes it answered 503 while the
    # workers registered (GET /v1/models) as errors; what came after is the service's own
    ready_log_offset: int = 0

    def __post_init__(self) -> None:
        if self.threads is None and self.loras:  # the CPUs split over every replica
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
            self.threads = max(1, cpus // (self.replicas * (1 + len(self.loras))))
        self.cluster = Cluster(self.replicas, server_args=self.server_args, threads=self.threads)
        self.metrics_port = free_port()  # SMG's default, 29000, is one per machine

    @property
    def base_url(self) -> str:
        """The OpenAI API root, for an SDK's base_url."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def metrics_url(self) -> str:
        """SMG's Prometheus metrics."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def metrics(self) -> dict[str, float]:
        """SMG's metrics now: {'name{labels}': value} (comments left out)."""
        with urllib.request.urlopen(self.metrics_url, timeout=5.0) as reply:
            text = reply.read().decode()
        samples = (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] not in "#")
        return {name: float(value) for name, value in samples}

    @property
    def workdir(self) -> Path:
        return self.cluster.workdir

    @property
    def parsers(self) -> smg_parsers.Parsers:
        if self.checked is None:
            raise RuntimeError("the gateway has not checked its model yet (start() does)")
        return smg_parsers.with_overrides(
            self.checked.parsers, self.tool_parser, self.reasoning_parser
        )

    @property
    def members(self) -> list[Replica]:
        """Every replica: the base model's (cluster.members), then the adapters'."""
        return [*self.cluster.members, *self.adapter_members]

    def start(self) -> Gateway:
        self.checked = check_model(self.server_args)
        for spec in self.loras:
            check_engine_lora(self.server_args, spec)
        self.start_adapter_replicas()  # loading while the base model's replicas load
        self.cluster.start_replicas()
        for replica in self.adapter_members:
            replica.wait_serving()
        self.start_smg()
        wait_for(self.is_ready, START_TIMEOUT_S, "the gateway is not ready", interval_s=0.1)
        self.ready_log_offset = (self.workdir / "smg.log").stat().st_size
        return self

    def start_adapter_replicas(self) -> None:
        """Start (not wait for) `replicas` replicas per --engine-lora entry, as the cluster's
        (deploy.cluster.Cluster.start_replicas) with `--engine-lora SPEC` added."""
        threads = str(self.threads or 1)
        base = ["--threads", threads, "--threads-batch", threads,
                "--drain-delay-s", str(DRAIN_DELAY_S), "--log-format", "json",
                *self.server_args]  # fmt: skip
        for spec in self.loras:
            name = spec.partition(":")[0]
            for i in range(self.replicas):
                index = len(self.adapter_members)
                log = self.workdir / f"replica-{name}-{i}.log"
                replica = Replica(index, 0, [*base, "--engine-lora", spec], log)  # a free port
                self.adapter_members.append(replica)
                replica.start()

    def expected_models(self) -> tuple[str, ...]:
        """The model ids SMG is to list: the base model's, then `<model>+NAME` per adapter
        (empty when the model was not checked: any one model will do)."""
        if self.checked is None:
            return ()
        name = self.checked.name
        return (name, *(f"{name}+{spec.partition(':')[0]}" for spec in self.loras))

    def start_smg(self) -> None:
        urls = [f"grpc://{r.target}" for r in self.members]
        log = (self.workdir / "smg.log").open("ab")
        self.smg = subprocess.Popen(
            [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend", "vllm", "--policy", self.policy, "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(self.metrics_port), *CPU_LIVENESS_ARGS,
             *self.parsers.smg_args(), *self.smg_args,
             "--worker-urls", *urls],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def is_ready(self) -> bool:
        """The gateway lists the model (with --engine-lora, every model), has every worker
        healthy, and a one-token completion (an embedding model: an embedding) goes through
        for each model (its tokenizer, fetched from a worker, is registered)."""
        if self.smg is not None and self.smg.poll() is not None:
            raise RuntimeError(f"smg exited; see {self.workdir / 'smg.log'}")
        try:
            listed = [str(m["id"]) for m in _http(f"{self.base_url}/models")["data"]]
            workers = _http(f"http://127.0.0.1:{self.port}/workers")["workers"]
            if not listed or len(workers) != self.replicas * (1 + len(self.loras)):
                return False
            if not all(w.get("is_healthy") for w in workers):
                return False
            models = self.expected_models() if self.loras else (listed[0],)
            if self.loras and sorted(listed) != sorted(models):
                return False
            for model in models:
                if self.checked is not None and self.checked.embeddings_only:
                    _http(f"{self.base_url}/embeddings", {"model": model, "input": "Hi"})
                else:
                    probe = {"model": model, "prompt": "Hi", "max_tokens": 1}
                    _http(f"{self.base_url}/completions", probe)
        except (OSError, KeyError, ValueError):  # not up yet, or a 503 while it registers
            return False
        self.model, self.models = models[0], tuple(models)
        return True

    def close(self) -> None:
        """SMG and the replicas get SIGTERM together: SMG's shutdown and the replicas' drains
        overlap (one after the other, closing a 1-replica gateway took 7.4 s)."""
        adapters = [replica.proc for replica in self.adapter_members]
        terminate_all([self.smg, self.cluster.envoy, *self.cluster.replica_processes(), *adapters],
                      max(SMG_STOP_S, REPLICA_STOP_S))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="SMG's port on 127.0.0.1")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="SMG's routing policy")
    parser.add_argument(
        "--tool-call-parser",
        help="SMG's tool-call parser (default: read off the model's chat template; none: SMG's "
        "own guess from the model id)",
    )
    parser.add_argument(
        "--reasoning-parser", help="SMG's reasoning parser (default and none: as above)"
    )
    parser.add_argument(
        "--engine-lora",
        action="append",
        default=[],
        metavar="NAME[:SCALE]",
        help="also serve the replicas' --lora adapter NAME as model MODEL+NAME: --replicas more "
        "replicas started with --engine-lora NAME[:SCALE] (repeatable)",
    )
    parser.add_argument("server_args", nargs="*", help="after --: llama-grpc serve options")
    args = parser.parse_args(argv)

    def ready_line(running: Gateway) -> str:
        workers = ", ".join(f"grpc://{r.target}" for r in running.members)
        parsers = running.parsers
        tool, reasoning = parsers.tool or "SMG's guess", parsers.reasoning or "SMG's guess"
        if running.checked is not None and running.checked.embeddings_only:
            return (
                f"ready: SMG on {running.base_url} (OpenAI API /v1/embeddings only: "
                f"{running.model!r} is an embedding model), workers {workers}, policy "
                f"{running.policy}; metrics on {running.metrics_url}; logs in "
                f"{running.workdir}. Ctrl-C stops everything."
            )
        models = ", ".join(repr(m) for m in running.models)
        return (
            f"ready: SMG on {running.base_url} (OpenAI API, model{'s' if running.loras else ''} "
            f"{models}), workers "
            f"{workers}, policy {running.policy}; SMG parsers: tool calls {tool}, reasoning "
            f"{reasoning} ({parsers.why}); metrics on {running.metrics_url}; logs in "
            f"{running.workdir}. Ctrl-C stops everything."
        )

    gateway = Gateway(
        args.replicas,
        args.port,
        args.policy,
        args.server_args,
        tool_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        loras=args.engine_lora,
    )
    return serve_foreground(gateway, ready_line)


if __name__ == "__main__":
    raise SystemExit(main())
