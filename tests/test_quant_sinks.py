"""The sink codecs (tierkv.quant.sinks): a sequence's first tokens lossless, keys centred."""

from __future__ import annotations

import numpy as np
import pytest

from tierkv.codecs import PRESETS, SINK_MODES, kv_pair_codecs
from tierkv.config import ConfigError, load_config
from tierkv.quant import (
    NonFiniteError,
    PayloadError,
    decode_into,
    encode_block,
    fidelity,
    get_codec,
)
from tierkv.quant.payload import header_bytes
from tierkv.quant.sinks import FLAT, token_axis

SHAPES = [
    # shape, (token axis, sink tokens): vLLM's [tokens, heads, d], EXO's [heads, tokens, d],
    # a stacked [layers, K/V, tokens, heads, d] and odd head sizes
    ((128, 3, 64), (0, 4)),
    ((4, 128, 128), (1, 4)),
    ((2, 1, 32, 2, 96), (2, 4)),
    ((5, 16, 80), (1, 2)),
    ((7, 40), (0, 1)),
]


def keys_like(shape: tuple[int, ...], axis: int, dtype: str, seed: int = 0) -> np.ndarray:
    """Key-like values: noise on a large per-channel offset, the first tokens outsized (sinks)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    offset_shape = tuple(1 if i == axis else n for i, n in enumerate(shape))
    x += 6.0 * rng.standard_normal(offset_shape).astype(np.float32)
    index = (slice(None),) * axis + (slice(0, 1),)
    x[index] *= 30.0
    if dtype == "fp16":
        return x.astype(np.float16)
    if dtype == "bf16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x


def decoded(payload: bytes, like: np.ndarray) -> np.ndarray:
    out = np.empty_like(like)
    decode_into(payload, out)
    return out


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", SINK_MODES)
@pytest.mark.parametrize(("shape", "sinks"), SHAPES)
def test_round_trip_keeps_sink_tokens_exact(
    name: str, dtype: str, shape: tuple[int, ...], sinks: tuple[int, int]
) -> None:
    d = shape[-1]
    x = keys_like(shape, sinks[0], dtype)
    codec = get_codec(name, d)
    payload = encode_block(codec, x, dtype, sink_tokens=sinks)
    out = decoded(payload, x)
    first = (slice(None),) * sinks[0] + (slice(0, sinks[1]),)
    assert out[first].tobytes() == x[first].tobytes()
    rest = (slice(None),) * sinks[0] + (slice(sinks[1], None),)
    minimum = {"3": 0.97, "4": 0.99, "5": 0.997}[name[2]]
    assert fidelity(
        np.ascontiguousarray(x[rest]), np.ascontiguousarray(out[rest]), dtype
    ).cosine > (minimum)
    assert decoded(codec.encode(x, dtype), x).shape == x.shape  # no sinks: a later block


def test_centring_cuts_the_error_of_keys_with_channel_offsets() -> None:
    x = keys_like((128, 3, 64), 0, "fp32")[4:]  # no sink tokens in the block
    err = {}
    for name in ("tq4", "tq4s", "tq4c"):
        out = decoded(get_codec(name, 64).encode(x, "fp32"), x)
        err[name] = float(((out - x) ** 2).mean())
    assert err["tq4c"] < err["tq4"] / 3
    assert err["tq4s"] == err["tq4"]  # without sinks and centring: TurboQuant as it was


def test_sink_tokens_stay_out_of_the_means() -> None:
    """An outsized first token kept as a sink shifts nothing: the rest decodes as it does
    without that token."""
    x = keys_like((128, 3, 64), 0, "fp32")
    codec = get_codec("tq4c", 64)
    with_sinks = decoded(encode_block(codec, x, "fp32", sink_tokens=(0, 4)), x)
    other = x.copy()
    other[:4] = 0.5
    same = decoded(encode_block(codec, other, "fp32", sink_tokens=(0, 4)), other)
    assert np.array_equal(with_sinks[4:], same[4:])


def test_presets_are_pairs_of_sink_codecs() -> None:
    x = np.concatenate([keys_like((128, 3, 64), 0, "fp16"), keys_like((128, 3, 64), 0, "fp16")], -1)
    for preset, pair in PRESETS.items():
        assert kv_pair_codecs(preset) == kv_pair_codecs(pair)
        codec = get_codec(preset, 64)
        assert codec.name == pair
        payload = encode_block(codec, x, "fp16", kv_split=(-1, 64), sink_tokens=(0, 4))
        out = decoded(payload, x)
        assert out[:4].tobytes() == x[:4].tobytes()
        later = encode_block(codec, x, "fp16", kv_split=(-1, 64))
        ratio = x.size * 2 / len(later)  # vs bf16, every byte of a later block counted
        assert ratio > {"kv4": 3.5, "kv3": 4.5}[preset]


def test_config_takes_a_preset(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "tierkv.toml"
    path.write_text('[compression]\nenabled = true\ncodec = "kv4"\n')
    assert get_codec(load_config(path).compression.codec_name).name == "k4cv4s"
    path.write_text('[compression]\nenabled = true\ncodec = "k4cv9s"\n')
    with pytest.raises(ConfigError, match="k4cv9s"):
        load_config(path)


def test_a_block_whose_token_axis_splits_vectors_is_flat_without_sinks() -> None:
    """As a K/V pair's half of (2, 128) at group_size 128 (the warm-up's block): 64 values per
    token, so each vector of 128 is taken as a token."""
    x = keys_like((4, 64), 0, "fp16")
    payload = get_codec("tq4c", 128).encode(x, "fp16")
    assert payload[header_bytes(2)] == FLAT
    assert fidelity(x, decoded(payload, x), "fp16").cosine > 0.99


def test_default_token_axis() -> None:
    assert token_axis((128, 8, 64)) == 0
    assert token_axis((8, 128, 64)) == 1
    assert token_axis((2, 2, 16, 4, 64)) == 2
    assert token_axis((7, 40)) == 0


def test_malformed_sink_payloads_are_refused() -> None:
    x = keys_like((16, 2, 64), 0, "fp16")
    codec = get_codec("tq4c", 64)
    payload = bytearray(encode_block(codec, x, "fp16", sink_tokens=(0, 4)))
    at = header_bytes(3)
    for prefix, message in [
        (b"\x05\x01\x04\x00", "token axis"),  # axis past the shape
        (b"\x00\x01\x14\x00", "sink tokens"),  # 20 sinks of 16 tokens
        (b"\x00\x00\x04\x00", "centred"),
        (b"\x00\x01\x03\x00", "needs"),  # a length that does not fit
    ]:
        bad = bytes(payload[:at]) + prefix + bytes(payload[at + 4 :])
        with pytest.raises(PayloadError, match=message):
            decode_into(bad, np.empty_like(x))
    with pytest.raises(PayloadError):
        decode_into(bytes(payload[: at + 2]), np.empty_like(x))
    with pytest.raises(ValueError, match="sink tokens do not fit"):
        encode_block(codec, x, "fp16", sink_tokens=(0, 17))
    with pytest.raises(ValueError, match="whole vectors"):
        encode_block(codec, x, "fp16", sink_tokens=(2, 1))
    x[5, 1, 3] = np.inf
    with pytest.raises(NonFiniteError):
        encode_block(codec, x, "fp16", sink_tokens=(0, 4))
