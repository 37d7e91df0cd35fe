"""deploy/: the Envoy configs validate with the real Envoy binary, and the Kubernetes manifests
parse and are wired together (ports, probes, the drain, the headless Service)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy.cluster import envoy_binary
from deploy.envoy import render
from deploy.gateway import CPU_LIVENESS_ARGS

ROOT = Path(__file__).resolve().parents[2]

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


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


def test_a_port_handed_out_is_not_handed_out_again_on_this_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """free_port() keeps the ports it handed out (for RESERVED_S) in a file every process on
    the machine shares: with a range of 8 ports, 8 calls (half of them in another process) get
    8 different ports, and a ninth finds none left below the ephemeral range, so the kernel
    picks. Once the reservations are older than RESERVED_S, the range is free again."""
    from deploy import cluster

    start = cluster._free_port_range()[0]
    reservations = tmp_path / "ports.json"
    monkeypatch.setattr(cluster, "_RESERVATIONS", reservations)
    monkeypatch.setattr(cluster, "_free_port_range", lambda: (start, start + 8))
    ours = [cluster.free_port() for _ in range(4)]
    script = (
        "import sys; from pathlib import Path; from deploy import cluster; "
        f"cluster._RESERVATIONS = Path({str(reservations)!r}); "
        f"cluster._free_port_range = lambda: ({start}, {start + 8}); "
        "print(*[cluster.free_port() for _ in range(4)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, cwd=ROOT
    )
    theirs = [int(p) for p in out.stdout.split()]
    taken = [*ours, *theirs]
    in_range = [p for p in taken if start <= p < start + 8]
    # a port of the 8 that something else on the machine holds is skipped, never repeated
    assert len(set(taken)) == 8 and len(in_range) == len(set(in_range)), taken
    assert cluster.free_port() not in in_range
    aged = {
        port: when - cluster.RESERVED_S
        for port, when in json.loads(reservations.read_text()).items()
    }
    reservations.write_text(json.dumps(aged))
    again = {cluster.free_port() for _ in range(4)}
    assert again & set(in_range), (again, in_range)


def test_an_unusable_reservations_file_leaves_the_random_pick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reservations path that cannot be opened (here a directory) or holds no JSON: free_port
    still hands out free ports below the ephemeral range."""
    from deploy import cluster

    monkeypatch.setattr(cluster, "_RESERVATIONS", tmp_path)
    first, end = cluster._free_port_range()
    assert first <= cluster.free_port() < end
    garbage = tmp_path / "ports.json"
    garbage.write_text("not json [")
    monkeypatch.setattr(cluster, "_RESERVATIONS", garbage)
    port = cluster.free_port()
    assert first <= port < end
    assert json.loads(garbage.read_text()).keys() == {str(port)}


def test_a_reservations_lock_held_elsewhere_does_not_hang_the_pick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another holder of the file's lock (here a second open file in this process, as a stopped
    process would hold it): free_port gives up on the lock after LOCK_WAIT_S and hands out a
    random free port without recording it; once the lock is free, it records again."""
    import fcntl

    from deploy import cluster

    reservations = tmp_path / "ports.json"
    monkeypatch.setattr(cluster, "_RESERVATIONS", reservations)
    monkeypatch.setattr(cluster, "LOCK_WAIT_S", 0.3)
    first, end = cluster._free_port_range()
    with reservations.open("a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        port = cluster.free_port()
    assert first <= port < end
    assert reservations.read_text() == ""
    assert str(cluster.free_port()) in json.loads(reservations.read_text())
