"""`tierkv bench` in its default mode: an embedded vault, synthetic KV, every phase."""

import io
import json
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner, Result

from tierkv.addresses import parse_address
from tierkv.backends.memory import MemoryBackend
from tierkv.bench.pipeline import BenchResult, LinkView, bench_tier
from tierkv.cli import app
from tierkv.cli.bench import results_table
from tierkv.keys import chain_block_keys, namespace_fingerprint
from tierkv.model_shapes import MODEL_SHAPES
from tierkv.quant import get_codec
from tierkv.quant.target import instruction_set

# Fidelity floors per codec on the bench's KV-like data (outlier channels, drifting scales).
MIN_COSINE = {
    "none": 1.0,
    "int8": 0.999,
    "tq4": 0.99,
    "tq3.5": 0.98,
    "tq3": 0.97,
    "tq2.5": 0.95,
    "tq2": 0.90,
}


@pytest.fixture(scope="module")
def all_codecs() -> list[dict[str, object]]:
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--tokens",
            "600",
            "--block-tokens",
            "128",
            "--codec",
            "all",
            "--json",
            "--links",
        ],
    )
    assert result.exit_code == 0, result.output
    objects = json.loads(result.stdout)
    assert isinstance(objects, list)
    return objects


def test_json_has_every_field_for_every_codec(all_codecs: list[dict[str, object]]) -> None:
    fields = {
        "tokens", "model_shape", "codec", "raw_bytes", "stored_bytes", "ratio", "memcpy_gbps",
        "encode_gbps", "decode_gbps", "store_s", "lookup_s", "promote_s", "promote_gbps",
        "restore_s", "snr_db", "cosine",
    }  # fmt: skip
    assert [obj["codec"] for obj in all_codecs] == list(MIN_COSINE)
    for obj in all_codecs:
        assert fields <= obj.keys()
        assert obj["tokens"] == 600
        assert obj["model_shape"] == "qwen3.6-35b-a3b"


def test_json_says_what_was_measured_and_leaves_out_what_was_not(
    all_codecs: list[dict[str, object]],
) -> None:
    """600 tokens asked for, 4 blocks of 128 measured; one worker: no concurrent promote, so its
    figures are absent rather than 0.0."""
    for obj in all_codecs:
        assert (obj["tokens"], obj["tokens_measured"]) == (600, 512)
        assert obj["workers"] == 1
        assert "worker_promote_gbps" not in obj and "aggregate_promote_gbps" not in obj
        assert 0.0 not in (obj["seal_gbps"], obj["open_gbps"], obj["sealed_restore_s"])


def test_each_phase_is_the_median_of_the_timed_runs_with_their_spread(
    all_codecs: list[dict[str, object]],
) -> None:
    phases = {
        "encode_s", "store_s", "lookup_s", "promote_s", "decode_s", "load_s", "seal_s",
        "sealed_store_s", "sealed_promote_s", "open_s", "sealed_decode_s", "sealed_load_s",
    }  # fmt: skip
    for obj in all_codecs:
        assert (obj["runs"], obj["warmup_runs"]) == (3, 1)
        spread = obj["spread_s"]
        assert isinstance(spread, dict)
        assert spread.keys() == phases | {"restore_s", "sealed_restore_s"}
        for name in phases:
            low, high = spread[name]
            assert 0 < low <= obj[name] <= high, name
        for total in ("restore_s", "sealed_restore_s"):
            low, high = spread[total]
            assert 0 < low <= high


def test_one_timed_run_has_no_spread() -> None:
    args = ["bench", "--tokens", "256", "--codec", "none", "--repeat", "1", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["runs"] == 1 and "spread_s" not in report


def test_figures_are_consistent(all_codecs: list[dict[str, object]]) -> None:
    raw = {obj["raw_bytes"] for obj in all_codecs}
    assert len(raw) == 1, "every codec must see the same input"
    for obj in all_codecs:
        spread = obj["spread_s"]
        assert isinstance(spread, dict)
        for total, phases in (
            ("restore_s", ("lookup_s", "load_s")),
            ("sealed_restore_s", ("lookup_s", "sealed_load_s")),
        ):  # each run's own sum, so it lies within the sums of the phases' spreads
            low, high = spread[total]
            assert sum(spread[p][0] for p in phases) <= low * (1 + 1e-9)
            assert high <= sum(spread[p][1] for p in phases) * (1 + 1e-9)
        for link, gbits in (("1GbE", 1), ("10GbE", 10), ("25GbE", 25)):
            wire_s = obj["stored_bytes"] * 8 / (gbits * 1e9)
            assert obj["link_s"][link] == pytest.approx(wire_s)
            # A load over the link can never beat the wire, nor the run's lookup before it.
            assert obj["link_restore_s"][link] >= spread["lookup_s"][0] + wire_s
        for speed in ("memcpy_gbps", "encode_gbps", "decode_gbps", "promote_gbps"):
            assert obj[speed] > 0
        # 600 tokens at 128 per block: 4 full blocks.
        assert obj["blocks"] == obj["hit_blocks"] == 4


def test_a_load_over_a_link_view_takes_the_wire_time_and_restores_every_block() -> None:
    """The link rows: ColdTier.load over a LinkView at 0.2 Gbit/s of 16 lossless blocks of 128
    KiB (2 MiB: 84 ms on that wire) takes at least the wire time, restores every block bit for
    bit, and leaves the backend beneath open when the tier closes."""
    backend = MemoryBackend()
    codec = get_codec("none", 64)
    namespace = namespace_fingerprint({"test": "link"})
    keys = chain_block_keys(list(range(16 * 16)), 16)
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal((16, 64, 64)).astype(np.float16) for _ in range(16)]
    with bench_tier(codec, backend) as tier:
        for key, block in zip(keys, blocks, strict=True):
            tier.store(namespace, key, 0, block.copy())
        assert tier.flush(timeout=30)
    stored = sum(block.nbytes for block in blocks)
    out = [np.zeros_like(block) for block in blocks]
    with bench_tier(codec, backend, gbits=0.2) as linked:
        assert isinstance(linked.vaults["kv"], LinkView)
        start = time.perf_counter()
        failed = linked.load(namespace, keys, {"kv": [0]}, lambda index, part: out[index])
        seconds = time.perf_counter() - start
    assert failed == set()
    assert seconds >= stored * 8 / 0.2e9
    assert all(map(np.array_equal, blocks, out))
    assert backend.lookup(namespace, keys, [0]) == 16  # still open, still holding them


def test_fidelity_within_each_codecs_bounds(all_codecs: list[dict[str, object]]) -> None:
    for obj in all_codecs:
        assert obj["cosine"] >= MIN_COSINE[obj["codec"]], obj
    lossless = all_codecs[0]
    assert lossless["max_abs_err"] == 0.0
    assert lossless["ratio"] == pytest.approx(1.0, rel=0.01)
    ratios = {obj["codec"]: obj["ratio"] for obj in all_codecs}
    # Diluted by the lossless linear-attention state, which dominates at 600 tokens.
    assert ratios["tq2"] > ratios["tq3"] > ratios["tq4"] > ratios["int8"] > 1.0


def test_ratio_of_a_pure_attention_model_is_the_codecs() -> None:
    args = ["bench", "--tokens", "512", "--model-shape", "llama-3.1-8b", "--codec", "int8"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    # Llama 3.1 8B: 32 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes per token.
    assert report["raw_bytes"] == 32 * 2 * 8 * 128 * 2 * 512
    # int8: a byte per value and an fp16 scale per group_size (128) values, headers aside.
    assert report["ratio"] == pytest.approx(2 * 128 / (128 + 2), rel=1e-3)


def test_embedded_vault_leaves_no_port_behind(all_codecs: list[dict[str, object]]) -> None:
    host, port = parse_address(str(all_codecs[0]["vault"]))
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect((host, port))


def test_single_codec_prints_one_object_and_the_table() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "--tokens", "256", "--codec", "int8", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["codec"] == "int8"
    table = runner.invoke(app, ["bench", "--tokens", "300", "--codec", "none"])
    assert table.exit_code == 0, table.output
    assert "promote" in table.stdout and "memcpy" in table.stdout
    assert f"kernels for {instruction_set()}" in " ".join(table.stdout.split())  # vector width
    assert "256 of 300 tokens" in table.stdout and "median of 3 timed runs" in table.stdout
    assert re.search(r"restore ±\s+±\d+%", table.stdout), table.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--codec", "tq9"], "tq9"),
        (["--model-shape", "gpt-5"], "gpt-5"),
        (["--tokens", "100"], "100"),
    ],
)
def test_bad_input_is_named(args: list[str], named: str) -> None:
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2
    assert named in result.output


def _no_constants(name: str) -> object:
    raise AssertionError(f"{name} is not JSON")


def test_json_is_strict_json(all_codecs: list[dict[str, object]]) -> None:
    result = CliRunner().invoke(app, ["bench", "--tokens", "256", "--codec", "none", "--json"])
    assert result.exit_code == 0, result.output
    lossless = json.loads(result.stdout, parse_constant=_no_constants)
    assert isinstance(lossless, dict) and lossless["snr_db"] is None
    assert all(obj["snr_db"] is not None for obj in all_codecs[1:])


def test_table_fits_80_columns_with_every_codec(all_codecs: list[dict[str, object]]) -> None:
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(results_table([BenchResult(**obj) for obj in all_codecs]))  # type: ignore[arg-type]
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    for codec in MIN_COSINE:
        assert codec in text
    assert "lossless" in text  # the SNR of "none", not "inf"


def test_progress_is_reported_when_output_is_not_a_terminal() -> None:
    result = CliRunner().invoke(app, ["bench", "--tokens", "256", "--codec", "int8"])
    assert result.exit_code == 0, result.output
    assert "tierkv bench: preparing the codec kernels" in result.stderr
    assert "tierkv bench: kernels ready in " in result.stderr


def test_tokens_not_a_multiple_of_the_block_says_what_is_measured() -> None:
    result = CliRunner().invoke(app, ["bench", "--tokens", "300", "--codec", "none", "--json"])
    assert result.exit_code == 0, result.output
    assert "measuring 256 of the 300 tokens: whole blocks of 256" in result.stderr
    assert json.loads(result.stdout)["blocks"] == 1


def test_too_many_tokens_are_refused_up_front_with_the_memory_needed() -> None:
    result = CliRunner().invoke(app, ["bench", "--tokens", "10000000"])
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("tierkv bench: --tokens 10000000 needs about ")
    assert "GB of memory" in line and "kernels" not in result.stderr


def _one_error_line(result: Result, code: int) -> str:
    """The line the bench ended with (after its progress notes), checking there is no more."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    line = result.stderr.splitlines()[-1]
    assert line.startswith("tierkv bench: ")
    return line


def test_a_vault_that_is_down_is_one_line_before_any_work(free_port: int) -> None:
    result = CliRunner().invoke(app, ["bench", "--vault", f"127.0.0.1:{free_port}"])
    line = _one_error_line(result, 1)
    assert f"127.0.0.1:{free_port}" in line
    assert result.stderr.strip() == line  # nothing compiled or generated first


def test_a_bad_vault_address_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["bench", "--vault", "nohost"])
    line = _one_error_line(result, 2)
    assert "--vault" in line and result.stderr.strip() == line


def test_a_full_vault_is_one_line(vault_factory: Callable[..., Any]) -> None:
    small = vault_factory(max_bytes="1MiB")
    args = ["bench", "--vault", small.address, "--tokens", "512", "--codec", "none"]
    line = _one_error_line(CliRunner().invoke(app, args), 1)
    assert "full" in line


def test_a_vault_that_refuses_us_is_one_line_before_any_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tierkv.vault.auth import Tokens
    from tierkv.vault.server import serve

    monkeypatch.delenv("TIERKV_TOKEN", raising=False)
    server = serve("127.0.0.1:0", 0, tokens=Tokens([("default", "right-token-0123")]))
    try:
        result = CliRunner().invoke(app, ["bench", "--vault", server.address, "--tokens", "256"])
        line = _one_error_line(result, 1)
        assert "token" in line and result.stderr.strip() == line
    finally:
        server.stop()


@pytest.mark.parametrize("shape", list(MODEL_SHAPES))
def test_every_model_shape_runs(shape: str) -> None:
    args = ["bench", "--tokens", "256", "--block-tokens", "128", "--model-shape", shape]
    result = CliRunner().invoke(app, [*args, "--codec", "none", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model_shape"] == shape
    assert report["blocks"] == report["hit_blocks"] == 2
    assert report["max_abs_err"] == 0.0


def test_an_external_vault_is_used_and_left_running(vault_factory: Callable[..., Any]) -> None:
    vault = vault_factory()
    args = ["bench", "--tokens", "256", "--block-tokens", "128", "--codec", "int8"]
    result = CliRunner().invoke(app, [*args, "--vault", vault.address, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["vault"] == vault.address
    stats = vault.store.stats()
    assert stats.hits > 0  # the bench's promote was served by this vault
    assert vault.server is not None and vault.server.bulk_port  # still serving


def test_an_external_vault_with_mutual_tls_and_a_token_uses_the_security_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tls_certs import make_certs

    from tierkv.config import SecurityConfig
    from tierkv.vault.auth import Tokens
    from tierkv.vault.server import serve

    monkeypatch.delenv("TIERKV_TOKEN", raising=False)
    certs = make_certs(tmp_path / "certs")
    token = "bench-token-0123456789abcdef"
    vault_side = SecurityConfig(
        tls_cert=str(certs.server_cert), tls_key=str(certs.server_key), client_ca=str(certs.ca)
    )
    server = serve("127.0.0.1:0", 0, tokens=Tokens([("default", token)]), security=vault_side)
    (tmp_path / "tokens").write_text(f"{token}\n")
    (tmp_path / "tokens").chmod(0o600)
    config = tmp_path / "tierkv.toml"
    config.write_text(
        f'[security]\ntoken_file = "{tmp_path / "tokens"}"\ntls_ca = "{certs.ca}"\n'
        f'tls_cert = "{certs.client_cert}"\ntls_key = "{certs.client_key}"\n'
    )
    args = ["bench", "--tokens", "256", "--codec", "none", "--json", "--config", str(config)]
    try:
        result = CliRunner().invoke(app, [*args, "--vault", server.address])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["hit_blocks"] == 1
        assert server.store.stats().hits > 0  # served over TLS, with our token
    finally:
        server.stop()


def test_every_codec_runs_sealed_beside_unsealed(all_codecs: list[dict[str, object]]) -> None:
    for obj in all_codecs:
        assert obj["sealed_with"] == "a key made for the run"
        for speed in ("seal_gbps", "open_gbps", "sealed_store_gbps", "sealed_promote_gbps"):
            assert obj[speed] > 0
        assert obj["sealed_vs_unsealed_restore"] == pytest.approx(
            obj["restore_s"] / obj["sealed_restore_s"]
        )


def test_the_configured_data_key_seals_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    from tierkv.seal import new_data_key_line

    keys = tmp_path / "data.keys"
    keys.write_text(new_data_key_line(1) + new_data_key_line(4))
    config = tmp_path / "tierkv.toml"
    config.write_text(f'[security]\ndata_key_file = "{keys}"\n')
    args = ["bench", "--tokens", "256", "--codec", "none", "--json", "--config", str(config)]
    line = _one_error_line(CliRunner().invoke(app, args), 2)  # others may read it: as status
    assert str(keys) in line and "open to group or others" in line
    keys.chmod(0o600)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sealed_with"] == "data_key_file key 4"
    keys.write_text("1 c2hvcnQ\n")
    line = _one_error_line(CliRunner().invoke(app, args), 2)
    assert str(keys) in line and "5 bytes" in line


def test_a_bench_that_fills_the_vault_leaves_none_of_its_blocks(
    vault_factory: Callable[..., Any],
) -> None:
    """Issue 36 point 7: the vault fills half-way; the blocks the bench did store are removed."""
    small = vault_factory(max_bytes="32MiB")
    args = ["bench", "--vault", small.address, "--tokens", "3000", "--codec", "none"]
    line = _one_error_line(CliRunner().invoke(app, args), 1)
    assert "full" in line
    assert small.store.stats().entries == 0


class _Stop(Exception):
    """What the bench's progress callback raises to end a run half-way."""


@pytest.mark.parametrize("phase", ["put", "promote", "sealed put", "sealed decode"])
@pytest.mark.parametrize("stop", [_Stop, KeyboardInterrupt])
def test_a_bench_stopped_half_way_removes_its_blocks(
    vault_factory: Callable[..., Any], phase: str, stop: type[BaseException]
) -> None:
    """An exception or Ctrl-C in any phase: the external vault holds none of the bench's blocks."""
    from tierkv.bench.pipeline import run_bench

    vault = vault_factory()

    def on_phase(codec: str, reached: str, done: int, total: int) -> None:
        if reached == phase:
            raise stop(phase)

    with pytest.raises(stop):
        run_bench(
            tokens=512, block_tokens=128, codecs=["int8"], vaults=[vault.address], on_phase=on_phase
        )
    assert vault.store.stats().entries == 0


def test_sliding_window_layers_store_only_their_window() -> None:
    """gemma3-27b: the 10 full-attention layers' KV of every block, the 52 sliding-window
    layers' of the blocks inside the 1024-token window before the prompt's end only."""
    from tierkv.bench.pipeline import raw_kv_bytes, synthetic_kv

    shape = MODEL_SHAPES["gemma3-27b"]
    kv = synthetic_kv(shape, tokens=4096, block_tokens=256, dtype="fp16")
    assert [len(block) for block in kv.blocks] == [10] * 12 + [62] * 4
    assert all(np.abs(block[-1]).max() > 0 for block in kv.blocks[12:])  # filled, not left empty
    token_layer_bytes = 2 * 16 * 128 * 2
    expected = (16 * 256 * 10 + 4 * 256 * 52) * token_layer_bytes
    assert kv.raw_bytes == raw_kv_bytes(shape, 4096, 256, "fp16") == expected


def test_window_shapes_report_stored_bytes_per_token_beside_full_attention() -> None:
    """gemma3-1b (4 full-attention layers, 22 of a 512-token window, 1 KV head of 256), 2048
    tokens in 16 blocks: the vault holds every block of the full-attention layers and the last 4
    of the window layers; were all 26 layers full attention, every block of each. Lossless, so
    the measured bytes are the raw KV's plus the payload headers."""
    args = ["bench", "--tokens", "2048", "--block-tokens", "128", "--model-shape", "gemma3-1b"]
    result = CliRunner().invoke(app, [*args, "--codec", "none", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    token_layer = 2 * 1 * 256 * 2  # K and V, fp16
    assert report["stored_bytes_per_token"] == report["stored_bytes"] / 2048
    window_share = 4 * 128 / 2048
    stored = (4 + 22 * window_share) * token_layer
    assert stored <= report["stored_bytes_per_token"] < 1.01 * stored
    full = 26 * token_layer
    assert full <= report["full_attention_bytes_per_token"] < 1.01 * full
    plain = CliRunner().invoke(app, ["bench", "--tokens", "256", "--codec", "none", "--json"])
    assert "full_attention_bytes_per_token" not in json.loads(plain.stdout)
    table = CliRunner().invoke(app, [*args, "--codec", "none"])
    assert "kB/token" in table.stdout and "kB/tok full" in table.stdout
