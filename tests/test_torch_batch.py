"""tierkv.quant.torch_batch: the batched torch decode is the Numba decode, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tierkv.codecs import CODEC_NAMES, PRESETS, SINK_MODES  # noqa: E402
from tierkv.quant import decode_into, get_codec  # noqa: E402
from tierkv.quant.pair import PairCodec  # noqa: E402
from tierkv.quant.torch_batch import HostMemory, Received, decode_batch  # noqa: E402

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def words(block: torch.Tensor) -> np.ndarray:
    """The numpy words the Numba codecs take (bf16 as int16)."""
    return block.view(torch.int16).numpy() if block.dtype == torch.bfloat16 else block.numpy()


def blocks_of(shape: tuple[int, ...], dtype: torch.dtype, n: int) -> list[torch.Tensor]:
    """Blocks like a model's keys: a per-channel offset (what centring removes), and one
    outsized channel (the channel selection of the mixed codecs)."""
    generator = torch.Generator().manual_seed(n)
    offset = torch.linspace(-2, 2, shape[-1])
    out = []
    for _ in range(n):
        x = torch.randn(shape, generator=generator) + offset
        x[..., 3] *= 20
        out.append(x.to(dtype))
    return out


def encode(name: str, block: torch.Tensor, first: bool, d: int) -> bytes:
    codec = get_codec(name, d)
    dtype = DTYPES[block.dtype]
    sinks = (0, 4 if first else 0)  # tokens first, as vLLM's [tokens, heads, head size]
    if isinstance(codec, PairCodec):
        return codec.encode(words(block), dtype, (2, d // 2), sinks)
    if name in SINK_MODES:
        return codec.encode(words(block), dtype, sinks)
    return codec.encode(words(block), dtype)


def numba_and_batched(payloads: list[bytes], shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    reference = torch.empty((len(payloads), *shape), dtype=dtype)
    for slot, payload in zip(reference, payloads, strict=True):
        decode_into(payload, words(slot))
    received = Received(len(payloads), HostMemory(pin=False))
    for index, payload in enumerate(payloads):
        assert received.add(index, payload)
    out = torch.zeros((len(payloads), *shape), dtype=dtype)
    assert decode_batch(received, out) == (set(), set())
    return out, reference


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


PAIRS = ("k8v4", "k4cv4s", *PRESETS)


@pytest.mark.parametrize("name", [*CODEC_NAMES, *PAIRS])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES.values()))
def test_the_batched_decode_is_the_numba_decode_bit_for_bit(name, dtype):
    """Every codec and dtype, the first block with sink tokens (a longer payload of its own
    group), head size 64 (mixed codecs: a power-of-two instance and a mixed one of 48)."""
    shape = (16, 2, 64)
    blocks = blocks_of(shape, dtype, 5)
    payloads = [encode(name, block, i == 0, 64) for i, block in enumerate(blocks)]
    out, reference = numba_and_batched(payloads, shape, dtype)
    assert same_bits(out, reference)


@pytest.mark.parametrize("name", ["int8", "tq3.5", "tq2.5", "tq3c", "kv4"])
def test_the_batched_decode_at_head_size_128(name):
    shape = (16, 4, 128)
    blocks = blocks_of(shape, torch.bfloat16, 3)
    payloads = [encode(name, block, i == 0, 128) for i, block in enumerate(blocks)]
    out, reference = numba_and_batched(payloads, shape, torch.bfloat16)
    assert same_bits(out, reference)


@pytest.mark.parametrize("name", [*CODEC_NAMES, *PAIRS])
def test_the_batched_decode_in_chunks_of_a_payload_is_the_numba_decode(name, monkeypatch):
    """On the CPU a payload larger than a chunk is decoded a few vectors at a time (sink tokens,
    means, channel groups and K/V halves cut across chunks): the same bits."""
    from tierkv.quant import torch_batch

    monkeypatch.setattr(torch_batch, "_CPU_CHUNK", 320)
    shape = (16, 2, 64)
    blocks = blocks_of(shape, torch.float16, 3)
    payloads = [encode(name, block, i == 0, 64) for i, block in enumerate(blocks)]
    out, reference = numba_and_batched(payloads, shape, torch.float16)
    assert same_bits(out, reference)


def test_a_corrupt_payload_fails_alone_and_a_misfit_one_is_refused():
    shape = (16, 2, 64)
    blocks = blocks_of(shape, torch.bfloat16, 4)
    payloads = [bytearray(encode("tq3.5", block, False, 64)) for block in blocks]
    from tierkv.quant.codec import checked_body

    _, body = checked_body(payloads[1])
    payloads[1][len(payloads[1]) - len(body) + 2] ^= 0xFF  # its channel mask no longer fits
    payloads[2] = bytearray(get_codec("int8", 64).encode(np.zeros((4, 64), np.float16), "fp16"))
    received = Received(4, HostMemory(pin=False))
    for index, payload in enumerate(payloads):
        assert received.add(index, payload)
    out = torch.zeros((4, *shape), dtype=torch.bfloat16)
    assert decode_batch(received, out) == ({1, 2}, set())
    assert not out[1].any() and not out[2].any()
    reference = torch.empty(shape, dtype=torch.bfloat16)
    decode_into(bytes(payloads[3]), words(reference))
    assert same_bits(out[3], reference)


def test_a_payload_larger_than_the_received_stride_is_left_to_the_caller():
    received = Received(2, HostMemory(pin=False))
    small = encode("tq4", blocks_of((16, 2, 64), torch.bfloat16, 1)[0], False, 64)
    assert received.add(0, small)
    assert not received.add(1, small * 2)


def test_payloads_received_on_several_threads_at_once_all_land():
    """A restore's runs arrive on several receive threads: the first payloads of a batch raced
    to size its buffer, and one saw the size before the buffer (seen in bench_movers)."""
    import threading

    payload = encode("tq4", blocks_of((16, 2, 64), torch.bfloat16, 1)[0], False, 64)
    for _ in range(20):
        received = Received(8, HostMemory(pin=False))
        start = threading.Barrier(8)
        results: list[bool] = []

        def add(index: int, received=received, start=start, results=results) -> None:
            start.wait()
            results.append(received.add(index, payload))

        threads = [threading.Thread(target=add, args=(index,)) for index in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [True] * 8 and sorted(received.lengths) == list(range(8))


def test_cpu_batches_reuse_one_host_buffer_and_each_decodes_its_own_payloads():
    """On the CPU the batches of a restore are received into one buffer, one after the other
    (a fresh 40 MB buffer per batch faulted every page in again): each decodes its own."""
    shape = (16, 2, 64)
    memory = HostMemory(pin=False)
    buffers = []
    for seed in range(3):
        blocks = blocks_of(shape, torch.bfloat16, 6 - seed)  # the first batch is the largest
        payloads = [encode("int8", block, False, 64) for block in blocks]
        received = Received(len(payloads), memory)
        for index, payload in enumerate(payloads):
            assert received.add(index, payload)
        buffers.append(received.data.data_ptr())
        out = torch.zeros((len(payloads), *shape), dtype=torch.bfloat16)
        assert decode_batch(received, out) == (set(), set())
        for slot, payload in zip(out, payloads, strict=True):
            reference = torch.empty(shape, dtype=torch.bfloat16)
            decode_into(payload, words(reference))
            assert same_bits(slot, reference)
    assert len(set(buffers)) == 1
