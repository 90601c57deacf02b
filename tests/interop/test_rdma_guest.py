"""RDMA groundwork proven inside the Debian guest on Soft-RoCE (rxe0 over the guest's eth0).

1. pyverbs + rdma_cm with NVMe/RDMA private data from nvmeof.spec.rdma, driven by nvmeof.rdma's
   sans-IO queues: CM accept, RDMA READ, RDMA WRITE + SEND (tests/interop/rdma_guest_script.py).
2. The kernel NVMe/RDMA host against the kernel target over rxe0 in the same guest.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.interop import guest_steps, rootfs, vm

pytestmark = [pytest.mark.vm, pytest.mark.rdma, pytest.mark.slow]

RXE_SETUP = """
modprobe crc32_generic
modprobe rdma_rxe
rdma link add rxe0 type rxe netdev eth0 || { echo "rdma link add failed"; exit 1; }
"""


@pytest.fixture(scope="module")
def debian_rootfs(vm_assets: vm.Assets) -> rootfs.RootfsAssets:
    missing = rootfs.missing_host_tools()
    if missing and os.geteuid() == 0:
        subprocess.run(["bash", str(Path(__file__).with_name("install_rootfs_deps.sh"))],
                       capture_output=True, check=False)
        missing = rootfs.missing_host_tools()
    if missing:
        pytest.skip(f"the Debian guest image needs {', '.join(missing)}: run install_rootfs_deps.sh as root")
    return rootfs.build_rootfs(assets=vm_assets)


def test_pyverbs_cm_read_write_send(debian_rootfs: rootfs.RootfsAssets, tmp_path: Path) -> None:
    # The host and controller processes each write their STEP lines to a file of their own on a 9p
    # share, read here after the guest has exited: no shared console line to tear (guest_steps.py).
    script = Path(__file__).with_name("rdma_guest_script.py").read_text()
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    res = rootfs.run_python_guest(
        script, setup=RXE_SETUP, rootfs=debian_rootfs, timeout=180, shares={"steps": steps_dir},
        env={guest_steps.STEP_DIR_ENV: f"{rootfs.GUEST_SHARE_ROOT}/steps"},
        files={"guest_steps.py": Path(guest_steps.__file__).read_bytes()})
    out = res.script_output
    assert res.exit_code == 0, out[-6000:]
    steps = guest_steps.collect(steps_dir, ("host", "controller"))
    names = {role: [s.name for s in got] for role, got in steps.items()}
    assert names == {"host": ["cm-connect", "rdma-write-send"], "controller": ["cm-accept", "rdma-read"]}, (
        f"steps {names}:\n{out[-4000:]}")
    detail = {s.name: s.detail for got in steps.values() for s in got}
    assert detail["cm-accept"] == "request 56 bytes qid=1 hsqsize=31 cntlid=1"
    assert detail["cm-connect"].startswith("crqsize=32 ")


# Shell: wait_rdma_dev NQN TRIES sets CTRL and DEV to the first RDMA controller of NQN (of any subsystem when
# NQN is "") that has a namespace block device, polling every 0.1 s; DEV stays empty if none appears.
WAIT_RDMA_DEV = r"""
wait_rdma_dev() {
    DEV=""; CTRL=""
    for i in $(seq $2); do
        for c in /sys/class/nvme/nvme*; do
            [ "$(cat $c/transport 2>/dev/null)" = rdma ] || continue
            [ -z "$1" ] || [ "$(cat $c/subsysnqn 2>/dev/null)" = "$1" ] || continue
            CTRL=/dev/$(basename $c)
            for n in $c/nvme*n1 /sys/block/$(basename $c)n1; do
                [ -e "$n" ] && DEV=/dev/$(basename $n | sed 's/c[0-9]*n/n/')
            done
        done
        [ -n "$DEV" ] && [ -b "$DEV" ] && return 0
        DEV=""; sleep 0.1
    done
    return 1
}
"""

KERNEL_RDMA_SCRIPT = """
set -u
NQN=nqn.2026-11.io.nvmeof-toolkit:rxe-selfcheck
{rxe}
{target}
nvme connect -t rdma -a 10.0.2.15 -s 4420 -n $NQN || {{ echo "nvme connect -t rdma failed"; exit 1; }}
{wait_dev}
wait_rdma_dev "" 100
[ -n "$DEV" ] || {{ echo "no rdma namespace block device"; exit 1; }}
echo "KERNEL-RDMA-DEV $DEV transport=$(cat /sys/class/nvme/*/transport | sort -u | tr '\\n' ' ')"
head -c 8388608 /dev/urandom > /tmp/pattern
dd if=/tmp/pattern of=$DEV bs=1M count=8 oflag=direct status=none || {{ echo "dd write failed"; exit 1; }}
dd if=$DEV of=/tmp/back bs=1M count=8 iflag=direct status=none || {{ echo "dd read failed"; exit 1; }}
A=$(sha256sum < /tmp/pattern | cut -d' ' -f1)
B=$(sha256sum < /tmp/back | cut -d' ' -f1)
echo "KERNEL-RDMA-SHA $A $B"
[ "$A" = "$B" ] || {{ echo "checksum mismatch"; exit 1; }}
nvme disconnect -n $NQN || {{ echo "nvme disconnect failed"; exit 1; }}
echo KERNEL-RDMA-OK
"""


def test_kernel_nvme_rdma_host_and_target_over_rxe(debian_rootfs: rootfs.RootfsAssets) -> None:
    target = vm.guest_kernel_target_script("nqn.2026-11.io.nvmeof-toolkit:rxe-selfcheck", ((1, 4420),),
                                           traddr="10.0.2.15", trtype="rdma", size_mib=16)
    script = KERNEL_RDMA_SCRIPT.format(rxe=RXE_SETUP, target=target, wait_dev=WAIT_RDMA_DEV)
    res = rootfs.run_rootfs_guest(script, rootfs=debian_rootfs, timeout=240)
    out = res.script_output
    assert res.exit_code == 0, out[-6000:]
    assert "KERNEL-RDMA-OK" in out
    sha = re.search(r"KERNEL-RDMA-SHA (\w+) (\w+)", out)
    assert sha and sha.group(1) == sha.group(2)
