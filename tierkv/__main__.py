"""The `tierkv` console script and `python -m tierkv`: the CLI of tierkv.cli.

A vault first restarts itself with a huge-page malloc heap (tierkv.vault.memory), before the CLI's
imports, so the restart costs little.
"""

import sys


def main() -> None:
    if sys.argv[1:2] == ["vault"]:
        from tierkv.vault.memory import restart_with_huge_pages

        restart_with_huge_pages()
    from tierkv.cli import app

    app()


if __name__ == "__main__":
    main()
