"""`python3 -m nvmeof ...` runs the `nvmeof` command line (useful where the console script is not on PATH)."""

from nvmeof.cli import main

main()
