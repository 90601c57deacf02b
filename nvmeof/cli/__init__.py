"""The `nvmeof` command line: one entry point for the target, the initiator and management."""

from __future__ import annotations

import click

from nvmeof import __version__
from nvmeof.cli.logformat import LOG_FORMATS

LOG_LEVELS = ["debug", "info", "warning", "error"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="nvmeof")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True,
              envvar="NVMEOF_LOG_LEVEL", help="Logging verbosity (stderr).")
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default="text", show_default=True,
              envvar="NVMEOF_LOG_FORMAT",
              help="Log lines as plain text, or one JSON object per line for log collectors (ts, level, logger, "
                   "message, and host, subnqn, qid, cntlid, peer, reason on connection events).")
def cli(log_level: str, log_format: str) -> None:
    """NVMe over Fabrics toolkit: run a target, attach hosts, manage and measure."""
    from nvmeof.cli.logformat import configure

    configure(log_level, log_format)


def _register() -> None:
    from nvmeof.cli.commands import host, resv, serve

    serve.register(cli)
    host.register(cli)
    resv.register(cli)
    from nvmeof.cli.commands import manage

    manage.register(cli)
    from nvmeof.cli.commands import gateway

    gateway.register(cli)
    from nvmeof.cli.commands import completion

    completion.register(cli)
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
