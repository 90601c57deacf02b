"""QEMU harness that runs Debian's own Linux kernel as an NVMe-oF peer.

The build machines cannot load NVMe-oF or RDMA modules, so the kernel host (nvme-tcp, nvme-rdma),
the kernel target (nvmet-tcp, nvmet-rdma) and Soft-RoCE run inside a TCG guest booted from a
busybox initramfs.  See /work/shared/VM.md for the facts this module relies on.

Assets (an uncompressed vmlinux, a base initramfs and an fio layer) are cached per kernel
package; each boot appends a tiny cpio archive that carries the guest script, so the base never
changes per test.  fio drags in ~80 MB of libraries (ceph, gluster, ICU) that cost ~3 s of boot
under TCG, so its layer is appended only to guests whose script mentions fio (or `fio=True`).
No pytest dependency: the conftest and ad-hoc scripts both use this module.
"""

from __future__ import annotations

import atexit
import codecs
import concurrent.futures
import ctypes
import dataclasses
import fcntl
import hashlib
import io
import lzma
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tests.ports import free_port, free_ports  # noqa: F401  (the VM tests pick hostfwd ports with these)

QEMU = "qemu-system-x86_64"
HOST_ADDR = "10.0.2.2"  # user-mode network: the host's 127.0.0.1 as seen from the guest
GUEST_ADDR = "10.0.2.15"
GUEST_PREFIX = 24

# Each boot hangs about once in fifty early in kernel start-up; a normal boot takes ~6 s.
BOOT_TIMEOUT = float(os.environ.get("NVMEOF_VM_BOOT_TIMEOUT", "60"))
SCRIPT_TIMEOUT = 120.0

DEFAULT_MEMORY_MB = 1024
DEFAULT_CPUS = 2

# Loaded by the guest's init, in order; crc32_generic must precede rdma_rxe (VM.md).
BOOT_MODULES: tuple[str, ...] = (
    "configfs",
    "virtio_pci",
    "virtio_net",
    "crc32_generic",
    "nvme-tcp",
    "nvme-rdma",
    "nvmet-tcp",
    "nvmet-rdma",
    "rdma_rxe",
)

# Kernel folders (relative to lib/modules/KVER/kernel) copied into the initramfs: the boot
# modules, their dependencies, and brd/null_blk for RAM namespaces.
MODULE_PATHS: tuple[str, ...] = (
    "drivers/nvme",
    "drivers/infiniband/core",
    "drivers/infiniband/sw",
    "drivers/infiniband/ulp",
    "block",
    "crypto",
    "lib",
    "arch/x86/crypto",
    "fs/configfs",
    "drivers/virtio",
    "drivers/block",
    "net/ipv4/udp_tunnel.ko",
    "net/ipv6/ip6_udp_tunnel.ko",
    "drivers/net/virtio_net.ko",
    "drivers/net/net_failover.ko",
    "net/core/failover.ko",
)

# Dynamic host binaries copied into the guest with every library ldd lists.
GUEST_BINARIES: tuple[str, ...] = ("/usr/sbin/nvme", "/usr/bin/rdma", "/usr/bin/kmod")
FIO_BINARIES: tuple[str, ...] = ("/usr/bin/fio",)
KMOD_APPLETS: tuple[str, ...] = ("modprobe", "insmod", "rmmod", "lsmod", "depmod", "modinfo")

# Bump when the initramfs layout changes in a way the recipe hash below would not see.
ASSET_FORMAT = 1

# The kernels the suite runs on, by label.  "6.1" is what linux-image-amd64 depends on (bookworm's
# own kernel: no NVMe in-band authentication); "6.12" is the newest bookworm 6.12 build apt offers
# (NVME_HOST_AUTH, NVME_TARGET_AUTH, NVME_TCP_TLS).  Each label's package can be pinned with its
# environment variable; NVMEOF_VM_KERNELS (comma-separated labels) limits which ones run.
KERNELS: tuple[str, ...] = ("6.1", "6.12")
DEFAULT_KERNEL = "6.1"
# "bpo": the newest kernel Debian trixie-backports offers (linux-image-X.Y.Z+deb13-amd64; 7.3.4 when this
# was written), for what bookworm's kernels lack: nvmet reservations (6.13+, configfs `resv_enable`).
# Not in KERNELS, so the suite's per-kernel tests never run on it (CI time); a test asks for it by name
# (build_assets(kernel="bpo")). Its apt lists live in a private apt configuration inside the VM cache, so
# the host's sources never see trixie (see _bpo_apt_options).
BPO_KERNEL = "bpo"
KNOWN_KERNELS: tuple[str, ...] = (*KERNELS, BPO_KERNEL)
KERNEL_PACKAGE_ENV: dict[str, str] = {
    "6.1": "NVMEOF_VM_KERNEL_PACKAGE",
    "6.12": "NVMEOF_VM_KERNEL_PACKAGE_6_12",
    BPO_KERNEL: "NVMEOF_VM_KERNEL_PACKAGE_BPO",
}
KERNELS_ENV = "NVMEOF_VM_KERNELS"
BPO_SUITE = "trixie-backports"
BPO_MIRROR_ENV = "NVMEOF_VM_BPO_MIRROR"  # the Debian archive to fetch BPO_SUITE from (default: the host's)
BPO_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")  # bookworm's holds the trixie keys
# Debian names a kernel's unsigned image package linux-image-<version>+deb12-<flavour>-unsigned.
_KERNEL_612_PACKAGE_RE = re.compile(r"^linux-image-6\.12\.(\d+)\+deb12-amd64-unsigned$")
# trixie's image package is a small one that depends on linux-binary-*, linux-modules-*, linux-base-*
_KERNEL_BPO_PACKAGE_RE = re.compile(r"^linux-image-(\d+)\.(\d+)\.(\d+)\+deb13-amd64$")
# What a cached kernel folder of each label is called (the fallback without apt lists).
_CACHED_KERNEL_RE: dict[str, re.Pattern[str]] = {
    "6.1": re.compile(r"^linux-image-6\.1\.\d"),
    "6.12": _KERNEL_612_PACKAGE_RE,
    BPO_KERNEL: _KERNEL_BPO_PACKAGE_RE,
}

_RUN_DIR = "/etc/nvmeof-vm"

# The part of the guest's /init that loads the modules, mounts configfs and brings up the network; this
# INIT_SCRIPT and rootfs.py's STAGE2_INIT both use it (@WHO@: the tag of their console messages).
GUEST_MODULES_AND_NETWORK = r"""for m in @MODULES@; do
    modprobe "$m" || echo "@WHO@ init: modprobe $m failed"
done
mount -t configfs configfs /sys/kernel/config || echo "@WHO@ init: configfs mount failed"
ip link set lo up
if ip link set eth0 up; then
    ip addr add @GUEST_ADDR@/@GUEST_PREFIX@ dev eth0
    ip route add default via @HOST_ADDR@
else
    echo "@WHO@ init: no eth0"
fi"""

INIT_SCRIPT = r"""#!/bin/sh
export PATH=/sbin:/usr/sbin:/bin:/usr/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
TOKEN=$(cat @RUN_DIR@/token)
""" + GUEST_MODULES_AND_NETWORK.replace("@WHO@", "nvmeof-vm") + r"""
# QEMU's DMI product UUID is all zeros, which `nvme gen-hostnqn` would turn into the same
# host NQN for every guest: use a random UUID for both the host NQN and the host ID.
HOSTID=$(cat /proc/sys/kernel/random/uuid)
mkdir -p /etc/nvme
echo "nqn.2014-08.org.nvmexpress:uuid:$HOSTID" > /etc/nvme/hostnqn
echo "$HOSTID" > /etc/nvme/hostid
# Boot ran quiet for speed; from here on the console shows info messages (nvme connect/errors).
dmesg -n 7
# The script and the markers own the second serial port: the kernel prints on ttyS0 at any moment,
# even between two bytes of a script's line, so sharing one port could tear any line the test parses.
OUT=/dev/ttyS1
[ -c $OUT ] || { echo "nvmeof-vm init: no $OUT, the script shares the kernel console"; OUT=/dev/console; }
echo "@@NVMEOF-VM-READY $TOKEN@@" > $OUT
cd /root
sh @RUN_DIR@/run.sh < /dev/null > $OUT 2>&1
rc=$?
sync
echo "@@NVMEOF-VM-EXIT $TOKEN $rc@@" > $OUT
poweroff -f
"""

# ttyS0 is the kernel console; ttyS1 carries only the guest script's output (see INIT_SCRIPT).
# cryptomgr.notests: Debian's 6.12 builds dh/ffdhe, hmac and sha2 in (=y), and their boot-time self-tests
# (crypto/testmgr.c) cost ~3.5 s per boot under TCG; the DH-HMAC-CHAP tests check those algorithms
# end to end against our own implementation anyway.  6.1 boots no slower or faster with it.
KERNEL_CMDLINE = "console=ttyS0 panic=-1 quiet rdinit=/init 8250.nr_uarts=2 mitigations=off cryptomgr.notests"


class VmError(Exception):
    """The VM harness could not do what was asked; `output` holds the console text so far."""

    def __init__(self, message: str, output: str = "") -> None:
        tail = output[-4000:]
        if output:
            message = f"{message}\n--- guest console (last {len(tail)} chars) ---\n{tail}"
        super().__init__(message)
        self.output = output


class VmSetupError(VmError):
    """Assets could not be built or QEMU could not be started (host environment problem)."""


class KernelUnavailable(VmSetupError):
    """The kernel package asked for cannot be downloaded here (no such package, archive unreachable)."""


class GuestBootError(VmError):
    """The guest did not reach its script within the boot deadline on any attempt."""


class GuestTimeout(VmError):
    """A marker or the script's exit did not appear within the deadline."""


class GuestExited(VmError):
    """The guest stopped (script ended, kernel panic, QEMU died) before the awaited event."""


# --------------------------------------------------------------------------- assets


@dataclasses.dataclass(frozen=True)
class Assets:
    kernel_package: str
    kernel_version: str
    vmlinux: Path
    initramfs: Path
    fio_layer: Path  # cpio appended after `initramfs` for guests that run fio
    modules_root: Path  # holds lib/modules/<kernel_version>
    cache_dir: Path
    kernel: str = DEFAULT_KERNEL  # the label in KERNELS this kernel stands for ("6.1", "6.12")

    @property
    def has_inband_auth(self) -> bool:
        """Whether this kernel has NVMe in-band authentication (DH-HMAC-CHAP).

        nvme-auth.ko (drivers/nvme/common/auth.c) is built exactly when NVME_HOST_AUTH or
        NVME_TARGET_AUTH selects NVME_AUTH; Debian's 6.1 does not build it, its 6.12 does.
        """
        common = self.modules_root / "lib" / "modules" / self.kernel_version / "kernel" / "drivers" / "nvme" / "common"
        return (common / "nvme-auth.ko").is_file()

    @property
    def has_nvme_tls(self) -> bool:
        """Whether this kernel's NVMe/TCP host and target speak TLS (NVME_TCP_TLS, NVME_TARGET_TCP_TLS).

        Both then call the net/handshake upcalls (tls_client_hello_psk, tls_server_hello_psk); Debian's 6.1
        has neither (TLS came in Linux 6.7), its 6.12 has both.
        """
        nvme = self.modules_root / "lib" / "modules" / self.kernel_version / "kernel" / "drivers" / "nvme"
        try:
            host = (nvme / "host" / "nvme-tcp.ko").read_bytes()
            target = (nvme / "target" / "nvmet-tcp.ko").read_bytes()
        except OSError:
            return False
        return b"tls_client_hello_psk" in host and b"tls_server_hello_psk" in target


def default_cache_dir() -> Path:
    env = os.environ.get("NVMEOF_VM_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "nvmeof-toolkit" / "vm"


def missing_host_tools() -> list[str]:
    """Host commands the harness needs that are not installed (install_deps.sh installs them)."""
    needed = [QEMU, "apt-get", "apt-cache", "dpkg-deb", "depmod", "ldd", "busybox", "zstd"]
    needed += [*GUEST_BINARIES, *FIO_BINARIES]
    path = os.environ.get("PATH", "") + ":/sbin:/usr/sbin"
    missing = []
    for tool in needed:
        if os.path.isabs(tool):
            if not os.access(tool, os.X_OK):
                missing.append(tool)
        elif shutil.which(tool, path=path) is None:
            missing.append(tool)
    return missing


def _run(cmd: Sequence[str], *, cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise VmSetupError(f"{cmd[0]} is not installed; run tests/interop/install_deps.sh as root") from exc
    if proc.returncode != 0:
        raise VmSetupError(
            f"{shlex.join(cmd)} failed with exit status {proc.returncode}: "
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout


def selected_kernels() -> tuple[str, ...]:
    """The kernel labels the VM suite runs on: $NVMEOF_VM_KERNELS (e.g. "6.12"), else all of KERNELS."""
    env = os.environ.get(KERNELS_ENV, "").strip()
    if not env:
        return KERNELS
    chosen = tuple(k.strip() for k in env.split(",") if k.strip())
    unknown = [k for k in chosen if k not in KERNELS]
    if unknown or not chosen:
        raise VmSetupError(f"{KERNELS_ENV}={env!r}: unknown kernel label(s) {unknown}; known: {', '.join(KERNELS)}")
    return chosen


def _apt_cache(*args: str) -> str:
    try:
        return subprocess.run(["apt-cache", *args], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        return ""


def _newest_612_package() -> str | None:
    """The newest linux-image-6.12.N+deb12-amd64-unsigned apt can download (highest N), or None."""
    names = _apt_cache("pkgnames", "linux-image-6.12.").split()
    found = sorted(
        ((int(m.group(1)), name) for name in names if (m := _KERNEL_612_PACKAGE_RE.match(name))), reverse=True
    )
    for _, name in found:
        # pkgnames also knows names whose archive is gone from the lists; take one with a candidate
        if re.search(r"Candidate: (?!\(none\))", _apt_cache("policy", name)):
            return name
    return None


def resolve_kernel_package(cache_root: Path, kernel: str = DEFAULT_KERNEL) -> str:
    """The kernel package to boot for label `kernel`.

    "6.1": $NVMEOF_VM_KERNEL_PACKAGE, else what linux-image-amd64 depends on.  "6.12":
    $NVMEOF_VM_KERNEL_PACKAGE_6_12, else the newest linux-image-6.12.*+deb12-amd64-unsigned apt offers.
    "bpo": $NVMEOF_VM_KERNEL_PACKAGE_BPO, else the newest linux-image-X.Y.Z+deb13-amd64 of trixie-backports
    (the private apt lists in the cache, refreshed here).
    Without apt lists (no `apt-get update` yet) a kernel of that label already in the cache is reused.
    """
    if kernel not in KNOWN_KERNELS:
        raise VmSetupError(f"unknown kernel label {kernel!r}; known: {', '.join(KNOWN_KERNELS)}")
    env = os.environ.get(KERNEL_PACKAGE_ENV[kernel])
    if env:
        return env
    failure: VmSetupError | None = None
    if kernel == BPO_KERNEL:
        try:
            newest = _newest_bpo_package(cache_root)
        except KernelUnavailable as exc:
            newest, failure = None, exc
        if newest:
            return newest
        asked = str(failure) if failure else f"{BPO_SUITE} offers no linux-image-X.Y.Z+deb13-amd64"
    elif kernel == "6.12":
        newest = _newest_612_package()
        if newest:
            return newest
        asked = "`apt-cache pkgnames linux-image-6.12.` offers no linux-image-6.12.*+deb12-amd64-unsigned"
    else:
        match = re.search(r"Depends:\s*(linux-image-\S+)", _apt_cache("depends", "linux-image-amd64"))
        if match:
            return match.group(1)
        asked = "`apt-cache depends linux-image-amd64` names no linux-image package"
    cached = sorted(
        (
            p
            for p in cache_root.glob("linux-image-*")
            if (p / "vmlinux").is_file() and _CACHED_KERNEL_RE[kernel].match(p.name)
        ),
        key=lambda p: p.stat().st_mtime,
    )
    if cached:
        return cached[-1].name
    if kernel == BPO_KERNEL:
        raise KernelUnavailable(f"cannot tell which {kernel} kernel to boot: {asked} (set {BPO_MIRROR_ENV} to a "
                                f"reachable Debian archive, or {KERNEL_PACKAGE_ENV[kernel]}) and the cache "
                                f"{cache_root} holds no such kernel")
    raise VmSetupError(
        f"cannot tell which {kernel} kernel to boot: {asked} (run `apt-get update`, e.g. via "
        f"tests/interop/install_deps.sh, or set {KERNEL_PACKAGE_ENV[kernel]}) and the cache {cache_root} "
        "holds no such kernel"
    )


# --------------------------------------------------------------------------- trixie-backports (private apt)


def _bpo_apt_dir(cache_root: Path) -> Path:
    return cache_root / f"apt-{BPO_SUITE}"


def _bpo_apt_options(cache_root: Path) -> list[str]:
    return private_apt_options(_bpo_apt_dir(cache_root))


def private_apt_options(d: Path) -> list[str]:
    """apt options that read the sources.list and lists in ``d`` (a folder of the VM cache) and nothing
    else: neither the host's sources nor its lists, so a bookworm `apt-get install` can never pull a
    trixie package."""
    return [
        "-o", f"Dir::Etc::sourcelist={d / 'sources.list'}",
        "-o", "Dir::Etc::sourceparts=/dev/null",
        "-o", f"Dir::State::lists={d / 'lists'}",
        "-o", f"Dir::Cache={d / 'cache'}",
        # the folders belong to whoever runs the tests, which apt's _apt sandbox user may not write
        "-o", "APT::Sandbox::User=root",
    ]  # fmt: skip


def bpo_mirror() -> str:
    """The Debian archive URI to take BPO_SUITE from: $NVMEOF_VM_BPO_MIRROR, else the one the host's own
    apt sources use for its release (`apt-get indextargets`), so no mirror is written down here."""
    env = os.environ.get(BPO_MIRROR_ENV, "").strip()
    if env:
        return env
    try:
        out = subprocess.run(["apt-get", "indextargets", "--format", "$(REPO_URI) $(RELEASE) $(IDENTIFIER)"],
                             capture_output=True, text=True, check=False).stdout
    except FileNotFoundError as exc:
        raise KernelUnavailable("apt-get is not installed; run tests/interop/install_deps.sh as root") from exc
    for line in out.splitlines():
        uri, _, rest = line.partition(" ")
        release, _, ident = rest.partition(" ")
        # the main archive of the host's release (bookworm), not -security or -updates
        if ident == "Packages" and re.fullmatch(r"[a-z]+", release):
            return uri
    raise KernelUnavailable(f"the host's apt sources name no Debian archive for its release (`apt-get "
                            f"indextargets` printed {out.strip()[:300]!r}); set {BPO_MIRROR_ENV}")


def bpo_apt_update(cache_root: Path) -> None:
    """Write the private sources.list (BPO_SUITE main, signed by Debian's archive keyring) and fetch its lists."""
    private_apt_update(_bpo_apt_dir(cache_root), BPO_SUITE)


def private_apt_update(d: Path, suite: str) -> None:
    """Write ``d``'s sources.list (``suite`` main from the host's mirror, signed by Debian's archive keyring)
    and fetch its lists; KernelUnavailable says why not."""
    for sub in ("lists/partial", "cache/archives/partial"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    if not BPO_KEYRING.is_file():
        raise KernelUnavailable(f"{BPO_KEYRING} is missing (package debian-archive-keyring; install_deps.sh "
                                f"installs it): the {suite} lists could not be verified")
    (d / "sources.list").write_text(f"deb [signed-by={BPO_KEYRING}] {bpo_mirror()} {suite} main\n")
    proc = subprocess.run(["apt-get", *private_apt_options(d), "-q", "update"], capture_output=True,
                          text=True, check=False)
    # apt-get update exits 0 even when a source failed; "W:"/"E:" lines say so
    failed = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(("E:", "W:", "Err:"))]
    if proc.returncode != 0 or failed:
        raise KernelUnavailable(f"apt-get update of {suite} (private lists in {d}) failed with exit status "
                                f"{proc.returncode}: {' | '.join(failed)[:800] or proc.stderr.strip()[:800]}")


def _bpo_apt_cache(cache_root: Path, *args: str) -> str:
    return subprocess.run(["apt-cache", *_bpo_apt_options(cache_root), *args], capture_output=True, text=True,
                          check=False).stdout


def _newest_bpo_package(cache_root: Path) -> str | None:
    """The newest linux-image-X.Y.Z+deb13-amd64 BPO_SUITE offers (after refreshing its private lists)."""
    bpo_apt_update(cache_root)
    names = _bpo_apt_cache(cache_root, "pkgnames", "linux-image-").split()
    found = sorted(
        ((tuple(int(g) for g in m.groups()), name) for name in names if (m := _KERNEL_BPO_PACKAGE_RE.match(name))),
        reverse=True,
    )
    for _, name in found:
        if re.search(r"Candidate: (?!\(none\))", _bpo_apt_cache(cache_root, "policy", name)):
            return name
    return None


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_XZ_MAGIC = b"\xfd7zXZ\x00"


def _bzimage_payload(bzimage: bytes) -> bytes | None:
    """The compressed kernel a bzImage carries, located by its boot protocol header (None if no header).

    Boot protocol 2.08+: `payload_offset`/`payload_length` at 0x248/0x24c count from the protected-mode
    code, which follows the (setup_sects + 1) 512-byte sectors of real-mode setup
    (Documentation/arch/x86/boot.rst).  The payload ends with the 4-byte uncompressed size.
    """
    if len(bzimage) < 0x250 or bzimage[0x202:0x206] != b"HdrS":
        return None
    setup_sects = bzimage[0x1F1] or 4
    offset = int.from_bytes(bzimage[0x248:0x24C], "little")
    length = int.from_bytes(bzimage[0x24C:0x250], "little")
    start = (setup_sects + 1) * 512 + offset
    if length <= 4 or start + length > len(bzimage):
        return None
    return bzimage[start : start + length]


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF vmlinux inside a bzImage's xz (6.1) or zstd (6.12) stream; QEMU boots it via PVH,
    skipping the in-guest decompression."""
    payload = _bzimage_payload(bzimage)
    if payload is not None and payload.startswith(_ZSTD_MAGIC):
        # Debian's 6.12 is CONFIG_KERNEL_ZSTD; the standard library has no zstd, the zstd tool does.
        # Without the trailing size word the payload is exactly one zstd frame.
        try:
            proc = subprocess.run(["zstd", "-d", "-c", "-q"], input=payload[:-4], capture_output=True, check=False)
        except FileNotFoundError as exc:
            raise VmSetupError("the kernel image is zstd-compressed and zstd is not installed; run "
                               "tests/interop/install_deps.sh as root") from exc
        if proc.returncode != 0 or not proc.stdout.startswith(b"\x7fELF"):
            raise VmSetupError(f"zstd -d of the kernel image failed (status {proc.returncode}): "
                               f"{proc.stderr.decode(errors='replace').strip()[:500]}")
        return proc.stdout
    start = bzimage.find(_XZ_MAGIC)
    if start < 0:
        raise VmSetupError("the kernel image holds no xz or zstd stream (kernel built with CONFIG_KERNEL_XZ "
                           "or CONFIG_KERNEL_ZSTD expected)")
    decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        elf = decompressor.decompress(bzimage[start:])
    except lzma.LZMAError as exc:
        raise VmSetupError(f"the kernel image's xz stream at offset {start} is corrupt: {exc}") from exc
    if not elf.startswith(b"\x7fELF"):
        raise VmSetupError("the kernel image's xz stream does not hold an ELF vmlinux")
    return elf


def _copy_modules(src: Path, kver: str, dst_root: Path) -> None:
    """The MODULE_PATHS of module tree `src` (a lib/modules/KVER) to dst_root/lib/modules/KVER, as plain .ko."""
    src_root = src.parents[2]
    dst = dst_root / "lib" / "modules" / kver
    for rel in MODULE_PATHS:
        path = src / "kernel" / rel
        if not path.exists() and path.with_name(path.name + ".xz").is_file():
            path = path.with_name(path.name + ".xz")  # 6.12 ships every module xz-compressed
        if not path.exists():
            raise VmSetupError(f"kernel package has no {path.relative_to(src_root)}")
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            out = dst / f.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            if f.name.endswith(".ko.xz"):
                # busybox-era tools and the kernel loader in the guest want plain .ko files
                out.with_name(f.name[: -len(".xz")]).write_bytes(lzma.decompress(f.read_bytes()))
            elif f.name.endswith(".ko"):
                shutil.copyfile(f, out)
    copy_module_lists(src, dst)
    _run(["depmod", "-b", str(dst_root), kver])


def copy_module_lists(src: Path, dst: Path) -> None:
    """modules.order/builtin from module tree `src` to `dst`, naming the decompressed .ko files."""
    for name in ("modules.order", "modules.builtin", "modules.builtin.modinfo"):
        if (src / name).is_file():
            text = (src / name).read_bytes().replace(b".ko.xz", b".ko")
            (dst / name).write_bytes(text)


def decompress_modules(tree: Path) -> int:
    """Replace every .ko.xz under `tree` by its plain .ko (busybox insmod cannot read xz); the count.

    Run depmod afterwards: modules.dep must name the .ko files.
    """
    count = 0
    for f in sorted(tree.rglob("*.ko.xz")):
        f.with_name(f.name[: -len(".xz")]).write_bytes(lzma.decompress(f.read_bytes()))
        f.unlink()
        count += 1
    for name in ("modules.order", "modules.builtin", "modules.builtin.modinfo"):
        if (tree / name).is_file():
            (tree / name).write_bytes((tree / name).read_bytes().replace(b".ko.xz", b".ko"))
    return count


def _kernel_debs(package: str, apt_options: Sequence[str]) -> list[str]:
    """`package` and the packages that carry its files: trixie's linux-image-X+deb13-amd64 holds nothing
    but depends on linux-binary-X (the image), linux-modules-X and linux-base-X (modules.order, .builtin)."""
    out = subprocess.run(["apt-cache", *apt_options, "depends", "--no-recommends", "--no-suggests", package],
                         capture_output=True, text=True, check=False).stdout
    parts = re.findall(r"^\s*Depends:\s*(linux-(?:binary|modules|base)-\d\S*)", out, re.MULTILINE)
    return [package, *dict.fromkeys(parts)]


def _unpacked_kernel(root: Path, package: str) -> tuple[str, Path, Path]:
    """(kernel version, module tree, bzImage) of kernel packages unpacked into `root`: bookworm's keep them
    in lib/modules and boot/vmlinuz-*, trixie's (merged /usr) in usr/lib/modules/KVER with its vmlinuz."""
    trees = [p for base in ("lib", "usr/lib") if (root / base / "modules").is_dir()
             for p in (root / base / "modules").iterdir() if p.is_dir()]
    if len(trees) != 1:
        raise VmSetupError(f"{package} holds {len(trees)} module trees ({[t.name for t in trees]}), expected 1")
    tree = trees[0]
    bzimages = [*(root / "boot").glob("vmlinuz-*"), *([tree / "vmlinuz"] if (tree / "vmlinuz").is_file() else [])]
    if len(bzimages) != 1:
        raise VmSetupError(f"{package} holds {len(bzimages)} kernel images (boot/vmlinuz-* or "
                           f"lib/modules/KVER/vmlinuz), expected 1")
    return tree.name, tree, bzimages[0]


def _fetch_kernel(package: str, kdir: Path, apt_options: Sequence[str] = ()) -> None:
    work = Path(tempfile.mkdtemp(prefix="kernel-", dir=kdir.parent))
    try:
        names = _kernel_debs(package, apt_options)
        proc = subprocess.run(["apt-get", *apt_options, "download", "-q", "-o", "APT::Sandbox::User=root", *names],
                              cwd=work, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            # the package is gone from the archive or the archive is unreachable: nothing here can fix that
            raise KernelUnavailable(f"apt-get download {' '.join(names)} failed with exit status "
                                    f"{proc.returncode}: {proc.stderr.strip()[-800:]}")
        debs = list(work.glob("*.deb"))
        if len(debs) != len(names):
            raise VmSetupError(f"apt-get download {' '.join(names)} produced {len(debs)} .deb files, "
                               f"expected {len(names)}")
        root = work / "root"
        for deb in debs:
            _run(["dpkg-deb", "-x", str(deb), str(root)])
            deb.unlink()
        kver, tree, bzimage = _unpacked_kernel(root, package)
        staging = work / "out"
        staging.mkdir()
        (staging / "vmlinux").write_bytes(extract_vmlinux(bzimage.read_bytes()))
        _copy_modules(tree, kver, staging / "modules")
        (staging / "kernel-version").write_text(kver + "\n")
        if kdir.exists():
            shutil.rmtree(kdir)
        staging.rename(kdir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class CpioWriter:
    """Writes a newc ("070701") cpio archive, the format the kernel's initramfs unpacker reads.

    Parent directories are emitted before their contents because the kernel does not create them.
    """

    def __init__(self, out: io.BufferedIOBase) -> None:
        self._out = out
        self._ino = 1
        self._dirs: set[str] = {""}

    def _header(
        self, name: str, mode: int, size: int, nlink: int = 1, rdev: tuple[int, int] = (0, 0)
    ) -> None:
        encoded = name.encode() + b"\0"
        fields = (self._ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev[0], rdev[1], len(encoded), 0)
        self._ino += 1
        self._out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + encoded)
        self._pad(110 + len(encoded))

    def _pad(self, length: int) -> None:
        self._out.write(b"\0" * (-length % 4))

    def _parents(self, name: str) -> None:
        parent = name.rpartition("/")[0]
        if parent not in self._dirs:
            self.add_dir(parent)

    def add_dir(self, name: str, mode: int = 0o755) -> None:
        name = name.strip("/")
        if name in self._dirs:
            return
        self._parents(name)
        self._dirs.add(name)
        self._header(name, 0o040000 | mode, 0, nlink=2)

    def add_file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        name = name.strip("/")
        self._parents(name)
        self._header(name, 0o100000 | mode, len(data))
        self._out.write(data)
        self._pad(len(data))

    def add_symlink(self, name: str, target: str) -> None:
        name = name.strip("/")
        self._parents(name)
        data = target.encode()
        self._header(name, 0o120000 | 0o777, len(data))
        self._out.write(data)
        self._pad(len(data))

    def add_chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        name = name.strip("/")
        self._parents(name)
        self._header(name, 0o020000 | mode, 0, rdev=(major, minor))

    def add_tree(self, src: Path, dest: str) -> None:
        for path in sorted(src.rglob("*")):
            name = f"{dest.strip('/')}/{path.relative_to(src).as_posix()}"
            if path.is_symlink():
                self.add_symlink(name, os.readlink(path))
            elif path.is_dir():
                self.add_dir(name)
            else:
                self.add_file(name, path.read_bytes(), path.stat().st_mode & 0o777)

    def close(self) -> None:
        self._header("TRAILER!!!", 0, 0)


def _ldd_paths(binary: str) -> list[str]:
    """Absolute paths of the shared objects `binary` loads, as the dynamic loader looks them up."""
    out = _run(["ldd", binary])
    paths = []
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            target = line.split("=>", 1)[1].strip().split(" ", 1)[0]
            if target.startswith("/"):
                paths.append(target)
            elif target != "" and not line.startswith("linux-vdso"):
                raise VmSetupError(f"ldd {binary}: library not found: {line}")
        elif line.startswith("/"):
            paths.append(line.split(" ", 1)[0])
    return paths


def _busybox_applets() -> list[str]:
    out = _run(["busybox", "--list-full"])
    return [line.strip() for line in out.splitlines() if line.strip()]


def _recipe_hash() -> str:
    h = hashlib.sha256()
    h.update(repr((ASSET_FORMAT, INIT_SCRIPT, BOOT_MODULES, GUEST_BINARIES, FIO_BINARIES)).encode())
    h.update(repr(KMOD_APPLETS).encode())
    for tool in (shutil.which("busybox") or "busybox", *GUEST_BINARIES, *FIO_BINARIES):
        try:
            st = os.stat(tool)
        except OSError:
            continue
        h.update(f"{tool}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _init_script() -> str:
    return (
        INIT_SCRIPT.replace("@RUN_DIR@", _RUN_DIR)
        .replace("@MODULES@", " ".join(BOOT_MODULES))
        .replace("@GUEST_ADDR@", GUEST_ADDR)
        .replace("@GUEST_PREFIX@", str(GUEST_PREFIX))
        .replace("@HOST_ADDR@", HOST_ADDR)
    )


def _build_initramfs(modules_root: Path, dest: Path) -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise VmSetupError("busybox is not installed; run tests/interop/install_deps.sh as root")
    busybox_data = Path(busybox).read_bytes()
    if not _is_static(busybox):
        raise VmSetupError(f"{busybox} is not statically linked; install busybox-static")
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        cpio = CpioWriter(f)
        for d in ("dev", "proc", "sys", "tmp", "run", "root", "mnt", "etc/nvme", _RUN_DIR, "bin", "sbin"):
            cpio.add_dir(d)
        cpio.add_chardev("dev/console", 5, 1)
        cpio.add_chardev("dev/null", 1, 3, 0o666)
        # A copy, not a link: the initramfs has no host file system to point into.
        cpio.add_file("bin/busybox", busybox_data, 0o755)
        for applet in _busybox_applets():
            if applet.rsplit("/", 1)[-1] in KMOD_APPLETS or applet == "bin/busybox":
                continue
            cpio.add_symlink(applet, "/bin/busybox")
        _add_binaries(cpio, GUEST_BINARIES, set())
        for applet in KMOD_APPLETS:
            # The kernel runs /sbin/modprobe itself to load crypto helpers on demand.
            cpio.add_symlink(f"sbin/{applet}", "/usr/bin/kmod")
        cpio.add_tree(modules_root / "lib", "lib")
        cpio.add_file("init", _init_script().encode(), 0o755)
        cpio.close()
    os.replace(tmp, dest)


def _add_binaries(cpio: CpioWriter, binaries: Iterable[str], skip: set[str]) -> set[str]:
    """Copy `binaries` and their libraries (except paths in `skip`); return every path involved."""
    seen = set(skip)
    for binary in binaries:
        for path in (binary, *_ldd_paths(binary)):
            if path not in seen:
                seen.add(path)
                cpio.add_file(path, Path(path).read_bytes(), 0o755)
    return seen


def _build_fio_layer(dest: Path) -> None:
    in_base = {p for b in GUEST_BINARIES for p in (b, *_ldd_paths(b))}
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        cpio = CpioWriter(f)
        # The base archive already made these directories; the kernel keeps existing ones.
        _add_binaries(cpio, FIO_BINARIES, in_base)
        cpio.close()
    os.replace(tmp, dest)


def _is_static(path: str) -> bool:
    proc = subprocess.run(["ldd", path], capture_output=True, text=True, check=False)
    return "not a dynamic executable" in (proc.stdout + proc.stderr) or "statically linked" in proc.stdout


_assets_memo: dict[tuple[Path, str], Assets] = {}


def build_assets(cache_dir: Path | str | None = None, kernel: str = DEFAULT_KERNEL) -> Assets:
    """Kernel, modules and base initramfs for kernel label `kernel` (one of KNOWN_KERNELS), built once per
    package and cached; KernelUnavailable when the package cannot be downloaded.

    The cache is `cache_dir`, else $NVMEOF_VM_CACHE, else ~/.cache/nvmeof-toolkit/vm, with one folder
    per kernel package (`<cache>/<package>/`); concurrent callers serialize on a lock file so only
    one builds.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    memo = _assets_memo.get((root, kernel))
    if memo is not None and all(p.is_file() for p in (memo.vmlinux, memo.initramfs, memo.fio_layer)):
        return memo
    root.mkdir(parents=True, exist_ok=True)
    package = resolve_kernel_package(root, kernel)
    kdir = root / package
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ((kdir / "vmlinux").is_file() and (kdir / "kernel-version").is_file()):
            apt_options: list[str] = []
            if kernel == BPO_KERNEL:
                bpo_apt_update(root)  # also when the package was pinned: download needs the lists
                apt_options = _bpo_apt_options(root)
            _fetch_kernel(package, kdir, apt_options)
        kver = (kdir / "kernel-version").read_text().strip()
        recipe = _recipe_hash()
        initramfs = kdir / f"initramfs-{recipe}.cpio"
        fio_layer = kdir / f"fio-{recipe}.cpio"
        if not (initramfs.is_file() and fio_layer.is_file()):
            for stale in (*kdir.glob("initramfs-*.cpio*"), *kdir.glob("fio-*.cpio*")):
                stale.unlink()
            _build_initramfs(kdir / "modules", initramfs)
            _build_fio_layer(fio_layer)
    assets = _assets_memo[(root, kernel)] = Assets(
        kernel_package=package,
        kernel_version=kver,
        vmlinux=kdir / "vmlinux",
        initramfs=initramfs,
        fio_layer=fio_layer,
        modules_root=kdir / "modules",
        cache_dir=root,
        kernel=kernel,
    )
    return assets


def run_layer(script: str, token: str, files: dict[str, bytes] | None = None) -> bytes:
    """The per-boot cpio archive appended to the base initramfs (the kernel reads concatenated cpio)."""
    buf = io.BytesIO()
    cpio = CpioWriter(buf)
    cpio.add_dir(_RUN_DIR)
    cpio.add_file(f"{_RUN_DIR}/run.sh", script.encode(), 0o755)
    cpio.add_file(f"{_RUN_DIR}/token", token.encode() + b"\n")
    for name, data in (files or {}).items():
        cpio.add_file(name, data, 0o755)
    cpio.close()
    return buf.getvalue()


# --------------------------------------------------------------------------- ports


# --------------------------------------------------------------------------- QEMU processes

_live: set[subprocess.Popen[bytes]] = set()
_live_lock = threading.Lock()
_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_PR_SET_PDEATHSIG = 1


def _kill_all() -> None:
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        _kill(proc)


atexit.register(_kill_all)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    with _live_lock:
        _live.discard(proc)


def _die_with_parent(parent: int) -> None:
    # QEMU gets SIGKILL when the thread that spawned it dies; spawning from one long-lived thread
    # makes that "when this Python process dies", even by SIGKILL, where atexit never runs.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _spawn(cmd: list[str], pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    global _spawner
    with _live_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qemu-spawner")
        spawner = _spawner
    parent = os.getpid()

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=tuple(pass_fds),
            preexec_fn=lambda: _die_with_parent(parent),
        )

    try:
        proc = spawner.submit(start).result()
    except FileNotFoundError as exc:
        raise VmSetupError(f"{cmd[0]} is not installed; run tests/interop/install_deps.sh as root") from exc
    with _live_lock:
        _live.add(proc)
    return proc


@dataclasses.dataclass(frozen=True)
class GuestResult:
    exit_code: int
    # both serial ports (kernel console and the script's port) joined line by line, "\r\n" turned into "\n"
    output: str
    script: str | None = None  # the script's port alone (no kernel message can be in it)

    @property
    def script_output(self) -> str:
        """The script's output between the boot-complete marker and the exit marker."""
        text = self.output if self.script is None else self.script
        start = re.search(r"@@NVMEOF-VM-READY \S+@@\n?", text)
        end = re.search(r"@@NVMEOF-VM-EXIT \S+ \d+@@", text)
        return text[start.end() if start else 0 : end.start() if end else len(text)]


class LineSplitter:
    """Cuts one serial port's byte stream into whole lines (kept with their "\n").

    The guest's two ports are read by two threads; each appends only whole lines to the shared
    transcript, so a kernel message can never land inside a line of the script or vice versa.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""

    def feed(self, data: bytes) -> list[str]:
        """The lines `data` completes; an empty `data` means end of stream and flushes the rest."""
        text = self._partial + self._decoder.decode(data, final=not data).replace("\r", "")
        if not data:
            self._partial = ""
            return [text] if text else []
        head, sep, self._partial = text.rpartition("\n")
        return (head + sep).splitlines(keepends=True)


class Guest:
    """One QEMU guest running a busybox script; a context manager that always kills QEMU.

    `start()` returns once the guest's init has loaded the modules and set up the network (it
    retries a boot that hangs); `wait_for()` waits for console output; `stop()` kills QEMU.
    `hostfwd` is (host port, guest port) pairs forwarded from 127.0.0.1; `files` maps guest paths
    to contents added beside the script; `fio=None` adds fio only if the script mentions it.
    """

    def __init__(
        self,
        assets: Assets | None = None,
        *,
        hostfwd: Iterable[tuple[int, int]] = (),
        memory_mb: int = DEFAULT_MEMORY_MB,
        cpus: int = DEFAULT_CPUS,
        boot_timeout: float = BOOT_TIMEOUT,
        retries: int = 2,
        kernel_args: str = "",
        qemu_args: Sequence[str] = (),
        files: dict[str, bytes] | None = None,
        fio: bool | None = None,
    ) -> None:
        self.assets = assets if assets is not None else build_assets()
        self.hostfwd = [(int(h), int(g)) for h, g in hostfwd]
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.boot_timeout = boot_timeout
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.retries = retries
        self.kernel_args = kernel_args
        self.qemu_args = list(qemu_args)
        self.files = files
        self.fio = fio
        self.boot_seconds: float | None = None
        self.attempts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._readers: list[threading.Thread] = []
        self._script_fd: int | None = None  # our end of the pipe behind the guest's ttyS1
        self._cond = threading.Condition()
        self._chunks: list[str] = []  # whole lines from either port, in arrival order
        self._text = ""
        self._script_text = ""  # whole lines from the script's port only
        self._open_streams = 0
        self._eof = False
        self._token = ""
        self._ready_end = 0
        self._initrd: Path | None = None
        self.failed_boots: list[str] = []  # console output of each boot that was retried

    # -- lifecycle

    def __enter__(self) -> Guest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, script: str) -> Guest:
        """Boot and run `script` under busybox sh; return once the script has started."""
        if self._proc is not None:
            raise VmError("Guest.start: this guest was already started; use a new Guest")
        try:
            return self._start(script)
        except BaseException:
            # Also on KeyboardInterrupt or a pytest timeout: never leave QEMU running.
            self.stop()
            raise

    def _start(self, script: str) -> Guest:
        for attempt in range(self.retries + 1):
            self.attempts = attempt + 1
            began = time.monotonic()
            self._boot(script)
            try:
                self.wait_for(
                    rf"@@NVMEOF-VM-READY {self._token}@@\n", self.boot_timeout, start=0, _ready=True
                )
            except (GuestTimeout, GuestExited) as exc:
                self.failed_boots.append(self.output)
                self.stop()
                assert self._proc is not None
                if self._proc.returncode not in (0, -signal.SIGKILL):
                    # QEMU itself refused to run (bad option, hostfwd port taken): retrying is futile.
                    raise GuestBootError(
                        f"QEMU exited with status {self._proc.returncode} before the guest booted",
                        self.output,
                    ) from exc
                if attempt == self.retries:
                    raise GuestBootError(
                        f"guest did not finish booting after {self.retries + 1} attempts "
                        f"(deadline {self.boot_timeout:g} s each); last: {exc.args[0].splitlines()[0]}",
                        self.output,
                    ) from exc
                self._proc = None
                continue
            self.boot_seconds = time.monotonic() - began
            return self
        raise AssertionError("unreachable")

    def _boot(self, script: str) -> None:
        self._token = secrets.token_hex(8)
        with self._cond:
            self._chunks = []
            self._text = ""
            self._script_text = ""
            self._open_streams = 2
            self._eof = False
            self._ready_end = 0
        fd, name = tempfile.mkstemp(prefix="nvmeof-vm-", suffix=".cpio")
        self._initrd = Path(name)
        with os.fdopen(fd, "wb") as out, open(self.assets.initramfs, "rb") as base:
            shutil.copyfileobj(base, out, 1 << 20)
            with_fio = self.fio if self.fio is not None else re.search(r"\bfio\b", script) is not None
            if with_fio:
                with open(self.assets.fio_layer, "rb") as layer:
                    shutil.copyfileobj(layer, out, 1 << 20)
            out.write(run_layer(script, self._token, self.files))
        script_r, script_w = os.pipe()
        self._script_fd = script_r
        try:
            self._proc = _spawn(self._command(script_w), pass_fds=(script_w,))
        finally:
            os.close(script_w)  # QEMU holds the write end: EOF on ours once QEMU is gone
        assert self._proc.stdout is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self._proc, self._proc.stdout.fileno(), False), daemon=True),
            threading.Thread(target=self._read, args=(self._proc, script_r, True), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _command(self, script_fd: int) -> list[str]:
        netdev = "user,id=n0"
        for host_port, guest_port in self.hostfwd:
            netdev += f",hostfwd=tcp:127.0.0.1:{host_port}-:{guest_port}"
        assert self._initrd is not None
        return [
            QEMU,
            "-accel", "tcg,thread=multi",
            "-cpu", "max",
            "-m", str(self.memory_mb),
            "-smp", str(self.cpus),
            "-nodefaults", "-no-user-config",
            "-display", "none",
            "-monitor", "none",
            "-serial", "stdio",  # ttyS0: the kernel console
            # ttyS1: the guest script's output only, on a pipe of its own
            "-chardev", f"file,id=script,path=/dev/fd/{script_fd}",
            "-serial", "chardev:script",
            "-no-reboot",
            "-kernel", str(self.assets.vmlinux),
            "-initrd", str(self._initrd),
            "-append", f"{KERNEL_CMDLINE} {self.kernel_args}".strip(),
            "-netdev", netdev,
            "-device", "virtio-net-pci,netdev=n0,romfile=",
            *self.qemu_args,
        ]  # fmt: skip

    def _read(self, proc: subprocess.Popen[bytes], fd: int, script: bool) -> None:
        """Append one port's whole lines to the transcript (and the script's to its own text too)."""
        splitter = LineSplitter()
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            lines = splitter.feed(data)
            with self._cond:
                if self._proc is proc:
                    self._chunks.extend(lines)
                    if script:
                        self._script_text += "".join(lines)
                    if not data:
                        self._open_streams -= 1
                        self._eof = self._open_streams <= 0
                    self._cond.notify_all()
            if not data:
                return

    def stop(self) -> None:
        """Kill QEMU (idempotent) and remove the per-boot initramfs."""
        proc = self._proc
        if proc is not None:
            _kill(proc)
        for reader in self._readers:
            reader.join(timeout=5)
        self._readers = []
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        if self._script_fd is not None:
            os.close(self._script_fd)
            self._script_fd = None
        if self._initrd is not None:
            self._initrd.unlink(missing_ok=True)
            self._initrd = None

    # -- observation

    @property
    def output(self) -> str:
        """Both ports joined line by line: kernel messages and the script's lines, each line whole."""
        with self._cond:
            return self._joined()

    @property
    def script_text(self) -> str:
        """The script's port alone (the boot markers and what the script printed), no kernel message."""
        with self._cond:
            return self._script_text

    def _joined(self) -> str:
        if self._chunks:
            self._text += "".join(self._chunks)
            self._chunks = []
        return self._text

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self.exit_code is None

    @property
    def exit_code(self) -> int | None:
        """The script's exit status once the guest's init has reported it."""
        match = re.search(rf"@@NVMEOF-VM-EXIT {self._token} (\d+)@@", self.output) if self._token else None
        return int(match.group(1)) if match else None

    def mark(self) -> int:
        """An output offset to pass as `start` to `wait_for`, to ignore what was printed before."""
        return len(self.output)

    def wait_for(
        self,
        pattern: str | re.Pattern[str],
        timeout: float,
        *,
        start: int | None = None,
        _ready: bool = False,
    ) -> re.Match[str]:
        """Wait until `pattern` appears in the console output after `start` (default: the script's start).

        Raises GuestExited if the script ends or QEMU stops first, GuestTimeout after `timeout` s.
        """
        if self._proc is None:
            raise VmError("Guest.wait_for: the guest was not started")
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        exit_re = re.compile(rf"@@NVMEOF-VM-EXIT {self._token} (\d+)@@")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                text = self._joined()
                match = regex.search(text, self._ready_end if start is None else start)
                if match:
                    if _ready:
                        self._ready_end = match.end()
                    return match
                done = exit_re.search(text)
                if done:
                    raise GuestExited(
                        f"guest script exited with status {done.group(1)} before {regex.pattern!r} appeared",
                        text,
                    )
                if self._eof:
                    code = self._proc.poll()
                    raise GuestExited(
                        f"QEMU stopped (exit status {code}) before {regex.pattern!r} appeared", text
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise GuestTimeout(f"{regex.pattern!r} did not appear within {timeout:g} s", text)
                self._cond.wait(min(remaining, 1.0))

    def wait_exit(self, timeout: float) -> int:
        """Wait for the script to end and return its exit status."""
        exit_re = re.compile(rf"@@NVMEOF-VM-EXIT {self._token} (\d+)@@")
        try:
            match = self.wait_for(exit_re, timeout, start=0)
        except GuestExited as exc:
            raise GuestExited(
                f"guest stopped without reporting an exit status: {exc.args[0]}", exc.output
            ) from None
        except GuestTimeout as exc:
            raise GuestTimeout(f"guest script did not finish within {timeout:g} s", exc.output) from None
        return int(match.group(1))


def run_guest(
    script: str,
    *,
    timeout: float = SCRIPT_TIMEOUT,
    hostfwd: Iterable[tuple[int, int]] = (),
    retries: int = 2,
    assets: Assets | None = None,
    boot_timeout: float = BOOT_TIMEOUT,
    fio: bool | None = None,
    files: dict[str, bytes] | None = None,
) -> GuestResult:
    """Boot a guest, run `script` (busybox sh) to completion, and return its exit status and console.

    Hung boots are retried `retries` times; a script that exceeds `timeout` s raises GuestTimeout.
    """
    guest = Guest(assets, hostfwd=hostfwd, retries=retries, boot_timeout=boot_timeout, fio=fio, files=files)
    with guest:
        guest.start(script)
        code = guest.wait_exit(timeout)
        return GuestResult(code, guest.output, guest.script_text)


# --------------------------------------------------------------------------- guest script fragments


def guest_nvme_connect_script(
    traddr: str, trsvcid: int | str, subnqn: str, extra_args: str = "", *, transport: str = "tcp"
) -> str:
    """Shell fragment: connect with the kernel NVMe host, then set CTRL (nvme0) and DEV (/dev/nvme0n1).

    `extra_args` is appended to `nvme connect` as shell text (e.g. "--hdr-digest --nr-io-queues=1").
    Waits up to 30 s for the first namespace's block device; on failure it prints why and exits 1.
    """
    q_addr, q_svc, q_nqn = shlex.quote(traddr), shlex.quote(str(trsvcid)), shlex.quote(subnqn)
    q_trtype = shlex.quote(transport)
    return f"""
_nvmeof_before=" $(ls /sys/class/nvme 2>/dev/null | tr '\\n' ' ') "
nvme connect -t {q_trtype} -a {q_addr} -s {q_svc} -n {q_nqn} {extra_args} || {{
    echo "guest_nvme_connect: nvme connect to {traddr}:{trsvcid} {subnqn} failed"; exit 1; }}
CTRL=""
for _nvmeof_c in $(ls /sys/class/nvme 2>/dev/null); do
    case "$_nvmeof_before" in *" $_nvmeof_c "*) continue ;; esac
    if [ "$(cat /sys/class/nvme/$_nvmeof_c/subsysnqn)" = {q_nqn} ]; then CTRL=$_nvmeof_c; fi
done
[ -n "$CTRL" ] || {{ echo "guest_nvme_connect: no new controller for {subnqn}"; exit 1; }}
DEV=""
_nvmeof_i=0
while [ -z "$DEV" ] && [ $_nvmeof_i -lt 300 ]; do
    for _nvmeof_ns in /sys/class/nvme/$CTRL/nvme*n*; do
        [ -e "$_nvmeof_ns" ] || continue
        # with native multipath the per-path node is nvmeXcYnZ; the block device is nvmeXnZ
        _nvmeof_name=$(basename "$_nvmeof_ns" | sed 's/c[0-9]*n/n/')
        if [ -b "/dev/$_nvmeof_name" ]; then DEV=/dev/$_nvmeof_name; break; fi
    done
    [ -n "$DEV" ] || {{ sleep 0.1; _nvmeof_i=$((_nvmeof_i + 1)); }}
done
[ -n "$DEV" ] || {{ echo "guest_nvme_connect: $CTRL has no namespace block device after 30 s"; exit 1; }}
echo "guest_nvme_connect: CTRL=$CTRL DEV=$DEV"
"""


@dataclasses.dataclass(frozen=True)
class KernelTargetHost:
    """One allowed host of the kernel target, with its nvmet DH-HMAC-CHAP settings (configfs
    ``hosts/<nqn>/dhchap_key``, ``dhchap_ctrl_key``, ``dhchap_hash`` e.g. "hmac(sha384)",
    ``dhchap_dhgroup`` e.g. "ffdhe2048" or "null"); None leaves nvmet's default."""

    hostnqn: str
    dhchap_key: str | None = dataclasses.field(default=None, repr=False)
    dhchap_ctrl_key: str | None = dataclasses.field(default=None, repr=False)
    dhchap_hash: str | None = None
    dhchap_dhgroup: str | None = None


def _kernel_target_host_steps(sub: str, host: KernelTargetHost) -> list[tuple[str, str]]:
    """(command, what to print if it fails) pairs; a secret never appears in the message."""
    cfs = "/sys/kernel/config/nvmet"
    h = f"{cfs}/hosts/{shlex.quote(host.hostnqn)}"
    steps = [(f"mkdir -p {h}", f"mkdir {h}")]
    for attr in ("dhchap_key", "dhchap_ctrl_key"):
        value = getattr(host, attr)
        if value is not None:
            steps.append((f"echo {shlex.quote(value)} > {h}/{attr}", f"writing {attr} of {host.hostnqn}"))
    for attr in ("dhchap_hash", "dhchap_dhgroup"):
        value = getattr(host, attr)
        if value is not None:
            steps.append((f"echo {shlex.quote(value)} > {h}/{attr}", f"echo {value} > {h}/{attr}"))
    link = f"ln -s {h} {sub}/allowed_hosts/{shlex.quote(host.hostnqn)}"
    steps.append((link, link))
    return steps


def guest_kernel_target_script(
    subnqn: str,
    ports: Sequence[tuple[int, int]] = ((1, 4420),),
    *,
    traddr: str = "0.0.0.0",
    trtype: str = "tcp",
    size_mib: int = 64,
    hosts: Sequence[KernelTargetHost] | None = None,
    namespaces: int = 1,
    resv_enable: bool = False,
    tls_ports: Sequence[int] = (),
) -> str:
    """Shell fragment: configure the kernel target (nvmet) exposing brd RAM disks as nsid 1..`namespaces`
    (`size_mib` each; /dev/ram<nsid-1>).

    `ports` is (nvmet port id, trsvcid) pairs; every port gets the subsystem linked, which also
    serves discovery on it.  Any host may connect, unless `hosts` lists the allowed ones (with their
    DH-HMAC-CHAP keys: nvmet then authenticates them, NVME_TARGET_AUTH).  `resv_enable` turns on
    persistent reservations per namespace (configfs `resv_enable`, Linux 6.13+; it must be set before
    the namespace is enabled).  `tls_ports` are the port ids that take NVMe/TCP over TLS 1.3 only (configfs
    `addr_tsas` "tls1.3", set before the subsystem link enables the port; nvmet_addr_tsas_store then makes
    `addr_treq` "required"; Linux 6.7+ with NVME_TARGET_TCP_TLS, and tlshd running for the handshakes).
    Exits 1 with a message on failure.
    """
    if size_mib <= 0:
        raise ValueError(f"size_mib must be positive, got {size_mib}")
    if namespaces <= 0:
        raise ValueError(f"namespaces must be positive, got {namespaces}")
    q_nqn = shlex.quote(subnqn)
    cfs = "/sys/kernel/config/nvmet"
    sub = f"{cfs}/subsystems/{q_nqn}"
    steps = [
        f"modprobe brd rd_nr={namespaces} rd_size={size_mib * 1024}",
        f"[ -b /dev/ram{namespaces - 1} ]",
        f"mkdir {sub}",
        f"echo {0 if hosts else 1} > {sub}/attr_allow_any_host",
    ]
    for nsid in range(1, namespaces + 1):
        ns = f"{sub}/namespaces/{nsid}"
        steps += [f"mkdir {ns}", f"echo -n /dev/ram{nsid - 1} > {ns}/device_path"]
        if resv_enable:
            steps.append(f"echo 1 > {ns}/resv_enable")
        steps.append(f"echo 1 > {ns}/enable")
    described = [(step, step) for step in steps]
    for host in hosts or ():
        described += _kernel_target_host_steps(sub, host)
    steps = []
    for portid, trsvcid in ports:
        p = f"{cfs}/ports/{int(portid)}"
        steps += [
            f"mkdir {p}",
            f"echo {shlex.quote(trtype)} > {p}/addr_trtype",
            f"echo ipv4 > {p}/addr_adrfam",
            f"echo {shlex.quote(traddr)} > {p}/addr_traddr",
            f"echo {int(trsvcid)} > {p}/addr_trsvcid",
            *([f"echo tls1.3 > {p}/addr_tsas"] if portid in tls_ports else []),
            f"ln -s {sub} {p}/subsystems/{q_nqn}",
        ]
    described += [(step, step) for step in steps]
    lines = [
        f"{step} || {{ echo {shlex.quote('guest_kernel_target: failed: ' + what)}; exit 1; }}"
        for step, what in described
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the kernel target guest

KERNEL_TARGET_NQN = "nqn.2026-11.io.nvmeof-toolkit:kernel-target"
KERNEL_TARGET_PORT = 4420  # guest-side nvmet port 1
KERNEL_DISCOVERY_PORT = 8009  # guest-side nvmet port 2: the same subsystem, at the discovery port
KERNEL_TARGET_SIZE_MIB = 64
_KERNEL_TARGET_READY = "@@KERNEL-TARGET-READY@@"


@dataclasses.dataclass
class KernelTarget:
    """The Linux kernel target (nvmet-tcp) in a guest, reached from the host through hostfwd.

    Both guest ports serve discovery and I/O.  The guest's discovery log entries name the guest's
    own address (10.0.2.15) and ports, which the host cannot reach: a host-side client keeps using
    `traddr`/`trsvcid` below.
    """

    traddr: str
    trsvcid: int  # host port forwarded to the guest's port 4420
    subnqn: str
    discovery_trsvcid: int  # host port forwarded to the guest's port 8009
    size: int  # each namespace's size in bytes
    guest: Guest


def kernel_target_script(
    subnqn: str = KERNEL_TARGET_NQN,
    size_mib: int = KERNEL_TARGET_SIZE_MIB,
    hosts: Sequence[KernelTargetHost] | None = None,
    namespaces: int = 1,
    resv_enable: bool = False,
) -> str:
    """Guest script: configure nvmet on ports 4420 and 8009, print a ready marker, then idle."""
    setup = guest_kernel_target_script(
        subnqn, ((1, KERNEL_TARGET_PORT), (2, KERNEL_DISCOVERY_PORT)), size_mib=size_mib, hosts=hosts,
        namespaces=namespaces, resv_enable=resv_enable,
    )
    return setup + f'echo "{_KERNEL_TARGET_READY}"\nwhile :; do sleep 3600; done\n'


def start_kernel_target(
    assets: Assets | None = None,
    *,
    subnqn: str = KERNEL_TARGET_NQN,
    size_mib: int = KERNEL_TARGET_SIZE_MIB,
    hosts: Sequence[KernelTargetHost] | None = None,
    namespaces: int = 1,
    resv_enable: bool = False,
) -> KernelTarget:
    """Boot a guest running the kernel target; the caller stops `.guest`.

    `hosts`: only these hosts may connect, with their DH-HMAC-CHAP settings (default: any host).
    `namespaces`, `resv_enable`: as for guest_kernel_target_script.
    Host ports are picked free; if one is taken before QEMU binds it, new ports are picked.
    """
    guest, (io_port, disc_port) = boot_with_forwards(
        assets, (KERNEL_TARGET_PORT, KERNEL_DISCOVERY_PORT),
        kernel_target_script(subnqn, size_mib, hosts, namespaces, resv_enable), _KERNEL_TARGET_READY)
    return KernelTarget(
        traddr="127.0.0.1",
        trsvcid=io_port,
        subnqn=subnqn,
        discovery_trsvcid=disc_port,
        size=size_mib << 20,
        guest=guest,
    )


def boot_with_forwards(assets: Assets, guest_ports: Sequence[int], script: str, ready: str,
                       timeout: float = 60) -> tuple[Guest, list[int]]:
    """Boot a guest running ``script`` with each of ``guest_ports`` forwarded from a free host port, and wait
    for ``ready`` on its console: the guest and the host ports, in the order of ``guest_ports``. A host port
    taken before QEMU binds it (QEMU refuses the "host forwarding") is picked again, up to three tries; the
    guest is stopped on any failure."""
    for attempt in range(3):
        ports = free_ports(len(guest_ports))
        guest = Guest(assets, hostfwd=tuple(zip(ports, guest_ports, strict=True)))
        try:
            guest.start(script)
            guest.wait_for(ready, timeout)
        except GuestBootError as exc:
            guest.stop()
            if "host forwarding" in exc.output and attempt < 2:
                continue
            raise
        except BaseException:
            guest.stop()
            raise
        return guest, list(ports)
    raise AssertionError("unreachable")
