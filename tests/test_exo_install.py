"""`tierkv install --exo-path` on fake EXO checkouts: version detection, idempotent install,
byte-identical uninstall, clear refusals."""

from __future__ import annotations

import ast
import json
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from fake_exo.tree import EXO_PYTHON, SITE_PACKAGES, exo_python, make_exo_tree, tree_digest
from helpers import VaultHandle
from typer.testing import CliRunner

import tierkv
from tierkv.cli import app
from tierkv.patches.exo import (
    CACHE_PY,
    PTH_NAME,
    RUNTIME_DIR_NAME,
    ExoLayoutError,
    boot_source,
    detect_version,
    hook_state,
)

# KVPrefixCache shapes of EXO releases, reduced to what detection reads (written for the tests).
V1_0_68 = """
class KVPrefixCache:
    def __init__(self, group): ...
    def add_kv_cache(self, prompt_tokens, cache, ssm_snapshots=None): ...
    def get_kv_cache(self, model, prompt_tokens) -> tuple[list, object, int | None]: ...
    def _evict_if_needed(self): ...
"""
V1_0_70 = V1_0_68.replace(
    "-> tuple[list, object, int | None]", "-> tuple[list, object, int | None, bool]"
)
V1_0_67 = """
class KVPrefixCache:
    def __init__(self, tokenizer): ...
    def add_kv_cache(self, prompt: str, cache): ...
    def get_kv_cache(self, model, prompt: str) -> tuple[list, object, int | None]: ...
    def _evict_if_needed(self): ...
"""
V1_0_65 = """
class KVPrefixCache:
    def __init__(self): ...
    def add_kv_cache(self, prompt, cache): ...
    def get_kv_cache(self, model, prompt): ...
"""


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["install", *args])
    return result.exit_code, result.output


def test_detects_the_supported_kv_prefix_cache_shapes() -> None:
    assert detect_version(V1_0_68) == "v1.0.68-v1.0.69"
    assert detect_version(V1_0_70) == "v1.0.70 or newer"
    assert detect_version(make_exo_tree_source()) == "v1.0.70 or newer"


def make_exo_tree_source() -> str:
    from fake_exo.tree import FIXTURE_SRC

    return (FIXTURE_SRC.parent / CACHE_PY).read_text()


@pytest.mark.parametrize(
    ("source", "named"),
    [
        (V1_0_67, "does not take prompt_tokens"),
        (V1_0_65, "has no _evict_if_needed"),
        ("def nothing(): ...\n", "defines no KVPrefixCache"),
        (V1_0_70.replace(" -> tuple[list, object, int | None, bool]", ""), "no annotation"),
        ("class KVPrefixCache(:\n", "does not parse"),
    ],
)
def test_refuses_other_shapes_and_names_the_needed_version(source: str, named: str) -> None:
    with pytest.raises(ExoLayoutError, match=r"v1\.0\.68") as caught:
        detect_version(source)
    assert named in str(caught.value)


def test_install_is_idempotent_and_uninstall_restores_every_byte(tmp_path: Path) -> None:
    root = make_exo_tree(tmp_path / "exo")
    before = tree_digest(root)

    code, out = invoke("--exo-path", str(root), "--no-runtime")
    assert code == 0, out
    assert "installed for EXO v1.0.70 or newer" in out
    pth = root / SITE_PACKAGES / PTH_NAME
    runtime = root / ".venv" / RUNTIME_DIR_NAME
    assert pth.read_text().splitlines() == [
        str(runtime.resolve()),
        str(runtime.resolve() / "lib"),
        "import tierkv_exo_boot; tierkv_exo_boot.arm()",
    ]
    assert (runtime / "tierkv_exo_boot.py").read_text() == boot_source()
    assert hook_state(root).installed
    installed = tree_digest(root)
    assert {p for p in installed if p not in before} == {
        str(SITE_PACKAGES / PTH_NAME),
        f".venv/{RUNTIME_DIR_NAME}",
        f".venv/{RUNTIME_DIR_NAME}/tierkv_exo_boot.py",
    }
    assert all(installed[p] == digest for p, digest in before.items())

    code, out = invoke("--exo-path", str(root), "--no-runtime")
    assert code == 0, out
    assert "already installed" in out
    assert tree_digest(root) == installed

    code, out = invoke("--exo-path", str(root), "--uninstall")
    assert code == 0, out
    assert tree_digest(root) == before
    assert not hook_state(root).installed

    code, out = invoke("--exo-path", str(root), "--uninstall")
    assert code == 0, out
    assert "Nothing to remove" in out


def test_refuses_an_unsupported_checkout_without_touching_it(tmp_path: Path) -> None:
    root = make_exo_tree(tmp_path / "exo")
    (root / CACHE_PY).write_text(V1_0_67)
    before = tree_digest(root)
    code, out = invoke("--exo-path", str(root), "--no-runtime")
    assert code == 1
    assert "does not take prompt_tokens" in out and "v1.0.68 or newer" in out
    assert tree_digest(root) == before


def test_refuses_a_directory_that_is_not_exo(tmp_path: Path) -> None:
    code, out = invoke("--exo-path", str(tmp_path), "--no-runtime")
    assert code == 1
    assert "cache.py not found" in out and "is not an EXO checkout" in out


def test_reports_a_missing_venv_and_still_uninstalls_without_it(tmp_path: Path) -> None:
    root = make_exo_tree(tmp_path / "exo", venv_kind="none")
    code, out = invoke("--exo-path", str(root), "--no-runtime")
    assert code == 1
    assert ".venv is missing" in out and "uv sync" in out
    assert "missing" in hook_state(root).detail

    root = make_exo_tree(tmp_path / "exo2")
    assert invoke("--exo-path", str(root), "--no-runtime")[0] == 0
    (root / ".venv/pyvenv.cfg").unlink()
    assert not hook_state(root).installed
    code, out = invoke("--exo-path", str(root), "--uninstall")
    assert code == 0, out
    assert not (root / SITE_PACKAGES / PTH_NAME).exists()
    assert not (root / ".venv" / RUNTIME_DIR_NAME).exists()


def make_wheel(directory: Path) -> Path:
    """A one-module pure-Python wheel, installable without an index."""
    wheel = directory / "tierkv_probe-0.1-py3-none-any.whl"
    info = "tierkv_probe-0.1.dist-info"
    files = {
        "tierkv_probe.py": "ANSWER = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: tierkv-probe\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, "RECORD"]))
    return wheel


def test_installs_the_runtime_packages_for_exos_python_and_removes_them(tmp_path: Path) -> None:
    """Into a venv of EXO's Python 3.13 where there is one (else the running interpreter's)."""
    root = make_exo_tree(tmp_path / "exo", venv_kind="real")
    before = tree_digest(root)
    wheel = make_wheel(tmp_path)
    code, out = invoke("--exo-path", str(root), "--runtime-requirement", str(wheel))
    assert code == 0, out
    lib = root / ".venv" / RUNTIME_DIR_NAME / "lib"
    assert (lib / "tierkv_probe.py").read_text() == "ANSWER = 42\n"
    probe = [
        str(root / ".venv/bin/python"),
        "-c",
        "import tierkv_probe; print(tierkv_probe.ANSWER)",
    ]
    done = subprocess.run(probe, capture_output=True, text=True, check=True, cwd=tmp_path)
    assert done.stdout == "42\n"  # EXO's Python finds the runtime packages
    assert invoke("--exo-path", str(root), "--uninstall")[0] == 0
    assert tree_digest(root) == before


def test_a_failed_runtime_install_leaves_nothing_behind(tmp_path: Path) -> None:
    root = make_exo_tree(tmp_path / "exo", venv_kind="real")
    before = tree_digest(root)
    missing = tmp_path / "no-such-project"
    code, out = invoke("--exo-path", str(root), "--runtime-requirement", str(missing))
    assert code == 1
    assert "failed" in out and "no-such-project" in out
    assert tree_digest(root) == before


def test_exos_python_starts_with_the_hook_armed_until_uninstalled(tmp_path: Path) -> None:
    """A venv of the running interpreter (its packages stand in for the runtime); on Python
    3.13 (.ci/run's 3.13 step) that is EXO's own version."""
    root = make_exo_tree(tmp_path / "exo", venv_kind="real", python=Path(sys.executable))
    assert invoke("--exo-path", str(root), "--no-runtime")[0] == 0
    # tierkv and mlx come from this venv (what `--runtime` would install into the hook's dir).
    paths = [str(Path(tierkv.__file__).parent.parent), *site.getsitepackages()]
    env = {k: v for k, v in os.environ.items() if k != "TIERKV_DISABLE"}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    patched = (
        "import exo.worker.engines.mlx.cache as cache, exo.worker.runner.bootstrap as boot;"
        "print(hasattr(cache.KVPrefixCache, '__tierkv_patched__'),"
        " hasattr(boot.entrypoint, '__tierkv_patched__'))"
    )
    armed = (
        "import sys; print('tierkv_exo_boot' in sys.modules,"
        " any(type(f).__name__ == 'HookFinder' for f in sys.meta_path))"
    )

    def run(code: str, **extra_env: str) -> str:
        done = subprocess.run(
            [str(root / ".venv/bin/python"), "-c", code],
            env={**env, **extra_env},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return done.stdout.strip()

    assert run(patched) == "True True"
    assert run(armed, TIERKV_DISABLE="1") == "True False"
    assert invoke("--exo-path", str(root), "--uninstall")[0] == 0
    assert run(armed) == "False False"


def test_install_gives_a_python_3_13_exo_venv_a_working_tierkv(tmp_path: Path) -> None:
    """EXO runs Python 3.13: `tierkv install` builds this checkout and its dependencies for that
    interpreter into the hook's directory (pip, with whatever index or cache pip is configured
    with), and EXO's Python then imports them, the boot module armed, on its own sys.path."""
    python = exo_python()
    if python is None:
        pytest.skip(
            f"no Python {EXO_PYTHON} (EXO's) here: pyenv's versions/{EXO_PYTHON}*, "
            f"python{EXO_PYTHON} on PATH; the other install tests used a Python "
            f"{sys.version_info.major}.{sys.version_info.minor} stand-in venv"
        )
    root = make_exo_tree(tmp_path / "exo", venv_kind="real", python=python)
    before = tree_digest(root)
    code, out = invoke("--exo-path", str(root))
    assert code == 0, out
    probe = (
        "import sys, numba, tierkv, tierkv.tier, tierkv.connectors.exo.boot;"
        "print(*sys.version_info[:2], sep='.'); print(tierkv.__file__);"
        "print(any(type(f).__name__ == 'HookFinder' for f in sys.meta_path))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TIERKV_DISABLE")}
    done = subprocess.run(
        [str(root / ".venv/bin/python"), "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    version, where, armed = done.stdout.split()
    assert version == EXO_PYTHON and armed == "True"
    assert Path(where).is_relative_to((root / ".venv" / RUNTIME_DIR_NAME).resolve())
    assert invoke("--exo-path", str(root), "--uninstall")[0] == 0
    assert tree_digest(root) == before


def test_status_shows_whether_the_hook_is_installed(tmp_path: Path, vault: VaultHandle) -> None:
    root = make_exo_tree(tmp_path / "exo")

    def status() -> tuple[int, dict[str, object]]:
        args = ["status", "--vault", vault.address, "--exo-path", str(root), "--json"]
        result = CliRunner().invoke(app, args)
        (row,) = json.loads(result.stdout)["exo"]
        return result.exit_code, row

    code, row = status()
    assert (code, row["up"]) == (1, False)
    assert "not installed" in str(row["reason"])
    assert invoke("--exo-path", str(root), "--no-runtime")[0] == 0
    code, row = status()
    assert (code, row["up"]) == (0, True)
    assert row["detail"] == "installed for EXO v1.0.70 or newer"


REAL_EXO_SRC = os.environ.get("TIERKV_EXO_SRC")


def assert_the_hook_fits(source: str, filename: str) -> None:
    """What the hook relies on, read from a real EXO's cache.py (parsed, not imported): a
    supported release, the hooked methods, the parallel `prompts` / `caches` lists that eviction
    pops and adds append to, the distributed group, and from v1.0.70 on the media regions that
    keep image prompts out."""
    from tierkv.connectors.exo.hook import HOOKED_METHODS

    version = detect_version(source, filename)
    (cls,) = [n for n in ast.parse(source).body if getattr(n, "name", "") == "KVPrefixCache"]
    assert isinstance(cls, ast.ClassDef)
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert set(HOOKED_METHODS) <= methods.keys()
    code = {name: ast.unparse(node) for name, node in methods.items()}
    for attribute in ("self.prompts", "self.caches", "self._group"):
        assert attribute in code["__init__"], attribute
    assert "self.prompts.append(" in code["add_kv_cache"]
    assert "self.caches.append(" in code["add_kv_cache"]
    assert "self._evict_if_needed()" in code["add_kv_cache"]
    assert "self.prompts.pop(" in code["_evict_if_needed"]
    assert "self.caches.pop(" in code["_evict_if_needed"]
    if version == "v1.0.70 or newer":
        assert "self._media_regions" in code["__init__"]
        assert "media_regions" in [arg.arg for arg in methods["get_kv_cache"].args.args]


@pytest.mark.skipif(not REAL_EXO_SRC, reason="TIERKV_EXO_SRC (an EXO checkout) is not set")
def test_the_hook_fits_the_prefix_cache_of_a_real_exo_checkout() -> None:
    """EXO itself needs Python 3.13 and its Rust bindings, so its cache.py is parsed."""
    assert REAL_EXO_SRC is not None
    cache_py = Path(REAL_EXO_SRC) / CACHE_PY
    assert_the_hook_fits(cache_py.read_text(encoding="utf-8"), str(cache_py))


def git_revisions(checkout: Path) -> dict[str, str]:
    """EXO's newest release tag and its main branch in a git checkout, by name -> revision."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    tags = git("tag", "--list", "v[0-9]*.[0-9]*.[0-9]*", "--sort=-v:refname").splitlines()
    main = next((ref for ref in ("main", "origin/main") if git("rev-parse", "--verify", ref)), "")
    return {name: rev for name, rev in (("newest tag", tags[0] if tags else ""), ("main", main))}


@pytest.mark.skipif(not REAL_EXO_SRC, reason="TIERKV_EXO_SRC (an EXO checkout) is not set")
@pytest.mark.parametrize("which", ["newest tag", "main"])
def test_the_hook_fits_exos_newest_tag_and_main(which: str) -> None:
    """With TIERKV_EXO_SRC a git checkout, the same check on the cache.py of its newest release
    tag and of main, whatever is checked out."""
    assert REAL_EXO_SRC is not None
    if not (Path(REAL_EXO_SRC) / ".git").exists():
        pytest.skip(f"TIERKV_EXO_SRC={REAL_EXO_SRC} is not a git checkout")
    revision = git_revisions(Path(REAL_EXO_SRC))[which]
    assert revision, f"no {which} in the EXO checkout {REAL_EXO_SRC}"
    source = subprocess.run(
        ["git", "-C", REAL_EXO_SRC, "show", f"{revision}:{CACHE_PY.as_posix()}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    print(f"EXO {which}: {revision}")
    assert_the_hook_fits(source, f"{revision}:{CACHE_PY}")


class _Installed:
    """A stand-in for an installed tierkv's metadata: only its direct_url.json."""

    def __init__(self, direct_url: dict[str, object] | None) -> None:
        self.direct_url = direct_url

    def read_text(self, name: str) -> str | None:
        wanted = self.direct_url is not None and name == "direct_url.json"
        return json.dumps(self.direct_url) if wanted else None


def test_runtime_outside_a_checkout_comes_from_the_installed_wheel_never_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata

    from tierkv.patches.exo import default_runtime_requirement

    site_dir = tmp_path / "site-packages" / "tierkv"
    site_dir.mkdir(parents=True)
    monkeypatch.setattr(tierkv, "__file__", str(site_dir / "__init__.py"))
    wheel = tmp_path / "dist" / "tierkv-0.2.0-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    installed = _Installed({"url": wheel.as_uri(), "archive_info": {}})
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: installed)
    assert default_runtime_requirement() == str(wheel)

    installed.direct_url = None  # installed by name from an index: we cannot tell which tierkv
    with pytest.raises(ExoLayoutError, match="--runtime-requirement"):
        default_runtime_requirement()
