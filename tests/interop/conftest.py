"""Fixtures for the QEMU interoperability suite: cached VM assets and a Linux kernel target.

Nothing here is autouse, so tests outside tests/interop never pay for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    # `from tests.interop import vm` must work under a bare `pytest` too, not only `python -m pytest`.
    sys.path.insert(0, str(_REPO))

from tests.interop import vm  # noqa: E402

_INSTALL_DEPS = Path(__file__).resolve().parent / "install_deps.sh"


def _qemu_unusable_reason() -> str | None:
    """Why the VM suite cannot run here, or None; installs the host packages first when root."""
    missing = vm.missing_host_tools()
    if missing and os.geteuid() == 0:
        proc = subprocess.run(["bash", str(_INSTALL_DEPS)], capture_output=True, text=True, check=False)
        missing = vm.missing_host_tools()
        if missing:
            return (
                f"QEMU VM suite needs {', '.join(missing)}; {_INSTALL_DEPS.name} exited "
                f"{proc.returncode}: {(proc.stderr or proc.stdout).strip()[-500:]}"
            )
    if missing:
        return f"QEMU VM suite needs {', '.join(missing)}: run `sudo bash {_INSTALL_DEPS}`"
    proc = subprocess.run([vm.QEMU, "--version"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return f"{vm.QEMU} --version exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
    return None


def _kernel_params() -> list[str]:
    try:
        return list(vm.selected_kernels())
    except vm.VmSetupError:
        return list(vm.KERNELS)  # the fixture reports the bad NVMEOF_VM_KERNELS value as an error


@pytest.fixture(scope="session", params=_kernel_params(), ids=lambda kernel: f"k{kernel}")
def vm_assets(request: pytest.FixtureRequest) -> vm.Assets:
    """The boot assets of one kernel: every test using them (directly or through `kernel_target`,
    `debian_rootfs`) runs once per kernel in vm.KERNELS, with ids `k6.1` and `k6.12`.

    Session-scoped and parametrized, so pytest runs all of one kernel's tests before the other's and
    tears down that kernel's guests (the kernel target) before booting the next kernel.
    """
    vm.selected_kernels()  # raises on a bad NVMEOF_VM_KERNELS
    reason = _qemu_unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    return vm.build_assets(kernel=request.param)


class _KernelTargetHolder:
    """One kernel target guest per session, replaced if a test killed it."""

    def __init__(self, assets: vm.Assets) -> None:
        self.assets = assets
        self.current: vm.KernelTarget | None = None

    def get(self) -> vm.KernelTarget:
        if self.current is not None and not self.current.guest.running:
            self.current.guest.stop()
            self.current = None
        if self.current is None:
            self.current = vm.start_kernel_target(self.assets)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.guest.stop()
            self.current = None


@pytest.fixture(scope="session")
def _kernel_target_holder(vm_assets: vm.Assets) -> Iterator[_KernelTargetHolder]:
    holder = _KernelTargetHolder(vm_assets)
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture
def kernel_target(_kernel_target_holder: _KernelTargetHolder) -> vm.KernelTarget:
    """The Linux kernel target (nvmet-tcp) in a guest: traddr 127.0.0.1, trsvcid/discovery_trsvcid
    are host ports forwarded to the guest's 4420/8009, subnqn KERNEL_TARGET_NQN, nsid 1 = 64 MiB brd.

    Shared across the session (restarted if a test killed it): data written by one test stays.
    """
    return _kernel_target_holder.get()
