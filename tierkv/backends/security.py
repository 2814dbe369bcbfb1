"""The engine side's security rules, for every backend: `check_client_security` refuses
`[security]` settings that cannot take effect as written (a secret file others may read, a TLS
certificate without its key) before any tier, backend or CLI command uses them; and what a vault
client presents: its token (`client_token`), a fresh call proof on every gRPC call
(`proving_channel`: made for the vault's run, which it asks the vault for once and learns
again from the refusal of a call after the vault restarted), and TLS for both of the vault's
ports.
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from tierkv.config import SecurityConfig
from tierkv.wire.proofs import PROOF_METADATA_KEY, RUN_QUERY, call_proof, run_of
from tierkv.wire.secrets import (
    TOKEN_ENV,
    check_secret_files,
    load_tls_files,
    read_secret,
    read_token_file,
    refuse_unpaired_tls,
)

RUN_ASKED_WITH = "/grpc.health.v1.Health/Check"
"""The call that asks a vault for its run (an empty request: any health check)."""


def check_client_security(security: SecurityConfig) -> None:
    """ConfigError naming the first `[security]` setting an engine side (a tier of any
    backends, `tierkv bench`, `eval`, `serve`, `status`) cannot use as written: a TLS
    certificate without its key or the reverse, a token, TLS key or data key file that group or
    others may read, TLS files that do not load."""
    refuse_unpaired_tls(security)
    check_secret_files(security)
    ssl_context(security)  # TLS files that do not load: named now, not at the first connection


def client_token(security: SecurityConfig) -> str | None:
    """The token a client presents: $TIERKV_TOKEN, else the first of `security.token_file`."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    if security.token_file:
        return read_token_file(security.token_file)[0][1]
    return None


class CallProver(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds a fresh `tierkv-proof` of `token` to every call of `channel` (`proving_channel`),
    made for the vault's run: asked of the vault (over `channel` itself) before the first call,
    and learnt again from any call refused with another (the vault restarted). A unary call so
    refused is made again at once; a streaming one fails, and the next call has the new run."""

    def __init__(self, token: str, channel: grpc.Channel) -> None:
        self._token = token
        self._ask = channel.unary_unary(
            RUN_ASKED_WITH, request_serializer=bytes, response_deserializer=bytes
        )
        self._lock = threading.Lock()
        self._run: str | None = None

    def _current_run(self, timeout: float | None) -> str:
        """The vault's run, asked of it when not known yet ("" when it tells none: a vault
        that checks no proofs, or one that did not answer, which the call itself then meets)."""
        with self._lock:
            if self._run is not None:
                return self._run
        try:
            self._ask(b"", metadata=((PROOF_METADATA_KEY, RUN_QUERY),), timeout=timeout or 10.0)
        except grpc.RpcError as exc:
            run = run_of(exc.trailing_metadata())
            if run is None:
                return ""
        else:
            run = ""
        with self._lock:
            self._run = run
        return run

    def _learnt(self, call: Any) -> bool:
        """Whether `call` (done) was refused with a run other than the one we used (which is
        then learnt)."""
        try:
            refused = call.code() == grpc.StatusCode.UNAUTHENTICATED
            run = run_of(call.trailing_metadata()) if refused else None
        except grpc.RpcError:
            return False
        with self._lock:
            if run is None or run == self._run:
                return False
            self._run = run
        return True

    def _proved(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [
            (name, value) for name, value in (details.metadata or ()) if name != PROOF_METADATA_KEY
        ]
        run = self._current_run(details.timeout)
        metadata.append((PROOF_METADATA_KEY, call_proof(self._token, details.method, run)))
        return _CallDetails(
            details.method,
            details.timeout,
            tuple(metadata),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(self._proved(details), request)
        if self._learnt(outcome):
            outcome = continuation(self._proved(details), request)
        return outcome

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(self._proved(details), request)
        outcome.add_done_callback(self._learnt)
        return outcome

    def intercept_stream_unary(
        self, continuation: Any, details: Any, request_iterator: Iterator[Any]
    ) -> Any:
        outcome = continuation(self._proved(details), request_iterator)
        outcome.add_done_callback(self._learnt)
        return outcome

    def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Iterator[Any]
    ) -> Any:
        outcome = continuation(self._proved(details), request_iterator)
        outcome.add_done_callback(self._learnt)
        return outcome


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
    return grpc.intercept_channel(channel, CallProver(token, channel)) if token else channel


def channel_credentials(security: SecurityConfig) -> grpc.ChannelCredentials | None:
    """TLS for a client's gRPC channel (its own certificate when configured); None: plain."""
    if not security.tls_ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_secret(security.tls_ca),
        private_key=read_secret(security.tls_key) if security.tls_key else None,
        certificate_chain=read_secret(security.tls_cert) if security.tls_cert else None,
    )


def ssl_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """TLS for a client's end of a vault's bulk port; None: plain TCP."""
    if not security.tls_ca:
        return None
    ca = security.tls_ca
    context = load_tls_files(f"security.tls_ca {ca}", lambda: ssl.create_default_context(cafile=ca))
    if security.tls_cert:
        cert, key = security.tls_cert, security.tls_key
        load_tls_files(
            f"security.tls_cert {cert} with tls_key {key}",
            lambda: context.load_cert_chain(cert, key),
        )
    return context
