"""Builds a running EngineLoop from Settings: load the model, create runner and scheduler,
warm up with one real decode, start the engine thread."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import structlog

from llama_grpc_server.config import Settings, ram_tier_mb
from llama_grpc_server.config.settings import LoraSpec
from llama_grpc_server.core.adapters import AdapterEntry
from llama_grpc_server.core.kv.disk import KvDiskStore
from llama_grpc_server.core.requests.request import SpeculativeConfig, SpeculativeMode
from llama_grpc_server.core.scheduling.plan import Chunk, StepPlan
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.core.scheduling.strategies import load_strategy
from llama_grpc_server.core.speculation.policy import PRIOR_AVX512, PRIOR_X86_64_V3, TickCostModel
from llama_grpc_server.engine import logs, openmp
from llama_grpc_server.engine.adapters import AdapterLoadError, LoraAdapters
from llama_grpc_server.engine.draft import DraftModel
from llama_grpc_server.engine.llama import LlamaModel, ModelLoadError, system_info
from llama_grpc_server.engine.loop import DoneHook, EngineLoop, TickHook
from llama_grpc_server.engine.runner import Runner
from llama_grpc_server.models import catalog
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME, default_model_path, file_sha256
from llama_grpc_server.watchdog import tick_bounds

log = structlog.get_logger("llama_grpc.engine")


def resolve_model(settings: Settings) -> tuple[str, str]:
    """(path, name) of the model to load; the embedded one when no path is configured."""
    if settings.model.model_path:
        path = settings.model.model_path
        return path, settings.model.model_name or Path(path).stem
    return str(default_model_path()), settings.model.model_name or DEFAULT_MODEL_NAME


def warm_up(
    model: LlamaModel, runner: Runner, costs: TickCostModel | None = None, max_rows: int = 0
) -> float:
    """One real decode so the first request does not pay for lazy allocations, then timed
    prefills of CALIBRATION_TEXT: the fastest one's milliseconds per prompt token are returned
    (the watchdog's start bound derives from them). Given the speculation cost model, calibrate
    it for ticks of up to max_rows rows."""
    tokens = tuple(model.tokenize("Hello", add_special=True, parse_special=False))
    plan = StepPlan(tick=0, chunks=(Chunk(0, "", 0, tokens, False),))
    runner.execute(plan)
    model.seq_remove(0, 0, -1)
    text = model.tokenize(CALIBRATION_TEXT, add_special=True, parse_special=False)
    context = tuple(text[: model.n_batch])
    passes_ms = []
    for _ in range(PREFILL_TIMINGS):
        passes_ms.append(runner.time_decode((Chunk(0, "", 0, context, False),)))
        model.seq_remove(0, 0, -1)
    prefill_token_ms = min(passes_ms) / len(context)
    if costs is not None:
        costs.calibrate(calibrate(model, runner, max_rows))
        log.info("speculation_calibrated", tick_ms={n: round(ms, 2) for n, ms in costs.snapshot()})
    return prefill_token_ms


# The first prefill after the warm-up decode pays for a larger compute graph, and other work on
# the machine stretches any pass: measured on the shared 2-core box (load ~3.7), 58 tokens took
# 2465, 1990, 628 and 711 ms in a row. The fastest of PREFILL_TIMINGS is kept.
PREFILL_TIMINGS = 2
CALIBRATION_TEXT = "The quick brown fox jumps over the lazy dog while the cat watches. " * 4


def calibrate(model: LlamaModel, runner: Runner, max_rows: int) -> list[tuple[int, float]]:
    """(rows, ms) of decode-only forward passes of every N from 1 to max_rows (one sequence
    after a short context, logits for every row, like a speculative decode), twice each in
    interleaved sweeps (the cost model keeps the faster: other work on the machine can stretch
    one pass tenfold): about 2.5 s for 18 rows on 2 CPU cores for Gemma 3 270M. Every N, not a
    few to interpolate between: the cost is not monotone in N (core.speculation.policy). The model
    then learns from real ticks."""
    context = tuple(model.tokenize(CALIBRATION_TEXT, add_special=True, parse_special=False))
    runner.time_decode((Chunk(0, "", 0, context, False),))
    points: list[tuple[int, float]] = []
    for _ in range(2):
        for rows in range(1, max_rows + 1):
            tokens = tuple(context[i % len(context)] for i in range(rows))
            chunk = Chunk(0, "", len(context), tokens, True, num_draft=rows - 1)
            points.append((rows, runner.time_decode((chunk,))))
            model.seq_remove(0, len(context), -1)
    model.seq_remove(0, 0, -1)
    return points


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
    drafter = _load_draft(settings, model) if settings.model.draft_model else None
    lora = None if model.is_encoder else LoraAdapters(model.model, model.ctx, path)
    try:
        entries = _load_loras(lora, settings.model.loras, name, model)
    except ModelLoadError:
        if drafter is not None:  # the target is freed already
            drafter.close()
        raise
    runner = Runner(model, lora)
    disk = None
    if sched.kv_cache_dir:
        disk = KvDiskStore(
            sched.kv_cache_dir,
            model.kv_fingerprint(file_sha256(path)),
            sched.kv_cache_disk_mb * 1024 * 1024,
        )
    engines = settings.pool.resident_engines()
    ram_mb = ram_tier_mb(sched.prompt_cache_ram_mb, engines=engines)
    log.info("ram_tier", mb=ram_mb, configured=sched.prompt_cache_ram_mb, engines=engines)
    info = model.info(name)
    scheduler = Scheduler(
        SchedulerLimits(
            n_parallel=sched.n_parallel,
            n_ctx=model.n_ctx,
            n_batch=model.n_batch,
            # an encoder's input goes whole in one pass (core.requests.embedding.share_whole)
            chunk_size=min(sched.chunk_size or model.n_batch, model.n_batch)
            if not model.is_encoder
            else model.n_batch,
            prefill_stall=sched.prefill_stall,
            max_queue=sched.max_queue,
            supports_partial_removal=model.supports_partial_removal,
            ram_cache_bytes=ram_mb * 1024 * 1024,
            session_idle_s=sched.session_idle_s,
            session_live_s=sched.session_live_s,
            tenants=sched.tenant_limits,
            pad_decode_batches=sched.pad_decode_batches,
            kv_events_bos=info.bos_token_id if info.add_bos else None,
            stream_buffer_tokens=sched.stream_buffer_tokens,
            stalled_reader_s=sched.stalled_reader_s,
            encoder=(model.architecture or "encoder") if model.is_encoder else "",
            speculative=SpeculativeConfig(
                SpeculativeMode(sched.speculative),
                sched.draft_max,
                sched.ngram_min,
                sched.ngram_max,
            ),
        ),
        pieces=model.pieces,
        eog_ids=model.eog_ids,
        strategy=strategy,
        disk=disk,
    )
    # the cost of a pass of N rows has another shape with AVX-512 (core.speculation.policy)
    avx512 = "AVX512 = 1" in system_info()
    scheduler.set_pass_prior(PRIOR_AVX512 if avx512 else PRIOR_X86_64_V3)
    scheduler.set_drafter(drafter)

    def close() -> None:
        if lora is not None:
            lora.close()
        if disk is not None:
            disk.close()  # the saves queued at shutdown reach the disk first
        runner.close()
        if drafter is not None:
            drafter.close()
        model.close()

    measured: list[float] = []  # the warm-up's ms per prompt token (on the engine thread)

    def start() -> None:
        measured.append(
            warm_up(
                model,
                runner,
                scheduler.pass_costs
                if sched.speculative != "off" and not model.is_encoder
                else None,
                min(sched.draft_max + 2, model.n_batch),
            )
        )
        if drafter is not None:  # a drafted token's first price, before any draft pass
            text = model.tokenize(CALIBRATION_TEXT, add_special=True, parse_special=False)
            token_ms = drafter.warm_up(text[: model.n_batch])
            scheduler.set_drafter(drafter, token_ms)
            log.info("draft_model_calibrated", token_ms=round(token_ms, 2))

    engine = EngineLoop(
        scheduler,
        runner,
        info,
        tokenizer=model,
        kv_cells_total=model.n_ctx,
        on_tick=on_tick,
        on_done=on_done,
        on_close=close,
        # The warm-up decode runs on the engine thread, like every later decode. llama.cpp's
        # OpenMP team belongs to the thread that first decodes; a second team (main thread, then
        # engine thread) makes libgomp see more threads than CPUs and throttle its barrier
        # spinning: measured here, every later decode 1.5-1.9x slower on 2 cores.
        # A server that speculates by default calibrates its cost model for one stream's
        # longest draft and one row more (~2.5 s for 18 rows); otherwise a request asking for
        # AUTO starts from the prior shape scaled by the measured ticks.
        on_start=start,
        # asked for after on_start, on the engine thread: the warm-up has measured by then
        watchdog_s=lambda: tick_bounds(sched.watchdog_s, model.n_batch, measured[-1]),
        # An idle engine's docked OpenMP helpers throttle a busy engine's barriers the same way
        # (engine/openmp.py): they are released after IDLE_RELEASE_S without work.
        on_idle=openmp.idle_release(),
        admission_window_s=sched.admission_window_ms / 1000,
        overlap_decode=overlap_decode(sched.overlap_decode, model),
        lora=lora,
    )
    if drafter is not None:
        drafter.before_pass = engine.expect_inner_pass
    for entry in entries:
        engine.adapters.add(entry)
    return engine


def _load_draft(settings: Settings, model: LlamaModel) -> DraftModel:
    """--draft-model, resolved (a path, or a name of --models-dir or the trained models) and
    loaded with the target's context settings; ModelLoadError (the target freed) when it cannot
    be found or loaded, or its vocabulary is not the target's."""
    entry = settings.model.draft_model
    models_dir = Path(settings.pool.models_dir) if settings.pool.models_dir else None
    try:
        draft_path = str(catalog.resolve(entry, models_dir))
        draft_settings = dataclasses.replace(settings.model, model_path=draft_path, loras=())
        drafter = DraftModel.load(draft_settings, draft_path, model.n_seq_max, model)
    except catalog.CatalogError as exc:
        model.close()
        raise ModelLoadError(f"--draft-model {entry}: {exc}") from None
    except ModelLoadError:
        model.close()
        raise
    log.info("draft_model_loaded", path=draft_path, n_vocab=drafter.model.n_vocab)
    if settings.scheduler.speculative == "off":
        log.warning(
            "draft_model_idle",
            reason="--speculative off: only requests asking for speculation (params.speculative) "
            "draft; --speculative on or auto drafts for the others",
        )
    return drafter


def _load_loras(
    lora: LoraAdapters | None, specs: Sequence[LoraSpec], name: str, model: LlamaModel
) -> list[AdapterEntry]:
    """The --lora adapters of model `name`, loaded (ModelLoadError naming the adapter and the
    mismatch, the model freed, when one does not fit)."""
    wanted = [s for s in specs if s.model in ("", name)]
    if lora is None:
        if wanted:
            model.close()
            raise ModelLoadError(f"--lora {wanted[0].name}: an encoder takes no LoRA adapters")
        return []
    entries = []
    for spec in wanted:
        try:
            entries.append(lora.load(spec.name, spec.path, spec.scale))
        except AdapterLoadError as exc:
            model.close()
            raise ModelLoadError(f"--lora {spec.name}: {exc}") from None
    return entries


def overlap_decode(mode: str, model: LlamaModel) -> bool:
    """--overlap-decode: auto is on when the model's layers are offloaded to a GPU, where
    llama_decode returns before the pass is done; on the CPU nothing would overlap."""
    if mode != "auto":
        return mode == "on"
    return model.n_gpu_layers != 0 and bool(llama_cpp.llama_supports_gpu_offload())
