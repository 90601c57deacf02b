#!/usr/bin/env bash
# Host packages for the Debian guest root image (tests/interop/rootfs.py): the Python + pyverbs
# guest used by the RDMA and kernel-attach tests. Idempotent; run as root on Debian bookworm.
# The QEMU/kernel packages come from install_deps.sh; this script adds only the image builders.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
    echo "install_rootfs_deps.sh: must run as root (it calls apt-get install)" >&2
    exit 1
fi

packages=(
    mmdebstrap        # builds the bookworm root directory from the host's apt sources
    e2fsprogs         # mkfs.ext4 -d: an ext4 image from a directory, no loop mount needed
    debian-archive-keyring  # mmdebstrap verifies the archive with it
    python3-pip       # fallback when the host Python has no pip (pip install --target for guest deps)
)

SCRIPT=install_rootfs_deps.sh
# shellcheck source=tests/interop/apt_packages.sh
source "$(dirname "$0")/apt_packages.sh"
install_missing_packages "${packages[@]}"
require_tools mmdebstrap mkfs.ext4
echo "install_rootfs_deps.sh: host packages for the guest root image are installed"
