"""No token crosses the wire: a relay recording every byte between a client and a real vault on
both ports finds none, and gRPC call proofs that are wrong, replayed, expired or made for another
method are refused with UNAUTHENTICATED.

The vault listens on 127.0.0.2 (still loopback) and relays (tests/relay.py) on 127.0.0.1 take its
own port numbers, so the bulk port the vault announces in Hello leads through them too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from helpers import wait_until

from tests.relay import Relay
from tierkv.backends import security
from tierkv.backends.base import BackendUnavailable
from tierkv.backends.security import RUN_ASKED_WITH
from tierkv.backends.vault import VaultClient, VaultRefused
from tierkv.vault.auth import ReplayGuard, Tokens
from tierkv.vault.server import serve
from tierkv.wire._pb import vault_pb2, vault_pb2_grpc
from tierkv.wire.proofs import (
    PROOF_METADATA_KEY,
    PROOF_VERSION,
    PROOF_WINDOW_S,
    RUN_QUERY,
    call_proof,
    key_id,
    run_of,
)

TOKEN = "alice-token-0123456789abcdef"
NS = b"wire-namespace"
STATS = "/tierkv.v1.Vault/Stats"
LOOKUP = "/tierkv.v1.Vault/Lookup"
VAULT_HOST = "127.0.0.2"  # loopback too, so relays on 127.0.0.1 take its port numbers


@pytest.fixture
def vault_and_relay() -> Iterator[tuple[str, list[Relay]]]:
    """A vault on VAULT_HOST and relays on 127.0.0.1 with its own port numbers (gRPC, bulk)."""
    server = serve(f"{VAULT_HOST}:0", 1 << 30, bulk_port=0, tokens=Tokens([("default", TOKEN)]))
    relays = [Relay(port, VAULT_HOST, port=port) for port in (server.port, server.bulk_port)]
    yield f"127.0.0.1:{server.port}", relays
    for relay in relays:
        relay.close()
    server.stop(grace=None)


def test_a_relay_recording_both_ports_finds_no_token(
    vault_and_relay: tuple[str, list[Relay]],
) -> None:
    address, relays = vault_and_relay
    with VaultClient(address, token=TOKEN) as client:
        for i in range(4):
            client.put(NS, i.to_bytes(16, "little"), 0, b"KV %d" % i * 1000)
        assert client.flush(timeout=10) and client.stored_puts == 4
        found = client.promote(NS, [i.to_bytes(16, "little") for i in range(4)], [0])
        assert len(found) == 4 and client.transport == "bulk"
        assert client.stats().auth_required
    recorded = [bytes(relay.sent + relay.received) for relay in relays]
    assert all(len(data) > 1000 for data in recorded)  # both ports went through
    for data in recorded:
        assert TOKEN.encode() not in data
    assert key_id(TOKEN).encode() in recorded[0]  # the gRPC proofs named the token


def _stats(address: str, proof: str | None) -> grpc.StatusCode:
    metadata = ((PROOF_METADATA_KEY, proof),) if proof else ()
    with grpc.insecure_channel(address) as channel:
        try:
            vault_pb2_grpc.VaultStub(channel).Stats(
                vault_pb2.StatsRequest(), timeout=5, metadata=metadata
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _run(address: str) -> str:
    """The run of the vault at `address`, as a client asks for it."""
    with grpc.insecure_channel(address) as channel:
        ask = channel.unary_unary(RUN_ASKED_WITH, request_serializer=bytes)
        with pytest.raises(grpc.RpcError) as refused:
            ask(b"", metadata=((PROOF_METADATA_KEY, RUN_QUERY),), timeout=5)
    run = run_of(refused.value.trailing_metadata())
    assert run is not None
    return run


def test_wrong_replayed_expired_and_misdirected_proofs_are_refused(
    vault_and_relay: tuple[str, list[Relay]],
) -> None:
    address, _ = vault_and_relay
    refused = grpc.StatusCode.UNAUTHENTICATED
    run = _run(address)
    recorded = call_proof(TOKEN, STATS, run)
    assert _stats(address, recorded) == grpc.StatusCode.OK
    assert _stats(address, recorded) == refused  # replayed
    assert _stats(address, None) == refused
    assert _stats(address, call_proof("wrong-token-0123456789abcdef", STATS, run)) == refused
    assert _stats(address, call_proof(TOKEN, LOOKUP, run)) == refused  # made for another method
    assert _stats(address, call_proof(TOKEN, STATS, "0" * len(run))) == refused  # another run
    for skew in (-2 * PROOF_WINDOW_S, 2 * PROOF_WINDOW_S):
        assert _stats(address, call_proof(TOKEN, STATS, run, now=time.time() + skew)) == refused
    tampered = recorded[:-1] + ("0" if recorded[-1] != "0" else "1")
    assert _stats(address, tampered) == refused
    assert _stats(address, "v1.garbage") == refused
    assert _stats(address, call_proof(TOKEN, STATS, run)) == grpc.StatusCode.OK


def test_a_client_whose_clock_is_off_is_told_why(
    vault_and_relay: tuple[str, list[Relay]], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, _ = vault_and_relay
    made = security.call_proof
    late = 2 * PROOF_WINDOW_S
    monkeypatch.setattr(
        security, "call_proof", lambda t, m, run, now=None: made(t, m, run, time.time() - late)
    )
    with VaultClient(address, token=TOKEN) as client, pytest.raises(VaultRefused) as refused:
        client.stats()
    assert "clocks differ" in str(refused.value) and TOKEN not in str(refused.value)


def test_the_replay_window_is_bounded_and_forgets_expired_nonces() -> None:
    guard = ReplayGuard(limit=2)
    now = time.time()
    assert guard.admit("a", now) is None and guard.admit("a", now) == "tierkv call proof replayed"
    assert guard.admit("b", now) is None
    assert "calls in" in (guard.admit("c", now) or "")  # full: refused, never unbounded
    later = now + 2 * PROOF_WINDOW_S + 1  # "a" and "b" can no longer pass the time check
    assert guard.admit("c", later) is None and guard.admit("d", later) is None


@pytest.mark.parametrize("digits", [5000, 16])
def test_a_proof_with_a_huge_time_is_refused_and_counted(digits: int) -> None:
    """A time field of more digits than a time has (5,000: more than Python's int() takes) is
    a malformed proof: UNAUTHENTICATED and an auth failure, not an error of the vault."""
    from test_vault_metrics import scrape_until

    stamp = "9" * digits
    server = serve("127.0.0.1:0", 0, tokens=Tokens([("default", TOKEN)]), metrics_port=0)
    proof = ".".join((PROOF_VERSION, key_id(TOKEN), stamp, "0" * 32, "0" * 64))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = vault_pb2_grpc.VaultStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Stats(
                    vault_pb2.StatsRequest(), metadata=[(PROOF_METADATA_KEY, proof)], timeout=10
                )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        failures = ("tierkv_vault_auth_failures_total", (("transport", "grpc"),))
        assert scrape_until(server.metrics_address, failures)[failures] == 1
    finally:
        server.stop(grace=None)


def test_a_sniffed_proof_is_good_for_no_other_vault_and_no_later_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two vaults that share a token (as `tierkv secrets init` lays them out): a proof sniffed on
    its way to one is refused by the other, and by the same vault once restarted, within the
    60 s window; the client itself goes on across the restart."""
    sniffed: list[str] = []
    made = security.call_proof

    def sniffing(*args: Any, **kwargs: Any) -> str:
        sniffed.append(made(*args, **kwargs))
        return sniffed[-1]

    monkeypatch.setattr(security, "call_proof", sniffing)
    one, two = (serve("127.0.0.1:0", 0, tokens=Tokens([("default", TOKEN)])) for _ in range(2))
    again = None
    try:
        with VaultClient(one.address, token=TOKEN) as client:
            assert client.stats().auth_required
            stats_proof = sniffed[-1]  # Stats' own, admitted by vault one
            unused = made(TOKEN, STATS, _run(one.address))  # never sent to vault one
            assert _stats(two.address, stats_proof) == grpc.StatusCode.UNAUTHENTICATED
            assert _stats(two.address, unused) == grpc.StatusCode.UNAUTHENTICATED
            port = one.port
            one.stop(grace=None)
            again = serve(f"127.0.0.1:{port}", 0, tokens=Tokens([("default", TOKEN)]))
            assert _stats(again.address, stats_proof) == grpc.StatusCode.UNAUTHENTICATED
            assert _stats(again.address, unused) == grpc.StatusCode.UNAUTHENTICATED
            assert wait_until(lambda: _serves(client), 10)  # learns the new run by itself
    finally:
        for server in (one, two, again):
            if server is not None:
                server.stop(grace=None)


def _serves(client: VaultClient) -> bool:
    try:
        return client.stats().auth_required
    except BackendUnavailable:
        return False
