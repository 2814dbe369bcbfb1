"""Payloads frozen from an earlier implementation still decode, and re-encode, to the same bytes.

tests/data/frozen_payloads.npz holds, for every codec and dtype on a few odd shapes, the input
block and the payload (format version 1) the kernels made before they were optimized;
frozen_payloads.json holds the sha256 of what that payload decoded to then. Any kernel change must
keep both: the payload decodes to the same bytes, and re-encoding the input gives the same body
wherever format version 2 did not change the rotation (every codec but TurboQuant on a
non-power-of-two number of channels), save that a version 1 payload with a dense rotation decodes
to CPU-dependent last bits (see assert_dense_rotation_decode_is_portable). They were written by
this module's main() in the commit that added it; never regenerate them to make this test pass.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from tierkv.codecs import DTYPE_BYTES, SINK_MODES, TURBO_MODES
from tierkv.quant import decode_into, encode_block, get_codec, read_header
from tierkv.quant.codebooks import is_power_of_two
from tierkv.quant.payload import header_bytes
from tierkv.quant.turbo import named_codec

DATA = Path(__file__).parent / "data"
TURBO = tuple(TURBO_MODES)
CODEC_NAMES = ("none", "int8", *TURBO)
"""The codecs of the format 1 and 2 sets (frozen before the sink codecs existed)."""
PAYLOADS = DATA / "frozen_payloads.npz"
MANIFEST = DATA / "frozen_payloads.json"

SHAPES = {
    # name: (shape, group_size, scale, codecs)
    "a": ((3, 5, 128), 128, 1.0, CODEC_NAMES),
    "b": ((2, 3, 2, 96), 96, 300.0, CODEC_NAMES),
    "c": ((2, 70, 64), 64, 1e-3, CODEC_NAMES),
    "d": ((13, 11), 7, 1.0, ("none", "int8")),
}


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
    assert read_header(payload).version == 1
    if not rotation_unchanged(codec, SHAPES[shape][1]):
        assert_dense_rotation_decode_is_portable(payload, x, dtype)
        return
    assert decoded_sha256(payload, x) == manifest[key(shape, codec, dtype)]
    fresh = get_codec(codec, SHAPES[shape][1]).encode(x, dtype)
    body = header_bytes(x.ndim)
    assert fresh[body:] == payload[body:]


def assert_dense_rotation_decode_is_portable(payload: bytes, x: np.ndarray, dtype: str) -> None:
    """A version 1 payload rotated by a dense matrix (TurboQuant on a non-power-of-two number of
    channels) decodes through float32 dot products that LLVM reassociates to the CPU's vector
    width, so the bytes it decodes to differ in the last bits between an AVX2 and an AVX-512
    machine: its frozen hash holds only on the CPU kind that froze it (all 20 such cases failed
    on an AVX-512 machine, with the kernel unchanged). What holds on any CPU, and is checked
    instead: the payload decodes, and equals torch_ops' independent decode within rounding."""
    torch = pytest.importorskip("torch")
    from tierkv.quant import torch_ops

    out = np.empty_like(x)
    decode_into(payload, out)
    words = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    theirs = torch.empty(x.shape, dtype=words)
    torch_ops.decode_into(payload, theirs)
    ours = torch.from_numpy(out.view(np.int16) if dtype == "bf16" else out).view(words)
    scale = float(ours.float().abs().max())
    assert torch.allclose(ours.float(), theirs.float(), rtol=1e-2, atol=1e-4 * scale)


def rotation_unchanged(codec: str, group_size: int) -> bool:
    """Whether format version 2 encodes `codec` like version 1 did."""
    if codec in ("none", "int8"):
        return True
    turbo = named_codec(codec, group_size)
    return all(is_power_of_two(inst.m) for inst in (turbo.hi, turbo.lo) if inst is not None)


PAYLOADS_V2 = DATA / "frozen_payloads_v2.npz"
MANIFEST_V2 = DATA / "frozen_payloads_v2.json"
"""Format 2 TurboQuant payloads of the inputs above (shapes a, b, c: Hadamard, Kronecker-mixed
and mixed-precision rotations) and the sha256 of what the decoder before the SIMD tile decoder
(commit dcf0ddd) decoded them to. That decoder used no reassociated sums there, so the hashes
hold on any CPU. The encoder still makes these payloads byte for byte from the inputs."""


@pytest.fixture(scope="module")
def frozen_v2() -> tuple[dict[str, np.ndarray], dict[str, str]]:
    return load_frozen(PAYLOADS_V2, MANIFEST_V2)


def load_frozen(payloads: Path, manifest: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The arrays of a frozen set and its manifest of sha256s."""
    with np.load(payloads) as data:
        arrays = {name: data[name] for name in data.files}
    return arrays, json.loads(manifest.read_text())


@pytest.mark.parametrize(
    ("shape", "codec", "dtype"), [case for case in cases() if case[0] != "d" and case[1] in TURBO]
)
def test_frozen_format_2_payload_decodes_and_encodes_to_the_same_bytes(
    frozen: tuple[dict[str, np.ndarray], dict[str, str]],
    frozen_v2: tuple[dict[str, np.ndarray], dict[str, str]],
    shape: str,
    codec: str,
    dtype: str,
) -> None:
    x = frozen[0][f"input/{shape}/{dtype}"]
    payloads, manifest = frozen_v2
    payload = payloads[key(shape, codec, dtype)].tobytes()
    assert read_header(payload).version == 2
    assert decoded_sha256(payload, x) == manifest[key(shape, codec, dtype)]
    assert get_codec(codec, SHAPES[shape][1]).encode(x, dtype) == payload


PAYLOADS_SINKS = DATA / "frozen_payloads_sinks.npz"
MANIFEST_SINKS = DATA / "frozen_payloads_sinks.json"
SINK_CASES = {
    # name: (input shape, token axis, sink tokens)
    "a": (0, 4),  # (3, 5, 128): all but the last of its 3 tokens sinks
    "b": (2, 1),  # (2, 3, 2, 96): the token axis given explicitly
    "c": (1, 4),  # (2, 70, 64): MLX's [heads, tokens, d]
}
"""The sink codecs' payloads (format 2, codec ids 7-12) of the inputs above, with sink tokens
and without, and the sha256 of what they decoded to when frozen (the commit that added them)."""


def sink_cases() -> list[tuple[str, str, str, bool]]:
    return [
        (shape, codec, dtype, with_sinks)
        for shape in SINK_CASES
        for codec in SINK_MODES
        for dtype in DTYPE_BYTES
        for with_sinks in (False, True)
    ]


def sink_key(shape: str, codec: str, dtype: str, with_sinks: bool) -> str:
    return f"{shape}/{codec}/{dtype}/{'sinks' if with_sinks else 'plain'}"


def sink_payload(x: np.ndarray, shape: str, codec: str, dtype: str, with_sinks: bool) -> bytes:
    axis, count = SINK_CASES[shape]
    sinks = (axis, min(count, x.shape[axis] - 1) if with_sinks else 0)
    return encode_block(get_codec(codec, SHAPES[shape][1]), x, dtype, sink_tokens=sinks)


@pytest.fixture(scope="module")
def frozen_sinks() -> tuple[dict[str, np.ndarray], dict[str, str]]:
    return load_frozen(PAYLOADS_SINKS, MANIFEST_SINKS)


@pytest.mark.parametrize(("shape", "codec", "dtype", "with_sinks"), sink_cases())
def test_frozen_sink_payload_decodes_and_encodes_to_the_same_bytes(
    frozen: tuple[dict[str, np.ndarray], dict[str, str]],
    frozen_sinks: tuple[dict[str, np.ndarray], dict[str, str]],
    shape: str,
    codec: str,
    dtype: str,
    with_sinks: bool,
) -> None:
    x = frozen[0][f"input/{shape}/{dtype}"]
    payloads, manifest = frozen_sinks
    name = sink_key(shape, codec, dtype, with_sinks)
    payload = payloads[name].tobytes()
    assert read_header(payload).codec == codec
    assert decoded_sha256(payload, x) == manifest[name]
    assert sink_payload(x, shape, codec, dtype, with_sinks) == payload


def main() -> None:
    """Write the sink codecs' frozen payloads (once, in the commit that adds them)."""
    with np.load(PAYLOADS) as data:
        inputs = {name: data[name] for name in data.files}
    payloads, manifest = {}, {}
    for shape, codec, dtype, with_sinks in sink_cases():
        x = inputs[f"input/{shape}/{dtype}"]
        name = sink_key(shape, codec, dtype, with_sinks)
        payload = sink_payload(x, shape, codec, dtype, with_sinks)
        payloads[name] = np.frombuffer(payload, np.uint8)
        manifest[name] = decoded_sha256(payload, x)
    np.savez_compressed(PAYLOADS_SINKS, **payloads)
    MANIFEST_SINKS.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
