"""tierkv.toml loading: search order, published examples, defaults, and errors that name the key."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
import tomlkit

from tierkv.addresses import parse_address
from tierkv.config import (
    ConfigError,
    Endpoint,
    TierKVConfig,
    config_from_mapping,
    default_max_bytes,
    load_config,
    physical_ram_bytes,
)
from tierkv.sizes import GIB, MIB, parse_size

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No $TIERKV_CONFIG, an empty working directory and home."""
    monkeypatch.delenv("TIERKV_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_published_inference_example_loads_unchanged(tmp_path: Path) -> None:
    path = write(
        tmp_path / "tierkv.toml",
        '[cluster]\nrole = "inference"\nkv_cold = "192.168.1.10:50051"\n'
        'ssm_cold = "192.168.1.11:50051"\n[compression]\nenabled = true\ngroup_size = 256\n',
    )
    cfg = load_config(path)
    assert cfg.source == str(path)
    assert cfg.cluster.vault_addresses() == {
        "kv_cold": (Endpoint("192.168.1.10:50051"),),
        "ssm_cold": (Endpoint("192.168.1.11:50051"),),
    }
    assert (cfg.compression.enabled, cfg.compression.group_size) == (True, 256)
    assert cfg.compression.codec_name == "tq3.5"


def test_published_vault_example_loads_unchanged(tmp_path: Path) -> None:
    path = write(
        tmp_path / "v.toml", '[cluster]\nrole = "kv_cold"\n[vault]\nmax_bytes = 24_000_000_000\n'
    )
    cfg = load_config(path)
    assert cfg.cluster.role == "kv_cold"
    assert cfg.vault.resolved_max_bytes() == 24_000_000_000


def test_defaults() -> None:
    cfg = load_config()
    assert cfg == TierKVConfig()
    assert cfg.source == "defaults"
    assert cfg.vault.listen == "127.0.0.1:50051"
    assert cfg.vault.max_bytes is None
    assert cfg.vault.resolved_max_bytes() == default_max_bytes()
    assert 0 < default_max_bytes() < physical_ram_bytes()
    assert (cfg.client.deadline_ms, cfg.client.promote_deadline_ms) == (2000, 30000)
    assert cfg.client.max_pending_bytes == 256 * MIB
    assert (cfg.client.breaker_failures, cfg.client.breaker_cooldown_s) == (3, 5.0)
    assert cfg.compression.codec_name == "none"
    assert (cfg.connector.store, cfg.connector.staging_bytes) == ("on_eviction", GIB)
    assert (cfg.exo.block_tokens, cfg.exo.write_through) == (256, False)


def test_search_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = write(tmp_path / "home/.config/tierkv/tierkv.toml", "[exo]\nblock_tokens = 1\n")
    assert load_config().source == str(home)
    cwd = write(tmp_path / "tierkv.toml", "[exo]\nblock_tokens = 2\n")
    assert load_config().source == str(cwd)
    env = write(tmp_path / "env.toml", "[exo]\nblock_tokens = 3\n")
    monkeypatch.setenv("TIERKV_CONFIG", str(env))
    assert load_config().exo.block_tokens == 3
    explicit = write(tmp_path / "explicit.toml", "[exo]\nblock_tokens = 4\n")
    assert load_config(explicit).exo.block_tokens == 4


FILES_TOML = """
[security]
token_file = "token"
tls_ca = "../ca/ca.crt"
data_key_file = "/etc/tierkv/data_key"
[vault]
disk_dir = "disk"
"""


def test_files_named_in_a_config_are_relative_to_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through --config, $TIERKV_CONFIG and the user config, from another working directory."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    lan = write(tmp_path / "lan/alice/tierkv.toml", FILES_TOML)
    home = write(tmp_path / "home/.config/tierkv/tierkv.toml", FILES_TOML)

    def files(cfg: TierKVConfig) -> tuple[str | None, ...]:
        return (
            cfg.security.token_file,
            cfg.security.tls_ca,
            cfg.security.data_key_file,
            cfg.vault.disk_dir,
            cfg.security.tls_cert,
        )

    def expected(directory: Path) -> tuple[str | None, ...]:
        return (
            str(directory / "token"),
            str(directory / "../ca/ca.crt"),
            "/etc/tierkv/data_key",
            str(directory / "disk"),
            None,
        )

    assert files(load_config()) == expected(home.parent)
    monkeypatch.setenv("TIERKV_CONFIG", str(lan))
    assert files(load_config()) == expected(lan.parent)
    monkeypatch.chdir(tmp_path / "lan")
    assert files(load_config("alice/tierkv.toml")) == expected(lan.parent)


def test_a_directory_given_as_the_config_is_named_as_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r": a directory, not a config file"):
        load_config(tmp_path)


def test_missing_explicit_or_env_file_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: config file not found"):
        load_config(tmp_path / "nope.toml")
    monkeypatch.setenv("TIERKV_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(ConfigError, match=r"gone.toml \(from \$TIERKV_CONFIG\)"):
        load_config()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cluster]\nrole = 'gpu'\n", "cluster.role: expected one of inference, kv_cold"),
        ("[cluster]\nkv_cold = '10.0.0.1'\n", "cluster.kv_cold: expected host:port"),
        ("[cluster]\nkv_cold = '10.0.0.1:0'\n", "cluster.kv_cold: port 0 out of range"),
        ("[cluster]\nkv_cold = 50051\n", "cluster.kv_cold: expected an address"),
        ("[cluster]\nkv_cold = []\n", "cluster.kv_cold: expected at least one address"),
        ("[cluster]\nkv_cold = ['a:1', 'a:1']\n", "cluster.kv_cold: an address is listed twice"),
        ("[cluster]\nkv_cold = [{ address = 'a:1', weight = 0 }]\n", "expected a positive number"),
        ("[cluster]\nkv_cold = [{ adress = 'a:1' }]\n", "expected { address = ..., weight"),
        ("[cluster]\nkv_cold = 'http://a:1'\n", "cluster.kv_cold: unknown scheme in 'http://a:1'"),
        ("[cluster]\nkv_cold = 'redis://:pw@a'\n", r"no port in 'redis://a'"),
        ("[client]\nredis_password = 7\n", "client.redis_password: expected a non-empty string"),
        ("[cluster]\nkv_colt = '10.0.0.1:1'\n", "unknown key cluster.kv_colt"),
        ("[clutser]\nrole = 'inference'\n", r"unknown section \[clutser\]"),
        ("[vault]\nmax_bytes = '24 bananas'\n", "vault.max_bytes: expected a size"),
        ("[vault]\nmax_bytes = 0\n", "vault.max_bytes: expected a positive size"),
        ("[vault]\nlisten = '::1:50051'\n", "vault.listen: an IPv6 address needs brackets"),
        ("[vault]\nbulk_port = 70000\n", "vault.bulk_port: expected a port number 0-65535"),
        ("[vault]\nbulk_port = '50052'\n", "vault.bulk_port: expected a port number"),
        ("[client]\ndeadline_ms = 'fast'\n", "client.deadline_ms: expected a positive integer"),
        ("[client]\nbreaker_failures = true\n", "client.breaker_failures: expected a positive"),
        ("[compression]\nenabled = 'yes'\n", "compression.enabled: expected true or false"),
        ("[compression]\ncodec = 'tq9'\n", "compression.codec: expected one of int8, tq4"),
        ("[compression]\nmin_cosine = 1.5\n", "compression.min_cosine: expected a number from 0"),
        ("[connector]\nstore = 'always'\n", "connector.store: expected one of on_eviction"),
        ("[exo]\nblock_tokens = -1\n", "exo.block_tokens: expected a positive integer"),
        ("cluster = 3\n", "cluster: expected a table"),
        ("[cluster\n", "cannot read TOML"),
    ],
)
def test_errors_name_the_file_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ".*" + message):
        load_config(path)


def test_sizes_and_unlimited(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.toml",
        '[vault]\nmax_bytes = "unlimited"\n[client]\nmax_pending_bytes = "64MiB"\n'
        "[connector]\nstaging_bytes = 1_000\n",
    )
    cfg = load_config(path)
    assert cfg.vault.max_bytes == 0 and cfg.vault.resolved_max_bytes() == 0
    assert cfg.client.max_pending_bytes == 64 * MIB
    assert cfg.connector.staging_bytes == 1000


def test_config_from_mapping_accepts_tables_and_dotted_keys() -> None:
    cfg = config_from_mapping(
        {
            "cluster": {"kv_cold": "[::1]:50051"},
            "compression.enabled": True,
            "client.deadline_ms": 5,
        },
        "kv_connector_extra_config",
    )
    assert cfg.cluster.kv_cold == (Endpoint("[::1]:50051"),)
    assert cfg.compression.enabled and cfg.client.deadline_ms == 5
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config: unknown key exo\.colour"):
        config_from_mapping({"exo.colour": "red"}, "kv_connector_extra_config")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("24GB", 24_000_000_000),
        ("512MiB", 512 * MIB),
        ("1.5 GiB", 3 * GIB // 2),
        ("4kb", 4000),
        ("100", 100),
        ("1_000", 1000),
        (7, 7),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "GB", "12 parsecs", "-1", -1, True, 1.5])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)  # type: ignore[arg-type]


def test_parse_address() -> None:
    assert parse_address("192.168.1.10:50051") == ("192.168.1.10", 50051)
    assert parse_address("[::1]:50051") == ("::1", 50051)
    assert parse_address("vault.local:1") == ("vault.local", 1)
    assert parse_address("127.0.0.1:0", allow_port_zero=True) == ("127.0.0.1", 0)
    for bad in ["127.0.0.1", ":50051", "host:port", "host:70000", "[::1]50051", "a b:1"]:
        with pytest.raises(ValueError, match=r"address|port|host"):
            parse_address(bad)


def test_example_toml_documents_every_key_and_loads() -> None:
    example = REPO / "tierkv.example.toml"
    cfg = load_config(example)
    document = tomlkit.parse(example.read_text()).unwrap()
    defaults = TierKVConfig()
    sections = ("cluster", "vault", "security", "limits", "client", "compression", "connector")
    for section in (*sections, "exo"):
        names = {f.name for f in fields(getattr(defaults, section))}
        written = set(document.get(section, {}))
        commented = set(re.findall(rf"^#\s*({'|'.join(names)})\s*=", example.read_text(), re.M))
        assert names <= written | commented, section
    assert cfg.source == str(example)


def test_readme_toml_examples_load(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", readme, re.S)
    assert blocks
    for number, block in enumerate(blocks):
        load_config(write(tmp_path / f"readme-{number}.toml", block))


def test_cold_stores_take_lists_weights_and_redis_urls(tmp_path: Path) -> None:
    path = write(
        tmp_path / "tierkv.toml",
        '[cluster]\nkv_cold = ["10.0.0.5:50051", { address = "10.0.0.6:50051", weight = 2 }]\n'
        'ssm_cold = "rediss+cluster://ops:pw@cache.lan:6380"\n',
    )
    cfg = load_config(path)
    assert cfg.cluster.kv_cold == (Endpoint("10.0.0.5:50051"), Endpoint("10.0.0.6:50051", 2.0))
    [ssm] = cfg.cluster.ssm_cold
    assert ssm.address == "rediss+cluster://ops:pw@cache.lan:6380"
    assert str(ssm) == "rediss+cluster://cache.lan:6380"  # what messages and tables show


def test_the_old_names_turbo_quant_and_kv_dim_still_read_with_one_notice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """[turbo_quant] (which also switches int8 and pairs) is now [compression], and its kv_dim
    (a group size) is group_size; a file written with the old names means the same, says so in
    one log line once, and names the new key in its errors."""
    old = tmp_path / "old.toml"
    old.write_text('[turbo_quant]\nenabled = true\ncodec = "int8"\nkv_dim = 64\n')
    new = tmp_path / "new.toml"
    new.write_text('[compression]\nenabled = true\ncodec = "int8"\ngroup_size = 64\n')
    with caplog.at_level("WARNING"):
        from_old, again = load_config(old), load_config(old)
        from_new = load_config(new)
    assert from_old.compression == again.compression == from_new.compression
    assert from_old.compression.group_size == 64
    notices = [record.getMessage() for record in caplog.records]
    assert notices == [
        f"tierkv: {old}: [turbo_quant] is now [compression], kv_dim is now group_size; "
        "the old names still work"
    ]
    dotted = config_from_mapping({"turbo_quant.kv_dim": 32, "turbo_quant.enabled": True}, "x")
    assert (dotted.compression.group_size, dotted.compression.enabled) == (32, True)
    with pytest.raises(ConfigError, match=r"^x: compression\.group_size: expected a multiple"):
        config_from_mapping({"turbo_quant": {"kv_dim": 12}}, "x")


def test_a_setting_under_its_old_and_its_new_name_is_an_error() -> None:
    both = {"compression": {"group_size": 64}, "turbo_quant": {"kv_dim": 32}}
    message = r"^y: compression\.group_size is set twice \(once as turbo_quant\.kv_dim\); set it"
    with pytest.raises(ConfigError, match=message):
        config_from_mapping(both, "y")


def test_a_fraction_of_a_byte_is_refused() -> None:
    assert parse_size("1.5KB") == 1500 and parse_size("0.5KiB") == 512
    for fractional in ("1.5", "0.3B", "1.0001KB"):
        with pytest.raises(ValueError, match="a size is a whole number of bytes"):
            parse_size(fractional)


def test_a_codec_without_enabled_is_noted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "codec.toml", '[compression]\ncodec = "tq4"\n')
    with caplog.at_level("WARNING"):
        assert load_config(path).compression.codec_name == "none"
    assert "compression.codec = 'tq4' is ignored without compression.enabled = true" in caplog.text
    caplog.clear()
    enabled = write(tmp_path / "on.toml", '[compression]\ncodec = "tq4"\nenabled = true\n')
    with caplog.at_level("WARNING"):
        assert load_config(enabled).compression.codec_name == "tq4"
    assert "ignored" not in caplog.text
