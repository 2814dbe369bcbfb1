"""benchmarks/bench_engines.py runs: 2 engine processes, tiny sizes, every tier and reference."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from redis_servers import require_redis

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engines.py"


def test_engines_benchmark_restores_through_every_tier_beside_its_references(tmp_path):
    require_redis()
    command = [sys.executable, str(SCRIPT), "--engines", "2", "--per-engine", "2MiB"]
    command += ["--block", "256KiB", "--dir", str(tmp_path), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["engines"] == 2
    found = {(row["scenario"], row["what"]) for row in report["rows"]}
    references = ["memcpy", "redis MGET", "file bare read", "bare TCP stream"]
    whats = [*references, "vault restore", "file restore", "redis restore"]
    assert found == {(s, w) for s in ("distinct", "shared") for w in whats}
    for row in report["rows"]:
        assert row["gbps"] > 0 and row["slowest_over_fastest"] >= 1
        assert row["client_cpu_s_per_gb"] > 0


def test_engines_benchmark_names_a_bad_codec():
    command = [sys.executable, str(SCRIPT), "--codec", "zip"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "zip" in result.stderr


def test_an_engine_that_fails_ends_the_run_with_its_error_at_once():
    """A failed engine breaks the barrier: the bench stops with that engine's error instead of
    waiting out the barrier's 300 s timeout (and the other engine is not left waiting)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_engines import Engines
    finally:
        sys.path.remove(str(SCRIPT.parent))
    engines = Engines(2, 1024)
    try:
        jobs = [
            {"kind": "restore", "address": "127.0.0.1:1", "codec": "zip", "keys": [], "bytes": 1},
            {"kind": "memcpy", "keys": [], "bytes": 1024},
        ]
        with pytest.raises(SystemExit, match="engine 0: ValueError"):
            engines.run(jobs, None)
    finally:
        engines.close()
    assert not any(process.is_alive() for process in engines.processes)
