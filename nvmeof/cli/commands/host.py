"""Host-side commands: discovery, kernel attach, and direct I/O through the Python initiator.

Exit codes scripts can rely on: 0 success, 1 the target answered with an NVMe error status,
2 usage error, 3 the target could not be reached or the connection failed, 4 kernel attach failed.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable

import click

from nvmeof import defaults
from nvmeof.auth import AuthFailure
from nvmeof.spec.identify import NSID_MAX
from nvmeof.spec.nvme import FeatureId, LogPageId
from nvmeof.status import NvmeError

from .. import render
from ..render import output_format_options, wants_json
from .common import echo_json, format_size, parse_size, table

EXIT_NVME_STATUS = 1
EXIT_CONNECT = 3
EXIT_KERNEL = 4


def _secret_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> object:
    """Check a DHHC-1 secret while parsing the command line; the error never repeats the value."""
    if value is None:
        return None
    from nvmeof.auth import DhchapSecret

    try:
        return DhchapSecret.parse(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def dhchap_options(f: Callable) -> Callable:
    """nvme-cli's -S/--dhchap-secret and -C/--dhchap-ctrl-secret (DH-HMAC-CHAP, `nvme gen-dhchap-key`)."""
    f = click.option("-C", "--dhchap-ctrl-secret", "dhchap_ctrl_secret", callback=_secret_callback,
                     metavar="DHHC-1:NN:...:", help="Controller secret: authenticate the controller too "
                     "(bidirectional).")(f)
    return click.option("-S", "--dhchap-secret", "dhchap_secret", callback=_secret_callback,
                        metavar="DHHC-1:NN:...:", help="Host secret for DH-HMAC-CHAP in-band authentication "
                        "(`nvmeof gen-dhchap-key`).")(f)


def _tls_key_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> object:
    """Check an NVMeTLSkey-1 PSK while parsing the command line; the error never repeats the value."""
    if value is None:
        return None
    from nvmeof.tls.psk import TlsKey

    try:
        return TlsKey.parse(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def tls_options(f: Callable) -> Callable:
    """nvme-cli's --tls and --tls-key (NVMe/TCP over TLS 1.3 with a configured PSK, `nvme gen-tls-key`)."""
    f = click.option("--tls-identity", "tls_identity_version", type=click.IntRange(0, 1),
                     default=defaults.TLS_IDENTITY_VERSION, show_default=True,
                     help="PSK identity version: 1 NVMe1R (with the PSK digest), 0 NVMe0R.")(f)
    f = click.option("--tls-key", "tls_key", callback=_tls_key_callback, metavar="NVMeTLSkey-1:NN:...:",
                     help="The configured TLS PSK (`nvmeof gen-tls-key`); implies --tls. Never printed.")(f)
    return click.option("--tls", is_flag=True, help="Connect over TLS 1.3 (the Python host needs --tls-key; "
                        "`connect`, the kernel host, may find its key in the .nvme keyring).")(f)


def tls_binder_option(f: Callable) -> Callable:
    """--tls-sha256-binder, the Python host's interop switch (the kernel host's tlshd binds as its GnuTLS does)."""
    return click.option("--tls-sha256-binder", "tls_sha256_binder", is_flag=True,
                        help="Offer a SHA-384 PSK (NVMeTLSkey-1:02:) with a SHA-256 binder and suite, as a Linux "
                        "nvmet TLS port whose tlshd runs on GnuTLS before 3.8.11 needs (TP 8011: SHA-384).")(f)


def tls_kwargs(tls: bool, tls_key: object, version: int, sha256_binder: bool = False) -> dict[str, object]:
    """connect()'s TLS arguments from the command line; --tls alone is refused (no keyring is read)."""
    if tls and tls_key is None:
        raise click.UsageError("--tls needs --tls-key NVMeTLSkey-1:...: (this host reads no kernel keyring)")
    if sha256_binder and tls_key is None:
        raise click.UsageError("--tls-sha256-binder needs --tls-key NVMeTLSkey-1:02:...: (a SHA-384 PSK)")
    if tls_key is None:
        return {}
    return {"tls_key": tls_key, "tls_identity_version": version,
            **({"tls_sha256_binder": True} if sha256_binder else {})}


def connection_options(default_port: int, *, nqn_required: bool = True) -> Callable:
    """The nvme-cli spellings: -t -a -s -n -q -I -S -C, plus digests and queue counts."""
    def deco(f: Callable) -> Callable:
        opts = [
            click.option("-t", "--transport", type=click.Choice(["tcp", "rdma"]), default="tcp",
                         show_default=True),
            click.option("-a", "--traddr", default=defaults.LISTEN_ADDRESS, show_default=True,
                         help="Target address."),
            click.option("-s", "--trsvcid", type=click.IntRange(1, defaults.PORT_MAX), default=default_port,
                         show_default=True, help="Target port."),
            click.option("-q", "--hostnqn", help="Host NQN (default: generated, or /etc/nvme/hostnqn)."),
            click.option("-I", "--hostid", help="Host identifier (UUID)."),
            click.option("--hdr-digest", is_flag=True, help="Negotiate the NVMe/TCP header digest."),
            click.option("--data-digest", is_flag=True, help="Negotiate the NVMe/TCP data digest."),
            click.option("--timeout", type=float, default=30.0, show_default=True,
                         help="Seconds to wait for each command."),
        ]
        if nqn_required:
            opts.append(click.option("-n", "--nqn", required=True, help="Subsystem NQN."))
        names = ["transport", "traddr", "trsvcid", "hostnqn", "hostid", "hdr_digest", "data_digest", "timeout",
                 "dhchap_secret", "dhchap_ctrl_secret", "tls", "tls_key", "tls_identity_version",
                 "tls_sha256_binder"] + (["nqn"] if nqn_required else [])

        @functools.wraps(f)
        def collect(**kwargs):
            conn = {name: kwargs.pop(name) for name in names}
            conn["as_json"] = wants_json(kwargs.pop("output_format"), kwargs.pop("as_json"))
            return f(conn, **kwargs)

        for opt in reversed(opts):
            collect = opt(collect)
        return output_format_options(dhchap_options(tls_options(tls_binder_option(collect))))
    return deco


def run_guarded(coro) -> object:
    """Run one initiator coroutine, turning errors into a message and a stable exit code."""
    try:
        return asyncio.run(coro)
    except NvmeError as e:
        click.echo(f"nvmeof: the target answered {e}", err=True)
        sys.exit(EXIT_NVME_STATUS)
    except AuthFailure as e:
        click.echo(f"nvmeof: {e}", err=True)
        sys.exit(EXIT_NVME_STATUS)
    # TransportError is an OSError; the initiator's connect-time checks (CNTLID, ICDOFF, KAS, a
    # discovery log that keeps changing) raise RuntimeError.
    except (TimeoutError, OSError, RuntimeError) as e:
        click.echo(f"nvmeof: {e or type(e).__name__}", err=True)
        sys.exit(EXIT_CONNECT)


async def _open(conn: dict, *, nr_io_queues: int = 1):
    """Connect the Python initiator with the command line's connection options."""
    import initiator

    return await initiator.connect(conn["traddr"], trsvcid=conn["trsvcid"], subnqn=conn["nqn"],
                                   hostnqn=conn["hostnqn"], hostid=conn["hostid"], transport=conn["transport"],
                                   hdr_digest=conn["hdr_digest"], data_digest=conn["data_digest"],
                                   timeout=conn["timeout"], nr_io_queues=nr_io_queues,
                                   dhchap_secret=conn["dhchap_secret"], dhchap_ctrl_secret=conn["dhchap_ctrl_secret"],
                                   **tls_kwargs(conn["tls"], conn["tls_key"], conn["tls_identity_version"],
                                              conn["tls_sha256_binder"]))


@click.command()
@connection_options(defaults.TCP_DISCOVERY_PORT, nqn_required=False)
def discover(conn) -> None:
    """Read a discovery controller's log: the subsystems and where to reach them (as `nvme discover`)."""
    genctr, entries = run_guarded(_discover(conn))
    if conn["as_json"]:
        echo_json(render.discovery_log_json(genctr, entries))
    else:
        click.echo(render.discovery_log_text(genctr, entries))


async def _discover(conn: dict) -> tuple[int, list]:
    """(genctr, entries): initiator.discover's sequence, keeping the generation counter nvme-cli prints."""
    from initiator.controller import HostController
    from initiator.discovery import read_discovery_log

    ctrl = HostController(conn["traddr"], conn["trsvcid"], defaults.DISCOVERY_NQN, hostnqn=conn["hostnqn"],
                          hostid=conn["hostid"], transport=conn["transport"], nr_io_queues=0, kato=0,
                          hdr_digest=conn["hdr_digest"], data_digest=conn["data_digest"], timeout=conn["timeout"],
                          dhchap_secret=conn["dhchap_secret"], dhchap_ctrl_secret=conn["dhchap_ctrl_secret"],
                          **tls_kwargs(conn["tls"], conn["tls_key"], conn["tls_identity_version"],
                                              conn["tls_sha256_binder"]))
    await ctrl.open()
    try:
        return await read_discovery_log(ctrl)
    finally:
        await ctrl.disconnect()


async def _identify(conn: dict) -> dict:
    async with await _open(conn, nr_io_queues=0) as ctrl:
        idc = await ctrl.identify_controller()
        namespaces = []
        for nsid in await ctrl.namespaces():
            ns = await ctrl.identify_namespace(nsid)
            lbads = ns["lbaf"][ns["flbas"] & 0xF]["lbads"]
            # nvme id-ns's fields, led by the NSID and the sizes it implies
            namespaces.append({"nsid": nsid, "block_size": 1 << lbads, "size": ns["nsze"] << lbads,
                               **render.id_ns_json(ns)})
        return {"controller": idc, "namespaces": namespaces}


@click.command()
@connection_options(defaults.TCP_IO_PORT)
def identify(conn) -> None:
    """Identify a subsystem's controller and its namespaces through the Python initiator.

    JSON: {"controller": what `nvme id-ctrl -o json` prints, "namespaces": [nsid, block_size, size and what
    `nvme id-ns -o json` prints]}."""
    out = run_guarded(_identify(conn))
    if conn["as_json"]:
        echo_json({"controller": render.id_ctrl_json(out["controller"]), "namespaces": out["namespaces"]})
        return
    click.echo(render.id_ctrl_text(out["controller"]))
    click.echo()
    click.echo(table(["nsid", "size", "blocks", "block size", "nguid"],
                     [[n["nsid"], format_size(n["size"]), n["nsze"], n["block_size"], n["nguid"]]
                      for n in out["namespaces"]]))


async def _read(conn: dict, nsid: int, slba: int, nlb: int) -> bytes:
    async with await _open(conn) as ctrl:
        return bytes(await ctrl.read(nsid, slba, nlb))


@click.command()
@connection_options(defaults.TCP_IO_PORT)
@click.option("--nsid", type=click.IntRange(1, NSID_MAX), default=1, show_default=True)
@click.option("--slba", "-z", type=click.IntRange(0), default=0, show_default=True, help="Starting LBA.")
@click.option("--nlb", "-c", type=click.IntRange(1), default=1, show_default=True, help="Number of blocks.")
@click.option("-d", "--data", "--output", "output", type=click.File("wb"), default="-",
              help="Where to write the data (stdout); nvme-cli's -d/--data (-o is the output format).")
def read(conn, nsid, slba, nlb, output) -> None:
    """Read NLB blocks from SLBA of namespace NSID."""
    data = run_guarded(_read(conn, nsid, slba, nlb))
    if conn["as_json"]:
        echo_json({"nsid": nsid, "slba": slba, "nlb": nlb, "length": len(data), "data": data.hex()})
        return
    output.write(data)


async def _write(conn: dict, nsid: int, slba: int, data: bytes, fua: bool) -> int:
    async with await _open(conn) as ctrl:
        ns = await ctrl.identify_namespace(nsid)
        block = 1 << ns["lbaf"][ns["flbas"] & 0xF]["lbads"]
        if len(data) % block:
            data += bytes(block - len(data) % block)
        await ctrl.write(nsid, slba, data, fua=fua)
        return len(data) // block


@click.command()
@connection_options(defaults.TCP_IO_PORT)
@click.option("--nsid", type=click.IntRange(1, NSID_MAX), default=1, show_default=True)
@click.option("--slba", "-z", type=click.IntRange(0), default=0, show_default=True, help="Starting LBA.")
@click.option("-i", "--input", "input_", type=click.File("rb"), default="-",
              help="Data to write (default stdin); padded with zeros to a whole block.")
@click.option("--fua", is_flag=True, help="Force unit access.")
def write(conn, nsid, slba, input_, fua) -> None:
    """Write data to namespace NSID starting at SLBA."""
    data = input_.read()
    if not data:
        raise click.UsageError("no data to write: give --input FILE or pipe data in")
    nlb = run_guarded(_write(conn, nsid, slba, data, fua))
    if conn["as_json"]:
        echo_json({"nsid": nsid, "slba": slba, "nlb": nlb})
    else:
        click.echo(f"wrote {nlb} blocks at LBA {slba} of nsid {nsid}", err=True)


def _int_or_name(enum_cls):
    def convert(ctx, param, value):
        if value is None:
            return None
        try:
            return int(value, 0)
        except ValueError:
            try:
                return enum_cls[value.upper().replace("-", "_")].value
            except KeyError:
                names = ", ".join(m.name.lower() for m in enum_cls)
                raise click.BadParameter(f"{value!r} is neither a number nor one of: {names}") from None
    return convert


async def _get_log(conn: dict, lid: int, length: int, offset: int, nsid: int) -> bytes:
    async with await _open(conn, nr_io_queues=0) as ctrl:
        return bytes(await ctrl.get_log_page(lid, length, offset=offset, nsid=nsid))


@click.command("get-log")
@connection_options(defaults.TCP_IO_PORT)
@click.option("--lid", "-i", required=True, callback=_int_or_name(LogPageId),
              help="Log page id: a number or one of error, smart, fw_slot, changed_ns, cmd_effects.")
@click.option("--len", "-l", "length", default="512", show_default=True, help="Bytes to read.")
@click.option("--lpo", "-L", "--offset", "lpo", type=click.IntRange(0), default=0, show_default=True,
              help="Log page offset in bytes (nvme-cli's -L/--lpo; -o is the output format).")
@click.option("--nsid", type=click.IntRange(0, 0xFFFFFFFF), default=0xFFFFFFFF)
@click.option("--raw", "-b", "--raw-binary", "raw_out", is_flag=True, help="Write the raw bytes to stdout.")
def get_log(conn, lid, length, lpo, nsid, raw_out) -> None:
    """Read a log page (decoded for SMART, error and firmware slot pages)."""
    try:
        nbytes = parse_size(length)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--len") from None
    if nbytes % 4 or nbytes == 0:
        raise click.BadParameter("the length must be a non-zero multiple of 4 bytes", param_hint="--len")
    data = run_guarded(_get_log(conn, lid, nbytes, lpo, nsid))
    if raw_out:
        sys.stdout.buffer.write(data)
        return
    decoded = _decode_log(lid, data, conn["nqn"]) if lpo == 0 else None
    if decoded is None:
        if conn["as_json"]:
            echo_json({"lid": lid, "lpo": lpo, "length": len(data), "data": data.hex()})
        else:
            click.echo(data.hex(" ", 16))
    elif conn["as_json"]:
        echo_json(decoded)
    elif "errors" in decoded:
        for i, entry in enumerate(decoded["errors"]):
            click.echo(f"Entry[{i:2}]")
            click.echo("\n".join(f"{k:<22}: {v}" for k, v in entry.items()))
    else:
        body = next(iter(decoded.values())) if lid == LogPageId.FW_SLOT else decoded
        click.echo("\n".join(f"{k:<40}: {v}" for k, v in body.items()))


def _decode_log(lid: int, data: bytes, device: str) -> dict | None:
    """The pages nvme-cli decodes, in its JSON shapes (error-log, smart-log, fw-log)."""
    from nvmeof.spec import logs

    try:
        if lid == LogPageId.SMART and len(data) >= 512:
            return render.smart_log_json(logs.SmartLog.parse(data[:512]))
        if lid == LogPageId.ERROR and len(data) >= 64:
            entries = [logs.ErrorLogEntry.parse(data[i:i + 64]) for i in range(0, len(data) - 63, 64)]
            return render.error_log_json(e for e in entries if e["error_count"])  # empty slots: not errors
        if lid == LogPageId.FW_SLOT and len(data) >= 512:
            return render.fw_log_json(logs.FirmwareSlotLog.parse(data[:512]), device)
    except Exception:  # an undecodable page is still shown raw
        return None
    return None


async def _get_feature(conn: dict, fid: int, sel: int, cdw11: int, nsid: int):
    async with await _open(conn, nr_io_queues=0) as ctrl:
        return await ctrl.get_features(fid, sel=sel, cdw11=cdw11, nsid=nsid)


@click.command("get-feature")
@connection_options(defaults.TCP_IO_PORT)
@click.option("--fid", "-f", required=True, callback=_int_or_name(FeatureId),
              help="Feature id: a number or a name such as num_queues, kato, volatile_wc.")
@click.option("--sel", "sel", type=click.IntRange(0, 3), default=0, show_default=True,
              help="0 current, 1 default, 2 saved, 3 supported capabilities.")
@click.option("--cdw11", type=click.IntRange(0, 0xFFFFFFFF), default=0)
@click.option("--nsid", type=click.IntRange(0, 0xFFFFFFFF), default=0)
def get_feature(conn, fid, sel, cdw11, nsid) -> None:
    """Get a feature's value (CQE dword 0)."""
    result = run_guarded(_get_feature(conn, fid, sel, cdw11, nsid))
    value = result[0] if isinstance(result, tuple) else result
    dw0 = value if isinstance(value, int) else getattr(value, "dw0", value)
    if conn["as_json"]:
        echo_json(render.feature_json(fid, sel, dw0))
    else:
        click.echo(render.feature_text(fid, sel, dw0))


def _kernel_guard(func: Callable) -> Callable:
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from initiator.kernel import KernelAttachError

        try:
            return func(*args, **kwargs)
        except KernelAttachError as e:
            click.echo(f"nvmeof: {e}", err=True)
            sys.exit(EXIT_KERNEL)
    return wrapper


@click.command()
@click.option("-t", "--transport", type=click.Choice(["tcp", "rdma"]), default="tcp", show_default=True)
@click.option("-a", "--traddr", default=defaults.LISTEN_ADDRESS, show_default=True)
@click.option("-s", "--trsvcid", type=click.IntRange(1, defaults.PORT_MAX), default=defaults.TCP_IO_PORT,
              show_default=True)
@click.option("-n", "--nqn", help="Subsystem NQN.")
@click.option("-q", "--hostnqn")
@click.option("-I", "--hostid")
@click.option("-i", "--nr-io-queues", type=click.IntRange(1, 1024))
@click.option("-Q", "--queue-size", type=click.IntRange(2, 1024))
@click.option("-k", "--keep-alive-tmo", "kato", type=click.IntRange(0))
@click.option("-g", "--hdr-digest", is_flag=True)
@click.option("-G", "--data-digest", is_flag=True)
@click.option("--list", "list_only", is_flag=True, help="List the kernel's fabrics controllers and exit "
              "(`nvmeof list` prints them as nvme-cli does).")
@output_format_options
@dhchap_options
@tls_options
@_kernel_guard
def connect(transport, traddr, trsvcid, nqn, hostnqn, hostid, nr_io_queues, queue_size, kato, hdr_digest,
            data_digest, list_only, output_format, as_json, dhchap_secret, dhchap_ctrl_secret, tls, tls_key,
            tls_identity_version) -> None:
    """Attach a subsystem through the Linux kernel host (like `nvme connect`); prints the block devices.

    -o json prints {"device": "nvmeN"} as nvme-cli does, with cntlid, subnqn and the block devices added.
    --list keeps its own rows (one per controller, sysfs names); `nvmeof list` prints nvme-cli's shape."""
    from initiator import kernel

    as_json = wants_json(output_format, as_json)
    if list_only:
        ctrls = kernel.controllers()
        if as_json:
            echo_json(ctrls)
        else:
            click.echo(render.kernel_list_text(ctrls, table))
        return
    if not nqn:
        raise click.UsageError("missing -n/--nqn: the subsystem NQN to connect to (see `nvmeof discover`)")
    ctrl = kernel.connect(traddr, trsvcid, subnqn=nqn, transport=transport, hostnqn=hostnqn, hostid=hostid,
                          nr_io_queues=nr_io_queues, queue_size=queue_size, kato=kato, hdr_digest=hdr_digest,
                          data_digest=data_digest,
                          dhchap_secret=dhchap_secret.format() if dhchap_secret else None,
                          dhchap_ctrl_secret=dhchap_ctrl_secret.format() if dhchap_ctrl_secret else None,
                          tls=tls, tls_key=tls_key.format() if tls_key else None,
                          tls_identity_version=tls_identity_version)
    if as_json:
        # nvme-cli's fabrics.c hook_connected prints {"device": name}; the rest is what we know besides
        echo_json({"device": ctrl.name, **vars(ctrl)})
    else:
        click.echo(f"connected {ctrl.name} (cntlid {ctrl.cntlid}) to {nqn}: "
                   f"{' '.join(ctrl.block_devices) or 'no namespaces yet'}")


@click.command()
@click.option("-n", "--nqn", help="Disconnect every controller of this subsystem.")
@click.option("-d", "--device", help="Disconnect one controller, e.g. nvme0.")
@output_format_options
@_kernel_guard
def disconnect(nqn, device, output_format, as_json) -> None:
    """Detach kernel-host controllers (like `nvme disconnect`)."""
    from initiator import kernel

    if bool(nqn) == bool(device):
        raise click.UsageError("give exactly one of -n/--nqn or -d/--device")
    if device:
        names = [device.removeprefix("/dev/")]
        kernel.disconnect(names[0])
    else:
        names = kernel.disconnect_nqn(nqn)
        if not names:
            click.echo(f"nvmeof: no controller is connected to {nqn}", err=True)
            sys.exit(EXIT_KERNEL)
    if wants_json(output_format, as_json):
        echo_json({"disconnected": names})
    else:
        # nvme-cli's words (fabrics.c: "NQN:%s disconnected %d controller(s)")
        click.echo(f"{f'NQN:{nqn} ' if nqn else ''}disconnected {len(names)} controller(s): {' '.join(names)}")


@click.command("list")
@output_format_options
@_kernel_guard
def list_(output_format, as_json) -> None:
    """List the Linux kernel host's NVMe over Fabrics controllers and their namespaces (like `nvme list -v`)."""
    from initiator import kernel

    ctrls = kernel.controllers_detail()
    if wants_json(output_format, as_json):
        echo_json(render.kernel_list_json(ctrls))
    else:
        click.echo(render.kernel_list_text(ctrls, table))


@click.command("gen-dhchap-key")
@click.option("-s", "--secret", help="Optional secret (in hexadecimal characters) to be used to initialize the "
              "host key.")
@click.option("-l", "--key-length", "key_length", type=int, default=None,
              help="Length of the resulting key (32, 48, or 64 bytes).")
@click.option("-n", "--nqn", help="Host NQN to use for key transformation (default: /etc/nvme/hostnqn).")
@click.option("-m", "--hmac", "hmac_id", type=int, default=0, show_default=True,
              help="HMAC function to use for key transformation (0 = none, 1 = SHA-256, 2 = SHA-384, 3 = SHA-512).")
def gen_dhchap_key(secret, key_length, nqn, hmac_id) -> None:
    """Generate a DH-HMAC-CHAP host key usable for NVMe In-Band Authentication (like `nvme gen-dhchap-key`)."""
    from initiator.controller import HOSTNQN_FILE
    from nvmeof.auth import generate_secret

    raw = None
    if secret is not None:
        text = secret.strip()
        try:
            if len(text) % 2:
                raise ValueError
            raw = bytes.fromhex(text)
        except ValueError:
            raise click.BadParameter("not an even number of hexadecimal characters", param_hint="'--secret'") from None
    if nqn is None and hmac_id:
        # nvme-cli reads the host NQN file when --nqn is not given
        try:
            with open(HOSTNQN_FILE, encoding="utf-8") as f:
                nqn = f.readline().strip() or None
        except OSError:
            nqn = None
        if nqn is None:
            raise click.UsageError(f"could not read the host NQN from {HOSTNQN_FILE}: give --nqn")
    try:
        click.echo(generate_secret(key_len=key_length, hmac_id=hmac_id, nqn=nqn, secret=raw))
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@click.command("gen-tls-key")
@click.option("-s", "--secret", help="Optional secret (in hexadecimal characters) to be used for the TLS key.")
@click.option("-m", "--hmac", "hmac_id", type=click.IntRange(1, 2), default=1, show_default=True,
              help="HMAC function of the PSK (1 = SHA-256: 32 bytes, 2 = SHA-384: 48 bytes).")
@click.option("-q", "--hostnqn", help="With --subsysnqn: also print the PSK identity this host offers.")
@click.option("-n", "--subsysnqn", help="With --hostnqn: also print the PSK identity this host offers.")
@click.option("-I", "--identity", "version", type=click.IntRange(0, 1), default=defaults.TLS_IDENTITY_VERSION,
              show_default=True, help="PSK identity version (0: NVMe0R, 1: NVMe1R with the PSK digest).")
def gen_tls_key(secret, hmac_id, hostnqn, subsysnqn, version) -> None:
    """Generate a TLS PSK in the NVMe interchange format (like `nvme gen-tls-key`): NVMeTLSkey-1:0N:...:"""
    from nvmeof.tls.psk import TlsKey, generate_key

    raw = None
    if secret is not None:
        try:
            raw = bytes.fromhex(secret.strip())
        except ValueError:
            raise click.BadParameter("not an even number of hexadecimal characters", param_hint="'--secret'") from None
    try:
        key = generate_key(hmac_id=hmac_id, secret=raw)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(key)
    if hostnqn and subsysnqn:
        click.echo(f"identity: {TlsKey.parse(key).identity(hostnqn, subsysnqn, version)}", err=True)


def register(cli: click.Group) -> None:
    for cmd in (discover, identify, read, write, get_log, get_feature, connect, disconnect, list_, gen_dhchap_key,
                gen_tls_key):
        cli.add_command(cmd)
