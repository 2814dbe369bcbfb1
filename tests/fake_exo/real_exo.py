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
  test's weight files;
- `mlx_lm.models.deepseek_v4` (EXO main, after v1.0.71), only where the installed mlx-lm has
  none: EXO main takes it from an mlx-lm fork; cache.py needs two of its class names.

The finder also gives `exo` the distribution metadata an install of the checkout has (its name
and version from pyproject.toml): EXO main's `exo/__init__.py` reads `version("exo")`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
from collections.abc import Iterator, Sequence
from os import PathLike
from pathlib import Path
from types import ModuleType

import tomlkit

from fake_exo.tree import FIXTURE_SRC

STAND_INS = (
    "exo.worker.runner.bootstrap",
    "exo.worker.engines.mlx.generator.generate",
    "exo.worker.engines.mlx.vision",
    "exo.download.download_utils",
)
EMPTY_PACKAGES = ("exo.utils",)
MLX_LM_STAND_INS = {"mlx_lm.models.deepseek_v4": Path(__file__).parent / "deepseek_v4.py"}


class _CheckoutDistribution(importlib.metadata.Distribution):
    """The `exo` distribution of a checkout: the METADATA an install of it would have."""

    def __init__(self, root: Path) -> None:
        self.root = root
        project = tomlkit.parse((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        self.metadata_text = (
            f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
        )

    def read_text(self, filename: str) -> str | None:
        return self.metadata_text if filename == "METADATA" else None

    def locate_file(self, path: str | PathLike[str]) -> Path:
        return self.root / "src" / path


class _EmptyPackage(importlib.abc.Loader):
    """Creates a package without running its `__init__`."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        pass


class RealExoFinder(importlib.abc.MetaPathFinder):
    """Finds `exo` in the checkout at `root`, and the stand-ins in the fixture package."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.src = root / "src"
        if not (self.src / "exo/worker/engines/mlx/cache.py").is_file():
            raise FileNotFoundError(f"TIERKV_EXO_SRC={root} holds no src/exo/.../mlx/cache.py")

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MLX_LM_STAND_INS:
            if importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
                return None  # the installed mlx-lm has it
            return importlib.util.spec_from_file_location(fullname, MLX_LM_STAND_INS[fullname])
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

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("-", "_").lower() == "exo":
            yield _CheckoutDistribution(self.root)
