"""A fake EXO checkout for install tests: the fixture package under src/ and a uv-style .venv."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

FIXTURE_SRC = Path(__file__).parent / "src"
SITE_PACKAGES = Path(".venv/lib/python3.13/site-packages")
EXO_PYTHON = "3.13"
"""The Python EXO's own environment runs (its pyproject.toml: requires-python ==3.13.*)."""


@cache
def exo_python() -> Path | None:
    """An interpreter of EXO's Python: the running one if it is that version, else pyenv's
    newest (versions/3.13*) or `python3.13` on PATH; None where there is none."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == EXO_PYTHON:
        return Path(sys.executable)
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = sorted(pyenv.glob(f"versions/{EXO_PYTHON}*/bin/python"), reverse=True)
    on_path = shutil.which(f"python{EXO_PYTHON}")
    for python in [*found, *([Path(on_path)] if on_path else [])]:
        version = "import sys; print(*sys.version_info[:2], sep='.')"
        done = subprocess.run([python, "-c", version], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == EXO_PYTHON:  # (not a pyenv shim)
            return python
    return None


def make_exo_tree(root: Path, *, venv_kind: str = "layout", python: Path | None = None) -> Path:
    """Copy the fixture package to `root`/src and lay out EXO's venv.

    venv_kind "layout": the files of a uv venv for Python 3.13 (bin/python links to the running
    interpreter; nothing runs in it). "real": a working venv of `python` (default: EXO's Python,
    `exo_python()`, else the running interpreter), for tests that start EXO's Python. "none": no
    venv. Either venv holds a `.pth` like the one uv writes for EXO's editable install.
    """
    shutil.copytree(FIXTURE_SRC, root / "src", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "pyproject.toml").write_text('[project]\nname = "exo"\nrequires-python = "==3.13.*"\n')
    if venv_kind == "none":
        return root
    if venv_kind == "real":
        python = python or exo_python() or Path(sys.executable)
        command = [str(python), "-m", "venv", "--without-pip", "--symlinks", str(root / ".venv")]
        subprocess.run(command, check=True)
        (site,) = (root / ".venv/lib").glob("python3.*/site-packages")
    else:
        site = root / SITE_PACKAGES
        site.mkdir(parents=True)
        (root / ".venv/pyvenv.cfg").write_text(
            "home = /usr/bin\nimplementation = CPython\nversion_info = 3.13.0\n"
        )
        (root / ".venv/bin").mkdir()
        os.symlink(sys.executable, root / ".venv/bin/python")
    (site / "_exo.pth").write_text(f"{root / 'src'}\n")
    return root


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under `root` (files, links, directories) mapped to a digest of its content."""
    digest: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            digest[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            digest[rel] = "dir"
        else:
            digest[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest
