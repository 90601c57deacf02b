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


def _cntlid_range(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    lo, sep, hi = value.partition("-")
    try:
        bounds = (int(lo, 0), int(hi, 0)) if sep else None
    except ValueError:
        bounds = None
    if bounds is None or not defaults.CNTLID_MIN <= bounds[0] <= bounds[1] <= defaults.CNTLID_MAX:
        raise click.BadParameter(f"{value!r}: give LO-HI with {defaults.CNTLID_MIN} <= LO <= HI <= "
                                 f"{defaults.CNTLID_MAX} (0x{defaults.CNTLID_MAX:X}), e.g. 1-2040",
                                 param_hint="--cntlid-range")
    return bounds


def _api(value: str):
    if value.lower() in ("none", "off", "no", ""):
        return None
    if value.startswith("unix:"):
        if not value[5:]:
            raise click.BadParameter("give the socket's path: unix:PATH", param_hint="--api")
        return Path(value[5:])
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
@click.option("--tls", "tls", type=click.Choice(list(defaults.TLS_MODES)), default="none", show_default=True,
              help="NVMe/TCP TLS 1.3 (PSK) of the -l/-d listeners given here: required, optional (TLS or clear) "
                   "or none; hosts' keys: `nvmeof host add ... --tls-key`.")
@click.option("--inline-data-size", "inline_data_size", type=click.IntRange(0, defaults.INLINE_DATA_SIZE_MAX),
              default=defaults.IO_INCAPSULE_SIZE, show_default=True, metavar="BYTES",
              help="In-capsule data per command on the I/O queues of the -l listeners given here (nvmetcli's "
                   "param_inline_data_size, Identify IOCCSZ): a multiple of 16; larger writes go by R2T.")
@click.option("--api", "api", default=f"{defaults.LISTEN_ADDRESS}:{defaults.API_PORT}", show_default=True,
              metavar="ADDR:PORT|unix:PATH|none",
              help="REST API address, a Unix socket (created with mode 0600), or 'none' to disable it.")
@click.option("--api-token", envvar="NVMEOF_API_TOKEN", metavar="TOKEN",
              help="Bearer token of the REST API; a random one is generated at start when not given. Either way "
                   "it is written to <state dir>/api-token (mode 0600), where the nvmeof CLI finds it. "
                   "Env: NVMEOF_API_TOKEN.")
@click.option("--state-dir", "state_dir", envvar="NVMEOF_STATE_DIR", type=click.Path(file_okay=False, path_type=Path),
              help=f"Directory of the API token and endpoint files (created 0700; refused if others can write "
                   f"it). Default {defaults.STATE_DIR_ROOT} for root, else ~/{defaults.STATE_DIR_USER}. "
                   "Env: NVMEOF_STATE_DIR.")
@click.option("--api-host-name", "api_host_names", multiple=True, metavar="NAME",
              help="A DNS name the REST API may be reached by (repeatable). Requests whose Host header is neither "
                   "the API's address nor such a name are refused (DNS rebinding).")
@click.option("--api-max-body", default=str(defaults.API_MAX_BODY), show_default=True, metavar="SIZE",
              help="Largest REST request body (K, M suffixes); larger gets 413.")
@click.option("--nqn", default=defaults.DEFAULT_SUBSYSTEM_NQN, show_default=True,
              help="NQN of the default subsystem (when no configuration exists).")
@click.option("--ramdisk-size", default="1G", show_default=True, metavar="SIZE",
              help="Size of the default RAM-disk namespace (K, M, G suffixes).")
@click.option("--block-size", type=click.Choice(["512", "4096"]), default="512", show_default=True,
              help="Block size of the default namespace.")
@click.option("--workers", type=click.IntRange(0, 256), default=0, show_default=True, metavar="N",
              help="Serve TCP I/O queues from N worker processes (one core each); admin queues and controller "
                   "state stay in the main process. 0 serves everything in one process.")
@click.option("--backing-dir", "backing_dirs", multiple=True, metavar="DIR",
              type=click.Path(file_okay=False, path_type=Path),
              help="Directory file namespaces may live in (repeatable; symbolic links are resolved). Default "
                   f"<state dir>/{defaults.BACKING_DIR}, created 0700. A configuration's backing_dirs add to these.")
@click.option("--allow-block-device", "block_devices", multiple=True, metavar="PATH",
              type=click.Path(dir_okay=False, path_type=Path),
              help="Block device a namespace may use (repeatable); nothing else under /dev, /proc or /sys is served.")
@click.option("--ic-timeout", type=click.FloatRange(min=0, min_open=True), default=defaults.TCP_ICREQ_TIMEOUT,
              show_default=True, metavar="SECONDS", help="Close an NVMe/TCP connection that sends no ICReq in time.")
@click.option("--connect-timeout", type=click.FloatRange(min=0, min_open=True), default=defaults.TCP_CONNECT_TIMEOUT,
              show_default=True, metavar="SECONDS",
              help="Close an NVMe/TCP connection whose Fabrics Connect does not follow the ICResp in time.")
@click.option("--auth-timeout", type=click.FloatRange(min=0, min_open=True), default=defaults.AUTH_TIMEOUT,
              show_default=True, metavar="SECONDS",
              help="Tear down a controller whose DH-HMAC-CHAP transaction makes no progress for this long.")
@click.option("--max-connections", type=click.IntRange(min=1), default=defaults.TCP_MAX_CONNECTIONS,
              show_default=True, metavar="N",
              help="NVMe/TCP connections across all listeners (lowered to fit RLIMIT_NOFILE, with a log line). "
                   "At the cap the oldest connection without a Connect makes room, else a new one is closed.")
@click.option("--max-connections-per-listener", type=click.IntRange(min=1),
              default=defaults.TCP_MAX_CONNECTIONS_PER_LISTENER, show_default=True, metavar="N",
              help="NVMe/TCP connections per listener.")
@click.option("--h2c-budget", default=f"{defaults.TCP_H2C_GLOBAL_BUDGET >> 20}M", show_default=True, metavar="SIZE",
              help="Write data all NVMe/TCP connections together may have asked for by R2T (split across --workers); "
                   "writes beyond it wait their turn.")
@click.option("--ceph-conf", "ceph_confs", multiple=True, metavar="PATH",
              type=click.Path(dir_okay=False, path_type=Path),
              help=f"Ceph configuration file RBD namespaces may use (repeatable); the first is their default "
                   f"(else {defaults.CEPH_CONF}). A configuration's ceph_confs add to these.")
@click.option("--ceph-keyring", "ceph_keyrings", multiple=True, metavar="PATH",
              type=click.Path(dir_okay=False, path_type=Path),
              help="Ceph keyring RBD namespaces may name (repeatable); without one the Ceph configuration decides.")
@click.option("--rbd-image", "rbd_images", multiple=True, metavar="POOL[/NAMESPACE]/IMAGE",
              help="Export this existing RBD image in the default subsystem instead of the RAM disk (repeatable; "
                   "when no configuration exists yet).")
@click.option("--rbd-op-timeout", type=click.FloatRange(min=0, min_open=True), default=defaults.RBD_OP_TIMEOUT,
              show_default=True, metavar="SECONDS",
              help="An RBD namespace's command fails (retryably) when the cluster does not answer in time, "
                   "instead of waiting for it forever.")
@click.option("--poll-us", type=click.IntRange(min=0), default=defaults.POLL_US, show_default=True, metavar="N",
              help="Batch engine: after a batch, keep trying non-blocking receives for up to N microseconds before "
                   f"sleeping (hybrid polling: lower QD1 latency for CPU time); 0 turns it off, at most "
                   f"{defaults.POLL_US_MAX}.")
@click.option("--cntlid-range", "cntlid_range", default=None, metavar="LO-HI",
              help=f"Give controllers IDs only in LO..HI (within {defaults.CNTLID_MIN}-{defaults.CNTLID_MAX}), so "
                   "several targets serving one subsystem to a host never hand out the same ID.")
@click.option("--gateway-group", "gateway_group", metavar="NAME",
              help="Join gateway group NAME: several `nvmeof serve` export the same subsystems, each ANA group "
                   "optimized on one live gateway (its owner) and moved to a survivor when that one dies.")
@click.option("--gateway-name", "gateway_name", metavar="NAME",
              help="This gateway's name in its group (default: the host name); its index, kept in the store, "
                   f"gives it controller IDs [index*{defaults.CNTLID_SPAN}+1, (index+1)*{defaults.CNTLID_SPAN}].")
@click.option("--group-store", "group_store", metavar="dir:PATH|rados:POOL",
              help="Where the group keeps members, shared configuration and ownership locks: a local directory "
                   "(gateways on one machine; file locks, so kill -9 fails over at once) or a RADOS pool (lock "
                   "leases, watch/notify; uses the first --ceph-conf and --ceph-keyring).")
@click.option("--gateway-lease", type=click.FloatRange(min=1), default=defaults.GATEWAY_LEASE, show_default=True,
              metavar="SECONDS", help="How long an ANA group's ownership outlives a gateway that stopped renewing "
                                      "it (rados store); renewed every third of it.")
@click.option("--failback", type=click.Choice(["auto", "manual"]), default="auto", show_default=True,
              help="auto: a group goes back to its preferred gateway once that one is back and ready; manual: it "
                   "stays on the survivor.")
@click.option("--ana-standby", "ana_standby", type=click.Choice(["non-optimized", "inaccessible"]),
              default="non-optimized", show_default=True,
              help="ANA state of the groups another gateway owns: non-optimized (a host always has a usable path) "
                   "or inaccessible (storage where two writers must never be active).")
def serve(**kw) -> None:
    """Run the NVMe-oF target: by default one subsystem with a 1 GiB RAM disk, allowing any host,
    I/O on 127.0.0.1:4420, discovery on 127.0.0.1:8009 and the REST API on 127.0.0.1:8080."""
    from nvmeof.cli.daemon import DaemonError, DaemonOptions
    from nvmeof.cli.daemon import serve as run

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
    fields["state_dir"] = kw["state_dir"]
    fields["backing_dirs"] = list(kw["backing_dirs"])
    fields["block_devices"] = list(kw["block_devices"])
    fields["api_host_names"] = list(kw["api_host_names"])
    try:
        fields["api_max_body"] = parse_size(kw["api_max_body"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--api-max-body") from None
    fields["ic_timeout"] = kw["ic_timeout"]
    fields["connect_timeout"] = kw["connect_timeout"]
    fields["auth_timeout"] = kw["auth_timeout"]
    fields["max_connections"] = kw["max_connections"]
    fields["max_connections_per_listener"] = kw["max_connections_per_listener"]
    try:
        fields["h2c_budget"] = parse_size(kw["h2c_budget"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--h2c-budget") from None
    fields["ceph_confs"] = list(kw["ceph_confs"])
    fields["ceph_keyrings"] = list(kw["ceph_keyrings"])
    fields["rbd_images"] = [_rbd_image(text) for text in kw["rbd_images"]]
    fields["rbd_op_timeout"] = kw["rbd_op_timeout"]
    fields["poll_us"] = kw["poll_us"]
    fields["gateway_group"] = kw["gateway_group"]
    fields["gateway_name"] = kw["gateway_name"]
    fields["group_store"] = kw["group_store"]
    fields["gateway_lease"] = kw["gateway_lease"]
    fields["failback"] = kw["failback"]
    fields["ana_standby"] = kw["ana_standby"]
    fields["cntlid_range"] = _cntlid_range(kw["cntlid_range"])
    fields["tls"] = kw["tls"]
    fields["inline_data_size"] = kw["inline_data_size"]
    options = DaemonOptions(**fields)

    def ready(daemon) -> None:
        click.echo(daemon.banner(), err=False)
        sys.stdout.flush()

    from target.backends.rbd import exit_process

    try:
        code = run_async(run(options, ready=ready))
    except DaemonError as e:
        click.echo(f"nvmeof serve: {e}", err=True)
        code = 1
    exit_process(code)   # an RBD image that would not close must not meet exit()'s teardown


def register(cli: click.Group) -> None:
    cli.add_command(serve)


def _rbd_image(text: str) -> dict[str, str]:
    """POOL/IMAGE or POOL/NAMESPACE/IMAGE, as the rbd CLI writes an image spec."""
    parts = text.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise click.BadParameter(f"{text!r} is not POOL/IMAGE or POOL/NAMESPACE/IMAGE", param_hint="--rbd-image")
    spec = {"pool": parts[0], "image": parts[-1]}
    if len(parts) == 3:
        spec["rbd_namespace"] = parts[1]
    return spec
