"""`llama-grpc serve`: argv + LLAMA_GRPC_* env + a TOML config file -> frozen Settings
(config/loading.py) -> serve(). The only reader of os.environ in the server; engine and rpc are
imported lazily, after parsing."""

from __future__ import annotations

import asyncio
import os
import sys

import structlog

from llama_grpc_server.config.loading import ConfigError, HelpRequested, load_settings
from llama_grpc_server.config.options import PROG
from llama_grpc_server.config.settings import Settings
from llama_grpc_server.core.api import EngineApi
from llama_grpc_server.observability import telemetry
from llama_grpc_server.observability.telemetry import configure_logging

log = structlog.get_logger("llama_grpc.config")


def run(settings: Settings) -> int:
    """Load the default model inside serve() (so health can report NOT_SERVING meanwhile) and
    serve, the other models loading on demand; each engine's telemetry events feed Prometheus
    (--metrics-port) and, at debug, the logs, labelled with its model's name."""
    from llama_grpc_server.engine.build import build_engine
    from llama_grpc_server.models.pool import ModelSpec, model_specs, settings_for
    from llama_grpc_server.observability.metrics import Metrics
    from llama_grpc_server.rpc.plumbing.server import serve
    from llama_grpc_server.watchdog import EXIT_ENGINE_HUNG

    debug_logs = settings.server.log_level == "debug"
    metrics = Metrics() if settings.server.metrics_port else None
    sinks: list[telemetry.EventSink] = [] if metrics is None else [metrics]
    if debug_logs:
        sinks.append(telemetry.LogSink())
    sink = telemetry.Sinks(*sinks) if sinks else None

    def build(spec: ModelSpec) -> EngineApi:
        events = telemetry.Telemetry(sink=sink, model=spec.name)
        return build_engine(
            settings_for(settings, spec),
            on_tick=events.on_tick,
            on_done=events.on_done,
            debug_logs=debug_logs,
        )

    default = model_specs(settings)[0]
    code = asyncio.run(
        serve(settings, lambda: build(default), model_factory=build, metrics=metrics)
    )
    if code == EXIT_ENGINE_HUNG:
        # A thread is stuck inside llama.cpp: the interpreter's shutdown could wait for it or
        # free the model under it. Nothing is left to clean up that the exit does not.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """`llama-grpc serve [options]`; returns the process exit code (2 for a bad option)."""
    notes: list[str] = []
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv, os.environ, notes)
    except HelpRequested as help_:
        print(help_.text, end="")
        return 0
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.server.log_format, settings.server.log_level)
    for note in notes:
        log.warning("deprecated_option", detail=note)
    try:
        return run(settings)
    except KeyboardInterrupt:
        return 130
