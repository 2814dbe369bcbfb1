"""K/V pair codecs: names, round trips on every split the engines use, and old readers refusing
the pair payload format (real kernels, a real vault for the tier round trip)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import VaultHandle

from tierkv.backends.vault import VaultClient
from tierkv.codecs import kv_pair_codecs, kv_pair_name
from tierkv.config import ConfigError, config_from_mapping
from tierkv.keys import chain_block_keys, namespace_fingerprint
from tierkv.quant import PayloadError, decode_into, encode_block, get_codec, read_header
from tierkv.quant.pair import PAIR_FORMAT_VERSION, PairCodec, is_pair
from tierkv.quant.payload import READ_VERSIONS, parse_header
from tierkv.tier import ColdTier


def kv_block(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


def test_short_names_and_tables_name_the_same_pair() -> None:
    assert kv_pair_name("int8", "tq4") == "k8v4"
    assert kv_pair_codecs("k8v3.5") == ("int8", "tq3.5")
    assert kv_pair_codecs("k16v4") == ("none", "tq4")
    assert kv_pair_codecs("tq4") is None
    assert kv_pair_name("tq4", "tq4") == "tq4"
    table = config_from_mapping({"compression": {"codec": {"k": "int8", "v": "tq4"}}}, "t")
    short = config_from_mapping({"compression.codec": "k8v4"}, "t")
    assert table.compression.codec == short.compression.codec == "k8v4"
    assert get_codec("k8v4", 64).name == "k8v4"
    assert get_codec("k4v4", 64).name == "tq4"  # the same codec twice is just that codec


@pytest.mark.parametrize(
    "bad", ["k7v4", {"k": "int8"}, {"k": "int8", "v": "tq9"}, "k8v4x", "auto-ish"]
)
def test_bad_pairs_are_config_errors_naming_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"compression\.codec"):
        config_from_mapping({"compression": {"codec": bad}}, "t")


@pytest.mark.parametrize(
    ("shape", "split"),
    [
        ((2, 2, 32, 128), (-1, 64)),  # vLLM: [layers, heads, tokens, head_size | head_size_v]
        ((2, 2, 2, 32, 64), (1, 1)),  # K/V-first layouts: [layers, K|V, heads, tokens, dim]
        ((2, 2, 32, 96), (3, 64)),  # keys and values of different widths
    ],
)
def test_pair_round_trip_equals_each_half_through_its_own_codec(
    shape: tuple[int, ...], split: tuple[int, int]
) -> None:
    x = kv_block(shape)
    codec = get_codec("k8v4", 32)
    payload = encode_block(codec, x, kv_split=split)
    assert is_pair(payload)
    out = np.empty_like(x)
    decode_into(payload, out)
    axis, count = split
    keys = np.ascontiguousarray(np.split(x, [count], axis=axis)[0])
    values = np.ascontiguousarray(np.split(x, [count], axis=axis)[1])
    expected_keys, expected_values = np.empty_like(keys), np.empty_like(values)
    decode_into(get_codec("int8", 32).encode(keys), expected_keys)
    decode_into(get_codec("tq4", 32).encode(values), expected_values)
    got_keys, got_values = np.split(out, [count], axis=axis)
    np.testing.assert_array_equal(got_keys, expected_keys)
    np.testing.assert_array_equal(got_values, expected_values)
    assert not np.array_equal(got_keys, keys)  # really quantized, not passed through


def test_keys_only_and_values_only_blocks_are_plain_payloads() -> None:
    """How EXO stores them: one part per layer for keys, one for values."""
    x = kv_block((2, 32, 64))
    codec = get_codec("k8v4", 64)
    assert read_header(encode_block(codec, x, kv_split=(0, 2))).codec == "int8"
    assert read_header(encode_block(codec, x, kv_split=(0, 0))).codec == "tq4"


def test_a_pair_never_guesses_where_keys_end() -> None:
    with pytest.raises(ValueError, match="did not say where keys and values split"):
        get_codec("k8v4", 64).encode(kv_block((2, 64)))
    with pytest.raises(ValueError, match="does not fit"):
        get_codec("k8v4", 64).encode(kv_block((2, 64)), kv_split=(2, 1))


def test_a_reader_of_formats_1_and_2_refuses_a_pair_payload() -> None:
    """parse_header is the single-codec reader every tierkv before pairs ran (magic, then
    version): a pair payload stops there with a clear error and is never decoded as one codec."""
    payload = get_codec("k8v4", 64).encode(kv_block((2, 2, 32, 128)), kv_split=(-1, 64))
    assert payload[4] == PAIR_FORMAT_VERSION not in READ_VERSIONS
    with pytest.raises(PayloadError, match="unsupported payload format version 3"):
        parse_header(payload)


def test_a_damaged_pair_payload_is_refused() -> None:
    x = kv_block((2, 2, 32, 128))
    payload = get_codec("k8v4", 64).encode(x, kv_split=(-1, 64))
    out = np.empty_like(x)
    for broken in (payload[:-1], payload[:20]):
        with pytest.raises(PayloadError):
            decode_into(broken, out)
    flipped = bytearray(payload)
    flipped[12] ^= 1  # inside the checksummed header
    with pytest.raises(PayloadError, match="checksum"):
        decode_into(flipped, out)
    with pytest.raises(PayloadError, match="does not fit"):
        decode_into(payload, np.empty((2, 2, 32, 64), np.float16))
    assert isinstance(get_codec("k8v4", 64), PairCodec)


def test_pair_blocks_round_trip_through_a_vault(vault: VaultHandle) -> None:
    namespace = namespace_fingerprint({"test": "pair"})
    keys = chain_block_keys(list(range(64)), block_tokens=32)
    blocks = [kv_block((2, 2, 32, 128), seed) for seed in range(len(keys))]
    tier = ColdTier(get_codec("k8v4", 64), {"kv": VaultClient(vault.address)})
    try:
        for key, block in zip(keys, blocks, strict=True):
            tier.store(namespace, key, 0, block.copy(), kv_split=(-1, 64))
        assert tier.flush(timeout=30)
        outs = [np.empty_like(block) for block in blocks]
        assert tier.load(namespace, keys, {"kv": [0]}, lambda i, part: outs[i]) == set()
    finally:
        tier.close()
    for block, out in zip(blocks, outs, strict=True):
        expected = np.empty_like(block)
        decode_into(get_codec("k8v4", 64).encode(block, kv_split=(-1, 64)), expected)
        np.testing.assert_array_equal(out, expected)
    assert tier.stats()["queued_payload_bytes"] < sum(block.nbytes for block in blocks) * 0.45
