"""Provision a LAN: tokens, data keys, a CA and vault certificates, and the tierkv.toml fragments
that use them (`tierkv secrets init`); every file written with mode 0600.

Layout of DIR, per tenant NAME:

- `vault/tokens`: one `NAME TOKEN` line per tenant (the vault's `[security] token_file`);
  `vault/tierkv.toml`: the vault's fragment; with TLS `vault/vault.crt`, `vault/vault.key`.
- `NAME/token`: that tenant's token; `NAME/data_key`: its data key (`KEY_ID KEY`, KEY 32 random
  bytes in URL-safe base64, unpadded: blocks are sealed with it, vaults never see it);
  `NAME/tierkv.toml`: the engine's fragment; with TLS `NAME/ca.crt`, the CA that signed the vault.
- with TLS, `ca/ca.crt` and `ca/ca.key` (keep the key off the LAN: it signs new certificates).

Each fragment names its files relative to its own directory: copy `vault/` to each vault
machine and `NAME/` to each engine machine of that tenant, and run tierkv in that directory.
Certificates are ECDSA P-256 from the `cryptography` package.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tierkv.seal import new_data_key_line
from tierkv.wire.secrets import make_private_dir

TOKEN_BYTES = 32
CERT_DAYS = 825
"""How long provisioned certificates are valid (the longest most TLS clients accept)."""

_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def write_private(path: Path, data: bytes | str) -> Path:
    """Write `data` to a new file `path` readable by its owner only (0600 from its creation)."""
    make_private_dir(path.parent)
    raw = data.encode() if isinstance(data, str) else data
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(raw)
    return path


def new_token() -> str:
    """A random token (URL-safe, 43 characters)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def valid_host(host: str) -> bool:
    """Whether `host` is an IP address or a DNS name (dot-separated labels of letters, digits
    and inner hyphens), as a certificate may name it; never an unspecified address (0.0.0.0,
    ::), which names no host an engine could reach."""
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return len(host) <= 253 and all(map(_HOST_LABEL.fullmatch, host.split(".")))


def alt_name(host: str) -> x509.GeneralName:
    """A certificate's subject alternative name for a host name or an IP address."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue(
    subject: str,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    hosts: Sequence[str] = (),
    days: int = CERT_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new key and its certificate for `subject`: a CA when `issuer` is None (self-signed),
    else signed by `issuer` (its name and key), naming `hosts`. With the key identifiers and key
    usage that strict verification (OpenSSL's X509_STRICT, Python 3.13's default) requires."""
    key = ec.generate_private_key(ec.SECP256R1())
    issuer_name, issuer_key = issuer or (_name(subject), key)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = issuer is None
    usage = dict.fromkeys(
        ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement"), False
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=not ca,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
                **usage,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    )
    if hosts:
        names = [alt_name(host) for host in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def init_secrets(
    directory: Path, tenants: Sequence[str], tls_hosts: Sequence[str], port: int = 50051
) -> list[Path]:
    """Write the layout of the module docstring into `directory` (none of its files may exist
    yet; FileExistsError) and return the paths written. With `tls_hosts` the vault certificate
    names them, and the engine fragment points at the first of them on `port`."""
    make_private_dir(directory)
    vault_dir = directory / "vault"
    written: list[Path] = []
    tokens = {tenant: new_token() for tenant in tenants}
    token_lines = "".join(f"{tenant} {token}\n" for tenant, token in tokens.items())
    written.append(write_private(vault_dir / "tokens", token_lines))
    vault_toml = f'[vault]\nlisten = "0.0.0.0:{port}"\n\n[security]\ntoken_file = "tokens"\n'
    engine_cluster = ""
    ca_cert: x509.Certificate | None = None
    if tls_hosts:
        ca_cert, ca_key = issue("tierkv CA", None)
        written.append(write_private(directory / "ca" / "ca.crt", cert_pem(ca_cert)))
        written.append(write_private(directory / "ca" / "ca.key", key_pem(ca_key)))
        vault_cert, vault_key = issue("tierkv vault", (ca_cert.subject, ca_key), tls_hosts)
        written.append(write_private(vault_dir / "vault.crt", cert_pem(vault_cert)))
        written.append(write_private(vault_dir / "vault.key", key_pem(vault_key)))
        vault_toml += 'tls_cert = "vault.crt"\ntls_key = "vault.key"\n'
        host = tls_hosts[0]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        engine_cluster = f'[cluster]\nkv_cold = "{address}"\n\n'
    written.append(write_private(vault_dir / "tierkv.toml", vault_toml))
    for tenant, token in tokens.items():
        tenant_dir = directory / tenant
        written.append(write_private(tenant_dir / "token", f"{token}\n"))
        written.append(write_private(tenant_dir / "data_key", new_data_key_line(1)))
        engine_toml = (
            f'{engine_cluster}[security]\ntoken_file = "token"\ndata_key_file = "data_key"\n'
        )
        if ca_cert is not None:
            written.append(write_private(tenant_dir / "ca.crt", cert_pem(ca_cert)))
            engine_toml += 'tls_ca = "ca.crt"\n'
        written.append(write_private(tenant_dir / "tierkv.toml", engine_toml))
    return written
