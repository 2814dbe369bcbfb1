"""Chained block keys and namespace fingerprints."""

from pathlib import Path

import pytest

from tierkv.keys import (
    KEY_BYTES,
    ROOT_KEY,
    WEIGHT_SAMPLE_BYTES,
    chain_block_keys,
    namespace_fingerprint,
    weights_fingerprint,
)


def test_one_key_per_full_block_and_none_for_the_tail() -> None:
    keys = chain_block_keys(list(range(100)), block_tokens=32)
    assert len(keys) == 3
    assert all(len(key) == KEY_BYTES for key in keys)
    assert len(set(keys)) == 3


def test_keys_chain_over_the_whole_prefix() -> None:
    a = chain_block_keys([1] * 32 + [2] * 32, block_tokens=32)
    b = chain_block_keys([9] * 32 + [2] * 32, block_tokens=32)
    assert a[1] != b[1], "equal second blocks after different first blocks must differ"


def test_chain_continues_from_a_parent() -> None:
    tokens = list(range(96))
    whole = chain_block_keys(tokens, block_tokens=32)
    tail = chain_block_keys(tokens[32:], block_tokens=32, parent=whole[0])
    assert tail == whole[1:]


def test_keys_are_stable_across_processes() -> None:
    # A fixed vector: a changed hash would orphan every block stored by an older tierkv.
    key = chain_block_keys([0, 0, 0, 0], block_tokens=4, parent=ROOT_KEY)[0]
    assert key.hex() == "505cd4e066810498e255222d4cbbadba"


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        chain_block_keys([1, 2], block_tokens=0)
    with pytest.raises(ValueError, match="parent key"):
        chain_block_keys([1, 2], block_tokens=1, parent=b"short")


def test_namespace_changes_with_any_field_and_ignores_order() -> None:
    base = {"model": "m", "dtype": "fp16", "block_size": 32}
    assert namespace_fingerprint(base) == namespace_fingerprint(dict(reversed(base.items())))
    assert namespace_fingerprint(base) != namespace_fingerprint({**base, "dtype": "bf16"})
    assert len(namespace_fingerprint(base)) == KEY_BYTES


def test_weights_fingerprint_follows_the_weights_not_the_path(tmp_path: Path) -> None:
    big = bytes(range(256)) * (3 * WEIGHT_SAMPLE_BYTES // 256)
    for copy in ("a", "b"):
        (tmp_path / copy).mkdir()
        (tmp_path / copy / "model-00001.safetensors").write_bytes(big)
        (tmp_path / copy / "config.json").write_text("{}")
    assert weights_fingerprint(tmp_path / "a") == weights_fingerprint(tmp_path / "b")
    retrained = bytearray(big)
    retrained[-10] ^= 1  # same size, a changed value in the last MiB
    (tmp_path / "b" / "model-00001.safetensors").write_bytes(bytes(retrained))
    assert weights_fingerprint(tmp_path / "a") != weights_fingerprint(tmp_path / "b")
    (tmp_path / "empty").mkdir()
    assert weights_fingerprint(tmp_path / "empty") is None
