"""benchmarks/bench_mlx.py runs (a tiny size) and refuses an unknown codec in one line."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_mlx.py"


def test_mlx_benchmark_prints_numba_and_mlx_figures() -> None:
    command = [sys.executable, str(SCRIPT), "--tokens", "256", "--codecs", "int8,tq3.5"]
    command += ["--dtypes", "bf16", "--repeats", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tq3.5" in result.stdout and "MLX / Numba" in result.stdout


def test_mlx_benchmark_rejects_an_unknown_codec() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--codecs", "int8,zip"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "unknown zip" in result.stderr
