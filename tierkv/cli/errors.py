"""The one place a failure of a `tierkv` command reaches a person: `ErrorBoundary`, the CLI's
Click group, turns every error leaving a command into one line on stderr, `tierkv COMMAND: what`,
and the README's exit code: 2 for configuration and usage (a bad flag, file or setting), 1 for a
failure at run time. Commands raise; they do not print their errors or pick exit codes apart
from `fail`, which says which of the two a failure is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperGroup

from tierkv.config import ConfigError
from tierkv.errors import TierKVError

USAGE, RUNTIME = 2, 1
"""Exit codes: a configuration or usage error; a failure at run time."""
TRACEBACK_ENV = "TIERKV_TRACEBACK"
"""Set to 1 to get the traceback of an error tierkv did not expect (a bug to report)."""


class CommandError(TierKVError):
    """A failure a command put in its own words, with its exit code (USAGE or RUNTIME)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def fail(command: str, message: str, code: int) -> CommandError:
    """The error to raise for a failure of `tierkv COMMAND` said as `message`, exit `code`.

    `command` names the command for readers of the code; the boundary names the one that ran.
    """
    del command
    return CommandError(message, code)


def exit_code(exc: BaseException) -> int:
    """The README's exit code of an error: USAGE for configuration and usage, else RUNTIME."""
    if isinstance(exc, CommandError):
        return exc.code
    if isinstance(exc, ConfigError):
        return USAGE
    return RUNTIME


def one_line(text: str) -> str:
    """`text` on one line: its lines joined, runs of blanks made one."""
    return " ".join(text.split())


class ErrorBoundary(TyperGroup):
    """The `tierkv` group: runs a command and reports whatever error leaves it in one line."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        command = next((arg for arg in argv if arg in self.commands), None)
        try:
            result = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
            code = result if isinstance(result, int) else 0
        except typer.Abort:
            code = _report(command, "aborted", RUNTIME)
        except typer.TyperException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `tierkv` alone: its help, as asked
                typer.echo(exc.format_message(), err=True)
                code = USAGE
            else:
                code = _report(command, exc.format_message(), USAGE)
        except TierKVError as exc:
            code = _report(command, str(exc), exit_code(exc))
        except Exception as exc:
            if os.environ.get(TRACEBACK_ENV) == "1":
                raise
            message = f"unexpected {type(exc).__name__}: {exc} ({TRACEBACK_ENV}=1 shows where)"
            code = _report(command, message, RUNTIME)
        if standalone_mode:
            sys.exit(code)
        return code


def _report(command: str | None, message: str, code: int) -> int:
    """Print the one line of an error; its exit code."""
    prefix = f"tierkv {command}" if command else "tierkv"
    typer.echo(f"{prefix}: {one_line(message)}", err=True)
    return code
