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

export DEBIAN_FRONTEND=noninteractive
missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

# mmdebstrap resolves the guest's packages from the host's apt lists: refresh them every time.
apt-get update -q

if [ "${#missing[@]}" -gt 0 ]; then
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

for tool in mmdebstrap mkfs.ext4; do
    command -v "$tool" >/dev/null || PATH="$PATH:/sbin:/usr/sbin" command -v "$tool" >/dev/null || {
        echo "install_rootfs_deps.sh: $tool still missing after install" >&2
        exit 1
    }
done
echo "install_rootfs_deps.sh: host packages for the guest root image are installed"
