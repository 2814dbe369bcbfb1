"""`python -m tierkv` runs the CLI."""

from tierkv.cli import main

main()
