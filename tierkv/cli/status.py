"""`tierkv status`: is each vault up, how fast it answers, and what it holds — table or JSON.

A vault is a tierkv vault or a Valkey / Redis backend (a cluster is one entry, its nodes summed);
where a role spreads blocks over several, each one's share of the role's entries and bytes shows.

Exit code 0 when every checked component is up, 1 when one is down, 2 on a configuration error.
A check is a function returning rows (dicts) plus whether everything it checked is healthy; the
command runs the vault check and prints one table (or one JSON key) per check.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tierkv.cli import app
from tierkv.cli.errors import fail
from tierkv.config import (
    ConfigError,
    TierKVConfig,
    format_size,
    is_redis_url,
    load_config,
    parse_address,
    parse_cold_address,
    redact,
)
from tierkv.patches.exo import hook_state

if TYPE_CHECKING:  # gRPC and the backends are imported when a check runs, not for --help
    from tierkv.vault.client import TierStats, VaultStats

VAULT_COLUMNS = {
    "address": "address",
    "up": "up",
    "rtt_ms": "rtt ms",
    "bulk": "bulk port",
    "role": "role",
    "auth": "auth",
    "entries": "entries",
    "used": "used / cap",
    "share": "share (entries / bytes)",
    "hits": "hits",
    "misses": "misses",
    "evictions": "evictions",
    "ram": "RAM tier",
    "disk": "disk tier",
    "uptime": "uptime",
}


@dataclass
class CheckResult:
    """What one check found: a titled table of rows, and whether all of it is healthy."""

    title: str
    columns: dict[str, str]  # row key → label (each row dict also has "name" and "up")
    rows: list[dict[str, Any]]
    healthy: bool


def vault_targets(cfg: TierKVConfig, addresses: list[str]) -> list[tuple[str, str, str]]:
    """(group, name, address) to check: the given ones (one group), else the configured vaults
    (one group per role), else the local one."""
    if addresses:
        return [("given", f"vault {i + 1}", address) for i, address in enumerate(addresses)]
    targets = [
        (role, role if len(endpoints) == 1 else f"{role} {i + 1}", endpoint.address)
        for role, endpoints in cfg.cluster.vault_addresses().items()
        for i, endpoint in enumerate(endpoints)
    ]
    return targets or [("local", "local", cfg.vault.listen)]


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def check_vault(name: str, address: str, cfg: TierKVConfig) -> dict[str, Any]:
    """One vault's status row (machine-readable values; `up` False with `error` when down).

    A Redis Cluster's nodes are summed into its row; `bulk_port` is None for Valkey / Redis.
    """
    from tierkv.backends import open_one
    from tierkv.backends.base import VaultUnavailable
    from tierkv.backends.vault import VaultBackend
    from tierkv.vault.client import VaultRefused

    if not is_redis_url(address):
        host, port = parse_address(address)
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            error = f"cannot resolve host {host}: {exc.strerror}"
            return {"name": name, "address": address, "up": False, "error": error}
    backend = open_one(address, cfg.client, cfg.security)
    bulk_port: int | None = None
    bulk_reachable = False
    try:
        backend.stats()  # connects; the second call measures the round trip alone
        nodes = backend.stats()
        if isinstance(backend, VaultBackend):
            bulk_port, bulk_reachable = backend.client.bulk_path()
    except VaultRefused as exc:  # up, but not for us: unusable all the same
        row = {"name": name, "address": redact(address), "up": False, "error": str(exc)}
        return {**row, "auth": "required, refused"}
    except VaultUnavailable as exc:
        return {"name": name, "address": redact(address), "up": False, "error": str(exc)}
    finally:
        backend.close()
    return {
        "name": name,
        "address": redact(address),
        "up": True,
        "rtt_ms": round(max(s.rtt_s for s in nodes) * 1000, 2),
        "bulk_port": bulk_port,  # 0: none, payloads travel over gRPC; None: Valkey / Redis
        "bulk_reachable": bulk_reachable,  # False: a firewall? payloads fall back to gRPC
        "role": nodes[0].role,
        "nodes": len(nodes),
        "entries": sum(s.entries for s in nodes),
        "bytes_used": sum(s.bytes_used for s in nodes),
        "max_bytes": sum(s.max_bytes for s in nodes),
        "hits": sum(s.hits for s in nodes),
        "misses": sum(s.misses for s in nodes),
        "evictions": sum(s.evictions for s in nodes),
        "rejected": sum(s.rejected for s in nodes),
        "uptime_s": round(min(s.uptime_s for s in nodes), 1),
        "version": nodes[0].version,
        "auth": _auth(backend, nodes[0]),
        "insecure": nodes[0].insecure,  # --insecure beyond loopback: anyone may call
        "tls": nodes[0].tls,
        "sealed": cfg.security.data_key_file is not None,  # we seal blocks with a data key
        "tenant": nodes[0].tenant,
        "ram": _tier_sum([s.ram for s in nodes]),
        "disk": _tier_sum([s.disk for s in nodes]),  # None: RAM only
    }


def _auth(backend: object, stats: VaultStats) -> str:
    """Whether the vault wants a token (ours was accepted, or stats would have failed)."""
    from tierkv.backends.vault import VaultBackend

    if not isinstance(backend, VaultBackend):
        return "n/a (redis)"
    return "required, accepted" if stats.auth_required else "none"


def check_vaults(cfg: TierKVConfig, addresses: list[str]) -> CheckResult:
    targets = vault_targets(cfg, addresses)
    rows = [check_vault(name, address, cfg) for _, name, address in targets]
    for group in {group for group, _, _ in targets}:
        members = [row for (g, _, _), row in zip(targets, rows, strict=True) if g == group]
        add_shares([row for row in members if row["up"]])
    return CheckResult("vaults", VAULT_COLUMNS, rows, all(row["up"] for row in rows))


def add_shares(rows: list[dict[str, Any]]) -> None:
    """Each row's fraction of the group's entries and bytes (`entry_share`, `byte_share`)."""
    entries = sum(row["entries"] for row in rows)
    used = sum(row["bytes_used"] for row in rows)
    for row in rows:
        row["entry_share"] = row["entries"] / entries if entries else 0.0
        row["byte_share"] = row["bytes_used"] / used if used else 0.0


def check_exo_hook(exo_path: Path) -> CheckResult:
    """Whether the tierkv hook is installed in the EXO checkout at `exo_path`."""
    state = hook_state(exo_path)
    row = {"name": "EXO hook", "address": str(exo_path), "up": state.installed}
    row["detail" if state.installed else "error"] = state.detail
    columns = {"address": "EXO checkout", "up": "up", "detail": "detail"}
    return CheckResult("exo", columns, [row], state.installed)


def _tier_sum(tiers: list[TierStats | None]) -> dict[str, Any] | None:
    """One tier's figures summed over the nodes that have it (None where none has)."""
    from tierkv.vault.client import TierStats

    present = [tier for tier in tiers if tier is not None]
    if not present:
        return None
    return {name: sum(getattr(tier, name) for tier in present) for name in TierStats._fields}


def _used(used: int, cap: int) -> str:
    return f"{format_size(used)} / {'unlimited' if cap == 0 else format_size(cap)}"


def _tier(tier: dict[str, Any]) -> str:
    """One tier's figures in a cell: entries, used / cap, hits, reads/s (and second chances and
    damaged blocks, where a disk tier has them)."""
    text = (
        f"{tier['entries']} entries, {_used(tier['bytes_used'], tier['max_bytes'])}, "
        f"{tier['hits']} hits, {tier['reads_per_s']:.1f} reads/s"
    )
    text += f", {tier['kept']} kept" if tier["kept"] else ""
    return text + (f", [red]{tier['corrupt']} corrupt[/red]" if tier["corrupt"] else "")


def _cell(row: dict[str, Any], key: str) -> str:
    """The table text of one value of a row."""
    if key == "up":
        return "[green]up[/green]" if row["up"] else "[red]down[/red]"
    if not row["up"]:
        return str(row.get(key, "")) if key in ("name", "address", "auth") else ""
    if key == "auth":
        text = row["auth"] + (", TLS" if row["tls"] else "")
        text += ", sealed" if row["sealed"] else ", unsealed"
        text += f", tenant {row['tenant']}" if row["tenant"] else ""
        return "[red]none: --insecure, open to the LAN[/red]" if row["insecure"] else text
    if key == "used":
        return _used(row["bytes_used"], row["max_bytes"])
    if key == "share":
        return f"{row['entry_share']:.0%} / {row['byte_share']:.0%}"
    if key == "uptime":
        return _duration(row["uptime_s"])
    if key in ("ram", "disk"):
        return _tier(row[key]) if row[key] else "none"
    if key == "bulk":
        if row["bulk_port"] is None:
            return "n/a (redis)"
        if not row["bulk_port"]:
            return "none (gRPC)"
        if not row["bulk_reachable"]:
            return f"[yellow]{row['bulk_port']} unreachable (gRPC, slower)[/yellow]"
        return str(row["bulk_port"])
    return str(row.get(key, ""))


def render(results: list[CheckResult], console: Console, errors: Console) -> None:
    """One table per check, one column per checked thing (fits narrow terminals); what is wrong
    with each, one line each, on `errors`."""
    for result in results:
        table = Table(title=result.title)
        table.add_column("")
        for row in result.rows:
            table.add_column(row["name"])
        for key, label in result.columns.items():
            table.add_row(label, *(_cell(row, key) for row in result.rows))
        console.print(table)
        for row in result.rows:
            if row.get("error"):
                errors.print(
                    f"[red]{row['name']}[/red]: {row['error']}", highlight=False, soft_wrap=True
                )


@app.command()
def status(
    config: Annotated[
        Path | None, typer.Option(metavar="PATH", help="tierkv.toml to read.", show_default=False)
    ] = None,
    vault: Annotated[
        list[str] | None,
        typer.Option(
            metavar="HOST:PORT|URL",
            help="A vault, or a redis:// URL, to check (repeatable).",
            show_default="the vaults of tierkv.toml's [cluster]",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    exo_path: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="EXO checkout: also check that the tierkv hook is installed.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Check each vault: reachable, round trip, role, entries, bytes used / cap, hits, uptime.

    With --exo-path, also check that the tierkv hook is installed in that EXO checkout.
    """
    addresses = vault or []
    from tierkv.vault.auth import refuse_ineffective_settings

    try:
        cfg = load_config(config)
        refuse_ineffective_settings(cfg.security, vault=False)
        for address in addresses:
            try:
                parse_cold_address(address)
            except ValueError as exc:
                raise ConfigError(f"--vault: {exc}") from None
    except ConfigError as exc:
        raise fail("status", str(exc), 2) from None
    results = [check_vaults(cfg, addresses)]
    if exo_path is not None:
        results.append(check_exo_hook(exo_path))
    if as_json:
        typer.echo(json.dumps({result.title: result.rows for result in results}, indent=2))
    else:
        render(results, Console(), Console(stderr=True))
    raise typer.Exit(0 if all(result.healthy for result in results) else 1)
