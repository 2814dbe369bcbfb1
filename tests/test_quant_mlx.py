"""mlx_ops (mlx[cpu] here; Metal untested) decodes the Numba kernels' payloads: INT8 and lossless
bit for bit, TurboQuant within float32 rounding, both payload format versions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.test_quant_frozen import PAYLOADS
from tierkv.quant import CODEC_NAMES, PayloadError, decode_into, get_codec, read_header
from tierkv.quant.payload import header_bytes

mx = pytest.importorskip("mlx.core")
mlx_ops = pytest.importorskip("tierkv.quant.mlx_ops")

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


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    name=st.sampled_from(CODEC_NAMES),
    dtype=st.sampled_from(["fp16", "bf16", "fp32"]),
    group_size=st.sampled_from([16, 40, 96, 128]),
    lead=hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5),
)
def test_mlx_decode_matches_numba_on_odd_shapes(  # type: ignore[no-untyped-def]
    data, name: str, dtype: str, group_size: int, lead
) -> None:
    shape = (*lead, group_size)
    seed = data.draw(st.integers(0, 2**32 - 1))
    x = block(dtype, shape, seed)
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
