"""cpu_share: while a model loads, the engines decode with the CPUs the load leaves them."""

from __future__ import annotations

import pytest

from llama_grpc_server.engine import cpu_share


def test_no_load_keeps_the_configured_threads() -> None:
    assert cpu_share.LOADS.count == 0
    assert cpu_share.decode_threads((2, 2), cpus=2) == (2, 2)
    assert cpu_share.decode_threads((16, 8), cpus=16) == (16, 8)


def test_a_load_takes_a_core_only_from_engines_that_would_oversubscribe() -> None:
    with cpu_share.loading():
        assert cpu_share.LOADS.count == 1
        assert cpu_share.decode_threads((2, 2), cpus=2) == (1, 1)
        assert cpu_share.decode_threads((16, 16), cpus=16) == (15, 15)
        assert cpu_share.decode_threads((8, 16), cpus=16) == (8, 15)  # 8 leave it room
        assert cpu_share.decode_threads((1, 1), cpus=1) == (1, 1)  # never fewer than one
        with cpu_share.loading():
            assert cpu_share.decode_threads((4, 4), cpus=4) == (2, 2)
            assert cpu_share.decode_threads((2, 2), cpus=2) == (1, 1)
    assert cpu_share.LOADS.count == 0
    assert cpu_share.decode_threads((2, 2), cpus=2) == (2, 2)


def test_a_failed_load_ends_too() -> None:
    with pytest.raises(RuntimeError), cpu_share.loading():
        raise RuntimeError("no such file")
    assert cpu_share.LOADS.count == 0


def test_turned_off_it_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_share.LOADS, "enabled", False)
    with cpu_share.loading():
        assert cpu_share.decode_threads((2, 2), cpus=2) == (2, 2)
