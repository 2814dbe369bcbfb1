"""reuse_freed_memory() works on glibc: payload-sized buffers stop faulting in fresh pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys
from tierkv.vault.memory import reuse_freed_memory

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
