"""TurboQuant payloads: round trips of any shape and dtype, edge values, format checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.test_quant_codec import DTYPES, as_f64, round_trip, to_dtype
from tierkv.codecs import TURBO_MODES
from tierkv.quant import NonFiniteError, PayloadError, decode_into, get_codec, read_header
from tierkv.quant.codebooks import lloyd_max, rotation
from tierkv.quant.kernels import expands
from tierkv.quant.payload import header_bytes
from tierkv.quant.turbo import (
    Layout,
    _merge,
    _merge_plan,
    _quantize,
    _split,
    index_positions,
    named_codec,
    selection_groups,
)

TURBO = tuple(TURBO_MODES)


def channels_from_mask(mask: np.ndarray) -> np.ndarray:
    """The reference channel order: per row, the True channels (ascending), then the False."""
    return np.argsort(~mask, axis=1, kind="stable").astype(np.int32)


def relative_error(x: np.ndarray, y: np.ndarray, dtype: str) -> float:
    a, b = as_f64(x, dtype), as_f64(y, dtype)
    assert np.all(np.isfinite(b))
    energy = float(np.sum(a * a))
    return float(np.sum((a - b) ** 2)) / energy if energy else float(np.sum(b * b))


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    name=st.sampled_from(TURBO),
    dtype=st.sampled_from(DTYPES),
    group_size=st.sampled_from([16, 40, 64, 96, 128, 200]),
    lead=hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=6),
)
def test_round_trip_any_shape(data, name: str, dtype: str, group_size: int, lead) -> None:  # type: ignore[no-untyped-def]
    shape = (*lead, group_size)
    values = st.floats(-1e3, 1e3, width=32, allow_subnormal=True)
    x = to_dtype(data.draw(hnp.arrays(np.float32, shape, elements=values)), dtype)
    y = round_trip(name, x, dtype, group_size)
    assert y.shape == x.shape
    assert relative_error(x, y, dtype) < 0.6


def reference_decode(payload: bytes) -> np.ndarray:
    """A format-2 TurboQuant payload decoded in numpy float32, in the kernels' order of
    operations, per instance: the levels; when the rotation has q > 1 Hadamard blocks, the
    blocks mixed (0 + Q^T[a, 0] * block 0 + Q^T[a, 1] * block 1 ...); the Walsh-Hadamard
    butterflies of distance 1, 2, 4, ... within each block; times 1 / sqrt(block size), the norm
    and 2**k; R's signs; then each coordinate to its channel (mixed: the masked channels take the
    hi instance, ascending, the others the lo one) and the dtype (clamped, rounded to nearest
    even)."""
    header = read_header(payload)
    codec = named_codec(header.codec, header.group_size)
    layout, d = codec.layout(header.shape), header.group_size
    n, n_inst = layout.n_vectors, layout.n_instances
    body = np.frombuffer(payload, np.uint8)[header_bytes(len(header.shape)) :]
    pow2k = np.float32(2.0 ** int(body[:2].view("<i2")[0]))
    norms = body[layout.norms_offset : layout.indices_offset].view("<f2").astype(np.float32)
    norms = norms.reshape(n, n_inst)
    packed = body[layout.indices_offset :].reshape(n, layout.bytes_per_vector)
    packed = np.concatenate([packed, np.zeros((n, 1), np.uint8)], axis=1).astype(np.uint32)
    channels = np.tile(np.arange(d), (1, 1))
    if codec.lo is not None:
        masks = body[2 : layout.norms_offset].reshape(layout.sel_mod, layout.mask_bytes)
        channels = channels_from_mask(np.unpackbits(masks, axis=1, bitorder="little")[:, :d] > 0)
    group = (np.arange(n) // layout.sel_div) % layout.sel_mod
    x = np.empty((n, d), np.float32)
    for which, (first_channel, inst, first_byte) in enumerate(codec.instances()):
        m, rot = inst.m, inst.rotation
        q = max(1, rot.matrix.shape[0])
        assert q < m, "a dense rotation (format 1) decodes to CPU-dependent bits"
        p = m // q
        offset, shift = index_positions(m, inst.bits)
        at = first_byte + offset
        both = packed[:, at] | (packed[:, at + 1] << 8)
        y = inst.codebook.centroids.astype(np.float32)[(both >> shift) & ((1 << inst.bits) - 1)]
        if q > 1:
            blocks = y.reshape(n, q, p)
            mixed = np.empty_like(blocks)
            for a in range(q):
                mixed[:, a] = np.float32(0.0) + rot.matrix_t[a, 0] * blocks[:, 0]
                for b in range(1, q):
                    mixed[:, a] += rot.matrix_t[a, b] * blocks[:, b]
            y = mixed.reshape(n, m)
        distance = 1
        while distance < p:
            pairs = y.reshape(n, m // (2 * distance), 2, distance)
            a, b = pairs[:, :, 0], pairs[:, :, 1]
            y = np.stack([a + b, a - b], axis=2).reshape(n, m)
            distance *= 2
        y = y * np.float32(1.0 / np.sqrt(p)) * norms[:, which, None] * pow2k
        y = y * np.where(rot.signs < 0, -1, 1).astype(np.float32)
        rows = np.arange(n)[:, None]
        x[rows, channels[group, first_channel : first_channel + m]] = y
    if header.dtype == "fp16":
        return np.clip(x, -65504, 65504).astype(np.float16).view(np.uint16)
    if header.dtype == "bf16":
        return to_dtype(np.clip(x, -3.3895314e38, 3.3895314e38), "bf16")
    top = np.finfo(np.float32).max
    return np.clip(x, -top, top).view(np.uint32)


@pytest.mark.parametrize("group_size", [32, 48, 64, 96, 128, 192, 256, 512])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TURBO)
def test_decode_is_the_reference_bit_for_bit(name: str, dtype: str, group_size: int) -> None:
    """Every mode and size, those whose butterflies run in SIMD registers (hadamard.SIZES) and
    the others, over several tiles of vectors of three selection groups and a partial one."""
    rng = np.random.default_rng(group_size)
    x = rng.standard_normal((37, 3, group_size)).astype(np.float32)
    x[:, :, 5] *= 30.0
    assert_decodes_as_the_reference(name, to_dtype(x, dtype), dtype, group_size)


def assert_decodes_as_the_reference(name: str, x: np.ndarray, dtype: str, group_size: int) -> None:
    payload = get_codec(name, group_size).encode(x, dtype)
    out = np.empty_like(x)
    decode_into(payload, out)
    expected = reference_decode(payload)
    assert np.array_equal(out.reshape(-1).view(expected.dtype), expected.reshape(-1))


@pytest.mark.parametrize("group_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["tq3.5", "tq2.5"])
def test_heads_first_blocks_decode_as_the_reference(name: str, dtype: str, group_size: int) -> None:
    """MLX's [heads, tokens, d] layout: each head's channel order covers a run of vectors, and
    a tile of vectors (128 of 128 values) starts part of the way through a run."""
    rng = np.random.default_rng(group_size)
    x = rng.standard_normal((3, 150, group_size)).astype(np.float32)
    x[:, :, 5] *= 30.0
    assert_decodes_as_the_reference(name, to_dtype(x, dtype), dtype, group_size)


@pytest.mark.parametrize("name", TURBO)
@pytest.mark.parametrize("dtype", DTYPES)
def test_typical_block_round_trip(name: str, dtype: str) -> None:
    x = to_dtype(np.random.default_rng(1).standard_normal((2, 16, 8, 128)), dtype)
    bound = {"tq4": 0.012, "tq3.5": 0.03, "tq3": 0.04, "tq2.5": 0.1, "tq2": 0.13}[name]
    assert relative_error(x, round_trip(name, x, dtype), dtype) < bound


@pytest.mark.parametrize("name", TURBO)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_round_trip_to_zeros(name: str, dtype: str) -> None:
    x = to_dtype(np.zeros((4, 8, 128)), dtype)
    assert not as_f64(round_trip(name, x, dtype), dtype).any()


@pytest.mark.parametrize("name", TURBO)
@pytest.mark.parametrize(("dtype", "scale"), [("fp16", 1e-7), ("bf16", 1e-39), ("fp32", 1e-40)])
def test_denormal_values(name: str, dtype: str, scale: float) -> None:
    rng = np.random.default_rng(2)
    x = to_dtype(rng.standard_normal((4, 8, 128)) * scale, dtype)
    assert relative_error(x, round_trip(name, x, dtype), dtype) < 0.2


@pytest.mark.parametrize("name", TURBO)
@pytest.mark.parametrize(("dtype", "big"), [("fp16", 6e4), ("bf16", 3e38), ("fp32", 3e38)])
def test_huge_values_stay_finite(name: str, dtype: str, big: float) -> None:
    x = np.random.default_rng(3).uniform(-1, 1, (4, 8, 128)).astype(np.float32) * np.float32(big)
    x = to_dtype(x, dtype)
    assert relative_error(x, round_trip(name, x, dtype), dtype) < 0.2


@pytest.mark.parametrize("name", TURBO)
def test_length_not_a_multiple_of_the_group_is_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="group_size=128"):
        get_codec(name, 128).encode(np.ones(200, np.float16))


@pytest.mark.parametrize("name", ["tq4", "tq3.5", "tq3", "tq2.5", "tq2"])
@pytest.mark.parametrize("group_size", [0, 8, 12, 100, 1032, 2048])
def test_unusable_group_size_is_rejected(name: str, group_size: int) -> None:
    # README: group_size must be a multiple of 8 in 16..1024.
    with pytest.raises(
        ValueError,
        match=rf"needs group_size to be a multiple of 8 in \[16, 1024\], got {group_size}",
    ):
        get_codec(name, group_size)


@pytest.mark.parametrize("name", ["tq4", "tq3.5", "tq3", "tq2.5", "tq2"])
@pytest.mark.parametrize("group_size", [16, 1024])
def test_the_group_size_limits_themselves_work(name: str, group_size: int) -> None:
    x = np.random.default_rng(0).standard_normal((4, group_size)).astype(np.float16)
    assert relative_error(x, round_trip(name, x, "fp16", group_size), "fp16") < 0.6


@pytest.mark.parametrize("name", TURBO)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_is_rejected(name: str, bad: float) -> None:
    x = np.ones((4, 8, 128), np.float16)
    x[1, 2, 3] = bad
    with pytest.raises(NonFiniteError):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", TURBO)
def test_every_corrupted_header_byte_is_detected(name: str) -> None:
    payload = get_codec(name).encode(np.ones((2, 8, 128), np.float16))
    for i in range(header_bytes(3)):
        corrupted = bytearray(payload)
        corrupted[i] ^= 0x21
        with pytest.raises(PayloadError):
            decode_into(bytes(corrupted), np.empty((2, 8, 128), np.float16))
    with pytest.raises(PayloadError, match="truncated"):
        decode_into(payload[:-3], np.empty((2, 8, 128), np.float16))


def test_corrupted_channel_mask_is_detected() -> None:
    payload = bytearray(get_codec("tq2.5").encode(np.ones((2, 8, 128), np.float16)))
    payload[header_bytes(3) + 2] ^= 0x01  # first mask byte: one channel more or less
    with pytest.raises(PayloadError, match="channel mask"):
        decode_into(bytes(payload), np.empty((2, 8, 128), np.float16))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    name=st.sampled_from(["tq3.5", "tq2.5"]),
    d=st.sampled_from([16, 40, 128, 200]),
    groups=st.integers(1, 5),
    miscount=st.sampled_from([0, 0, -1, 1]),
)
def test_body_channels_parse_packed_masks(
    seed: int, name: str, d: int, groups: int, miscount: int
) -> None:
    """The decoders' channel orders from a body's packed masks are channels_from_mask of the
    unpacked masks (junk in the padding bits ignored); a mask selecting one channel more or
    less than hi.m is a PayloadError."""
    codec = named_codec(name, d)
    rng = np.random.default_rng(seed)
    mask = np.zeros((groups, d), bool)
    for g in range(groups):
        mask[g, rng.choice(d, codec.hi.m + (miscount if g == groups - 1 else 0), replace=False)] = 1
    packed = np.packbits(mask, axis=1, bitorder="little")
    if d % 8:
        packed[:, -1] |= np.uint8(0xFF << (d % 8) & 0xFF)  # padding bits set: ignored
    layout = Layout(d, codec.hi, codec.lo, (8, groups, d))  # groups heads
    body = np.concatenate([np.zeros(2, np.uint8), packed.reshape(-1)])
    if miscount:
        with pytest.raises(PayloadError, match="channel mask"):
            codec.body_channels(body, layout)
    else:
        assert np.array_equal(codec.body_channels(body, layout), channels_from_mask(mask))


def test_header_and_encoding_are_deterministic() -> None:
    x = np.random.default_rng(4).standard_normal((16, 8, 128)).astype(np.float16)
    codec = get_codec("tq3.5", 128)
    payload = codec.encode(x)
    assert payload == codec.encode(x.copy())
    header = read_header(payload)
    assert (header.codec, header.shape, header.group_size, header.bits) == (
        "tq3.5",
        (16, 8, 128),
        128,
        3.5,
    )


def test_selection_groups_follow_the_head_axis() -> None:
    assert selection_groups((16, 8, 128)) == (1, 8)  # vLLM block: tokens, heads, d
    assert selection_groups((2, 16, 8, 128)) == (1, 8)  # K and V
    assert selection_groups((8, 256, 128)) == (256, 8)  # MLX: heads, tokens, d
    assert selection_groups((4, 128)) == (1, 1)


def test_mixed_mode_keeps_each_heads_outlier_channels_at_high_precision() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((32, 4, 128)).astype(np.float32)
    for head, channel in enumerate([3, 40, 77, 120]):
        x[:, head, channel] *= 50.0
    y = round_trip("tq2.5", x.astype(np.float16), "fp16").astype(np.float32)
    for head, channel in enumerate([3, 40, 77, 120]):
        err = np.abs(y[:, head, channel] - x[:, head, channel]) / np.abs(x[:, head, channel]).max()
        assert err.max() < 0.15


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("m", [32, 96, 128, 12, 250])
def test_codebooks_and_rotations_are_well_formed(m: int, version: int) -> None:
    for bits in (1, 2, 3, 4, 5):
        book = lloyd_max(m, bits)
        assert book.centroids.size == 2**bits
        assert np.all(np.diff(book.centroids) > 0)
        assert np.allclose(book.centroids, -book.centroids[::-1], atol=1e-7)
    r = rotation(m, version).as_matrix()
    assert np.allclose(r @ r.T, np.eye(m), atol=1e-5)


@pytest.mark.parametrize("size", [1, 3, 7, 15, 31])
def test_quantize_counts_the_boundaries_each_coordinate_exceeds(size: int) -> None:
    """_quantize (unrolled per codebook size, with a generic fallback for other sizes) gives
    each coordinate the number of boundaries strictly below it, ties included."""
    rng = np.random.default_rng(size)
    boundaries = np.sort(rng.standard_normal(size)).astype(np.float32)
    y = rng.standard_normal((40, 64)).astype(np.float32)
    y[0, :size] = boundaries  # exactly on a boundary: not above it
    idx = np.full((40, 64), -1, np.int32)
    _quantize(y, 37, 50, boundaries, idx)
    expected = np.searchsorted(boundaries, y[:37, :50], side="left")
    assert (idx[:37, :50] == expected).all()
    assert (idx[37:] == -1).all() and (idx[:, 50:] == -1).all()


@pytest.mark.parametrize("d", [16, 96, 128, 1000])
def test_channel_map_takes_the_most_energy_ties_to_the_lower_channel(d: int) -> None:
    """The Numba selection equals numpy's stable argsort of -energy, with many exact ties (and
    zeros), and its masks are the packed form of the selection."""
    codec = named_codec("tq3.5", d)
    rng = np.random.default_rng(d)
    energy = rng.integers(0, 4, size=(9, d)).astype(np.float64)  # ties everywhere
    energy[0] = 0.0
    channels, masks = codec.channel_map(energy)
    top = np.argsort(-energy, axis=1, kind="stable")[:, : codec.hi.m]
    mask = np.zeros(energy.shape, bool)
    np.put_along_axis(mask, top, True, axis=1)
    assert np.array_equal(channels, channels_from_mask(mask))
    assert np.array_equal(masks, np.packbits(mask, axis=1, bitorder="little"))


def channel_plans(select: tuple[np.ndarray, int, int], hi_m: int, word_bytes: int) -> list:
    """_merge_plan's plan for this CPU (runs of expand_merge / compress_split where it has them)
    and the word-by-word plan every CPU can run."""
    mod = select[2]
    by_word = (select, np.zeros((mod, 0), np.uint64), np.zeros((mod, 0, 2), np.int64))
    return [_merge_plan(select, hi_m, True, word_bytes), by_word]


@pytest.mark.parametrize("d", [40, 64, 128, 200, 256])
@pytest.mark.parametrize(("div", "mod"), [(1, 3), (5, 2)])
def test_split_and_merge_order_the_channels_by_selection_group(d: int, div: int, mod: int) -> None:
    """The encoder's _split (compress-stores, or word by word) gives each vector's channels in
    its group's order, hi ones first; the decoder's _merge (expand-loads, or word by word) puts
    them back, for 16- and 32-bit words; from a first vector part of the way through a run."""
    rng = np.random.default_rng(d)
    hi_m = d // 4
    channels = channels_from_mask(np.stack([rng.permutation(d) < hi_m for _ in range(mod)]))
    select = (channels.astype(np.int32), div, mod)
    v0, n = 7, 50
    groups = ((v0 + np.arange(n)) // div) % mod
    x = rng.standard_normal((n, d)).astype(np.float32)
    for plan in channel_plans(select, hi_m, 4):
        rows = np.empty_like(x)
        _split(x, d, v0, n, plan, rows)
        assert np.array_equal(rows, np.take_along_axis(x, channels[groups], axis=1))
    for word in (np.uint16, np.uint32):
        words = rng.integers(0, 1 << 16, (n, d)).astype(word)
        expected = np.empty((v0 + n, d), word)
        np.put_along_axis(expected[v0:], channels[groups], words, axis=1)
        for plan in channel_plans(select, hi_m, np.dtype(word).itemsize):
            out = np.zeros((v0 + n, d), word)
            _merge(words.reshape(-1), d, v0, n, plan, out.reshape(-1))
            assert np.array_equal(out[v0:], expected[v0:])
    if expands(2) and d % 32 == 0:  # on an AVX-512 CPU the fast paths ran too
        assert channel_plans(select, hi_m, 2)[0][1].shape[1] == d // 32


@pytest.mark.parametrize("group_size", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TURBO)
def test_every_index_pattern_and_norm_decodes_as_the_reference(
    name: str, dtype: str, group_size: int
) -> None:
    """Random indices (every level combination the packed bits can hold) and norms from tiny
    to the largest fp16, so the vectors whose values reach past the dtype's range and those
    that stay within it both occur: the decoder clamps the ones that need it (it skips the
    clamp only where a bound says no value can reach that far) and agrees with the reference
    bit for bit."""
    rng = np.random.default_rng(group_size)
    x = to_dtype(rng.standard_normal((300, 2, group_size)).astype(np.float32), dtype)
    codec = get_codec(name, group_size)
    payload = bytearray(codec.encode(x, dtype))
    header = read_header(bytes(payload))
    layout = named_codec(name, group_size).layout(header.shape)
    start = header_bytes(len(header.shape))
    body = np.frombuffer(payload, np.uint8)[start:]
    k = 5 if dtype == "fp16" else 115  # the largest norms take values past the dtype's range
    body[:2] = np.frombuffer(np.int16(k).astype("<i2").tobytes(), np.uint8)
    norms = np.geomspace(1e-3, 65504, (layout.indices_offset - layout.norms_offset) // 2)
    body[layout.norms_offset : layout.indices_offset] = np.frombuffer(
        rng.permutation(norms).astype("<f2").tobytes(), np.uint8
    )
    body[layout.indices_offset :] = rng.integers(0, 256, body.size - layout.indices_offset)
    out = np.empty_like(x)
    decode_into(bytes(payload), out)
    with np.errstate(over="ignore"):
        expected = reference_decode(bytes(payload))
    assert np.array_equal(out.reshape(-1).view(expected.dtype), expected.reshape(-1))
