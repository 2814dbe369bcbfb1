"""The configuration an engine-side command (bench, eval, serve, status) runs with: tierkv.toml,
its `[security]` checked by the same rule every tier applies (a secret file others may read, a
TLS certificate without its key: one line, exit code 2)."""

from __future__ import annotations

from pathlib import Path

from tierkv.cli.errors import fail
from tierkv.config import ConfigError, TierKVConfig, load_config


def engine_config(path: Path | None, command: str) -> TierKVConfig:
    """tierkv.toml at `path` (None: the default search) with usable `[security]` settings;
    exits with one line naming the bad setting otherwise."""
    from tierkv.backends.security import check_client_security  # gRPC: not for `--help`

    try:
        cfg = load_config(path)
        check_client_security(cfg.security)
    except ConfigError as exc:
        raise fail(command, str(exc), 2) from None
    return cfg
