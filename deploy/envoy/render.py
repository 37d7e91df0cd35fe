"""Envoy in front of N llama-grpc replicas: one config, rendered for local replicas (STATIC
endpoints on 127.0.0.1, `make cluster`) or for Kubernetes (STRICT_DNS on a headless Service,
deploy/k8s/envoy-config.yaml).

Routing, and why:
- Consistent hashing (RING_HASH) on `x-session-id`, else `x-cache-scope`, else the caller's
  `authorization` header (its tenant's token): a conversation keeps landing on the replica that
  holds its KV, which is the only way prefix caching pays across replicas. The client library
  sends session_id / cache_scope as those headers, so Envoy never parses a body.
- Bounded load (`hash_balance_factor` 250): no replica takes more than 2.5x the average number
  of outstanding requests; a hot key spills to the next replica on the ring instead of queueing.
- Active grpc.health.v1 checks every second, also with no traffic (Envoy's default
  `no_traffic_interval` is 60 s: a dead replica would stay hidden for a minute), and outlier
  detection on consecutive gateway errors / 5xx (gRPC UNAVAILABLE maps to 503).
- Retries only before any response byte (connection failures, refused and reset streams: a
  draining or dead replica), on another replica; Envoy never retries once it has forwarded
  response headers, and llama-grpc sends its headers (x-request-id) when a call starts, so a
  stream that has emitted tokens is never replayed.
- No route timeout: the caller's grpc-timeout is the deadline, so long generations are not cut;
  an idle timeout of 10 minutes between frames ends only dead streams.

    python -m deploy.envoy.render --replicas 127.0.0.1:50061,127.0.0.1:50062 > envoy.yaml
    python -m deploy.envoy.render --k8s llama-grpc-replicas.default.svc.cluster.local:50051
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import yaml

SERVICE = "llama_grpc.v1.LlmService"
CLUSTER = "llama_grpc"
HASH_HEADERS = ("x-session-id", "x-cache-scope", "authorization")
HEALTH_INTERVAL_S = 1
# Bounded load: a host keeps its keys while its outstanding requests stay within
# ceil(ceil((all outstanding + 1) x factor / 100) / hosts) (Envoy's BoundedLoadHashingLoadBalancer,
# the request being routed included). The average moves with every arrival, so a low factor
# spills ordinary sessions: with 3 replicas a host whose own sessions are the only traffic at
# that moment spills its 4th at 150 % (Envoy's example), its 6th at 200 %, and 12 chatting
# sessions spilled a turn (which then finds no cache) in most runs here. At 250 % it spills
# only past 11 outstanding requests of its own: one hot session sending 20 requests at once
# spreads from the 12th on; at 275 % it would never spill below 24. Revisit with more replicas.
HASH_BALANCE_FACTOR = 250
STREAM_IDLE_TIMEOUT = "600s"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {target!r}")
    return host.strip("[]"), int(port)


def route(lb_policy: str) -> dict[str, Any]:
    """Everything (LlmService, health, reflection) goes to the replicas."""
    action: dict[str, Any] = {
        "cluster": CLUSTER,
        "timeout": "0s",  # no route timeout: streams last as long as their generation
        "max_stream_duration": {"grpc_timeout_header_max": "0s"},  # honour grpc-timeout
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset,unavailable",
            "num_retries": 2,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host."
                        "previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 5,
            "retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"},
        },
    }
    if lb_policy == "RING_HASH":
        action["hash_policy"] = [
            {"header": {"header_name": name}, "terminal": True} for name in HASH_HEADERS
        ]
    return {"match": {"prefix": "/"}, "route": action}


def config(
    endpoints: Sequence[tuple[str, int]],
    *,
    listen: tuple[str, int] = ("127.0.0.1", 50051),
    admin: tuple[str, int] = ("127.0.0.1", 9901),
    lb_policy: str = "RING_HASH",
    dns: bool = False,
    hash_balance_factor: int = HASH_BALANCE_FACTOR,
) -> dict[str, Any]:
    """The Envoy bootstrap as a dict. `dns`: endpoints are names resolved to every replica's
    address (a Kubernetes headless Service), else addresses."""
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "llama_grpc",
        "codec_type": "AUTO",
        "stream_idle_timeout": STREAM_IDLE_TIMEOUT,
        "request_timeout": "0s",
        "route_config": {
            "name": "llama_grpc",
            "virtual_hosts": [
                {"name": "llama_grpc", "domains": ["*"], "routes": [route(lb_policy)]}
            ],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    cluster: dict[str, Any] = {
        "name": CLUSTER,
        "type": "STRICT_DNS" if dns else "STATIC",
        "connect_timeout": "1s",
        "lb_policy": lb_policy,
        "common_lb_config": {
            # Never send to a replica the health check calls unhealthy, even when few are left
            # (Envoy's default panic threshold routes to all of them below 50 % healthy).
            "healthy_panic_threshold": {"value": 0.0},
        },
        "typed_extension_protocol_options": {
            HTTP_OPTIONS: {
                "@type": "type.googleapis.com/" + HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": CLUSTER,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in endpoints]}
            ],
        },
        "health_checks": [
            {
                "timeout": "1s",
                "interval": f"{HEALTH_INTERVAL_S}s",
                "no_traffic_interval": f"{HEALTH_INTERVAL_S}s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": SERVICE},
            }
        ],
        "outlier_detection": {
            "consecutive_5xx": 3,
            "consecutive_gateway_failure": 2,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 50,
        },
    }
    if lb_policy == "RING_HASH":
        cluster["ring_hash_lb_config"] = {"minimum_ring_size": 1024}
        cluster["common_lb_config"]["consistent_hashing_lb_config"] = {
            "hash_balance_factor": hash_balance_factor
        }
    if dns:
        cluster["dns_refresh_rate"] = "5s"
        cluster["respect_dns_ttl"] = False
    return {
        "admin": {"address": _address(*admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "llama_grpc",
                    "address": _address(*listen),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [cluster],
        },
    }


def render(cfg: dict[str, Any]) -> str:
    return yaml.safe_dump(cfg, sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--replicas", help="HOST:PORT,HOST:PORT,... of the replicas")
    where.add_argument("--k8s", metavar="NAME:PORT", help="headless Service resolving to replicas")
    parser.add_argument("--listen", default="0.0.0.0:50051")
    parser.add_argument("--admin", default="127.0.0.1:9901")
    parser.add_argument("--lb-policy", default="RING_HASH", choices=("RING_HASH", "ROUND_ROBIN"))
    args = parser.parse_args(argv)
    targets = [args.k8s] if args.k8s else args.replicas.split(",")
    cfg = config(
        [_split(t) for t in targets],
        listen=_split(args.listen),
        admin=_split(args.admin),
        lb_policy=args.lb_policy,
        dns=bool(args.k8s),
    )
    sys.stdout.write(render(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
