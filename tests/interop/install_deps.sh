#!/usr/bin/env bash
# Host packages for the QEMU interoperability suite (tests/interop) and the GnuTLS referee.
# Idempotent; run as root on Debian bookworm. Only the distribution's package
# archive has to be reachable: the guest kernel is fetched with `apt-get download`
# by tests/interop/vm.py, not here, so this script never depends on a kernel version.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
    echo "install_deps.sh: must run as root (it calls apt-get install)" >&2
    exit 1
fi

packages=(
    qemu-system-x86   # qemu-system-x86_64 (TCG; KVM does not work on these machines)
    busybox-static    # the guest's /bin/busybox (must be static: the initramfs has no libc for it)
    nvme-cli          # copied into the guest with the libraries ldd lists
    fio
    iproute2          # `rdma` for Soft-RoCE links inside the guest
    cpio              # builds the initramfs archives
    xz-utils          # unpacks vmlinux from the bzImage's xz stream
    zstd              # unpacks vmlinux from the 6.12 bzImage's zstd stream
    kmod              # depmod for the guest's modules.dep
    dpkg              # dpkg -x of the kernel package
    apt               # apt-get download / apt-cache depends
    debian-archive-keyring  # verifies the trixie-backports lists of the "bpo" kernel (vm.py, private apt lists)
    binutils          # readelf, used to check the extracted vmlinux is an ELF with a PVH note
    libc-bin          # ldd
    gnutls-bin        # gnutls-cli / gnutls-serv: tests/test_tls_gnutls.py, a second TLS stack against ours
)

SCRIPT=install_deps.sh
# shellcheck source=tests/interop/apt_packages.sh
source "$(dirname "$0")/apt_packages.sh"
install_missing_packages "${packages[@]}"
require_tools qemu-system-x86_64 busybox nvme fio rdma cpio xz zstd depmod dpkg-deb gnutls-cli gnutls-serv
echo "install_deps.sh: host packages for tests/interop are installed"
