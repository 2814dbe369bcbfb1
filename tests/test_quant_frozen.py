"""Payloads frozen from an earlier implementation still decode, and re-encode, to the same bytes.

tests/data/frozen_payloads.npz holds, for every codec and dtype on a few odd shapes, the input
block and the payload the kernels made before they were optimized; frozen_payloads.json holds the
sha256 of what that payload decoded to then. Any kernel change must keep both. Regenerate (only
when the payload format version changes, never to make this test pass) with
`python -m tests.test_quant_frozen`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from tierkv.quant import CODEC_NAMES, decode_into, get_codec
from tierkv.quant.payload import DTYPE_BYTES

DATA = Path(__file__).parent / "data"
PAYLOADS = DATA / "frozen_payloads.npz"
MANIFEST = DATA / "frozen_payloads.json"

SHAPES = {
    # name: (shape, group_size, scale, codecs)
    "a": ((3, 5, 128), 128, 1.0, CODEC_NAMES),
    "b": ((2, 3, 2, 96), 96, 300.0, CODEC_NAMES),
    "c": ((2, 70, 64), 64, 1e-3, CODEC_NAMES),
    "d": ((13, 11), 7, 1.0, ("none", "int8")),
}


def frozen_input(shape: tuple[int, ...], scale: float, dtype: str, seed: int) -> np.ndarray:
    """A block of `shape` like K: normal values, a few outlier channels, as the caller's array."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    x[..., 1] *= 12
    if dtype == "fp16":
        return x.astype(np.float16)
    if dtype == "bf16":
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return x


def cases() -> list[tuple[str, str, str]]:
    return [
        (shape, codec, dtype)
        for shape, (_, _, _, codecs) in SHAPES.items()
        for codec in codecs
        for dtype in DTYPE_BYTES
    ]


def key(shape: str, codec: str, dtype: str) -> str:
    return f"{shape}/{codec}/{dtype}"


def decoded_sha256(payload: bytes, like: np.ndarray) -> str:
    out = np.empty_like(like)
    decode_into(payload, out)
    return hashlib.sha256(out.tobytes()).hexdigest()


@pytest.fixture(scope="module")
def frozen() -> tuple[dict[str, np.ndarray], dict[str, str]]:
    with np.load(PAYLOADS) as data:
        arrays = {name: data[name] for name in data.files}
    return arrays, json.loads(MANIFEST.read_text())


@pytest.mark.parametrize(("shape", "codec", "dtype"), cases())
def test_frozen_payload_decodes_and_encodes_to_the_same_bytes(
    frozen: tuple[dict[str, np.ndarray], dict[str, str]], shape: str, codec: str, dtype: str
) -> None:
    arrays, manifest = frozen
    x = arrays[f"input/{shape}/{dtype}"]
    payload = arrays[f"payload/{key(shape, codec, dtype)}"].tobytes()
    assert decoded_sha256(payload, x) == manifest[key(shape, codec, dtype)]
    assert get_codec(codec, SHAPES[shape][1]).encode(x, dtype) == payload


def main() -> None:
    """Write the frozen set from the current kernels."""
    arrays: dict[str, np.ndarray] = {}
    manifest: dict[str, str] = {}
    for seed, (shape, (dims, _, scale, _)) in enumerate(SHAPES.items()):
        for dtype in DTYPE_BYTES:
            arrays[f"input/{shape}/{dtype}"] = frozen_input(dims, scale, dtype, seed)
    for shape, codec, dtype in cases():
        x = arrays[f"input/{shape}/{dtype}"]
        payload = get_codec(codec, SHAPES[shape][1]).encode(x, dtype)
        arrays[f"payload/{key(shape, codec, dtype)}"] = np.frombuffer(payload, np.uint8)
        manifest[key(shape, codec, dtype)] = decoded_sha256(payload, x)
    DATA.mkdir(exist_ok=True)
    np.savez_compressed(PAYLOADS, **arrays)
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
