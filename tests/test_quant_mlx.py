"""mlx_ops (mlx[cpu] here; Metal untested) decodes the Numba kernels' payloads (INT8 and lossless
bit for bit, TurboQuant within float32 rounding, both payload format versions) and encodes the
payloads they make (INT8 and lossless byte for byte; TurboQuant the same header, exponent and
channel masks, norms within one fp16 unit, and indices that differ only rarely and then by one
level, where a rotated coordinate sits on a decision boundary)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.test_quant_frozen import PAYLOADS
from tierkv.codecs import SINK_MODES
from tierkv.quant import (
    CODEC_NAMES,
    NonFiniteError,
    PayloadError,
    decode_into,
    encode_block,
    get_codec,
    read_header,
)
from tierkv.quant.payload import header_bytes
from tierkv.quant.turbo import index_positions, named_codec

mx = pytest.importorskip("mlx.core")
mlx_ops = pytest.importorskip("tierkv.quant.mlx_ops")

ENCODED = tuple(name for name in CODEC_NAMES if name not in SINK_MODES)
"""The codecs this module encodes with too (it only decodes the sink codecs)."""
TOLERANCE = {"fp16": 2e-3, "bf16": 1.6e-2, "fp32": 1e-5}
"""Relative difference a TurboQuant value may show: about one unit in the last place."""


def as_numpy(array: object, dtype: str) -> np.ndarray:
    """An MLX result as the array the Numba decoder fills (bf16 as uint16 words)."""
    if dtype == "bf16":
        return np.array(array.view(mx.uint16))  # type: ignore[attr-defined]
    return np.array(array)


def values(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def assert_decodes_like_numba(payload: bytes, like: np.ndarray) -> None:
    header = read_header(payload)
    expected = np.empty_like(like)
    decode_into(payload, expected)
    got = as_numpy(mlx_ops.decode(payload), header.dtype)
    assert got.shape == header.shape
    if header.codec in ("none", "int8"):
        assert got.tobytes() == expected.tobytes()
        return
    a, b = values(expected, header.dtype), values(got, header.dtype)
    bound = TOLERANCE[header.dtype] * np.abs(a) + 1e-5 * np.abs(a).max()
    assert np.all(np.abs(a - b) <= bound)


def block(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x[..., 3] *= 15.0
    if dtype == "fp16":
        return x.astype(np.float16)
    if dtype == "bf16":
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return x


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize(("shape", "group_size"), [((16, 8, 128), 128), ((3, 2, 5, 96), 96)])
def test_mlx_decode_matches_numba(
    name: str, dtype: str, shape: tuple[int, ...], group_size: int
) -> None:
    x = block(dtype, shape)
    assert_decodes_like_numba(get_codec(name, group_size).encode(x, dtype), x)


def test_mlx_decodes_int8_of_any_length() -> None:
    x = block("fp16", (13, 11))
    assert_decodes_like_numba(get_codec("int8", 7).encode(x, "fp16"), x)


def test_mlx_decodes_the_frozen_version_1_payloads() -> None:
    with np.load(PAYLOADS) as data:
        for name in data.files:
            if name.startswith("payload/"):
                shape, _, dtype = name.split("/")[1:]
                assert_decodes_like_numba(data[name].tobytes(), data[f"input/{shape}/{dtype}"])


def test_mlx_rejects_a_corrupted_channel_mask() -> None:
    payload = bytearray(get_codec("tq3.5").encode(block("fp16", (4, 2, 128)), "fp16"))
    mask_at = header_bytes(3) + 2  # after the header and the block exponent
    payload[mask_at : mask_at + 16] = b"\xff" * 16  # every channel "hi"
    with pytest.raises(PayloadError, match="channel mask"):
        mlx_ops.decode(bytes(payload))


# ---- encode ---------------------------------------------------------------------------------

MX_TYPES = {"fp16": mx.float16, "bf16": mx.bfloat16, "fp32": mx.float32}


def as_mlx(x: np.ndarray, dtype: str) -> object:
    """The block as EXO holds it: an MLX array of its float type."""
    return mx.array(x).view(MX_TYPES[dtype]) if dtype == "bf16" else mx.array(x)


def turbo_parts(payload: bytes) -> tuple[bytes, np.ndarray, list[np.ndarray]]:
    """(exponent and channel masks, fp16 norms, per instance its codes [vectors, m]) of a
    TurboQuant payload."""
    header = read_header(payload)
    codec = named_codec(header.codec, header.group_size)
    layout = codec.layout(header.shape)
    body = np.frombuffer(payload, np.uint8)[header_bytes(len(header.shape)) :]
    norms = body[layout.norms_offset : layout.indices_offset].copy().view("<f2")
    packed = body[layout.indices_offset :].reshape(layout.n_vectors, layout.bytes_per_vector)
    packed = np.concatenate([packed, np.zeros((layout.n_vectors, 1), np.uint8)], axis=1)
    packed = packed.astype(np.uint32)
    codes = []
    for _, inst, byte_at in codec.instances():
        offset, shift = index_positions(inst.m, inst.bits)
        at = offset + byte_at
        both = packed[:, at] | (packed[:, at + 1] << 8)
        codes.append(((both >> shift.astype(np.uint32)) & ((1 << inst.bits) - 1)).astype(int))
    return bytes(body[: layout.norms_offset]), norms, codes


def assert_encodes_like_numba(x: np.ndarray, name: str, dtype: str, group_size: int) -> int:
    """MLX's payload of `x` is Numba's (within rounding for TurboQuant); returns how many of
    its TurboQuant codes differ."""
    codec = get_codec(name, group_size)
    expected = codec.encode(x, dtype)
    payload = mlx_ops.encode(codec, as_mlx(x, dtype))
    assert read_header(payload) == read_header(expected)
    if name in ("none", "int8"):
        assert payload == expected
        return 0
    assert len(payload) == len(expected)
    head, norms, codes = turbo_parts(payload)
    want_head, want_norms, want_codes = turbo_parts(expected)
    assert head == want_head  # block exponent and channel masks
    ulps = np.abs(norms.view(np.int16).astype(int) - want_norms.view(np.int16).astype(int))
    assert ulps.max(initial=0) <= 1
    differing = 0
    for ours, theirs in zip(codes, want_codes, strict=True):
        assert np.abs(ours - theirs).max(initial=0) <= 1  # a neighbouring level at most
        differing += int(np.count_nonzero(ours != theirs))
    total = sum(c.size for c in codes)
    assert differing <= 2 + total // 10_000
    return differing


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", ENCODED)
@pytest.mark.parametrize(
    ("shape", "group_size"), [((256, 8, 128), 128), ((8, 256, 128), 128), ((3, 2, 5, 96), 96)]
)
def test_mlx_encode_makes_the_numba_payload(
    name: str, dtype: str, shape: tuple[int, ...], group_size: int
) -> None:
    assert_encodes_like_numba(block(dtype, shape), name, dtype, group_size)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    name=st.sampled_from(ENCODED),
    dtype=st.sampled_from(["fp16", "bf16", "fp32"]),
    group_size=st.sampled_from([16, 40, 96, 128]),
    lead=hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5),
)
def test_mlx_matches_numba_on_odd_shapes(  # type: ignore[no-untyped-def]
    data, name: str, dtype: str, group_size: int, lead
) -> None:
    """Both ways: MLX decodes Numba's payload, and encodes it (then decodes its own)."""
    shape = (*lead, group_size)
    x = block(dtype, shape, data.draw(st.integers(0, 2**32 - 1)))
    assert_decodes_like_numba(get_codec(name, group_size).encode(x, dtype), x)
    assert_encodes_like_numba(x, name, dtype, group_size)
    payload = mlx_ops.encode(get_codec(name, group_size), as_mlx(x, dtype))
    assert_decodes_like_numba(payload, x)


def test_mlx_encodes_int8_of_any_length_and_zeros() -> None:
    assert_encodes_like_numba(block("fp16", (13, 11)), "int8", "fp16", 7)
    assert_encodes_like_numba(np.zeros((4, 128), np.float16), "int8", "fp16", 128)
    assert_encodes_like_numba(np.zeros((4, 2, 128), np.float16), "tq3.5", "fp16", 128)


def test_mlx_encodes_raw_words_with_their_dtype() -> None:
    x = block("bf16", (4, 2, 128))
    codec = get_codec("int8")
    assert mlx_ops.encode(codec, mx.array(x), "bf16") == codec.encode(x, "bf16")
    with pytest.raises(ValueError, match="cannot infer"):
        mlx_ops.encode(codec, mx.array(x))
    with pytest.raises(ValueError, match="cannot hold 'fp32'"):
        mlx_ops.encode(codec, mx.array(x), "fp32")
    with pytest.raises(TypeError, match="mlx array"):
        mlx_ops.encode(codec, x, "bf16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mlx array"):
        mlx_ops.encode(get_codec("k8v4"), x.tolist(), kv_split=(0, 4))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["none", "int8", "tq3"])
def test_mlx_encode_refuses_nan_and_inf(name: str) -> None:
    x = block("fp16", (4, 2, 128))
    x[1, 1, 7] = np.inf
    with pytest.raises(NonFiniteError, match="NaN/Inf"):
        mlx_ops.encode(get_codec(name), mx.array(x))


def test_mlx_encode_refuses_a_partial_vector() -> None:
    with pytest.raises(ValueError, match="whole vectors"):
        mlx_ops.encode(get_codec("tq4", 128), mx.array(block("fp16", (3, 96))))


def test_mlx_encodes_keys_or_values_of_a_pair_codec() -> None:
    keys = block("bf16", (8, 16, 128))
    pair = get_codec("k8v4")
    k = mlx_ops.encode(pair, as_mlx(keys, "bf16"), kv_split=(0, 8))
    assert k == get_codec("int8").encode(keys, "bf16")
    v = mlx_ops.encode(pair, as_mlx(keys, "bf16"), kv_split=(0, 0))
    assert read_header(v).codec == "tq4"
    with pytest.raises(ValueError, match="keys only or values only"):
        mlx_ops.encode(pair, as_mlx(keys, "bf16"), kv_split=(2, 64))
    with pytest.raises(ValueError, match="keys only or values only"):
        mlx_ops.encode(pair, as_mlx(keys, "bf16"))


@pytest.mark.parametrize("name", ["int8", "tq4", "tq3.5"])
@pytest.mark.parametrize("magnitude", [1e36, 1e25, 1e-25, 1e-39])
def test_mlx_encodes_huge_and_tiny_fp32_values_like_numba(name: str, magnitude: float) -> None:
    """Down to subnormals. The float32 channel energies are summed after the block's 2**-k
    scaling: squares of 1e25 would overflow float32 (every channel "inf"), of 1e-25 underflow."""
    x = block("fp32", (4, 32, 128), seed=9) * np.float32(magnitude)
    assert_encodes_like_numba(x, name, "fp32", 128)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", SINK_MODES)
@pytest.mark.parametrize(
    ("shape", "sinks"), [((4, 64, 128), (1, 4)), ((40, 3, 96), (0, 4)), ((2, 6, 1, 80), (1, 1))]
)
def test_mlx_decodes_sink_codecs_like_numba(
    name: str, dtype: str, shape: tuple[int, ...], sinks: tuple[int, int]
) -> None:
    """EXO's [heads, tokens, d] blocks and others, sink tokens kept and keys centred."""
    x = block(dtype, shape, seed=5)
    payload = encode_block(get_codec(name, shape[-1]), x, dtype, sink_tokens=sinks)
    assert_decodes_like_numba(payload, x)
    got = as_numpy(mlx_ops.decode(payload), dtype)
    first = (slice(None),) * sinks[0] + (slice(0, sinks[1]),)
    assert got[first].tobytes() == np.ascontiguousarray(x[first]).tobytes()
