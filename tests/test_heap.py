"""Freed memory kept for reuse (tierkv.heap): a tier's encodes write into mapped pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tierkv.config import ConfigError, config_from_mapping
from tierkv.heap import _mallopt
from tierkv.sizes import MIB

BLOCKS = 160
BLOCK_VALUES = 1 << 20  # fp16: 2 MiB a block, about 1 MiB an int8 payload
ROUNDS = 2
PAYLOAD_PAGES = BLOCKS * ROUNDS * (BLOCK_VALUES // 4096)

# A tier encodes a batch of blocks on its two encode threads, the payloads all alive at once (as
# a put queue holds them), then lets them go; the page faults of the later batches are counted.
_ENCODE_BATCHES = f"""
import resource, sys
import numpy as np
from tierkv.config import config_from_mapping
from tierkv.quant import get_codec
from tierkv.tier import ColdTier
from tierkv.heap import keep_freed_memory

keep_freed_memory(config_from_mapping({{"client.kept_freed_bytes": sys.argv[1]}}, "test")
                  .client.kept_freed_bytes)
tier = ColdTier(get_codec("int8"), {{}})
rng = np.random.default_rng(0)
blocks = [rng.standard_normal({BLOCK_VALUES}, dtype=np.float32).astype(np.float16)
          for _ in range({BLOCKS})]
for _ in range(3):  # kernels compiled, threads started, arenas grown
    tier.stored_forms(blocks)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({ROUNDS}):
    tier.stored_forms(blocks)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
tier.close()
"""


def _page_faults_encoding(kept_freed_bytes: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _ENCODE_BATCHES, kept_freed_bytes],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(_mallopt() is None, reason="the C library is not glibc")
def test_encoded_payloads_reuse_freed_memory_instead_of_faulting_in_fresh_pages() -> None:
    kept = _page_faults_encoding("256MiB")
    default = _page_faults_encoding("0")
    # glibc's defaults give a freed batch back to the kernel: nearly every payload page faults.
    assert default > PAYLOAD_PAGES // 2, (default, PAYLOAD_PAGES)
    # Kept: a few percent fault (new heaps, the encode threads' arenas settling; 1-12 % here).
    assert kept < PAYLOAD_PAGES // 4, (kept, PAYLOAD_PAGES)


def test_kept_freed_bytes_is_a_size_and_may_be_zero() -> None:
    assert config_from_mapping({}, "test").client.kept_freed_bytes == 256 * MIB
    assert (
        config_from_mapping({"client.kept_freed_bytes": "0"}, "test").client.kept_freed_bytes == 0
    )
    with pytest.raises(ConfigError, match="kept_freed_bytes"):
        config_from_mapping({"client.kept_freed_bytes": "-1"}, "test")
