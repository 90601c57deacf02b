# Shared by install_deps.sh and install_rootfs_deps.sh (sourced, not run): install what is missing
# of a list of Debian packages, then check the tools they provide are there.
# Callers set SCRIPT (their name, for messages) and call the functions below as root.

install_missing_packages() {
    export DEBIAN_FRONTEND=noninteractive
    local missing=() p
    for p in "$@"; do
        if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
            missing+=("$p")
        fi
    done
    # Refreshed every time: the VM harness (apt-get download of the kernel) and mmdebstrap (the
    # guest's packages) read the package lists later, even when every host package is there.
    apt-get update -q
    if [ "${#missing[@]}" -gt 0 ]; then
        apt-get install -y -q --no-install-recommends "${missing[@]}"
    fi
}

require_tools() {
    local tool
    for tool in "$@"; do
        command -v "$tool" >/dev/null || PATH="$PATH:/sbin:/usr/sbin" command -v "$tool" >/dev/null || {
            echo "$SCRIPT: $tool still missing after install" >&2
            exit 1
        }
    done
}
