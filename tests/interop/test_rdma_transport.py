"""Our NVMe/RDMA target and initiator on Soft-RoCE inside the Debian guest, against the Linux kernel.

One boot runs everything (boots cost ~14 s each under TCG):
1. our target (tests/interop/rdma_guest_apps.py, RAM namespace) on rdma://10.0.2.15:4420;
2. the kernel host against it: nvme discover, nvme connect -t rdma, id-ctrl, 64 MiB of random data
   written and read back with O_DIRECT (sha256 equal), fio with crc32c verification, nvme disconnect;
3. bad peers against our target: a rejected CM request, a keyed SGL beyond the host's registered
   region, a host that vanishes; then our initiator against our target (write/read/verify), proving
   the daemon kept serving;
4. our initiator against the kernel target (nvmet-rdma on rdma://10.0.2.15:4421, brd).
"""

from __future__ import annotations

import re

import pytest

from tests.interop import rootfs, vm
from tests.interop.test_rdma_guest import RXE_SETUP, WAIT_RDMA_DEV, debian_rootfs  # noqa: F401  (fixture)

# As in test_vm_kernel_attach: the guest's own 900 s deadline is the bound, not pytest-timeout's 300 s default.
pytestmark = [pytest.mark.vm, pytest.mark.rdma, pytest.mark.slow, pytest.mark.timeout(960)]

NQN = "nqn.2026-11.io.nvmeof-toolkit:rdma-ours"
KNQN = "nqn.2026-11.io.nvmeof-toolkit:rdma-kernel"

SCRIPT = r"""
set -u
{rxe}
APPS=/host/tests/interop/rdma_guest_apps.py
export PYTHONPATH=/host:/pydeps:/usr/lib/python3/dist-packages PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
cd /host
python3 $APPS target {nqn} 10.0.2.15 4420 96 > /tmp/tgt.out 2> /tmp/tgt.log &
TGT=$!
dump() {{ echo "--- target stdout"; cat /tmp/tgt.out; echo "--- target log"; tail -n 80 /tmp/tgt.log; }}
fail() {{ echo "FAIL: $*"; dump; kill $TGT 2>/dev/null; exit 1; }}
for i in $(seq 300); do grep -q TARGET-READY /tmp/tgt.out 2>/dev/null && break; sleep 0.1; done
grep -q TARGET-READY /tmp/tgt.out || fail "our target did not start"
cat /tmp/tgt.out

T0=$(date +%s.%N)
nvme discover -t rdma -a 10.0.2.15 -s 4420 > /tmp/disc.txt 2>&1 || {{ cat /tmp/disc.txt; fail "nvme discover"; }}
cat /tmp/disc.txt
grep -q "subnqn:.*{nqn}" /tmp/disc.txt || fail "discovery log lacks {nqn}"
grep -q "trtype:.*rdma" /tmp/disc.txt || fail "discovery log lacks trtype rdma"
echo "KERNEL-DISCOVER-OK"

nvme connect -t rdma -a 10.0.2.15 -s 4420 -n {nqn} || fail "nvme connect -t rdma"
{wait_dev}
wait_rdma_dev {nqn} 200
[ -n "$DEV" ] || fail "no block device for our RDMA namespace"
echo "KERNEL-CONNECTED $CTRL $DEV"
dmesg | grep -E "nvme.*(I/O queues|new ctrl)" | tail -n 3
nvme id-ctrl $CTRL > /tmp/idctrl.txt || fail "nvme id-ctrl"
grep -E "^(mn|sgls|mdts|ioccsz|cntlid|subnqn) " /tmp/idctrl.txt
echo "KERNEL-IDCTRL-OK"
head -c 67108864 /dev/urandom > /tmp/pattern
S=$(date +%s.%N)
dd if=/tmp/pattern of=$DEV bs=1M count=64 oflag=direct status=none || fail "dd write"
M=$(date +%s.%N)
dd if=$DEV of=/tmp/back bs=1M count=64 iflag=direct status=none || fail "dd read"
E=$(date +%s.%N)
A=$(sha256sum < /tmp/pattern | cut -d' ' -f1)
B=$(sha256sum < /tmp/back | cut -d' ' -f1)
rm -f /tmp/back
rate() {{ echo "$1 $2" | awk '{{printf "%.1f", 64/($2-$1)}}'; }}
echo "KERNEL-SHA $A $B write $(rate $S $M) MiB/s read $(rate $M $E) MiB/s"
[ "$A" = "$B" ] || fail "checksum mismatch"
if command -v fio > /dev/null; then
    fio --name=verify --filename=$DEV --direct=1 --ioengine=libaio --rw=randwrite \
        --bssplit=4k/60:16k/30:128k/10 --size=16M --iodepth=16 --verify=crc32c --do_verify=1 --verify_fatal=1 \
        > /tmp/fio.txt 2>&1 || {{ cat /tmp/fio.txt; fail "fio verify"; }}
    grep -E "err=|IOPS=" /tmp/fio.txt
    echo "KERNEL-FIO-OK"
else
    echo "KERNEL-FIO-MISSING"
fi
nvme disconnect -n {nqn} || fail "nvme disconnect"
echo "KERNEL-DISCONNECT-OK $(echo "$T0 $(date +%s.%N)" | awk '{{printf "%.1f", $2-$1}}')s"

timeout 120 python3 $APPS abuse {nqn} 10.0.2.15 4420 0 || fail "abuse script"
timeout 120 python3 $APPS initiator {nqn} 10.0.2.15 4420 16 || fail "our initiator against our target"
grep -E "torn down|rejected" /tmp/tgt.log | sed 's/^/TARGET-LOG /'
kill -0 $TGT || fail "our target died"

{ktarget}
echo "KERNEL-TARGET-UP"
timeout 120 python3 $APPS initiator {knqn} 10.0.2.15 4421 16 || fail "our initiator against nvmet-rdma"

kill -TERM $TGT
for i in $(seq 100); do kill -0 $TGT 2>/dev/null || break; sleep 0.1; done
dump
grep -q TARGET-STOPPED /tmp/tgt.out || {{ echo "FAIL: target did not stop cleanly"; exit 1; }}
if grep -q Traceback /tmp/tgt.log; then echo "FAIL: traceback in the target log"; exit 1; fi
echo ALL-RDMA-OK
"""


def test_rdma_transport_against_the_kernel(debian_rootfs: rootfs.RootfsAssets) -> None:  # noqa: F811
    ktarget = vm.guest_kernel_target_script(KNQN, ((2, 4421),), traddr="10.0.2.15", trtype="rdma", size_mib=32)
    script = SCRIPT.format(rxe=RXE_SETUP, nqn=NQN, knqn=KNQN, ktarget=ktarget, wait_dev=WAIT_RDMA_DEV)
    res = rootfs.run_rootfs_guest(script, rootfs=debian_rootfs, timeout=900)
    out = res.script_output
    print(out[-12000:])
    assert res.exit_code == 0, out[-12000:]
    for marker in ("KERNEL-DISCOVER-OK", "KERNEL-IDCTRL-OK", "KERNEL-DISCONNECT-OK", "ABUSE-REJECTED",
                   "ABUSE-BAD-SGL", "ABUSE-VANISHED exit 0", "ABUSE-DONE", "ALL-RDMA-OK"):
        assert marker in out, f"{marker} missing"
    assert "INVALID_HSQSIZE" in out
    assert "ABUSE-VANISHING" in out
    assert re.search(r"TARGET-LOG .*torn down: RDMA READ of host data failed, IBV_WC_REM_ACCESS_ERR", out)
    sha = re.search(r"KERNEL-SHA (\w+) (\w+)", out)
    assert sha and sha.group(1) == sha.group(2)
    assert "KERNEL-FIO-OK" in out
    shas = re.findall(r"INITIATOR-SHA (\w+) (\w+)", out)
    assert len(shas) == 2 and all(a == b for a, b in shas), shas
    assert out.count("INITIATOR-OK") == 2
    sgls = re.search(r"^sgls\s+:\s+(0x[0-9a-f]+)", out, re.M)
    assert sgls and int(sgls.group(1), 16) & 0x4, "Identify SGLS lacks keyed SGL support (bit 2)"
