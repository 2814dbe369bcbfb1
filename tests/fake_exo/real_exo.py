"""Import a real EXO checkout's prompt cache (`TIERKV_EXO_SRC=/path/to/exo`) for the hook tests.

EXO's package does not install here (it needs Python 3.13 and its Rust bindings), but its
`src/exo/worker/engines/mlx/cache.py` imports with mlx and mlx-lm alone once a few modules it
pulls in are replaced. `RealExoFinder` imports every `exo.*` module from the checkout except
these stand-ins, each for the reason given:

- `exo.utils` (the package's `__init__`): its helpers use Python 3.12 generics (`def f[T]`);
  the package is created empty, so its submodules (`pydantic_ext`, which the real
  `exo.shared.types.memory` needs) still come from the checkout;
- `exo.worker.runner.bootstrap`: EXO's runner entry point, whose imports (events, channels) need
  Python 3.12+; the fixture's has the same `entrypoint(bound_instance, ...)` and the `logger`
  cache.py imports;
- `exo.worker.engines.mlx.generator.generate`: EXO's `mlx_generate` needs a tokenizer, EXO's task
  types and its runner; the fixture's is the same request flow on token ids;
- `exo.worker.engines.mlx.vision` (EXO >= v1.0.70): pulls in mlx-vlm and transformers; cache.py
  imports it for type checking only, the tests for `MediaRegion` (the same three fields);
- `exo.download.download_utils`: EXO's downloader; the fixture's `build_model_path` finds the
  test's weight files.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from fake_exo.tree import FIXTURE_SRC

STAND_INS = (
    "exo.worker.runner.bootstrap",
    "exo.worker.engines.mlx.generator.generate",
    "exo.worker.engines.mlx.vision",
    "exo.download.download_utils",
)
EMPTY_PACKAGES = ("exo.utils",)


class _EmptyPackage(importlib.abc.Loader):
    """Creates a package without running its `__init__`."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        pass


class RealExoFinder(importlib.abc.MetaPathFinder):
    """Finds `exo` in the checkout at `root`, and the stand-ins in the fixture package."""

    def __init__(self, root: Path) -> None:
        self.src = root / "src"
        if not (self.src / "exo/worker/engines/mlx/cache.py").is_file():
            raise FileNotFoundError(f"TIERKV_EXO_SRC={root} holds no src/exo/.../mlx/cache.py")

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        relative = fullname.replace(".", "/")
        if fullname in STAND_INS:
            return importlib.util.spec_from_file_location(fullname, FIXTURE_SRC / f"{relative}.py")
        if fullname in EMPTY_PACKAGES:
            spec = importlib.util.spec_from_loader(fullname, _EmptyPackage(), is_package=True)
            assert spec is not None and spec.submodule_search_locations is not None
            spec.submodule_search_locations.append(str(self.src / relative))
            return spec
        if fullname == "exo":
            return importlib.machinery.PathFinder.find_spec(fullname, [str(self.src)])
        return None  # the rest of exo.*: found in the checkout through exo's own __path__
