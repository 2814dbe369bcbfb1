"""Throwaway certificates for TLS tests and benchmarks, made by tierkv.provision.

`make_certs(directory)` writes a CA, a vault certificate for 127.0.0.1 / ::1 / localhost and a
client certificate, both signed by the CA (keys with mode 0600), and returns their paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierkv.provision import cert_pem, issue, key_pem, write_private


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(directory: Path) -> Certs:
    """A CA and a vault and a client certificate signed by it, as PEM files in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = issue("tierkv test CA", None, days=1)
    ca = write_private(directory / "ca.crt", cert_pem(ca_cert))
    paths = {}
    for role, hosts in (
        ("server", ["127.0.0.1", "::1", "localhost"]),
        ("client", ["tierkv-client"]),
    ):
        cert, key = issue(f"tierkv {role}", (ca_cert.subject, ca_key), hosts, days=1)
        paths[role] = (
            write_private(directory / f"{role}.crt", cert_pem(cert)),
            write_private(directory / f"{role}.key", key_pem(key)),
        )
    return Certs(ca, *paths["server"], *paths["client"])
