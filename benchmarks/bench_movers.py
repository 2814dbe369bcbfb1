"""A restore's device data path: a Llama-3.1-8B-shaped paged KV through tierkv.movers and a vault.

torch only (no vLLM): builds a paged KV buffer of --tokens tokens on --device (default: cuda when
available) shaped like Llama-3.1-8B (32 layers, 8 KV heads × 128, bf16, 16-token blocks; 30k
tokens are 3.9 GB), stores it through tierkv.movers into a vault on 127.0.0.1 in engine steps of
--step-tokens and restores it, for each --codec, with host decode (Numba) and device decode
(tierkv.quant.torch_batch, batched). Prints per codec and decode: the engine-thread time of the
store per step (the gather and hand-over a worker does inside vLLM's step; on CUDA the copy to
the host is asynchronous; what does not fit in the free staging is dropped, as the worker does,
and stored after the steps) beside one copy of a step's bytes on the device, restore wall time
and GB/s of the restored bf16 bytes, a bare client Promote of the same blocks and the decode
alone (device decode: batched, beside the per-payload torch_ops decode it replaced), each
measured in the same run, and the device's memcpy GB/s (a tensor copy on the device). Figures
on a shared machine are noisy; read the ratios.

    python benchmarks/bench_movers.py                       # 30k tokens, 3.9 GB
    python benchmarks/bench_movers.py --tokens 256 --layers 2 --json   # seconds, on a CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vault import running_vault

from tierkv.backends.vault import VaultClient
from tierkv.load import Consume
from tierkv.movers import BlockMover, StagingRing, hand_over
from tierkv.quant import decode_into, get_codec, torch_ops
from tierkv.quant import warmup as warmup_codecs
from tierkv.quant.torch_batch import Received, decode_batch
from tierkv.sizes import format_size, parse_size
from tierkv.tier import ColdTier
from tierkv.transfer import Into


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memcpy_gbps(device: torch.device, nbytes: int) -> float:
    """A copy of `nbytes` within the device (best of 5)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def paged_kv(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """Per layer [K|V, blocks, block tokens, KV heads, head dim], bf16 (vLLM's flash layout)."""
    blocks = -(-args.tokens // args.block)
    shape = (2, blocks, args.block, args.kv_heads, args.head_dim)
    generator = torch.Generator(device=device).manual_seed(0)
    return [
        torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        for _ in range(args.layers)
    ]


def store_all(
    tier: ColdTier, mover: BlockMover, namespace: bytes, keys: list[bytes], step_blocks: int
) -> tuple[list[float], float, int]:
    """Store every block in engine steps: (engine-thread seconds per step, wall seconds until the
    vault acknowledged all, blocks the steps dropped).

    A step does what the vLLM worker's store step does: it stages what fits in the free staging
    now and drops the rest, never waiting. The benchmark wants every block stored, so the
    dropped ones are stored after the steps, waiting for staging space (not timed as steps)."""
    handoff = ThreadPoolExecutor(1, thread_name_prefix="bench-handoff")
    per_step: list[float] = []
    dropped: list[int] = []

    def send(index: int, part: int, array: np.ndarray, dtype: str, on_done: Callable[[], None]):
        tier.store(namespace, keys[index], part, array, dtype, on_done=on_done)

    def stage(ids: list[int]) -> None:
        staged = mover.store(ids)
        assert staged is not None
        sender = functools.partial(_send_as, ids, send)
        if staged.done():
            hand_over(staged, mover.codec_dtypes, sender)
        else:
            handoff.submit(hand_over, staged, mover.codec_dtypes, sender)

    started = time.perf_counter()
    for start in range(0, len(keys), step_blocks):
        ids = list(range(start, min(start + step_blocks, len(keys))))
        step_started = time.perf_counter()
        fit = mover.fitting(len(ids), mover.store_ring)
        if fit:
            stage(ids[:fit])
        dropped.extend(ids[fit:])
        per_step.append(time.perf_counter() - step_started)
    for start in range(0, len(dropped), step_blocks):
        ids = dropped[start : start + step_blocks]
        while mover.fitting(len(ids), mover.store_ring) < len(ids):
            time.sleep(0.001)
        stage(ids)
    handoff.shutdown(wait=True)
    if not tier.flush(timeout=600):
        raise AssertionError(f"the vault did not acknowledge every block: {tier.stats()}")
    return per_step, time.perf_counter() - started, len(dropped)


def _send_as(
    ids: list[int],
    send: Callable[[int, int, np.ndarray, str, Callable[[], None]], None],
    index: int,
    part: int,
    array: np.ndarray,
    dtype: str,
    on_done: Callable[[], None],
) -> None:
    """hand_over's send for staged slot `index`, which holds block ids[index]."""
    send(ids[index], part, array, dtype, on_done)


def step_copy_s(device: torch.device, nbytes: int) -> float:
    """The same-run reference of a store step: one copy of its raw bytes on the device (median
    of 5)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def restore_all(
    tier: ColdTier,
    mover: BlockMover,
    namespace: bytes,
    keys: list[bytes],
    batch_blocks: int,
    on_device: bool,
) -> tuple[float, set[int]]:
    def fetch(start: int, stop: int, consume: Consume, into: Into | None) -> set[int]:
        return tier.load_blocks(namespace, keys[start:stop], {"kv": [0]}, consume, into)

    synchronize(mover.device)
    started = time.perf_counter()
    failed = mover.load(
        list(range(len(keys))), fetch, batch_blocks=batch_blocks, on_device=on_device
    )
    synchronize(mover.device)
    return time.perf_counter() - started, failed


def promote_and_decode(
    address: str, namespace: bytes, keys: list[bytes], mover: BlockMover, batch_blocks: int
) -> tuple[float, int, float, float, float]:
    """(bare Promote seconds (median of 3), payload bytes, host decode s, per-payload device
    decode s, batched device decode s) of every block. The per-payload decode is the device
    path before the batched one: one torch_ops.decode_into per payload; the batched one copies
    each batch's payloads into one (pinned) host buffer and runs torch_batch.decode_batch."""
    with VaultClient(address) as client:
        client.promote(namespace, keys[:1], [0])  # a warm connection, as the tier has
        times = []
        for _ in range(3):
            started = time.perf_counter()
            found = client.promote(namespace, keys, [0])
            times.append(time.perf_counter() - started)
        promote_s = statistics.median(times)
    payloads = [found[(index, 0)] for index in range(len(keys))]
    host = mover.staging(1)
    out = host.arrays()[0][0]
    started = time.perf_counter()
    for payload in payloads:
        decode_into(payload, out)
    host_s = time.perf_counter() - started
    host.release()
    device_out = mover.staging(1, on_device=True).tensors[0][0]
    device_out.zero_()  # both decodes write into touched memory (not first-touch page faults)
    synchronize(mover.device)
    started = time.perf_counter()
    for payload in payloads:
        torch_ops.decode_into(payload, device_out)
    synchronize(mover.device)
    per_payload_s = time.perf_counter() - started
    batch = mover.staging(min(batch_blocks, len(payloads)), on_device=True).tensors[0]
    batch.zero_()
    memory = mover.received_memory()[0]
    synchronize(mover.device)
    started = time.perf_counter()
    for start in range(0, len(payloads), len(batch)):
        chunk = payloads[start : start + len(batch)]
        received = Received(len(batch), memory)
        for index, payload in enumerate(chunk):
            assert received.add(index, payload)
        failed, unhandled = decode_batch(received, batch)
        assert not failed and not unhandled
        synchronize(mover.device)  # before the next batch reuses (CPU) or replaces the buffer
    batched_s = time.perf_counter() - started
    return promote_s, sum(map(len, payloads)), host_s, per_payload_s, batched_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=30000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--codec", nargs="+", default=["none", "int8", "tq4"])
    parser.add_argument(
        "--decode", nargs="+", choices=("host", "device"), default=["host", "device"]
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=16, help="tokens per block")
    parser.add_argument("--step-tokens", type=int, default=2048, help="tokens stored per step")
    parser.add_argument("--staging", default="1GiB", help="bytes of each staging ring")
    parser.add_argument("--in-process", action="store_true", help="vault in this process")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    args = parser.parse_args()
    try:
        device = torch.device(args.device)
        staging = parse_size(args.staging)
        for name in args.codec:
            get_codec(name, args.head_dim)
    except (ValueError, RuntimeError) as exc:
        parser.error(str(exc))
    if args.tokens < args.block:
        parser.error(f"--tokens must be at least one block ({args.block})")

    console = Console(width=160)
    warmup_codecs()
    layers = paged_kv(args, device)
    reference = [layer.clone() for layer in layers]
    pin = device.type == "cuda"
    mover = BlockMover(
        [[(layer, 1) for layer in layers]],
        StagingRing(staging, pin=pin),
        StagingRing(staging, pin=pin),
    )
    num_blocks = layers[0].shape[1]
    raw_bytes = num_blocks * mover.block_bytes
    if mover.region_bytes(1) * 2 > staging:
        parser.error(
            f"--staging {args.staging} holds less than two blocks of {mover.block_bytes} bytes"
        )
    memcpy = memcpy_gbps(device, min(max(raw_bytes, 64 << 20), 1 << 30))
    step_blocks = max(1, args.step_tokens // args.block)
    step_copy = step_copy_s(device, min(step_blocks, num_blocks) * mover.block_bytes)
    batch_blocks = max(1, staging // 2 // mover.block_bytes)
    rows = []
    with running_vault(args.in_process, False) as (address, _):
        for codec_name in args.codec:
            codec = get_codec(codec_name, args.head_dim)
            namespace = codec_name.encode().ljust(16, b"-")
            keys = [index.to_bytes(16, "big") for index in range(num_blocks)]
            # The put queue holds every staged block: a lossless block stays in staging until its
            # put is answered, and a queue smaller than the ring would drop the blocks a fast
            # device hands over faster than the vault takes them (the benchmark wants them all).
            client = VaultClient(address, max_pending_bytes=staging)
            tier = ColdTier(codec, {"kv": client}, max_pending_encode_bytes=staging)
            try:
                per_step, store_s, dropped = store_all(tier, mover, namespace, keys, step_blocks)
                promote_s, payload_bytes, host_decode_s, per_payload_s, device_decode_s = (
                    promote_and_decode(address, namespace, keys, mover, batch_blocks)
                )
                for decode in args.decode:
                    for layer in layers:
                        layer.zero_()
                    restore_s, failed = restore_all(
                        tier, mover, namespace, keys, batch_blocks, decode == "device"
                    )
                    assert not failed, f"{len(failed)} blocks failed to restore"
                    cosine = min(
                        torch.nn.functional.cosine_similarity(
                            layer.double().flatten(), ref.double().flatten(), dim=0
                        ).item()
                        for layer, ref in zip(layers, reference, strict=True)
                    )
                    exact = all(
                        torch.equal(layer, ref)
                        for layer, ref in zip(layers, reference, strict=True)
                    )
                    decode_s = device_decode_s if decode == "device" else host_decode_s
                    row = {
                        "device": str(device),
                        "tokens": args.tokens,
                        "codec": codec_name,
                        "decode": decode,
                        "raw_bytes": raw_bytes,
                        "payload_bytes": payload_bytes,
                        "store_step_ms_median": round(statistics.median(per_step) * 1e3, 3),
                        "store_step_ms_max": round(max(per_step) * 1e3, 3),
                        "store_steps": len(per_step),
                        "store_step_dropped_blocks": dropped,
                        "step_copy_ms": round(step_copy * 1e3, 3),
                        "store_s": round(store_s, 4),
                        "restore_s": round(restore_s, 4),
                        "restore_gbps": round(raw_bytes / restore_s / 1e9, 3),
                        "promote_s": round(promote_s, 4),
                        "restore_over_promote": round(restore_s / promote_s, 3),
                        "decode_gbps": round(raw_bytes / decode_s / 1e9, 3),
                        "memcpy_gbps": round(memcpy, 3),
                        "decode_over_memcpy": round(raw_bytes / decode_s / 1e9 / memcpy, 4),
                        "per_payload_device_decode_gbps": round(raw_bytes / per_payload_s / 1e9, 3),
                        "batched_over_per_payload": round(per_payload_s / device_decode_s, 2),
                        "min_cosine": round(cosine, 5),
                        "exact": exact,
                    }
                    assert exact or codec_name != "none", "a lossless restore changed the KV"
                    rows.append(row)
                    if args.json:
                        print(json.dumps(row), flush=True)
            finally:
                tier.close()
    if not args.json:
        print_table(console, args, device, raw_bytes, rows)


def print_table(
    console: Console,
    args: argparse.Namespace,
    device: torch.device,
    raw_bytes: int,
    rows: list[dict[str, Any]],
) -> None:
    title = (
        f"tierkv.movers on {device}: {args.tokens} tokens, {args.layers} layers × "
        f"{args.kv_heads} KV heads × {args.head_dim}, bf16, {args.block}-token blocks "
        f"({format_size(raw_bytes)})"
    )
    table = Table(title=title)
    columns = ("codec", "decode", "store ms/step (median, max; step copy)", "dropped")
    columns += ("restore s", "restore GB/s")
    columns += ("promote s", "restore / promote", "decode GB/s", "decode / memcpy")
    columns += ("batched / per payload", "memcpy GB/s", "min cosine")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["codec"],
            row["decode"],
            f"{row['store_step_ms_median']:.2f}, {row['store_step_ms_max']:.2f}; "
            f"{row['step_copy_ms']:.2f}",
            str(row["store_step_dropped_blocks"]),
            f"{row['restore_s']:.3f}",
            f"{row['restore_gbps']:.2f}",
            f"{row['promote_s']:.3f}",
            f"{row['restore_over_promote']:.2f}x",
            f"{row['decode_gbps']:.2f}",
            f"{row['decode_over_memcpy']:.3f}x",
            f"{row['batched_over_per_payload']:.1f}x",
            f"{row['memcpy_gbps']:.2f}",
            f"{row['min_cosine']:.4f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
