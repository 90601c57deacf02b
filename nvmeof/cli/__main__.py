"""`python3 -m nvmeof.cli ...` runs the `nvmeof` command line (the interop scripts start the target this way)."""

from nvmeof.cli import main

main()
