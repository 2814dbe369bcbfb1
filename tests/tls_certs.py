"""Throwaway certificates for TLS tests and benchmarks (the `cryptography` package, dev only).

`make_certs(directory)` writes a CA, a vault certificate for 127.0.0.1 / ::1 / localhost and a
client certificate, both signed by the CA, and returns their paths.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    ca: bool,
    alt_names: list[x509.GeneralName],
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if alt_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(directory: Path) -> Certs:
    """A CA and a vault and a client certificate signed by it, as PEM files in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue("tierkv test CA", ca_key, _name("tierkv test CA"), ca_key, True, [])
    paths = {}
    for role, names in (
        (
            "server",
            [
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")),
                x509.DNSName("localhost"),
            ],
        ),
        ("client", [x509.DNSName("tierkv-client")]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"tierkv {role}", key, ca_cert.subject, ca_key, False, names)
        (directory / f"{role}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[role] = (directory / f"{role}.crt", _write_key(key, directory / f"{role}.key"))
    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return Certs(directory / "ca.crt", *paths["server"], *paths["client"])
