"""A man in the middle between engines and a real `tierkv vault` process, on both of its ports.

The vault listens on 127.0.0.2 (gRPC and bulk port); relays on 127.0.0.1 forward to it. A client
pointed at the gRPC relay learns the vault's bulk port number from Hello and, connecting to that
port on 127.0.0.1, reaches the bulk relay: every byte of both ports passes a relay, which records
it (tests/relay.py) and, on the bulk port, may rewrite what the vault returns, recomputing the
vault's unkeyed checksums as an attacker would. With sealed blocks nothing of a payload shows on
the wire, and whatever the relay changes, swaps, replays or brings in from another tenant is a
counted miss, never data.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import pick_free_port, start_subprocess_vault, wait_serving

from tests.relay import BulkReplyRewriter, Relay, Tamper
from tests.test_seal import KEYS, NS, PATTERN, key_file, pattern_blocks
from tierkv.backends.vault import VaultClient
from tierkv.keys import namespace_fingerprint
from tierkv.quant import get_codec
from tierkv.seal import Sealer
from tierkv.tier import ColdTier

VAULT_HOST = "127.0.0.2"  # loopback too, so relays on 127.0.0.1 can take the same port numbers
TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdefgh"}
PROBE = PATTERN.tobytes()[:64]
TENANTS_NS = namespace_fingerprint({"test": "seal relay tenants"})


@dataclass
class RelayedVault:
    grpc: Relay
    bulk: Relay
    keys: dict[str, Path]
    """Each tenant's data key file."""

    def tier(self, tenant: str, *, sealed: bool = True) -> ColdTier:
        client = VaultClient(f"127.0.0.1:{self.grpc.port}", token=TOKENS[tenant])
        sealer = Sealer.from_file(self.keys[tenant]) if sealed else None
        return ColdTier(get_codec("none"), {"kv": client}, sealer=sealer)

    def forget(self) -> None:
        """Empty both recordings and stop rewriting."""
        for relay in (self.grpc, self.bulk):
            relay.sent.clear()
            relay.received.clear()
        self.bulk.rewriter = None


@pytest.fixture(scope="module")
def relayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayedVault]:
    work = tmp_path_factory.mktemp("relayed")
    token_file = work / "tokens"
    token_file.write_text("".join(f"{name} {token}\n" for name, token in TOKENS.items()))
    token_file.chmod(0o600)
    bulk_port, grpc_port = pick_free_port(), pick_free_port()
    bulk = Relay(bulk_port, VAULT_HOST, port=bulk_port)
    process, _ = start_subprocess_vault(
        grpc_port,
        "1GiB",
        "kv_cold",
        work,
        ["--bulk-port", str(bulk_port)],
        f'[security]\ntoken_file = "{token_file}"\n',
        host=VAULT_HOST,
    )
    grpc = Relay(grpc_port, VAULT_HOST)
    try:
        wait_serving(f"{VAULT_HOST}:{grpc_port}", process, TOKENS["alice"])
        keys = {name: key_file(work, 1, name=f"{name}.keys") for name in TOKENS}
        yield RelayedVault(grpc, bulk, keys)
    finally:
        grpc.close()
        bulk.close()
        process.terminate()
        process.wait(timeout=30)


def store(tier: ColdTier, blocks: list[np.ndarray], namespace: bytes = NS) -> None:
    for index, block in enumerate(blocks):
        tier.store(namespace, KEYS[index], 0, block.copy())
    assert tier.flush(timeout=30)


def load(
    tier: ColdTier, blocks: list[np.ndarray], namespace: bytes = NS
) -> tuple[set[int], list[np.ndarray]]:
    outs = [np.zeros_like(block) for block in blocks]
    keys = KEYS[: len(blocks)]
    failed = tier.load(namespace, keys, {"kv": [0]}, lambda index, part: outs[index])
    return failed, outs


def bulk_transport(tier: ColdTier) -> str:
    client = tier.vaults["kv"]
    assert isinstance(client, VaultClient)
    return client.transport


def test_the_relay_finds_no_payload_plaintext_and_no_token_on_the_bulk_port(
    relayed: RelayedVault,
) -> None:
    relayed.forget()
    plain = relayed.tier("alice", sealed=False)
    try:
        store(plain, pattern_blocks(), namespace=b"unsealed-control")
    finally:
        plain.close()
    assert PROBE in relayed.bulk.sent  # the relay does see payloads that are not sealed
    relayed.forget()
    tier = relayed.tier("alice")
    try:
        blocks = pattern_blocks()
        store(tier, blocks)
        failed, outs = load(tier, blocks)
        assert failed == set() and all(map(np.array_equal, blocks, outs))
        assert bulk_transport(tier) == "bulk"
    finally:
        tier.close()
    recordings = [relayed.grpc.sent, relayed.grpc.received, relayed.bulk.sent]
    recordings.append(relayed.bulk.received)
    assert all(len(recording) > 0 for recording in recordings)
    assert not any(PROBE in recording for recording in recordings)
    assert not any(
        TOKENS["alice"].encode() in r for r in (relayed.bulk.sent, relayed.bulk.received)
    )


def test_the_relay_finds_no_token_on_the_grpc_port(relayed: RelayedVault) -> None:
    relayed.forget()
    tier = relayed.tier("alice")
    try:
        store(tier, pattern_blocks())
        load(tier, pattern_blocks())
    finally:
        tier.close()
    assert TOKENS["alice"].encode() not in relayed.grpc.sent


def flip_one_byte(index: object, payloads: list[bytes]) -> list[bytes]:
    changed = bytearray(payloads[1])
    changed[len(changed) // 2] ^= 0x01
    return [payloads[0], bytes(changed), *payloads[2:]]


def swap_two(index: object, payloads: list[bytes]) -> list[bytes]:
    return [payloads[0], payloads[2], payloads[1], payloads[3]]


def replay_at_another_key(index: object, payloads: list[bytes]) -> list[bytes]:
    return [*payloads[:3], payloads[0]]


@pytest.mark.parametrize(
    ("tamper", "changed"),
    [(flip_one_byte, {1}), (swap_two, {1, 2}), (replay_at_another_key, {3})],
)
def test_payloads_changed_on_the_wire_are_counted_misses_only(
    relayed: RelayedVault, tamper: Tamper, changed: set[int]
) -> None:
    relayed.forget()
    writer = relayed.tier("alice")
    blocks = pattern_blocks()
    try:
        store(writer, blocks)
    finally:
        writer.close()
    relayed.bulk.rewriter = lambda: BulkReplyRewriter(tamper, NS, KEYS[:4])
    tier = relayed.tier("alice")  # its bulk connection goes through the rewriting relay
    try:
        failed, outs = load(tier, blocks)
        client = tier.vaults["kv"]
        assert isinstance(client, VaultClient)
        assert bulk_transport(tier) == "bulk" and client.checksum_failures == 0
        assert failed == changed
        assert tier.stats()["open_failures"] == len(changed)
        for index in set(range(4)) - changed:
            assert np.array_equal(outs[index], blocks[index])
    finally:
        relayed.forget()
        tier.close()


def test_a_block_tenant_b_wrote_at_as_address_never_reaches_a_as_data(
    relayed: RelayedVault,
) -> None:
    """Bob, with his own valid token and data key, writes blocks at Alice's addresses. The vault
    keeps them apart (Alice misses); and where they reach her anyway (here the relay hands her
    Bob's payloads, as a vault whose isolation failed would), they do not open."""
    relayed.forget()
    bob, alice = relayed.tier("bob"), relayed.tier("alice")
    bob_client = VaultClient(f"127.0.0.1:{relayed.grpc.port}", token=TOKENS["bob"])
    try:
        blocks = pattern_blocks()
        store(bob, [np.flip(block) for block in blocks], TENANTS_NS)
        bobs = bob_client.promote(TENANTS_NS, KEYS[:4], [0])
        assert len(bobs) == 4
        bobs_payloads = [bytes(bobs[(index, 0)]) for index in range(4)]
        failed, _ = load(alice, blocks, TENANTS_NS)
        assert failed == {0, 1, 2, 3} and alice.stats()["open_failures"] == 0
        store(alice, blocks, TENANTS_NS)

        def bobs_instead(index: object, payloads: list[bytes]) -> list[bytes]:
            return bobs_payloads

        relayed.bulk.rewriter = lambda: BulkReplyRewriter(bobs_instead, TENANTS_NS, KEYS[:4])
        fresh = relayed.tier("alice")  # a new bulk connection, through the rewriting relay
        try:
            failed, outs = load(fresh, blocks, TENANTS_NS)
            assert failed == {0, 1, 2, 3} and fresh.stats()["open_failures"] == 4
            assert not any(
                np.array_equal(out, np.flip(block)) for out, block in zip(outs, blocks, strict=True)
            )
        finally:
            fresh.close()
    finally:
        relayed.forget()
        bob_client.close()
        bob.close()
        alice.close()
