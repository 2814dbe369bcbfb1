"""benchmarks/bench_engines.py runs: 2 engine processes, tiny sizes, every tier and reference."""

import json
import subprocess
import sys
from pathlib import Path

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
