"""TLS for the server: --tls-cert/--tls-key (and --tls-client-ca for mTLS) checked at start,
reloaded without a restart, and the caller's certificate subject.

grpc reads a server certificate configuration through a fetcher it calls at each new TLS
handshake (grpc.dynamic_ssl_server_credentials, called on grpc's own threads), so a rotated
certificate takes effect for new connections while established ones (and their streams) go on
with the old one. The fetcher only hands over a configuration prepared by reload(): it is called
on SIGHUP and when the files' modification times change (checked at most once a second, at a
handshake). A reload whose files are broken keeps the current certificate and logs why."""

from __future__ import annotations

import dataclasses
import os
import ssl
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

MTIME_CHECK_INTERVAL_S = 1.0

log = structlog.get_logger("llama_grpc.tls")


class TlsFileError(Exception):
    """A TLS file is missing, unreadable or does not match; the message names the flag."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None  # set: clients must present a certificate it signed

    def paths(self) -> tuple[Path, ...]:
        return (self.cert, self.key) + ((self.client_ca,) if self.client_ca else ())


@dataclass(frozen=True, slots=True)
class _Loaded:
    key: bytes
    cert: bytes
    client_ca: bytes | None
    mtimes: tuple[int, ...]


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsFileError(f"{flag} {path}: {exc.strerror or exc}") from None


def _mtimes(files: TlsFiles) -> tuple[int, ...]:
    try:
        return tuple(os.stat(p).st_mtime_ns for p in files.paths())
    except OSError:
        return ()


def load(files: TlsFiles) -> _Loaded:
    """Read and check the files with the ssl module (grpc itself would only fail at the first
    handshake): the key must match the certificate, the CA file must hold a certificate."""
    cert = _read(files.cert, "--tls-cert")
    key = _read(files.key, "--tls-key")
    client_ca = _read(files.client_ca, "--tls-client-ca") if files.client_ca else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(files.cert, files.key)
    except ssl.SSLError as exc:
        raise TlsFileError(
            f"--tls-cert {files.cert} / --tls-key {files.key}: not a certificate and its "
            f"matching private key ({exc.reason or exc})"
        ) from None
    if files.client_ca is not None:
        try:
            context.load_verify_locations(cafile=files.client_ca)
        except ssl.SSLError as exc:
            raise TlsFileError(
                f"--tls-client-ca {files.client_ca}: no CA certificate ({exc.reason or exc})"
            ) from None
    return _Loaded(key, cert, client_ca, _mtimes(files))


def _configuration(loaded: _Loaded) -> Any:
    return grpc.ssl_server_certificate_configuration(
        [(loaded.key, loaded.cert)], root_certificates=loaded.client_ca
    )


class ReloadingCredentials:
    """Server credentials whose certificate can be replaced while serving."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._current = load(files)
        self._pending: Any = None
        self._lock = threading.Lock()
        self._next_check = time.monotonic() + MTIME_CHECK_INTERVAL_S
        self.reloads = 0

    @property
    def requires_client_certificate(self) -> bool:
        return self.files.client_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            _configuration(self._current),
            self._fetch,
            require_client_authentication=self.requires_client_certificate,
        )

    def reload(self, why: str) -> bool:
        """Read the files again; new connections get them. False (and a log line) when they are
        broken: the current certificate stays."""
        try:
            loaded = load(self.files)
        except TlsFileError as exc:
            log.error("tls_reload_failed", why=why, error=str(exc))
            with self._lock:  # don't retry the same broken files at every handshake
                self._current = dataclasses.replace(self._current, mtimes=_mtimes(self.files))
            return False
        with self._lock:
            self._current, self._pending = loaded, _configuration(loaded)
            self.reloads += 1
        log.info("tls_reloaded", why=why, cert=str(self.files.cert))
        return True

    def _fetch(self) -> Any:
        """grpc's fetcher (its threads, at each handshake): a new configuration, or None to keep
        the current one."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + MTIME_CHECK_INTERVAL_S
            if _mtimes(self.files) != self._current.mtimes:
                self.reload("files changed")
        with self._lock:
            pending, self._pending = self._pending, None
        return pending


def peer_subject(auth_context: Mapping[str, Iterable[bytes]] | None) -> str:
    """The client certificate's identity: its URI SAN (a SPIFFE id, say) when it has one, else
    its CN; "" without a verified client certificate."""
    if not auth_context:
        return ""
    for key in ("peer_spiffe_id", "peer_uri", "x509_common_name"):
        for value in auth_context.get(key, ()):
            return value.decode("utf-8", "replace")
    return ""
