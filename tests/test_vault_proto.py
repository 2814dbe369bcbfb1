"""The generated gRPC code matches proto/ and the fast bulk codec matches protobuf's encoding."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tierkv.transfer import batched_by_size
from tierkv.wire._pb import vault_pb2
from tierkv.wire.messages import MalformedMessage, decode_bulk, encode_bulk, split_payloads

REPO = Path(__file__).resolve().parent.parent


def load_gen_proto():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    gen_proto = load_gen_proto()
    for fresh in gen_proto.generate(tmp_path):
        committed = REPO / fresh.relative_to(tmp_path)
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.relative_to(REPO)} is stale: run `{sys.executable} scripts/gen_proto.py`"
        )


def test_bulk_encoding_is_what_protobuf_writes_and_reads() -> None:
    index = vault_pb2.PromoteIndex(
        key_indices=[0, 2], parts=[1, 1], lengths=[3, 200], checksums=[7, 8]
    )
    payloads = [b"abc", b"x" * 200]
    fast = encode_bulk(index, payloads)
    reference = vault_pb2.PromoteChunk(index=index, data=b"".join(payloads))
    assert fast == reference.SerializeToString()
    decoded, data = decode_bulk(fast, vault_pb2.PromoteIndex, vault_pb2.PromoteChunk)
    assert decoded == index and data.obj is fast  # a view, not a copy
    assert [bytes(p) for p in split_payloads(data, decoded.lengths)] == payloads


def test_decode_falls_back_to_protobuf_for_other_field_orders() -> None:
    index = vault_pb2.PutIndex(namespace=b"n", keys=[b"k"], parts=[0], lengths=[2], checksums=[1])
    data_first = b"\x12\x02hi" + b"\x0a" + bytes([index.ByteSize()]) + index.SerializeToString()
    decoded, data = decode_bulk(data_first, vault_pb2.PutIndex, vault_pb2.PutBatch)
    assert decoded == index and bytes(data) == b"hi"


def test_malformed_messages_raise() -> None:
    with pytest.raises(MalformedMessage):
        decode_bulk(b"\x0a\xff", vault_pb2.PutIndex, vault_pb2.PutBatch)
    with pytest.raises(MalformedMessage, match="sum to 5"):
        split_payloads(memoryview(b"abcd"), [2, 3])


def test_batched_by_size_groups_and_isolates_oversize_items() -> None:
    items = [("a", 3), ("a", 3), ("a", 9), ("b", 1), ("b", 1)]
    batches = list(batched_by_size(items, lambda i: i[1], 6, lambda i: i[0]))
    assert [[size for _, size in batch] for batch in batches] == [[3, 3], [9], [1, 1]]
