"""Boot module of the EXO hook: the line in tierkv's `.pth` imports it when EXO's Python starts.

`tierkv install --exo-path` copies this file, alone, into a tierkv-owned directory of EXO's venv as
`tierkv_exo_boot.py`; the `.pth` line calls `arm()`. It uses the standard library only and imports
nothing else at start-up: `arm()` puts an import hook first on `sys.meta_path` that, once EXO
imports its prompt-cache module or its runner bootstrap, hands the freshly executed module to
`tierkv.connectors.exo.hook`. Any failure there leaves EXO's module as it was (fail-open).
`TIERKV_DISABLE=1` keeps the hook off.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

DISABLE_ENV = "TIERKV_DISABLE"
CACHE_MODULE = "exo.worker.engines.mlx.cache"
BOOTSTRAP_MODULE = "exo.worker.runner.bootstrap"
HOOKED_MODULES = frozenset({CACHE_MODULE, BOOTSTRAP_MODULE})


def disabled() -> bool:
    """Whether TIERKV_DISABLE=1 turns the hook off in this process."""
    return os.environ.get(DISABLE_ENV, "") == "1"


class _PatchingLoader(importlib.abc.Loader):
    """Runs EXO's own loader, then lets the tierkv hook wrap what the module defines."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:  # get_source, get_resource_reader, ...
        return getattr(self._inner, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        try:
            # By name, at run time: this file runs copied alone at every EXO start-up, before
            # tierkv (numpy, Numba) may be imported; the hook imports this module's constants.
            importlib.import_module("tierkv.connectors.exo.hook").patch_module(module)
        except Exception as exc:  # tierkv missing or broken: EXO runs as without it
            print(f"tierkv: EXO hook not active in {module.__name__}: {exc!r}", file=sys.stderr)


class HookFinder(importlib.abc.MetaPathFinder):
    """Finds EXO's hooked modules through the other finders and swaps in the patching loader."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in HOOKED_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def arm() -> bool:
    """Put the hook first on `sys.meta_path` (once); False when TIERKV_DISABLE=1 keeps it off."""
    if disabled():
        return False
    if not any(type(finder).__name__ == HookFinder.__name__ for finder in sys.meta_path):
        sys.meta_path.insert(0, HookFinder())
    return True
