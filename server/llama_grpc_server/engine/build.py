"""Builds a running EngineLoop from Settings: load the model, create runner and scheduler,
warm up with one real decode, start the engine thread."""

from __future__ import annotations

from pathlib import Path

from llama_grpc_server.config import Settings
from llama_grpc_server.core.plan import Chunk, StepPlan
from llama_grpc_server.core.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.core.strategies import load_strategy
from llama_grpc_server.engine import logs, openmp
from llama_grpc_server.engine.llama import LlamaModel
from llama_grpc_server.engine.runner import Runner
from llama_grpc_server.kv_disk import KvDiskStore
from llama_grpc_server.loop import DoneHook, EngineLoop, TickHook
from llama_grpc_server.model_files import DEFAULT_MODEL_NAME, default_model_path, file_sha256


def resolve_model(settings: Settings) -> tuple[str, str]:
    """(path, name) of the model to load; the embedded one when no path is configured."""
    if settings.model.model_path:
        path = settings.model.model_path
        return path, settings.model.model_name or Path(path).stem
    return str(default_model_path()), settings.model.model_name or DEFAULT_MODEL_NAME


def warm_up(model: LlamaModel, runner: Runner) -> None:
    """One real decode so the first request does not pay for lazy allocations."""
    tokens = tuple(model.tokenize("Hello", add_special=True, parse_special=False))
    plan = StepPlan(tick=0, chunks=(Chunk(0, "", 0, tokens, False),))
    runner.execute(plan)
    model.seq_remove(0, 0, -1)


def build_engine(
    settings: Settings,
    *,
    on_tick: TickHook | None = None,
    on_done: DoneHook | None = None,
    debug_logs: bool = False,
) -> EngineLoop:
    logs.install(debug_logs)
    path, name = resolve_model(settings)
    sched = settings.scheduler
    strategy = load_strategy(sched.batch_strategy)
    model = LlamaModel(settings.model, path, sched.n_parallel)
    runner = Runner(model)
    disk = None
    if sched.kv_cache_dir:
        disk = KvDiskStore(
            sched.kv_cache_dir,
            model.kv_fingerprint(file_sha256(path)),
            sched.kv_cache_disk_mb * 1024 * 1024,
        )
    scheduler = Scheduler(
        SchedulerLimits(
            n_parallel=sched.n_parallel,
            n_ctx=model.n_ctx,
            n_batch=model.n_batch,
            chunk_size=min(sched.chunk_size, model.n_batch),
            max_queue=sched.max_queue,
            supports_partial_removal=model.supports_partial_removal,
            ram_cache_bytes=sched.prompt_cache_ram_mb * 1024 * 1024,
            session_idle_s=sched.session_idle_s,
            tenants=sched.tenant_limits,
        ),
        pieces=model.pieces,
        eog_ids=model.eog_ids,
        strategy=strategy,
        disk=disk,
    )

    def close() -> None:
        if disk is not None:
            disk.close()  # the saves queued at shutdown reach the disk first
        runner.close()
        model.close()

    return EngineLoop(
        scheduler,
        runner,
        model.info(name),
        tokenizer=model,
        kv_cells_total=model.n_ctx,
        on_tick=on_tick,
        on_done=on_done,
        on_close=close,
        # The warm-up decode runs on the engine thread, like every later decode. llama.cpp's
        # OpenMP team belongs to the thread that first decodes; a second team (main thread, then
        # engine thread) makes libgomp see more threads than CPUs and throttle its barrier
        # spinning: measured here, every later decode 1.5-1.9x slower on 2 cores.
        on_start=lambda: warm_up(model, runner),
        # An idle engine's docked OpenMP helpers throttle a busy engine's barriers the same way
        # (engine/openmp.py): they are released after IDLE_RELEASE_S without work.
        on_idle=openmp.idle_release(),
        admission_window_s=sched.admission_window_ms / 1000,
    )
