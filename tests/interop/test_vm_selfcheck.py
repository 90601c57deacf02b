"""Self-check of the QEMU harness: the guest boots, its modules work, the kernel target is reachable."""

from __future__ import annotations

import socket
import struct

import pytest

from tests.interop import vm

pytestmark = pytest.mark.vm

SELFCHECK_NQN = "nqn.2026-11.io.nvmeof-toolkit:selfcheck"


def test_guest_runs_script_and_exit_status_propagates(vm_assets: vm.Assets) -> None:
    # Checks the environment init promises, then exits 3: any failed check shows as another status.
    script = """
test -d /sys/kernel/config/nvmet || exit 10
ip -4 addr show eth0 | grep -q "inet 10.0.2.15/24" || exit 11
ip route | grep -q "default via 10.0.2.2" || exit 12
for m in nvme_tcp nvme_rdma nvmet_tcp nvmet_rdma rdma_rxe; do
    grep -q "^$m " /proc/modules || { echo "module $m not loaded"; exit 13; }
done
command -v nvme rdma dd sha256sum >/dev/null || exit 14
[ -x /sbin/modprobe ] || exit 15
grep -q "^nqn.2014-08.org.nvmexpress:uuid:" /etc/nvme/hostnqn || exit 16
echo "selfcheck: guest environment ok"
exit 3
"""
    result = vm.run_guest(script, assets=vm_assets, timeout=60)
    assert result.exit_code == 3, result.output
    assert "selfcheck: guest environment ok" in result.script_output


def test_kernel_host_against_kernel_target_in_one_guest(vm_assets: vm.Assets) -> None:
    script = (
        vm.guest_kernel_target_script(SELFCHECK_NQN, ((1, 4420),), traddr="127.0.0.1", size_mib=64)
        + f"""
nvme discover -t tcp -a 127.0.0.1 -s 4420 > /tmp/disc || {{ echo "nvme discover failed"; exit 20; }}
cat /tmp/disc
grep -q "subnqn: *{SELFCHECK_NQN}" /tmp/disc || {{ echo "subsystem missing from discovery log"; exit 21; }}
"""
        + vm.guest_nvme_connect_script("127.0.0.1", 4420, SELFCHECK_NQN)
        + """
[ "$(cat /sys/block/${DEV#/dev/}/size)" = 131072 ] || { echo "namespace is not 64 MiB"; exit 22; }
dd if=/dev/urandom of=/tmp/data bs=1M count=16 2>/dev/null || exit 23
dd if=/tmp/data of="$DEV" bs=1M oflag=direct conv=fsync || { echo "write to $DEV failed"; exit 24; }
written=$(sha256sum < /tmp/data | cut -d' ' -f1)
read_back=$(dd if="$DEV" bs=1M count=16 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
echo "selfcheck: written=$written read=$read_back"
[ "$written" = "$read_back" ] || { echo "data read back differs"; exit 25; }
nvme disconnect -d "$CTRL" || { echo "nvme disconnect failed"; exit 26; }
[ ! -e "/sys/class/nvme/$CTRL" ] || { echo "$CTRL still present after disconnect"; exit 27; }
echo "selfcheck: io ok"
"""
    )
    result = vm.run_guest(script, assets=vm_assets, timeout=90)
    assert result.exit_code == 0, result.output
    assert "selfcheck: io ok" in result.script_output
    assert "nvme subsystem" in result.script_output  # the discovery log entry was printed


def _icreq() -> bytes:
    # NVMe/TCP ICReq: common header (type 0, flags 0, hlen 128, pdo 0, plen 128), then pfv 0,
    # hpda 0, digest flags 0, maxr2t 0, and 112 reserved bytes.
    return struct.pack("<BBBBIHBBI112x", 0x00, 0, 128, 0, 128, 0, 0, 0, 0)


def _exchange_ic(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(_icreq())
        resp = b""
        while len(resp) < 128:
            chunk = sock.recv(128 - len(resp))
            if not chunk:
                break
            resp += chunk
    return resp


@pytest.mark.parametrize("which", ["io", "discovery"])
def test_kernel_target_reachable_from_host(kernel_target: vm.KernelTarget, which: str) -> None:
    port = kernel_target.trsvcid if which == "io" else kernel_target.discovery_trsvcid
    resp = _exchange_ic(port)
    assert len(resp) == 128, f"expected a 128-byte ICResp, got {len(resp)} bytes: {resp.hex()}"
    pdu_type, _flags, hlen, pdo, plen = struct.unpack_from("<BBBBI", resp)
    assert (pdu_type, hlen, pdo, plen) == (0x01, 128, 0, 128)
    pfv, _cpda, dgst, maxh2cdata = struct.unpack_from("<HBBI", resp, 8)
    assert pfv == 0
    assert dgst == 0  # no digests were asked for
    assert maxh2cdata >= 4096  # the spec requires at least 4 KiB
    assert kernel_target.guest.running
