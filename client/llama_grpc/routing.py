"""Routing with several replicas: the headers a proxy hashes on (x-session-id, x-cache-scope),
and, without a proxy, one channel balancing over all replicas (round_robin over the addresses of
a target list or a dns: name, skipping replicas whose LlmService health is not SERVING).

Plain functions; client.py adds their results to each call and to the channels it creates.
"""

from __future__ import annotations

import ipaddress
import json
import urllib.parse
from collections.abc import Sequence

from google.protobuf.message import Message

# A generation call's non-empty session_id / cache_scope, repeated as headers so that a proxy can
# hash on them without parsing the body.
SESSION_ID_KEY = "x-session-id"
CACHE_SCOPE_KEY = "x-cache-scope"

LLM_SERVICE_NAME = "llama_grpc.v1.LlmService"
SERVICE_CONFIG_OPTION = "grpc.service_config"
# gRPC's own round_robin over every address of the target, with client-side health checking: each
# connection watches grpc.health.v1 for LlmService and gets calls only while it is SERVING.
BALANCED_SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": LLM_SERVICE_NAME},
    }
)

_ROUTING_FIELDS = (("session_id", SESSION_ID_KEY), ("cache_scope", CACHE_SCOPE_KEY))
# Left as they are in a header value: printable ASCII but space and "%" (the escape character).
_HEADER_SAFE = "".join(chr(code) for code in range(0x21, 0x7F) if chr(code) != "%")


def routing_metadata(request: Message) -> tuple[tuple[str, str], ...]:
    """The `x-session-id` / `x-cache-scope` metadata of a request's non-empty session_id /
    cache_scope (none for a request without them). A header value must be printable ASCII, so
    other text is sent as its UTF-8, percent-encoded: the same value always gives the same
    header, and a call never fails for its session id."""
    fields = request.DESCRIPTOR.fields_by_name
    return tuple(
        (key, urllib.parse.quote(getattr(request, name), safe=_HEADER_SAFE))
        for name, key in _ROUTING_FIELDS
        if name in fields and getattr(request, name)
    )


def balanced_target(addresses: Sequence[str]) -> str:
    """The gRPC target URI of a list of IP:PORT addresses: `ipv4:10.0.0.1:50051,10.0.0.2:50051`
    (or `ipv6:[fd00::1]:50051,...`). A host name raises ValueError: it would need resolving, which
    a `dns:///name:port` target does (balanced too with balance=True)."""
    if isinstance(addresses, str):
        raise TypeError("addresses must be a list of IP:PORT strings, not one string")
    if not addresses:
        raise ValueError("the list of targets is empty")
    families = {_family(address) for address in addresses}
    if len(families) > 1:
        raise ValueError(
            "a list of targets must be all IPv4 or all IPv6 addresses (one ipv4: or ipv6: "
            "target); for a name with both kinds use a dns:///name:port target and balance=True"
        )
    return f"{families.pop()}:{','.join(addresses)}"


def _family(address: str) -> str:
    """The family of an IP:PORT address ([ADDRESS]:PORT for IPv6): "ipv4" or "ipv6"."""
    host, _, port = address.rpartition(":")
    if (
        "/" in address
        or not host
        or not (port.isascii() and port.isdigit())
        or not 0 < int(port) < 2**16
    ):
        raise ValueError(
            f"{address!r} is not IP:PORT: a list of targets takes IP:PORT addresses only "
            "(a target URI such as dns:///name:port goes alone, as the target itself)"
        )
    is_bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if is_bracketed else host)
    except ValueError:
        raise ValueError(
            f"{address!r} names a host, not an IP address: a list of targets is not resolved; "
            f"for the replicas a name resolves to, pass target='dns:///{address}' with "
            "balance=True"
        ) from None
    if isinstance(ip, ipaddress.IPv6Address) != is_bracketed:
        raise ValueError(f"{address!r}: write IPv6 addresses (only) as [ADDRESS]:PORT")
    return f"ipv{ip.version}"
