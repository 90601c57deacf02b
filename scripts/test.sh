#!/usr/bin/env bash
# Install everything the test suite needs (system packages for the QEMU interop suite, the package
# with its dev extras) and run the whole suite. README's second command and .ci/run both run this.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    bash tests/interop/install_deps.sh
    bash tests/interop/install_rootfs_deps.sh
    bash tests/install_ceph_deps.sh
    bash tests/install_browser_deps.sh
else
    echo "scripts/test.sh: not root or no apt-get: system packages for the VM suite are not installed;" \
         "VM, Ceph and browser tests will skip with the reason" >&2
fi

python3 -m pip install --quiet --disable-pip-version-check -e '.[dev]'
python3 -m ruff check .

set +e
python3 -m pytest -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$rc"
