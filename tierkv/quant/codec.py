"""The codec catalogue, payload decoding, the lossless fallback and kernel warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from tierkv.codecs import (
    CODEC_NAMES,
    DTYPES,
    kv_pair_codecs,
)
from tierkv.quant import int8, lossless, sinks, turbo
from tierkv.quant.base import Codec, CodecFamily
from tierkv.quant.fidelity import fidelity
from tierkv.quant.kernels import PARALLEL_MIN_BYTES, Threaded
from tierkv.quant.pair import PairCodec, decode_pair_into, is_pair, parse_pair
from tierkv.quant.payload import (
    PayloadError,
    PayloadHeader,
    PayloadRun,
    back_to_back_runs,
    header_bytes,
    input_words,
    output_words,
    parse_header,
)
from tierkv.quant.sinks import Sinks, SinkTurboCodec

FAMILIES = (lossless.FAMILY, int8.FAMILY, turbo.FAMILY, sinks.FAMILY)
"""The catalogue: every codec family, from which get_codec, decode_into, checked_body and
decode_many dispatch on a codec's name (see base.CodecFamily for adding a codec)."""
FAMILY_OF: dict[str, CodecFamily] = {name: family for family in FAMILIES for name in family.names}
"""Each codec name of CODEC_NAMES -> its family (a payload header's codec is always one)."""


def get_codec(name: str, group_size: int = 128) -> Codec:
    """The codec called `name` (one of CODEC_NAMES, or a K/V pair like "k8v4") for groups of
    `group_size` values."""
    pair = kv_pair_codecs(name)
    if pair is not None:
        keys, values = (get_codec(codec, group_size) for codec in pair)
        return keys if keys.name == values.name else PairCodec(keys, values)
    family = FAMILY_OF.get(name)
    if family is None:
        raise ValueError(
            f"unknown codec {name!r}; expected one of {', '.join(CODEC_NAMES)} or a K/V pair "
            'like "k8v4"'
        )
    return family.make(name, group_size)


def decode_into(payload: bytes | bytearray | memoryview, out: np.ndarray) -> None:
    """Decode `payload` (any codec, read from its header) into the preallocated array `out`.

    `out` must be C-contiguous with the payload's element size and element count; the kernels
    release the GIL. Raises PayloadError for a malformed payload or a mismatching `out`.
    """
    if is_pair(payload):
        decode_pair_into(payload, out, decode_into)
        return
    header, body = checked_body(payload)
    words = output_words(out, header)
    body_array = np.frombuffer(body, np.uint8)
    body_array.flags.writeable = False  # one kernel specialisation for bytes and bytearrays
    FAMILY_OF[header.codec].decode_body(header, body_array, words)


def payload_shape(payload: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """The block shape a payload (any codec, a K/V pair too) holds; PayloadError when its header
    is malformed. A decoder checks only the element count, so a caller that stores blocks in
    more than one shape tells them apart by this."""
    if is_pair(payload):
        return parse_pair(payload)[0].shape
    return parse_header(payload)[0].shape


def decode_many(payloads: Sequence[memoryview], out: np.ndarray, rows: Sequence[int]) -> np.ndarray:
    """Decode payload i into out[rows[i]] (`out`: C-contiguous, [n, *block]) where one kernel
    call can decode many; which were decoded (decode the others with decode_into, which says
    why one fails).

    Decoded one by one, each block gives the GIL back once, and each time a thread busy in
    Python (an engine's) may keep it for a switch interval (5 ms). Here each run of payloads
    that lie back to back in memory with one length (as promoted payloads of one block shape
    do in a receive buffer) is one call: its int8 and TurboQuant payloads whose header bytes
    equal the run's first, when that header validates, fits a row of `out` and is of a block
    under PARALLEL_MIN_BYTES (larger ones use the multi-threaded kernels).
    """
    done = np.zeros(len(payloads), np.bool_)
    at_rows = np.asarray(rows, np.int64)
    if len(at_rows) != len(payloads):
        raise ValueError(f"{len(payloads)} payloads but {len(at_rows)} rows")
    if len(at_rows) and (at_rows.min() < 0 or at_rows.max() >= len(out)):
        raise IndexError(f"rows {at_rows.min()}..{at_rows.max()} outside {len(out)} outputs")
    if not out.flags.c_contiguous:
        return done
    for span in back_to_back_runs(payloads):
        if len(span) > 1:
            first = memoryview(payloads[span.start]).cast("B")
            run_rows = at_rows[span.start : span.stop]
            done[span.start : span.stop] = _decode_run(first, len(span), out, run_rows)
    return done


def _decode_run(first: memoryview, count: int, out: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """decode_many of `count` payloads back to back from `first` (checked), into out[rows]."""
    done = np.zeros(count, np.bool_)
    try:
        header, body = checked_body(first)
        words = output_words(out[rows[0]], header)
    except PayloadError:
        return done
    decode_run = FAMILY_OF[header.codec].decode_run
    if decode_run is None or words.nbytes >= PARALLEL_MIN_BYTES:
        return done
    stride, head = len(first), len(first) - len(body)
    data = np.lib.stride_tricks.as_strided(
        np.frombuffer(first, np.uint8), (count * stride,), (1,), writeable=False
    )
    heads = data.reshape(count, stride)[:, :head]
    at = np.flatnonzero((heads == heads[0]).all(axis=1))
    out_rows = out.reshape(len(out), -1).view(words.dtype)
    done[at] = decode_run(header, PayloadRun(data, stride, head, at), out_rows, rows[at])
    return done


_NDIM_AT = 7
"""Offset of the header's ndim byte (after magic, version, codec id and dtype)."""
_CHECKED_HEADERS = 512
_checked: dict[bytes, tuple[PayloadHeader, int]] = {}
"""Header bytes that passed checked_body -> (their header, the payload length they need). A
restore decodes many payloads with one header, so each one's parsing and checks (most of a small
payload's decode time) run once; a byte-identical header validates identically."""


def checked_body(payload: bytes | bytearray | memoryview) -> tuple[PayloadHeader, memoryview]:
    """The validated header and body of `payload`; PayloadError when the body length does not
    match what the header's codec, shape and group size need."""
    view = memoryview(payload).cast("B")
    if len(view) > _NDIM_AT:
        head_len = header_bytes(view[_NDIM_AT])
        known = _checked.get(bytes(view[:head_len]))
        if known is not None and known[1] == len(view):
            return known[0], view[head_len:]
    header, body = parse_header(view)
    expected = FAMILY_OF[header.codec].body_bytes(header, body)
    if len(body) != expected:
        raise PayloadError(
            f"{header.codec} payload body is {len(body)} bytes, shape {header.shape} with "
            f"group_size {header.group_size} needs {expected}"
        )
    if len(_checked) >= _CHECKED_HEADERS:
        _checked.clear()
    _checked[bytes(view[: len(view) - len(body)])] = (header, len(view))
    return header, body


def encode_block(
    codec: Codec,
    src: np.ndarray,
    dtype: str | None = None,
    min_cosine: float = 0.0,
    kv_split: tuple[int, int] | None = None,
    sink_tokens: Sinks | None = None,
) -> bytes:
    """`codec.encode(src)`, or the lossless payload when the decoded block's cosine similarity to
    `src` is under `min_cosine` (0 = never fall back). NonFiniteError propagates.

    `kv_split`: (axis, keys along it) where the block's keys end and its values begin, for a K/V
    pair codec (which refuses a block without one). Other codecs ignore it. `sink_tokens`: (token
    axis, count) of the block's first tokens a sink codec keeps lossless (a sequence's first
    block); other codecs ignore it."""
    if isinstance(codec, PairCodec):
        payload = codec.encode(src, dtype, kv_split, sink_tokens)
    elif isinstance(codec, SinkTurboCodec):
        payload = codec.encode(src, dtype, sink_tokens)
    else:
        payload = codec.encode(src, dtype)
    if min_cosine <= 0.0 or codec.name == "none":
        return payload
    words, dtype = input_words(src, dtype)
    decoded = np.empty_like(words)
    decode_into(payload, decoded)
    if fidelity(words, decoded, dtype).cosine < min_cosine:
        return get_codec("none", codec.group_size).encode(words.reshape(src.shape), dtype)
    return payload


def warmup(
    codecs: Iterable[str] = CODEC_NAMES,
    dtypes: Iterable[str] = DTYPES,
    *,
    with_fidelity: bool = True,
    largest_block_bytes: int | None = None,
    on_step: Callable[[str, int, int], None] | None = None,
) -> float:
    """Compile (or load from Numba's cache) the kernels of `codecs` for `dtypes`, and of
    `fidelity` if `with_fidelity` (encode_block's min_cosine check uses it), so no request pays
    for it; returns the seconds taken. The multi-threaded builds are compiled too unless
    `largest_block_bytes` says no block is large enough to use them (None: compile them).
    `on_step(what, done, total)` reports progress ("int8 fp16", ..., "multi-threaded builds",
    then "done")."""
    start = time.perf_counter()
    steps = [(name, dtype) for name in dict.fromkeys(codecs) for dtype in dict.fromkeys(dtypes)]
    total = len(steps) + 1
    for done, (name, dtype) in enumerate(steps):
        if on_step:
            on_step(f"{name} {dtype}", done, total)
        array = np.ones((2, 128), np.float32 if dtype == "fp32" else np.float16)
        if dtype == "bf16":
            array = array.view(np.uint16)
        codec = get_codec(name, 128)
        payload = encode_block(codec, array, dtype, kv_split=(1, 64))  # pairs too
        decode_into(payload, np.empty_like(array))
        family = FAMILY_OF.get(name)  # None for a K/V pair
        if family is not None and family.decode_run is not None:  # how a load decodes a run
            run = memoryview(bytes(payload) * 2)
            halves = [run[: len(payload)], run[len(payload) :]]
            decode_many(halves, np.empty((2, *array.shape), array.dtype), [0, 1])
        if isinstance(codec, lossless.LosslessCodec):
            codec.encode_pieces(array, dtype)  # ColdTier's hand-over of lossless blocks
        if with_fidelity:
            fidelity(array, array, dtype)
    if on_step:
        on_step("multi-threaded builds", len(steps), total)
    if largest_block_bytes is None or largest_block_bytes >= PARALLEL_MIN_BYTES:
        for kernel in Threaded.every:
            kernel.compile_parallel()
    if on_step:
        on_step("done", total, total)
    return time.perf_counter() - start
