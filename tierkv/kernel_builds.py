"""Which build of the codec kernels a process runs: "native" (this CPU's every feature) or
"haswell" (AVX2, FMA and F16C), chosen by measurement.

Numba compiles a process's kernels for one CPU (NUMBA_CPU_NAME, see kernels.pin_features), so
the build is chosen before the kernels load, for the codec the process stores with: a child
process per build times that codec's encode and decode of a short sample and the faster build
is kept, on disk beside Numba's cache (`choices_path`), keyed by the CPU, its features and the
versions of Python, Numba, llvmlite and tierkv, so each machine measures once (the children's
kernels land in Numba's cache too). NUMBA_CPU_NAME set by hand forces a build.

`choose(codec)` returns the Choice; `with_build(env, choice)` the environment a process is to
start with, `apply(choice)` sets this one's. This module loads no kernel (importing tierkv.quant
would load them for the build in force): the timing child is tierkv/quant/build_timing.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

BUILDS = ("native", "haswell")
HASWELL_FEATURES = ("avx2", "fma", "f16c")
"""What a haswell build needs of the CPU."""
CHOICES_FILE = "tierkv-kernel-builds.json"
LOSSLESS = "none"
"""The lossless codec: a checked copy, bound by memory on either build (never measured)."""
CHILD_TIMEOUT_S = 600.0
"""A timing child compiles its build's kernels first (or loads them from Numba's cache)."""


@dataclass(frozen=True)
class Choice:
    """The build to run and how it was chosen: "forced" (NUMBA_CPU_NAME), "cached", "measured",
    "only one" (the CPU runs no other), or why nothing was measured; `seconds` per build timed
    (empty unless measured or cached)."""

    build: str
    how: str
    seconds: Mapping[str, float]

    def __str__(self) -> str:
        timed = ", ".join(f"{build} {s * 1e3:.1f} ms" for build, s in self.seconds.items())
        return f"{self.build} ({self.how}{': ' + timed if timed else ''})"


def runnable_builds() -> tuple[str, ...]:
    """The builds this CPU runs: native, and haswell on an x86 CPU with its features."""
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    if platform.machine().lower() in ("x86_64", "amd64") and all(
        features.get(name) for name in HASWELL_FEATURES
    ):
        return BUILDS
    return BUILDS[:1]


def machine_key() -> str:
    """The CPU, its features and the versions a measurement holds for."""
    import llvmlite
    import numba
    from llvmlite import binding

    import tierkv

    features = ",".join(sorted(f for f, on in binding.get_host_cpu_features().items() if on))
    digest = hashlib.sha256(features.encode()).hexdigest()[:16]
    return (
        f"{binding.get_host_cpu_name()} {digest} python {sys.version_info[0]}.{sys.version_info[1]}"
        f" numba {numba.__version__} llvmlite {llvmlite.__version__} tierkv {tierkv.__version__}"
    )


def choices_path() -> Path:
    """Where measured choices are kept: Numba's cache directory (NUMBA_CACHE_DIR), else the
    __pycache__ beside the kernels, where Numba caches them."""
    from numba.core import config

    kernels = Path(__file__).parent / "quant" / "__pycache__"
    return Path(config.CACHE_DIR or kernels) / CHOICES_FILE


def _read_choices(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def time_build(codec: str, build: str) -> float:
    """Seconds of `codec`'s encode and decode of the sample in a child running `build`."""
    env = with_build(os.environ, build)
    done = subprocess.run(
        [sys.executable, "-m", "tierkv.quant.build_timing", codec],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    if done.returncode:
        raise RuntimeError(f"timing the {build} build of {codec} failed: {done.stderr[-500:]}")
    return float(done.stdout.split()[-1])


def choose(codec: str, *, measure: bool = True) -> Choice:
    """The build for a process storing with `codec`: forced by NUMBA_CPU_NAME, else the cached
    measurement for this machine, else measured now (and cached) unless not `measure`."""
    forced = os.environ.get("NUMBA_CPU_NAME")
    if forced:
        return Choice(forced, "forced", {})
    builds = runnable_builds()
    if len(builds) == 1:
        return Choice(builds[0], "only one", {})
    if codec == LOSSLESS:
        return Choice("native", "lossless: a copy, as fast in either", {})
    path = choices_path()
    choices = _read_choices(path)
    key = machine_key()
    seconds = choices.get(key, {}).get(codec)
    how = "cached"
    if not seconds or set(seconds) != set(builds):
        if not measure:
            return Choice("native", "not measured", {})
        try:
            seconds = {build: time_build(codec, build) for build in builds}
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            return Choice("native", f"not measured: {exc}", {})
        choices.setdefault(key, {})[codec] = seconds
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(choices, indent=1))
        except OSError:
            pass  # measured again next time
        how = "measured"
    return Choice(min(seconds, key=seconds.__getitem__), how, seconds)


def with_build(env: Mapping[str, str], build: str | Choice) -> dict[str, str]:
    """`env` for a process that is to run `build` (it takes effect when its kernels load)."""
    name = build.build if isinstance(build, Choice) else build
    found = dict(env)
    found.pop("NUMBA_CPU_FEATURES", None)
    if name == "native":
        found.pop("NUMBA_CPU_NAME", None)
    else:
        found["NUMBA_CPU_NAME"] = name
    return found


def apply(choice: Choice) -> bool:
    """Run `choice` in this process: its environment set for the kernels, when they have not
    loaded yet; False when they loaded already for another build. Loaded kernels leave the
    environment alone: it would only mislead this process and the processes it starts about
    the build they run (a child is given a build with `with_build`)."""
    if "tierkv.quant.kernels" in sys.modules:
        return (os.environ.get("NUMBA_CPU_NAME") or "native") == choice.build
    wanted = with_build(os.environ, choice)
    for name in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
        if name in wanted:
            os.environ[name] = wanted[name]
        else:
            os.environ.pop(name, None)
    return True
