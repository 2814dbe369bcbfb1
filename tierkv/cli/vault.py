"""`tierkv vault`: run a vault server on this machine until SIGINT / SIGTERM.

With a disk tier (--disk-dir / vault.disk_dir) it reports what it recovered at start, and on
SIGINT / SIGTERM it writes every block that is only in RAM to disk (at most FLUSH_TIMEOUT_S).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

from tierkv.addresses import parse_address, parse_ip_address
from tierkv.cli import app
from tierkv.cli.errors import fail
from tierkv.config import (
    DEFAULT_RAM_FRACTION,
    UNLIMITED,
    VAULT_ROLES,
    ConfigError,
    TierKVConfig,
    load_config,
    parse_cap,
    physical_ram_bytes,
)
from tierkv.sizes import format_size

if TYPE_CHECKING:  # the server's modules (gRPC, numpy) are imported to run one, not for --help
    from tierkv.vault.auth import Tokens
    from tierkv.vault.disk import DiskTier

STOP_GRACE_S = 5.0
FLUSH_TIMEOUT_S = 60.0
INDEX_SHARE = 0.25
"""The most of --max-bytes the disk tier's index may take (the RAM tier holds the rest)."""


@app.command()
def vault(
    config: Annotated[
        Path | None, typer.Option(metavar="PATH", help="tierkv.toml to read.", show_default=False)
    ] = None,
    role: Annotated[
        str | None,
        typer.Option(
            metavar="ROLE",
            help="kv_cold or ssm_cold.",
            show_default="cluster.role of tierkv.toml, else kv_cold",
        ),
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option(
            metavar="HOST:PORT",
            help="Address to listen on.",
            show_default="vault.listen, else 127.0.0.1:50051",
        ),
    ] = None,
    max_bytes: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help='RAM cap: 24GB, 512MiB or "unlimited".',
            show_default="vault.max_bytes, else half of RAM",
        ),
    ] = None,
    bulk_port: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=65535,
            metavar="PORT",
            help="TCP port of the bulk data path.",
            show_default="vault.bulk_port, else any free port",
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=65535,
            metavar="PORT",
            help=(
                "Serve Prometheus metrics as /metrics on this port: of the listen host when it is "
                "loopback, --insecure or mutual TLS, else of loopback (it checks no token)."
            ),
            show_default="vault.metrics_port, else no metrics",
        ),
    ] = None,
    metrics_host: Annotated[
        str | None,
        typer.Option(
            metavar="IP",
            help="Serve /metrics on this address instead, e.g. a separate management network's "
            "(anyone who reaches it may scrape: /metrics checks no token).",
            show_default="vault.metrics_host, else as --metrics-port says",
        ),
    ] = None,
    disk_dir: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Spill to, and recover from, this directory.",
            show_default="vault.disk_dir, else none: RAM only",
        ),
    ] = None,
    disk_max_bytes: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Disk tier cap, e.g. 500GB.",
            show_default="vault.disk_max_bytes, else half the free space",
        ),
    ] = None,
    disk_reset: Annotated[
        bool,
        typer.Option(
            "--disk-reset",
            help="Start the disk tier empty: remove its segments and record.key first (every "
            "block on disk is lost; for a disk_dir whose record.key is lost).",
        ),
    ] = False,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Listen beyond loopback without authentication: anyone who reaches the vault "
            "may read, overwrite and delete every block (said at start-up and in tierkv status).",
        ),
    ] = False,
) -> None:
    """Run a vault: a byte-capped store of KV blocks for engines on the LAN, in RAM (and on disk
    with --disk-dir)."""
    cfg = load_config(config)
    if role is None and cfg.cluster.role == "inference":
        raise fail(
            "vault",
            f'{cfg.source}: cluster.role = "inference" is an engine\'s tierkv.toml; give the '
            "vault's (role kv_cold or ssm_cold), or --role",
            2,
        )
    role = role or cfg.cluster.role or "kv_cold"
    if role not in VAULT_ROLES:
        raise fail("vault", f"--role: expected one of {', '.join(VAULT_ROLES)}, got {role!r}", 2)
    listen_origin = "--listen" if listen else f"{cfg.source}: vault.listen"
    listen = listen or cfg.vault.listen
    try:
        parse_address(listen, allow_port_zero=True)
    except ValueError as exc:
        raise fail("vault", f"{listen_origin}: {exc}", 2) from None
    from tierkv.vault.auth import (
        Tokens,
        configured_tokens,
        listens_open,
        refuse_ineffective_settings,
    )

    refuse_ineffective_settings(cfg.security)
    entries = configured_tokens(cfg.security)
    tokens = Tokens(entries) if entries else None
    open_to_lan = listens_open(listen, tokens, cfg.security, insecure=insecure)
    if max_bytes is not None:
        try:
            cap = parse_cap(max_bytes, unlimited=True)
        except ValueError as exc:
            raise fail("vault", f"--max-bytes: {exc}", 2) from None
        origin = "--max-bytes"
    else:
        cap = cfg.vault.resolved_max_bytes()
        origin = (
            f"{cfg.source} vault.max_bytes"
            if cfg.vault.max_bytes is not None
            else f"default: {DEFAULT_RAM_FRACTION:.0%} of {format_size(physical_ram_bytes())} RAM"
        )
    scrape_host = cfg.vault.metrics_host
    if metrics_host is not None:
        try:
            scrape_host = parse_ip_address(metrics_host)
        except ValueError as exc:
            raise fail("vault", f"--metrics-host: {exc}", 2) from None
    metrics = cfg.vault.metrics_port if metrics_port is None else metrics_port
    if scrape_host is not None and metrics is None:
        given = (
            "--metrics-host" if metrics_host is not None else f"{cfg.source}: vault.metrics_host"
        )
        raise fail(
            "vault", f"{given} without a metrics port: set --metrics-port or vault.metrics_port", 2
        )
    from tierkv.heap import reuse_freed_memory
    from tierkv.vault.memory import freeze_startup_objects
    from tierkv.vault.server import VaultBindError, serve

    reuse_freed_memory()
    disk = _open_disk(cfg, disk_dir, disk_max_bytes, disk_reset, cap)
    _warn_beyond_memory(cap, origin, disk.max_bytes if disk else 0)
    try:
        bulk = cfg.vault.bulk_port if bulk_port is None else bulk_port
        server = serve(
            listen,
            cap,
            role=role,
            bulk_port=bulk,
            disk=disk,
            limits=cfg.limits,
            tokens=tokens,
            security=cfg.security,
            insecure=open_to_lan,
            metrics_port=metrics,
            metrics_host=scrape_host,
        )
    except (VaultBindError, ConfigError) as exc:
        if disk:
            disk.close()
        if isinstance(exc, ConfigError):
            raise
        from_config = listen_origin != "--listen"
        bind_error = str(exc).startswith("cannot listen on")
        where = f" ({listen_origin})" if from_config and bind_error else ""
        raise fail("vault", f"{exc}{where}", 1) from None

    freeze_startup_objects()
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    cap_text = "unlimited" if cap == 0 else format_size(cap)
    metrics_text = f", metrics on {server.metrics_address}" if server.metrics_address else ""
    typer.echo(
        f"tierkv vault: {role} listening on {server.address} (bulk data on port "
        f"{server.bulk_port}{metrics_text}), cap {cap_text} ({origin}); {_access_text(tokens, cfg)}"
    )
    if open_to_lan:
        typer.echo(
            f"tierkv vault: WARNING --insecure: no authentication on {listen}; anyone who "
            "reaches it can read, overwrite and delete every block"
        )
    stop.wait()
    typer.echo("tierkv vault: stopping")
    server.stop(grace=STOP_GRACE_S)
    if disk:
        started = time.monotonic()
        left = server.store.close(timeout=FLUSH_TIMEOUT_S)
        typer.echo(
            f"tierkv vault: disk tier flushed in {time.monotonic() - started:.1f} s"
            + (f"; {left} blocks did not reach the disk in {FLUSH_TIMEOUT_S:.0f} s" if left else "")
        )
    typer.echo("tierkv vault: stopped")


def _warn_beyond_memory(cap: int, origin: str, disk_cap: int) -> None:
    """Warn when the cap is more than physical RAM plus the disk tier's cap (`disk_cap`, 0: no
    disk tier) can hold."""
    ram = physical_ram_bytes()
    if cap <= ram + disk_cap:
        return
    if disk_cap:
        room = f"{format_size(ram)} of RAM plus the disk tier's cap of {format_size(disk_cap)}"
    else:
        room = f"{format_size(ram)} of RAM"
    typer.echo(
        f"tierkv vault: warning: the cap of {format_size(cap)} ({origin}) is more than this "
        f"machine's {room}; the system swaps or stops the vault before the cap is reached"
        + ("" if disk_cap else " (a disk tier, --disk-dir, holds more than RAM)"),
        err=True,
    )


def _warn_beyond_free_space(cap: int, directory: Path) -> None:
    """Warn when the disk tier's cap is more than its filesystem has free plus what the tier
    already holds there."""
    from tierkv.vault.disk import DEFAULT_FREE_FRACTION, default_max_bytes

    room = int(default_max_bytes(directory) / DEFAULT_FREE_FRACTION)
    if cap > room:
        typer.echo(
            f"tierkv vault: warning: the disk tier's cap of {format_size(cap)} is more than the "
            f"{format_size(room)} its filesystem has free at {directory}; stores fail when the "
            "disk fills before the cap is reached",
            err=True,
        )


def _access_text(tokens: Tokens | None, cfg: TierKVConfig) -> str:
    """How callers are admitted, for the start-up line (never a token)."""
    parts = [f"auth: {tokens.describe()}" if tokens else "auth: none"]
    if cfg.security.tls_cert:
        parts.append("mutual TLS" if cfg.security.client_ca else "TLS")
    return ", ".join(parts)


def _open_disk(
    cfg: TierKVConfig, option: Path | None, cap_option: str | None, reset: bool, ram_cap: int
) -> DiskTier | None:
    """The disk tier the options or the config ask for (recovered, or emptied first when
    `reset`), else None; exits on errors. Its index is RAM counted in `ram_cap` (the RAM tier
    holds what the index leaves), at most INDEX_SHARE of it."""
    from tierkv.vault.disk import DiskKeyError, DiskLockedError, DiskTier, default_max_bytes
    from tierkv.wire.secrets import make_private_dir

    directory = option or (Path(cfg.vault.disk_dir) if cfg.vault.disk_dir else None)
    origin = "--disk-dir" if option else f"{cfg.source}: vault.disk_dir"
    if directory is None:
        if cap_option is not None or reset:
            given = "--disk-max-bytes" if cap_option is not None else "--disk-reset"
            raise fail("vault", f"{given} needs --disk-dir (or vault.disk_dir)", 2)
        return None
    cap = cfg.vault.disk_max_bytes
    if cap_option is not None:
        try:
            cap = parse_cap(cap_option, unlimited=False)
        except ValueError as exc:
            raise fail("vault", f"--disk-max-bytes: {exc}", 2) from None
    if directory.exists() and not directory.is_dir():
        raise fail("vault", f"{origin} {directory}: not a directory", 2)
    if not directory.absolute().parent.is_dir():  # a typo, not a tree to create
        raise fail(
            "vault",
            f"{origin} {directory}: {directory.absolute().parent} does not exist (tierkv "
            "creates the disk tier's directory, not its parents)",
            2,
        )
    try:
        make_private_dir(directory)  # its parent exists: only the last directory is made
        if cap:
            _warn_beyond_free_space(cap, directory)
        cap = cap or default_max_bytes(directory)
        if cap <= 0:
            raise fail(
                "vault",
                f"{origin} {directory}: no free space for a disk tier (free some, or set its cap "
                "with --disk-max-bytes)",
                1,
            )
        index_cap = None if ram_cap == UNLIMITED else int(ram_cap * INDEX_SHARE)
        disk = DiskTier(directory, cap, cfg.vault.fsync, max_index_bytes=index_cap, reset=reset)
    except (DiskLockedError, DiskKeyError) as exc:
        raise fail("vault", str(exc), 1) from None
    except OSError as exc:
        raise fail("vault", f"{origin} {directory}: {exc.strerror or exc}", 1) from None
    if reset:
        typer.echo(
            f"tierkv vault: disk tier {directory}: reset (--disk-reset): "
            f"{disk.reset_segments} segments and the record key removed"
        )
    found = disk.recovery
    typer.echo(
        f"tierkv vault: disk tier {directory}: recovered {found.blocks} blocks "
        f"({format_size(found.payload_bytes)}) in {found.seconds:.2f} s; cap {format_size(cap)}, "
        f"fsync {cfg.vault.fsync}"
    )
    if found.damaged:
        typer.echo(
            f"tierkv vault: disk tier {directory}: damaged records dropped (never served): "
            + "; ".join(found.damaged)
        )
    return disk
