"""benchmarks/bench_movers.py runs on a machine without vLLM (here: with vLLM's import blocked)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_movers.py"
NO_VLLM = (
    "import runpy, sys; sys.modules['vllm'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_device_benchmark_runs_without_vllm_and_restores_every_block():
    command = [sys.executable, "-c", NO_VLLM, str(SCRIPT), "--tokens", "48", "--layers", "2"]
    command += ["--kv-heads", "2", "--codec", "none", "int8", "--in-process", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(row["codec"], row["decode"]) for row in rows] == [
        ("none", "host"), ("none", "device"), ("int8", "host"), ("int8", "device")
    ]  # fmt: skip
    for row in rows:
        assert row["raw_bytes"] == 3 * 2 * 2 * 16 * 2 * 128 * 2  # blocks × layers × K|V × ...
        for field in ("store_step_ms_median", "restore_gbps", "promote_s", "memcpy_gbps"):
            assert row[field] > 0
        assert row["exact"] if row["codec"] == "none" else row["min_cosine"] > 0.99


def test_device_benchmark_rejects_an_unknown_codec():
    command = [sys.executable, str(SCRIPT), "--tokens", "48", "--codec", "zip"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "zip" in result.stderr


def test_device_benchmark_keeps_every_block_of_a_staging_ring_larger_than_the_put_queue():
    """A lossless block stays in staging until its put is answered: with a ring larger than the
    client's default put queue (256 MiB) a fast hand-over overflowed the queue, which dropped
    blocks, and the run ended "the vault did not acknowledge every block" (seen on CUDA)."""
    command = [sys.executable, "-c", NO_VLLM, str(SCRIPT), "--tokens", "32768", "--layers", "4"]
    command += ["--codec", "none", "--decode", "host", "--staging", "512MiB", "--in-process"]
    command += ["--device", "cpu", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert row["raw_bytes"] == 512 << 20 and row["exact"]
