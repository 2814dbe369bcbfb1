"""Fair share on the disk tier: a real `tierkv vault --disk-dir` process of two tenants on
loopback. Alice holds a quarter of the disk (RAM is small, so her blocks live on disk); Bob then
writes four times the disk, the vault restarting halfway; Alice must still have every block,
byte for byte. The figures (Alice's blocks kept, the bytes copied forward during Bob's flood)
are printed for the closing note (run with -s).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from helpers import VaultHandle, key, pick_free_port
from test_vault_attacks import token_file
from test_vault_auth import ALICE, BOB
from test_vault_metrics import scrape

from tierkv.backends.vault import VaultClient
from tierkv.sizes import MIB

NS = b"disk-share-00000"
BLOCK = 256 * 1024
DISK_CAP = 24 * MIB
ALICE_BLOCKS = 24
"""6 MiB: a quarter of the disk (the red team's 24 MiB of 96 MiB, scaled down by 4)."""
BOB_BLOCKS = 400
"""100 MiB: about four times the disk (their 400 MiB)."""
BATCH = 50
KEPT = ("tierkv_vault_disk_kept_blocks_total", ())
EVICTED = ("tierkv_vault_evictions_total", (("tier", "disk"),))


def payload(tenant: bytes, i: int) -> bytes:
    return (tenant + i.to_bytes(4, "little")) * (BLOCK // (len(tenant) + 4))


def put_all(address: str, token: str, tenant: bytes, count: int, first: int = 0) -> None:
    """Store `count` blocks of `tenant` from number `first`, each batch acknowledged before the
    next."""
    with VaultClient(address, token=token, deadline_s=60, max_pending_bytes=64 * MIB) as client:
        for start in range(first, first + count, BATCH):
            for i in range(start, min(first + count, start + BATCH)):
                client.put(NS, key(i), 0, payload(tenant, i))
            assert client.flush(timeout=120), client.counters()
        assert client.stored_puts == count, client.counters()


def test_a_tenant_within_its_disk_share_keeps_every_block_through_anothers_flood(
    vault_factory: Callable[..., VaultHandle], tmp_path: Path
) -> None:
    tokens = token_file(tmp_path, alice=ALICE, bob=BOB)
    args = ["--disk-dir", str(tmp_path / "disk"), "--disk-max-bytes", str(DISK_CAP)]

    def start() -> tuple[VaultHandle, str]:
        metrics = pick_free_port()
        config = (
            f'[security]\ntoken_file = "{tokens}"\n'
            f'[vault]\nfsync = "never"\nmetrics_port = {metrics}\n'
        )
        vault = vault_factory("2MiB", subprocess=True, args=args, config=config, token=ALICE)
        return vault, f"127.0.0.1:{metrics}"

    vault, metrics = start()
    put_all(vault.address, ALICE, b"alice", ALICE_BLOCKS)
    before = scrape(metrics)
    put_all(vault.address, BOB, b"bob", BOB_BLOCKS // 2)
    halfway = scrape(metrics)
    vault.stop()  # the share is counted again from what recovery finds
    vault, metrics = start()
    put_all(vault.address, BOB, b"bob", BOB_BLOCKS // 2, first=BOB_BLOCKS // 2)
    after = scrape(metrics)
    assert halfway[EVICTED] > 0 and after[EVICTED] > 0
    with VaultClient(vault.address, token=ALICE, promote_deadline_s=60) as alice:
        found = alice.promote(NS, [key(i) for i in range(ALICE_BLOCKS)], [0])
        assert alice.checksum_failures == 0
    held = {index: bytes(data) for (index, _), data in found.items()}
    kept = int(halfway[KEPT] - before[KEPT] + after[KEPT])
    copied = kept * BLOCK
    print(
        f"disk fair share: alice kept {len(held)} of {ALICE_BLOCKS} blocks "
        f"({ALICE_BLOCKS * BLOCK // MIB} MiB of a {DISK_CAP // MIB} MiB disk) after bob wrote "
        f"{BOB_BLOCKS * BLOCK // MIB} MiB; copied forward meanwhile: {kept} blocks"
        f", {copied / MIB:.0f} MiB ({copied / (BOB_BLOCKS * BLOCK):.0%} of bob's writes)"
    )
    assert held == {i: payload(b"alice", i) for i in range(ALICE_BLOCKS)}
