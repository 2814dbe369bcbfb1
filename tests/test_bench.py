"""`tierkv bench` in its default mode: an embedded vault, synthetic KV, every phase."""

import json
import socket

import pytest
from typer.testing import CliRunner

from tierkv.cli import app
from tierkv.config import parse_address

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
        app, ["bench", "--tokens", "600", "--block-tokens", "128", "--codec", "all", "--json"]
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


def test_figures_are_consistent(all_codecs: list[dict[str, object]]) -> None:
    raw = {obj["raw_bytes"] for obj in all_codecs}
    assert len(raw) == 1, "every codec must see the same input"
    for obj in all_codecs:
        assert obj["ratio"] == pytest.approx(obj["raw_bytes"] / obj["stored_bytes"])
        assert obj["restore_s"] == pytest.approx(
            obj["lookup_s"] + obj["promote_s"] + obj["decode_s"]
        )
        for speed in ("memcpy_gbps", "encode_gbps", "decode_gbps", "promote_gbps"):
            assert obj[speed] > 0
        # 600 tokens at 128 per block: 4 full blocks.
        assert obj["blocks"] == obj["hit_blocks"] == 4


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
    assert json.loads(result.stdout)["ratio"] > 1.9


def test_embedded_vault_leaves_no_port_behind(all_codecs: list[dict[str, object]]) -> None:
    host, port = parse_address(str(all_codecs[0]["vault"]))
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect((host, port))


def test_single_codec_prints_one_object_and_the_table() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "--tokens", "256", "--codec", "int8", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["codec"] == "int8"
    table = runner.invoke(app, ["bench", "--tokens", "256", "--codec", "none"])
    assert table.exit_code == 0, table.output
    assert "promote" in table.stdout and "memcpy" in table.stdout


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
