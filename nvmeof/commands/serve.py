"""`nvmeof serve`: run the target daemon."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from nvmeof import defaults
from nvmeof.uri import parse_address

from .common import parse_size, run_async


def _addresses(values: tuple[str, ...], default_port: int, what: str):
    out = []
    for v in values:
        try:
            out.append(parse_address(v, default_port))
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=what) from None
    return out


def _api(value: str):
    if value.lower() in ("none", "off", "no", ""):
        return None
    try:
        addr = parse_address(value, defaults.API_PORT)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--api") from None
    return addr.traddr, addr.trsvcid


@click.command()
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="JSON configuration to restore at start; every change is saved back to it. "
                   "Created with the default subsystem if it does not exist.")
@click.option("-l", "--listen", multiple=True, metavar="[tcp://]ADDR[:PORT]",
              help=f"I/O listener (repeatable). Default tcp://{defaults.LISTEN_ADDRESS}:{defaults.TCP_IO_PORT} "
                   "when no configuration provides one.")
@click.option("-d", "--discovery", multiple=True, metavar="[tcp://]ADDR[:PORT]",
              help=f"Discovery listener (repeatable). Default tcp://{defaults.LISTEN_ADDRESS}:"
                   f"{defaults.TCP_DISCOVERY_PORT}.")
@click.option("--api", "api", default=f"{defaults.LISTEN_ADDRESS}:{defaults.API_PORT}", show_default=True,
              metavar="ADDR:PORT|none", help="REST API address, or 'none' to disable it.")
@click.option("--api-token", envvar="NVMEOF_API_TOKEN", metavar="TOKEN",
              help="Bearer token for the REST API (required beyond loopback). Env: NVMEOF_API_TOKEN.")
@click.option("--nqn", default=defaults.DEFAULT_SUBSYSTEM_NQN, show_default=True,
              help="NQN of the default subsystem (when no configuration exists).")
@click.option("--ramdisk-size", default="1G", show_default=True, metavar="SIZE",
              help="Size of the default RAM-disk namespace (K, M, G suffixes).")
@click.option("--block-size", type=click.Choice(["512", "4096"]), default="512", show_default=True,
              help="Block size of the default namespace.")
@click.option("--workers", type=click.IntRange(0, 256), default=0, show_default=True, metavar="N",
              help="Serve TCP I/O queues from N worker processes (one core each); admin queues and controller "
                   "state stay in the main process. 0 serves everything in one process.")
def serve(**kw) -> None:
    """Run the NVMe-oF target: by default one subsystem with a 1 GiB RAM disk, allowing any host,
    I/O on 127.0.0.1:4420, discovery on 127.0.0.1:8009 and the REST API on 127.0.0.1:8080."""
    from target.daemon import DaemonError, DaemonOptions
    from target.daemon import serve as run

    # Each option group below turns its click values into DaemonOptions fields (one place per option).
    try:
        size = parse_size(kw["ramdisk_size"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--ramdisk-size") from None
    fields: dict = dict(
        config_path=kw["config_path"],
        listen=_addresses(kw["listen"], defaults.TCP_IO_PORT, "--listen"),
        discovery=_addresses(kw["discovery"], defaults.TCP_DISCOVERY_PORT, "--discovery"),
        api=_api(kw["api"]), api_token=kw["api_token"], subsystem_nqn=kw["nqn"], ramdisk_size=size,
        block_size=int(kw["block_size"]), workers=kw["workers"],
    )
    options = DaemonOptions(**fields)

    def ready(daemon) -> None:
        click.echo(daemon.banner(), err=False)
        sys.stdout.flush()

    try:
        code = run_async(run(options, ready=ready))
    except DaemonError as e:
        click.echo(f"nvmeof serve: {e}", err=True)
        sys.exit(1)
    sys.exit(code)


def register(cli: click.Group) -> None:
    cli.add_command(serve)
