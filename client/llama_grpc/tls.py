"""TLS settings of a client's channel: which CA to trust, an optional client certificate (mTLS)
and the server name to check; read into grpc channel credentials when a client is created."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

# The name checked against the server certificate when it is not the target's host.
SERVER_NAME_OPTION = "grpc.ssl_target_name_override"
_PEM_MARKER = b"-----BEGIN "


@dataclass(frozen=True)
class TlsConfig:
    """TLS for a client: `ca` is the PEM file of the CA to trust (None = the system roots);
    `cert` and `key` (both or neither) are PEM files of a client certificate and its key for
    servers that require one (mTLS); `server_name` replaces the target's host as the name the
    server certificate must carry. The files are read when the client is created."""

    ca: str | Path | None = None
    cert: str | Path | None = None
    key: str | Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            given, missing = ("cert", "key") if self.key is None else ("key", "cert")
            raise ValueError(
                f"TlsConfig: {given} without {missing}: a client certificate needs both "
                "cert and key (or neither)"
            )
        if self.server_name is not None and not self.server_name:
            raise ValueError("TlsConfig: server_name is empty (use None to check the target's)")

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials of these settings, reading the PEM files now."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem("ca", self.ca),
            private_key=_read_pem("key", self.key),
            certificate_chain=_read_pem("cert", self.cert),
        )

    def options(self) -> list[tuple[str, str]]:
        """The channel options these settings add (the server name override, when set)."""
        return [] if self.server_name is None else [(SERVER_NAME_OPTION, self.server_name)]


def _read_pem(field: str, path: str | Path | None) -> bytes | None:
    """The bytes of a PEM file; an unreadable or non-PEM file is an error naming field and path."""
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        reason = error.strerror or str(error)
        raise type(error)(f"TlsConfig.{field}: cannot read {str(path)!r}: {reason}") from error
    if _PEM_MARKER not in data:
        raise ValueError(f"TlsConfig.{field}: {str(path)!r} is not a PEM file")
    return data


def channel_security(
    tls: bool | TlsConfig,
) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """(credentials, extra channel options) for `tls`: (None, []) means a plaintext channel."""
    if isinstance(tls, TlsConfig):
        return tls.credentials(), tls.options()
    if tls is True:
        return grpc.ssl_channel_credentials(), []
    if tls is False:
        return None, []
    raise TypeError(f"tls must be a bool or a TlsConfig, not {type(tls).__name__}")
