#!/usr/bin/env bash
# Debian packages for the Ceph RBD tests (a throwaway one-node cluster, tests/ceph_cluster.py, and
# librbd's Python bindings for target/backends/rbd.py). Idempotent; run as root on Debian bookworm.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
    echo "install_ceph_deps.sh: must run as root (it calls apt-get install)" >&2
    exit 1
fi

packages=(
    ceph-mon        # the monitor
    ceph-osd        # the OSD (memstore: no disk needed)
    ceph-mgr        # not started by the tests; installed so a cluster with a manager can be tried
    ceph-common     # the ceph and rbd CLIs, monmaptool
    python3-rbd     # librbd's binding (compiled for Debian's Python 3.11)
    python3-rados   # librados's binding
)

SCRIPT=install_ceph_deps.sh
# shellcheck source=tests/interop/apt_packages.sh
source "$(dirname "$0")/interop/apt_packages.sh"
install_missing_packages "${packages[@]}"
require_tools ceph-mon ceph-osd ceph rbd monmaptool
echo "install_ceph_deps.sh: Ceph packages for the RBD tests are installed"
