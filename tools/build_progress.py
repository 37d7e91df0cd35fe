"""Run a long, quiet build command (`pip wheel -v` of llama-cpp-python) and show that it is alive.

    python tools/build_progress.py LOG -- COMMAND...

The command's whole output goes to LOG. On the terminal: each CMake/Ninja step as `[n/N] file`
(the object being compiled or the library being linked), and a line every TICK seconds
(default 30) while no step finishes (configure, a long compile, pip's own work). On failure, the
log's last lines and its path; the exit status is the command's.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import time

# `[12/142] /usr/bin/c++ ... -o path/ggml-cpu.c.o -c /src/.../ggml-cpu.c` (Ninja, verbose) or
# `[ 12%] Building CXX object ...` (Makefiles)
NINJA_STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(.*)$")
MAKE_STEP = re.compile(r"^\s*\[\s*(\d+)%\]\s+(.*)$")
SOURCE = re.compile(r"\s-c\s+(\S+)")
OUTPUT = re.compile(r"\s-o\s+(\S+)")
TAIL_LINES = 60
NAME_WIDTH = 100


def step_name(command: str) -> str:
    """What a verbose Ninja step works on: the source compiled, else the file written."""
    for pattern in (SOURCE, OUTPUT):
        found = pattern.search(command)
        if found:
            return os.path.basename(found.group(1))
    return command if len(command) <= NAME_WIDTH else command[: NAME_WIDTH - 3] + "..."


def summarize(line: str) -> str | None:
    """The terminal line for one output line, or None for a line only the log keeps."""
    ninja = NINJA_STEP.match(line)
    if ninja:
        done, total, what = ninja.groups()
        return f"[{done}/{total}] {step_name(what)}"
    make = MAKE_STEP.match(line)
    if make:
        return f"[{make.group(1)}%] {make.group(2)}"
    return None


def elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def main(argv: list[str]) -> int:
    log_path, separator, *command = [*argv, "", ""][:2] + argv[2:]
    if separator != "--" or not command:
        print(__doc__, file=sys.stderr)
        return 2
    tick = float(os.environ.get("TICK", "30"))
    start = time.monotonic()
    last_shown = [start]
    lock = threading.Lock()
    done = threading.Event()

    def say(text: str) -> None:
        with lock:
            print(f"  {elapsed(time.monotonic() - start)} {text}", flush=True)
            last_shown[0] = time.monotonic()

    def ticker() -> None:
        while not done.wait(5):
            if time.monotonic() - last_shown[0] >= tick:
                say("still building (configure, a long compile step or pip)...")

    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    say(f"building; the whole output goes to {log_path}")
    threading.Thread(target=ticker, daemon=True).start()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            tail.append(line)
            shown = summarize(line)
            if shown is not None:
                say(shown)
        returncode = process.wait()
    done.set()
    if returncode != 0:
        sys.stdout.write("".join(tail))
        say(f"FAILED (exit {returncode}); the whole output: {log_path}")
    else:
        say("done")
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
