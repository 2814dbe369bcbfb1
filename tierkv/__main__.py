"""The `tierkv` console script and `python -m tierkv`: the CLI of tierkv.cli.

gRPC's own log lines are off unless GRPC_VERBOSITY asks for them, and a TierKVError that leaves
a command is one line on stderr and exit 1, not a traceback. A vault first restarts itself
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
    from tierkv.errors import TierKVError

    try:
        app()
    except TierKVError as exc:  # one a command did not put in its own words: still one line
        print(f"tierkv: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
