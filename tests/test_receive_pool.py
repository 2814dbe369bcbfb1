"""The client's receive buffers are mapped and touched when a tier starts, so a restore into them
faults no page in (the first restore of a new engine as fast as the next ones)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import VaultHandle, key

from tierkv.backends.vault import VaultClient
from tierkv.config import ConfigError, config_from_mapping
from tierkv.sizes import MIB
from tierkv.transfer import ReceiveBuffers

NS = b"p" * 16
BLOCKS = 64
"""1 MiB blocks restored and all held at once: eight pooled buffers of 8 MiB."""
FAULT_SLACK = 8
"""Minor faults a restore into touched buffers may still take (measured: 3 or 4). Python's own
small objects (the blocks' list and views, the reply's index) come from its allocator's arenas,
which map a new 256 KiB arena now and then, and the kernel may fault a page of a thread's stack
or the socket's. Untouched buffers fault at least once per huge page they hold: 32 here, and
2048 per buffer (16384) where transparent huge pages are off."""

RESTORE = """
import resource, sys
from tierkv.config import config_from_mapping
from tierkv.tier import ColdTier
address, pool, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = config_from_mapping(
    {"cluster.kv_cold": address, "client.receive_pool_bytes": pool}, source="test"
)
tier = ColdTier.from_config(cfg, warm_dtypes=())
keys = [i.to_bytes(16, "little") for i in range(blocks + 1)]  # helpers.key
held = []
# A new client's first call: the connection (and the tier's threads), one block of one byte.
assert not tier.load_blocks(b"p" * 16, keys[-1:], {"kv": [0]}, lambda arrived: set())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
failed = tier.load_blocks(
    b"p" * 16, keys[:-1], {"kv": [0]}, lambda arrived: held.append(arrived) or set()
)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
assert not failed and sum(len(b[2]) for run in held for b in run) == blocks << 20
print(faults)
tier.close()
"""


def restore_faults(vault: VaultHandle, pool: str) -> int:
    """Minor page faults of a fresh process's first restore of BLOCKS blocks, its pool `pool`."""
    done = subprocess.run(
        [sys.executable, "-c", RESTORE, vault.address, pool, str(BLOCKS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(done.stdout.split()[-1])


def test_a_restore_into_the_pool_filled_at_start_faults_no_page_in(vault: VaultHandle) -> None:
    with VaultClient(vault.address) as client:
        for i in range(BLOCKS):
            client.put(NS, key(i), 0, bytes([i]) * MIB)
        client.put(NS, key(BLOCKS), 0, b"x")
        assert client.flush(timeout=30)
    assert restore_faults(vault, f"{BLOCKS}MiB") <= FAULT_SLACK
    assert restore_faults(vault, "0") > FAULT_SLACK  # the pool left empty: the test can fail


def test_fill_touches_whole_buffers_up_to_the_cap() -> None:
    pool = ReceiveBuffers(1024, 4096)
    assert pool.fill(1500) == 2048  # whole buffers
    assert pool.fill(1000) == 2048  # never shrinks
    assert pool.fill(1 << 20) == 4096  # at most the cap
    assert all(not buf.any() for buf in pool._buffers)  # written (zeros): touched
    taken = pool.take()
    assert any(taken is buf for buf in pool._buffers)


def test_receive_pool_bytes_is_a_size_and_may_be_zero() -> None:
    empty = config_from_mapping({"client.receive_pool_bytes": "0"}, "test")
    assert empty.client.receive_pool_bytes == 0
    cfg = config_from_mapping({"client.receive_pool_bytes": "16MiB"}, "test")
    assert cfg.client.receive_pool_bytes == 16 * MIB
    with pytest.raises(ConfigError, match="receive_pool_bytes"):
        config_from_mapping({"client.receive_pool_bytes": "-1"}, "test")
