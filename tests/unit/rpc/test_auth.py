"""The tokens file, token lookup and who may call what (auth.py,
rpc/plumbing/access.py): pure logic."""

from __future__ import annotations

import hmac
from pathlib import Path

import pytest

from llama_grpc_server import auth, errors
from llama_grpc_server.auth import AuthFileError, Role, load_auth_file, token_digest
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.rpc.plumbing.access import AccessControl, bearer_token

USER_TOKEN = "user-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"
GENERATE = "/llama_grpc.v1.LlmService/Generate"
HEALTH = "/grpc.health.v1.Health/Check"

FILE = f"""
[tenants.team-a]
weight = 2
max_concurrent = 3
max_queued = 5

[[tokens]]
tenant = "team-a"
role = "user"
sha256 = "{token_digest(USER_TOKEN)}"

[[tokens]]
tenant = "ops"
role = "admin"
token = "{ADMIN_TOKEN}"

[[identities]]
subject = "spiffe://mesh/ns/b/sa/svc-b"
tenant = "team-b"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    return path


@pytest.fixture
def table(tmp_path: Path) -> auth.AuthTable:
    return load_auth_file(write(tmp_path, FILE))


def test_tokens_resolve_to_their_tenant_and_role(table: auth.AuthTable) -> None:
    """A hashed and a plaintext entry both match their token; a near miss matches nothing."""
    user = table.by_token(USER_TOKEN)
    admin = table.by_token(ADMIN_TOKEN)
    assert user is not None and (user.tenant, user.role) == ("team-a", Role.USER)
    assert admin is not None and (admin.tenant, admin.role) == ("ops", Role.ADMIN)
    assert table.by_token(USER_TOKEN[:-1]) is None
    assert table.by_token("") is None


def test_a_tenants_adapters_restrict_its_principals(tmp_path: Path) -> None:
    """`adapters` in a tenant's table: the LoRA adapters its callers may apply; others any."""
    text = FILE.replace("max_queued = 5\n", "max_queued = 5\nadapters = ['sql', 'chat']\n")
    table = load_auth_file(write(tmp_path, text))
    user, admin = table.by_token(USER_TOKEN), table.by_token(ADMIN_TOKEN)
    assert user is not None and user.adapters == frozenset({"sql", "chat"})
    assert admin is not None and admin.adapters is None
    assert table.limits["team-a"].adapters == ("sql", "chat")
    bad = "[tenants.a]\nadapters = 'sql'\n"
    with pytest.raises(AuthFileError, match=r"tenants\.a\.adapters: must be a list"):
        load_auth_file(write(tmp_path, bad))


def test_limits_and_tenants_come_from_the_file(table: auth.AuthTable) -> None:
    assert table.limits == {"team-a": TenantLimits(max_concurrent=3, max_queued=5, weight=2.0)}
    assert table.tenants == {"team-a", "ops", "team-b"}


def test_every_entry_is_compared_in_constant_time(
    table: auth.AuthTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By construction: the digest of the presented token is compared with hmac.compare_digest
    against every entry, also after a match, so timing says nothing about which one matched."""
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    table.by_token(USER_TOKEN)  # the first entry
    assert len(calls) == len(table.tokens)
    assert all(len(a) == len(b) == 32 for a, b in calls)  # digests, never the raw token


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[[tokens]]\ntenant = 'a'\n", "exactly one of token and sha256"),
        ("[[tokens]]\ntenant = 'a'\ntoken = 'short'\n", "tokens[0].token"),
        ("[[tokens]]\ntenant = 'a'\nsha256 = 'abc'\n", "tokens[0].sha256"),
        (f"[[tokens]]\ntenant = 'a b'\ntoken = '{USER_TOKEN}'\n", "tokens[0].tenant"),
        (f"[[tokens]]\ntenant = 'a'\nrole = 'root'\ntoken = '{USER_TOKEN}'\n", "tokens[0].role"),
        (f"[[tokens]]\ntenant = 'a'\ntoken = '{USER_TOKEN}'\nextra = 1\n", "tokens[0].extra"),
        (
            f"[[tokens]]\ntenant = 'a'\ntoken = '{USER_TOKEN}'\n"
            f"[[tokens]]\ntenant = 'b'\nsha256 = '{token_digest(USER_TOKEN)}'\n",
            "tokens[1]: the same token appears twice",
        ),
        ("[tenants.a]\nweight = 0\n", "tenants.a.weight"),
        ("[tenants.a]\nmax_queued = -1\n", "tenants.a.max_queued"),
        ("[tenants.a]\nburst = 1\n", "tenants.a.burst"),
        ("[[identities]]\ntenant = 'a'\n", "identities[0].subject"),
        ("[tenants.a]\n", "nobody could call"),
        ("users = 1\n", "unknown key 'users'"),
        ("[[tokens]\n", "invalid TOML"),
    ],
)
def test_a_bad_file_names_the_entry(tmp_path: Path, text: str, names: str) -> None:
    with pytest.raises(AuthFileError, match=r"tokens\.toml") as raised:
        load_auth_file(write(tmp_path, text))
    assert names in str(raised.value)


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(AuthFileError, match="No such file"):
        load_auth_file(tmp_path / "absent.toml")


def test_cache_scopes_of_two_tenants_never_collide() -> None:
    """Length-prefixed: no pair of (tenant, scope) maps onto another tenant's scope, and the
    anonymous scope is unchanged."""
    assert auth.scoped_cache_scope("", "s") == "s"
    assert auth.scoped_cache_scope("a", "b:c") != auth.scoped_cache_scope("a:b", "c")
    assert auth.scoped_cache_scope("a", "") != auth.scoped_cache_scope("b", "")
    assert auth.scoped_cache_scope("a", "") != "a"  # nor an anonymous scope named like it


# -- rpc.plumbing.access ---------------------------------------------------------------------------


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_bearer_token_parsing() -> None:
    assert bearer_token(bearer("abc")) == "abc"
    assert bearer_token([("authorization", "bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic Zm9v")]) == ""  # present, but no bearer
    assert bearer_token([("x-request-id", "r")]) is None


def test_without_a_file_everyone_may_call(table: auth.AuthTable) -> None:
    open_access = AccessControl()
    assert open_access.principal(GENERATE, None, None) is auth.ANONYMOUS
    cert = {"x509_common_name": [b"svc-c"]}
    caller = open_access.principal(GENERATE, None, cert)
    assert (caller.tenant, caller.is_admin) == ("svc-c", True)  # its own cache scope, though
    assert open_access.metric_label(caller) == ""  # subjects are unbounded: no label


def test_with_a_file_a_call_needs_a_known_credential(table: auth.AuthTable) -> None:
    access = AccessControl(table)
    with pytest.raises(errors.Unauthenticated, match="no credentials"):
        access.principal(GENERATE, [], None)
    with pytest.raises(errors.Unauthenticated, match="unknown bearer token"):
        access.principal(GENERATE, bearer("wrong-token-0123456789"), None)
    with pytest.raises(errors.Unauthenticated, match="unknown bearer token"):
        access.principal(GENERATE, [("authorization", "Basic Zm9v")], None)
    assert access.principal(GENERATE, bearer(USER_TOKEN), None).tenant == "team-a"
    stranger = {"peer_uri": [b"spiffe://mesh/ns/x/sa/other"]}
    with pytest.raises(errors.Unauthenticated, match="not in the tokens file"):
        access.principal(GENERATE, None, stranger)
    known = {"peer_uri": [b"spiffe://mesh/ns/b/sa/svc-b"], "x509_common_name": [b"cn"]}
    assert access.principal(GENERATE, None, known).tenant == "team-b"  # URI SAN over CN
    assert access.metric_label(access.principal(GENERATE, None, known)) == "team-b"


def test_health_and_reflection_stay_open(table: auth.AuthTable) -> None:
    access = AccessControl(table)
    assert access.principal(HEALTH, None, None) is auth.ANONYMOUS
    reflection = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    assert access.principal(reflection, None, None) is auth.ANONYMOUS


def test_admin_methods_need_the_admin_role(
    table: auth.AuthTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llama_grpc_server.rpc.plumbing import access as access_module

    monkeypatch.setattr(access_module, "ADMIN_METHODS", frozenset({GENERATE}))
    access = AccessControl(table)
    with pytest.raises(errors.PermissionDenied, match="needs the admin role"):
        access.principal(GENERATE, bearer(USER_TOKEN), None)
    assert access.principal(GENERATE, bearer(ADMIN_TOKEN), None).is_admin


@pytest.mark.parametrize(
    ("host", "is_loopback"),
    [("127.0.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("LocalHost", True), ("127.3.2.1", True), ("0.0.0.0", False), ("::", False),
     ("", False), ("10.0.0.5", False), ("myhost.internal", False)],
)  # fmt: skip
def test_plaintext_warning_applies_off_loopback(host: str, is_loopback: bool) -> None:
    """rpc.plumbing.server warns at start when plaintext listens anywhere but loopback, and refuses
    tokens there (auth.plaintext_tokens_problem) unless TLS or --allow-insecure-tokens."""
    assert auth.is_loopback(host) is is_loopback
    problem = auth.plaintext_tokens_problem(
        host, has_tls=False, has_tokens=True, allow_insecure=False
    )
    assert (problem is None) is is_loopback
    for has_tls, has_tokens, allow_insecure in ((True, True, False), (False, False, False),
                                                (False, True, True)):  # fmt: skip
        assert (
            auth.plaintext_tokens_problem(
                host, has_tls=has_tls, has_tokens=has_tokens, allow_insecure=allow_insecure
            )
            is None
        )


def test_the_vllm_engine_service_is_protected_and_flush_cache_is_admin_only(
    table: auth.AuthTable,
) -> None:
    """VllmEngine needs a known caller like LlmService; its FlushCache (ClearCache) needs the
    admin role, its Generate and Abort do not."""
    access = AccessControl(table)
    service = "/vllm.grpc.engine.VllmEngine/"
    with pytest.raises(errors.Unauthenticated, match="no credentials"):
        access.principal(service + "Generate", [], None)
    assert access.principal(service + "Generate", bearer(USER_TOKEN), None).tenant == "team-a"
    assert access.principal(service + "Abort", bearer(USER_TOKEN), None).tenant == "team-a"
    with pytest.raises(errors.PermissionDenied, match="FlushCache needs the admin role"):
        access.principal(service + "FlushCache", bearer(USER_TOKEN), None)
    assert access.principal(service + "FlushCache", bearer(ADMIN_TOKEN), None).is_admin
