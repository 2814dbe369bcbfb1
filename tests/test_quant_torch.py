"""torch_ops (CPU torch here) produces and reads the same payloads as the Numba kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.codecs import SINK_MODES
from tierkv.quant import (
    CODEC_NAMES,
    PayloadError,
    decode_into,
    encode_block,
    fidelity,
    get_codec,
    read_header,
    torch_ops,
)

ENCODED = tuple(name for name in CODEC_NAMES if name not in SINK_MODES)
"""The codecs this module encodes with too (it only decodes the sink codecs)."""
TORCH_TYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def block(dtype: str, shape: tuple[int, ...] = (16, 8, 128), seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., [5, shape[-1] - 3]] *= 12.0
    return torch.from_numpy(x).to(TORCH_TYPES[dtype])


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """The array a caller hands to the Numba codecs (bf16 as uint16 words)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def numba_decode(payload: bytes, like: torch.Tensor) -> torch.Tensor:
    out = np.empty_like(as_numpy(like))
    decode_into(payload, out)
    t = torch.from_numpy(out.view(np.int16) if like.dtype == torch.bfloat16 else out)
    return t.view(like.dtype)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", TORCH_TYPES)
def test_torch_decode_equals_numba_decode(name: str, dtype: str) -> None:
    x = block(dtype)
    payload = get_codec(name).encode(as_numpy(x), dtype)
    expected = numba_decode(payload, x)
    out = torch.empty_like(x)
    torch_ops.decode_into(payload, out)
    if name in ("none", "int8"):
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    else:
        scale = float(x.float().abs().max())
        assert torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-4 * scale)


@pytest.mark.parametrize("name", ENCODED)
@pytest.mark.parametrize("dtype", TORCH_TYPES)
def test_torch_encode_makes_the_numba_payload(name: str, dtype: str) -> None:
    x = block(dtype, seed=1)
    codec = get_codec(name)
    expected = codec.encode(as_numpy(x), dtype)
    payload = torch_ops.encode(codec, x)
    assert read_header(payload) == read_header(expected)
    if name in ("none", "int8"):
        assert payload == expected
    else:
        ours = fidelity(as_numpy(x), as_numpy(numba_decode(payload, x)), dtype)
        theirs = fidelity(as_numpy(x), as_numpy(numba_decode(expected, x)), dtype)
        assert ours.cosine == pytest.approx(theirs.cosine, abs=1e-4)


@pytest.mark.parametrize("name", ["int8", "tq3", "tq3.5"])
def test_torch_round_trip_of_odd_group_sizes(name: str) -> None:
    x = block("fp16", shape=(3, 4, 96), seed=2)
    codec = get_codec(name, 96)
    out = torch.empty_like(x)
    torch_ops.decode_into(torch_ops.encode(codec, x), out)
    assert torch.allclose(out.float(), numba_decode(codec.encode(x.numpy()), x).float(), atol=0.05)


def test_torch_decode_into_raw_words_and_mismatches() -> None:
    x = block("bf16")
    payload = get_codec("int8").encode(as_numpy(x), "bf16")
    words = torch.empty(x.shape, dtype=torch.int16)
    torch_ops.decode_into(payload, words)
    assert torch.equal(words.view(torch.bfloat16), numba_decode(payload, x))
    with pytest.raises(PayloadError, match="float16"):
        torch_ops.decode_into(payload, torch.empty(x.shape, dtype=torch.float16))
    with pytest.raises(PayloadError, match="elements"):
        torch_ops.decode_into(payload, torch.empty(7, dtype=torch.bfloat16))
    with pytest.raises(PayloadError, match="contiguous"):
        torch_ops.decode_into(
            payload, torch.empty((128, 8, 16), dtype=torch.bfloat16).permute(2, 1, 0)
        )


@pytest.mark.parametrize("shape", [(4, 24, 128), (5, 3, 40), (2, 16, 8, 64)])
@pytest.mark.parametrize("name", ["tq2.5", "tq3"])
def test_torch_matches_numba_for_other_layouts_and_head_dims(name: str, shape) -> None:  # type: ignore[no-untyped-def]
    x = block("fp16", shape=shape, seed=3)
    codec = get_codec(name, shape[-1])
    payload = codec.encode(x.numpy())
    out = torch.empty_like(x)
    torch_ops.decode_into(payload, out)
    expected = numba_decode(payload, x)
    assert torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-3)
    ours = fidelity(x.numpy(), numba_decode(torch_ops.encode(codec, x), x).numpy())
    assert ours.cosine == pytest.approx(fidelity(x.numpy(), expected.numpy()).cosine, abs=1e-3)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 70),
    heads=st.integers(1, 9),
    name=st.sampled_from(["tq3.5", "tq2.5"]),
    group_size=st.sampled_from([16, 64, 72]),
    dtype=st.sampled_from(list(TORCH_TYPES)),
)
def test_mixed_decode_of_any_head_layout_matches_torch(
    tokens: int, heads: int, name: str, group_size: int, dtype: str
) -> None:
    """The Numba decoder of the mixed modes works on tiles of one head (selection group) and
    scatters them back; any [a, b, d] layout, with groups of any size, lands where torch's
    straightforward decoder puts it."""
    x = block(dtype, shape=(tokens, heads, group_size), seed=tokens * 16 + heads)
    payload = get_codec(name, group_size).encode(as_numpy(x), dtype)
    out = torch.empty_like(x)
    torch_ops.decode_into(payload, out)
    assert torch.allclose(out.float(), numba_decode(payload, x).float(), rtol=1e-2, atol=1e-3)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(tuple(TORCH_TYPES)),
    group_size=st.sampled_from([1, 3, 8, 128]),
    exponents=st.lists(st.integers(-60, 60), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_int8_payload_of_groups_far_apart_in_magnitude_matches_torch(
    dtype: str, group_size: int, exponents: list[int], seed: int
) -> None:
    """Blocks whose groups lie far apart in magnitude (scales out of fp16's normal range for the
    block exponent, at either end) get the same int8 payload from the Numba kernels, which
    convert each word as they quantize it, as from torch_ops' encoder."""
    low, high = (-24, 12) if dtype == "fp16" else (-100, 100)
    rng = np.random.default_rng(seed)
    scales = np.exp2(np.clip(np.repeat(exponents, group_size), low, high)).astype(np.float32)
    x = (rng.standard_normal(scales.size).astype(np.float32) * scales).reshape(-1, group_size)
    t = torch.from_numpy(x).to(TORCH_TYPES[dtype])
    codec = get_codec("int8", group_size)
    assert codec.encode(as_numpy(t), dtype) == torch_ops.encode(codec, t)


@pytest.mark.parametrize(
    ("shape", "sinks"), [((16, 8, 128), (0, 4)), ((2, 40, 96), (1, 4)), ((3, 1, 6, 2, 80), (2, 1))]
)
@pytest.mark.parametrize("name", SINK_MODES)
@pytest.mark.parametrize("dtype", TORCH_TYPES)
def test_torch_decodes_sink_codecs_like_numba(
    name: str, dtype: str, shape: tuple[int, ...], sinks: tuple[int, int]
) -> None:
    x = block(dtype, shape, seed=4)
    x = x + torch.linspace(-20, 20, shape[-1]).to(x.dtype)  # a per-channel offset to centre
    payload = encode_block(get_codec(name, shape[-1]), as_numpy(x), dtype, sink_tokens=sinks)
    expected = numba_decode(payload, x)
    out = torch.empty_like(x)
    torch_ops.decode_into(payload, out)
    scale = float(x.float().abs().max())
    assert torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-4 * scale)
    first = (slice(None),) * sinks[0] + (slice(0, sinks[1]),)
    assert torch.equal(out[first].view(torch.uint8), x[first].contiguous().view(torch.uint8))
