"""The `nvmeof` command line: one entry point for the target, the initiator and management."""

from __future__ import annotations

import logging
import sys

import click

from nvmeof import __version__

LOG_LEVELS = ["debug", "info", "warning", "error"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="nvmeof")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True,
              envvar="NVMEOF_LOG_LEVEL", help="Logging verbosity (stderr).")
def cli(log_level: str) -> None:
    """NVMe over Fabrics toolkit: run a target, attach hosts, manage and measure."""
    logging.basicConfig(level=getattr(logging, log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register() -> None:
    from nvmeof.cli.commands import host, serve

    serve.register(cli)
    host.register(cli)
    from nvmeof.cli.commands import manage

    manage.register(cli)
    try:
        from nvmeof.cli.commands import bench
    except ImportError:  # benchmark command lands separately
        return
    bench.register(cli)


_register()


def main() -> None:
    cli(prog_name="nvmeof")


if __name__ == "__main__":
    main()
