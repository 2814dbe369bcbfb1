"""Install the tierkv hook into an EXO checkout, detect EXO's version, and uninstall it again.

The install leaves every file of EXO untouched. It adds exactly two things to EXO's venv:
- `<site-packages>/tierkv_exo.pth`: puts the runtime directory on `sys.path` and arms the boot
  module (`tierkv.connectors.exo.boot`) when EXO's Python starts;
- `<venv>/tierkv-runtime/`: the boot module and, unless skipped, tierkv and its dependencies
  installed for EXO's interpreter (`pip --python <EXO's python> install --target`).
Uninstall removes those two and nothing else, so the tree and the venv are byte-identical to
before. A `git pull` in EXO keeps the hook; re-creating EXO's venv drops it (re-run the install).

EXO's version is read by parsing its `cache.py` (never importing it): the hook needs the
token-keyed `KVPrefixCache` of EXO v1.0.68 or newer.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import shutil
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import tierkv
from tierkv.errors import TierKVError

CACHE_PY = Path("src/exo/worker/engines/mlx/cache.py")
BOOTSTRAP_PY = Path("src/exo/worker/runner/bootstrap.py")
PTH_NAME = "tierkv_exo.pth"
RUNTIME_DIR_NAME = "tierkv-runtime"
RUNTIME_LIB_NAME = "lib"
BOOT_MODULE = "tierkv_exo_boot"
REQUIRED_METHODS = ("get_kv_cache", "add_kv_cache", "_evict_if_needed")
NEEDED_VERSION = "EXO v1.0.68 or newer (token-keyed KVPrefixCache with LRU eviction)"


class ExoLayoutError(TierKVError, ValueError):
    """The path is not an EXO checkout tierkv supports, or its venv is missing or unusable."""


class ExoPathError(ExoLayoutError):
    """The path given is not a directory at all (a usage error, not a problem of a checkout)."""


@dataclass(frozen=True)
class ExoLayout:
    """What the install needs to know about one EXO checkout."""

    root: Path
    version: str
    """The EXO releases whose KVPrefixCache shape was found, e.g. "v1.0.70 or newer"."""
    venv: Path
    site_packages: Path
    python: Path

    @property
    def pth_file(self) -> Path:
        return self.site_packages / PTH_NAME

    @property
    def runtime_dir(self) -> Path:
        return self.venv / RUNTIME_DIR_NAME

    def pth_text(self) -> str:
        """The `.pth` content: path lines (`site` adds those that exist to the end of sys.path, so
        EXO's own packages win) for the boot module and the runtime packages, then the import."""
        lib = self.runtime_dir / RUNTIME_LIB_NAME
        return f"{self.runtime_dir}\n{lib}\nimport {BOOT_MODULE}; {BOOT_MODULE}.arm()\n"


@dataclass(frozen=True)
class HookState:
    """Whether the hook is installed in an EXO checkout (for `tierkv status`)."""

    installed: bool
    detail: str


def detect_version(cache_py_source: str, filename: str = str(CACHE_PY)) -> str:
    """The EXO release range whose `KVPrefixCache` the source defines; ExoLayoutError otherwise."""
    try:
        tree = ast.parse(cache_py_source, filename=filename)
    except SyntaxError as exc:
        raise ExoLayoutError(
            f"{filename} does not parse as Python ({exc.msg}, line {exc.lineno}): tierkv needs "
            f"{NEEDED_VERSION}"
        ) from None
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVPrefixCache"]
    if not classes:
        raise ExoLayoutError(f"{filename} defines no KVPrefixCache: tierkv needs {NEEDED_VERSION}")
    methods = {
        n.name: n for n in classes[0].body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    missing = [name for name in REQUIRED_METHODS if name not in methods]
    if missing:
        raise ExoLayoutError(
            f"{filename}: KVPrefixCache has no {', '.join(missing)}: tierkv needs {NEEDED_VERSION}"
        )
    get_kv_cache = methods["get_kv_cache"]
    params = [a.arg for a in get_kv_cache.args.args]
    if params[:3] != ["self", "model", "prompt_tokens"]:
        raise ExoLayoutError(
            f"{filename}: KVPrefixCache.get_kv_cache{tuple(params)} does not take prompt_tokens "
            f"after model (EXO before v1.0.68 keyed it by prompt text): tierkv needs "
            f"{NEEDED_VERSION}"
        )
    init = methods.get("__init__")
    init_params = [a.arg for a in init.args.args] if init else []
    if init_params[:2] != ["self", "group"]:
        raise ExoLayoutError(
            f"{filename}: KVPrefixCache.__init__ does not take the distributed group: tierkv needs "
            f"{NEEDED_VERSION}"
        )
    returned = _tuple_arity(get_kv_cache.returns)
    if returned == 3:
        return "v1.0.68-v1.0.69"
    if returned == 4:
        return "v1.0.70 or newer"
    raise ExoLayoutError(
        f"{filename}: KVPrefixCache.get_kv_cache returns "
        f"{ast.unparse(get_kv_cache.returns) if get_kv_cache.returns else 'no annotation'}, "
        f"expected a 3-tuple (EXO v1.0.68-v1.0.69) or a 4-tuple (v1.0.70 or newer)"
    )


def _tuple_arity(annotation: ast.expr | None) -> int | None:
    """Number of elements of a `tuple[...]` annotation, else None."""
    if (
        isinstance(annotation, ast.Subscript)
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id in ("tuple", "Tuple")
        and isinstance(annotation.slice, ast.Tuple)
    ):
        return len(annotation.slice.elts)
    return None


def _has_entrypoint(bootstrap_source: str, filename: str) -> bool:
    """Whether the runner bootstrap defines `entrypoint(bound_instance, ...)`."""
    tree = ast.parse(bootstrap_source, filename=filename)
    return any(
        isinstance(n, ast.FunctionDef)
        and n.name == "entrypoint"
        and [a.arg for a in n.args.args][:1] == ["bound_instance"]
        for n in tree.body
    )


def find_exo(exo_path: str | Path) -> ExoLayout:
    """Check that `exo_path` is a supported EXO checkout with a venv (ExoLayoutError: why not)."""
    root = Path(exo_path).expanduser().resolve()
    if not root.is_dir():
        raise ExoPathError(f"--exo-path {root}: not a directory")
    cache_py = root / CACHE_PY
    if not cache_py.is_file():
        raise ExoLayoutError(
            f"{cache_py} not found: {root} is not an EXO checkout tierkv supports "
            f"(tierkv needs {NEEDED_VERSION})"
        )
    version = detect_version(cache_py.read_text(encoding="utf-8"), str(cache_py))
    bootstrap_py = root / BOOTSTRAP_PY
    if not bootstrap_py.is_file() or not _has_entrypoint(
        bootstrap_py.read_text(encoding="utf-8"), str(bootstrap_py)
    ):
        raise ExoLayoutError(
            f"{bootstrap_py} has no entrypoint(bound_instance, ...): tierkv needs {NEEDED_VERSION}"
        )
    venv = root / ".venv"
    if not (venv / "pyvenv.cfg").is_file():
        raise ExoLayoutError(
            f"EXO's venv {venv} is missing (no pyvenv.cfg): run `uv sync` in {root} first, "
            f"then install again"
        )
    candidates = sorted((venv / "lib").glob("python3.*/site-packages"))
    if len(candidates) != 1:
        found = ", ".join(str(c) for c in candidates) or "none"
        raise ExoLayoutError(
            f"EXO's venv {venv} should have exactly one lib/python3.*/site-packages, found {found}"
        )
    python = venv / "bin" / "python"
    if not python.exists():
        raise ExoLayoutError(f"EXO's venv {venv} has no bin/python: re-create it with `uv sync`")
    return ExoLayout(root, version, venv, candidates[0], python)


def boot_source() -> str:
    """The boot module's source, as copied into EXO's venv."""
    return (Path(__file__).parent.parent / "connectors" / "exo" / "boot.py").read_text("utf-8")


def default_runtime_requirement() -> str:
    """What to install for EXO's interpreter: this source checkout if run from one, else the
    wheel or directory the running tierkv was installed from. Never `tierkv` by name: the
    package index's `tierkv` is an unrelated project."""
    project = Path(tierkv.__file__).resolve().parent.parent
    if (project / "pyproject.toml").is_file() and (project / "tierkv").is_dir():
        return str(project)
    origin = installed_from()
    if origin is None:
        raise ExoLayoutError(
            "cannot tell where this tierkv was installed from; pass --runtime-requirement with "
            "its checkout or a wheel built from it (the package index's 'tierkv' is another "
            "project)"
        )
    return origin


def installed_from() -> str | None:
    """The local file or directory the installed tierkv came from (PEP 610 direct_url.json),
    None when unknown or not local."""
    try:
        text = importlib.metadata.distribution("tierkv").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    url = str(json.loads(text).get("url", "")) if text else ""
    if not url.startswith("file://"):
        return None
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    return str(path) if path.exists() else None


def install(
    exo_path: str | Path, *, runtime_requirement: str | None = None, install_runtime: bool = True
) -> tuple[ExoLayout, bool]:
    """Install the hook; returns the layout and whether anything changed (False: already there).

    `install_runtime=False` skips installing tierkv's packages for EXO's interpreter (for when
    tierkv is importable there already).
    """
    layout = find_exo(exo_path)
    boot_file = layout.runtime_dir / f"{BOOT_MODULE}.py"
    source = boot_source()
    up_to_date = (
        layout.pth_file.is_file()
        and layout.pth_file.read_text(encoding="utf-8") == layout.pth_text()
        and boot_file.is_file()
        and boot_file.read_text(encoding="utf-8") == source
    )
    if install_runtime:
        fresh = not layout.runtime_dir.exists()
        try:
            _install_runtime_packages(layout, runtime_requirement or default_runtime_requirement())
        except ExoLayoutError:
            if fresh:
                shutil.rmtree(layout.runtime_dir, ignore_errors=True)
            raise
    if up_to_date:
        return layout, False
    layout.runtime_dir.mkdir(exist_ok=True)
    boot_file.write_text(source, encoding="utf-8")
    layout.pth_file.write_text(layout.pth_text(), encoding="utf-8")
    return layout, True


def _install_runtime_packages(layout: ExoLayout, requirement: str) -> None:
    """pip-install `requirement` for EXO's interpreter into the runtime directory."""
    target = layout.runtime_dir / RUNTIME_LIB_NAME
    layout.runtime_dir.mkdir(exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "--python", str(layout.python), "install", "--quiet",
        "--upgrade", "--target", str(target), requirement,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ExoLayoutError(
            f"installing {requirement} for EXO's Python {layout.python} failed "
            f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )


def uninstall(exo_path: str | Path) -> list[Path]:
    """Remove what `install` added; returns the removed paths (empty: nothing was installed).

    Works on a checkout whose venv is gone or whose EXO version is no longer supported.
    """
    root = Path(exo_path).expanduser().resolve()
    if not root.is_dir():
        raise ExoPathError(f"--exo-path {root}: not a directory")
    venv = root / ".venv"
    removed: list[Path] = []
    for pth in sorted(venv.glob(f"lib/python3.*/site-packages/{PTH_NAME}")):
        pth.unlink()
        removed.append(pth)
    runtime = venv / RUNTIME_DIR_NAME
    if runtime.is_dir():
        shutil.rmtree(runtime)
        removed.append(runtime)
    return removed


def hook_state(exo_path: str | Path) -> HookState:
    """Whether the hook is installed in the EXO checkout at `exo_path`, and what is wrong if not."""
    try:
        layout = find_exo(exo_path)
    except ExoLayoutError as exc:
        return HookState(False, str(exc))
    boot_file = layout.runtime_dir / f"{BOOT_MODULE}.py"
    if not layout.pth_file.is_file():
        return HookState(False, f"not installed (no {layout.pth_file})")
    if layout.pth_file.read_text(encoding="utf-8") != layout.pth_text() or not boot_file.is_file():
        return HookState(False, "damaged install: run `tierkv install --exo-path` again")
    if boot_file.read_text(encoding="utf-8") != boot_source():
        return HookState(True, f"installed for EXO {layout.version}, boot module outdated")
    return HookState(True, f"installed for EXO {layout.version}")
