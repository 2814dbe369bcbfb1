"""Round trips, edge values and payload validation of the tierkv.quant codecs (real kernels)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numba.core.registry import CPUDispatcher as Dispatcher

from tierkv.quant import (
    CODEC_NAMES,
    NonFiniteError,
    PayloadError,
    decode_into,
    decode_many,
    encode_block,
    fidelity,
    get_codec,
    int8,
    kernels,
    lossless,
    read_header,
    turbo,
    warmup,
)
from tierkv.quant.codec import FAMILIES, FAMILY_OF
from tierkv.quant.payload import FORMAT_VERSION, header_bytes

fidelity_module = importlib.import_module("tierkv.quant.fidelity")

DTYPES = ("fp16", "bf16", "fp32")


def test_every_codec_has_one_family() -> None:
    """The catalogue serves each codec name once, each by the family whose codec has that name."""
    served = [name for family in FAMILIES for name in family.names]
    assert sorted(served) == sorted(CODEC_NAMES)
    for name in CODEC_NAMES:
        assert FAMILY_OF[name].make(name, 128).name == name


def to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 data as the array a caller hands over: float16, bf16 words (uint16) or float32."""
    x = np.asarray(x, np.float32)
    if dtype == "fp16":
        return x.astype(np.float16)
    if dtype == "bf16":
        u = x.view(np.uint32).astype(np.uint64)
        return np.asarray((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return x


def as_f64(a: np.ndarray, dtype: str) -> np.ndarray:
    """Values of an fp16 / bf16-words / fp32 array as float64."""
    if dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def round_trip(name: str, x: np.ndarray, dtype: str, group_size: int = 128) -> np.ndarray:
    out = np.empty_like(x)
    decode_into(get_codec(name, group_size).encode(x, dtype), out)
    return out


def assert_int8_close(x: np.ndarray, y: np.ndarray, dtype: str, group_size: int) -> None:
    """Every value within half a quantization step of its group, plus output rounding; groups more
    than 2**28 below the block's largest may lose precision (fp16 scale under a block exponent)."""
    xs, ys = as_f64(x, dtype).reshape(-1), as_f64(y, dtype).reshape(-1)
    assert np.all(np.isfinite(ys))
    floor = np.abs(xs).max(initial=0.0) * 2.0**-30 + 1e-45
    for start in range(0, xs.size, group_size):
        gx, gy = xs[start : start + group_size], ys[start : start + group_size]
        step = np.abs(gx).max() / 127
        tol = 0.51 * step + np.abs(gx).max() * 2.0**-8 + floor
        assert np.abs(gx - gy).max() <= tol


WARMUP_CHECK = """
import numpy as np
from numba.core.registry import CPUDispatcher
from tierkv.quant import CODEC_NAMES, decode_many, decode_into, get_codec, warmup
from tierkv.quant import fidelity, int8, kernels, lossless, turbo

def compiled():
    return {
        f"{module.__name__}.{name}": len(kernel.signatures)
        for module in (lossless, int8, turbo, fidelity, kernels)
        for name, kernel in vars(module).items()
        if isinstance(kernel, CPUDispatcher)
    }

warmup()
after = compiled()
rng = np.random.default_rng(0)
block = rng.standard_normal((2, 4, 32, 128)).astype(np.float32)
arrays = {"fp16": block.astype(np.float16), "fp32": block,
          "bf16": block.astype(np.float16).view(np.uint16)}
for name in CODEC_NAMES:
    for dtype, array in arrays.items():
        payload = get_codec(name).encode(array, dtype)
        decode_into(payload, np.empty_like(array))
        run = memoryview(payload * 3)
        thirds = [run[i * len(payload) : (i + 1) * len(payload)] for i in range(3)]
        decode_many(thirds, np.empty((3, *array.shape), array.dtype), [2, 0, 1])
grown = {name: count for name, count in compiled().items() if count != after[name]}
assert not grown, grown
"""


def test_warmup_compiles_every_kernel() -> None:
    """In a fresh process, warmup() leaves no kernel for a request's encode or decode to compile."""
    subprocess.run([sys.executable, "-c", WARMUP_CHECK], check=True, timeout=600)


@pytest.mark.parametrize("module", [lossless, int8, turbo, fidelity_module, kernels])
def test_every_kernel_releases_the_gil_and_is_cached(module) -> None:  # type: ignore[no-untyped-def]
    dispatchers = [v for v in vars(module).values() if isinstance(v, Dispatcher)]
    assert dispatchers
    for kernel in dispatchers:
        assert kernel.targetoptions.get("nogil") is True, kernel.__name__
        assert type(kernel._cache).__name__ == "FunctionCache", kernel.__name__


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=9),
)
def test_lossless_round_trip_is_bit_exact(data, dtype: str, shape: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    x = to_dtype(
        data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-1e4, 1e4, width=32))), dtype
    )
    y = round_trip("none", x, dtype)
    assert y.tobytes() == x.tobytes()


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    group_size=st.sampled_from([1, 7, 64, 128]),
    shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=12),
)
def test_int8_round_trip_any_shape(data, dtype: str, group_size: int, shape) -> None:  # type: ignore[no-untyped-def]
    finite = st.floats(-3e4, 3e4, width=32, allow_subnormal=True)
    x = to_dtype(data.draw(hnp.arrays(np.float32, shape, elements=finite)), dtype)
    y = round_trip("int8", x, dtype, group_size)
    assert_int8_close(x, y, dtype, group_size)


@pytest.mark.parametrize("offset", [0, 2, 46, 64])
@pytest.mark.parametrize("extra", [0, 2, 62])
def test_lossless_decode_of_large_blocks_into_any_alignment(offset: int, extra: int) -> None:
    """Bodies from lossless.STREAM_MIN_BYTES on are copied with non-temporal stores to the
    64-byte aligned middle of the output and ordinary ones at its edges: every alignment of
    the output and every tail length gives the exact bytes, and nothing outside it is written."""
    n = (lossless.STREAM_MIN_BYTES + extra) // 2
    x = np.random.default_rng(offset + extra).standard_normal(n).astype(np.float16)
    payload = get_codec("none").encode(x)
    buffer = np.full(n + 64, 7, np.uint16)
    start = offset // 2 + (-buffer.ctypes.data // 2) % 32  # the output starts `offset` bytes
    out = buffer[start : start + n]  # past a 64-byte boundary
    assert out.ctypes.data % 64 == offset % 64
    decode_into(payload, out)
    assert out.tobytes() == x.tobytes()
    assert (buffer[:start] == 7).all() and (buffer[start + n :] == 7).all()


def back_to_back(payloads: list[bytes]) -> list[memoryview]:
    """The payloads as a Promote receives them: slices of one buffer, one after the other."""
    buffer = memoryview(b"".join(payloads)).toreadonly()
    ends = np.cumsum([len(payload) for payload in payloads])
    return [buffer[end - len(payload) : end] for payload, end in zip(payloads, ends, strict=True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["int8", "tq4", "tq3.5", "tq2.5", "tq2"])
def test_a_run_of_payloads_decodes_in_one_call_as_each_one_alone(name: str, dtype: str) -> None:
    rng = np.random.default_rng(7)
    blocks = to_dtype(rng.standard_normal((9, 2, 3, 16, 64)) * 3, dtype)
    codec = get_codec(name, 64)
    payloads = [codec.encode(block, dtype) for block in blocks]
    alone = np.stack([round_trip(name, block, dtype, 64) for block in blocks])
    if name in ("tq3.5", "tq2.5"):  # a channel mask that selects too many: not decoded
        corrupt = bytearray(payloads[4])
        corrupt[len(corrupt) - turbo.body_bytes(read_header(corrupt)) + 2] = 0xFF
        payloads[4] = bytes(corrupt)
    corrupt = bytearray(payloads[6])  # another header (group size): left to decode_into
    corrupt[10] ^= 1
    payloads[6] = bytes(corrupt)
    out = np.zeros((12, *blocks.shape[1:]), blocks.dtype)
    rows = [11, 0, 5, 3, 1, 2, 9, 7, 4]
    done = decode_many(back_to_back(payloads), out, rows)
    failed = {6} | ({4} if name in ("tq3.5", "tq2.5") else set())
    assert [i for i in range(9) if not done[i]] == sorted(failed)
    for i, row in enumerate(rows):
        if i in failed:
            assert not out[row].any()  # never written
        else:
            assert np.array_equal(out[row], alone[i]), i
    if name in ("tq3.5", "tq2.5"):
        with pytest.raises(PayloadError, match="channel mask"):
            decode_into(payloads[4], np.empty_like(blocks[4]))


def test_what_decode_many_cannot_decode_in_one_call_is_left_to_decode_into() -> None:
    block = np.ones((4, 128), np.float16)
    lossless_run = back_to_back([get_codec("none").encode(block, "fp16")] * 2)
    out = np.zeros((2, 4, 128), np.float16)
    assert not decode_many(lossless_run, out, [0, 1]).any()
    int8_run = back_to_back([get_codec("int8").encode(block, "fp16")] * 2)
    assert not decode_many(int8_run, np.zeros((2, 4, 64), np.float16), [0, 1]).any()
    assert not decode_many(int8_run, np.zeros((4, 4, 128), np.float16)[::2], [0, 1]).any()
    with pytest.raises(IndexError, match="outside 2 outputs"):
        decode_many(int8_run, out, [0, 2])
    apart = [memoryview(get_codec("int8").encode(block, "fp16")) for _ in range(2)]
    assert not decode_many(apart, out, [0, 1]).any()  # not back to back: one by one
    assert not out.any()
    out = np.zeros((6, 4, 128), np.float16)
    done = decode_many([*int8_run, apart[0], *back_to_back([bytes(apart[1])] * 3)], out, range(6))
    assert done.tolist() == [True, True, False, True, True, True]
    assert (out[[0, 1, 3, 4, 5]] == 1).all() and not out[2].any()


def test_a_cached_header_still_checks_the_payload_length() -> None:
    """checked_body remembers headers it validated; a payload that reuses one with a truncated
    or padded body is still refused, and a corrupted header still fails its checksum."""
    x = np.ones((4, 128), np.float16)
    payload = get_codec("none").encode(x)
    decode_into(payload, np.empty_like(x))  # its header is now cached
    for bad in (payload[:-2], payload + b"\0\0"):
        with pytest.raises(PayloadError, match="truncated or padded"):
            decode_into(bad, np.empty_like(x))
    corrupt = bytearray(payload)
    corrupt[header_bytes(2) - 1] ^= 1
    with pytest.raises(PayloadError, match="checksum"):
        decode_into(corrupt, np.empty_like(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["none", "int8"])
def test_zeros_round_trip_to_zeros(name: str, dtype: str) -> None:
    x = to_dtype(np.zeros((3, 128)), dtype)
    assert not as_f64(round_trip(name, x, dtype), dtype).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_denormal_values(dtype: str) -> None:
    tiny = {"fp16": 6e-8, "bf16": 1e-39, "fp32": 1e-44}[dtype]
    x = to_dtype(np.linspace(-100 * tiny, 100 * tiny, 256, dtype=np.float32), dtype)
    y = round_trip("int8", x, dtype)
    assert_int8_close(x, y, dtype, 128)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_huge_values_stay_finite(dtype: str) -> None:
    big = {"fp16": 65504.0, "bf16": 3.38e38, "fp32": 3.4e38}[dtype]
    x = to_dtype(np.array([big, -big, big / 3, 1.0] * 64, np.float32), dtype)
    y = round_trip("int8", x, dtype)
    assert_int8_close(x, y, dtype, 128)


def test_int8_groups_with_very_different_magnitudes() -> None:
    x = np.concatenate([np.full(128, 1e4), np.full(128, 1e-3), np.zeros(128)]).astype(np.float32)
    y = round_trip("int8", x, "fp32")
    assert_int8_close(x, y, "fp32", 128)
    assert np.allclose(y[128:256], 1e-3, rtol=1e-2)


@pytest.mark.parametrize("length", [1, 7, 127, 129, 300])
def test_int8_odd_lengths_round_trip(length: int) -> None:
    x = np.random.default_rng(length).standard_normal(length).astype(np.float16)
    assert_int8_close(x, round_trip("int8", x, "fp16"), "fp16", 128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["none", "int8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_rejected(name: str, dtype: str, bad: float) -> None:
    x = np.ones((4, 128), np.float32)
    x[2, 5] = bad
    with pytest.raises(NonFiniteError):
        get_codec(name).encode(to_dtype(x, dtype), dtype)


def test_header_describes_the_payload() -> None:
    x = np.zeros((2, 16, 8, 128), np.float16)
    header = read_header(get_codec("int8", 128).encode(x))
    assert (header.codec, header.dtype, header.shape, header.group_size, header.bits) == (
        "int8",
        "fp16",
        (2, 16, 8, 128),
        128,
        8.0,
    )
    assert header.version == FORMAT_VERSION


def test_int8_ratio_against_fp16_is_honest() -> None:
    x = np.zeros((16, 8, 128), np.float16)
    ratio = x.nbytes / len(get_codec("int8").encode(x))
    assert 1.9 < ratio < 1.97


@pytest.mark.parametrize("name", ["none", "int8"])
def test_every_corrupted_header_byte_is_detected(name: str) -> None:
    payload = get_codec(name).encode(np.ones((4, 128), np.float16))
    for i in range(header_bytes(2)):
        corrupted = bytearray(payload)
        corrupted[i] ^= 0x5A
        with pytest.raises(PayloadError):
            decode_into(bytes(corrupted), np.empty((4, 128), np.float16))


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda p: p[:-1], "truncated"),
        (lambda p: p + b"\0", "padded"),
        (lambda p: p[:10], "too short"),
        (lambda p: b"", "too short"),
        (lambda p: b"GARBAGE" * 10, "not a tierkv payload"),
        (lambda p: p[:4] + b"\x09" + p[5:], "version 9"),
    ],
)
def test_malformed_payloads_raise_clear_errors(mangle, message: str) -> None:  # type: ignore[no-untyped-def]
    payload = get_codec("int8").encode(np.ones((4, 128), np.float16))
    with pytest.raises(PayloadError, match=message):
        decode_into(mangle(payload), np.empty((4, 128), np.float16))


def test_mismatching_output_array_is_rejected() -> None:
    payload = get_codec("int8").encode(np.ones((4, 128), np.float16))
    with pytest.raises(PayloadError, match="elements"):
        decode_into(payload, np.empty((4, 127), np.float16))
    with pytest.raises(PayloadError, match="fp16"):
        decode_into(payload, np.empty((4, 128), np.float32))
    with pytest.raises(PayloadError, match="contiguous"):
        decode_into(payload, np.empty((128, 4), np.float16).T)
    words = to_dtype(np.linspace(-3, 3, 4 * 128).reshape(4, 128), "bf16")
    bf16_payload = get_codec("int8").encode(words, "bf16")
    with pytest.raises(PayloadError, match="bf16"):
        decode_into(bf16_payload, np.empty((4, 128), np.float16))
    as_uint16, as_int16 = np.empty((4, 128), np.uint16), np.empty((4, 128), np.int16)
    decode_into(bf16_payload, as_uint16)
    decode_into(bf16_payload, as_int16)  # torch's bf16 seen through numpy: int16 words
    assert as_int16.view(np.uint16).tobytes() == as_uint16.tobytes()
    assert_int8_close(words, as_uint16, "bf16", 128)


def test_bad_codec_and_input_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="tq9"):
        get_codec("tq9")
    for name in ("none", "int8"):
        with pytest.raises(ValueError, match="group_size"):
            get_codec(name, 0)
    with pytest.raises(ValueError, match="bf16"):
        get_codec("int8").encode(np.zeros(8, np.uint16))
    with pytest.raises(ValueError, match="4-byte"):
        get_codec("int8").encode(np.zeros(8, np.float16), "fp32")
    with pytest.raises(ValueError, match="float16 array cannot hold 'bf16'"):
        get_codec("int8").encode(np.zeros(8, np.float16), "bf16")
    assert CODEC_NAMES[:7] == ("none", "int8", "tq4", "tq3.5", "tq3", "tq2.5", "tq2")  # ids kept


def test_encode_block_falls_back_to_lossless_under_min_cosine() -> None:
    x = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float16)
    codec = get_codec("int8")
    assert read_header(encode_block(codec, x, min_cosine=0.99)).codec == "int8"
    fallback = encode_block(codec, x, min_cosine=1.5)
    assert read_header(fallback).codec == "none"
    out = np.empty_like(x)
    decode_into(fallback, out)
    assert out.tobytes() == x.tobytes()


@pytest.mark.parametrize("name", ["none", "int8", "tq3", "tq2.5"])
def test_multi_threaded_kernels_match_the_single_threaded_ones(name: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    x = np.random.default_rng(7).standard_normal((4096, 8, 128)).astype(np.float16)
    assert x.nbytes >= kernels.PARALLEL_MIN_BYTES
    codec = get_codec(name)
    threaded_payload = codec.encode(x)
    threaded_out = np.empty_like(x)
    decode_into(threaded_payload, threaded_out)
    threaded_fidelity = fidelity(x, threaded_out)
    monkeypatch.setattr(kernels, "PARALLEL_MIN_BYTES", 1 << 62)
    assert codec.encode(x) == threaded_payload
    serial_out = np.empty_like(x)
    decode_into(threaded_payload, serial_out)
    assert serial_out.tobytes() == threaded_out.tobytes()
    serial_fidelity = fidelity(x, serial_out)
    assert serial_fidelity.cosine == pytest.approx(threaded_fidelity.cosine, abs=1e-12)
    assert serial_fidelity.max_abs_err == threaded_fidelity.max_abs_err


def test_warmup_builds_the_multi_threaded_kernels_without_running_them() -> None:
    warmup()
    for kernel in kernels.Threaded.every:
        assert kernel.parallel.signatures, kernel.parallel.__name__


def test_warmup_compiles_only_what_it_is_asked_for() -> None:
    """The named codecs and dtypes only; no multi-threaded builds for blocks too small to use
    them, no fidelity kernels unless asked (a fresh process: nothing compiled before)."""
    probe = """
from tierkv.quant import warmup
from tierkv.quant.kernels import Threaded
warmup(("int8", "none"), ("fp16",), with_fidelity=False, largest_block_bytes=1 << 20)
print(sum(len(k.serial.signatures) for k in Threaded.every),
      sum(len(k.parallel.signatures) for k in Threaded.every))
warmup(("int8",), ("fp16",), with_fidelity=False)
print(sum(len(k.parallel.signatures) for k in Threaded.every))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, check=True
    )
    (serial, parallel_small), (parallel,) = (
        [int(word) for word in line.split()] for line in done.stdout.splitlines()
    )
    assert serial > 0 and parallel_small == 0 and parallel > 0
