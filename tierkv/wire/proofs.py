"""Call proofs, what both ends of a vault connection compute: a client to prove it holds a
token, the vault to check it (tierkv/vault/auth.py), without the token crossing the wire.

- every gRPC call carries a fresh proof in its `tierkv-proof` metadata (`call_proof`): the
  token's key id, the time, a random nonce, the vault's run and HMAC-SHA256(token, run, method,
  key id, time, nonce). The run is a random value a vault draws at each start (`new_run`): it
  names that vault and that run of it, so a proof is accepted by no other vault sharing the
  token, nor by the same vault after a restart. A vault tells its run in the trailing metadata
  of every call it refuses (`RUN_METADATA_KEY`), so a client learns it by asking once
  (`RUN_QUERY` in place of a proof) and again after the vault restarted;
- a bulk connection proves it before its first frame by answering the vault's random nonce with
  HMAC-SHA256(token, nonce) (`proof`): a nonce is already bound to its vault and its run.

docs/security-wire.md says what they protect against and what not.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

PROOF_METADATA_KEY = "tierkv-proof"
PROOF_VERSION = "v2"
PROOF_WINDOW_S = 60.0
"""How far a call proof's time may be from the vault's clock; its nonce is remembered as long."""
RUN_METADATA_KEY = "tierkv-run"
"""Trailing metadata of a refused call: the run of the vault that refused it."""
RUN_QUERY = "run?"
"""A `tierkv-proof` that asks the vault for its run (refused, and not counted as a failure)."""
RUN_BYTES = 16
CALL_NONCE_BYTES = 16
NONCE_BYTES = 32
_STAMP = re.compile(r"[0-9]{1,15}")
"""A proof's time in ms: ASCII digits, at most 15 (beyond the year 30000), so no proof costs the
vault a conversion of a huge number."""
_HEX = re.compile(r"[0-9a-f]*")


class CallProof(NamedTuple):
    """The fields of a `tierkv-proof`."""

    key: str
    stamp_ms: int
    nonce: str
    run: str
    mac: str


def proof(token: str, nonce: bytes) -> bytes:
    """What a bulk client answers the vault's nonce with."""
    return hmac.new(token.encode(), b"tierkv-bulk-v1" + nonce, hashlib.sha256).digest()


def key_id(token: str) -> str:
    """How a call proof names its token without revealing it (16 hex digits of an HMAC)."""
    return hmac.new(token.encode(), b"tierkv-key-id-v1", hashlib.sha256).hexdigest()[:16]


def new_run() -> str:
    """A vault's run: random, drawn at each start (hex)."""
    return os.urandom(RUN_BYTES).hex()


def call_mac(token: str, method: str, key: str, stamp_ms: int, nonce: str, run: str) -> str:
    """HMAC-SHA256(token) over the vault's run and one call's method, key id, time (ms) and
    nonce, in hex."""
    message = f"tierkv-call-v2\n{run}\n{method}\n{key}\n{stamp_ms}\n{nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def call_proof(token: str, method: str, run: str, now: float | None = None) -> str:
    """A fresh `tierkv-proof` value for one call to `method` (full name, "/pkg.Service/Name")
    of the vault whose run is `run`."""
    key = key_id(token)
    stamp = int((time.time() if now is None else now) * 1000)
    nonce = os.urandom(CALL_NONCE_BYTES).hex()
    mac = call_mac(token, method, key, stamp, nonce, run)
    return ".".join((PROOF_VERSION, key, str(stamp), nonce, run, mac))


def proof_fields(metadata: Sequence[tuple[str, Any]] | None) -> CallProof | None:
    """The fields of a call's `tierkv-proof`; None when absent or malformed."""
    for name, value in metadata or ():
        if name != PROOF_METADATA_KEY or not isinstance(value, str):
            continue
        parts = value.split(".")
        if len(parts) != 6 or parts[0] != PROOF_VERSION or not _STAMP.fullmatch(parts[2]):
            return None
        _, key, stamp, nonce, run, mac = parts
        if len(nonce) != 2 * CALL_NONCE_BYTES or len(run) != 2 * RUN_BYTES or len(mac) != 64:
            return None
        if not _HEX.fullmatch(run):
            return None
        return CallProof(key, int(stamp), nonce, run, mac)
    return None


def asks_for_run(metadata: Sequence[tuple[str, Any]] | None) -> bool:
    """Whether a call's `tierkv-proof` is RUN_QUERY."""
    return any(name == PROOF_METADATA_KEY and value == RUN_QUERY for name, value in metadata or ())


def run_of(metadata: Sequence[Any] | None) -> str | None:
    """The vault's run told in (trailing) metadata; None when it tells none."""
    for name, value in metadata or ():
        if name == RUN_METADATA_KEY and isinstance(value, str):
            return value
    return None
