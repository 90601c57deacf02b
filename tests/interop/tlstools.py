"""NVMe/TCP TLS userland for the VM guests: tlshd (ktls-utils), nvme-cli 2.13 and keyctl from Debian trixie.

The kernel does the TLS record layer (net/tls) but hands the TLS 1.3 handshake to a user-space daemon
over the netlink handshake family (net/handshake): tlshd of ktls-utils. Debian bookworm, the guests'
userland, has no ktls-utils, and its nvme-cli 2.3 has neither `nvme connect --tls` nor
`nvme gen-tls-key --insert`. Debian trixie has both (ktls-utils 1.0.0, nvme-cli 2.13), as binary packages
of the Debian archive, the only network CI has. Their sources are not reliably there (the archive the
machines reach returned 404 for ktls-utils' source files), and trixie's binaries need trixie's glibc
(2.41 > bookworm's 2.36) and gnutls 3.8, so they cannot run against bookworm's libraries.

So this module downloads the tools *with* the trixie shared libraries they load (the closure of their
`lib*` dependencies) into a folder of their own and runs each through trixie's own dynamic loader:
``ld-linux-x86-64.so.2 --library-path <folder's libs> <binary>``. The bookworm guest (and the host, for
`nvme gen-tls-key`) runs them unchanged; nothing is installed into the bookworm image, whose recipe hash
therefore stays the same. The folder is cached in the VM cache, keyed by a hash of its recipe, and reaches
the Debian rootfs guest as a read-only 9p share (`rootfs_guest(shares={"tls": tools.root})`); its `bin/`
holds the wrappers (`tlshd`, `nvme`, `keyctl`), which find the libraries relative to themselves.

The trixie lists live in a private apt configuration in the cache (``<cache>/apt-trixie/``), like vm.py's
trixie-backports lists for the "bpo" kernel: the host's bookworm sources never see trixie.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.interop import vm

SUITE = "trixie"
# The tools; their dependencies follow (every Depends/Pre-Depends whose package ships shared libraries).
ROOT_PACKAGES: tuple[str, ...] = ("ktls-utils", "nvme-cli", "keyutils")
# Library packages whose name does not start with "lib".
EXTRA_LIBRARY_PACKAGES: tuple[str, ...] = ("zlib1g",)
# (wrapper name, path of the binary inside the unpacked packages)
TOOLS: tuple[tuple[str, str], ...] = (
    ("tlshd", "usr/sbin/tlshd"),
    ("nvme", "usr/sbin/nvme"),
    ("keyctl", "usr/bin/keyctl"),
)
LIBRARY_DIRS: tuple[str, ...] = ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")
LOADER = "usr/lib64/ld-linux-x86-64.so.2"
# Bump when the folder's layout changes in a way the recipe would not see.
FORMAT = 1

# tlshd.conf(5): the kernel consumers (nvme-tcp, nvmet-tcp) keep their PSKs in the ".nvme" keyring and also
# name it in each handshake request; listing it here links it into tlshd's session keyring on older tlshd.
TLSHD_CONF = """[debug]
loglevel=@LOGLEVEL@
tls=0
nl=0

[authenticate]
keyrings=.nvme
"""

WRAPPER = """#!/bin/sh
# Runs trixie's @NAME@ with trixie's loader and libraries (tests/interop/tlstools.py).
T=$(cd "$(dirname "$0")/.." && pwd)
exec "$T/root/@LOADER@" --library-path "@LIBPATH@" "$T/root/@BINARY@" "$@"
"""


class ToolsUnavailable(vm.VmSetupError):
    """The trixie packages could not be listed or downloaded here (the archive is unreachable, a package gone)."""


@dataclasses.dataclass(frozen=True)
class TlsTools:
    root: Path  # the folder: bin/ (wrappers), root/ (unpacked packages), tlshd.conf, versions.json
    versions: dict[str, str]  # package -> version, as downloaded

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name


def _apt_dir(cache_root: Path) -> Path:
    return cache_root / f"apt-{SUITE}"


def _apt_options(cache_root: Path) -> list[str]:
    return vm.private_apt_options(_apt_dir(cache_root))


def _apt_update(cache_root: Path) -> None:
    try:
        vm.private_apt_update(_apt_dir(cache_root), SUITE)
    except vm.KernelUnavailable as exc:
        raise ToolsUnavailable(str(exc)) from exc


def _is_library_package(name: str) -> bool:
    return name.startswith("lib") or name in EXTRA_LIBRARY_PACKAGES


def package_closure(cache_root: Path) -> list[str]:
    """ROOT_PACKAGES and every library package they need, transitively (one apt-cache call per level)."""
    level, seen = list(ROOT_PACKAGES), set(ROOT_PACKAGES)
    while level:
        out = subprocess.run(["apt-cache", *_apt_options(cache_root), "depends", "--no-recommends", "--no-suggests",
                              "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", *level],
                             capture_output=True, text=True, check=False).stdout
        listed = set(re.findall(r"^(\S+)$", out, re.MULTILINE))
        if missing := [name for name in level if name not in listed]:
            raise ToolsUnavailable(f"{SUITE} has no package {', '.join(missing)} (apt-cache depends)")
        # "|Depends:" is the first of alternatives: take it (the others are for other setups)
        deps = re.findall(r"^\s*\|?(?:Pre)?Depends:\s*([^\s<]\S*)", out, re.MULTILINE)
        level = sorted({d for d in deps if _is_library_package(d)} - seen)
        seen.update(level)
    return sorted(seen)


def recipe_hash() -> str:
    recipe = {"suite": SUITE, "roots": ROOT_PACKAGES, "extra": EXTRA_LIBRARY_PACKAGES, "tools": TOOLS,
              "format": FORMAT, "conf": TLSHD_CONF, "wrapper": WRAPPER}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _check_resolved(root: Path, binary: Path, libpath: str) -> None:
    """Every library the binary loads comes from the folder, none from the host (which would differ in the guest)."""
    proc = subprocess.run([str(root / LOADER), "--list", "--library-path", libpath, str(binary)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise vm.VmSetupError(f"{binary.name}: the trixie loader cannot resolve its libraries: "
                              f"{(proc.stderr or proc.stdout).strip()[:800]}")
    outside = [line.strip() for line in proc.stdout.splitlines()
               if "=>" in line and str(root) not in line and "linux-vdso" not in line]
    if outside:
        raise vm.VmSetupError(f"{binary.name} loads libraries from outside the trixie folder (a package missing "
                              f"from the closure): {outside}")


def _build(cache_root: Path, dest: Path) -> None:
    _apt_update(cache_root)
    packages = package_closure(cache_root)
    work = Path(tempfile.mkdtemp(prefix="tls-tools-", dir=cache_root))
    try:
        debs = work / "debs"
        debs.mkdir()
        proc = subprocess.run(["apt-get", *_apt_options(cache_root), "download", "-q", *packages], cwd=debs,
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ToolsUnavailable(f"apt-get download of {SUITE}'s {' '.join(packages)} failed with exit status "
                                   f"{proc.returncode}: {proc.stderr.strip()[-800:]}")
        versions: dict[str, str] = {}
        root = work / "out" / "root"
        root.mkdir(parents=True)
        for deb in sorted(debs.glob("*.deb")):
            fields = vm._run(["dpkg-deb", "-f", str(deb), "Package", "Version"])
            info = dict(line.split(": ", 1) for line in fields.splitlines() if ": " in line)
            versions[info["Package"]] = info["Version"]
            vm._run(["dpkg-deb", "-x", str(deb), str(root)])
        if sorted(versions) != packages:
            raise ToolsUnavailable(f"apt-get download gave {sorted(versions)}, expected {packages}")
        out = work / "out"
        libpath = ":".join(f"$T/root/{d}" for d in LIBRARY_DIRS)
        (out / "bin").mkdir()
        for name, rel in TOOLS:
            if not (root / rel).is_file():
                raise vm.VmSetupError(f"{SUITE}'s packages hold no {rel}")
            _check_resolved(root, root / rel, ":".join(str(root / d) for d in LIBRARY_DIRS))
            text = (WRAPPER.replace("@NAME@", name).replace("@LOADER@", LOADER).replace("@LIBPATH@", libpath)
                    .replace("@BINARY@", rel))
            (out / "bin" / name).write_text(text)
            (out / "bin" / name).chmod(0o755)
        (out / "versions.json").write_text(json.dumps(versions, indent=1, sort_keys=True) + "\n")
        out.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        out.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_tls_tools(cache_dir: Path | str | None = None) -> TlsTools:
    """The trixie TLS tools folder, downloaded once and cached (``<vm cache>/tls-tools-<recipe>``).

    Raises ToolsUnavailable when the packages cannot be had (tests skip with that reason).
    """
    cache_root = Path(cache_dir) if cache_dir is not None else vm.default_cache_dir()
    cache_root.mkdir(parents=True, exist_ok=True)
    dest = cache_root / f"tls-tools-{recipe_hash()}"
    with open(cache_root / ".tls-tools.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "versions.json").is_file():
            for stale in cache_root.glob("tls-tools-*"):
                if stale != dest and stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            _build(cache_root, dest)
    return TlsTools(root=dest, versions=json.loads((dest / "versions.json").read_text()))


def tlshd_conf(loglevel: int = 0) -> str:
    return TLSHD_CONF.replace("@LOGLEVEL@", str(int(loglevel)))


def guest_tlshd_script(tools_dir: str, *, log: str = "/tmp/tlshd.log", loglevel: int = 0) -> str:
    """Shell fragment: load the kernel TLS module, start tlshd in the background with a config naming the
    .nvme keyring, wait until it listens on the handshake netlink family. Exits 1 with a message on failure."""
    conf = "/tmp/tlshd.conf"
    q_tools, q_log = shlex.quote(tools_dir), shlex.quote(log)
    return f"""
modprobe tls || {{ echo "guest_tlshd: modprobe tls failed"; exit 1; }}
modprobe nvme-keyring 2>/dev/null
cat > {conf} <<'NVMEOF_TLSHD_CONF'
{tlshd_conf(loglevel).rstrip()}
NVMEOF_TLSHD_CONF
{q_tools}/bin/tlshd -s -c {conf} > {q_log} 2>&1 &
TLSHD_PID=$!
sleep 0.5
kill -0 $TLSHD_PID 2>/dev/null || {{ echo "guest_tlshd: tlshd exited:"; cat {q_log}; exit 1; }}
echo "guest_tlshd: tlshd running, pid $TLSHD_PID"
# its log on the console too (whole lines, prefixed), for the test's failure messages
tail -n +1 -f {q_log} | sed -u 's/^/tlshd: /' &
"""
