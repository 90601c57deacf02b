"""Subcommands of the `nvmeof` command line; each module has ``register(cli_group)``."""
