"""`tierkv vault`: run a vault server on this machine until SIGINT / SIGTERM."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from tierkv.cli import app
from tierkv.config import (
    DEFAULT_RAM_FRACTION,
    VAULT_ROLES,
    ConfigError,
    format_size,
    load_config,
    parse_address,
    parse_max_bytes,
    physical_ram_bytes,
)
from tierkv.vault.memory import reuse_freed_memory
from tierkv.vault.server import VaultBindError, serve

STOP_GRACE_S = 5.0


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"tierkv vault: {message}", err=True)
    return typer.Exit(code)


@app.command()
def vault(
    config: Annotated[Path | None, typer.Option(help="tierkv.toml to read.")] = None,
    role: Annotated[
        str | None,
        typer.Option(
            help="kv_cold or ssm_cold (default: cluster.role of tierkv.toml, else kv_cold)."
        ),
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option(help="HOST:PORT to listen on (default: vault.listen, else 127.0.0.1:50051)."),
    ] = None,
    max_bytes: Annotated[
        str | None,
        typer.Option(
            help='Cap: 24GB, 512MiB or "unlimited" (default: vault.max_bytes, else half of RAM).'
        ),
    ] = None,
    bulk_port: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=65535,
            help="TCP port of the bulk data path (default: vault.bulk_port, else any free port).",
        ),
    ] = None,
) -> None:
    """Run a vault: a RAM-only, byte-capped store of KV blocks for engines on the LAN."""
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        raise _fail(str(exc), 2) from None
    role = role or (cfg.cluster.role if cfg.cluster.role in VAULT_ROLES else "kv_cold")
    if role not in VAULT_ROLES:
        raise _fail(f"--role: expected one of {', '.join(VAULT_ROLES)}, got {role!r}", 2)
    listen = listen or cfg.vault.listen
    try:
        parse_address(listen, allow_port_zero=True)
    except ValueError as exc:
        raise _fail(f"--listen: {exc}", 2) from None
    if max_bytes is not None:
        try:
            cap = parse_max_bytes(max_bytes)
        except ValueError as exc:
            raise _fail(f"--max-bytes: {exc}", 2) from None
        origin = "--max-bytes"
    else:
        cap = cfg.vault.resolved_max_bytes()
        origin = (
            f"{cfg.source} vault.max_bytes"
            if cfg.vault.max_bytes is not None
            else f"default: {DEFAULT_RAM_FRACTION:.0%} of {format_size(physical_ram_bytes())} RAM"
        )
    reuse_freed_memory()
    try:
        bulk = cfg.vault.bulk_port if bulk_port is None else bulk_port
        server = serve(listen, cap, role=role, bulk_port=bulk)
    except VaultBindError as exc:
        raise _fail(str(exc), 1) from None

    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    cap_text = "unlimited" if cap == 0 else format_size(cap)
    typer.echo(
        f"tierkv vault: {role} listening on {server.address} (bulk data on port "
        f"{server.bulk_port}), cap {cap_text} ({origin})"
    )
    stop.wait()
    typer.echo("tierkv vault: stopping")
    server.stop(grace=STOP_GRACE_S)
    typer.echo("tierkv vault: stopped")
