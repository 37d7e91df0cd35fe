"""Security end to end, against real servers with the embedded model: TLS and mTLS with
certificates made by openssl in the test (tests/support/certs.py), bearer tokens on every RPC,
tenants kept apart in the prefix cache, in GetStats and in request ids, and certificates and tokens
reloaded without a restart."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from structlog.testing import capture_logs

from llama_grpc import AsyncClient, PermissionDeniedError, TlsConfig, UnauthenticatedError
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.auth import load_auth_file, token_digest
from llama_grpc_server.config import ServerSettings, Settings
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_server.rpc.plumbing.wiring import ServerStartError
from tests.e2e.conftest import settings
from tests.support.certs import Pki, make_pki

USER_A = "token-of-tenant-a-0123456789"
USER_B = "token-of-tenant-b-0123456789"
ADMIN = "token-of-the-admin-0123456789"
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
SERVICE = pb.DESCRIPTOR.services_by_name["LlmService"]


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def write_tokens(path: Path, pki: Pki, *, with_b: bool = True) -> Path:
    b = f'[[tokens]]\ntenant = "team-b"\ntoken = "{USER_B}"\n' if with_b else ""
    path.write_text(
        f"""
[tenants.team-a]
max_queued = 8

[[tokens]]
tenant = "team-a"
sha256 = "{token_digest(USER_A)}"

{b}
[[tokens]]
tenant = "ops"
role = "admin"
sha256 = "{token_digest(ADMIN)}"

[[identities]]
subject = "{client_subject(pki)}"
tenant = "team-cert"
"""
    )
    return path


def client_subject(pki: Pki) -> str:
    """What the server takes as the client certificate's identity (its URI SAN, else CN)."""
    return pki.client_identity


def server_settings(pki: Pki, directory: Path, model_path: str = "", **server: Any) -> Settings:
    """TLS and the tokens file; its tenant limits reach the scheduler as cli.py passes them. The
    embedded model, or model_path (the tiny one, for the tests that never generate)."""
    tokens = write_tokens(directory / "tokens.toml", pki)
    limits = load_auth_file(tokens).limits
    conf = settings(model_path, n_parallel=2, max_queue=16, tenant_limits=limits)
    tls = ServerSettings(
        port=0,
        grace_s=1.0,
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        auth_tokens_file=str(tokens),
    )
    return replace(conf, server=replace(tls, **server))


def channel(port: int, pki: Pki | None, *, client_cert: bool = False) -> grpc.aio.Channel:
    """A TLS channel trusting `pki`'s CA (None: the system roots), with its client certificate
    when asked."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca_cert.read_bytes() if pki else None,
        private_key=pki.client_key.read_bytes() if pki and client_cert else None,
        certificate_chain=pki.client_cert.read_bytes() if pki and client_cert else None,
    )
    return grpc.aio.secure_channel(f"localhost:{port}", credentials)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def tls_server(
    pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningServer]:
    """TLS with bearer tokens (no client certificates)."""
    conf = server_settings(pki, tmp_path_factory.mktemp("tls"))
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def stub(tls_server: RunningServer, pki: Pki) -> AsyncIterator[pb_grpc.LlmServiceStub]:
    async with channel(tls_server.port, pki) as ch:
        yield pb_grpc.LlmServiceStub(ch)


def generate(prompt: str = PROMPT, max_tokens: int = 4, **fields: Any) -> pb.GenerateRequest:
    params = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens),
    )
    return pb.GenerateRequest(prompt=prompt, params=params, **fields)


async def call_every_rpc(
    stub: pb_grpc.LlmServiceStub, metadata: tuple[tuple[str, str], ...]
) -> dict[str, grpc.StatusCode]:
    """Each LlmService method called once with a valid request: its status code."""
    small = pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=2))
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "Generate": lambda: stub.Generate(generate(max_tokens=2), metadata=metadata),
        "StreamGenerate": lambda: _drain(
            stub.StreamGenerate(
                pb.StreamGenerateRequest(prompt="Hi", params=small), metadata=metadata
            )
        ),
        "GenerateTokens": lambda: _drain(
            stub.GenerateTokens(
                pb.GenerateTokensRequest(token_ids=[2, 9259], params=small), metadata=metadata
            )
        ),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="Hi"), metadata=metadata),
        "Detokenize": lambda: stub.Detokenize(
            pb.DetokenizeRequest(token_ids=[9259]), metadata=metadata
        ),
        "Embed": lambda: stub.Embed(
            pb.EmbedRequest(inputs=[pb.EmbedInput(text="Hi")]), metadata=metadata
        ),
        "GetStats": lambda: stub.GetStats(pb.GetStatsRequest(), metadata=metadata),
        "WatchLoad": lambda: _first(stub.WatchLoad(pb.WatchLoadRequest(), metadata=metadata)),
        "GetModelInfo": lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata),
        "ClearCache": lambda: stub.ClearCache(pb.ClearCacheRequest(), metadata=metadata),
        "ListModels": lambda: stub.ListModels(pb.ListModelsRequest(), metadata=metadata),
        "LoadModel": lambda: stub.LoadModel(pb.LoadModelRequest(), metadata=metadata),
        # a name the server does not know: past the role check it is NOT_FOUND (unloading the
        # one model would make the next calls load it again)
        "UnloadModel": lambda: stub.UnloadModel(
            pb.UnloadModelRequest(model="no-such-model"), metadata=metadata
        ),
        # past the role check: no such file, no such adapter (INVALID_ARGUMENT)
        "LoadAdapter": lambda: stub.LoadAdapter(
            pb.LoadAdapterRequest(name="x", path="/no/such/adapter.gguf"), metadata=metadata
        ),
        "UnloadAdapter": lambda: stub.UnloadAdapter(
            pb.UnloadAdapterRequest(name="no-such-adapter"), metadata=metadata
        ),
        "ListAdapters": lambda: stub.ListAdapters(pb.ListAdaptersRequest(), metadata=metadata),
    }
    assert set(calls) == set(SERVICE.methods_by_name), "a new RPC needs a case here"
    codes: dict[str, grpc.StatusCode] = {}
    for name, call in calls.items():
        try:
            await call()
            codes[name] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            codes[name] = exc.code()
    return codes


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


async def _first(call: Any) -> None:
    """Read one message, then cancel: a watch has no end of its own."""
    try:
        await call.read()
    finally:
        call.cancel()


# -- transport -------------------------------------------------------------------------------------


async def test_tls_needs_the_ca(tls_server: RunningServer, pki: Pki) -> None:
    """A client trusting the test CA gets through; one trusting only the system roots does
    not get past the handshake."""
    async with channel(tls_server.port, pki) as ch:
        got = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert got.status == health_pb2.HealthCheckResponse.SERVING
    async with channel(tls_server.port, None) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_key_that_does_not_match_fails_at_start(
    pki: Pki, tmp_path: Path, tiny_model_path: Path
) -> None:
    conf = server_settings(pki, tmp_path, str(tiny_model_path), tls_key=str(pki.client_key))
    with pytest.raises(ServerStartError, match=r"--tls-cert .* --tls-key .*matching private key"):
        async with start_server(conf, lambda: build_engine(conf)):
            pass


# -- tokens ----------------------------------------------------------------------------------------


async def test_every_rpc_needs_a_known_token(stub: pb_grpc.LlmServiceStub) -> None:
    unauthenticated = dict.fromkeys(SERVICE.methods_by_name, grpc.StatusCode.UNAUTHENTICATED)
    assert await call_every_rpc(stub, ()) == unauthenticated
    assert await call_every_rpc(stub, bearer("not-a-token-0123456789")) == unauthenticated
    assert await call_every_rpc(stub, (("authorization", f"Basic {USER_A}"),)) == unauthenticated
    ok = {
        **dict.fromkeys(SERVICE.methods_by_name, grpc.StatusCode.OK),
        "UnloadModel": grpc.StatusCode.NOT_FOUND,
        "LoadAdapter": grpc.StatusCode.INVALID_ARGUMENT,
        "UnloadAdapter": grpc.StatusCode.INVALID_ARGUMENT,
    }
    admin_only = (
        "ClearCache",
        "ListModels",
        "LoadModel",
        "UnloadModel",
        "LoadAdapter",
        "UnloadAdapter",
    )
    user_ok = {**ok, **dict.fromkeys(admin_only, grpc.StatusCode.PERMISSION_DENIED)}
    assert await call_every_rpc(stub, bearer(USER_A)) == user_ok
    assert await call_every_rpc(stub, bearer(ADMIN)) == ok


async def test_refusal_carries_error_details(stub: pb_grpc.LlmServiceStub) -> None:
    """UNAUTHENTICATED says what was missing, with an ErrorInfo reason and the request id."""
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Tokenize(pb.TokenizeRequest(text="x"), metadata=(("x-request-id", "r-1"),))
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in (raised.value.details() or "")
    trailing = dict(raised.value.trailing_metadata() or ())
    assert "grpc-status-details-bin" in trailing


async def test_health_and_reflection_stay_open(tls_server: RunningServer, pki: Pki) -> None:
    async with channel(tls_server.port, pki) as ch:
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for answer in stub.ServerReflectionInfo(iter([request])):
            names = {s.name for s in answer.list_services_response.service}
            assert "llama_grpc.v1.LlmService" in names
            break


# -- tenants ---------------------------------------------------------------------------------------


async def test_tenants_never_share_a_cached_prefix(stub: pb_grpc.LlmServiceStub) -> None:
    """A's repeat is warm; B's identical prompt is evaluated from scratch (no cache hit to
    time or read), and B's own repeat is warm again."""
    prompt = PROMPT + " (isolation)"
    first_a = await stub.Generate(generate(prompt), metadata=bearer(USER_A))
    again_a = await stub.Generate(generate(prompt), metadata=bearer(USER_A))
    first_b = await stub.Generate(generate(prompt), metadata=bearer(USER_B))
    again_b = await stub.Generate(generate(prompt), metadata=bearer(USER_B))
    assert first_a.usage.cached_prompt_tokens == 0
    assert again_a.usage.cached_prompt_tokens > 0
    assert first_b.usage.cached_prompt_tokens == 0
    assert again_b.usage.cached_prompt_tokens > 0
    assert first_b.text == first_a.text  # same model, same greedy answer


async def test_cache_scope_is_per_tenant(stub: pb_grpc.LlmServiceStub) -> None:
    """Naming the same cache_scope does not let B into A's scope."""
    prompt = PROMPT + " (scope)"
    await stub.Generate(generate(prompt, cache_scope="shared"), metadata=bearer(USER_A))
    b = await stub.Generate(generate(prompt, cache_scope="shared"), metadata=bearer(USER_B))
    assert b.usage.cached_prompt_tokens == 0


async def test_stats_hide_other_tenants_request_ids(stub: pb_grpc.LlmServiceStub) -> None:
    request = pb.StreamGenerateRequest(
        prompt="Count: 1, 2, 3,",
        params=pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True)),
    )
    secret = "request-of-a-secret"
    stream = stub.StreamGenerate(request, metadata=(*bearer(USER_A), ("x-request-id", secret)))
    async for _ in stream:  # running once its first delta arrived
        break

    async def ids(token: str) -> list[str]:
        stats = await stub.GetStats(pb.GetStatsRequest(), metadata=bearer(token))
        assert stats.active_slots >= 1  # B still sees that the slot is busy
        return [s.request_id for s in stats.slots]

    try:
        assert secret in await ids(USER_A)
        assert secret in await ids(ADMIN)
        assert secret not in await ids(USER_B)
    finally:
        stream.cancel()


async def test_same_request_id_in_two_tenants(stub: pb_grpc.LlmServiceStub) -> None:
    """x-request-ids are per tenant: B reusing A's in-flight id neither fails nor touches A."""
    request = pb.StreamGenerateRequest(
        prompt="Count: 1, 2, 3,",
        params=pb.GenerationParams(
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True),
        ),
    )
    same = ("x-request-id", "same-id")
    a = stub.StreamGenerate(request, metadata=(*bearer(USER_A), same))
    async for _ in a:
        break
    b = stub.StreamGenerate(request, metadata=(*bearer(USER_B), same))
    b_messages = [m async for m in b]
    assert b_messages[-1].done.usage.completion_tokens == 24
    assert b_messages[-1].done.request_id == "same-id"
    a_rest = [m async for m in a]
    assert a_rest[-1].done.usage.completion_tokens == 24


# -- mTLS ------------------------------------------------------------------------------------------


async def test_mtls_needs_a_client_certificate_whose_subject_is_the_tenant(
    pki: Pki, tmp_path: Path, tiny_model_path: Path
) -> None:
    conf = server_settings(pki, tmp_path, str(tiny_model_path), tls_client_ca=str(pki.ca_cert))
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        async with channel(running.port, pki) as ch:  # no client certificate
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await pb_grpc.LlmServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        async with channel(running.port, pki, client_cert=True) as ch:
            with capture_logs() as logs:
                info = await pb_grpc.LlmServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest())
            assert info.n_ctx > 0
    access = [e for e in logs if e.get("event") == "rpc" and e["method"].endswith("GetModelInfo")]
    assert access and access[0]["tenant"] == "team-cert"
    assert access[0]["auth"] == "certificate"


# -- reload ----------------------------------------------------------------------------------------


async def test_reload_rotates_certificate_and_tokens_without_cutting_a_stream(
    pki: Pki, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """After a reload, new connections get the new certificate (a client trusting only the old
    CA is refused) and a removed token stops working, while a stream opened before goes on."""
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server_cert", "server_key"):
        shutil.copy(getattr(pki, name), live / name)
    conf = server_settings(
        pki, tmp_path, tls_cert=str(live / "server_cert"), tls_key=str(live / "server_key")
    )
    rotated = make_pki(tmp_path_factory.mktemp("rotated"), "rotated")
    request = pb.StreamGenerateRequest(
        prompt="Count: 1, 2, 3,",
        params=pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=48, ignore_eos=True)),
    )
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        async with channel(running.port, pki) as old:
            stream = pb_grpc.LlmServiceStub(old).StreamGenerate(request, metadata=bearer(USER_B))
            async for _ in stream:
                break
            shutil.copy(rotated.server_cert, live / "server_cert")
            shutil.copy(rotated.server_key, live / "server_key")
            write_tokens(Path(conf.server.auth_tokens_file), pki, with_b=False)
            assert running.reload("test")
            async with channel(running.port, rotated) as new:
                stub = pb_grpc.LlmServiceStub(new)
                ok = await stub.Tokenize(pb.TokenizeRequest(text="a"), metadata=bearer(USER_A))
                assert ok.token_ids
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.Tokenize(pb.TokenizeRequest(text="a"), metadata=bearer(USER_B))
                assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            rest = [m async for m in stream]  # the old connection and its stream go on
            assert rest[-1].done.usage.completion_tokens == 48
        async with channel(running.port, pki) as stale:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await health_pb2_grpc.HealthStub(stale).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_broken_reload_keeps_the_old_files(
    pki: Pki, tmp_path: Path, tiny_model_path: Path
) -> None:
    conf = server_settings(pki, tmp_path, str(tiny_model_path))
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        Path(conf.server.auth_tokens_file).write_text("[[tokens]]\n")
        assert not running.reload("test")
        async with channel(running.port, pki) as ch:
            stub = pb_grpc.LlmServiceStub(ch)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(USER_A))
            assert info.n_ctx > 0


# -- fair share ------------------------------------------------------------------------------------


async def test_a_flooding_tenant_cannot_starve_another(stub: pb_grpc.LlmServiceStub) -> None:
    """Tenant A fills both slots and its whole queue allowance (max_queued = 8: a ninth waiting
    request is refused, naming the limit); B's one request is admitted at the first slot
    turnover, ahead of A's six other waiting requests, not after them as FIFO would."""
    params = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=16, ignore_eos=True),
    )
    loop = asyncio.get_running_loop()
    first_token: dict[str, float] = {}

    async def run(name: str, token: str) -> None:
        call = stub.StreamGenerate(
            pb.StreamGenerateRequest(prompt=f"Request {name}: count", params=params),
            metadata=bearer(token),
        )
        async for _ in call:
            first_token.setdefault(name, loop.time())

    floods = [asyncio.create_task(run(f"a{i}", USER_A)) for i in range(10)]

    async def queued() -> int:
        return (await stub.GetStats(pb.GetStatsRequest(), metadata=bearer(ADMIN))).queue_depth

    for _ in range(200):
        if await queued() == 8:
            break
        await asyncio.sleep(0.05)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await run("a-extra", USER_A)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued=8" in (refused.value.details() or "")
    await run("b", USER_B)
    await asyncio.gather(*floods)
    a_starts = sorted(first_token[f"a{i}"] for i in range(10))
    assert first_token["b"] < a_starts[4], "B waited behind more than one turnover of A"


async def test_clear_cache_is_for_admins_and_forgets_cached_prefixes(
    stub: pb_grpc.LlmServiceStub,
) -> None:
    prompt = PROMPT + " (clear)"
    await stub.Generate(generate(prompt), metadata=bearer(USER_A))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ClearCache(pb.ClearCacheRequest(), metadata=bearer(USER_A))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "admin role" in (refused.value.details() or "")
    warm = await stub.Generate(generate(prompt), metadata=bearer(USER_A))
    assert warm.usage.cached_prompt_tokens > 0  # the refusal cleared nothing
    cleared = await stub.ClearCache(pb.ClearCacheRequest(), metadata=bearer(ADMIN))
    assert cleared.cleared_slots >= 1
    assert cleared.freed_kv_cells > 0
    stats = await stub.GetStats(pb.GetStatsRequest(), metadata=bearer(ADMIN))
    assert stats.kv_cells_used == 0  # nothing runs, so nothing is held
    cold = await stub.Generate(generate(prompt), metadata=bearer(USER_A))
    assert cold.usage.cached_prompt_tokens == 0
    assert cold.text == warm.text


async def test_the_client_library_speaks_tls_and_tokens(
    tls_server: RunningServer, pki: Pki
) -> None:
    """AsyncClient with TlsConfig and a token: a user generates and sees its own usage; its
    ClearCache is PermissionDeniedError; the admin's clears; no token is UnauthenticatedError."""
    target = f"localhost:{tls_server.port}"
    tls = TlsConfig(ca=pki.ca_cert)
    async with AsyncClient(target, tls=tls, token=USER_A, timeout=60) as user:
        result = await user.generate("Hello", max_tokens=2, temperature=0.0)
        assert result.usage.completion_tokens == 2
        with pytest.raises(PermissionDeniedError):
            await user.clear_cache()
    async with AsyncClient(target, tls=tls, token=ADMIN, timeout=60) as admin:
        assert (await admin.clear_cache()).cleared_slots >= 0
    async with AsyncClient(target, tls=tls, timeout=60) as anonymous:
        with pytest.raises(UnauthenticatedError):
            await anonymous.tokenize("Hello")


async def test_rotated_certificate_files_are_picked_up_without_a_signal(
    pki: Pki, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path
) -> None:
    """Replacing the files is enough (mesh agents rewrite them in place): a handshake more than
    a second later notices the new modification times and serves the new certificate."""
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(pki.server_cert, live / "cert.pem")
    shutil.copy(pki.server_key, live / "key.pem")
    conf = server_settings(
        pki,
        tmp_path,
        str(tiny_model_path),
        tls_cert=str(live / "cert.pem"),
        tls_key=str(live / "key.pem"),
    )
    rotated = make_pki(tmp_path_factory.mktemp("rotated-files"), "rotated files")
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        shutil.copy(rotated.server_cert, live / "cert.pem")
        shutil.copy(rotated.server_key, live / "key.pem")
        await asyncio.sleep(1.2)  # past MTIME_CHECK_INTERVAL_S
        async with channel(running.port, rotated) as ch:
            got = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert got.status == health_pb2.HealthCheckResponse.SERVING
        assert running.credentials is not None and running.credentials.reloads == 1
