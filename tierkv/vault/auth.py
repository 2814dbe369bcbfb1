"""Who may use a vault: tokens, tenants and TLS, applied the same way to the gRPC and the bulk port.

A vault with tokens (tierkv/wire/secrets.py: `[security] token_file`, else $TIERKV_TOKEN)
requires one on every call, and the token itself never crosses the wire, TLS or not
(docs/security-wire.md; the proofs: tierkv/wire/proofs.py):

- every gRPC call carries a fresh proof in its `tierkv-proof` metadata, checked by
  `AuthInterceptor` before the request is read. The vault refuses a proof whose MAC is wrong,
  that was made for another run (another vault sharing the token, or this one before it
  restarted: `Tokens.run`, told with every refusal), whose time is more than PROOF_WINDOW_S
  from its clock, or whose nonce it has seen (`ReplayGuard` remembers them for the window). A
  per-call MAC rather than a challenge: a challenge costs every call (or a session) a round
  trip, and gRPC's channels multiplex calls over connections the caller does not see; the
  price is that vault and engine clocks must agree within the window.
- a bulk connection proves it before its first frame by answering the vault's random nonce.

Every comparison is constant-time.

Tenants: when the tokens name more than one tenant, the vault files each tenant's namespaces
under `TENANT/` (`Tenant.prefix`), so a tenant can neither read, overwrite, delete, clear nor
count another's blocks, and the store evicts from the tenant holding the most (store.py); with one
tenant (or none) namespaces are used as given.
`server_credentials` / `ssl_context` build TLS (mutual with a client CA) from `[security]` for
both ports.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from tierkv.addresses import parse_address
from tierkv.checksum import block_checksum
from tierkv.config import ConfigError, SecurityConfig
from tierkv.wire.proofs import (
    PROOF_WINDOW_S,
    RUN_METADATA_KEY,
    asks_for_run,
    call_mac,
    key_id,
    new_run,
    proof,
    proof_fields,
)
from tierkv.wire.secrets import (
    MIN_TOKEN_CHARS,
    TOKEN_ENV,
    check_secret_files,
    load_tls_files,
    read_secret,
    read_token_file,
    refuse_unpaired_tls,
)

Payload = bytes | memoryview

MAX_REMEMBERED_PROOFS_PER_TENANT = 250_000
"""Call proofs of one tenant remembered (each for 2 to 4 x PROOF_WINDOW_S); beyond it that
tenant's calls are refused until older ones are forgotten, the other tenants' are not (only a
caller with the tenant's token can add one). About 60 bytes each: 15 MB at the bound."""


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


def refuse_ineffective_settings(security: SecurityConfig) -> None:
    """ConfigError naming the first `[security]` setting that cannot take effect for a vault as
    written, instead of starting without it."""
    refuse_unpaired_tls(security)
    if security.client_ca and not security.tls_cert:
        raise ConfigError(
            "security.client_ca needs security.tls_cert and tls_key: without a certificate the "
            "vault speaks no TLS, so no client certificate would be checked"
        )
    check_secret_files(security)


def configured_tokens(security: SecurityConfig) -> list[tuple[str, str]]:
    """(tenant, token) pairs from `security.token_file`, else $TIERKV_TOKEN, else none."""
    if security.token_file:
        return read_token_file(security.token_file)
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"${TOKEN_ENV}: a token needs at least {MIN_TOKEN_CHARS} characters")
    return [("default", token)] if token else []


class ReplayGuard:
    """The nonces of one tenant's admitted call proofs, so a recorded proof is refused when
    played again: a proof's time may be PROOF_WINDOW_S either side of now, so a nonce must be
    remembered for 2 x PROOF_WINDOW_S. Kept compactly: 60 bits of each nonce (a small int) in two
    sets, each gathering the nonces of 2 x PROOF_WINDOW_S, so a nonce is remembered for 2 to 4
    windows (about 60 bytes each, against 330 as strings with their expiry)."""

    def __init__(self, limit: int = MAX_REMEMBERED_PROOFS_PER_TENANT) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._current: set[int] = set()
        self._previous: set[int] = set()
        self._started = -math.inf  # when _current began gathering

    def admit(self, nonce: str, now: float) -> str | None:
        """None when `nonce` (hex) is new (then remembered), else why the call is refused."""
        seen = int(nonce[:15], 16)
        generation = 2 * PROOF_WINDOW_S
        with self._lock:
            if now - self._started >= generation:
                recent = now - self._started < 2 * generation
                self._previous = self._current if recent else set()
                self._current = set()
                self._started = now
            if seen in self._current or seen in self._previous:
                return "tierkv call proof replayed"
            if len(self._current) + len(self._previous) >= self._limit:
                return f"more than {self._limit} calls in {2 * generation:.0f} s (of this tenant)"
            self._current.add(seen)
            return None


class Refusal(NamedTuple):
    """Why a gRPC call is refused; `counted`: as an authentication failure (a query for the
    vault's run is not, nor a proof made for another run: a client sends one after a restart)."""

    reason: str
    counted: bool = True


class Tokens:
    """The tokens a vault accepts, each naming its tenant, and the vault's run (drawn here, at
    each start) that every call proof must be made for."""

    def __init__(
        self,
        entries: Sequence[tuple[str, str]],
        remembered_proofs: int = MAX_REMEMBERED_PROOFS_PER_TENANT,
    ) -> None:
        multi = len({tenant for tenant, _ in entries}) > 1
        self.several_tenants = multi
        """Whether namespaces are filed under each tenant (see the module docstring)."""
        self._entries = [
            (token, Tenant(tenant, f"{tenant}/".encode()) if multi else OPEN)
            for tenant, token in entries
        ]
        self._by_key_id = {key_id(token): (token, tenant) for token, tenant in self._entries}
        self._replays = {tenant.name: ReplayGuard(remembered_proofs) for _, tenant in self._entries}
        """Per tenant, so one tenant filling its own cannot refuse another's calls."""
        self.run = new_run()
        """This vault's run: random, so a proof made for it is good for no other vault sharing a
        token, nor for this one once restarted."""

    def describe(self) -> str:
        """E.g. "3 tokens, 2 tenants" (never a token)."""
        tenants = {tenant.name for _, tenant in self._entries} - {""}
        count = f"{len(self._entries)} token{'s' if len(self._entries) > 1 else ''}"
        return f"{count}, {len(tenants)} tenants" if tenants else count

    def check_call(
        self, method: str, metadata: Sequence[tuple[str, Any]] | None, now: float | None = None
    ) -> Refusal | None:
        """Why a gRPC call to `method` is refused (its `tierkv-proof`), None when it is admitted;
        an admitted proof's nonce is remembered, so the same proof is refused next time."""
        if asks_for_run(metadata):
            return Refusal("asked for the vault's run", counted=False)
        fields = proof_fields(metadata)
        if fields is None:
            return Refusal("missing or malformed tierkv call proof")
        found = self._by_key_id.get(fields.key)
        expected = call_mac(
            found[0] if found else "", method, fields.key, fields.stamp_ms, fields.nonce, fields.run
        )
        if not hmac.compare_digest(expected, fields.mac) or found is None:
            return Refusal("wrong tierkv token")
        if not hmac.compare_digest(fields.run, self.run):
            return Refusal(
                "tierkv call proof made for another vault, or before this one restarted",
                counted=False,
            )
        now = time.time() if now is None else now
        if abs(now - fields.stamp_ms / 1000) > PROOF_WINDOW_S:
            return Refusal(
                f"tierkv call proof expired: clocks differ by more than {PROOF_WINDOW_S:.0f} s?"
            )
        replayed = self._replays[found[1].name].admit(fields.nonce, now)
        return None if replayed is None else Refusal(replayed)

    def tenant_of_metadata(self, metadata: Sequence[tuple[str, Any]] | None) -> Tenant:
        """The tenant of a call that `check_call` admitted (its proof's key id)."""
        fields = proof_fields(metadata)
        found = self._by_key_id.get(fields.key) if fields else None
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


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses a gRPC call without a valid call proof (UNAUTHENTICATED, with the vault's run in
    the trailing metadata) before reading its request; `on_refusal()` is told of each counted
    one (the vault's metrics count them)."""

    def __init__(self, tokens: Tokens, on_refusal: Callable[[], None] = lambda: None) -> None:
        self._tokens = tokens
        self._on_refusal = on_refusal

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        details = handler_call_details
        refusal = self._tokens.check_call(details.method, details.invocation_metadata)
        if refusal is None:
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        if refusal.counted:
            self._on_refusal()
        told = ((RUN_METADATA_KEY, self._tokens.run),)

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.set_trailing_metadata(told)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal.reason)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS for the vault's gRPC port (client certificates required with client_ca); None: none."""
    if not security.tls_cert:
        return None
    key_and_cert = [(read_secret(security.tls_key or ""), read_secret(security.tls_cert))]
    client_ca = read_secret(security.client_ca) if security.client_ca else None
    return grpc.ssl_server_credentials(
        key_and_cert, root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def ssl_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """TLS for the vault's bulk port (client certificates required with client_ca); None: plain
    TCP."""
    if not security.tls_cert:
        return None
    cert, key, client_ca = security.tls_cert, security.tls_key, security.client_ca
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    load_tls_files(
        f"security.tls_cert {cert} with tls_key {key}", lambda: context.load_cert_chain(cert, key)
    )
    if client_ca:
        load_tls_files(
            f"security.client_ca {client_ca}",
            lambda: context.load_verify_locations(client_ca),
        )
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@dataclass(frozen=True)
class Access:
    """How a vault admits callers: its tokens (None: anyone), whether it speaks TLS, and whether
    it was started --insecure beyond loopback (told to clients in Stats)."""

    tokens: Tokens | None = None
    tls: bool = False
    insecure: bool = False

    @property
    def several_tenants(self) -> bool:
        """Whether the vault tells tenants apart (their shares of its limits then hold)."""
        return self.tokens is not None and self.tokens.several_tenants

    def tenant(self, context: grpc.ServicerContext) -> Tenant:
        """The tenant of a gRPC call that AuthInterceptor let through."""
        if self.tokens is None:
            return OPEN
        return self.tokens.tenant_of_metadata(context.invocation_metadata())
