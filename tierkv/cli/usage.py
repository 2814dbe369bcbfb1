"""Help of commands that take positional arguments: each argument shown by its metavar alone
(plain Typer help writes "{DIR}" in the usage line and "DIR <path>" in the list)."""

from __future__ import annotations

from typing import Any

from typer.core import TyperArgument, TyperCommand


class NamedArgument(TyperArgument):
    """An argument shown by its metavar alone."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None

    def get_usage_pieces(self, ctx: Any) -> list[str]:
        return [self.metavar or self.name or ""]


class NamedArgumentsCommand(TyperCommand):
    """A command whose arguments are NamedArguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, TyperArgument):
                param.__class__ = NamedArgument
