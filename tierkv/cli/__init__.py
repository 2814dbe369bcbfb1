"""The `tierkv` command line: one Typer app; each subcommand lives in its own module."""

from typing import Annotated

import typer

from tierkv import __version__
from tierkv.cli.errors import ErrorBoundary

app = typer.Typer(
    name="tierkv",
    cls=ErrorBoundary,  # every error leaving a command: one line and the README's exit code
    help="A cold KV-cache tier for vLLM and EXO on ordinary LAN machines.",
    no_args_is_help=True,
    add_completion=False,
    # Plain help: flags show no type, long lines rewrap to the terminal, "[default: ...]" stays.
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tierkv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """A cold KV-cache tier for vLLM and EXO on ordinary LAN machines."""


# Subcommand modules register themselves on `app` when imported.
from tierkv.cli import install  # noqa: E402, F401
from tierkv.cli import vault  # noqa: E402, F401
from tierkv.cli import status  # noqa: E402, F401
from tierkv.cli import secrets  # noqa: E402, F401
from tierkv.cli import bench  # noqa: E402, F401
from tierkv.cli import serve  # noqa: E402, F401
from tierkv.cli import eval  # noqa: E402, F401
