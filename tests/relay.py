"""A TCP relay on 127.0.0.1 that records every byte both ways and can rewrite what the server
sends: the man in the middle of the security tests.

`Relay(target_port, target_host=..., port=0, rewriter=None)` accepts connections on
127.0.0.1:`port` (0: a free one; `.port` says which) and joins each to target_host:target_port.
`.sent` holds every byte the clients sent, `.received` every byte they received (after any
rewriting), over all connections. `rewriter()` makes, per connection, an object whose `feed(data)`
returns what the client gets instead of the server's `data` (it may hold bytes back).
`BulkReplyRewriter` is one for the vault's bulk port: it hands each PROMOTE_REPLY frame's
payloads to a `tamper` function and gives the payloads it returns their vault checksums anew, as
an attacker who knows the (unkeyed) checksum would.
`.close()` stops it and closes every connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Protocol

from tierkv.checksum import block_checksum
from tierkv.wire._pb import vault_pb2
from tierkv.wire.framing import HEADER, MAGIC, PROMOTE_REPLY
from tierkv.wire.messages import split_payloads

LOOPBACK = "127.0.0.1"


class Rewriter(Protocol):
    def feed(self, data: bytes) -> bytes: ...


class Relay:
    """See the module docstring."""

    def __init__(
        self,
        target_port: int,
        target_host: str = LOOPBACK,
        port: int = 0,
        rewriter: Callable[[], Rewriter] | None = None,
    ) -> None:
        self.target = (target_host, target_port)
        self.rewriter = rewriter
        self.sent = bytearray()
        self.received = bytearray()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server((LOOPBACK, port))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            rewriter = self.rewriter() if self.rewriter else None
            threading.Thread(
                target=self._pump, args=(client, server, self.sent, None), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(server, client, self.received, rewriter), daemon=True
            ).start()

    def _pump(
        self,
        source: socket.socket,
        sink: socket.socket,
        record: bytearray,
        rewriter: Rewriter | None,
    ) -> None:
        try:
            while data := source.recv(1 << 16):
                if rewriter is not None:
                    data = rewriter.feed(data)
                with self._lock:
                    record += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


Tamper = Callable[[vault_pb2.PromoteIndex, list[bytes]], list[bytes]]
"""tamper(index, payloads) -> the payloads the client gets (same count, any bytes)."""


class BulkReplyRewriter:
    """Rewrites the payloads of PROMOTE_REPLY frames of a bulk connection with `tamper`, then
    their checksums: those of namespace `namespace`, the request's key indices in `keys`."""

    def __init__(self, tamper: Tamper, namespace: bytes, keys: list[bytes]) -> None:
        self.tamper = tamper
        self.namespace = namespace
        self.keys = keys
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        out = []
        while len(self._pending) >= HEADER.size:
            _, kind, index_len, data_len = HEADER.unpack_from(self._pending)
            end = HEADER.size + index_len + data_len
            if len(self._pending) < end:
                break
            frame, self._pending = self._pending[:end], self._pending[end:]
            out.append(self._rewritten(frame, index_len) if kind == PROMOTE_REPLY else frame)
        return b"".join(out)

    def _rewritten(self, frame: bytes, index_len: int) -> bytes:
        index = vault_pb2.PromoteIndex.FromString(frame[HEADER.size : HEADER.size + index_len])
        data = memoryview(frame)[HEADER.size + index_len :]
        payloads = self.tamper(index, [bytes(p) for p in split_payloads(data, index.lengths)])
        del index.lengths[:]
        index.lengths.extend(len(payload) for payload in payloads)
        del index.checksums[:]
        index.checksums.extend(
            block_checksum(self.namespace, self.keys[key_index], part, payload)
            for key_index, part, payload in zip(
                index.key_indices, index.parts, payloads, strict=True
            )
        )
        raw = index.SerializeToString()
        body = b"".join(payloads)
        return HEADER.pack(MAGIC, PROMOTE_REPLY, len(raw), len(body)) + raw + body
