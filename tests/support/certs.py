"""Throwaway certificates for TLS tests, made with the `openssl` CLI: a CA, a server certificate
for localhost / 127.0.0.1 and a client certificate, all signed by that CA (EC P-256, valid for
a week). Independent of the client and the server packages, so every tier can use it:

    pki = make_pki(tmp_path_factory.mktemp("pki"))
    grpc.ssl_server_credentials([(pki.server_key.read_bytes(), pki.server_cert.read_bytes())])
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = "openssl"
CLIENT_URI = "spiffe://llama-grpc.test/client"
DAYS = "7"

# req's own settings (no system openssl.cnf) and the extensions of each certificate.
_CONFIG = f"""\
[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
subjectAltName = URI:{CLIENT_URI}
"""


@dataclass(frozen=True)
class Pki:
    """PEM files: the CA (certificate and key) and the server and client certificates + keys."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    # the client certificate's URI SAN: what a server takes as its identity (over its CN)
    client_identity: str = CLIENT_URI


def openssl_available() -> bool:
    """Whether the `openssl` CLI is on PATH."""
    return shutil.which(OPENSSL) is not None


def _openssl(directory: Path, *args: str) -> None:
    completed = subprocess.run(
        [shutil.which(OPENSSL) or OPENSSL, *args],
        cwd=directory,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={**os.environ, "OPENSSL_CONF": str(directory / "pki.cnf")},
    )
    if completed.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{completed.stderr}")


def _new_key_args(name: str) -> list[str]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", name]


def _leaf(directory: Path, name: str, common_name: str) -> None:
    """<name>.key and <name>.pem: a key and its certificate signed by ca.pem, extensions [name]."""
    _openssl(
        directory,
        "req",
        "-new",
        *_new_key_args(f"{name}.key"),
        "-subj",
        f"/CN={common_name}",
        "-config",
        "pki.cnf",
        "-out",
        f"{name}.csr",
    )
    _openssl(
        directory,
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-set_serial",
        f"0x{secrets.token_hex(8)}",
        "-days",
        DAYS,
        "-extfile",
        "pki.cnf",
        "-extensions",
        name,
        "-out",
        f"{name}.pem",
    )


def make_pki(directory: Path, name: str = "llama-grpc test") -> Pki:
    """A new CA and server/client certificates signed by it, as PEM files in `directory`.

    Each call makes an unrelated CA: two PKIs do not trust each other's certificates."""
    if not openssl_available():
        raise RuntimeError("make_pki needs the openssl command line tool on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pki.cnf").write_text(_CONFIG)
    _openssl(
        directory,
        "req",
        "-x509",
        *_new_key_args("ca.key"),
        "-subj",
        f"/CN={name} CA",
        "-days",
        DAYS,
        "-config",
        "pki.cnf",
        "-extensions",
        "ca",
        "-out",
        "ca.pem",
    )
    _leaf(directory, "server", "localhost")
    _leaf(directory, "client", f"{name} client")
    return Pki(
        ca_cert=directory / "ca.pem",
        ca_key=directory / "ca.key",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )
