"""The `tierkv` console script and `python -m tierkv`: the CLI of tierkv.cli.

gRPC's own log lines are off unless GRPC_VERBOSITY asks for them; an error leaving a command is
one line and an exit code (tierkv.cli.errors). A vault first restarts itself
with a huge-page malloc heap (tierkv.vault.memory), before the CLI's imports, so the restart costs
little.
"""

import os
import sys


def main() -> None:
    # gRPC's C core logs to stderr on its own (a port taken, a host unknown); tierkv says what
    # went wrong in one line of its own instead. GRPC_VERBOSITY=ERROR (or DEBUG) brings it back.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    if sys.argv[1:2] == ["vault"]:
        from tierkv.vault.memory import restart_with_huge_pages

        restart_with_huge_pages()
    from tierkv.cli import app

    app()


if __name__ == "__main__":
    main()
