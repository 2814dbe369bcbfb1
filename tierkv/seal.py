"""Sealed blocks: each payload encrypted and bound to its address by the engine (AES-256-GCM).

A vault, a Redis, a disk or a wire only ever holds sealed bytes; a block opens only under one of
the tenant's data keys and only at the address it was written for. A sealed payload is

    seal header: magic "TKVS" | version u8 | 0 u8 | key id u16 | clear bytes u32 | nonce 12 bytes
    clear part:  the payload's own header (`clear bytes` of it), in the clear but authenticated
    ciphertext:  the rest of the payload (its body), then the 16-byte GCM tag

(little-endian). The associated data is the seal header, the clear part and the block's address
(namespace, which fingerprints the model, key and part; see `block_address`), so a payload that
is changed, cut, moved to another key, part or namespace, or sealed under another tenant's key
does not open: `SealError`, which the tier counts and treats as a miss.

Nonces never repeat under a key: each Sealer draws a random 64-bit prefix and counts the blocks
it seals in the remaining 32 bits, drawing a new prefix before the count wraps. Two nonces can
only be equal when two draws of a prefix under one key are equal: with N draws (engine starts,
and one per 2^32 blocks sealed) that chance is below N^2 / 2^65, for N = 2^20 below 2^-25. Append
a new key to the file (rotation) long before a key has been drawn for that often.

Sealed copies are carved, one after the other, out of the pooled buffers the bulk client
receives into (transfer.RECEIVE_BUFFERS: already mapped, huge-page aligned); a buffer returns to the
pool once no sealed payload in it is referenced any more. Fresh memory would cost a page fault
per page of every sealed copy, which in a VM runs the seal at a fraction of the cipher's speed.

Data keys live in a file (`[security] data_key_file`) of lines `KEY_ID KEY`: KEY_ID a decimal
1..65535, KEY 32 random bytes in URL-safe base64 (unpadded); `#` starts a comment line. Every
key listed opens blocks, the last line's key seals new ones. Each tenant's engines hold their
tenant's file; vaults never see it.
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tierkv.config import ConfigError
from tierkv.transfer import RECEIVE_BUFFERS

MAGIC = b"TKVS"
VERSION = 1
KEY_BYTES = 32
"""AES-256."""
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_KEY_ID = 65535
_HEADER = struct.Struct("<4sBBHI12s")
HEADER_BYTES = _HEADER.size
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
"""Bytes a sealed payload has beyond the payload it seals."""
COUNTER_LIMIT = 1 << 32
"""Blocks a Sealer seals under one nonce prefix before it draws a new one."""
_LENGTH = struct.Struct("<I")


class SealError(ValueError):
    """A payload that does not open: not sealed, cut, changed, moved, or under an unknown key."""


def block_address(namespace: bytes, key: bytes, part: int) -> bytes:
    """The address a block is sealed for, each field length-prefixed (no two addresses share a
    byte string)."""
    return b"".join(
        (_LENGTH.pack(len(namespace)), namespace, _LENGTH.pack(len(key)), key, _LENGTH.pack(part))
    )


def read_data_keys(path: str | Path) -> tuple[dict[int, bytes], int]:
    """(key id -> key, id of the sealing key: the last line's) of a data key file; ConfigError
    naming the file and line for anything else than lines `KEY_ID KEY` of 32-byte keys."""
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"security.data_key_file {path}: cannot read: {exc}") from None
    keys: dict[int, bytes] = {}
    newest = 0
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"security.data_key_file {path}: line {number}"
        fields = line.split()
        if len(fields) != 2 or not fields[0].isdigit() or not 1 <= int(fields[0]) <= MAX_KEY_ID:
            raise ConfigError(
                f"{where}: expected KEY_ID KEY (KEY_ID 1..{MAX_KEY_ID}, KEY URL-safe base64)"
            )
        key_id = int(fields[0])
        try:
            key = base64.b64decode(fields[1] + "=" * (-len(fields[1]) % 4), b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"{where}: key {key_id} is not URL-safe base64") from None
        if len(key) != KEY_BYTES:
            raise ConfigError(
                f"{where}: key {key_id} is {len(key)} bytes; a data key is {KEY_BYTES} random "
                "bytes (tierkv secrets init writes one)"
            )
        if key_id in keys:
            raise ConfigError(f"{where}: key id {key_id} is listed twice")
        keys[key_id] = key
        newest = key_id
    if not keys:
        raise ConfigError(f"security.data_key_file {path}: no key in it")
    return keys, newest


def new_data_key_line(key_id: int) -> str:
    """A line of a data key file with a fresh random key."""
    key = base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).rstrip(b"=").decode()
    return f"{key_id} {key}\n"


class Sealer:
    """Seals payloads under the newest of a tenant's data keys and opens them under any."""

    def __init__(self, keys: Mapping[int, bytes], sealing_key_id: int) -> None:
        if sealing_key_id not in keys:
            raise ValueError(f"sealing key {sealing_key_id} is not among the keys")
        self._ciphers = {key_id: AESGCM(key) for key_id, key in keys.items()}
        self.key_id = sealing_key_id
        self._lock = threading.Lock()
        self._prefix = os.urandom(8)
        self._count = 0
        self._arena: np.ndarray | None = None  # the pooled buffer sealed copies are cut from
        self._arena_at = 0

    @classmethod
    def from_file(cls, path: str | Path) -> Sealer:
        """A sealer of the keys in data key file `path` (ConfigError: see read_data_keys)."""
        return cls(*read_data_keys(path))

    def seal(self, address: bytes, head: bytes, body: memoryview) -> tuple[bytes, memoryview]:
        """The sealed payload of `head` (sent in the clear, authenticated) and `body`
        (encrypted), as two pieces: the headers, and the ciphertext with its tag in memory of
        its own (`body` may be reused at once)."""
        header = _HEADER.pack(MAGIC, VERSION, 0, self.key_id, len(head), self._nonce())
        sealed = self._room(len(body) + TAG_BYTES)
        self._ciphers[self.key_id].encrypt_into(
            header[-NONCE_BYTES:], body, header + head + address, sealed
        )
        return header + head, sealed

    def opened_bytes(self, sealed: memoryview) -> int:
        """Bytes of the payload `sealed` holds (SealError when it is too short to be sealed)."""
        if len(sealed) < OVERHEAD_BYTES:
            raise SealError(f"{len(sealed)} bytes are too few for a sealed payload")
        return len(sealed) - OVERHEAD_BYTES

    def open_into(self, address: bytes, sealed: memoryview, out: memoryview) -> None:
        """Write the payload sealed in `sealed` for `address` into `out` (of `opened_bytes`);
        SealError when it does not open (`out` then holds anything)."""
        if len(out) != self.opened_bytes(sealed):
            raise SealError(f"{len(out)} bytes of room for a payload of {len(sealed)} sealed")
        magic, version, _, key_id, clear, nonce = _HEADER.unpack_from(sealed)
        if magic != MAGIC or version != VERSION:
            raise SealError("not a sealed payload")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise SealError(f"sealed under data key {key_id}, which this engine does not hold")
        if clear > len(out):
            raise SealError(f"clear part of {clear} bytes in a payload of {len(out)}")
        head = sealed[HEADER_BYTES : HEADER_BYTES + clear]
        out[:clear] = head
        try:
            cipher.decrypt_into(
                nonce,
                sealed[HEADER_BYTES + clear :],
                b"".join((sealed[:HEADER_BYTES], head, address)),
                out[clear:],
            )
        except InvalidTag:
            raise SealError("does not open: changed, moved or sealed under another key") from None

    def _room(self, size: int) -> memoryview:
        """`size` writable bytes that nothing else uses: the next ones of the current pooled
        buffer, of a new one when they do not fit (a larger size: memory of its own)."""
        if size > RECEIVE_BUFFERS.buffer_bytes:
            return np.empty(size, dtype=np.uint8).data
        with self._lock:
            if self._arena is None or self._arena_at + size > len(self._arena):
                self._arena, self._arena_at = RECEIVE_BUFFERS.take(), 0
            start = self._arena_at
            self._arena_at += size
            return self._arena.data[start : start + size]

    def _nonce(self) -> bytes:
        """The prefix and the count of this Sealer, a new prefix before the count wraps."""
        with self._lock:
            if self._count == COUNTER_LIMIT:
                self._prefix, self._count = os.urandom(8), 0
            count = self._count
            self._count += 1
            prefix = self._prefix
        return prefix + count.to_bytes(4, "big")
