"""Addresses as tierkv.toml and the command line write them: a vault's "host:port" or
"[v6]:port", the redis://, rediss:// and redis+cluster:// URLs of Valkey / Redis backends (shown
without their passwords by `redact`), the file:///PATH?tenant=..&max_bytes=.. URL of a file
tier (`parse_file_url`), and plain IP addresses; each parser raises ValueError naming the
address."""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tierkv.sizes import MIB, SIZE_FORMS, parse_size


def parse_address(text: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """(host, port) from "host:port" or "[v6]:port"; ValueError naming the address if malformed.

    Port 0 ("any free port") is only accepted with `allow_port_zero` (a server's listen address).
    """
    if not isinstance(text, str):
        raise ValueError(f"expected an address host:port, got {text!r}")
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep or not host:
            raise ValueError(f"expected [ipv6]:port, got {text!r}")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"expected host:port, got {text!r}")
        if ":" in host:
            raise ValueError(f"an IPv6 address needs brackets, like [::1]:50051; got {text!r}")
    if any(c.isspace() for c in host) or "/" in host:
        raise ValueError(f"bad host {host!r} in address {text!r}")
    if not port_text.isdigit():
        raise ValueError(f"bad port {port_text!r} in address {text!r}")
    port = int(port_text)
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise ValueError(f"port {port} out of range in address {text!r}")
    return host, port


def format_address(host: str, port: int) -> str:
    """The "host:port" form of an address, bracketing IPv6 hosts."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
"""URL schemes of a Valkey / Redis backend: rediss = TLS, +cluster = a Redis Cluster."""


def is_redis_url(address: str) -> bool:
    """Whether `address` names a Valkey / Redis backend rather than a tierkv vault."""
    return address.partition("://")[0] in REDIS_SCHEMES and "://" in address


FILE_SCHEME = "file"
FILE_URL_OPTIONS = ("tenant", "max_bytes")
"""What a file tier's URL may say after its path: `?tenant=NAME&max_bytes=SIZE`."""
DEFAULT_FILE_TENANT = "default"


def is_file_url(address: str) -> bool:
    """Whether `address` names a file tier (a directory engines read and write themselves)."""
    return address.startswith(f"{FILE_SCHEME}://")


def parse_file_url(text: str) -> tuple[str, str, int | None]:
    """(directory, tenant, cap in bytes or None: the default) of a file tier's URL
    `file:///ABSOLUTE/PATH[?tenant=NAME][&max_bytes=SIZE]`; ValueError naming it otherwise."""
    url = urlsplit(text)
    if url.scheme != FILE_SCHEME or url.netloc or not url.path.startswith("/") or url.fragment:
        raise ValueError(
            f"expected file:///absolute/path[?tenant=NAME&max_bytes=SIZE], got {text!r}"
        )
    try:
        options = parse_qs(url.query, keep_blank_values=True, strict_parsing=bool(url.query))
    except ValueError:
        raise ValueError(f"bad options in {text!r}: expected ?tenant=NAME&max_bytes=SIZE") from None
    unknown = set(options) - set(FILE_URL_OPTIONS)
    repeated = [name for name, values in options.items() if len(values) > 1]
    if unknown or repeated:
        raise ValueError(
            f"unknown or repeated option {sorted(unknown) or repeated} in {text!r}; a file tier "
            f"takes {', '.join(FILE_URL_OPTIONS)}"
        )
    cap = None
    if "max_bytes" in options:
        cap = parse_size(options["max_bytes"][0], SIZE_FORMS)
        if cap < MIB:
            raise ValueError(f"max_bytes in {text!r}: expected at least 1MiB")
    tenant = options.get("tenant", [DEFAULT_FILE_TENANT])[0]
    return url.path.rstrip("/") or "/", tenant, cap


def redact(address: str) -> str:
    """`address` without any user:password part, for logs and tables."""
    if not is_redis_url(address):
        return address
    scheme, _, rest = address.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"


def parse_cold_address(text: str) -> str:
    """A vault "host:port", a redis://, rediss://, redis+cluster:// URL or a file tier's
    file:/// URL; else ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"expected an address host:port or a redis:// URL, got {text!r}")
    if "://" not in text:
        parse_address(text)
        return text
    if is_file_url(text):
        parse_file_url(text)
        return text
    if not is_redis_url(text):
        raise ValueError(
            f"unknown scheme in {redact(text)!r}; expected host:port, file:/// or one of "
            + ", ".join(f"{scheme}://" for scheme in REDIS_SCHEMES)
        )
    try:
        url = urlsplit(text)
        port = url.port
    except ValueError as exc:
        raise ValueError(f"bad URL {redact(text)!r}: {exc}") from None
    if not url.hostname or (url.path not in ("", "/") and not url.path[1:].isdigit()):
        raise ValueError(f"expected redis://host:port[/db], got {redact(text)!r}")
    if port is None:
        raise ValueError(f"no port in {redact(text)!r} (e.g. redis://10.0.0.5:6379)")
    return text


def parse_ip_address(value: Any) -> str:
    """`value` as an IP address (normalised); ValueError naming it when it is none."""
    try:
        return str(ipaddress.ip_address(value if isinstance(value, str) else ""))
    except ValueError:
        raise ValueError(
            f"expected an IP address such as 127.0.0.1 or ::1, got {value!r}"
        ) from None
