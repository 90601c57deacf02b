#!/usr/bin/env bash
# Debian's chromium for the dashboard test (tests/test_ui_browser.py, marker `browser`), which Playwright
# (the PyPI package in the dev extra) drives through executable_path=/usr/bin/chromium: no
# `playwright install`, so no browser build is downloaded. Idempotent; run as root on Debian bookworm.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
    echo "install_browser_deps.sh: must run as root (it calls apt-get install)" >&2
    exit 1
fi

SCRIPT=install_browser_deps.sh
# shellcheck source=tests/interop/apt_packages.sh
source "$(dirname "$0")/interop/apt_packages.sh"
install_missing_packages chromium
require_tools chromium
echo "install_browser_deps.sh: chromium for the dashboard test is installed"
