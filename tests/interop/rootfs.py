"""A Debian bookworm guest with Python and pyverbs, booted by the VM harness (tests/interop/vm.py).

The busybox initramfs of vm.py has no Python. RDMA tests that drive pyverbs, and kernel-attach tests
that run the project's code inside the guest, boot this instead:

- an ext4 root image made by ``mmdebstrap --variant=apt`` with the packages below plus the Debian
  kernel's complete module tree, cached next to the harness's kernel and keyed by a hash of its
  recipe (package list, kernel package, format);
- a small busybox initramfs (cached too) that loads virtio + ext4, mounts the image (attached with
  ``snapshot=on``, so guests never change the cached file and may run side by side), copies the
  per-boot script into the new root's /run and switch_roots to a second-stage init there;
- the second stage loads the NVMe-oF / RDMA modules and 9p, brings eth0 up as vm.py does, mounts
  the host folders shared with ``-virtfs`` (the project tree at /host, its Python dependencies at
  /pydeps), prints the harness's ready marker and runs the script.

QEMU, the boot deadline and retries, the markers and the kill-on-exit guarantees are vm.py's
``Guest``: this module only supplies different boot assets and QEMU arguments.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import inspect
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tests.interop import vm

SUITE = "bookworm"
PACKAGES: tuple[str, ...] = (
    "python3",
    "python3-pyverbs",
    "rdma-core",
    "ibverbs-providers",
    "ibverbs-utils",   # ibv_devices / ibv_devinfo when a test has to say why a device is missing
    "rdmacm-utils",    # rping: a known-good rdma_cm peer for diagnosing our own
    "nvme-cli",
    "fio",
    "iproute2",
    "kmod",
    "mount",
    "procps",
    # blktests (docs/blktests.md): its `check` wants gawk, udevadm and column; the nvme group uuidgen and mkfs.xfs
    "bsdextrautils",
    "gawk",
    "udev",
    "uuid-runtime",
    "xfsprogs",
)
# Bump when the image layout changes in a way the recipe hash would not see.
IMAGE_FORMAT = 1
# Free space left in the image; writes go to QEMU's snapshot overlay, this is for tools that
# check free space (and for debugging with the snapshot off).
IMAGE_SLACK_MB = 256

# The project's own pure-Python dependencies, copied from the host's installed distributions into
# a folder the guest mounts over 9p: the guest installs nothing and gets the very versions the
# host tests use (Debian's python3-construct is older than pyproject allows).
# cryptography (nvmeof.auth's FFDHE and HMAC) ships an abi3 extension and cffi one for cpython-311,
# which both the host's and bookworm's Python 3.11 load.
GUEST_PYTHON_DISTRIBUTIONS: tuple[str, ...] = ("construct", "crc32c", "click", "pyudev", "cryptography", "cffi",
                                               "pycparser")

PROJECT_ROOT = Path(__file__).resolve().parents[2]
GUEST_PROJECT = "/host"
GUEST_PYDEPS = "/pydeps"
GUEST_SHARE_ROOT = "/mnt"  # extra shares mount at /mnt/<tag>

# Initramfs stage: just enough to mount the root image (ext4 asks the crypto API for crc32c).
ROOT_MODULES: tuple[str, ...] = ("virtio_pci", "virtio_blk", "crc32c_generic", "ext4")
# Second stage: 9p first (the shares), then what vm.py loads in its own guests.
STAGE2_MODULES: tuple[str, ...] = ("9p", "9pnet_virtio", *vm.BOOT_MODULES)

_RUN = "/run/nvmeof-vm"

STAGE1_INIT = r"""#!/bin/sh
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() { echo "nvmeof-rootfs stage 1: $*"; poweroff -f; }
@INSMODS@
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
[ -b /dev/vda ] || fail "no /dev/vda (root image not attached?)"
mkdir -p /newroot
mount -t ext4 /dev/vda /newroot || fail "cannot mount /dev/vda"
mount -t tmpfs -o mode=0755 tmpfs /newroot/run || fail "cannot mount /run"
mkdir -p /newroot@RUN@
cp -a @RUN_DIR@/. /newroot@RUN@/ || fail "cannot copy the run files"
cp /bin/busybox /newroot@RUN@/busybox
cp /stage2 /newroot@RUN@/init
chmod 755 /newroot@RUN@/init /newroot@RUN@/busybox
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot @RUN@/init
"""

STAGE2_INIT = r"""#!/bin/sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
R=@RUN@
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
hostname nvmeof-guest
TOKEN=$(cat $R/token)
""" + vm.GUEST_MODULES_AND_NETWORK.replace("@WHO@", "nvmeof-rootfs") + r"""
while read -r tag dir opts; do
    [ -n "$tag" ] || continue
    mkdir -p "$dir"
    mount -t 9p -o "trans=virtio,version=9p2000.L,msize=524288,$opts" "$tag" "$dir" \
        || echo "nvmeof-rootfs init: cannot mount 9p share $tag at $dir"
done < $R/shares
mkdir -p /etc/nvme
nvme gen-hostnqn > /etc/nvme/hostnqn
cat /proc/sys/kernel/random/uuid > /etc/nvme/hostid
dmesg -n 7
# The script's own serial port (vm.INIT_SCRIPT says why): no kernel message can tear its lines.
OUT=/dev/ttyS1
[ -c $OUT ] || { echo "nvmeof-rootfs init: no $OUT, the script shares the kernel console"; OUT=/dev/console; }
echo "@@NVMEOF-VM-READY $TOKEN@@" > $OUT
cd /root
sh $R/run.sh < /dev/null > $OUT 2>&1
rc=$?
sync
echo "@@NVMEOF-VM-EXIT $TOKEN $rc@@" > $OUT
$R/busybox poweroff -f
"""


@dataclasses.dataclass(frozen=True)
class RootfsAssets:
    image: Path
    initramfs: Path
    pydeps: Path
    vm_assets: vm.Assets
    build_seconds: float | None  # time spent building now, None when everything came from the cache

    def guest_assets(self) -> vm.Assets:
        """vm.Assets whose initramfs is the root-mounting one, for vm.Guest."""
        return dataclasses.replace(self.vm_assets, initramfs=self.initramfs)


def missing_host_tools() -> list[str]:
    """Host commands the image build needs (install_rootfs_deps.sh installs them)."""
    path = os.environ.get("PATH", "") + ":/sbin:/usr/sbin"
    return [t for t in ("mmdebstrap", "mkfs.ext4", "apt-get", "dpkg-deb", "depmod", "busybox")
            if shutil.which(t, path=path) is None]


def _run(cmd: Sequence[str], *, cwd: Path | None = None, what: str = "") -> str:
    try:
        proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise vm.VmSetupError(
            f"{cmd[0]} is not installed; run tests/interop/install_rootfs_deps.sh as root") from exc
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-3000:]
        raise vm.VmSetupError(f"{what or shlex.join(cmd)} failed with exit status {proc.returncode}: {tail}")
    return proc.stdout


def recipe_hash(kernel_package: str) -> str:
    recipe = {"suite": SUITE, "packages": sorted(PACKAGES), "kernel": kernel_package,
              "format": IMAGE_FORMAT, "slack": IMAGE_SLACK_MB}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _boot_hash(image_key: str) -> str:
    text = "\n".join((image_key, STAGE1_INIT, STAGE2_INIT, *ROOT_MODULES, *STAGE2_MODULES))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _module_chain(modules_dir: Path, names: Iterable[str]) -> list[str]:
    """Relative .ko paths to insmod, dependencies first, for module names (- and _ are the same)."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        by_name[Path(path).name.removesuffix(".ko").replace("-", "_")] = path
    builtin = {Path(p).name.removesuffix(".ko").replace("-", "_")
               for p in (modules_dir / "modules.builtin").read_text().split()}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        # modules.dep lists the full transitive closure, deepest last: load in reverse
        for dep in reversed(deps[path]):
            visit(dep)
        order.append(path)

    for name in names:
        key = name.replace("-", "_")
        if key in builtin:
            continue
        if key not in by_name:
            raise vm.VmSetupError(f"the kernel has no module {name!r} (not in modules.dep nor builtin)")
        visit(by_name[key])
    return order


def _fetch_kernel_modules(package: str, work: Path) -> tuple[str, Path]:
    """(kernel version, lib/modules/KVER) of the complete kernel package, unpacked under work."""
    _run(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package], cwd=work)
    debs = list(work.glob("*.deb"))
    if len(debs) != 1:
        raise vm.VmSetupError(f"apt-get download {package} produced {len(debs)} .deb files, expected 1")
    kroot = work / "kernel"
    _run(["dpkg-deb", "-x", str(debs[0]), str(kroot)])
    debs[0].unlink()
    trees = [p for p in (kroot / "lib" / "modules").iterdir() if p.is_dir()]
    if len(trees) != 1:
        raise vm.VmSetupError(f"{package} holds {len(trees)} module trees, expected 1")
    return trees[0].name, trees[0]


def _build_image(assets: vm.Assets, image: Path, work: Path) -> None:
    kver, modules = _fetch_kernel_modules(assets.kernel_package, work)
    if kver != assets.kernel_version:
        raise vm.VmSetupError(f"{assets.kernel_package} unpacked kernel {kver}, the harness boots "
                              f"{assets.kernel_version}")
    root = work / "root"
    _run([
        "mmdebstrap", "--quiet", "--mode=root", "--variant=apt", f"--include={','.join(PACKAGES)}",
        "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        SUITE, str(root),
    ], what="mmdebstrap")
    # bookworm is merged-/usr: /lib is a link to usr/lib
    dest = root / "usr" / "lib" / "modules" / kver
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(modules, dest, symlinks=True)
    # 6.12's modules are .ko.xz; the stage-1 busybox insmod (and _module_chain) need plain .ko files
    vm.decompress_modules(dest)
    _run(["depmod", "-b", str(root), kver])
    (root / "etc" / "hostname").write_text("nvmeof-guest\n")
    used = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
    size_mb = used // (1 << 20) * 11 // 10 + IMAGE_SLACK_MB
    tmp = image.with_name(image.name + ".tmp")
    _run(["mkfs.ext4", "-q", "-F", "-L", "nvmeof-root", "-E", "root_owner=0:0", "-d", str(root),
          str(tmp), f"{size_mb}M"], what="mkfs.ext4 -d")
    os.replace(tmp, image)


def _build_initramfs(image_root_modules: Path, dest: Path) -> None:
    """The busybox stage that mounts the root image; modules come from the image's own tree."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise vm.VmSetupError("busybox is not installed; run tests/interop/install_deps.sh as root")
    chain = _module_chain(image_root_modules, ROOT_MODULES)
    insmods = "\n".join(f'insmod /lib/modules/{p} || fail "insmod {p}"' for p in chain)
    stage1 = STAGE1_INIT.replace("@INSMODS@", insmods).replace("@RUN@", _RUN).replace(
        "@RUN_DIR@", vm._RUN_DIR)
    stage2 = (STAGE2_INIT.replace("@RUN@", _RUN).replace("@MODULES@", " ".join(STAGE2_MODULES))
              .replace("@GUEST_ADDR@", vm.GUEST_ADDR).replace("@GUEST_PREFIX@", str(vm.GUEST_PREFIX))
              .replace("@HOST_ADDR@", vm.HOST_ADDR))
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        cpio = vm.CpioWriter(f)
        for d in ("dev", "proc", "sys", "newroot", vm._RUN_DIR, "bin", "sbin"):
            cpio.add_dir(d)
        cpio.add_chardev("dev/console", 5, 1)
        cpio.add_chardev("dev/null", 1, 3, 0o666)
        cpio.add_file("bin/busybox", Path(busybox).read_bytes(), 0o755)
        for applet in ("sh", "mount", "umount", "insmod", "mkdir", "cp", "chmod", "sleep", "switch_root",
                       "poweroff", "echo", "cat", "[", "test"):
            cpio.add_symlink(f"bin/{applet}", "/bin/busybox")
        for rel in chain:
            cpio.add_file(f"lib/modules/{rel}", (image_root_modules / rel).read_bytes())
        cpio.add_file("init", stage1.encode(), 0o755)
        cpio.add_file("stage2", stage2.encode(), 0o755)
        cpio.close()
    os.replace(tmp, dest)


def _module_tree_from_image(image: Path, kver: str, work: Path) -> Path:
    """lib/modules/KVER out of the ext4 image (debugfs rdump: no mount, no root privileges needed)."""
    out = work / "modules"
    out.mkdir()
    _run(["debugfs", "-R", f"rdump /usr/lib/modules/{kver} {out}", str(image)], what="debugfs rdump")
    return out / kver


def _copy_distributions(dest: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="pydeps-", dir=dest.parent))
    try:
        for name in GUEST_PYTHON_DISTRIBUTIONS:
            try:
                dist = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError as exc:
                raise vm.VmSetupError(f"the host Python lacks {name}, which the guest borrows; "
                                      f"python3 -m pip install {name}") from exc
            for file in dist.files or ():
                src = Path(dist.locate_file(file))
                if file.parts[0] in ("..", "/") or not src.is_file() or "__pycache__" in file.parts:
                    continue
                out = tmp / file
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, out)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.chmod(0o755)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pydeps_key() -> str:
    versions = []
    for name in GUEST_PYTHON_DISTRIBUTIONS:
        try:
            versions.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name}==missing")
    return hashlib.sha256("\n".join(versions).encode()).hexdigest()[:16]


def _owner_file(path: Path) -> Path:
    return path.with_name(path.name + ".kernel")


def _claim(path: Path, package: str) -> None:
    """Record which kernel package a cached image/initramfs belongs to (for per-kernel clean-up)."""
    owner = _owner_file(path)
    if not owner.is_file() or owner.read_text().strip() != package:
        owner.write_text(package + "\n")


def _remove_stale(out: Path, pattern: str, package: str, keep: Path) -> None:
    """Delete cached files matching `pattern` built for `package` other than `keep`.

    Another kernel's files stay: both kernels' guests share this folder (a file without an owner
    record predates per-kernel caching and is left alone too).
    """
    for stale in out.glob(pattern):
        owner = _owner_file(stale)
        if stale != keep and owner.is_file() and owner.read_text().strip() == package:
            stale.unlink()
            owner.unlink()


def build_rootfs(cache_dir: Path | str | None = None, *, assets: vm.Assets | None = None) -> RootfsAssets:
    """The root image, its initramfs and the guest's Python dependencies; built once and cached.

    ``assets`` picks the kernel (default: vm.build_assets(cache_dir), the 6.1 kernel); each kernel
    package has its own image and initramfs.  Lives in ``<vm cache>/rootfs``; concurrent callers
    serialize on a lock file. The first build downloads the packages and takes minutes; later calls
    return at once.
    """
    assets = assets if assets is not None else vm.build_assets(cache_dir)
    if assets.kernel not in vm.KERNELS:
        # the image's modules come from the host's apt (bookworm); the "bpo" kernel is in a private trixie list
        raise vm.VmSetupError(f"the Debian root file system guest boots only the kernels {', '.join(vm.KERNELS)}, "
                              f"not {assets.kernel!r} ({assets.kernel_package})")
    missing = missing_host_tools()
    out = assets.cache_dir / "rootfs"
    out.mkdir(parents=True, exist_ok=True)
    key = recipe_hash(assets.kernel_package)
    image = out / f"{SUITE}-{key}.ext4"
    initramfs = out / f"boot-{_boot_hash(key)}.cpio"
    pydeps = out / f"pydeps-{_pydeps_key()}"
    began = time.monotonic()
    built = False
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not image.is_file() or not initramfs.is_file():
            if missing:
                raise vm.VmSetupError(f"building the guest root image needs {', '.join(missing)}; run "
                                      "tests/interop/install_rootfs_deps.sh as root")
            work = Path(tempfile.mkdtemp(prefix="build-", dir=out))
            try:
                if not image.is_file():
                    _remove_stale(out, f"{SUITE}-*.ext4", assets.kernel_package, image)
                    _build_image(assets, image, work)
                    modules = work / "root" / "usr" / "lib" / "modules" / assets.kernel_version
                else:
                    modules = _module_tree_from_image(image, assets.kernel_version, work)
                _remove_stale(out, "boot-*.cpio", assets.kernel_package, initramfs)
                _build_initramfs(modules, initramfs)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            built = True
        _claim(image, assets.kernel_package)
        _claim(initramfs, assets.kernel_package)
        if not pydeps.is_dir():
            # No clean-up of other pydeps-* folders: a guest of another environment (another venv with
            # other versions) may be reading one over 9p right now, and each is only a few MiB.
            _copy_distributions(pydeps)
            built = True
    return RootfsAssets(image=image, initramfs=initramfs, pydeps=pydeps, vm_assets=assets,
                        build_seconds=time.monotonic() - began if built else None)


# --------------------------------------------------------------------------- booting


def _qemu_args(rootfs: RootfsAssets, shares: Mapping[str, tuple[Path, bool]]) -> list[str]:
    args = ["-drive", f"file={rootfs.image},format=raw,if=virtio,snapshot=on,cache=unsafe"]
    for tag, (path, readonly) in shares.items():
        if not Path(path).is_dir():
            raise vm.VmSetupError(f"9p share {tag!r}: {path} is not a directory")
        opt = f"local,path={path},mount_tag={tag},security_model=none"
        args += ["-virtfs", opt + (",readonly=on" if readonly else "")]
    return args


def _share_table(project: Path, pydeps: Path, extra: Mapping[str, Path | str],
                 writable_project: bool) -> tuple[dict[str, tuple[Path, bool]], bytes]:
    shares: dict[str, tuple[Path, bool]] = {"host": (project, not writable_project), "pydeps": (pydeps, True)}
    mounts = [("host", GUEST_PROJECT), ("pydeps", GUEST_PYDEPS)]
    for tag, path in extra.items():
        if tag in shares or not tag.isidentifier():
            raise ValueError(f"share tag {tag!r} is taken or not a plain name")
        shares[tag] = (Path(path), False)
        mounts.append((tag, f"{GUEST_SHARE_ROOT}/{tag}"))
    table = "".join(f"{tag} {mnt} {'ro' if shares[tag][1] else 'rw'}\n" for tag, mnt in mounts)
    return shares, table.encode()


def rootfs_guest(
    rootfs: RootfsAssets | None = None,
    *,
    project: Path | str = PROJECT_ROOT,
    shares: Mapping[str, Path | str] | None = None,
    writable_project: bool = False,
    files: dict[str, bytes] | None = None,
    qemu_args: Sequence[str] = (),
    **guest_kwargs: object,
) -> vm.Guest:
    """A vm.Guest (not yet started) that boots the Debian root image with the 9p shares mounted.

    ``files`` are extra guest files relative to the run folder, /run/nvmeof-vm.
    """
    rootfs = rootfs if rootfs is not None else build_rootfs()
    share_map, table = _share_table(Path(project), rootfs.pydeps, shares or {}, writable_project)
    run_files = {f"{vm._RUN_DIR}/shares": table}
    for name, data in (files or {}).items():
        if ".." in Path(name).parts:
            raise ValueError(f"guest file name {name!r} leaves the run folder")
        run_files[f"{vm._RUN_DIR}/{name.strip('/')}"] = data
    if "fio" in inspect.signature(vm.Guest).parameters:
        # fio is in the image; the harness's busybox fio layer must not be appended
        guest_kwargs.setdefault("fio", False)
    return vm.Guest(rootfs.guest_assets(), files=run_files,
                    qemu_args=[*_qemu_args(rootfs, share_map), *qemu_args], **guest_kwargs)  # type: ignore[arg-type]


def run_rootfs_guest(
    script: str,
    *,
    timeout: float = vm.SCRIPT_TIMEOUT,
    rootfs: RootfsAssets | None = None,
    **kwargs: object,
) -> vm.GuestResult:
    """Boot the Debian guest, run ``script`` with /bin/sh (dash) and return its status and console."""
    with rootfs_guest(rootfs, **kwargs) as guest:  # type: ignore[arg-type]
        guest.start(script)
        code = guest.wait_exit(timeout)
        return vm.GuestResult(code, guest.output, guest.script_text)


def python_run_script(setup: str = "", env: Mapping[str, str] | None = None) -> str:
    """The shell that runs the guest's script.py against the shared project tree."""
    exports = {"PYTHONPATH": f"{GUEST_PROJECT}:{GUEST_PYDEPS}", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONUNBUFFERED": "1", **(env or {})}
    lines = [setup.rstrip(), f"cd {GUEST_PROJECT}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
    lines.append(f"exec python3 {_RUN}/script.py")
    return "\n".join(lines) + "\n"


def run_python_guest(
    script: str,
    *,
    setup: str = "",
    env: Mapping[str, str] | None = None,
    timeout: float = vm.SCRIPT_TIMEOUT,
    rootfs: RootfsAssets | None = None,
    **kwargs: object,
) -> vm.GuestResult:
    """Boot the Debian guest and run the Python source ``script`` there, like vm.run_guest.

    The script runs as root from /host (the project tree, read-only) with PYTHONPATH /host:/pydeps,
    so ``import nvmeof`` and ``import pyverbs`` both work. ``setup`` is shell run first (for
    example `rdma link add`); a failing setup line does not stop the script, test it yourself.
    Returns the exit status and the whole console; hung boots are retried and QEMU is always
    killed (vm.Guest). Other keyword arguments go to :func:`rootfs_guest` / vm.Guest.
    """
    files = dict(kwargs.pop("files", None) or {})  # type: ignore[call-overload]
    files["script.py"] = script.encode()
    return run_rootfs_guest(python_run_script(setup, env), timeout=timeout, rootfs=rootfs, files=files,
                            **kwargs)
