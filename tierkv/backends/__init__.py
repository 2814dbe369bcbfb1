"""Cold stores behind one protocol (base.Backend): a tierkv vault, Valkey / Redis (single or
cluster), a directory engines share (file.FileTier), or several of them with blocks spread by
weight. `open_backend` builds the right one from configured endpoints; ColdTier holds backends,
never addresses."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from tierkv.addresses import is_file_url, is_redis_url
from tierkv.backends.base import Backend
from tierkv.config import ClientConfig, Endpoint, SecurityConfig


def open_one(
    address: str, client_cfg: ClientConfig, security: SecurityConfig | None = None
) -> Backend:
    """The backend of one address: a vault "host:port", a redis[s][+cluster]:// URL (with
    the token / TLS files of `security`) or a file:/// URL."""
    if is_file_url(address):
        from tierkv.backends.file import FileTier

        return FileTier.from_url(address, client_cfg)
    if not is_redis_url(address):
        from tierkv.backends.vault import VaultClient

        return VaultClient.from_config(address, client_cfg, security)
    from tierkv.backends.redis import RedisBackend, RedisClusterBackend, connection_options

    if "+cluster" in address.partition("://")[0]:
        return RedisClusterBackend(address, client_cfg, security)
    url = urlsplit(address)
    options = connection_options(address, client_cfg, security)
    return RedisBackend.connect(url.hostname or "", url.port or 6379, options, client_cfg, address)


def open_backend(
    endpoints: Sequence[Endpoint],
    client_cfg: ClientConfig,
    security: SecurityConfig | None = None,
) -> Backend:
    """One endpoint's backend, or several spread by weighted rendezvous hashing."""
    if len(endpoints) == 1:
        return open_one(endpoints[0].address, client_cfg, security)
    from tierkv.backends.sharded import WeightedShards

    return WeightedShards(
        [(open_one(e.address, client_cfg, security), e.weight) for e in endpoints]
    )
