"""Recovery under random records whose payloads tenants chose (hypothesis), cut at every offset.

Each example writes records of two tenants' namespaces (blocks, deletes, clears) through a real
DiskTier; a payload is made of random bytes, records forged with every checksum a tenant can
compute (both formats, blocks and CLEARs of the other tenant's namespace), and copies of real
records written earlier (header and payload as the vault wrote them). The segment is then cut at
every offset of a few records and recovered: every block served must be byte for byte one that
was acknowledged at that exact address, and while no copy of a real record lies before the cut,
every block the records before the cut left must be served.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from helpers import key
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_vault_disk import forged_record

from tierkv.checksum import block_checksum
from tierkv.sizes import MIB
from tierkv.vault.disk import KIND_BLOCK, KIND_CLEAR, KIND_DELETE, DiskTier

TENANTS = [b"A" * 16, b"B" * 16]
KEYS = 3
PARTS = 2
CUT_RECORDS = 2
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

Address = tuple[bytes, bytes, int]

forged = st.builds(
    forged_record,
    st.sampled_from([KIND_BLOCK, KIND_CLEAR]),
    st.sampled_from(TENANTS),
    st.sampled_from([key(i) for i in range(KEYS)]),
    st.binary(max_size=48),
    st.sampled_from([b"TKVR", b"TKV2"]),
)
chunk = st.one_of(
    st.binary(max_size=64),
    forged,
    st.integers(min_value=0, max_value=1_000),  # a copy of the real record nearest this index
)
operation = st.tuples(
    st.sampled_from([KIND_BLOCK] * 4 + [KIND_DELETE, KIND_CLEAR]),
    st.sampled_from(TENANTS),
    st.integers(min_value=0, max_value=KEYS - 1),
    st.integers(min_value=0, max_value=PARTS - 1),
    st.lists(chunk, max_size=4),
)


def segment_of(directory: Path) -> Path:
    [segment] = directory.glob("*.seg")
    return segment


def replay(records: list[tuple[int, Address, bytes]]) -> dict[Address, bytes]:
    """The blocks `records` leave, replayed in order as the vault does."""
    state: dict[Address, bytes] = {}
    for kind, (namespace, block_key, part), data in records:
        if kind == KIND_BLOCK:
            state[namespace, block_key, part] = data
        elif kind == KIND_DELETE:
            state = {a: d for a, d in state.items() if a[:2] != (namespace, block_key)}
        else:
            state = {a: d for a, d in state.items() if a[0] != namespace}
    return state


def served(directory: Path) -> dict[Address, bytes]:
    """Every block a DiskTier recovered from `directory` serves."""
    disk = DiskTier(directory, 64 * MIB, "never")
    try:
        found = {}
        wanted = [(key(i), part) for i in range(KEYS) for part in range(PARTS)]
        for namespace in TENANTS:
            for (block_key, part), block in zip(
                wanted, disk.read_many(namespace, wanted), strict=True
            ):
                if block is not None:
                    found[namespace, block_key, part] = bytes(block[0])
        return found
    finally:
        disk.close()


@SETTINGS
@given(st.lists(operation, min_size=2, max_size=6), st.data())
def test_recovery_serves_only_acknowledged_blocks_wherever_the_segment_is_cut(
    operations: list[tuple[int, bytes, int, int, list[bytes | int]]], data: st.DataObject
) -> None:
    work = Path(tempfile.mkdtemp(prefix="tierkv-fuzz-"))
    try:
        written = work / "written"
        disk = DiskTier(written, 64 * MIB, "never")
        acknowledged: dict[Address, set[bytes]] = {}
        records: list[tuple[int, Address, bytes]] = []
        spans: list[tuple[int, int]] = []  # each record's (start, end) in the segment
        copies: list[bool] = []  # whether its payload holds a copy of a real record
        for kind, namespace, index, part, chunks in operations:
            image = segment_of(written).read_bytes()
            real = [image[start:end] for start, end in spans]
            payload = b"".join(
                c if isinstance(c, bytes) else real[c % len(real)] if real else b"" for c in chunks
            )
            address = (namespace, key(index), part)
            if kind == KIND_BLOCK:
                checksum = block_checksum(*address, payload)
                disk.write(*address, payload, checksum)
            elif kind == KIND_DELETE:
                disk.delete(namespace, [key(index)])
            else:
                disk.clear(namespace)
            assert disk.wait_written(disk.mark(), timeout=30)
            if kind == KIND_BLOCK:
                acknowledged.setdefault(address, set()).add(payload)
            records.append((kind, address, payload))
            spans.append((len(image), segment_of(written).stat().st_size))
            copies.append(bool(real) and any(isinstance(c, int) for c in chunks))
        disk.close()
        image = segment_of(written).read_bytes()
        cut_at = data.draw(
            st.lists(
                st.integers(0, len(records) - 1), min_size=1, max_size=CUT_RECORDS, unique=True
            )
        )
        recovered = work / "recovered"  # the same directory but for its segment
        shutil.copytree(written, recovered, ignore=shutil.ignore_patterns("*.seg", "lock"))
        for record in cut_at:
            start, end = spans[record]
            before = replay(records[:record])
            for cut in range(start, end):
                for stale in recovered.glob("*.seg"):
                    stale.unlink()
                (recovered / "0000000001.seg").write_bytes(image[:cut])
                found = served(recovered)
                for address, block in found.items():
                    assert block in acknowledged.get(address, ()), (record, cut, address)
                if not any(copies[: record + 1]):
                    assert found == before, (record, cut)
    finally:
        shutil.rmtree(work, ignore_errors=True)
