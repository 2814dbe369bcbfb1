"""Fast (de)serialisation of the bulk messages PutBatch and PromoteChunk.

Byte-compatible with the generated protobuf classes: `encode_bulk` writes field 1 (the small
index, serialised by protobuf) and then field 2 (the payloads, concatenated with one copy);
`decode_bulk` parses the index with protobuf and returns the payload area as a memoryview of the
received buffer, so payloads are sliced out without copying. A message whose fields come in
another order (another writer) is parsed by the generated class instead. `block_checksum` is the
checksum every payload travels with, on the gRPC and the bulk path alike.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from functools import lru_cache
from typing import Any, TypeVar

import xxhash
from google.protobuf.message import DecodeError, Message

CHANNEL_OPTIONS = [
    # Bulk messages are bounded by the chunking, not by gRPC's 4 MiB default.
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]
"""gRPC options both ends of a vault connection use."""

_INDEX_TAG = 0x0A  # field 1, length-delimited
_DATA_TAG = 0x12  # field 2, length-delimited

IndexT = TypeVar("IndexT", bound=Message)
ItemT = TypeVar("ItemT")


HOLDING_GIL_BYTES = 64 * 1024
"""xxhash gives the GIL back while it hashes more than this in one call."""


def block_checksum(
    namespace: bytes,
    key: bytes,
    part: int,
    payload: bytes | memoryview,
    *more: bytes | memoryview,
    hold_gil: bool = False,
) -> int:
    """The checksum a payload travels and is stored with: xxh3_64 of the payload, seeded with
    its address, so a payload filed or returned under another (namespace, key, part) fails its
    check exactly like a corrupted one. A payload received in pieces: `payload, *more`.

    `hold_gil` (in an engine's process) hashes in slices of HOLDING_GIL_BYTES, so the GIL is
    never given back: each time it is, a thread busy in Python may keep it for a switch
    interval (5 ms), per block. A vault gives it back, so its other threads run meanwhile."""
    return checksum_at(address_prefix(namespace, part) + key, (payload, *more), hold_gil)


def checksum_at(
    address: bytes, pieces: Sequence[bytes | memoryview], hold_gil: bool = False
) -> int:
    """block_checksum of the payload in `pieces` at `address`, which is
    `address_prefix(namespace, part) + key` (a caller checking many blocks of a part makes the
    prefix once)."""
    seed = xxhash.xxh3_64_intdigest(address)
    if len(pieces) == 1 and (not hold_gil or len(pieces[0]) <= HOLDING_GIL_BYTES):
        return xxhash.xxh3_64_intdigest(pieces[0], seed=seed)
    hasher = xxhash.xxh3_64(seed=seed)
    for piece in pieces:
        if not hold_gil or len(piece) <= HOLDING_GIL_BYTES:
            hasher.update(piece)
            continue
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), HOLDING_GIL_BYTES):
            hasher.update(view[start : start + HOLDING_GIL_BYTES])
    return hasher.intdigest()


@lru_cache(maxsize=256)
def address_prefix(namespace: bytes, part: int) -> bytes:
    """What a block's address starts with: the same for every key of a namespace's part."""
    return struct.pack("<II", len(namespace), part) + namespace


class MalformedMessage(ValueError):
    """A bulk message that does not parse or whose index does not match its payload area."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(buf):
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise MalformedMessage("truncated varint")


def already_encoded(message: bytes) -> bytes:
    """gRPC serializer for messages that encode_bulk has already serialised."""
    return message


def encode_bulk(index: Message, payloads: Sequence[bytes | memoryview]) -> bytes:
    """One serialised bulk message: `index` as field 1, the concatenated `payloads` as field 2."""
    index_bytes = index.SerializeToString()
    data_len = sum(len(p) for p in payloads)
    head = b"%c%s%s%c%s" % (
        _INDEX_TAG,
        _varint(len(index_bytes)),
        index_bytes,
        _DATA_TAG,
        _varint(data_len),
    )
    return b"".join([head, *payloads])


def decode_bulk(
    buf: bytes, index_type: type[IndexT], message_type: type[Message]
) -> tuple[IndexT, memoryview]:
    """(index, payload area) of a serialised `message_type` whose field 1 is an `index_type`."""
    try:
        if len(buf) >= 2 and buf[0] == _INDEX_TAG:
            index_len, pos = _read_varint(buf, 1)
            index = index_type.FromString(buf[pos : pos + index_len])
            pos += index_len
            if pos < len(buf) and buf[pos] == _DATA_TAG:
                data_len, pos = _read_varint(buf, pos + 1)
                if pos + data_len == len(buf):
                    return index, memoryview(buf)[pos:]
        message: Any = message_type.FromString(buf)
    except DecodeError as exc:
        raise MalformedMessage(f"cannot parse {message_type.__name__}: {exc}") from None
    return message.index, memoryview(message.data)


def split_payloads(data: memoryview, lengths: Sequence[int]) -> list[memoryview]:
    """Slices of `data` of the given lengths; MalformedMessage unless they cover it exactly."""
    if sum(lengths) != len(data):
        raise MalformedMessage(
            f"index lengths sum to {sum(lengths)} bytes but the message carries {len(data)}"
        )
    slices = []
    offset = 0
    for length in lengths:
        slices.append(data[offset : offset + length])
        offset += length
    return slices


def batched_by_size(
    items: Iterable[ItemT],
    size_of: Callable[[ItemT], int],
    max_bytes: int,
    group_of: Callable[[ItemT], Hashable] | None = None,
    max_items: int = sys.maxsize,
) -> Iterator[list[ItemT]]:
    """Consecutive runs of `items` (of one `group_of`, when given), each about `max_bytes` (an
    oversize item alone) and of at most `max_items`. One call of each function per item: this
    runs once per block on a restore's path."""
    batch: list[ItemT] = []
    size = 0
    group: Hashable = None
    for item in items:
        item_size = size_of(item)
        item_group = group_of(item) if group_of is not None else None
        if batch and (
            size + item_size > max_bytes or len(batch) >= max_items or item_group != group
        ):
            yield batch
            batch, size = [], 0
        if not batch:
            group = item_group
        batch.append(item)
        size += item_size
    if batch:
        yield batch
