"""Fast (de)serialisation of the bulk messages PutBatch and PromoteChunk.

Byte-compatible with the generated protobuf classes: `encode_bulk` writes field 1 (the small
index, serialised by protobuf) and then field 2 (the payloads, concatenated with one copy);
`decode_bulk` parses the index with protobuf and returns the payload area as a memoryview of the
received buffer, so payloads are sliced out without copying. A message whose fields come in
another order (another writer) is parsed by the generated class instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

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
