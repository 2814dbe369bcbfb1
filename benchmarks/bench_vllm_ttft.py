"""Time to first token on a real vLLM CPU engine: cold prefill vs vLLM's own prefix-cache hit vs
a restore from a tierkv vault, at several prompt lengths, on the tiny random-weight Llama.

The vault runs as a separate `tierkv vault` process on loopback. Blocks are stored with
`store = "on_finish"`, then vLLM's prefix cache is reset, so the next identical prompt can only be
served by the vault. Each figure is the median of --repeats runs (fresh prompts for cold and
restore). The references measured in the same run: a bare client Promote of the same blocks
(what the restore's load could reach if decoding and copying into the paged buffer were free)
and a numpy copy of as many bytes as the restore moves. The load's speed against the Promote,
`load_vs_promote`, is the median of each repeat's own ratio (its Promote follows its load within
a second), which the drift of a shared machine between repeats disturbs less than the ratio of
the two medians. With --json, one JSON object per length (tokens, cold_ms, prefix_hit_ms,
restore_ms, load_ms, restored_bytes, promote_gbps, load_gbps, load_vs_promote, memcpy_gbps) is
printed per line instead of the table; each also gives its block_size (vLLM CPU's default, 128,
unless --block-size says otherwise: smaller blocks mean more per-block work for the same bytes).

    .venv/bin/python benchmarks/bench_vllm_ttft.py --tokens 2048 30000 [--json] [--block-size 32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tierkv.patches.vllm import kv_transfer_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import MAX_POSITIONS, build_tiny_llama

VLLM_CPU_BLOCK = 128
"""vLLM CPU's block size when none is given (the engine's default, and this benchmark's)."""
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2  # layers × (K, V) × heads × head dim × bf16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_vault(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    from tierkv.backends.vault import VaultClient

    port = free_port()
    config = work / "vault.toml"
    config.write_text("")
    command = [sys.executable, "-m", "tierkv", "vault", "--config", str(config)]
    command += ["--listen", f"127.0.0.1:{port}", "--max-bytes", "8GiB"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    client = VaultClient(address)
    ready = client.wait_ready(60)
    client.close()
    if not ready:
        process.kill()
        raise RuntimeError("the vault did not start")
    return process, address


def memcpy_seconds(nbytes: int) -> float:
    """The reference: one numpy copy of `nbytes` (best of 5)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return best


def print_table(console: Console, codec: str, block: int, rows: list[dict[str, float]]) -> None:
    table = Table(title=f"TTFT, tiny Llama on vLLM CPU, codec {codec}, {block}-token blocks")
    columns = ("tokens", "cold ms", "prefix hit ms", "vault restore ms", "of which load ms")
    columns += ("cold / restore", "restore / prefix hit", "restored MB", "load GB/s")
    columns += ("promote GB/s", "load / promote", "memcpy GB/s")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["tokens"]),
            f"{row['cold_ms']:.1f}",
            f"{row['prefix_hit_ms']:.1f}",
            f"{row['restore_ms']:.1f}",
            f"{row['load_ms']:.1f}",
            f"{row['cold_ms'] / row['restore_ms']:.2f}x",
            f"{row['restore_ms'] / row['prefix_hit_ms']:.2f}x",
            f"{row['restored_bytes'] / 1e6:.1f}",
            f"{row['load_gbps']:.2f}",
            f"{row['promote_gbps']:.2f}",
            f"{row['load_vs_promote']:.2f}x",
            f"{row['memcpy_gbps']:.2f}",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 30000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--block-size",
        type=int,
        default=VLLM_CPU_BLOCK,
        help="tokens per vLLM block (a multiple of 32; smaller blocks: more per-block work)",
    )
    parser.add_argument("--codec", default="none", help="tierkv codec (none, int8, tq4, ...)")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    args = parser.parse_args()
    if max(args.tokens) >= MAX_POSITIONS:
        parser.error(f"--tokens must stay under the tiny model's {MAX_POSITIONS} positions")
    if args.block_size <= 0 or args.block_size % 32:
        parser.error(f"--block-size {args.block_size}: vLLM CPU needs a multiple of 32")
    block = args.block_size

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from tierkv.backends.vault import VaultClient
    from tierkv.keys import chain_block_keys

    console = Console(width=160)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "llama")
        vault, address = start_vault(work)
        try:
            extra: dict[str, object] = {"cluster.kv_cold": address, "connector.store": "on_finish"}
            if args.codec != "none":
                extra |= {"compression.enabled": True, "compression.codec": args.codec}
                extra |= {"compression.group_size": 64}
            max_len = max(args.tokens) + 16
            llm = LLM(
                model=str(model),
                dtype="bfloat16",
                block_size=block,
                max_model_len=max_len,
                enable_prefix_caching=True,
                enforce_eager=True,
                kv_cache_memory_bytes=2 * max_len * KV_BYTES_PER_TOKEN,
                kv_transfer_config=KVTransferConfig(**kv_transfer_config(extra)),
            )
            worker = get_kv_transfer_group()
            one_token = SamplingParams(max_tokens=1, temperature=0)

            def ttft(tokens: list[int]) -> float:
                started = time.perf_counter()
                llm.generate([TokensPrompt(prompt_token_ids=tokens)], one_token, use_tqdm=False)
                return time.perf_counter() - started

            def prompt(length: int) -> list[int]:
                rng = random.Random()
                return [rng.randrange(2, 500) for _ in range(length)]

            ttft(prompt(64))  # warm up the engine
            bare = VaultClient(address)
            plan = next(iter(worker.worker_side.plans.values()))

            def promote_seconds(tokens: list[int], blocks: int) -> float:
                """A bare Promote of the blocks the restore loaded, on a warm connection, timed
                like the load: once per repeat (the median across repeats is reported)."""
                keys = chain_block_keys(tokens, block)[:blocks]
                bare.promote(plan.namespaces[0], keys[:1], list(plan.parts))
                started = time.perf_counter()
                found = bare.promote(plan.namespaces[0], keys, list(plan.parts))
                seconds = time.perf_counter() - started
                assert len(found) == blocks * len(plan.parts), "the vault lost blocks"
                return seconds

            rows = []
            for length in args.tokens:
                cold, hit, restore, load, promote = [], [], [], [], []
                for _ in range(args.repeats):
                    tokens = prompt(length)
                    cold.append(ttft(tokens))
                    ttft(prompt(8))  # one more step: the finished prompt's blocks are copied out
                    assert worker.tier.flush(timeout=60), "the vault did not acknowledge"
                    hit.append(ttft(tokens))  # (after the stores, which would slow it down)
                    llm.reset_prefix_cache()
                    counters = worker.worker_side.stats.data
                    loaded_before, load_before = counters["loaded_blocks"], counters["load_seconds"]
                    restore.append(ttft(tokens))
                    load.append(counters["load_seconds"] - load_before)
                    loaded = counters["loaded_blocks"] - loaded_before
                    if loaded != (length - 1) // block:
                        console.print(f"[yellow]only {loaded} blocks were restored[/yellow]")
                    promote.append(promote_seconds(tokens, (length - 1) // block))
                moved = (length - 1) // block * block * KV_BYTES_PER_TOKEN
                c, h, r, ld, p = (statistics.median(x) for x in (cold, hit, restore, load, promote))
                row = {
                    "tokens": length,
                    "block_size": block,
                    "cold_ms": round(c * 1e3, 2),
                    "prefix_hit_ms": round(h * 1e3, 2),
                    "restore_ms": round(r * 1e3, 2),
                    "load_ms": round(ld * 1e3, 2),
                    "restored_bytes": moved,
                    "load_gbps": round(moved / ld / 1e9, 3),
                    "promote_gbps": round(moved / p / 1e9, 3),
                    "load_vs_promote": round(
                        statistics.median(
                            promote_s / load_s
                            for load_s, promote_s in zip(load, promote, strict=True)
                        ),
                        3,
                    ),
                    "memcpy_gbps": round(moved / memcpy_seconds(moved) / 1e9, 3),
                }
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
            bare.close()
            if not args.json:
                print_table(console, args.codec, block, rows)
                console.print(f"tier counters: {worker.tier.stats()}")
        finally:
            vault.kill()
            vault.wait()


if __name__ == "__main__":
    main()
