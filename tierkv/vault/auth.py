"""Who may use a vault: tokens, tenants and TLS, applied the same way to the gRPC and the bulk port.

Tokens come from `[security] token_file` (one per line: `TOKEN`, or `TENANT TOKEN`; `#` starts a
comment) or, when no file is configured, the `TIERKV_TOKEN` environment variable; never from a
command line. A vault with tokens requires one on every call, and the token itself never
crosses the wire, TLS or not (docs/security-wire.md):

- every gRPC call carries a fresh proof in its `tierkv-proof` metadata (`CallProver`, checked by
  `AuthInterceptor` before the request is read): the token's key id, the time, a random nonce and
  HMAC-SHA256(token, method, key id, time, nonce). The vault refuses a proof whose MAC is wrong,
  whose time is more than PROOF_WINDOW_S from its clock, or whose nonce it has seen (`ReplayGuard`
  remembers them for the window). A per-call MAC rather than a challenge: a challenge costs every
  call (or a session) a round trip, and gRPC's channels multiplex calls over connections the
  caller does not see; the price is that vault and engine clocks must agree within the window.
- a bulk connection proves it before its first frame by answering the vault's random nonce with
  HMAC-SHA256(token, nonce) (`proof`).

Every comparison is constant-time.

Tenants: when the tokens name more than one tenant, the vault files each tenant's namespaces
under `TENANT/` (`Tenant.prefix`), so a tenant can neither read, overwrite, delete, clear nor
count another's blocks, and the store evicts from the tenant holding the most (store.py); with one
tenant (or none) namespaces are used as given.
`server_credentials` / `channel_credentials` / `ssl_context` build TLS (mutual with a client CA)
from `[security]` for both ports.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tierkv.addresses import parse_address
from tierkv.checksum import block_checksum
from tierkv.config import ConfigError, SecurityConfig

Payload = bytes | memoryview

TOKEN_ENV = "TIERKV_TOKEN"
PROOF_METADATA_KEY = "tierkv-proof"
PROOF_VERSION = "v1"
PROOF_WINDOW_S = 60.0
"""How far a call proof's time may be from the vault's clock; its nonce is remembered as long."""
MAX_REMEMBERED_NONCES = 1_000_000
"""Call proofs remembered within the window; beyond it calls are refused until older ones expire
(only a caller with a valid token can add one)."""
CALL_NONCE_BYTES = 16
NONCE_BYTES = 32
MIN_TOKEN_CHARS = 16
TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Tenant:
    """Whose blocks a call reaches: `prefix` is put before every namespace (b"": none).

    A payload's checksum is bound to its address, so a tenant's blocks are stored with the
    checksum of their prefixed address (`stored_checksum`) and returned with the one of the
    address the tenant knows (`returned_checksum`), each after verifying the other.
    """

    name: str
    prefix: bytes

    def stored_checksum(
        self, namespace: bytes, key: bytes, part: int, payload: Payload, checksum: int
    ) -> int | None:
        """The checksum to store a block the tenant sent with `checksum` under; None when
        `checksum` does not match (corrupted in transit)."""
        if not self.prefix:
            return checksum
        if block_checksum(namespace, key, part, payload) != checksum:
            return None
        return block_checksum(self.prefix + namespace, key, part, payload)

    def returned_checksum(
        self, namespace: bytes, key: bytes, part: int, payload: Payload, checksum: int
    ) -> int:
        """The checksum the tenant gets with a block stored under `checksum`; a wrong one when
        the stored payload no longer matches it (so the reader counts a miss, as it would)."""
        if not self.prefix:
            return checksum
        if block_checksum(self.prefix + namespace, key, part, payload) != checksum:
            return checksum ^ 1
        return block_checksum(namespace, key, part, payload)


OPEN = Tenant("", b"")
"""The only tenant of a vault without tokens, or with tokens of a single tenant."""


def namespace_tenant(stored_namespace: bytes) -> bytes:
    """The tenant whose blocks a namespace of a vault of several tenants holds ("TENANT/...")."""
    return stored_namespace.partition(b"/")[0]


class TenantCounters:
    """hits, misses and rejected blocks per tenant of a vault of several tenants (each sees only
    its own in Stats); a single tenant's are the store's own counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, tuple[int, int, int]] = {}

    def add(self, tenant: Tenant, hits: int = 0, misses: int = 0, rejected: int = 0) -> None:
        if tenant.prefix:
            with self._lock:
                old = self._counts.get(tenant.name, (0, 0, 0))
                self._counts[tenant.name] = (old[0] + hits, old[1] + misses, old[2] + rejected)

    def get(self, tenant: Tenant) -> tuple[int, int, int]:
        with self._lock:
            return self._counts.get(tenant.name, (0, 0, 0))


def check_private_file(path: str | Path, setting: str) -> None:
    """ConfigError when the secret file `path` (of `setting`) is open to group or others:
    refused rather than warned about, since a warning does not stop a local user reading it."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return  # reading it reports what is wrong
    if mode & 0o077:
        raise ConfigError(
            f"{setting} {path}: open to group or others (mode {mode & 0o777:04o}); "
            f"run chmod 600 {path}"
        )


def refuse_ineffective_settings(security: SecurityConfig, *, vault: bool) -> None:
    """ConfigError naming the first `[security]` setting that cannot take effect as written
    (`vault`: for a vault, else for a client), instead of starting without it."""
    if security.tls_cert and not security.tls_key:
        raise ConfigError("security.tls_cert needs security.tls_key (the certificate's key)")
    if security.tls_key and not security.tls_cert:
        raise ConfigError("security.tls_key needs security.tls_cert (the key's certificate)")
    if vault and security.client_ca and not security.tls_cert:
        raise ConfigError(
            "security.client_ca needs security.tls_cert and tls_key: without a certificate the "
            "vault speaks no TLS, so no client certificate would be checked"
        )
    for setting, path in (
        ("security.token_file", security.token_file),
        ("security.tls_key", security.tls_key),
        ("security.data_key_file", security.data_key_file),
    ):
        if path:
            check_private_file(path, setting)


def read_token_file(path: str | Path) -> list[tuple[str, str]]:
    """(tenant, token) of each line of a token file; ConfigError naming the file and line (or
    its mode, when others may read it)."""
    check_private_file(path, "security.token_file")
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"security.token_file {path}: cannot read: {exc}") from None
    entries = []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2 or (len(fields) == 2 and not TENANT_RE.match(fields[0])):
            raise ConfigError(
                f"{path}:{number}: expected TOKEN or TENANT TOKEN (tenant: letters, digits, _.-)"
            )
        tenant, token = (fields[0], fields[1]) if len(fields) == 2 else ("default", fields[0])
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"{path}:{number}: a token needs at least {MIN_TOKEN_CHARS} chars")
        entries.append((tenant, token))
    if not entries:
        raise ConfigError(f"security.token_file {path}: no token in it")
    return entries


def configured_tokens(security: SecurityConfig) -> list[tuple[str, str]]:
    """(tenant, token) pairs from `security.token_file`, else $TIERKV_TOKEN, else none."""
    if security.token_file:
        return read_token_file(security.token_file)
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"${TOKEN_ENV}: a token needs at least {MIN_TOKEN_CHARS} characters")
    return [("default", token)] if token else []


def client_token(security: SecurityConfig) -> str | None:
    """The token a client presents: $TIERKV_TOKEN, else the first of `security.token_file`."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    if security.token_file:
        return read_token_file(security.token_file)[0][1]
    return None


def proof(token: str, nonce: bytes) -> bytes:
    """What a bulk client answers the vault's nonce with."""
    return hmac.new(token.encode(), b"tierkv-bulk-v1" + nonce, hashlib.sha256).digest()


def key_id(token: str) -> str:
    """How a call proof names its token without revealing it (16 hex digits of an HMAC)."""
    return hmac.new(token.encode(), b"tierkv-key-id-v1", hashlib.sha256).hexdigest()[:16]


def call_mac(token: str, method: str, key: str, stamp_ms: int, nonce: str) -> str:
    """HMAC-SHA256(token) over one call's method, key id, time (ms) and nonce, in hex."""
    message = f"tierkv-call-v1\n{method}\n{key}\n{stamp_ms}\n{nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def call_proof(token: str, method: str, now: float | None = None) -> str:
    """A fresh `tierkv-proof` value for one call to `method` (full name, "/pkg.Service/Name")."""
    key = key_id(token)
    stamp = int((time.time() if now is None else now) * 1000)
    nonce = os.urandom(CALL_NONCE_BYTES).hex()
    return ".".join(
        (PROOF_VERSION, key, str(stamp), nonce, call_mac(token, method, key, stamp, nonce))
    )


def _proof_fields(metadata: Sequence[tuple[str, Any]] | None) -> tuple[str, int, str, str] | None:
    """(key id, time ms, nonce, mac) of a call's `tierkv-proof`; None when absent or malformed."""
    for name, value in metadata or ():
        if name != PROOF_METADATA_KEY or not isinstance(value, str):
            continue
        parts = value.split(".")
        if len(parts) != 5 or parts[0] != PROOF_VERSION or not parts[2].isdigit():
            return None
        if len(parts[3]) != 2 * CALL_NONCE_BYTES or len(parts[4]) != 64:
            return None
        return parts[1], int(parts[2]), parts[3], parts[4]
    return None


class ReplayGuard:
    """The nonces of call proofs admitted within the last 2 x PROOF_WINDOW_S (a proof's time may
    be PROOF_WINDOW_S either side of now), so a recorded proof is refused when played again."""

    def __init__(self, limit: int = MAX_REMEMBERED_NONCES) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._order: deque[tuple[float, str]] = deque()

    def admit(self, nonce: str, now: float) -> str | None:
        """None when `nonce` is new (then remembered), else why the call is refused."""
        with self._lock:
            while self._order and self._order[0][0] < now:
                self._seen.discard(self._order.popleft()[1])
            if nonce in self._seen:
                return "tierkv call proof replayed"
            if len(self._seen) >= self._limit:
                return f"more than {self._limit} calls in {2 * PROOF_WINDOW_S:.0f} s"
            self._seen.add(nonce)
            self._order.append((now + 2 * PROOF_WINDOW_S, nonce))
            return None


class Tokens:
    """The tokens a vault accepts, each naming its tenant."""

    def __init__(self, entries: Sequence[tuple[str, str]]) -> None:
        multi = len({tenant for tenant, _ in entries}) > 1
        self.several_tenants = multi
        """Whether namespaces are filed under each tenant (see the module docstring)."""
        self._entries = [
            (token, Tenant(tenant, f"{tenant}/".encode()) if multi else OPEN)
            for tenant, token in entries
        ]
        self._by_key_id = {key_id(token): (token, tenant) for token, tenant in self._entries}
        self._replays = ReplayGuard()

    def describe(self) -> str:
        """E.g. "3 tokens, 2 tenants" (never a token)."""
        tenants = {tenant.name for _, tenant in self._entries} - {""}
        count = f"{len(self._entries)} token{'s' if len(self._entries) > 1 else ''}"
        return f"{count}, {len(tenants)} tenants" if tenants else count

    def check_call(
        self, method: str, metadata: Sequence[tuple[str, Any]] | None, now: float | None = None
    ) -> str | None:
        """Why a gRPC call to `method` is refused (its `tierkv-proof`), None when it is admitted;
        an admitted proof's nonce is remembered, so the same proof is refused next time."""
        fields = _proof_fields(metadata)
        if fields is None:
            return "missing or malformed tierkv call proof"
        key, stamp, nonce, mac = fields
        found = self._by_key_id.get(key)
        expected = call_mac(found[0] if found else "", method, key, stamp, nonce)
        if not hmac.compare_digest(expected, mac) or found is None:
            return "wrong tierkv token"
        now = time.time() if now is None else now
        if abs(now - stamp / 1000) > PROOF_WINDOW_S:
            return f"tierkv call proof expired: clocks differ by more than {PROOF_WINDOW_S:.0f} s?"
        return self._replays.admit(nonce, now)

    def tenant_of_metadata(self, metadata: Sequence[tuple[str, Any]] | None) -> Tenant:
        """The tenant of a call that `check_call` admitted (its proof's key id)."""
        fields = _proof_fields(metadata)
        found = self._by_key_id.get(fields[0]) if fields else None
        return found[1] if found else OPEN

    def tenant_of_proof(self, nonce: bytes, answer: bytes) -> Tenant | None:
        """The tenant whose token made `answer` to `nonce`; None when no token did."""
        found = None
        for token, tenant in self._entries:
            if hmac.compare_digest(proof(token, nonce), answer):
                found = tenant
        return found


def is_loopback(host: str) -> bool:
    """Whether every address `host` stands for is a loopback address (127.0.0.0/8, ::1)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(found) and all(
        ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_loopback for *_, sockaddr in found
    )


def listens_open(
    listen: str, tokens: Tokens | None, security: SecurityConfig, *, insecure: bool
) -> bool:
    """The listener rule, for every caller that starts a vault: whether it would listen on
    `listen` beyond loopback without authentication (no tokens, no client CA), which only
    `insecure` allows. ConfigError naming the fix when it is not allowed, and for `insecure`
    together with authentication (one of them would not mean what it says)."""
    authenticated = tokens is not None or security.client_ca is not None
    if insecure and authenticated:
        given = "client_ca" if tokens is None else "tokens (security.token_file or $TIERKV_TOKEN)"
        raise ConfigError(f"--insecure together with {given}: drop one of them")
    host, _ = parse_address(listen, allow_port_zero=True)
    open_to_lan = not authenticated and not is_loopback(host)
    if open_to_lan and not insecure:
        raise ConfigError(
            f"refusing to listen on {listen}, beyond loopback, without authentication: set "
            "[security] token_file (or $TIERKV_TOKEN, or client_ca), or pass --insecure"
        )
    return open_to_lan


class CallProver(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds a fresh `tierkv-proof` of `token` to every call of a channel (`proving_channel`)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _proved(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [
            (name, value) for name, value in (details.metadata or ()) if name != PROOF_METADATA_KEY
        ]
        metadata.append((PROOF_METADATA_KEY, call_proof(self._token, details.method)))
        return _CallDetails(
            details.method,
            details.timeout,
            tuple(metadata),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._proved(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._proved(details), request)

    def intercept_stream_unary(
        self, continuation: Any, details: Any, request_iterator: Iterator[Any]
    ) -> Any:
        return continuation(self._proved(details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Iterator[Any]
    ) -> Any:
        return continuation(self._proved(details), request_iterator)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: tuple[tuple[str, str | bytes], ...] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


def proving_channel(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel` with a call proof of `token` on every call; `channel` itself without a token."""
    return grpc.intercept_channel(channel, CallProver(token)) if token else channel


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses a gRPC call without a valid call proof (UNAUTHENTICATED) before reading its request;
    `on_refusal()` is told of each (the vault's metrics count them)."""

    def __init__(self, tokens: Tokens, on_refusal: Callable[[], None] = lambda: None) -> None:
        self._tokens = tokens
        self._on_refusal = on_refusal

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        details = handler_call_details
        reason = self._tokens.check_call(details.method, details.invocation_metadata)
        if reason is None:
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        self._on_refusal()

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS for the vault's gRPC port (client certificates required with client_ca); None: none."""
    if not security.tls_cert:
        return None
    key_and_cert = [(_read(security.tls_key or ""), _read(security.tls_cert))]
    client_ca = _read(security.client_ca) if security.client_ca else None
    return grpc.ssl_server_credentials(
        key_and_cert, root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def channel_credentials(security: SecurityConfig) -> grpc.ChannelCredentials | None:
    """TLS for a client's gRPC channel (its own certificate when configured); None: plain."""
    if not security.tls_ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(security.tls_ca),
        private_key=_read(security.tls_key) if security.tls_key else None,
        certificate_chain=_read(security.tls_cert) if security.tls_cert else None,
    )


def ssl_context(security: SecurityConfig, server: bool) -> ssl.SSLContext | None:
    """TLS for the bulk port, the vault's (`server`) or a client's end; None: plain TCP."""
    try:
        if server:
            if not security.tls_cert:
                return None
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(security.tls_cert, security.tls_key)
            if security.client_ca:
                context.load_verify_locations(security.client_ca)
                context.verify_mode = ssl.CERT_REQUIRED
            return context
        if not security.tls_ca:
            return None
        context = ssl.create_default_context(cafile=security.tls_ca)
        if security.tls_cert:
            context.load_cert_chain(security.tls_cert, security.tls_key)
        return context
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"[security] TLS files: {exc}") from None


@dataclass(frozen=True)
class Access:
    """How a vault admits callers: its tokens (None: anyone), whether it speaks TLS, and whether
    it was started --insecure beyond loopback (told to clients in Stats)."""

    tokens: Tokens | None = None
    tls: bool = False
    insecure: bool = False

    def tenant(self, context: grpc.ServicerContext) -> Tenant:
        """The tenant of a gRPC call that AuthInterceptor let through."""
        if self.tokens is None:
            return OPEN
        return self.tokens.tenant_of_metadata(context.invocation_metadata())
