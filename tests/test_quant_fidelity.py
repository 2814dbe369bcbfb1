"""The fidelity figures the codecs promise (TurboQuant MSE / cosine, INT8 SNR, compression)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierkv.quant import decode_into, fidelity, get_codec
from tierkv.quant.codebooks import lloyd_max
from tierkv.quant.turbo import TurboCodec

PAPER_MSE = {1: 0.3634, 2: 0.1175, 3: 0.0345, 4: 0.0095}
"""Zandieh et al. 2025, Table 1: MSE of TurboQuant on unit vectors, b bits per coordinate."""


def gaussian(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def with_outlier_channels(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Gaussian KV with 4 channels (the same in every head) scaled 10-20x."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    channels = rng.choice(shape[-1], 4, replace=False)
    x[..., channels] *= rng.uniform(10, 20, size=4).astype(np.float32)
    return x


def decoded(name: str, x: np.ndarray) -> tuple[np.ndarray, int]:
    payload = get_codec(name, x.shape[-1]).encode(x)
    out = np.empty_like(x)
    decode_into(payload, out)
    return out, len(payload)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_turboquant_mse_on_unit_vectors_matches_the_paper(bits: int) -> None:
    x = gaussian((8192, 128), seed=bits)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    codec = TurboCodec(f"tq{bits}", 128, bits, bits, mixed=False)
    words = x.reshape(-1).view(np.uint32)
    body = np.empty(codec.layout(x.shape).body_bytes, np.uint8)
    codec.encode_words(words, "fp32", x.shape, body)
    y = np.empty_like(x)
    codec.decode_words(body, "fp32", x.shape, y.reshape(-1).view(np.uint32))
    mse = float(np.mean(np.sum((x - y) ** 2, axis=1)))
    assert abs(mse - PAPER_MSE[bits]) <= 0.03 * PAPER_MSE[bits]


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_expected_mse_matches_the_paper(bits: int) -> None:
    assert abs(lloyd_max(128, bits).mse - PAPER_MSE[bits]) <= 0.03 * PAPER_MSE[bits]


def test_turboquant_4_bit_cosine() -> None:
    x = gaussian((64, 8, 128)).astype(np.float16)
    y, _ = decoded("tq4", x)
    assert fidelity(x, y).cosine >= 0.995


def test_tq2_5_on_outlier_channels_is_accurate_and_small() -> None:
    x = with_outlier_channels((16, 8, 128)).astype(np.float16)
    y, size = decoded("tq2.5", x)
    assert fidelity(x, y).cosine >= 0.96
    assert x.nbytes / size >= 5.3


def test_tq3_is_five_times_smaller_than_fp16() -> None:
    x = gaussian((16, 8, 128)).astype(np.float16)
    _, size = decoded("tq3", x)
    assert x.nbytes / size >= 5.0


def test_int8_snr_on_gaussian_data() -> None:
    x = gaussian((256, 8, 128)).astype(np.float16)
    y, _ = decoded("int8", x)
    assert fidelity(x, y).snr_db >= 43.0


def test_int8_snr_with_outlier_channels() -> None:
    x = with_outlier_channels((256, 8, 128)).astype(np.float16)
    y, _ = decoded("int8", x)
    assert fidelity(x, y).snr_db >= 34.0


def test_fidelity_of_identical_zero_and_opposite_blocks() -> None:
    x = gaussian((4, 128)).astype(np.float16)
    same = fidelity(x, x.copy())
    assert (same.snr_db, same.cosine, same.max_abs_err) == (float("inf"), 1.0, 0.0)
    assert fidelity(x, np.zeros_like(x)).cosine == 0.0
    assert fidelity(np.zeros_like(x), np.zeros_like(x)).cosine == 1.0
    opposite = fidelity(x, -x)
    assert opposite.cosine == pytest.approx(-1.0)
    assert opposite.max_abs_err == pytest.approx(2 * float(np.abs(x.astype(np.float32)).max()))
    with pytest.raises(ValueError, match="shapes"):
        fidelity(x, x[:2])


README_RATIOS = {"int8": 1.96, "tq4": 3.9, "tq3.5": 4.2, "tq3": 5.1, "tq2.5": 5.6, "tq2": 7.4}


def test_every_codec_ratio_is_the_readmes() -> None:
    """README's codec table, to the digits it prints: a 16-token block of 8 heads x 128 in fp16,
    every payload byte counted."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("## Codecs", 1)[1].split("\n\n")[2]
    x = np.random.default_rng(0).standard_normal((16, 8, 128)).astype(np.float16)
    for name, figure in README_RATIOS.items():
        assert f"{figure}x" in table, f"README's codec table no longer gives {name} as {figure}x"
        ratio = x.nbytes / len(get_codec(name, 128).encode(x))
        digits = 2 if name == "int8" else 1
        assert round(ratio, digits) == figure, (name, ratio)
