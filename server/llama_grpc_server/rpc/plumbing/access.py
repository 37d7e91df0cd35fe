"""Who may call what: each RPC's Principal from its bearer token or its client certificate, and
the role an operation needs. Health and reflection stay open (orchestrators and grpcurl probe
them); everything of LlmService and VllmEngine needs a known caller once --auth-tokens-file
is given.

Without a tokens file nobody is refused: a caller is ANONYMOUS (tenant "", may do everything),
or, with --tls-client-ca, the tenant named by its certificate subject, so that services of a
mesh still get separate caches."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llama_grpc_server import errors
from llama_grpc_server.auth import ANONYMOUS, AuthTable, Principal, Role
from llama_grpc_server.rpc.plumbing.tls import peer_subject

AUTHORIZATION_KEY = "authorization"
BEARER = "bearer "
PROTECTED_SERVICE = "/llama_grpc.v1.LlmService/"
VLLM_SERVICE = "/vllm.grpc.engine.VllmEngine/"  # the vLLM engine protocol (rpc.vllm.engine)
PROTECTED_SERVICES = (PROTECTED_SERVICE, VLLM_SERVICE)
# Operations only an admin may call (full path). GetStats is open to users, with other tenants'
# request ids hidden (rpc.v1.servicer); so is WatchLoad, which carries aggregate load only. A user's
# request for a model that is not loaded loads it (on demand); managing models is an admin's.
# The vLLM protocol's FlushCache is ClearCache; its Abort reaches the caller's own calls only.
ADMIN_METHODS: frozenset[str] = frozenset(
    PROTECTED_SERVICE + name
    for name in (
        "ClearCache",
        "ListModels",
        "LoadModel",
        "UnloadModel",
        "LoadAdapter",
        "UnloadAdapter",
    )
) | {VLLM_SERVICE + "FlushCache"}


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` header; None when there is none."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY and isinstance(value, str):
            if value[: len(BEARER)].lower() == BEARER:
                return value[len(BEARER) :].strip()
            return ""  # present but not a bearer token: as bad as a wrong one
    return None


class AccessControl:
    """Answers who is calling. `table` is replaced whole on reload (SIGHUP), so a call sees
    one version of the file."""

    def __init__(self, table: AuthTable | None = None) -> None:
        self.table = table

    def principal(
        self,
        method: str,
        metadata: Sequence[tuple[str, Any]] | None,
        auth_context: Mapping[str, Iterable[bytes]] | None,
    ) -> Principal:
        """The caller of `method`, or Unauthenticated / PermissionDenied."""
        if not method.startswith(PROTECTED_SERVICES):
            return ANONYMOUS
        subject = peer_subject(auth_context)
        table = self.table
        if table is None:
            return Principal(subject, Role.ADMIN, "certificate") if subject else ANONYMOUS
        found = self._authenticate(table, bearer_token(metadata), subject)
        if method in ADMIN_METHODS and not found.is_admin:
            raise errors.PermissionDenied(
                f"{method.rsplit('/', 1)[-1]} needs the admin role; tenant {found.tenant!r} "
                "is a user",
                metadata={"tenant": found.tenant, "role": found.role.value},
            )
        return found

    def metric_label(self, principal: Principal) -> str:
        """The tenant as a metric label: only the tokens file's tenants (bounded cardinality),
        "" for anyone else (anonymous callers, certificate subjects without a file)."""
        table = self.table
        return principal.tenant if table is not None and principal.tenant in table.tenants else ""

    @staticmethod
    def _authenticate(table: AuthTable, token: str | None, subject: str) -> Principal:
        if token is not None:
            found = table.by_token(token)
            if found is None:
                raise errors.Unauthenticated(
                    "unknown bearer token", metadata={"credential": "token"}
                )
            return found
        if subject:
            found = table.by_subject(subject)
            if found is None:
                raise errors.Unauthenticated(
                    f"client certificate subject {subject!r} is not in the tokens file",
                    metadata={"credential": "certificate"},
                )
            return found
        raise errors.Unauthenticated(
            "no credentials: send 'authorization: Bearer <token>' metadata",
            metadata={"credential": "none"},
        )
