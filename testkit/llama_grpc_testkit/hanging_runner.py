"""A real server process whose real runner (engine.runner.Runner over the embedded model) hangs or
slows down on demand: `python -m llama_grpc_testkit.hanging_runner [serve options]`
(server_process's and deploy.cluster.Replica's `module`). HANG_AT_PASS=N: forward pass N (the
warm-up's is the first) blocks for ever, a llama_decode that never returns; SLOW_PASS_S=S: every
pass after the warm-up takes S seconds more, slow but legitimate; SLOW_TOKEN_S=S: every pass after
the warm-up takes S seconds more for each token it feeds, slow in proportion to its work as a long
prefill is; HANG_FILE=PATH: once that file holds this process's pid, the next forward pass blocks
for ever (a hang on demand, in one replica of several sharing the environment)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from llama_grpc_server.cli import main
from llama_grpc_server.core.scheduling.plan import StepPlan, StepResult
from llama_grpc_server.engine.runner import Runner


def install() -> None:
    execute = Runner.execute
    hang_at = int(os.environ.get("HANG_AT_PASS", "0"))
    slow_s = float(os.environ.get("SLOW_PASS_S", "0"))
    slow_token_s = float(os.environ.get("SLOW_TOKEN_S", "0"))
    hang_file = Path(os.environ["HANG_FILE"]) if os.environ.get("HANG_FILE") else None
    pid = str(os.getpid())
    never = threading.Event()
    passes = 0

    def faulty_execute(self: Runner, plan: StepPlan) -> StepResult:
        nonlocal passes
        passes += 1
        if passes == hang_at or (hang_file is not None and _holds(hang_file, pid)):
            never.wait()  # for ever, asleep: the watchdog must notice
        if slow_s > 0 and passes > 1:
            time.sleep(slow_s)
        if slow_token_s > 0 and passes > 1:
            time.sleep(slow_token_s * sum(len(chunk.tokens) for chunk in plan.chunks))
        return execute(self, plan)

    Runner.execute = faulty_execute  # type: ignore[method-assign]


def _holds(path: Path, pid: str) -> bool:
    try:
        return path.read_text().strip() == pid
    except OSError:  # not there (yet)
        return False


if __name__ == "__main__":
    install()
    sys.exit(main())
