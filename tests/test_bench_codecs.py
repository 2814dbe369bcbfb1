"""benchmarks/bench_codecs.py's "runs" decode, ColdTier's way, decodes every block as decode_into
does: payloads back to back, decode_many per task, the ones it leaves decoded one by one."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_codecs import as_dtype, check_cpu, decode_task, load_tasks, split_blocks, synthetic_kv

from tierkv.load import DECODE_TASK_BYTES
from tierkv.quant import decode_into, get_codec


@pytest.mark.parametrize("name", ["none", "int8", "tq4", "tq3.5"])
def test_runs_decode_equals_block_by_block_decode(name: str) -> None:
    codec = get_codec(name, 128)
    blocks = split_blocks(as_dtype(synthetic_kv(1024), "fp16"), 32)  # 64 blocks of 64 KB
    payloads = [codec.encode(block, "fp16") for block in blocks]
    expected = np.empty((len(blocks), *blocks[0].shape), np.float16)
    for payload, out in zip(payloads, expected, strict=True):
        decode_into(payload, out)
    tasks = load_tasks(payloads, DECODE_TASK_BYTES // 8)
    assert len(tasks) > 1
    outs = np.full_like(expected, np.nan)
    for task in tasks:
        decode_task(task, outs)
    assert outs.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()


def test_cpu_flag_takes_haswell_and_refuses_a_name_llvm_does_not_know() -> None:
    check_cpu("haswell")  # AVX2 + FMA + F16C: compiles on any x86 machine
    with pytest.raises(SystemExit, match=r"^--cpu nosuchcpu: LLVM cannot compile"):
        check_cpu("nosuchcpu")
