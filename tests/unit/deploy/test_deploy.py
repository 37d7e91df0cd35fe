"""deploy/: the Envoy configs validate with the real Envoy binary, and the Kubernetes manifests
parse and are wired together (ports, probes, the drain, the headless Service)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy.cluster import envoy_binary
from deploy.envoy import render
from deploy.gateway import CPU_LIVENESS_ARGS

ROOT = Path(__file__).resolve().parents[3]

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"


def manifests(name: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


def flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


@pytest.mark.parametrize(
    "cfg",
    [
        render.config([("127.0.0.1", 50061), ("127.0.0.1", 50062)], admin=("127.0.0.1", 0)),
        render.config([("127.0.0.1", 50061)], lb_policy="ROUND_ROBIN", admin=("127.0.0.1", 0)),
        render.config([("llama-grpc-replicas.default.svc.cluster.local", 50051)], dns=True),
    ],
    ids=["local-ring-hash", "local-round-robin", "k8s"],
)
def test_rendered_configs_validate_with_envoy(tmp_path: Path, cfg: dict[str, Any]) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render.render(cfg))
    done = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"configuration '{path}' OK" in done.stdout + done.stderr


def test_ring_hash_config_hashes_sessions_and_checks_health() -> None:
    cfg = render.config([("127.0.0.1", 1)])
    [cluster] = cfg["static_resources"]["clusters"]
    [route] = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"]  # fmt: skip
    headers = [p["header"]["header_name"] for p in route["route"]["hash_policy"]]
    assert headers == ["x-session-id", "x-cache-scope", "authorization"]
    assert route["route"]["timeout"] == "0s"  # long generations are not cut
    assert "reset" in route["route"]["retry_policy"]["retry_on"]
    [check] = cluster["health_checks"]
    assert check["no_traffic_interval"] == check["interval"] == "1s"
    assert check["grpc_health_check"]["service_name"] == "llama_grpc.v1.LlmService"
    balance = cluster["common_lb_config"]["consistent_hashing_lb_config"]
    assert balance["hash_balance_factor"] == render.HASH_BALANCE_FACTOR


def test_replica_deployment_wiring() -> None:
    got = manifests("llama-grpc.yaml")
    pod = got["Deployment"]["spec"]["template"]
    [container] = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert int(flag(args, "port")) == ports["grpc"]
    assert int(flag(args, "metrics-port")) == ports["metrics"]
    assert flag(args, "host") == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"], probe
    assert container["readinessProbe"]["grpc"]["service"] == "llama_grpc.v1.LlmService"
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(flag(args, "drain-delay-s")) + float(flag(args, "grace-s"))
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + drain
    service = got["Service"]
    assert service["spec"]["clusterIP"] == "None"  # headless: Envoy sees every replica
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == "grpc"


def test_envoy_deployment_wiring() -> None:
    got = manifests("envoy.yaml")
    pod = got["Deployment"]["spec"]["template"]
    [container] = pod["spec"]["containers"]
    config_path = container["args"][container["args"].index("-c") + 1]
    [mount] = container["volumeMounts"]
    assert Path(config_path).parent == Path(mount["mountPath"])
    [volume] = pod["spec"]["volumes"]
    assert volume["name"] == mount["name"] and volume["configMap"]["name"] == "envoy-config"
    grpc_port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
    listen = render.config([("x", 1)], listen=("0.0.0.0", 50051))["static_resources"][
        "listeners"][0]["address"]["socket_address"]["port_value"]  # fmt: skip
    assert grpc_port == listen
    service = got["Service"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    replicas = manifests("llama-grpc.yaml")["Service"]["metadata"]["name"]
    readme = (K8S / "README.md").read_text()
    assert re.search(rf"--k8s {replicas}\.default\.svc\.cluster\.local:50051", readme)


def test_smg_gateway_wiring() -> None:
    """smg.yaml: SMG's own argument parser accepts the container's arguments; it discovers the
    llama-grpc pods by their labels on their gRPC port, in its own namespace, with a service
    account whose Role may get/list/watch pods; cache_aware over the vLLM protocol; probes,
    metrics and the Service on the ports it listens on."""
    from smg.launch_router import parse_router_args

    got = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(
        (K8S / "smg.yaml").read_text()) if d}  # fmt: skip
    kinds = sorted(kind for kind, _ in got)
    assert kinds == ["Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]
    [deployment] = [d for (kind, _), d in got.items() if kind == "Deployment"]
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert container["command"] == ["smg"] and container["args"][0] == "launch"
    args = parse_router_args(container["args"][1:])
    assert (args.backend, args.policy, args.service_discovery) == ("vllm", "cache_aware", True)
    # the same wedge bound for CPU workers as `make gateway` (deploy/gateway.py says why)
    assert ["--worker-wedge-secs", str(args.worker_wedge_secs)] == list(CPU_LIVENESS_ARGS)
    replicas = manifests("llama-grpc.yaml")
    worker_pod = replicas["Deployment"]["spec"]["template"]
    assert args.selector.items() <= worker_pod["metadata"]["labels"].items()
    [worker] = worker_pod["spec"]["containers"]
    worker_ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert args.service_discovery_port == worker_ports["grpc"] == int(flag(worker["args"], "port"))
    [namespace] = [e for e in container["env"] if e["name"] == "POD_NAMESPACE"]
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert args.service_discovery_namespace == "$(POD_NAMESPACE)"  # a Role, not a ClusterRole
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.host, args.port, args.prometheus_port) == ("0.0.0.0", ports["http"],
                                                            ports["metrics"])  # fmt: skip
    assert args.health_check_port == ports["probes"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "probes"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "probes"}
    account = pod["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in got
    [binding] = [d for (kind, _), d in got.items() if kind == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = got[("Role", binding["roleRef"]["name"])]
    assert binding["roleRef"]["kind"] == "Role"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    [service] = [d for (kind, _), d in got.items() if kind == "Service"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


@pytest.mark.parametrize(
    ("ephemeral", "low", "high"), [("32768\t60999\n", 20480, 32768), ("1024\t65535\n", 1024, 65536)]
)
def test_free_ports_come_from_below_the_ephemeral_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ephemeral: str, low: int, high: int
) -> None:
    """Below the range where outgoing connections take their source ports; where the range
    starts at 1024 there is nothing below it, and the kernel picks."""
    from deploy import cluster

    path = tmp_path / "ip_local_port_range"
    path.write_text(ephemeral)
    monkeypatch.setattr(cluster, "_EPHEMERAL_RANGE", path)
    ports = [cluster.free_port() for _ in range(20)]
    assert all(low <= p < high for p in ports), ports


# a stand-in for `python -m llama_grpc_server --port N ...`: binds N (0: any) and logs the port
# as the server's JSON "listening" line, after a line that is not JSON
FAKE_SERVER = """
import json, socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
with socket.socket() as s:
    s.bind(("127.0.0.1", port))
    print("starting", flush=True)
    print(json.dumps({"event": "listening", "port": s.getsockname()[1]}), flush=True)
    time.sleep(60)
"""


def test_a_replica_on_port_0_reads_the_port_it_got_from_its_log(tmp_path: Path) -> None:
    """A replica started on port 0 learns its port from its own log lines (not an earlier
    process's in the same file); restarted, it asks for that port again."""
    from deploy.cluster import Replica, listening_port, terminate

    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    log = tmp_path / "replica.log"
    log.write_text('{"event": "listening", "port": 1}\n')  # an earlier process's
    replica = Replica(0, 0, (), log, module="fake_server", env=env)
    replica.start()
    try:
        port = replica.wait_listening(timeout_s=30)
        assert port > 1 and replica.target == f"127.0.0.1:{port}"
        assert replica.stop(timeout_s=10) is not None
        replica.start()
        assert replica.wait_listening(timeout_s=30) == port
        for _ in range(300):  # the restarted process's own line, with the same port
            if listening_port(log, replica.log_offset):
                break
            time.sleep(0.1)
        assert listening_port(log, replica.log_offset) == port
    finally:
        terminate(replica.proc)


def test_the_listening_port_is_read_from_whole_json_lines_only(tmp_path: Path) -> None:
    from deploy.cluster import listening_port

    log = tmp_path / "replica.log"
    log.write_text('starting\n{"event": "ready"}\n{"event": "listening", "port": 4')
    assert listening_port(log) == 0  # the line is still being written
    with log.open("a") as f:
        f.write("1234}\n")
    assert listening_port(log) == 41234


def test_a_replica_that_exits_before_listening_fails_its_wait(tmp_path: Path) -> None:
    from deploy.cluster import Replica

    (tmp_path / "exits.py").write_text("raise SystemExit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    replica = Replica(0, 0, (), tmp_path / "replica.log", module="exits", env=env)
    replica.start()
    with pytest.raises(RuntimeError, match="replica 0 exited"):
        replica.wait_serving(timeout_s=30)
