"""reuse_freed_memory() works on glibc: payload-sized buffers stop faulting in fresh pages, in a
script and in a real `tierkv vault` process; freeze_startup_objects() leaves a full garbage
collection little to visit."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import VaultHandle

from tierkv.backends.vault import VaultClient
from tierkv.sizes import MIB

SCRIPT = """
import resource, sys
from tierkv.heap import reuse_freed_memory

if sys.argv[1] == "tuned":
    assert reuse_freed_memory()

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def churn():
    kept = [bytes(bytearray(1 << 20)) for _ in range(64)]
    del kept

churn()
before = faults()
churn()
print(faults() - before)
"""


def second_round_faults(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return int(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_freed_payload_memory_is_reused() -> None:
    # 64 MiB of 1 MiB buffers is ~16k pages; reused memory needs (almost) none of them again.
    assert second_round_faults("tuned") < 1000 < second_round_faults("default")


def minor_faults(pid: int) -> int:
    """Minor page faults of process `pid` so far (field 10 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning, /proc")
def test_a_tierkv_vault_process_reuses_freed_payload_memory(
    vault_factory: Callable[..., VaultHandle],
) -> None:
    """Fill-and-evict cycles through a 32 MiB vault: once warm, each 64 MiB cycle of 1 MiB
    payloads is stored in memory freed by the evicted ones, so the vault process barely faults
    (5 faults for 65536 pages here; with the tuning left out of `tierkv vault`, glibc returned
    freed memory and faulted it in again: 5556)."""
    vault = vault_factory("32MiB", subprocess=True)
    assert vault.process is not None
    payload = bytes(range(256)) * 4096
    cycles, per_cycle = 6, 64

    def cycle(number: int) -> None:
        with VaultClient(vault.address, deadline_s=30, max_pending_bytes=128 * MIB) as client:
            for i in range(per_cycle):
                client.put(b"memory-test-0000", (number * per_cycle + i).to_bytes(16), 0, payload)
            assert client.flush(timeout=120) and client.stored_puts == per_cycle

    for number in range(2):  # the heap grows to the vault's cap
        cycle(number)
    before = minor_faults(vault.process.pid)
    for number in range(2, cycles):
        cycle(number)
    faults = minor_faults(vault.process.pid) - before
    pages = (cycles - 2) * per_cycle * len(payload) // 4096
    print(f"{faults} minor faults in the vault for {pages} pages of payload stored and evicted")
    assert faults < pages // 64


FREEZE_SCRIPT = """
import gc
from tierkv.vault.server import serve
from tierkv.vault.memory import freeze_startup_objects

vault = serve("127.0.0.1:0")
gc.collect()
before = len(gc.get_objects())
freeze_startup_objects()
print(before, len(gc.get_objects()), gc.get_freeze_count())
vault.stop(None)
"""


def test_a_serving_vaults_startup_objects_are_out_of_the_collectors_sight() -> None:
    """Without the freeze, every full collection in a vault visits the tens of thousands of
    objects start-up made (modules, gRPC; about 47k in `tierkv vault`), a pause of 15-35 ms
    here for every thread, each Promote in flight included."""
    command = [sys.executable, "-c", FREEZE_SCRIPT]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    before, after, frozen = map(int, result.stdout.split())
    assert before > 20000 and frozen > before // 2 and after < before // 20
