"""The CPU the kernels are compiled for: a named CPU gets its own features, not the host's, and
the instruction set reported is what the compiler emitted."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tierkv.quant.kernels import target_name
from tierkv.quant.target import instruction_set

_REPORT = """
import json
from tierkv.quant.kernels import EXPANDS
from tierkv.quant import target
isa = target.instruction_set()
asm = "\\n".join(target._probe.inspect_asm().values())
print(json.dumps({"isa": str(isa), "bits": isa.bits, "expands": EXPANDS, "zmm": "zmm" in asm}))
"""


def compiled_for(cpu: str, cache: Path) -> dict[str, object]:
    """What a fresh process with NUMBA_CPU_NAME=cpu (and no NUMBA_CPU_FEATURES) compiles."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    env.update(NUMBA_CPU_NAME=cpu, NUMBA_CACHE_DIR=str(cache))
    done = subprocess.run(
        [sys.executable, "-c", _REPORT], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_haswell_build_is_avx2_without_512_bit_registers_or_expand(tmp_path: Path) -> None:
    report = compiled_for("haswell", tmp_path)
    assert report["isa"] == "haswell: AVX2 FMA F16C, 256-bit"
    assert report["zmm"] is False
    assert report["expands"] == [False, False]  # no AVX-512 expand / compress paths


def test_this_process_reports_its_own_target() -> None:
    isa = instruction_set()
    assert str(isa).startswith(f"{target_name()}: ")
    assert isa.bits in (128, 256, 512)
    if os.environ.get("NUMBA_CPU_NAME") == "haswell":  # the CI step that builds for AVX2
        assert isa.bits == 256
