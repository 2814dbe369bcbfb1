"""The `tierkv` command line: one Typer app; each subcommand lives in its own module."""

import typer

app = typer.Typer(
    name="tierkv",
    help="A cold KV-cache tier for vLLM and EXO on ordinary LAN machines.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """A cold KV-cache tier for vLLM and EXO on ordinary LAN machines."""


# Subcommand modules register themselves on `app` when imported.
from tierkv.cli import install  # noqa: E402, F401
from tierkv.cli import vault  # noqa: E402, F401
from tierkv.cli import status  # noqa: E402, F401
from tierkv.cli import bench  # noqa: E402, F401
from tierkv.cli import serve  # noqa: E402, F401
