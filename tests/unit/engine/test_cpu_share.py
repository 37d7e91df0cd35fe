"""cpu_share: while a model loads, the engines decode with the CPUs the load leaves them, and a
load starts once the forward passes running with more threads than that have ended."""

from __future__ import annotations

import threading
import time

import pytest

from llama_grpc_server.engine import cpu_share
from llama_grpc_server.engine.cpu_share import CpuShare


def test_no_load_keeps_the_configured_threads() -> None:
    assert CpuShare(cpus=2).threads_for((2, 2)) == (2, 2)
    assert CpuShare(cpus=16).threads_for((16, 8)) == (16, 8)


@pytest.mark.parametrize(
    ("cpus", "configured", "one_load", "two_loads"),
    [
        (2, (2, 2), (1, 1), (1, 1)),
        (16, (16, 16), (15, 15), (14, 14)),
        (16, (8, 16), (8, 15), (8, 14)),  # 8 leave the loads room
        (1, (1, 1), (1, 1), (1, 1)),  # never fewer than one
        (4, (4, 4), (3, 3), (2, 2)),
    ],
)
def test_each_load_takes_a_core_from_engines_that_would_oversubscribe(
    cpus: int, configured: tuple[int, int], one_load: tuple[int, int], two_loads: tuple[int, int]
) -> None:
    share = CpuShare(cpus=cpus)
    with share.loading():
        assert share.threads_for(configured) == one_load
        with share.loading():
            assert share.threads_for(configured) == two_loads
        assert share.threads_for(configured) == one_load
    assert share.threads_for(configured) == configured


def test_a_pass_starting_during_a_load_gets_fewer_threads() -> None:
    share = CpuShare(cpus=2)
    with share.forward_pass((2, 2)) as before:
        assert before == (2, 2)
    with share.loading(), share.forward_pass((2, 2)) as during:
        assert during == (1, 1)
    with share.forward_pass((2, 2)) as after:
        assert after == (2, 2)


def test_a_load_waits_for_the_pass_running_with_too_many_threads() -> None:
    """A 2-thread pass is running on 2 CPUs when a load starts: the load begins when it ends."""
    share = CpuShare(cpus=2)
    ended: list[float] = []
    loading_from: list[float] = []
    in_pass = threading.Event()

    def engine() -> None:
        with share.forward_pass((2, 2)):
            in_pass.set()
            time.sleep(0.2)
            ended.append(time.monotonic())

    thread = threading.Thread(target=engine)
    thread.start()
    in_pass.wait()
    with share.loading():
        loading_from.append(time.monotonic())
    thread.join()
    assert loading_from[0] >= ended[0]


def test_a_load_does_not_wait_for_passes_that_leave_it_a_core() -> None:
    share = CpuShare(cpus=4)
    with share.forward_pass((2, 2)), share.forward_pass((3, 3)):
        started = time.monotonic()
        with share.loading(wait_s=5.0):
            assert time.monotonic() - started < 1.0


def test_a_load_waits_at_most_wait_s() -> None:
    share = CpuShare(cpus=2)
    with share.forward_pass((2, 2)):
        started = time.monotonic()
        with share.loading(wait_s=0.05):
            assert 0.04 < time.monotonic() - started < 2.0


def test_a_failed_load_ends_too() -> None:
    share = CpuShare(cpus=2)
    with pytest.raises(RuntimeError), share.loading():
        raise RuntimeError("no such file")
    assert share.loads == 0
    assert share.threads_for((2, 2)) == (2, 2)


def test_turned_off_it_changes_nothing() -> None:
    share = CpuShare(cpus=2)
    share.enabled = False
    with share.forward_pass((2, 2)):
        started = time.monotonic()
        with share.loading(wait_s=5.0):
            assert share.threads_for((2, 2)) == (2, 2)
        assert time.monotonic() - started < 1.0


def test_the_process_wide_share_starts_idle() -> None:
    assert cpu_share.SHARE.loads == 0
    assert cpu_share.SHARE.enabled
