"""--batch-invariant's parts that need no model: the option, the context parameters it sets,
the process-wide kernel setting, and the spare row that keeps llama.cpp from a one-row
micro-batch (tests/e2e/test_batch_invariant.py runs the real model)."""

from __future__ import annotations

import os
from typing import Any

import llama_cpp
import pytest

from llama_grpc_server.config import ModelSettings
from llama_grpc_server.config.loading import load_settings
from llama_grpc_server.core.scheduling.plan import Chunk
from llama_grpc_server.engine import llama
from llama_grpc_server.engine.batch import Batch, needs_spare_row
from llama_grpc_server.engine.llama import BATCH_INVARIANT_UBATCH, LlamaModel


def test_the_flag_sets_the_model_setting() -> None:
    assert load_settings(["--batch-invariant"], {}).model.batch_invariant is True
    assert load_settings([], {}).model.batch_invariant is False


def context_params(settings: ModelSettings) -> Any:
    model = object.__new__(LlamaModel)
    model.settings, model.is_encoder = settings, False
    return model._context_params(4)


def test_the_mode_takes_small_micro_batches_and_flash_attention() -> None:
    plain = context_params(ModelSettings(flash_attn=False))
    assert plain.n_ubatch == 512
    mode = context_params(ModelSettings(flash_attn=False, batch_invariant=True))
    assert mode.n_ubatch == BATCH_INVARIANT_UBATCH
    assert mode.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
    tiny = context_params(ModelSettings(n_ubatch=1, batch_invariant=True))
    assert tiny.n_ubatch == 2  # a micro-batch of one: never


def test_the_kernel_setting_goes_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGML_CPU_TILED_MM_FORCE", "1")
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    llama._batch_invariant_kernels(0)
    assert os.environ["GGML_CPU_TILED_MM"] == "0"
    assert "GGML_CPU_TILED_MM_FORCE" not in os.environ


@pytest.mark.parametrize(
    ("rows", "n_ubatch", "needed"),
    [
        (1, 32, True),
        (2, 32, False),
        (32, 32, False),
        (33, 32, True),
        (65, 32, True),
        (64, 32, False),
    ],
)
def test_a_spare_row_where_a_micro_batch_would_hold_one(
    rows: int, n_ubatch: int, needed: bool
) -> None:
    assert needs_spare_row(rows, n_ubatch) is needed


def decode(slot: int, pos: int, token: int) -> Chunk:
    return Chunk(
        slot_id=slot, request_id=f"r{slot}", start_pos=pos, tokens=(token,), wants_logits=True
    )


def test_the_spare_row_repeats_the_last_rows_token_at_the_next_position() -> None:
    batch = Batch(4)
    assert batch.fill([decode(2, 40, 7)]) == [0]
    assert batch.add_spare_row(32, 4096) == (2, 41)
    n = int(batch.struct.n_tokens)
    assert n == 2
    assert (batch.token[1], batch.pos[1], batch.seq[1], batch.logits[1]) == (7, 41, 2, 0)
    assert batch.logits[0] == 1
    batch.drop_spare_row()
    assert batch.struct.n_tokens == 1
    assert batch.add_spare_row(32, 41) is None  # position 41 is past a context of 41


def test_no_spare_row_when_none_is_needed_and_room_for_one_on_a_full_batch() -> None:
    batch = Batch(3)
    batch.fill([decode(0, 10, 5), decode(1, 20, 6)])
    assert batch.add_spare_row(32, 4096) is None
    assert batch.struct.n_tokens == 2
    full = Batch(3)  # a whole n_batch of rows that leaves one row over: the spare still fits
    prompt = Chunk(slot_id=1, request_id="p", start_pos=0, tokens=(1, 2, 3), wants_logits=True)
    full.fill([prompt])
    assert full.add_spare_row(2, 4096) == (1, 3)
    assert full.struct.n_tokens == 4
