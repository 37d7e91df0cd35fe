"""Client and CLI over TLS, mTLS and bearer tokens, against small real grpc servers on 127.0.0.1:0
with certificates made by openssl (tests/support/certs.py). The servers answer Tokenize,
GetModelInfo
and GetStats (the "admin" call) with canned replies and record what each call carried."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

import llama_grpc
from llama_grpc import (
    AsyncClient,
    Client,
    LlamaGrpcError,
    PermissionDeniedError,
    TlsConfig,
    UnauthenticatedError,
    UnavailableError,
    cli,
)
from llama_grpc.v1 import llm_service_pb2 as pb
from tests.support.certs import Pki, make_pki, openssl_available

SERVICE_NAME = "llama_grpc.v1.LlmService"
MODEL_NAME = "tls-test-model"
TOKENS = {"user-token": "user", "admin-token": "admin"}
TIMEOUT = 10.0  # a hang shows as DEADLINE_EXCEEDED, never as the UNAVAILABLE some tests expect


class Recorder:
    """The canned LlmService: records each call's metadata and the client's TLS identity; with
    `tokens` it wants `authorization: Bearer <token>` and an "admin" token for GetStats."""

    def __init__(self, tokens: Mapping[str, str] | None = None) -> None:
        self.tokens = tokens
        self.metadata: list[tuple[str, str]] = []
        self.peer_identities: list[bytes] | None = None

    def _enter(self, context: grpc.ServicerContext, admin: bool = False) -> None:
        self.metadata = [(key, value) for key, value in context.invocation_metadata()]
        self.peer_identities = context.peer_identities()  # type: ignore[assignment]
        if self.tokens is None:
            return
        bearer = dict(self.metadata).get("authorization", "")
        role = self.tokens.get(bearer.removeprefix("Bearer ")) if bearer[:7] == "Bearer " else None
        if role is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
        if admin and role != "admin":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "GetStats needs an admin token")

    def tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> Any:
        self._enter(context)
        return pb.TokenizeResponse(token_ids=[ord(c) for c in request.text])

    def model_info(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> Any:
        self._enter(context)
        return pb.GetModelInfoResponse(model_name=MODEL_NAME, n_ctx=128)

    def stats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> Any:
        self._enter(context, admin=True)
        return pb.GetStatsResponse(n_parallel=3)

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(method: Any, request: Any, response: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                method,
                request_deserializer=request.FromString,
                response_serializer=response.SerializeToString,
            )

        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Tokenize": unary(self.tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
                "GetModelInfo": unary(
                    self.model_info, pb.GetModelInfoRequest, pb.GetModelInfoResponse
                ),
                "GetStats": unary(self.stats, pb.GetStatsRequest, pb.GetStatsResponse),
            },
        )


Served = tuple[str, Recorder]


@contextmanager
def _serve(
    credentials: grpc.ServerCredentials | None, tokens: Mapping[str, str] | None = None
) -> Iterator[Served]:
    recorder = Recorder(tokens)
    server = grpc.server(ThreadPoolExecutor(max_workers=2), handlers=[recorder.handler()])
    address = "127.0.0.1:0"
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    server.start()
    try:
        yield f"127.0.0.1:{port}", recorder
    finally:
        server.stop(None)


def _server_credentials(pki: Pki, client_ca: Path | None = None) -> grpc.ServerCredentials:
    pair = (pki.server_key.read_bytes(), pki.server_cert.read_bytes())
    if client_ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca.read_bytes(), require_client_auth=True
    )


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA with a server certificate (localhost, 127.0.0.1) and a client certificate."""
    if not openssl_available():
        pytest.skip("needs the openssl command line tool")
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def other_pki(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Pki:
    """An unrelated CA and its certificates: trusted by nothing the `pki` servers trust."""
    return make_pki(tmp_path_factory.mktemp("other-pki"), name="stranger")


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[Served]:
    """A TLS server (no client certificate asked), tokens checked."""
    with _serve(_server_credentials(pki), TOKENS) as served:
        yield served


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[Served]:
    """A TLS server that requires a client certificate signed by the `pki` CA."""
    with _serve(_server_credentials(pki, client_ca=pki.ca_cert)) as served:
        yield served


@pytest.fixture(scope="module")
def plain_server() -> Iterator[Served]:
    """A plaintext server that checks bearer tokens (GetStats needs the admin one)."""
    with _serve(None, TOKENS) as served:
        yield served


def _bearer(recorder: Recorder) -> list[str]:
    return [value for key, value in recorder.metadata if key == "authorization"]


# --- TLS -----------------------------------------------------------------------------------------


def test_client_trusting_the_ca_talks_tls(tls_server: Served, pki: Pki) -> None:
    """TlsConfig(ca=...) verifies the server certificate against that CA and calls go through."""
    target, recorder = tls_server
    with Client(target, tls=TlsConfig(ca=pki.ca_cert), token="user-token", timeout=TIMEOUT) as c:
        assert c.model_info().model_name == MODEL_NAME
        assert c.tokenize("hi") == [104, 105]
    assert recorder.peer_identities is None  # no client certificate was asked for or sent


async def test_async_client_trusting_the_ca_talks_tls(tls_server: Served, pki: Pki) -> None:
    """The same over grpc.aio, with the CA given as a str path."""
    target, _ = tls_server
    tls = TlsConfig(ca=str(pki.ca_cert))
    async with AsyncClient(target, tls=tls, token="user-token", timeout=TIMEOUT) as client:
        assert (await client.model_info()).model_name == MODEL_NAME


@pytest.mark.parametrize(
    ("tls", "says"),
    [
        pytest.param(True, "CERTIFICATE_VERIFY_FAILED", id="system-roots"),
        pytest.param(TlsConfig(), "CERTIFICATE_VERIFY_FAILED", id="empty-config-system-roots"),
        pytest.param("other-ca", "CERTIFICATE_VERIFY_FAILED", id="another-ca"),
        pytest.param(False, "", id="plaintext"),
    ],
)
def test_untrusted_server_certificate_fails_unavailable(
    tls_server: Served, other_pki: Pki, tls: bool | TlsConfig | str, says: str
) -> None:
    """Without the server's CA (system roots, another CA) or without TLS, calls fail at once
    with UnavailableError, not a hang or an untyped grpc error; a certificate that cannot be
    verified is named as such in the message."""
    target, _ = tls_server
    config = TlsConfig(ca=other_pki.ca_cert) if tls == "other-ca" else tls
    assert not isinstance(config, str)
    with (
        Client(target, tls=config, token="user-token", timeout=TIMEOUT) as client,
        pytest.raises(UnavailableError) as caught,
    ):
        client.model_info()
    assert caught.value.code == "UNAVAILABLE"
    assert says in caught.value.message


async def test_async_untrusted_server_certificate_fails_unavailable(tls_server: Served) -> None:
    """The async client fails the same way against a certificate it cannot verify."""
    target, _ = tls_server
    async with AsyncClient(target, tls=True, timeout=TIMEOUT) as client:
        with pytest.raises(UnavailableError):
            await client.model_info()


def test_tls_client_against_a_plaintext_server_fails_unavailable(plain_server: Served) -> None:
    """tls=True really speaks TLS: a plaintext server cannot answer it."""
    target, _ = plain_server
    with Client(target, tls=True, timeout=TIMEOUT) as client, pytest.raises(UnavailableError):
        client.tokenize("x")


def test_server_name_replaces_the_target_host_in_the_check(tls_server: Served, pki: Pki) -> None:
    """server_name is the name the certificate must carry: "localhost" passes while dialing
    127.0.0.1, a name the certificate lacks fails."""
    target, _ = tls_server
    good = TlsConfig(ca=pki.ca_cert, server_name="localhost")
    with Client(target, tls=good, token="user-token", timeout=TIMEOUT) as client:
        assert client.model_info().model_name == MODEL_NAME
    bad = TlsConfig(ca=pki.ca_cert, server_name="elsewhere.example")
    with (
        Client(target, tls=bad, token="user-token", timeout=TIMEOUT) as client,
        pytest.raises(UnavailableError),
    ):
        client.model_info()


# --- mTLS ----------------------------------------------------------------------------------------


def test_mtls_server_accepts_a_client_certificate_from_its_ca(
    mtls_server: Served, pki: Pki
) -> None:
    """With cert + key the handshake succeeds and the server sees the client's identity."""
    target, recorder = mtls_server
    tls = TlsConfig(ca=pki.ca_cert, cert=pki.client_cert, key=pki.client_key)
    with Client(target, tls=tls, timeout=TIMEOUT) as client:
        assert client.tokenize("a") == [97]
    assert recorder.peer_identities == [pki.client_identity.encode()]


async def test_async_mtls_server_accepts_a_client_certificate(
    mtls_server: Served, pki: Pki
) -> None:
    """The async client presents its certificate too."""
    target, recorder = mtls_server
    recorder.peer_identities = None
    tls = TlsConfig(ca=pki.ca_cert, cert=pki.client_cert, key=pki.client_key)
    async with AsyncClient(target, tls=tls, timeout=TIMEOUT) as client:
        assert await client.tokenize("a") == [97]
    assert recorder.peer_identities == [pki.client_identity.encode()]


@pytest.mark.parametrize("credential", ["none", "other-ca"])
def test_mtls_server_rejects_a_client_without_a_trusted_certificate(
    mtls_server: Served, pki: Pki, other_pki: Pki, credential: str
) -> None:
    """No client certificate, or one from another CA: the handshake fails, UnavailableError."""
    target, _ = mtls_server
    if credential == "none":
        tls = TlsConfig(ca=pki.ca_cert)
    else:
        tls = TlsConfig(ca=pki.ca_cert, cert=other_pki.client_cert, key=other_pki.client_key)
    with Client(target, tls=tls, timeout=TIMEOUT) as client, pytest.raises(UnavailableError):
        client.tokenize("a")


# --- tokens --------------------------------------------------------------------------------------


def test_token_travels_as_bearer_metadata_with_the_other_metadata(
    tls_server: Served, pki: Pki
) -> None:
    """token= adds `authorization: Bearer <token>` once, beside client and per-call metadata."""
    target, recorder = tls_server
    tls = TlsConfig(ca=pki.ca_cert)
    with Client(target, tls=tls, token="user-token", metadata={"x-tenant": "t1"}) as client:
        client.tokenize("x", metadata=[("x-call", "c1")])
    assert _bearer(recorder) == ["Bearer user-token"]
    assert ("x-tenant", "t1") in recorder.metadata
    assert ("x-call", "c1") in recorder.metadata


async def test_async_token_travels_as_bearer_metadata(tls_server: Served, pki: Pki) -> None:
    """The async client sends the same header, with per-call metadata alongside."""
    target, recorder = tls_server
    tls = TlsConfig(ca=pki.ca_cert)
    async with AsyncClient(target, tls=tls, token="admin-token") as client:
        assert (await client.stats(metadata={"x-call": "c2"})).n_parallel == 3
    assert _bearer(recorder) == ["Bearer admin-token"]
    assert ("x-call", "c2") in recorder.metadata


def test_token_over_plaintext_to_loopback_is_allowed(plain_server: Served) -> None:
    """A token needs no TLS (documented risk off loopback): it is sent as is."""
    target, recorder = plain_server
    with Client(target, token="admin-token", timeout=TIMEOUT) as client:
        assert client.stats().n_parallel == 3
    assert _bearer(recorder) == ["Bearer admin-token"]


def test_no_token_sends_no_authorization(mtls_server: Served, pki: Pki) -> None:
    """Without token= no authorization header is added."""
    target, recorder = mtls_server
    tls = TlsConfig(ca=pki.ca_cert, cert=pki.client_cert, key=pki.client_key)
    with Client(target, tls=tls, timeout=TIMEOUT) as client:
        client.tokenize("x")
    assert _bearer(recorder) == []


@pytest.mark.parametrize(
    ("token", "method", "expected"),
    [
        (None, "tokenize", UnauthenticatedError),
        ("not-a-token", "tokenize", UnauthenticatedError),
        ("user-token", "stats", PermissionDeniedError),
    ],
)
def test_auth_failures_are_typed(
    plain_server: Served, token: str | None, method: str, expected: type[LlamaGrpcError]
) -> None:
    """UNAUTHENTICATED (missing or unknown token) and PERMISSION_DENIED (user token on an admin
    call) become UnauthenticatedError and PermissionDeniedError with the server's message."""
    target, _ = plain_server
    with Client(target, token=token, timeout=TIMEOUT) as client:
        call = client.stats if method == "stats" else lambda: client.tokenize("x")
        with pytest.raises(expected) as caught:
            call()
    assert type(caught.value) is expected
    assert caught.value.code in {"UNAUTHENTICATED", "PERMISSION_DENIED"}
    assert "token" in caught.value.message


async def test_async_auth_failures_are_typed(plain_server: Served) -> None:
    """The async client maps both codes the same way."""
    target, _ = plain_server
    async with AsyncClient(target, timeout=TIMEOUT) as client:
        with pytest.raises(UnauthenticatedError):
            await client.tokenize("x")
    async with AsyncClient(target, token="user-token", timeout=TIMEOUT) as client:
        assert await client.tokenize("x") == [120]
        with pytest.raises(PermissionDeniedError):
            await client.stats()


# --- settings checked when the client is created -------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "given", "missing"),
    [({"cert": "c.pem"}, "cert", "key"), ({"key": "k.pem"}, "key", "cert")],
)
def test_cert_and_key_go_together(fields: dict[str, str], given: str, missing: str) -> None:
    """A client certificate without its key (or the reverse) is a ValueError naming both."""
    with pytest.raises(ValueError, match=f"{given} without {missing}"):
        TlsConfig(**fields)  # type: ignore[arg-type]


def test_unreadable_files_name_the_field_and_path(tmp_path: Path, pki: Pki) -> None:
    """Files are read when the client is created; a missing one is a FileNotFoundError and a
    directory an IsADirectoryError, each naming the TlsConfig field and the path."""
    missing = tmp_path / "nope.pem"
    config = TlsConfig(ca=missing)  # nothing is read yet
    with pytest.raises(FileNotFoundError, match=r"TlsConfig\.ca: cannot read .*nope\.pem"):
        Client("127.0.0.1:1", tls=config)
    with pytest.raises(IsADirectoryError, match=r"TlsConfig\.key: cannot read"):
        AsyncClient("127.0.0.1:1", tls=TlsConfig(cert=pki.client_cert, key=tmp_path))


def test_a_file_that_is_not_pem_is_refused(tmp_path: Path, pki: Pki) -> None:
    """A file without a PEM block (say, DER or a typo'd path to something else) is a ValueError."""
    der = tmp_path / "client.der"
    der.write_bytes(b"\x30\x82\x01\x0a")
    with pytest.raises(ValueError, match=r"TlsConfig\.cert: .*client\.der.* is not a PEM file"):
        Client("127.0.0.1:1", tls=TlsConfig(ca=pki.ca_cert, cert=der, key=pki.client_key))


def test_tls_with_a_given_channel_is_refused() -> None:
    """tls configures the channel the client creates; with channel= it would be ignored."""
    channel = grpc.insecure_channel("127.0.0.1:1")
    try:
        with pytest.raises(ValueError, match="tls applies"):
            Client(channel=channel, tls=True)
    finally:
        channel.close()


@pytest.mark.parametrize("token", ["", " padded", "two\nlines", "caf\u00e9"])
def test_malformed_tokens_are_refused(token: str) -> None:
    """A token that cannot travel as one metadata value is a ValueError at construction."""
    with pytest.raises(ValueError, match="token"):
        Client("127.0.0.1:1", token=token)


# --- CLI -----------------------------------------------------------------------------------------


def test_cli_tls_ca_and_token_from_the_environment(
    tls_server: Served,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--tls-ca trusts that CA; the token comes from $LLAMA_GRPC_TOKEN, --token wins over it."""
    target, recorder = tls_server
    monkeypatch.setenv(cli.TOKEN_ENV, "user-token")
    assert cli.main(["info", "--target", target, "--tls-ca", str(pki.ca_cert)]) == 0
    assert json.loads(capsys.readouterr().out)["model_name"] == MODEL_NAME
    assert _bearer(recorder) == ["Bearer user-token"]
    argv = ["stats", "--target", target, "--tls-ca", str(pki.ca_cert), "--token", "admin-token"]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["n_parallel"] == 3
    assert _bearer(recorder) == ["Bearer admin-token"]


def test_cli_auth_errors_print_the_code(
    plain_server: Served, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No token: UNAUTHENTICATED; a user token on stats: PERMISSION_DENIED; both exit 1."""
    target, _ = plain_server
    monkeypatch.delenv(cli.TOKEN_ENV, raising=False)
    assert cli.main(["tokenize", "x", "--target", target]) == 1
    assert capsys.readouterr().err.startswith("error: UNAUTHENTICATED")
    assert cli.main(["stats", "--target", target, "--token", "user-token"]) == 1
    assert capsys.readouterr().err.startswith("error: PERMISSION_DENIED")


def test_cli_mtls_flags(mtls_server: Served, pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    """--tls-cert/--tls-key present a client certificate; without them the server refuses."""
    target, _ = mtls_server
    base = ["tokenize", "ab", "--target", target, "--tls-ca", str(pki.ca_cert)]
    assert (
        cli.main([*base, "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]) == 0
    )
    assert json.loads(capsys.readouterr().out) == [97, 98]
    assert cli.main(base) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE")


def test_cli_tls_server_name(
    tls_server: Served,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--tls-server-name is the name checked in the server certificate."""
    target, _ = tls_server
    monkeypatch.setenv(cli.TOKEN_ENV, "user-token")
    base = ["info", "--target", target, "--tls-ca", str(pki.ca_cert), "--tls-server-name"]
    assert cli.main([*base, "localhost"]) == 0
    assert cli.main([*base, "elsewhere.example"]) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tls-cert", "c.pem"], "cert without key"),
        (["--tls-key", "k.pem"], "key without cert"),
        (["--tls-ca", "/nonexistent/ca.pem"], "TlsConfig.ca: cannot read '/nonexistent/ca.pem'"),
        (["--token", ""], "token"),
    ],
)
def test_cli_bad_tls_settings_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unusable TLS flags or token exit 2 with the reason, before any call."""
    assert cli.main(["info", "--target", "127.0.0.1:1", *argv]) == 2
    assert message in capsys.readouterr().err


class _ClientSpy:
    """Stands in for cli.Client: records its arguments, then fails the call."""

    calls: list[tuple[str, dict[str, Any]]]

    def __init__(self, target: str, **kwargs: Any) -> None:
        self.calls.append((target, kwargs))

    def __enter__(self) -> _ClientSpy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def model_info(self, **options: Any) -> Any:
        raise UnavailableError("spy")


@pytest.mark.parametrize(
    ("argv", "tls"),
    [
        ([], False),
        (["--tls"], True),
        (["--tls-ca", "ca.pem"], TlsConfig(ca="ca.pem")),
        (["--tls", "--tls-server-name", "n"], TlsConfig(server_name="n")),
        (
            ["--tls-cert", "c.pem", "--tls-key", "k.pem"],
            TlsConfig(cert="c.pem", key="k.pem"),
        ),
    ],
)
def test_cli_flags_reach_the_client(
    argv: list[str],
    tls: bool | TlsConfig,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--tls alone means system roots; any --tls-* option a TlsConfig (TLS implied)."""
    monkeypatch.setattr(_ClientSpy, "calls", [], raising=False)
    monkeypatch.setattr(cli, "Client", _ClientSpy)
    monkeypatch.delenv(cli.TOKEN_ENV, raising=False)
    assert cli.main(["info", "--target", "h:1", "--timeout", "3", *argv]) == 1
    expected = {"timeout": 3.0, "tls": tls, "token": None, "resume_attempts": 3}
    assert _ClientSpy.calls == [("h:1", expected)]


def test_cli_tls_flag_uses_the_system_roots(tls_server: Served, pki: Pki) -> None:
    """`--tls` alone trusts the system roots: with grpc's roots file pointed at our CA (in a
    fresh process, as grpc reads it once) the server is trusted."""
    target, _ = tls_server
    package_root = Path(llama_grpc.__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(package_root), *sys.path]),
        "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(pki.ca_cert),
        cli.TOKEN_ENV: "user-token",
    }
    completed = subprocess.run(
        [sys.executable, "-m", "llama_grpc", "info", "--tls", "--target", target],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["model_name"] == MODEL_NAME
