"""Kernel attach (initiator.kernel, `nvmeof connect` / `disconnect`) inside the Debian guest, one boot.

The guest runs tests/interop/kernel_attach_guest.py against two targets in the same guest:
1. our `nvmeof serve` (64 MiB RAM disk) on 127.0.0.1: kernel.connect -> /dev/nvmeXnY found with pyudev while
   no udevd runs -> 8 MiB dd round trip with O_DIRECT (sha256 equal) -> controllers() -> a duplicate connect
   refused -> disconnect and the device gone; the same through `nvmeof connect --json`, `connect --list`,
   `disconnect -n`, with their exit codes; a wrong subsystem NQN (exit 4, the message points at the NQN
   and dmesg);
2. the kernel target (nvmet-tcp, 32 MiB brd) as referee, after starting systemd-udevd;
3. nvme-tcp, nvme-rdma and nvme-fabrics unloaded: the message says how to load them (exit 4), and the
   very command it names brings /dev/nvme-fabrics back so a connect works again.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.interop import rootfs, vm
from tests.interop.test_rdma_guest import debian_rootfs  # noqa: F401  (fixture)

# The guest's own deadline (run_python_guest timeout=900) is the bound: pytest-timeout's 300 s default cut
# it first on a loaded machine (one CI flake) and lost the guest's output with it.
pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(960)]

NQN = "nqn.2026-11.io.nvmeof-toolkit:kernel-attach"
KNQN = "nqn.2026-11.io.nvmeof-toolkit:kernel-attach-nvmet"
PORT, DPORT, KPORT = 4420, 8009, 4421
GUEST_SCRIPT = Path(__file__).with_name("kernel_attach_guest.py")

STEPS = ("our-target-started", "ours-connect", "ours-dd", "ours-controllers", "ours-duplicate-refused",
         "ours-disconnect", "cli-connect", "cli-list", "cli-disconnect", "cli-errors", "wrong-nqn-api",
         "wrong-nqn-cli", "udevd-started", "nvmet-connect", "nvmet-dd", "nvmet-controllers",
         "nvmet-duplicate-refused", "nvmet-disconnect", "rmmod-fabrics", "no-fabrics-message",
         "modprobe-as-told", "our-target-stopped")


def test_kernel_attach_in_guest(debian_rootfs: rootfs.RootfsAssets, tmp_path: Path) -> None:  # noqa: F811
    setup = vm.guest_kernel_target_script(KNQN, ((1, KPORT),), traddr="127.0.0.1", size_mib=32)
    # Only the runtime needs of the target and host commands: /pydeps lacks httpx and FastAPI, which
    # proves `nvmeof serve --api none`, `nvmeof connect` and `disconnect` run without them.
    env = {"PYTHONPATH": f"{rootfs.GUEST_PROJECT}:{rootfs.GUEST_PYDEPS}",
           # The shares are read-only, so without a cache prefix every `python3 -m nvmeof.cli` recompiles
           # each module it imports; under TCG that cost ~15 s per command.
           "PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": "/tmp/pycache",
           "KA_NQN": NQN, "KA_PORT": str(PORT), "KA_DPORT": str(DPORT), "KA_KNQN": KNQN, "KA_KPORT": str(KPORT)}
    res = rootfs.run_python_guest(GUEST_SCRIPT.read_text(), setup=setup, env=env, rootfs=debian_rootfs,
                                  timeout=900)
    out = res.script_output
    print(out[-15000:])
    assert res.exit_code == 0, out[-15000:]
    done = re.findall(r"^STEP (\S+) OK", out, re.M)
    assert list(done) == list(STEPS), f"steps run: {done}"
    shas = re.findall(r"^SHA (\S+) (\w+) (\w+)$", out, re.M)
    assert len(shas) == 2 and all(a == b for _, a, b in shas), shas
    # pyudev found the devices both without udevd (sysfs alone) and with it (udev's database).
    assert re.search(r"^PYUDEV no-udevd run_udev=False node=/dev/nvme\d+n1 devtype=disk initialized=False", out,
                     re.M), "pyudev view without udevd"
    assert re.search(r"^PYUDEV udevd run_udev=True node=/dev/nvme\d+n1 devtype=disk initialized=True", out,
                     re.M), "pyudev view with udevd"
    msg = re.search(r"^STEP no-fabrics-message OK \S+ exit 4: (.*)$", out, re.M)
    assert msg and "/dev/nvme-fabrics does not exist" in msg.group(1) and "'modprobe nvme-tcp'" in msg.group(1)
    assert re.search(r"^STEP wrong-nqn-cli OK \S+ exit 4: .*wrong subsystem NQN.*dmesg|"
                     r"^STEP wrong-nqn-cli OK \S+ exit 4: .*dmesg.*wrong subsystem NQN", out, re.M)
    assert "KERNEL-ATTACH-ALL-OK" in out
