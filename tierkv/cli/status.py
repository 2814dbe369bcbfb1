"""`tierkv status`: one row per vault with a verdict, its tiers and the totals — table or JSON.

A vault is a tierkv vault, a Valkey / Redis backend (a cluster is one entry, its nodes summed) or
a file tier (a directory engines share: its path, bytes used and cap in the disk column).
Each row gets a verdict:

- up: answers, serves the role it is configured for;
- full: up, but its last tier (disk if it has one, else RAM) is at FULL_SHARE of its cap or more,
  so every new block evicts an old one;
- degraded: up, but slower or less safe than it should be (bulk port unreachable, damaged disk
  blocks, open to the LAN with --insecure);
- refused: answers, but refuses our token (or we have none);
- wrong role: answers, but serves another role than the one tierkv.toml's [cluster] names;
- down: does not answer (the reason in plain words).

Exit code 0 when every row is up, full or degraded; 1 when one is down, refused or of the wrong
role (and when a checked EXO hook is missing); 2 on a configuration error. The default table fits
80 columns (addresses are never cut); `--wide` shows every figure; `--watch` refreshes in place.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tierkv.addresses import (
    is_file_url,
    is_redis_url,
    parse_address,
    parse_cold_address,
    redact,
)
from tierkv.cli import app
from tierkv.cli.engine import engine_config
from tierkv.cli.errors import fail
from tierkv.config import VAULT_ROLES, ConfigError, TierKVConfig
from tierkv.patches.exo import hook_state
from tierkv.sizes import format_size

if TYPE_CHECKING:  # gRPC and the backends are imported when a check runs, not for --help
    from tierkv.backends.base import BackendStats, StorageTierStats

FULL_SHARE = 0.95
"""A tier holding this share of its cap or more is full: each new block evicts an old one."""
WORKING = ("up", "full", "degraded")
"""Verdicts of a vault that serves us (exit code 0)."""
VERDICT_STYLES = {
    "up": "green",
    "full": "yellow",
    "degraded": "yellow",
    "refused": "red",
    "wrong role": "red",
    "down": "red",
}

COLUMNS = {  # the default table: fits 80 columns with 127.0.0.1 addresses
    "address": "address",
    "verdict": "state",
    "ram": "RAM",
    "disk": "disk",
    "hit_rate": "hits",
    "link": "link",
}
WIDE_COLUMNS = {
    "address": "address",
    "verdict": "state",
    "role": "role",
    "rtt_ms": "rtt ms",
    "ram": "RAM used / cap",
    "disk": "disk used / cap (live)",
    "entries": "entries",
    "hit_rate": "hits",
    "share": "share (entries / bytes)",
    "evictions": "evictions",
    "rejected": "rejected",
    "bulk": "bulk port",
    "auth": "auth",
    "link": "link",
    "uptime": "uptime",
    "version": "version",
    "reason": "reason",
}


@dataclass
class CheckResult:
    """What one check found: a titled table of rows, and whether all of it is healthy."""

    title: str
    columns: dict[str, str]  # row key → label (each row dict also has "name" and "up")
    rows: list[dict[str, Any]]
    healthy: bool
    totals: dict[str, Any] | None = None


def vault_targets(cfg: TierKVConfig, addresses: list[str]) -> list[tuple[str, str, str]]:
    """(group, name, address) to check: the given ones (one group), else the configured vaults
    (one group per role, the group naming the role they must serve), else the local one."""
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


def unreachable(address: str, timeout_s: float) -> str | None:
    """Why nothing answers TCP at vault `address`, in plain words; None when something does."""
    host, port = parse_address(address)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve host {host}: {exc.strerror}"
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return f"nothing listens at {address} (connection refused: vault not running?)"
    except TimeoutError:
        return f"no answer from {address} in {timeout_s * 1000:.0f} ms (host off, or a firewall)"
    except OSError as exc:
        return f"cannot reach {address}: {exc.strerror or exc}"
    return None


def tls_refused(host: str, port: int, cfg: TierKVConfig) -> str | None:
    """Why the certificate of the vault at `host`:`port` fails our verification (security.tls_ca,
    the vault's name); None when it passes, or we speak no TLS, or nothing answers there."""
    from tierkv.backends.security import ssl_context

    context = ssl_context(cfg.security)
    if context is None:
        return None
    try:
        with socket.create_connection((host, port), timeout=cfg.client.deadline_ms / 1000) as raw:
            context.wrap_socket(raw, server_hostname=host).close()
    except ssl.SSLCertVerificationError as exc:
        return (
            f"TLS verification failed at port {port}: {exc.verify_message} (is "
            f"security.tls_ca {cfg.security.tls_ca} the CA that signed the vault's certificate?)"
        )
    except OSError:  # ssl.SSLError included: not a verdict on the certificate
        return None
    return None


def check_vault(name: str, address: str, cfg: TierKVConfig, role: str | None) -> dict[str, Any]:
    """One vault's status row: machine-readable values, `verdict` and, unless up, `reason`.

    `role` is the role it must serve (None: any). `up` is True when it serves us (up, full or
    degraded); `reachable` when it answered at all. A Redis Cluster's nodes are summed into its
    row; `bulk_port` is None for Valkey / Redis.
    """
    from tierkv.backends import open_one
    from tierkv.backends.base import BackendUnavailable
    from tierkv.backends.security import client_token
    from tierkv.backends.vault import VaultClient, VaultRefused

    vault = not is_redis_url(address) and not is_file_url(address)  # a tierkv vault
    row: dict[str, Any] = {
        "name": name,
        "address": redact(address),
        # the client's link to it is encrypted / the blocks we write are sealed with a data key
        "tls": address.startswith("rediss://") or (vault and cfg.security.tls_ca is not None),
        "sealed": cfg.security.data_key_file is not None,
    }
    deadline_s = cfg.client.deadline_ms / 1000
    if vault and (why := unreachable(address, deadline_s)):
        return {**row, "up": False, "reachable": False, "verdict": "down", "reason": why}
    try:
        backend = open_one(address, cfg.client, cfg.security)
    except ConfigError as exc:  # a file tier's directory missing or open to others
        return {**row, "up": False, "reachable": False, "verdict": "down", "reason": str(exc)}
    bulk_port: int | None = None
    bulk_reachable = False
    try:
        backend.server_stats()  # connects; the second call measures the round trip alone
        nodes = backend.server_stats()
        policy = _eviction_policy(backend) if is_redis_url(address) else None
        if isinstance(backend, VaultClient):
            bulk_port, bulk_reachable = backend.bulk_path()
    except VaultRefused:  # up, but not for us: unusable all the same
        given = "ours was refused" if client_token(cfg.security) else "we have none ($TIERKV_TOKEN)"
        reason = f"answers, but requires a token and {given}"
        row |= {"up": False, "reachable": True, "verdict": "refused", "reason": reason}
        return row | {"auth": "required, refused"}
    except BackendUnavailable as exc:
        reason = (
            str(exc)
            if not vault
            else tls_refused(*parse_address(address), cfg)
            or (
                f"answers TCP at {address}, but not as a tierkv vault in {deadline_s * 1000:.0f} ms"
                " (another service on that port, a TLS mismatch, or overloaded)"
            )
        )
        return {**row, "up": False, "reachable": vault, "verdict": "down",
                "reason": reason}  # fmt: skip
    finally:
        backend.close()
    ram, disk = _tier_sum([s.ram for s in nodes]), _tier_sum([s.disk for s in nodes])
    row |= {
        "up": True,
        "reachable": True,
        "rtt_ms": round(max(s.rtt_s for s in nodes) * 1000, 2),
        "bulk_port": bulk_port,  # 0: none, payloads travel over gRPC; None: Valkey / Redis
        "bulk_reachable": bulk_reachable,  # False: a firewall? payloads fall back to gRPC
        "bulk_tls": None  # why the bulk port's certificate failed our verification
        if bulk_reachable or not bulk_port
        else tls_refused(parse_address(address)[0], bulk_port, cfg),
        "role": nodes[0].role,
        "nodes": len(nodes),
        "entries": sum(s.entries for s in nodes),  # the RAM tier's (see ram / disk for each)
        "bytes_used": sum(s.bytes_used for s in nodes),
        "max_bytes": sum(s.max_bytes for s in nodes),
        "hits": sum(s.hits for s in nodes),  # of both tiers
        "misses": sum(s.misses for s in nodes),
        "evictions": sum(s.evictions for s in nodes),  # out of RAM (to disk, where it has one)
        "rejected": sum(s.rejected for s in nodes),
        "uptime_s": round(min(s.uptime_s for s in nodes), 1),
        "version": nodes[0].version,
        "auth": _auth(backend, nodes[0]),
        "insecure": nodes[0].insecure,  # --insecure beyond loopback: anyone may call
        "tenant": nodes[0].tenant,
        "ram": ram,
        "disk": disk,  # None: RAM only
        "eviction_policy": policy,  # Valkey / Redis only
    }
    return row | _verdict(row, role)


def _verdict(row: dict[str, Any], role: str | None) -> dict[str, Any]:
    """`verdict` and `reason` of a vault that answered (its row's figures)."""
    address = row["address"]
    if (
        role is not None
        and row["role"] != role
        and not is_redis_url(address) | is_file_url(address)
    ):
        reason = f"serves {row['role']}, but tierkv.toml's [cluster] names it as {role}"
        return {"up": False, "verdict": "wrong role", "reason": reason}
    problems = []
    if row.get("bulk_tls"):
        problems.append(f"{row['bulk_tls']}; payloads go over gRPC, slower")
    elif row["bulk_port"] and not row["bulk_reachable"]:
        problems.append(f"bulk port {row['bulk_port']} unreachable: payloads go over gRPC, slower")
    if row["disk"] and row["disk"]["corrupt"]:
        problems.append(f"{row['disk']['corrupt']} disk blocks failed their checksum")
    if row["insecure"]:
        problems.append("started --insecure: open to the LAN without a token")
    problems += redis_eviction_problems(row)
    if problems:
        return {"verdict": "degraded", "reason": "; ".join(problems)}
    last_name, last = ("disk", row["disk"]) if row["disk"] else ("RAM", row["ram"])
    last = last or row  # Valkey / Redis: no tiers, the row's own figures
    used, cap = last["bytes_used"], last["max_bytes"]
    if cap and used >= FULL_SHARE * cap:
        reason = f"{last_name} tier at {used / cap:.0%} of its cap: new blocks evict old ones"
        return {"verdict": "full", "reason": reason}
    return {"verdict": "up"}


def _eviction_policy(backend: object) -> str | None:
    """The maxmemory-policy of a Valkey / Redis backend (a cluster's first primary); None when
    the server does not tell."""
    from tierkv.backends.base import BackendUnavailable
    from tierkv.backends.redis import RedisBackend, RedisClusterBackend

    nodes = backend.members() if isinstance(backend, RedisClusterBackend) else [backend]
    for node in nodes:
        if isinstance(node, RedisBackend):
            try:
                return node.eviction_policy() or None
            except BackendUnavailable:
                return None
    return None


def redis_eviction_problems(row: dict[str, Any]) -> list[str]:
    """What a Valkey / Redis row's memory settings will do to stores (README: Redis needs
    maxmemory and maxmemory-policy allkeys-lru)."""
    policy = row.get("eviction_policy")
    problems = []
    if policy is not None and not row["max_bytes"]:
        problems.append("maxmemory 0: Redis grows until the machine runs out of memory")
    if policy == "noeviction":
        problems.append("maxmemory-policy noeviction: stores fail once it is full (allkeys-lru)")
    return problems


def _auth(backend: object, stats: BackendStats) -> str:
    """Whether the vault wants a token (ours was accepted, or stats would have failed)."""
    from tierkv.backends.vault import VaultClient

    if not isinstance(backend, VaultClient):
        return f"n/a ({'file' if is_file_url(stats.address) else 'redis'})"
    return "required, accepted" if stats.auth_required else "none"


def check_vaults(cfg: TierKVConfig, addresses: list[str]) -> CheckResult:
    """Every vault checked at once (a down one costs a deadline, not one each), one row each."""
    targets = vault_targets(cfg, addresses)
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        rows = list(
            pool.map(
                lambda target: check_vault(
                    target[1], target[2], cfg, target[0] if target[0] in VAULT_ROLES else None
                ),
                targets,
            )
        )
    for group in {group for group, _, _ in targets}:
        members = [row for (g, _, _), row in zip(targets, rows, strict=True) if g == group]
        add_shares([row for row in members if row["up"]])
    healthy = all(row["verdict"] in WORKING for row in rows)
    return CheckResult("vaults", COLUMNS, rows, healthy, totals(rows))


def add_shares(rows: list[dict[str, Any]]) -> None:
    """Each row's fraction of the group's entries and bytes (`entry_share`, `byte_share`), both
    tiers counted."""
    entries = sum(_held(row, "entries") for row in rows)
    used = sum(_held(row, "bytes_used") for row in rows)
    for row in rows:
        row["entry_share"] = _held(row, "entries") / entries if entries else 0.0
        row["byte_share"] = _held(row, "bytes_used") / used if used else 0.0


def _held(row: dict[str, Any], name: str) -> int:
    """A row's `name` ("entries", "bytes_used", "max_bytes") over its RAM and disk tiers."""
    ram = row["ram"][name] if row.get("ram") else row.get(name, 0)
    return int(ram + (row["disk"][name] if row.get("disk") else 0))


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Across the vaults that serve us: counts by verdict, RAM and disk held / capped, hits."""
    serving = [row for row in rows if row["up"]]
    found: dict[str, Any] = {
        "vaults": len(rows),
        "verdicts": {v: sum(row["verdict"] == v for row in rows) for v in VERDICT_STYLES},
        "entries": sum(_held(row, "entries") for row in serving),
        "hits": sum(row["hits"] for row in serving),
        "misses": sum(row["misses"] for row in serving),
    }
    for tier in ("ram", "disk"):
        present = [row[tier] for row in serving if row.get(tier)]
        if tier == "ram":  # Valkey / Redis rows have no tiers: their bytes count as RAM
            present += [
                {"bytes_used": row["bytes_used"], "max_bytes": row["max_bytes"]}
                for row in serving
                if not row.get("ram")
            ]
        found[f"{tier}_bytes_used"] = sum(t["bytes_used"] for t in present)
        found[f"{tier}_max_bytes"] = sum(t["max_bytes"] for t in present)
    found["disk_live_bytes"] = sum(row["disk"]["live_bytes"] for row in serving if row.get("disk"))
    return found


def check_exo_hook(exo_path: Path) -> CheckResult:
    """Whether the tierkv hook is installed in the EXO checkout at `exo_path`."""
    state = hook_state(exo_path)
    row = {"name": "EXO hook", "address": str(exo_path), "up": state.installed}
    row["verdict"] = "up" if state.installed else "down"
    row["detail" if state.installed else "reason"] = state.detail
    columns = {"address": "EXO checkout", "verdict": "state", "detail": "detail"}
    return CheckResult("exo", columns, [row], state.installed)


def _tier_sum(tiers: list[StorageTierStats | None]) -> dict[str, Any] | None:
    """One tier's figures summed over the nodes that have it (None where none has)."""
    from tierkv.backends.base import StorageTierStats

    present = [tier for tier in tiers if tier is not None]
    if not present:
        return None
    return {name: sum(getattr(tier, name) for tier in present) for name in StorageTierStats._fields}


def short_size(size: int) -> str:
    """A binary size in at most 4 characters: 512B, 1.5K, 64M, 1.2T."""
    value = float(size)
    for unit in ("B", "K", "M", "G", "T"):
        if value < 1024 or unit == "T":
            break
        value /= 1024
    if unit == "B":
        return f"{size}B"
    return f"{value:.1f}{unit}" if value < 9.95 else f"{value:.0f}{unit}"


def _used(used: int, cap: int, *, wide: bool) -> str:
    if wide:
        return f"{format_size(used)} / {'unlimited' if cap == 0 else format_size(cap)}"
    return f"{short_size(used)}/{'∞' if cap == 0 else short_size(cap)}"


def _disk_used(used: int, cap: int, live: int, *, wide: bool) -> str:
    """The disk's segment bytes against its cap; wide, also the bytes of records it can still
    read (overwritten and deleted ones stay in their segment until it is dropped)."""
    return (
        f"{_used(used, cap, wide=wide)} ({format_size(live)})"
        if wide
        else _used(used, cap, wide=wide)
    )


def _hit_rate(hits: int, misses: int) -> str:
    return f"{hits / (hits + misses):.0%}" if hits + misses else "-"


def _link(row: dict[str, Any]) -> str:
    """TLS on the link, blocks sealed with our data key: "tls+seal", "tls", "seal" or "-"."""
    return (
        "+".join(name for name, on in (("tls", row["tls"]), ("seal", row["sealed"])) if on) or "-"
    )


def _cell(row: dict[str, Any], key: str, wide: bool) -> str | Text:
    """The table text of one value of a row."""
    if key == "verdict":
        style = VERDICT_STYLES[row["verdict"]]
        return f"[{style}]{row['verdict']}[/{style}]"
    if key == "address":  # "[fd00::1234:1]:50051", "[cluster]": plain text, no markup or emoji
        return Text(str(row["address"]))
    if key == "reason":
        return Text(str(row.get("reason", "")))
    if key == "link" and "tls" in row:
        return _link(row)
    if not row["up"] or "ram" not in row:
        return str(row[key]) if key == "role" and key in row else ""
    if key == "auth":
        text = row["auth"] + (f", tenant {row['tenant']}" if row["tenant"] else "")
        return "[red]none: --insecure, open to the LAN[/red]" if row["insecure"] else text
    if key == "hit_rate":
        return _hit_rate(row["hits"], row["misses"])
    if key == "entries":
        return str(_held(row, "entries"))
    if key == "share":
        return f"{row['entry_share']:.0%} / {row['byte_share']:.0%}"
    if key == "uptime":
        return _duration(row["uptime_s"])
    if key == "ram":
        if is_file_url(row["address"]):
            return "-"
        tier = row["ram"] or row
        return _used(tier["bytes_used"], tier["max_bytes"], wide=wide)
    if key == "disk":
        disk = row["disk"]
        if not disk:
            return "-"
        return _disk_used(disk["bytes_used"], disk["max_bytes"], disk["live_bytes"], wide=wide)
    if key == "bulk":
        if row["bulk_port"] is None:
            return f"n/a ({'file' if is_file_url(row['address']) else 'redis'})"
        if not row["bulk_port"]:
            return "none (gRPC)"
        if not row["bulk_reachable"]:
            return f"[yellow]{row['bulk_port']} unreachable (gRPC, slower)[/yellow]"
        return str(row["bulk_port"])
    return str(row.get(key, ""))


def _totals_cells(result: CheckResult, wide: bool) -> dict[str, str]:
    found = result.totals
    assert found is not None
    serving = sum(found["verdicts"][v] for v in WORKING)
    return {
        "address": f"{serving} of {found['vaults']} serving",
        "ram": _used(found["ram_bytes_used"], found["ram_max_bytes"], wide=wide),
        "disk": _disk_used(
            found["disk_bytes_used"], found["disk_max_bytes"], found["disk_live_bytes"], wide=wide
        )
        if found["disk_max_bytes"]
        else "-",
        "entries": str(found["entries"]),
        "hit_rate": _hit_rate(found["hits"], found["misses"]),
    }


def table(result: CheckResult, wide: bool) -> Table:
    """One row per checked thing; a long address wraps within its column, figures never do."""
    columns = WIDE_COLUMNS if wide and result.title == "vaults" else result.columns
    grid = Table(title=result.title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    grid.add_column("name", no_wrap=True)
    for key, label in columns.items():
        grid.add_column(label, no_wrap=key not in ("address", "reason"), overflow="fold")
    for row in result.rows:
        grid.add_row(row["name"], *(_cell(row, key, wide) for key in columns))
    if result.totals is not None and len(result.rows) > 1:
        cells = _totals_cells(result, wide)
        grid.add_section()
        grid.add_row("total", *(cells.get(key, "") for key in columns), style="bold")
    return grid


def reasons(results: list[CheckResult]) -> list[Text]:
    """One line per row that is not plainly up: "NAME: VERDICT, why"."""
    return [
        Text.assemble(
            (row["name"], VERDICT_STYLES[row["verdict"]]), f": {row['verdict']}, {row['reason']}"
        )
        for result in results
        for row in result.rows
        if row.get("reason")
    ]


def render(results: list[CheckResult], wide: bool) -> Group:
    """The tables, one per check."""
    return Group(*(table(result, wide) for result in results))


def run_checks(cfg: TierKVConfig, addresses: list[str], exo_path: Path | None) -> list[CheckResult]:
    results = [check_vaults(cfg, addresses)]
    if exo_path is not None:
        results.append(check_exo_hook(exo_path))
    return results


def as_json(results: list[CheckResult]) -> str:
    found: dict[str, Any] = {result.title: result.rows for result in results}
    found["totals"] = results[0].totals  # the vaults'

    return json.dumps(found, indent=2)


@app.command()
def status(
    config: Annotated[
        Path | None, typer.Option(metavar="PATH", help="tierkv.toml to read.", show_default=False)
    ] = None,
    vault: Annotated[
        list[str] | None,
        typer.Option(
            metavar="HOST:PORT|URL",
            help="A vault, a redis:// or a file:/// URL, to check (repeatable).",
            show_default="the vaults of tierkv.toml's [cluster]",
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print JSON instead of tables.")
    ] = False,
    wide: Annotated[
        bool, typer.Option("--wide", help="Every figure of each vault (a wider table).")
    ] = False,
    watch: Annotated[
        bool, typer.Option("--watch", help="Check again every --interval, refreshing in place.")
    ] = False,
    interval: Annotated[
        float, typer.Option(metavar="SECONDS", help="Time between checks with --watch.", min=0.1)
    ] = 2.0,
    exo_path: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="EXO checkout: also check that the tierkv hook is installed.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """One row per vault: verdict (up, full, degraded, refused, wrong role, down), RAM and disk
    used / cap, hit rate, TLS and sealing; totals across them.

    Exit code 0 when every vault serves us (up, full or degraded), 1 when one is down, refuses
    our token or serves the wrong role, 2 on a configuration error. With --exo-path, also check
    that the tierkv hook is installed in that EXO checkout.
    """
    with _backend_warnings_kept_out():
        _status(config, vault or [], json_output, wide, watch, interval, exo_path)


@contextmanager
def _backend_warnings_kept_out() -> Iterator[None]:
    """Each vault's state and why are in its row and the reason lines: a backend's own warning
    about a vault that does not answer would say it a second time."""
    backends = logging.getLogger("tierkv.backends")
    level = backends.level
    backends.setLevel(logging.ERROR)
    try:
        yield
    finally:
        backends.setLevel(level)


def _status(
    config: Path | None,
    addresses: list[str],
    json_output: bool,
    wide: bool,
    watch: bool,
    interval: float,
    exo_path: Path | None,
) -> None:
    cfg = engine_config(config)
    if cfg.security.data_key_file:  # one that does not parse would fail every store
        from tierkv.seal import read_data_keys

        read_data_keys(cfg.security.data_key_file)
    for address in addresses:
        try:
            parse_cold_address(address)
        except ValueError as exc:
            raise ConfigError(f"--vault: {exc}") from None
    if json_output and watch:
        raise fail("status", "--watch refreshes a table: it cannot be combined with --json", 2)
    results = run_checks(cfg, addresses, exo_path)
    if json_output:
        typer.echo(as_json(results))
    elif watch:
        results = _watch(cfg, addresses, exo_path, results, wide, interval)
    else:
        console = Console()
        tables = render(results, wide)
        if wide:  # every figure whole, however long the lines get (as `kubectl -o wide`)
            unbounded = console.options.update_width(10_000)
            console.width = max(console.width, console.measure(tables, options=unbounded).maximum)
        console.print(tables)
        errors = Console(stderr=True, soft_wrap=True)
        for line in reasons(results):
            errors.print(line)
    raise typer.Exit(0 if all(result.healthy for result in results) else 1)


def _watch(
    cfg: TierKVConfig,
    addresses: list[str],
    exo_path: Path | None,
    results: list[CheckResult],
    wide: bool,
    interval: float,
) -> list[CheckResult]:
    """Check again every `interval` s until Ctrl-C or SIGTERM (whatever signal dispositions this
    process inherited); the last results. On a terminal the tables refresh in place; to a pipe
    or a file each check is one frame, flushed at once."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)
    console = Console()

    def frame(results: list[CheckResult]) -> Group:
        stamp = Text(time.strftime("checked %H:%M:%S (Ctrl-C stops)"), style="dim")
        return Group(render(results, wide), *reasons(results), stamp)

    try:
        if console.is_terminal:
            with Live(frame(results), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    results = run_checks(cfg, addresses, exo_path)
                    live.update(frame(results), refresh=True)
        while True:
            console.print(frame(results))
            console.file.flush()
            time.sleep(interval)
            results = run_checks(cfg, addresses, exo_path)
    except KeyboardInterrupt:
        pass
    return results
