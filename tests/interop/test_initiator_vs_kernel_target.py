"""Our Python initiator and the `nvmeof` host commands against the Linux kernel target (nvmet-tcp).

One guest per session (the `kernel_target` fixture) serves every test here: namespace 1 is a 64 MiB
brd RAM disk behind nvmet ports 4420 and 8009, reached through hostfwd ports on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import initiator
from nvmeof import defaults
from tests.interop import vm

pytestmark = pytest.mark.vm

_REPO = Path(__file__).resolve().parents[2]
BLOCK = 512  # brd's logical block size, which nvmet reports
IO_BYTES = 4 << 20
CHUNK = 64 << 10  # one command per 64 KiB: 64 commands in flight for the 4 MiB


def _expect_subsystem(entries: list[initiator.DiscoveryEntry], subnqn: str) -> initiator.DiscoveryEntry:
    subs = [e for e in entries if e.subnqn == subnqn]
    assert subs, f"{subnqn} missing from the kernel target's discovery log: {entries}"
    return subs[0]


@pytest.mark.parametrize("port", ["discovery", "io"])
async def test_discover(kernel_target: vm.KernelTarget, port: str) -> None:
    trsvcid = kernel_target.discovery_trsvcid if port == "discovery" else kernel_target.trsvcid
    entries = await initiator.discover(kernel_target.traddr, trsvcid, timeout=30)
    entry = _expect_subsystem(entries, kernel_target.subnqn)
    assert entry.transport == "tcp" and entry.kind == "nvme"
    # nvmet lists the subsystems of the port asked (nvmet_execute_disc_get_log_page walks
    # req->port->subsystems), under the guest-side port number the hostfwd port leads to.
    guest_port = vm.KERNEL_DISCOVERY_PORT if port == "discovery" else vm.KERNEL_TARGET_PORT
    assert [e.trsvcid for e in entries if e.subnqn == kernel_target.subnqn] == [str(guest_port)]


@pytest.mark.parametrize("digests", [False, True], ids=["plain", "digests"])
async def test_connect_identify_write_read_flush(kernel_target: vm.KernelTarget, digests: bool) -> None:
    data = os.urandom(IO_BYTES)
    # Different LBAs per run, so a read can only match what this run wrote.
    slba = (IO_BYTES // BLOCK) * (2 if digests else 1)
    async with initiator.connect(kernel_target.traddr, kernel_target.trsvcid, kernel_target.subnqn,
                                 nr_io_queues=4, queue_size=32, hdr_digest=digests, data_digest=digests,
                                 timeout=60) as ctrl:
        assert len(ctrl.io_queues) == 4, f"asked for 4 I/O queues, got {len(ctrl.io_queues)}"
        for queue in (ctrl.admin, *ctrl.io_queues):
            assert queue is not None and queue.negotiated_digests == (digests, digests)
        idc = await ctrl.identify_controller()
        assert idc.subnqn == kernel_target.subnqn
        assert idc.cntlid == ctrl.cntlid
        assert idc.cntrltype == 1, f"CNTRLTYPE {idc.cntrltype}: expected an I/O controller"
        assert await ctrl.namespaces() == [1]
        ns = await ctrl.identify_namespace(1)
        assert 1 << ns.lbaf[ns.flbas & 0xF].lbads == BLOCK
        assert ns.nsze * BLOCK == kernel_target.size

        view = memoryview(data)
        nlb = CHUNK // BLOCK
        offsets = range(0, IO_BYTES, CHUNK)
        await asyncio.gather(*(ctrl.write(1, slba + off // BLOCK, view[off:off + CHUNK]) for off in offsets))
        await ctrl.flush(1)
        pieces = await asyncio.gather(*(ctrl.read(1, slba + off // BLOCK, nlb) for off in offsets))
        back = b"".join(pieces)
        assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest(), (
            f"4 MiB read back from the kernel target differs (digests={digests}); first bad byte at "
            f"{next(i for i, (a, b) in enumerate(zip(back, data, strict=True)) if a != b)}")
        # One large request, split by MDTS on the initiator side, must agree too.
        whole = await ctrl.read(1, slba, IO_BYTES // BLOCK)
        assert whole == data
        assert ctrl.mdts_bytes == 0 or ctrl.mdts_bytes < IO_BYTES  # nvmet: MDTS 8 with 4 KiB pages
    assert kernel_target.guest.running


def _nvmeof(*args: str, stdin: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "nvmeof.cli", *args], input=stdin, capture_output=True,
                          timeout=timeout, cwd=_REPO, check=False)


def _ok(proc: subprocess.CompletedProcess[bytes], what: str) -> bytes:
    assert proc.returncode == 0, (f"`nvmeof {what}` exited {proc.returncode}:\nstdout: {proc.stdout[-2000:]!r}\n"
                                  f"stderr: {proc.stderr.decode(errors='replace')[-3000:]}")
    return proc.stdout


def test_cli_commands(kernel_target: vm.KernelTarget, tmp_path: Path) -> None:
    kt = kernel_target
    addr = ["-a", kt.traddr]
    conn = [*addr, "-s", str(kt.trsvcid), "-n", kt.subnqn]

    out = _ok(_nvmeof("discover", *addr, "-s", str(kt.discovery_trsvcid)), "discover")
    assert kt.subnqn.encode() in out and defaults.DISCOVERY_NQN.encode() in out

    disc = _nvmeof("discover", *addr, "-s", str(kt.discovery_trsvcid), "--json")
    rows = json.loads(_ok(disc, "discover --json"))["records"]   # nvme-cli's json_discovery_log shape
    assert kt.subnqn in {r["subnqn"] for r in rows}

    ident = json.loads(_ok(_nvmeof("identify", *conn, "--json"), "identify --json"))
    assert ident["controller"]["subnqn"] == kt.subnqn
    assert [(n["nsid"], n["size"], n["block_size"]) for n in ident["namespaces"]] == [(1, kt.size, BLOCK)]
    table = _ok(_nvmeof("identify", *conn), "identify").decode()
    assert kt.subnqn in table

    data = os.urandom(64 << 10)
    slba = 3 * (IO_BYTES // BLOCK)  # clear of the LBAs the other tests use
    src = tmp_path / "data"
    src.write_bytes(data)
    _ok(_nvmeof("write", *conn, "--slba", str(slba), "-i", str(src)), "write")
    back = _ok(_nvmeof("read", *conn, "--slba", str(slba), "--nlb", str(len(data) // BLOCK)), "read")
    assert back == data, "`nvmeof read` returned other bytes than `nvmeof write` wrote"

    # The same through header and data digests, data piped through stdin.
    data2 = os.urandom(8 << 10)
    _ok(_nvmeof("write", *conn, "--hdr-digest", "--data-digest", "--slba", str(slba), stdin=data2),
        "write --hdr-digest --data-digest")
    back2 = _ok(_nvmeof("read", *conn, "--hdr-digest", "--data-digest", "--slba", str(slba), "--nlb",
                        str(len(data2) // BLOCK)), "read --hdr-digest --data-digest")
    assert back2 == data2
