"""The kernels' build is chosen by measurement once per machine, can be forced, and every build
decodes bit-identically."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tierkv import kernel_builds
from tierkv.kernel_builds import Choice, choose, runnable_builds, with_build

needs_two = pytest.mark.skipif(
    len(runnable_builds()) < 2, reason="this CPU runs only the native build"
)

DECODE = """
import hashlib, sys
import numpy as np
from tierkv.quant import decode_into
from tierkv.quant.kernels import target_name
out = np.empty((256, 8, 128), np.float16)
digest = hashlib.sha256()
for path in sys.argv[1:]:
    decode_into(open(path, "rb").read(), out)
    digest.update(out.tobytes())
print(target_name(), digest.hexdigest())
"""


@pytest.fixture
def choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Measured choices kept in a file of this test's own."""
    path = tmp_path / kernel_builds.CHOICES_FILE
    monkeypatch.setattr(kernel_builds, "choices_path", lambda: path)
    monkeypatch.delenv("NUMBA_CPU_NAME", raising=False)
    return path


@needs_two
def test_the_choice_is_measured_once_then_cached(choices: Path) -> None:
    first = choose("int8")
    assert first.how == "measured" and set(first.seconds) == set(runnable_builds())
    assert first.build == min(first.seconds, key=first.seconds.__getitem__)
    kept = json.loads(choices.read_text())
    assert kept[kernel_builds.machine_key()]["int8"] == first.seconds
    again = choose("int8")
    assert again == Choice(first.build, "cached", first.seconds)
    assert choose("tq3", measure=False).how == "not measured"  # another codec: its own


def test_numba_cpu_name_forces_the_build(choices: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    assert choose("int8") == Choice("haswell", "forced", {})
    assert not choices.exists()  # nothing measured


def test_a_build_is_set_in_the_environment_and_native_clears_it() -> None:
    env = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "", "PATH": "/bin"}
    assert with_build(env, "native") == {"PATH": "/bin"}
    assert with_build({"PATH": "/bin"}, Choice("haswell", "cached", {})) == {
        "PATH": "/bin",
        "NUMBA_CPU_NAME": "haswell",
    }


@needs_two
@pytest.mark.parametrize("codec", ["int8", "tq3"])
def test_a_forced_build_decodes_bit_identically_to_the_other(tmp_path: Path, codec: str) -> None:
    from tierkv.quant import encode_block, get_codec

    rng = np.random.default_rng(7)
    paths = []
    for i in range(3):
        block = (rng.standard_normal((256, 8, 128)) * (i + 1)).astype(np.float16)
        paths.append(tmp_path / f"{i}.payload")
        paths[-1].write_bytes(bytes(encode_block(get_codec(codec, 128), block, "fp16")))
    decoded = {}
    for build in runnable_builds():
        done = subprocess.run(
            [sys.executable, "-c", DECODE, *map(str, paths)],
            env=with_build(os.environ, build),
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        target, digest = done.stdout.split()
        assert target == build
        decoded[build] = digest
    assert len(set(decoded.values())) == 1, decoded
    assert all(len(d) == len(hashlib.sha256().hexdigest()) for d in decoded.values())


def test_bench_refuses_a_build_this_cpu_does_not_run() -> None:
    from typer.testing import CliRunner

    from tierkv.cli import app

    result = CliRunner().invoke(app, ["bench", "--cpu", "cortex-a72", "--tokens", "256"])
    assert result.exit_code == 2
    assert "--cpu 'cortex-a72': this CPU runs native" in result.output


def test_lossless_is_never_measured(choices: Path) -> None:
    assert choose("none").build == "native" and not choices.exists()


def test_a_choice_after_the_kernels_loaded_leaves_the_environment_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An in-process bench after the kernels loaded (natively here) cannot switch builds: it
    used to set NUMBA_CPU_NAME anyway, so this process claimed a build it does not run and
    every process it started compiled for that one."""
    import tierkv.quant.kernels  # noqa: F401  (loaded, for the host)

    monkeypatch.delenv("NUMBA_CPU_NAME", raising=False)
    monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)
    assert kernel_builds.apply(kernel_builds.Choice("haswell", "--cpu", {})) is False
    assert "NUMBA_CPU_NAME" not in os.environ and "NUMBA_CPU_FEATURES" not in os.environ
