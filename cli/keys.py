"""`vault keys init|issue`: a certificate authority, the server's certificate and clients'
certificates for TLS and mutual TLS, made with `cryptography` (ECDSA P-256)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from vault.config import check_name, check_role
from vault.errors import InvalidArgument

CERT_DAYS = 825


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    if path.exists():
        raise InvalidArgument(f"{path} exists: keys are never overwritten")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificate(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    hosts: list[str] | None = None,
    client: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650 if ca else CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    if client:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def init(folder: Path, extra_hosts: list[str]) -> dict[str, Any]:
    """A new CA and a server certificate for these hosts (and this machine's names); what was
    written where."""
    folder.mkdir(parents=True, exist_ok=True)
    hosts = list(dict.fromkeys([*extra_hosts, "localhost", "127.0.0.1", "::1", socket.getfqdn()]))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pinvault CA")])
    ca = _certificate(ca_name, ca_key, ca_name, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    server = _certificate(server_name, server_key, ca_name, ca_key, hosts=hosts)
    _write(folder / "ca.key", _key_pem(ca_key), secret=True)
    _write(folder / "ca.pem", _pem(ca), secret=False)
    _write(folder / "server.key", _key_pem(server_key), secret=True)
    _write(folder / "server.pem", _pem(server), secret=False)
    return {
        "folder": str(folder),
        "hosts": hosts,
        "ca_cert": str(folder / "ca.pem"),
        "ca_key": str(folder / "ca.key"),
        "server_cert": str(folder / "server.pem"),
        "server_key": str(folder / "server.key"),
    }


def issue(folder: Path, *, name: str, team: str, role: str) -> dict[str, Any]:
    """A client certificate signed by the CA in `folder`: CN name, O team, OU role; what was
    written where."""
    name = check_name("name", name)
    if "/" in name or name.startswith("."):
        raise InvalidArgument(f"name {name!r} cannot name a file")
    try:
        ca_key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), None)
        ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    except OSError as exc:
        raise InvalidArgument(f"no CA in {folder} (run `vault keys init` first): {exc}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise InvalidArgument(f"{folder / 'ca.key'} is not the CA key `vault keys init` made")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, check_name("team", team)),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, check_role(role)),
        ]
    )
    cert = _certificate(subject, key, ca.subject, ca_key, client=True)
    _write(folder / f"{name}.key", _key_pem(key), secret=True)
    _write(folder / f"{name}.pem", _pem(cert), secret=False)
    return {
        "name": name,
        "team": team,
        "role": role,
        "cert": str(folder / f"{name}.pem"),
        "key": str(folder / f"{name}.key"),
    }
