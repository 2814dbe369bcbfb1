"""Checks tierkv's vLLM connector against a vLLM wheel without installing or importing it.

The newest wheel the `vllm` extra allows is downloaded once (`pip download --no-deps`) into a
cache outside the repository; its sources are read from the zip and parsed with `ast`, and so
are tierkv's. What is compared, and why (the drift that breaks a connector silently):
- every abstract method of `KVConnectorBase_V1` (and of `SupportsHMA`) is defined by
  TierKVConnector;
- every method TierKVConnector defines is one the base class defines (vLLM never calls one it
  renamed), as the same kind (method, classmethod, property), with the same parameters: names,
  kinds and which have defaults. Annotations are not compared: vLLM changes them cosmetically
  (quoted or not, `Optional` or `| None`) and a caller does not see them;
- every name the connector's modules import from vLLM exists where they import it from.

Run as a script (`python tests/vllm_api.py`) to print the result for the newest allowed wheel.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomlkit

REPO = Path(__file__).resolve().parent.parent
CONNECTOR_DIR = REPO / "tierkv" / "connectors" / "vllm"
CONNECTOR_CLASS = "TierKVConnector"
BASE_MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
BASE_CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
WHEEL_CACHE = Path.home() / ".cache" / "tierkv" / "wheels"
DOWNLOAD_TIMEOUT_S = 900


class WheelUnavailable(RuntimeError):
    """The wheel could not be downloaded (no network, no index, no wheel for this platform)."""


def vllm_requirement(pyproject: Path = REPO / "pyproject.toml") -> str:
    """The `vllm` extra's requirement, e.g. 'vllm>=0.32,<0.35'."""
    extras = tomlkit.parse(pyproject.read_text())["project"]["optional-dependencies"]
    (requirement,) = (str(r) for r in extras["vllm"] if str(r).startswith("vllm"))
    return requirement


def newest_wheel(requirement: str, cache: Path = WHEEL_CACHE) -> Path:
    """The newest wheel satisfying `requirement`, downloaded into `cache` unless already there."""
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    try:
        done = subprocess.run(
            [*command, "--dest", str(cache), requirement],
            capture_output=True,
            text=True,
            timeout=DOWNLOAD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise WheelUnavailable(f"pip download {requirement} took over {exc.timeout} s") from exc
    found = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", done.stdout)
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise WheelUnavailable(f"pip download {requirement} failed: {' '.join(tail)}")
    return (cache / Path(found[-1]).name).resolve()


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def _kind(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    names = {ast.unparse(d) for d in function.decorator_list}
    for kind in ("classmethod", "staticmethod", "property"):
        if kind in names:
            return kind
    return "method"


def _is_abstract(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d).endswith("abstractmethod") for d in function.decorator_list)


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The parameter list as a caller sees it: names, kinds, defaults marked '=…'."""
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    with_default = len(positional) - len(args.defaults)
    shown = [a.arg + ("=…" if i >= with_default else "") for i, a in enumerate(positional)]
    if args.posonlyargs:
        shown.insert(len(args.posonlyargs), "/")
    if args.vararg:
        shown.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        shown.append("*")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        shown.append(arg.arg + ("" if default is None else "=…"))
    if args.kwarg:
        shown.append("**" + args.kwarg.arg)
    return "(" + ", ".join(shown) + ")"


def _methods(source: str, class_name: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {
                item.name: item
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    raise LookupError(f"class {class_name} not found")


def connector_drift(base_source: str, connector_source: str, where: str) -> list[str]:
    """One line per difference between TierKVConnector and vLLM's base classes in `base_source`
    (`where` names the vLLM version in the lines)."""
    ours = _methods(connector_source, CONNECTOR_CLASS)
    theirs: dict[str, tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    for class_name in reversed(BASE_CLASSES):  # KVConnectorBase_V1's definition wins
        try:
            theirs |= {
                name: (class_name, f) for name, f in _methods(base_source, class_name).items()
            }
        except LookupError:
            return [f"{where}: class {class_name} not found in {BASE_MODULE}"]
    problems = []
    for name, (class_name, function) in theirs.items():
        if _is_abstract(function) and name not in ours:
            problems.append(
                f"{where}: abstract method {class_name}.{name}{_parameters(function)} is not "
                f"defined by {CONNECTOR_CLASS}"
            )
    for name, function in ours.items():
        if name.startswith("_") and name != "__init__":
            continue
        if name not in theirs:
            problems.append(
                f"{where}: {CONNECTOR_CLASS}.{name} overrides nothing: the base classes have no "
                f"{name} (renamed or removed?)"
            )
            continue
        class_name, base = theirs[name]
        if (_kind(function), _parameters(function)) != (_kind(base), _parameters(base)):
            problems.append(
                f"{where}: {CONNECTOR_CLASS}.{name} is the {_kind(function)} "
                f"{name}{_parameters(function)}, but {class_name} has the {_kind(base)} "
                f"{name}{_parameters(base)}"
            )
    return problems


def _defined_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (also inside if/try blocks)."""
    names: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):
            pending += [*node.body, *node.orelse]
            if isinstance(node, ast.Try):
                pending += [*node.finalbody, *(s for h in node.handlers for s in h.body)]
    return names


def import_drift(wheel: zipfile.ZipFile, where: str, sources: dict[str, str]) -> list[str]:
    """One line per `from vllm... import name` in `sources` (file name -> source) that the
    wheel's module does not define."""
    files = set(wheel.namelist())
    problems = []
    for file_name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("vllm"):
                continue
            path = node.module.replace(".", "/")  # type: ignore[union-attr]
            module = next((p for p in (f"{path}.py", f"{path}/__init__.py") if p in files), None)
            if module is None:
                problems.append(f"{where}: module {node.module} (imported by {file_name}) is gone")
                continue
            tree = ast.parse(wheel.read(module))
            defined = _defined_names(tree)
            submodules = {Path(p).stem for p in files if p.startswith(f"{path}/")}
            for alias in node.names:
                if alias.name not in defined and alias.name not in submodules:
                    problems.append(
                        f"{where}: {node.module} has no {alias.name} (imported by {file_name})"
                    )
    return problems


def check_wheel(wheel_path: Path) -> list[str]:
    """Every difference between tierkv's vLLM connector and the vLLM wheel at `wheel_path`."""
    where = f"vllm {wheel_version(wheel_path)}"
    sources = {p.name: p.read_text() for p in sorted(CONNECTOR_DIR.glob("*.py"))}
    with zipfile.ZipFile(wheel_path) as wheel:
        base = wheel.read(BASE_MODULE).decode()
        return connector_drift(base, sources["connector.py"], where) + import_drift(
            wheel, where, sources
        )


def main() -> int:
    requirement = vllm_requirement()
    try:
        wheel = newest_wheel(requirement)
    except WheelUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    problems = check_wheel(wheel)
    for line in problems:
        print(line)
    if not problems:
        print(f"{CONNECTOR_CLASS} matches vllm {wheel_version(wheel)} ({requirement})")
    return 1 if problems else 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
