"""How a `tierkv` command reports bad input or a failure: one line on stderr naming the command."""

from __future__ import annotations

import typer


def fail(command: str, message: str, code: int) -> typer.Exit:
    """Print `tierkv COMMAND: MESSAGE` on stderr and return the exit to raise with `code`."""
    typer.echo(f"tierkv {command}: {message}", err=True)
    return typer.Exit(code)
