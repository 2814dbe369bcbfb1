"""A tierkv vault as a Backend: today's VaultClient (gRPC + the bulk port) behind the protocol."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tierkv.config import ClientConfig, SecurityConfig
from tierkv.reliability import PutPayload
from tierkv.vault.bulk import Into
from tierkv.vault.client import VaultClient, VaultStats


class VaultBackend:
    """One vault at `address` ("host:port"); puts, reads and the breaker are the client's."""

    def __init__(self, client: VaultClient) -> None:
        self.client = client
        self.address = client.address

    @classmethod
    def from_config(
        cls, address: str, client_cfg: ClientConfig, security: SecurityConfig | None = None
    ) -> VaultBackend:
        return cls(VaultClient.from_config(address, client_cfg, security))

    def put(
        self,
        namespace: bytes,
        key: bytes,
        part: int,
        payload: PutPayload,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.client.put(namespace, key, part, payload, release)

    def lookup(self, namespace: bytes, keys: Sequence[bytes], parts: Sequence[int]) -> int:
        return self.client.lookup(namespace, keys, parts)

    def promote(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        parts: Sequence[int],
        into: Into | None = None,
    ) -> dict[tuple[int, int], memoryview]:
        return self.client.promote(namespace, keys, parts, into)

    def flush(self, timeout: float | None = None) -> bool:
        return self.client.flush(timeout)

    def stats(self) -> list[VaultStats]:
        return [self.client.stats()]

    def clear(self, namespace: bytes) -> int:
        return self.client.clear(namespace)

    def counters(self) -> dict[str, int | str]:
        return self.client.counters()

    def close(self) -> None:
        self.client.close()
