"""Attach NVMe-oF controllers through the Linux kernel host, the way nvme-cli does.

The kernel host is driven by writing an option string to ``/dev/nvme-fabrics`` (drivers/nvme/host/
fabrics.c ``nvmf_dev_write``); reading the same file descriptor back gives ``instance=N,cntlid=M``.
Block devices are found with pyudev: ``nvmeNnM`` without native multipath, or the multipath head
``nvmeXnM`` of the controller's subsystem ``nvme-subsysX`` with it.
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from initiator.controller import default_host_identity
from nvmeof import defaults
from nvmeof.auth import DhchapSecret

FABRICS_DEV = "/dev/nvme-fabrics"
SYS_NVME = Path("/sys/class/nvme")
SYS_NVME_SUBSYS = Path("/sys/class/nvme-subsystem")
SYS_BLOCK = Path("/sys/class/block")


class KernelAttachError(Exception):
    """The kernel host could not attach or detach; the message says why and what to do."""


@dataclass
class KernelController:
    name: str           # nvmeN
    instance: int
    cntlid: int
    subnqn: str
    transport: str
    traddr: str
    trsvcid: int
    block_devices: list[str] = field(default_factory=list)

    @property
    def device(self) -> str:
        return f"/dev/{self.name}"


def build_options(*, subnqn: str, transport: str, traddr: str, trsvcid: int, hostnqn: str, hostid: str,
                  nr_io_queues: int | None = None, queue_size: int | None = None, kato: int | None = None,
                  ctrl_loss_tmo: int | None = None, reconnect_delay: int | None = None,
                  hdr_digest: bool = False, data_digest: bool = False, disable_sqflow: bool = False,
                  host_traddr: str | None = None, dhchap_secret: str | None = None,
                  dhchap_ctrl_secret: str | None = None, tls: bool = False, tls_key_id: int | None = None) -> str:
    """The option string nvme-cli writes (libnvme ``build_options``); values are validated first.

    It carries the DH-HMAC-CHAP secrets: never log it or put it in an exception."""
    for name, value in (("subnqn", subnqn), ("traddr", traddr), ("hostnqn", hostnqn)):
        if not value or "," in value or "\n" in value:
            raise KernelAttachError(f"invalid {name} {value!r}: it must be non-empty without commas")
    if transport not in ("tcp", "rdma", "loop"):
        raise KernelAttachError(f"unknown transport {transport!r}: use tcp or rdma")
    opts = [f"nqn={subnqn}", f"transport={transport}"]
    if transport != "loop":
        opts += [f"traddr={traddr}", f"trsvcid={trsvcid}"]
    if host_traddr:
        opts.append(f"host_traddr={host_traddr}")
    opts += [f"hostnqn={hostnqn}", f"hostid={hostid}"]
    # libnvme build_options: dhchap_secret / dhchap_ctrl_secret right after the host identity, checked here
    # (DHHC-1 form, length, CRC) so a typo fails with a reason instead of the kernel's bare EINVAL
    for key, secret in (("dhchap_secret", dhchap_secret), ("dhchap_ctrl_secret", dhchap_ctrl_secret)):
        if secret is not None:
            try:
                text = DhchapSecret.parse(secret).format()
            except ValueError as e:
                raise KernelAttachError(f"invalid {key} (--{key.replace('_', '-')}): {e}") from None
            opts.append(f"{key}={text}")
    if dhchap_ctrl_secret is not None and dhchap_secret is None:
        raise KernelAttachError("dhchap_ctrl_secret (--dhchap-ctrl-secret) needs dhchap_secret (--dhchap-secret)")
    for key, value in (("nr_io_queues", nr_io_queues), ("queue_size", queue_size), ("keep_alive_tmo", kato),
                       ("ctrl_loss_tmo", ctrl_loss_tmo), ("reconnect_delay", reconnect_delay)):
        if value is not None:
            opts.append(f"{key}={int(value)}")
    if hdr_digest:
        opts.append("hdr_digest")
    if data_digest:
        opts.append("data_digest")
    if disable_sqflow:
        opts.append("disable_sqflow")
    # libnvme build_options: "tls" (the kernel picks the PSK from its .nvme keyring, nvme_tls_psk_default)
    # and, for one given key, "tls_key=<serial>"
    if tls or tls_key_id is not None:
        if transport != "tcp":
            raise KernelAttachError(f"--tls needs transport tcp, not {transport}")
        opts.append("tls")
    if tls_key_id is not None:
        opts.append(f"tls_key={int(tls_key_id)}")
    return ",".join(opts)


_SYS_ADD_KEY = {"x86_64": 248, "aarch64": 217}


def nvme_keyring_id(proc_keys: str = "/proc/keys") -> int:
    """The serial of the kernel's ``.nvme`` keyring (libnvme nvme_lookup_keyring reads /proc/keys too)."""
    try:
        lines = Path(proc_keys).read_text().splitlines()
    except OSError as e:
        raise KernelAttachError(f"cannot read {proc_keys}: {e.strerror}") from e
    for line in lines:
        fields = line.split(None, 8)
        if len(fields) == 9 and fields[7] == "keyring" and fields[8].split(":", 1)[0] == ".nvme":
            return int(fields[0], 16)
    raise KernelAttachError("the kernel has no .nvme keyring: load nvme-tcp from a kernel with "
                            "CONFIG_NVME_TCP_TLS (and CONFIG_NVME_KEYRING)")


def insert_tls_key(tls_key: str, hostnqn: str, subnqn: str, version: int = defaults.TLS_IDENTITY_VERSION) -> int:
    """Put the TLS PSK of a configured key into the .nvme keyring under its identity, as `nvme check-tls-key
    --insert` does (libnvme __nvme_insert_tls_key: add_key("psk", identity, TLS PSK)); returns its serial."""
    import ctypes
    import platform

    from nvmeof.tls.psk import TlsKey

    try:
        key = TlsKey.parse(tls_key)
    except ValueError as e:
        raise KernelAttachError(f"invalid --tls-key: {e}") from None
    identity = key.identity(hostnqn, subnqn, version)
    psk = key.tls_psk(identity)
    number = _SYS_ADD_KEY.get(platform.machine())
    if number is None:
        raise KernelAttachError(f"inserting a TLS key is not supported on {platform.machine()}; use nvme-cli's "
                                "check-tls-key --insert")
    keyring = nvme_keyring_id()
    libc = ctypes.CDLL(None, use_errno=True)
    serial = libc.syscall(number, b"psk", str(identity).encode(), psk, ctypes.c_size_t(len(psk)),
                          ctypes.c_int32(keyring))
    if serial < 0:
        err = ctypes.get_errno()
        raise KernelAttachError(f"cannot add the TLS PSK to the .nvme keyring: {os.strerror(err)}")
    return int(serial)


def _explain_write_error(e: OSError, transport: str) -> str:
    if e.errno == errno.EINVAL:
        return (f"the kernel rejected the options ({e.strerror}); check that the nvme-{transport} module is "
                f"loaded (modprobe nvme-{transport}) and see dmesg for the reason")
    if e.errno == errno.ECONNREFUSED:
        return "connection refused: is the target listening on that address and port?"
    if e.errno in (errno.EIO, errno.ENOTCONN, errno.ECONNRESET):
        return (f"the target refused or dropped the connection ({e.strerror}); see dmesg: typical causes are "
                "a wrong subsystem NQN or a host NQN that the subsystem does not allow")
    if e.errno in (errno.EKEYREJECTED, errno.ENOKEY, errno.EACCES):
        return (f"DH-HMAC-CHAP authentication failed ({e.strerror}): check --dhchap-secret / --dhchap-ctrl-secret "
                "against the keys the target has for this host; dmesg names the queue and the reason")
    if e.errno == errno.EALREADY:
        return "already connected to this subsystem through the same address (nvme list shows it)"
    return f"{e.strerror} (errno {e.errno}); see dmesg"


def connect(traddr: str, trsvcid: int = defaults.TCP_IO_PORT, *, subnqn: str, transport: str = "tcp",
            hostnqn: str | None = None, hostid: str | None = None, nr_io_queues: int | None = None,
            queue_size: int | None = None, kato: int | None = None, hdr_digest: bool = False,
            data_digest: bool = False, ctrl_loss_tmo: int | None = None, wait_for_devices: float = 10.0,
            dhchap_secret: str | None = None, dhchap_ctrl_secret: str | None = None, tls: bool = False,
            tls_key: str | None = None,
            tls_identity_version: int = defaults.TLS_IDENTITY_VERSION) -> KernelController:
    """Connect through the kernel host and return the controller with its block devices.

    ``tls``: NVMe/TCP over TLS with the PSK the kernel finds in its .nvme keyring; ``tls_key`` (an NVMeTLSkey-1
    configured PSK) is first inserted there under this host's identity and named by serial."""
    if not os.path.exists(FABRICS_DEV):
        raise KernelAttachError(
            # One module name only: modprobe reads any further words as parameters of the first module.
            # nvme-TRANSPORT pulls nvme-fabrics (and nvme-core) in as its dependencies.
            f"{FABRICS_DEV} does not exist: this kernel has no NVMe over Fabrics host loaded. Load it with "
            f"'modprobe nvme-{transport}' as root (the kernel needs CONFIG_NVME_FABRICS and "
            f"CONFIG_NVME_{transport.upper()})")
    if not hostnqn or not hostid:
        # The same identity the Python initiator presents: /etc/nvme/hostnqn and hostid as nvme-cli reads them.
        default_nqn, default_id = default_host_identity()
        hostnqn = hostnqn or default_nqn
        hostid = hostid or str(default_id)
    tls_key_id = insert_tls_key(tls_key, hostnqn, subnqn, tls_identity_version) if tls_key else None
    options = build_options(subnqn=subnqn, transport=transport, traddr=traddr, trsvcid=trsvcid,
                            hostnqn=hostnqn, hostid=hostid, nr_io_queues=nr_io_queues, queue_size=queue_size,
                            kato=kato, hdr_digest=hdr_digest, data_digest=data_digest,
                            ctrl_loss_tmo=ctrl_loss_tmo, dhchap_secret=dhchap_secret,
                            dhchap_ctrl_secret=dhchap_ctrl_secret, tls=tls, tls_key_id=tls_key_id)
    try:
        fd = os.open(FABRICS_DEV, os.O_RDWR)
    except PermissionError as e:
        raise KernelAttachError(f"cannot open {FABRICS_DEV}: {e.strerror}; run as root") from e
    try:
        try:
            os.write(fd, options.encode())
        except OSError as e:
            raise KernelAttachError(f"connect to {subnqn} at {transport}://{traddr}:{trsvcid} failed: "
                                    f"{_explain_write_error(e, transport)}") from e
        reply = os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)
    fields = dict(kv.split("=", 1) for kv in reply.strip().split(",") if "=" in kv)
    try:
        instance = int(fields["instance"])
    except (KeyError, ValueError) as e:
        raise KernelAttachError(f"unexpected reply from {FABRICS_DEV}: {reply!r}") from e
    if instance < 0:
        # Newer kernels answer "instance=-1,cntlid=-1,<option list>" when no controller was created.
        raise KernelAttachError(f"the kernel created no controller: {FABRICS_DEV} answered {reply.strip()!r}")
    ctrl = KernelController(name=f"nvme{instance}", instance=instance, cntlid=int(fields.get("cntlid", -1)),
                            subnqn=subnqn, transport=transport, traddr=traddr, trsvcid=trsvcid)
    deadline = time.monotonic() + wait_for_devices
    while True:
        ctrl.block_devices = block_devices(ctrl.name)
        if ctrl.block_devices or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return ctrl


def block_devices(ctrl_name: str) -> list[str]:
    """Block devices (``/dev/nvmeXnY``) served through controller ``ctrl_name``, found with pyudev."""
    import pyudev

    ctx = pyudev.Context()
    subsys_dir = _subsystem_dir(ctrl_name)
    found = []
    for dev in ctx.list_devices(subsystem="block", DEVTYPE="disk"):
        name = dev.sys_name
        if not re.fullmatch(r"nvme\d+n\d+", name):
            continue  # skips the hidden per-path devices nvmeXcYnZ
        parent = Path(dev.sys_path, "device").resolve()
        if parent.name == ctrl_name or (subsys_dir is not None and parent == subsys_dir):
            found.append(dev.device_node or f"/dev/{name}")
    return sorted(found, key=_numeric_key)


def _numeric_key(name: str) -> list[int]:
    """nvme2n1 before nvme10n1: sort device names by their numbers, not as text."""
    return [int(x) for x in re.findall(r"\d+", name)]


def _subsystem_dir(ctrl_name: str) -> Path | None:
    if not SYS_NVME_SUBSYS.exists():
        return None
    for sub in SYS_NVME_SUBSYS.iterdir():
        if (sub / ctrl_name).exists():
            return sub.resolve()
    return None


def controllers() -> list[dict]:
    """Fabrics controllers the kernel has now (like ``nvme list-subsys``)."""
    out = []
    if not SYS_NVME.exists():
        return out
    for c in sorted(SYS_NVME.iterdir(), key=lambda p: _numeric_key(p.name)):
        def attr(name: str, c: Path = c) -> str:
            try:
                return (c / name).read_text().strip()
            except OSError:
                return ""
        transport = attr("transport")
        if transport == "pcie":
            continue  # local NVMe drives: not ours to list, nor to delete by NQN
        out.append({"name": c.name, "transport": transport, "address": attr("address"),
                    "subsysnqn": attr("subsysnqn"), "state": attr("state"), "cntlid": attr("cntlid"),
                    "block_devices": block_devices(c.name)})
    return out


def controllers_detail() -> list[dict]:
    """controllers() with what ``nvme list -v`` shows besides: serial, model, firmware, host identity,
    the nvme-subsystem name and each block device's NSID and geometry (the sysfs attributes libnvme reads)."""
    out = []
    for c in controllers():
        base = SYS_NVME / c["name"]

        def attr(name: str, base: Path = base) -> str:
            try:
                return (base / name).read_text().strip()
            except OSError:
                return ""
        subsys = _subsystem_dir(c["name"])
        out.append({**c, "serial": attr("serial"), "model": attr("model"), "firmware": attr("firmware_rev"),
                    "hostnqn": attr("hostnqn"), "hostid": attr("hostid"),
                    "subsystem": subsys.name if subsys is not None else "",
                    "namespaces": [namespace_info(d) for d in c["block_devices"]]})
    return out


def namespace_info(device: str) -> dict:
    """NSID and geometry of block device ``/dev/nvmeXnY`` from sysfs (``size`` counts 512-byte sectors)."""
    name = Path(device).name
    base = SYS_BLOCK / name

    def number(rel: str) -> int:
        try:
            return int((base / rel).read_text().strip())
        except (OSError, ValueError):
            return 0
    lba_size = number("queue/logical_block_size") or 512
    size = number("size") * 512
    return {"name": name, "nsid": number("nsid"), "lba_size": lba_size, "size": size, "lbas": size // lba_size}


def disconnect(name: str) -> None:
    """Delete controller ``nvmeN`` (what ``nvme disconnect -d nvmeN`` does)."""
    if not re.fullmatch(r"nvme\d+", name):
        raise KernelAttachError(f"{name!r} is not a controller name like nvme0")
    path = SYS_NVME / name / "delete_controller"
    if not path.exists():
        raise KernelAttachError(f"no controller {name}: see 'nvmeof connect --list' or 'nvme list'")
    try:
        path.write_text("1")
    except OSError as e:
        raise KernelAttachError(f"cannot delete {name}: {e.strerror}") from e


def disconnect_nqn(subnqn: str) -> list[str]:
    """Delete every controller connected to ``subnqn``; return their names."""
    names = [c["name"] for c in controllers() if c["subsysnqn"] == subnqn]
    for name in names:
        disconnect(name)
    return names
