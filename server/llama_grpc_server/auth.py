"""Who is calling: the --auth-tokens-file (bearer tokens and mTLS subjects, each bound to a tenant
and a role, plus per-tenant limits), token lookup in constant time, and the tenant's cache scope.
Pure Python: no grpc (rpc.plumbing.interceptors asks, rpc.plumbing.tls supplies certificate
subjects).

The file is TOML:

    [tenants.team-a]             # optional: limits and share under contention
    weight = 2.0                 # share of slots when tenants contend (default 1)
    max_concurrent = 4           # requests in slots at once (0 = no limit)
    max_queued = 16              # requests waiting (0 = no limit)
    adapters = ["team-a-sql"]    # the LoRA adapters its requests may apply (default: any)

    [[tokens]]
    tenant = "team-a"
    role = "user"                # or "admin"
    sha256 = "<64 hex digits>"   # sha256 of the token (preferred), or: token = "<the token>"

    [[identities]]               # with --tls-client-ca: a certificate subject (URI SAN such as
    subject = "spiffe://mesh/ns/a/sa/svc"  # a SPIFFE id, else the CN) bound to a tenant
    tenant = "team-a"
    role = "user"
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import ipaddress
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llama_grpc_server.core.scheduling.tenants import TenantLimits

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MIN_TOKEN_CHARS = 16  # a plaintext token shorter than this is guessable
_TOP_KEYS = frozenset({"tenants", "tokens", "identities"})
_LIMIT_KEYS = {"max_concurrent": int, "max_queued": int, "weight": float, "adapters": list}


class AuthFileError(Exception):
    """The tokens file cannot be used; the message names the file and the entry."""


class Role(enum.Enum):
    USER = "user"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one RPC. `tenant` "" is the anonymous caller of a server without
    authentication, which may do everything."""

    tenant: str
    role: Role
    via: str  # "token", "certificate" or "none": for the access log
    # The LoRA adapters its requests may apply (its tenant's `adapters`); None: any.
    adapters: frozenset[str] | None = None

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN


ANONYMOUS = Principal("", Role.ADMIN, "none")


@dataclass(frozen=True, slots=True)
class AuthTable:
    """A parsed tokens file. Tokens are kept only as sha256 digests."""

    tokens: tuple[tuple[bytes, Principal], ...] = ()
    identities: Mapping[str, Principal] = field(default_factory=dict)
    limits: Mapping[str, TenantLimits] = field(default_factory=dict)

    @property
    def tenants(self) -> frozenset[str]:
        """Every tenant the file names: the bounded set of metric labels."""
        named = {p.tenant for _, p in self.tokens} | {p.tenant for p in self.identities.values()}
        return frozenset(named | set(self.limits))

    def by_token(self, token: str) -> Principal | None:
        """The token's principal. Every entry is compared, each in constant time, so the time
        taken says nothing about which entry (or how much of one) matched."""
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found: Principal | None = None
        for expected, principal in self.tokens:
            if hmac.compare_digest(expected, digest):
                found = principal
        return found

    def by_subject(self, subject: str) -> Principal | None:
        return self.identities.get(subject)


def scoped_cache_scope(tenant: str, cache_scope: str) -> str:
    """The cache scope a tenant's request really uses: prefixed by the tenant (length-prefixed,
    so no choice of names can make two tenants' scopes equal). Anonymous scopes are unchanged."""
    return f"{len(tenant)}:{tenant}:{cache_scope}" if tenant else cache_scope


def token_digest(token: str) -> str:
    """The sha256 hex a tokens file may hold instead of the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def load_auth_file(path: Path) -> AuthTable:
    """Parse and check the whole file; AuthFileError names the file and the bad entry."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AuthFileError(f"{path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise AuthFileError(f"{path}: invalid TOML: {exc}") from None
    try:
        return _table(data)
    except ValueError as exc:
        raise AuthFileError(f"{path}: {exc}") from None


def _table(data: Mapping[str, Any]) -> AuthTable:
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ValueError(
            f"unknown key {sorted(unknown)[0]!r} (expected tenants, tokens, identities)"
        )
    limits = {name: _limits(name, raw) for name, raw in _table_of(data, "tenants").items()}
    tokens: list[tuple[bytes, Principal]] = []
    seen: set[bytes] = set()
    for index, entry in enumerate(_array_of(data, "tokens")):
        where = f"tokens[{index}]"
        digest = _digest(entry, where)
        if digest in seen:
            raise ValueError(f"{where}: the same token appears twice")
        seen.add(digest)
        tokens.append((digest, _principal(entry, where, {"token", "sha256"}, "token")))
    identities: dict[str, Principal] = {}
    for index, entry in enumerate(_array_of(data, "identities")):
        where = f"identities[{index}]"
        subject = entry.get("subject")
        if not isinstance(subject, str) or not subject:
            raise ValueError(f"{where}.subject: must be a non-empty string")
        if subject in identities:
            raise ValueError(f"{where}.subject: {subject!r} appears twice")
        identities[subject] = _principal(entry, where, {"subject"}, "certificate")
    if not tokens and not identities:
        raise ValueError("no [[tokens]] and no [[identities]]: nobody could call the server")

    def restricted(principal: Principal) -> Principal:
        allowed = limits.get(principal.tenant, TenantLimits()).adapters
        if allowed is None:
            return principal
        return dataclasses.replace(principal, adapters=frozenset(allowed))

    return AuthTable(
        tuple((digest, restricted(p)) for digest, p in tokens),
        {subject: restricted(p) for subject, p in identities.items()},
        limits,
    )


def _table_of(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{key}: must be a table ([{key}.NAME])")
    return value


def _array_of(data: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"{key}: must be an array of tables ([[{key}]])")
    return value


def _tenant_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ValueError(
            f"{where}: tenant name {name!r} must be 1-128 characters of letters, digits and "
            "._:/@- (starting with a letter or digit)"
        )
    return name


def _limits(name: str, raw: object) -> TenantLimits:
    where = f"tenants.{name}"
    _tenant_name(name, where)
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a table")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        kind = _LIMIT_KEYS.get(key)
        if kind is None:
            raise ValueError(f"{where}.{key}: unknown (expected {', '.join(_LIMIT_KEYS)})")
        if kind is list:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{where}.{key}: must be a list of adapter names")
            values[key] = tuple(value)
            continue
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not is_number or (kind is int and not isinstance(value, int)) or value < 0:
            raise ValueError(f"{where}.{key}: must be a non-negative {kind.__name__}")
        values[key] = kind(value)
    if values.get("weight", 1.0) <= 0:
        raise ValueError(f"{where}.weight: must be > 0")
    return TenantLimits(**values)


def _digest(entry: Mapping[str, Any], where: str) -> bytes:
    token, hexdigest = entry.get("token"), entry.get("sha256")
    if (token is None) == (hexdigest is None):
        raise ValueError(f"{where}: give exactly one of token and sha256")
    if token is not None:
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"{where}.token: must be a string of at least {MIN_TOKEN_CHARS} characters"
            )
        return hashlib.sha256(token.encode()).digest()
    if not isinstance(hexdigest, str) or not SHA256_HEX.fullmatch(hexdigest.lower()):
        raise ValueError(f"{where}.sha256: must be 64 hex digits (sha256 of the token)")
    return bytes.fromhex(hexdigest)


def _principal(entry: Mapping[str, Any], where: str, own: set[str], via: str) -> Principal:
    unknown = set(entry) - own - {"tenant", "role"}
    if unknown:
        raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown key")
    tenant = _tenant_name(entry.get("tenant"), f"{where}.tenant")
    role = entry.get("role", Role.USER.value)
    if role not in {r.value for r in Role}:
        raise ValueError(f"{where}.role: {role!r} must be user or admin")
    return Principal(tenant, Role(role), via)


def is_loopback(host: str) -> bool:
    """Whether listening on `host` keeps the port on this machine: localhost, 127.0.0.0/8, ::1.
    Any other name or address (0.0.0.0, ::, a hostname) may be reached from the network."""
    name = host.strip().removeprefix("[").removesuffix("]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def plaintext_tokens_problem(
    host: str, *, has_tls: bool, has_tokens: bool, allow_insecure: bool
) -> str | None:
    """Why a listener must not start: bearer tokens checked on a plaintext (no TLS) port that
    the network reaches would be read by anyone on the path. None when that is not the case,
    or when the operator said so with --allow-insecure-tokens (a TLS-terminating proxy in front
    on a private network, for instance)."""
    if not has_tokens or has_tls or allow_insecure or is_loopback(host):
        return None
    return (
        f"--auth-tokens-file on a plaintext listener at --host={host}: bearer tokens would "
        "travel in clear over the network, where anyone on the path can read and replay them. "
        "Serve TLS (--tls-cert/--tls-key), listen on a loopback address (127.0.0.1, ::1, "
        "localhost), or pass --allow-insecure-tokens if TLS ends in front of this port"
    )
