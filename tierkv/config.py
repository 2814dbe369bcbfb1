"""tierkv.toml: find, read (tomlkit) and validate the configuration into frozen dataclasses.

Search order of `load_config`: an explicit path, `$TIERKV_CONFIG`, `./tierkv.toml`,
`~/.config/tierkv/tierkv.toml`, then the built-in defaults. Every problem (unknown key, wrong
type, bad size or address) raises `ConfigError` naming the file, the key and what was expected.
A file named in a tierkv.toml (security files, vault.disk_dir) is relative to that file's
directory, whatever directory tierkv runs in.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tierkv.addresses import parse_address, parse_cold_address, parse_ip_address, redact
from tierkv.codecs import AUTO_CODEC, PRESETS, TURBO_QUANT_CODECS, kv_pair_codecs, kv_pair_name
from tierkv.errors import TierKVError
from tierkv.logs import get_logger
from tierkv.sizes import GIB, MIB, SIZE_FORMS, parse_size

log = get_logger(__name__)

KV_VAULT, SSM_VAULT = "kv", "ssm"
VAULT_ROLE = {KV_VAULT: "kv_cold", SSM_VAULT: "ssm_cold"}
"""ColdTier's vaults ("kv": attention KV; "ssm": SSM / linear-attention state) and the role the
vault of each serves, which is also its `[cluster]` key."""
VAULT_ROLES = tuple(VAULT_ROLE.values())
ROLES = ("inference", *VAULT_ROLES)
STORE_MODES = ("on_eviction", "on_finish")
FSYNC_MODES = ("never", "interval", "always")
"""When a vault's disk tier syncs its writes: see the README's table of what each loses."""
DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_RAM_FRACTION = 0.5
"""Share of physical RAM a vault caps itself at when `vault.max_bytes` is not set."""
UNLIMITED = 0
"""`max_bytes` value meaning no cap (written "unlimited" in tierkv.toml)."""
ENV_VAR = "TIERKV_CONFIG"
MIN_CAP_BYTES = MIB
"""The smallest cap of a vault's RAM or disk tier: below it not one KV block of a small model
(a few hundred KiB per layer) fits, so every store would be dropped."""


class ConfigError(TierKVError, ValueError):
    """A configuration problem; the message names the source, the key and what was expected."""


@dataclass(frozen=True)
class Endpoint:
    """One cold store: a vault "host:port" or a redis URL, and its share weight among several."""

    address: str
    weight: float = 1.0

    def __str__(self) -> str:
        return redact(self.address)


def physical_ram_bytes() -> int:
    """Physical memory of this machine in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_max_bytes() -> int:
    """A vault's cap when none is configured: DEFAULT_RAM_FRACTION of physical RAM."""
    return int(physical_ram_bytes() * DEFAULT_RAM_FRACTION)


@dataclass(frozen=True)
class ClusterConfig:
    """Which role this machine plays and where the cold stores of each role are (empty: none).

    `kv_cold` / `ssm_cold` take one address, a list of them, or `{ address, weight }` tables;
    blocks are spread over several in proportion to their weights.
    """

    role: str | None = None
    """"inference" (an engine's file), kv_cold or ssm_cold (a vault's); None: not said."""
    kv_cold: tuple[Endpoint, ...] = ()
    ssm_cold: tuple[Endpoint, ...] = ()

    def endpoints(self, vault: str) -> tuple[Endpoint, ...]:
        """The configured cold stores of ColdTier's vault `vault` ("kv" or "ssm")."""
        found: tuple[Endpoint, ...] = getattr(self, VAULT_ROLE[vault])
        return found

    def vault_addresses(self) -> dict[str, tuple[Endpoint, ...]]:
        """Configured cold stores by role name ("kv_cold", "ssm_cold")."""
        found = {role: self.endpoints(vault) for vault, role in VAULT_ROLE.items()}
        return {role: endpoints for role, endpoints in found.items() if endpoints}


@dataclass(frozen=True)
class VaultConfig:
    """The vault server on this machine. max_bytes None: default share of RAM; 0: unlimited."""

    listen: str = DEFAULT_LISTEN
    max_bytes: int | None = None
    bulk_port: int = 0
    """TCP port of the bulk data path on the listen host; 0: any free port (told to clients)."""
    disk_dir: str | None = None
    """Directory of the disk tier (blocks spill there and survive restarts); None: RAM only."""
    disk_max_bytes: int | None = None
    """Cap of the disk tier; None: half of what the filesystem has free (plus what it holds)."""
    fsync: str = "interval"
    metrics_port: int | None = None
    """TCP port of Prometheus /metrics; None: not served."""
    metrics_host: str | None = None
    """IP address /metrics listens on (it checks no token); None: the listen host where that is
    loopback, the vault is --insecure or needs client certificates, else loopback."""

    def resolved_max_bytes(self) -> int:
        """The cap to use: the configured one, or default_max_bytes() (0 stays unlimited)."""
        return default_max_bytes() if self.max_bytes is None else self.max_bytes


@dataclass(frozen=True)
class SecurityConfig:
    """Tokens and TLS (tierkv/wire/secrets.py; the vault: tierkv/vault/auth.py, a client:
    tierkv/backends/security.py); paths of files, never secrets themselves.

    A vault uses token_file (its tokens, tenants), tls_cert/tls_key (its certificate) and
    client_ca (require client certificates signed by it); a client uses token_file (its token,
    unless $TIERKV_TOKEN is set), tls_ca (verify the vault's certificate: TLS on) and
    tls_cert/tls_key (its own certificate, for a vault with client_ca). An engine with
    data_key_file seals every block it stores under its tenant's data keys (tierkv/seal.py);
    vaults never see that file.
    """

    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    client_ca: str | None = None
    tls_ca: str | None = None
    data_key_file: str | None = None


@dataclass(frozen=True)
class LimitsConfig:
    """What one peer may ask of a vault; beyond it a request is refused, the vault serves on."""

    max_connections: int = 256
    """Bulk connections served at once (all clients)."""
    max_connections_per_client: int = 64
    """Bulk connections served at once per client IP address."""
    max_connections_per_tenant: int = 32
    """Authenticated bulk connections served at once per tenant, on a vault of several tenants
    (more are refused after their handshake, with a reason; the client uses gRPC then), so one
    tenant cannot hold every connection of an address or of the vault."""
    handshake_timeout_s: float = 5.0
    """A new bulk connection that has not authenticated (or sent a frame) by then is closed."""
    idle_timeout_s: float = 30.0
    """A bulk connection idle between frames this long is closed (clients reconnect: one
    handshake), so idle connections hold their slots for seconds, not minutes."""
    stall_timeout_s: float = 30.0
    """A frame that makes no progress this long is dropped with its connection."""
    max_concurrent_rpcs: int = 64
    """gRPC calls served at once; more are answered RESOURCE_EXHAUSTED. Put and Promote
    streams may take at most half of them, so lookups and health checks always get through."""
    max_concurrent_rpcs_per_tenant: int = 32
    """gRPC calls of one tenant served at once, on a vault of several tenants; more of its calls
    are answered RESOURCE_EXHAUSTED, so one tenant cannot take every call of the vault. Its part
    of max_concurrent_rpcs is the tenant's part of the Put/Promote streams and of the bytes being
    received or sent too (vault.limits.tenant_share)."""
    stream_timeout_s: float = 120.0
    """A gRPC Put or Promote stream still open after this long is cancelled by the vault."""
    max_message_bytes: int = 64 * MIB
    """Largest gRPC message the vault receives (one Put batch)."""
    max_blocks_per_request: int = 65536
    """keys x parts of one Lookup or Promote, keys of one Delete, blocks of one Put batch."""
    max_key_bytes: int = 64
    max_namespace_bytes: int = 256
    max_inflight_bytes: int = 256 * MIB
    """Payload bytes of bulk PUT frames being received at once; a frame waits for room, and a
    frame larger than this (or than the cap) is refused from its header. gRPC Put messages have
    a budget of the same size, a stream taking max_message_bytes of it to receive each one."""


@dataclass(frozen=True)
class ClientConfig:
    """How engines talk to vaults: deadlines, put queue, circuit breaker."""

    deadline_ms: int = 2000
    promote_deadline_ms: int = 30000
    max_pending_bytes: int = 256 * MIB
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    receive_pool_bytes: int = 64 * MIB
    """Receive buffers mapped and touched when a tier starts (0: none), so no restore pays a
    page fault for them (transfer.ReceiveBuffers.fill)."""
    kept_freed_bytes: int = 256 * MIB
    """Freed memory each malloc arena of the engine process keeps mapped for the next
    allocations (glibc; 0: the C library's defaults), so the payloads a tier encodes and
    receives are written into pages already mapped (tierkv.heap)."""
    redis_username: str | None = None
    """ACL user for redis:// backends (else $TIERKV_REDIS_USERNAME, else the URL's)."""
    redis_password: str | None = None
    """Password for redis:// backends (else $TIERKV_REDIS_PASSWORD, else the URL's)."""


@dataclass(frozen=True)
class CompressionConfig:
    """`[compression]`: how KV blocks are stored, lossless unless enabled (int8, TurboQuant or a
    K/V pair of them). `group_size`: the values the codecs scale and rotate together (a head's
    dim); `min_cosine`: a block whose round trip falls below it is stored lossless."""

    enabled: bool = False
    group_size: int = 128
    codec: str = "tq3.5"
    min_cosine: float = 0.0

    @property
    def codec_name(self) -> str:
        """The codec blocks are stored with: "none" (lossless) unless enabled; "auto" until
        `resolve_auto_codec` replaces it with the model's verdict."""
        return self.codec if self.enabled else "none"


@dataclass(frozen=True)
class ConnectorConfig:
    """vLLM connector behaviour."""

    store: str = "on_eviction"
    staging_bytes: int = GIB


@dataclass(frozen=True)
class ExoConfig:
    """EXO hook behaviour."""

    block_tokens: int = 256
    write_through: bool = False


@dataclass(frozen=True)
class TierKVConfig:
    """The whole configuration; `source` says where it came from (a path or "defaults")."""

    source: str = "defaults"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    vault: VaultConfig = field(default_factory=VaultConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    exo: ExoConfig = field(default_factory=ExoConfig)
    codec_verdicts: dict[str, str] = field(default_factory=dict)
    """`[codec_verdicts]`: model fingerprint -> the codec `tierkv eval --write-config` chose."""


# ---- validation ------------------------------------------------------------------------------
# Each checker turns a raw TOML value into the field's value or raises ValueError("expected ...").


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return value


def _group_size(value: Any) -> int:
    """A group the codecs can scale and TurboQuant rotate: a multiple of 8 in 16..1024."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value % 8
        or not 16 <= value <= 1024
    ):
        raise ValueError(f"expected a multiple of 8 in 16..1024, got {value!r}")
    return value


def _port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"expected a port number 0-65535, got {value!r}")
    return value


def _positive_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"expected a positive number, got {value!r}")
    return float(value)


def _cosine(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"expected a number from 0 to 1, got {value!r}")
    return float(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}; got {value!r}")
        return str(value)

    return check


def _codec_choice(value: Any) -> str:
    """`[compression] codec`: a lossy codec, "auto", a K/V pair ("k8v4" or {k = .., v = ..}) or
    a preset ("kv4": the pair it names)."""
    if isinstance(value, Mapping):
        if set(value) != {"k", "v"}:
            raise ValueError(f"a K/V pair is a table with keys k and v, got {dict(value)!r}")
        return kv_pair_name(value["k"], value["v"])
    if value == AUTO_CODEC or value in TURBO_QUANT_CODECS:
        return str(value)
    pair = kv_pair_codecs(value) if isinstance(value, str) else None
    if pair is not None:
        return kv_pair_name(*pair)
    raise ValueError(
        f"expected one of {', '.join(TURBO_QUANT_CODECS)}, {AUTO_CODEC}, a preset "
        f'({", ".join(PRESETS)}), a K/V pair like "k8v4" or {{ k = "int8", v = "tq4" }}; '
        f"got {value!r}"
    )


def _verdict_codec(value: Any) -> str:
    """A `[codec_verdicts]` value: "none" or anything `[compression] codec` accepts but auto."""
    if value == "none":
        return "none"
    codec = _codec_choice(value)
    if codec == AUTO_CODEC:
        raise ValueError("a verdict names a codec, not auto")
    return codec


def _positive_size(value: Any) -> int:
    size = parse_size(value)
    if size <= 0:
        raise ValueError(f"expected a positive size, got {value!r}")
    return size


def _size(value: Any) -> int:
    size = parse_size(value)
    if size < 0:
        raise ValueError(f"expected a size (0 or more), got {value!r}")
    return size


def parse_max_bytes(value: int | str) -> int:
    """A vault cap: a positive size, or "unlimited" (→ UNLIMITED, 0); else ValueError."""
    if value == "unlimited":
        return UNLIMITED
    size = parse_size(value, f'{SIZE_FORMS}, or "unlimited"')
    if size <= 0:
        raise ValueError(f'expected a positive size or "unlimited", got {value!r}')
    return size


def parse_cap(value: int | str, *, unlimited: bool) -> int:
    """A RAM (`unlimited`: also "unlimited" → UNLIMITED) or disk tier's cap: a size of at least
    MIN_CAP_BYTES; else ValueError naming the smallest."""
    size = parse_max_bytes(value) if unlimited else _positive_size(value)
    if size != UNLIMITED and size < MIN_CAP_BYTES:
        raise ValueError(
            f"expected at least 1MiB (a smaller cap holds no KV block: every store would be "
            f"dropped), got {value!r}"
        )
    return size


def _string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty string")
    return value


def _endpoint(value: Any) -> Endpoint:
    if not isinstance(value, Mapping):
        return Endpoint(parse_cold_address(value))
    unknown = set(value) - {"address", "weight"}
    if unknown or "address" not in value:
        raise ValueError(f"expected {{ address = ..., weight = ... }}, got keys {sorted(value)}")
    return Endpoint(parse_cold_address(value["address"]), _positive_float(value.get("weight", 1)))


def _cold_endpoints(value: Any) -> tuple[Endpoint, ...]:
    """One address, or a non-empty list of addresses / { address, weight } tables."""
    endpoints = (
        tuple(_endpoint(v) for v in value) if isinstance(value, list) else (_endpoint(value),)
    )
    if not endpoints:
        raise ValueError("expected at least one address")
    addresses = [endpoint.address for endpoint in endpoints]
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"an address is listed twice in {[str(e) for e in endpoints]}")
    return endpoints


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a file path, got {value!r}")
    return str(Path(value).expanduser())


def _listen_address(value: Any) -> str:
    parse_address(value, allow_port_zero=True)
    return str(value)


_SECTIONS: dict[str, tuple[type, dict[str, Callable[[Any], Any]]]] = {
    "cluster": (
        ClusterConfig,
        {"role": _one_of(ROLES), "kv_cold": _cold_endpoints, "ssm_cold": _cold_endpoints},
    ),
    "vault": (
        VaultConfig,
        {
            "listen": _listen_address,
            "max_bytes": lambda value: parse_cap(value, unlimited=True),
            "bulk_port": _port,
            "disk_dir": _path,
            "disk_max_bytes": lambda value: parse_cap(value, unlimited=False),
            "fsync": _one_of(FSYNC_MODES),
            "metrics_port": _port,
            "metrics_host": parse_ip_address,
        },
    ),
    "security": (
        SecurityConfig,
        {
            "token_file": _path,
            "tls_cert": _path,
            "tls_key": _path,
            "client_ca": _path,
            "tls_ca": _path,
            "data_key_file": _path,
        },
    ),
    "limits": (
        LimitsConfig,
        {
            "max_connections": _positive_int,
            "max_connections_per_client": _positive_int,
            "max_connections_per_tenant": _positive_int,
            "handshake_timeout_s": _positive_float,
            "idle_timeout_s": _positive_float,
            "stall_timeout_s": _positive_float,
            "max_concurrent_rpcs": _positive_int,
            "max_concurrent_rpcs_per_tenant": _positive_int,
            "stream_timeout_s": _positive_float,
            "max_message_bytes": _positive_size,
            "max_blocks_per_request": _positive_int,
            "max_key_bytes": _positive_int,
            "max_namespace_bytes": _positive_int,
            "max_inflight_bytes": _positive_size,
        },
    ),
    "client": (
        ClientConfig,
        {
            "deadline_ms": _positive_int,
            "promote_deadline_ms": _positive_int,
            "max_pending_bytes": _positive_size,
            "breaker_failures": _positive_int,
            "breaker_cooldown_s": _positive_float,
            "receive_pool_bytes": _size,
            "kept_freed_bytes": _size,
            "redis_username": _string,
            "redis_password": _string,
        },
    ),
    "compression": (
        CompressionConfig,
        {
            "enabled": _bool,
            "group_size": _group_size,
            "codec": _codec_choice,
            "min_cosine": _cosine,
        },
    ),
    "connector": (
        ConnectorConfig,
        {"store": _one_of(STORE_MODES), "staging_bytes": _positive_size},
    ),
    "exo": (ExoConfig, {"block_tokens": _positive_int, "write_through": _bool}),
}


def _nest_dotted_keys(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """{"compression.enabled": 1} → {"compression": {"enabled": 1}}; nested tables pass through."""
    nested: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: key {key!r}: expected a string key")
        section, dot, name = key.partition(".")
        if not dot:
            nested.setdefault(section, {})
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: {key}: expected a table [{key}], got {value!r}")
            nested[section].update(value)
        else:
            nested.setdefault(section, {})[name] = value
    return nested


def config_from_mapping(data: Mapping[str, Any], source: str) -> TierKVConfig:
    """Validate a parsed mapping (TOML tables, or dotted keys like "cluster.kv_cold").

    Raises ConfigError naming `source`, the key and what was expected.
    """
    sections: dict[str, Any] = {}
    for section, raw in _renamed(_nest_dotted_keys(data, source), source).items():
        if section == "codec_verdicts":
            sections[section] = _verdicts(raw, source)
            continue
        if section not in _SECTIONS:
            raise ConfigError(
                f"{source}: unknown section [{section}]; expected one of "
                f"{', '.join(_SECTIONS)}, codec_verdicts"
            )
        cls, checkers = _SECTIONS[section]
        values: dict[str, Any] = {}
        for name, value in raw.items():
            if name not in checkers:
                raise ConfigError(
                    f"{source}: unknown key {section}.{name}; [{section}] accepts "
                    f"{', '.join(checkers)}"
                )
            try:
                values[name] = checkers[name](value)
            except ValueError as exc:
                raise ConfigError(f"{source}: {section}.{name}: {exc}") from None
        if section == "compression" and "codec" in values and not values.get("enabled"):
            log.warning(
                "%s: compression.codec = %r is ignored without compression.enabled = true; "
                "blocks are stored lossless",
                source,
                values["codec"],
            )
        sections[section] = cls(**values)
    return TierKVConfig(source=source, **sections)


RENAMED_SECTIONS = {"turbo_quant": "compression"}
"""Sections read under an old name too, as their new one (with a notice)."""
RENAMED_KEYS = {"compression.kv_dim": "compression.group_size"}
"""Keys read under an old name too, as their new one (with a notice)."""
_told_renamed: set[str] = set()


def _renamed(sections: dict[str, dict[str, Any]], source: str) -> dict[str, dict[str, Any]]:
    """`sections` under today's names (RENAMED_SECTIONS, RENAMED_KEYS); the old names found are
    said in one log line, once per source. ConfigError when a setting is given under its old
    and its new name."""
    renamed: dict[str, dict[str, Any]] = {}
    notes: dict[str, str] = {}
    for section, raw in sections.items():
        target = RENAMED_SECTIONS.get(section, section)
        if target != section:
            notes[f"[{section}]"] = f"[{target}]"
        table = renamed.setdefault(target, {})
        for name, value in raw.items():
            new = RENAMED_KEYS.get(f"{target}.{name}", f"{target}.{name}").partition(".")[2]
            if new != name:
                notes[name] = new
            if new in table:
                raise ConfigError(
                    f"{source}: {target}.{new} is set twice (once as {section}.{name}); set it once"
                )
            table[new] = value
    if notes and source not in _told_renamed:
        _told_renamed.add(source)
        renames = ", ".join(f"{old} is now {new}" for old, new in notes.items())
        log.warning("%s: %s; the old names still work", source, renames)
    return renamed


def _verdicts(raw: Mapping[str, Any], source: str) -> dict[str, str]:
    verdicts = {}
    for fingerprint, value in raw.items():
        try:
            verdicts[str(fingerprint)] = _verdict_codec(value)
        except ValueError as exc:
            raise ConfigError(f"{source}: codec_verdicts.{fingerprint}: {exc}") from None
    return verdicts


def _candidate_paths(path: str | Path | None) -> list[tuple[Path, bool]]:
    """(path, must_exist) in search order."""
    if path is not None:
        return [(Path(path), True)]
    env = os.environ.get(ENV_VAR)
    if env:
        return [(Path(env), True)]
    return [
        (Path.cwd() / "tierkv.toml", False),
        (Path.home() / ".config" / "tierkv" / "tierkv.toml", False),
    ]


def load_config(path: str | Path | None = None) -> TierKVConfig:
    """The configuration from the first file found in the search order, else the defaults."""
    import tomlkit  # here, not at the top: `tierkv --help` needs no TOML parser
    from tomlkit.exceptions import TOMLKitError

    for candidate, must_exist in _candidate_paths(path):
        if not candidate.is_file():
            if must_exist:
                origin = "" if path is not None else f" (from ${ENV_VAR})"
                what = (
                    "a directory, not a config file"
                    if candidate.is_dir()
                    else "config file not found"
                )
                raise ConfigError(f"{candidate}{origin}: {what}")
            continue
        try:
            document = tomlkit.parse(candidate.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, TOMLKitError) as exc:
            raise ConfigError(f"{candidate}: cannot read TOML: {exc}") from None
        cfg = config_from_mapping(document.unwrap(), str(candidate))
        return _files_relative_to(cfg, candidate.absolute().parent)
    return TierKVConfig()


def _files_relative_to(cfg: TierKVConfig, directory: Path) -> TierKVConfig:
    """`cfg` with every relative file or directory it names made relative to `directory`."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else str(directory / path)  # an absolute path stays

    security = replace(
        cfg.security,
        **{name: absolute(getattr(cfg.security, name)) for name in _SECTIONS["security"][1]},
    )
    vault = replace(cfg.vault, disk_dir=absolute(cfg.vault.disk_dir))
    return replace(cfg, security=security, vault=vault)


_told_auto: set[str | None] = set()


def resolve_auto_codec(
    cfg: TierKVConfig, model_fingerprint: Callable[[], str | None]
) -> TierKVConfig:
    """`cfg` with `[compression] codec = "auto"` replaced by the verdict `[codec_verdicts]` holds
    for the model whose weights `model_fingerprint()` fingerprints (called only for auto),
    lossless when there is none (said once per model in the log). Any other codec setting comes
    back unchanged."""
    if cfg.compression.codec_name != AUTO_CODEC:
        return cfg
    fingerprint = model_fingerprint()
    verdict = cfg.codec_verdicts.get(fingerprint) if fingerprint else None
    if fingerprint not in _told_auto:
        _told_auto.add(fingerprint)
        if verdict is None:
            log.warning(
                "codec = auto, but %s holds no verdict for model %s; storing lossless "
                "(run `tierkv eval --write-config` to record one)",
                cfg.source,
                fingerprint or "(weights not found)",
            )
        else:
            log.warning("codec = auto: %s's verdict for this model is %s", cfg.source, verdict)
    codec = verdict or "none"
    compression = replace(cfg.compression, codec=codec, enabled=codec != "none")
    return replace(cfg, compression=compression)
