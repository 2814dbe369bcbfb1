"""`tierkv install`: add the tierkv hook to an EXO checkout (or remove it with --uninstall)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tierkv.cli import app
from tierkv.cli.errors import fail
from tierkv.patches.exo import ExoLayoutError, ExoPathError
from tierkv.patches.exo import install as install_hook
from tierkv.patches.exo import uninstall as remove_hook

console = Console(stderr=True, soft_wrap=True)


@app.command()
def install(
    exo_path: Annotated[
        Path,
        typer.Option(
            "--exo-path", metavar="PATH", help="The EXO checkout (the directory with .venv)."
        ),
    ],
    uninstall: Annotated[
        bool, typer.Option("--uninstall", help="Remove the hook; EXO is left as before.")
    ] = False,
    runtime: Annotated[
        bool,
        typer.Option(
            help="Install tierkv's packages for EXO's Python into the hook's own directory "
            "(--no-runtime when tierkv is importable in EXO's venv already)."
        ),
    ] = True,
    runtime_requirement: Annotated[
        str | None,
        typer.Option(
            metavar="REQUIREMENT",
            help="pip requirement to install for EXO's Python.",
            show_default="this tierkv",
        ),
    ] = None,
) -> None:
    """Hook tierkv into EXO: evicted prompt caches go to the vault and come back on a miss."""
    try:
        if uninstall:
            removed = remove_hook(exo_path)
            if not removed:
                console.print(f"Nothing to remove: the tierkv hook is not installed in {exo_path}")
            for path in removed:
                console.print(f"removed {path}")
            return
        with console.status("installing the tierkv hook into EXO's venv"):
            layout, changed = install_hook(
                exo_path, runtime_requirement=runtime_requirement, install_runtime=runtime
            )
    except ExoLayoutError as exc:
        raise fail("install", str(exc), 2 if isinstance(exc, ExoPathError) else 1) from None
    state = "installed" if changed else "already installed (nothing changed)"
    console.print(f"tierkv hook {state} for EXO {layout.version} at {layout.root}")
    console.print(f"  {layout.pth_file}\n  {layout.runtime_dir}")
    console.print("Start EXO as usual; set TIERKV_DISABLE=1 to run it without tierkv.")
