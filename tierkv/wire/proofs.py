"""Call proofs, what both ends of a vault connection compute: a client to prove it holds a
token, the vault to check it (tierkv/vault/auth.py), without the token crossing the wire.

- every gRPC call carries a fresh proof in its `tierkv-proof` metadata (`call_proof`): the
  token's key id, the time, a random nonce and HMAC-SHA256(token, method, key id, time, nonce);
- a bulk connection proves it before its first frame by answering the vault's random nonce with
  HMAC-SHA256(token, nonce) (`proof`).

docs/security-wire.md says what they protect against and what not.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections.abc import Sequence
from typing import Any

PROOF_METADATA_KEY = "tierkv-proof"
PROOF_VERSION = "v1"
PROOF_WINDOW_S = 60.0
"""How far a call proof's time may be from the vault's clock; its nonce is remembered as long."""
CALL_NONCE_BYTES = 16
_STAMP = re.compile(r"[0-9]{1,15}")
"""A proof's time in ms: ASCII digits, at most 15 (beyond the year 30000), so no proof costs the
vault a conversion of a huge number."""
NONCE_BYTES = 32


def proof(token: str, nonce: bytes) -> bytes:
    """What a bulk client answers the vault's nonce with."""
    return hmac.new(token.encode(), b"tierkv-bulk-v1" + nonce, hashlib.sha256).digest()


def key_id(token: str) -> str:
    """How a call proof names its token without revealing it (16 hex digits of an HMAC)."""
    return hmac.new(token.encode(), b"tierkv-key-id-v1", hashlib.sha256).hexdigest()[:16]


def call_mac(token: str, method: str, key: str, stamp_ms: int, nonce: str) -> str:
    """HMAC-SHA256(token) over one call's method, key id, time (ms) and nonce, in hex."""
    message = f"tierkv-call-v1\n{method}\n{key}\n{stamp_ms}\n{nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def call_proof(token: str, method: str, now: float | None = None) -> str:
    """A fresh `tierkv-proof` value for one call to `method` (full name, "/pkg.Service/Name")."""
    key = key_id(token)
    stamp = int((time.time() if now is None else now) * 1000)
    nonce = os.urandom(CALL_NONCE_BYTES).hex()
    return ".".join(
        (PROOF_VERSION, key, str(stamp), nonce, call_mac(token, method, key, stamp, nonce))
    )


def proof_fields(metadata: Sequence[tuple[str, Any]] | None) -> tuple[str, int, str, str] | None:
    """(key id, time ms, nonce, mac) of a call's `tierkv-proof`; None when absent or malformed."""
    for name, value in metadata or ():
        if name != PROOF_METADATA_KEY or not isinstance(value, str):
            continue
        parts = value.split(".")
        if len(parts) != 5 or parts[0] != PROOF_VERSION or not _STAMP.fullmatch(parts[2]):
            return None
        if len(parts[3]) != 2 * CALL_NONCE_BYTES or len(parts[4]) != 64:
            return None
        return parts[1], int(parts[2]), parts[3], parts[4]
    return None
