"""Time to first token on a real vLLM CPU engine: cold prefill vs vLLM's own prefix-cache hit vs
a restore from a tierkv vault, at several prompt lengths, on the tiny random-weight Llama.

The vault runs as a separate `tierkv vault` process on loopback. Blocks are stored with
`store = "on_finish"`, then vLLM's prefix cache is reset, so the next identical prompt can only be
served by the vault. Each figure is the median of --repeats runs (fresh prompts for cold and
restore). The reference measured in the same run is a numpy copy of as many bytes as the restore
moves.

    .venv/bin/python benchmarks/bench_vllm_ttft.py --tokens 2048 30000
"""

from __future__ import annotations

import argparse
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

BLOCK = 32
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2  # layers × (K, V) × heads × head dim × bf16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_vault(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    from tierkv.vault.client import VaultClient

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 30000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--codec", default="none", help="tierkv codec (none, int8, tq4, ...)")
    args = parser.parse_args()
    if max(args.tokens) >= MAX_POSITIONS:
        parser.error(f"--tokens must stay under the tiny model's {MAX_POSITIONS} positions")

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    console = Console(width=160)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "llama")
        vault, address = start_vault(work)
        try:
            extra: dict[str, object] = {"cluster.kv_cold": address, "connector.store": "on_finish"}
            if args.codec != "none":
                extra |= {"turbo_quant.enabled": True, "turbo_quant.codec": args.codec}
                extra |= {"turbo_quant.kv_dim": 64}
            max_len = max(args.tokens) + 16
            llm = LLM(
                model=str(model),
                dtype="bfloat16",
                block_size=BLOCK,
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
            table = Table(title=f"TTFT, tiny Llama on vLLM CPU, codec {args.codec}")
            for column in (
                "tokens",
                "cold ms",
                "prefix hit ms",
                "vault restore ms",
                "of which load ms",
                "cold / restore",
                "restore / prefix hit",
                "restored MB",
                "load GB/s",
                "memcpy GB/s",
            ):
                table.add_column(column, justify="right")
            for length in args.tokens:
                cold, hit, restore, load = [], [], [], []
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
                    if loaded != (length - 1) // BLOCK:
                        console.print(f"[yellow]only {loaded} blocks were restored[/yellow]")
                moved = (length - 1) // BLOCK * BLOCK * KV_BYTES_PER_TOKEN
                c, h, r, ld = (statistics.median(x) for x in (cold, hit, restore, load))
                table.add_row(
                    str(length),
                    f"{c * 1e3:.1f}",
                    f"{h * 1e3:.1f}",
                    f"{r * 1e3:.1f}",
                    f"{ld * 1e3:.1f}",
                    f"{c / r:.2f}x",
                    f"{r / h:.2f}x",
                    f"{moved / 1e6:.1f}",
                    f"{moved / ld / 1e9:.2f}",
                    f"{moved / memcpy_seconds(moved) / 1e9:.2f}",
                )
            console.print(table)
            console.print(f"tier counters: {worker.tier.stats()}")
        finally:
            vault.kill()
            vault.wait()


if __name__ == "__main__":
    main()
