"""The configuration an engine-side command (bench, eval, serve, status) runs with: tierkv.toml,
its `[security]` checked by the same rule every tier applies (a secret file others may read, a
TLS certificate without its key: one line, exit code 2)."""

from __future__ import annotations

from pathlib import Path

from tierkv.config import TierKVConfig, load_config


def engine_config(path: Path | None) -> TierKVConfig:
    """tierkv.toml at `path` (None: the default search) with usable `[security]` settings;
    a ConfigError naming the bad setting otherwise (the CLI's error boundary reports it)."""
    from tierkv.backends.security import check_client_security  # gRPC: not for `--help`

    cfg = load_config(path)
    check_client_security(cfg.security)
    return cfg
