"""`nvmeof serve --workers N`: I/O queues in worker processes, controller state in the main process.

The daemon runs in-process (so the tests can reach TargetService and the pool's placement), its
workers are real processes; the last test runs `nvmeof serve --workers 2` as a subprocess and stops
it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import initiator
from initiator import commands as c
from initiator.queue import HostQueue, TransportError
from nvmeof import defaults
from nvmeof.cli.daemon import Daemon, DaemonOptions
from nvmeof.status import NvmeError, Status
from nvmeof.uri import TransportAddress
from target.workers import PooledTarget, WorkerPool
from tests.ports import free_ports
from tests.procs import child_pids

ROOT = Path(__file__).resolve().parent.parent
NQN = defaults.DEFAULT_SUBSYSTEM_NQN
HOST = "nqn.2014-08.org.nvmexpress:uuid:77777777-0000-4000-8000-000000000007"
MiB = 1 << 20
READ, WRITE = 0x02, 0x01

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create") or sys.platform != "linux",
                                reason="worker processes need Linux memfd and SCM_RIGHTS")


async def eventually(check, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def socket_owner(local_port: int, remote_port: int, pids: list[int]) -> int | None:
    """The pid (among ``pids``) holding the TCP socket 127.0.0.1:local_port <-> 127.0.0.1:remote_port."""
    want_local, want_remote = f"0100007F:{local_port:04X}", f"0100007F:{remote_port:04X}"
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == want_local and fields[2] == want_remote:
                inode = fields[9]
    if inode is None:
        return None
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        for name in os.listdir(fd_dir):
            try:
                if os.readlink(f"{fd_dir}/{name}") == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    return None


def host_port(queue: HostQueue) -> int:
    return queue.sockname[1]


class Served:
    def __init__(self, daemon: Daemon, io: int) -> None:
        self.daemon = daemon
        self.io = io

    @property
    def pool(self) -> WorkerPool:
        target = self.daemon.target
        assert isinstance(target, PooledTarget)
        return target.pool

    def connect(self, **kw):
        kw.setdefault("nr_io_queues", 4)
        return initiator.connect("127.0.0.1", self.io, NQN, hostnqn=HOST, timeout=10, **kw)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    io, disc = free_ports(2)
    daemon = Daemon(DaemonOptions(listen=[TransportAddress("tcp", "127.0.0.1", io)],
                                  discovery=[TransportAddress("tcp", "127.0.0.1", disc)],
                                  api=None, ramdisk_size=4 * MiB, workers=2, backing_dirs=[tmp_path]))
    try:
        await daemon.start()
        yield Served(daemon, io)
    finally:
        await daemon.stop()
    for w in daemon.target.pool.workers:  # type: ignore[attr-defined]
        assert w.proc is not None and w.proc.returncode is not None, f"worker {w.index} still running"


def block(seed: int, n: int = 4096) -> bytes:
    return bytes((seed + i) & 0xFF for i in range(n))


async def write(q: HostQueue, nsid: int, slba: int, data: bytes) -> None:
    await q.submit(c.rw(WRITE, nsid, slba, len(data) // 512), data_out=data)


async def read(q: HostQueue, nsid: int, slba: int, nlb: int) -> bytes:
    buf = bytearray(nlb * 512)
    await q.submit(c.rw(READ, nsid, slba, nlb), data_in=buf)
    return bytes(buf)


async def test_queues_spread_over_workers_and_share_the_ram_disk(served: Served) -> None:
    async with served.connect() as ctrl:
        assert len(ctrl.io_queues) == 4
        pids = served.pool.pids()
        assert len(pids) == 2 and os.getpid() not in pids
        placement = served.pool.placement()
        assert sorted(qid for (_cntlid, qid) in placement) == [1, 2, 3, 4]
        assert set(placement.values()) == set(pids), f"queues not spread over both workers: {placement}"
        # Independently of the pool's bookkeeping: which process really holds each queue's socket. The
        # host sees its Connect answered before the worker has taken the descriptor off the control
        # channel (in flight it is in no process's fd table), so wait for it to land, then compare.
        for q in ctrl.io_queues:
            await eventually(lambda q=q: socket_owner(served.io, host_port(q), pids) is not None,
                             what=f"qid {q.qid}'s socket to reach a worker")
            owner = socket_owner(served.io, host_port(q), pids)
            assert owner == placement[(ctrl.cntlid, q.qid)], f"qid {q.qid}: socket in {owner}"
        # Data written through one queue reads back through every other (the RAM disk is shared).
        for i, q in enumerate(ctrl.io_queues):
            await write(q, 1, 16 * i, block(i, 8192))
        for i in range(4):
            for q in ctrl.io_queues:
                assert await read(q, 1, 16 * i, 16) == block(i, 8192), f"block {i} via qid {q.qid}"
        # The admin queue stays in the main process and keeps working.
        assert (await ctrl.identify_controller()).cntlid == ctrl.cntlid
        ns = served.daemon.target.subsystems[NQN].namespaces[1]
        # Statistics come back from the workers: 4 writes, 16 reads.
        await eventually(lambda: ns.stats.writes == 4 and ns.stats.reads == 16, what="worker statistics")
        assert ns.stats.write_bytes == 4 * 8192


async def test_rest_controllers_show_the_worker_serving_each_queue(served: Served) -> None:
    import httpx

    from api.app import create_app

    app = create_app(served.daemon.service, token="workers")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api",
                                 headers={"Authorization": "Bearer workers"}) as client:
        async with served.connect(nr_io_queues=2) as ctrl:
            resp = await client.get("/api/v1/controllers")
            assert resp.status_code == 200, resp.text
            [info] = [c for c in resp.json() if c["cntlid"] == ctrl.cntlid]
            shown = {q["qid"]: q["worker_pid"] for q in info["queues"]}
            placement = served.pool.placement()
            assert shown == {0: None, 1: placement[(ctrl.cntlid, 1)], 2: placement[(ctrl.cntlid, 2)]}
            assert set(shown.values()) - {None} == set(served.pool.pids())
            # What the API names is where the socket really is.
            for q in ctrl.io_queues:
                assert socket_owner(served.io, host_port(q), served.pool.pids()) == shown[q.qid]
        await eventually(lambda: served.pool.placement() == {}, what="worker queues to go")
        assert (await client.get("/api/v1/controllers")).json() == []


async def test_io_errors_reach_the_controller_error_log(served: Served) -> None:
    async with served.connect(nr_io_queues=2) as ctrl:
        main_ctrl = served.daemon.target.controllers[ctrl.cntlid]
        before = main_ctrl.error_count
        nsze = served.daemon.target.subsystems[NQN].namespaces[1].nsze
        with pytest.raises(NvmeError) as err:
            await read(ctrl.io_queues[1], 1, nsze, 1)
        assert err.value.status == Status.LBA_RANGE
        await eventually(lambda: main_ctrl.error_count == before + 1, what="the error log entry")
        entry = main_ctrl.errors[0]
        assert (entry.sqid, entry.lba, entry.status) == (2, nsze, Status.LBA_RANGE)


async def test_namespace_changes_reach_worker_queues(served: Served) -> None:
    service = served.daemon.service
    async with served.connect() as ctrl:
        q = ctrl.io_queues
        await service.add_namespace(NQN, backend="ram", size=MiB, nsid=2)
        await write(q[0], 2, 0, block(7))
        for other in q[1:]:
            assert await read(other, 2, 0, 8) == block(7)
        await service.add_namespace(NQN, backend="null", size=MiB, nsid=3)
        assert await read(q[2], 3, 100, 8) == bytes(4096)

        # Grow: the new blocks are usable at once on every queue, the old data stays.
        old_nsze = MiB // 512
        await service.resize_namespace(NQN, 2, 2 * MiB)
        for i, other in enumerate(q):
            await write(other, 2, old_nsze + 8 * i, block(20 + i))
        for i in range(4):
            assert await read(q[(i + 1) % 4], 2, old_nsze + 8 * i, 8) == block(20 + i)
        assert await read(q[3], 2, 0, 8) == block(7)
        # Shrink: past the new end is out of range everywhere.
        await service.resize_namespace(NQN, 2, MiB)
        for other in q:
            with pytest.raises(NvmeError) as err:
                await read(other, 2, old_nsze, 8)
            assert err.value.status == Status.LBA_RANGE
        # Grow again: the cut-off blocks read as zeros, not as the data written before the shrink.
        await service.resize_namespace(NQN, 2, 2 * MiB)
        assert await read(q[1], 2, old_nsze, 8) == bytes(4096)

        await service.set_namespace_enabled(NQN, 2, False)
        for other in q:
            with pytest.raises(NvmeError) as err:
                await read(other, 2, 0, 8)
            assert err.value.status == Status.INVALID_NS
        await service.set_namespace_enabled(NQN, 2, True)
        assert await read(q[0], 2, 0, 8) == block(7)

        await service.remove_namespace(NQN, 2)
        for other in q:
            with pytest.raises(NvmeError) as err:
                await read(other, 2, 0, 8)
            assert err.value.status == Status.INVALID_NS
        # A new namespace on the same NSID is a new disk.
        await service.add_namespace(NQN, backend="ram", size=MiB, nsid=2)
        assert await read(q[1], 2, 0, 8) == bytes(4096)


async def test_file_namespace_is_opened_in_each_worker(served: Served, tmp_path: Path) -> None:
    path = tmp_path / "disk.img"
    await served.daemon.service.add_namespace(NQN, backend="file", path=str(path), size=MiB, create=True, nsid=4)
    async with served.connect() as ctrl:
        for i, q in enumerate(ctrl.io_queues):
            await write(q, 4, 8 * i, block(40 + i))
        for i in range(4):
            assert await read(ctrl.io_queues[3 - i], 4, 8 * i, 8) == block(40 + i)
    with open(path, "rb") as f:
        f.seek(8 * 512 * 2)
        assert f.read(4096) == block(42)


async def test_admin_queue_loss_tears_down_worker_queues(served: Served) -> None:
    ctrl = await served.connect()
    try:
        assert len(served.pool.placement()) == 4
        cntlid = ctrl.cntlid
        served.daemon.target.disconnect_controller(cntlid)
        for q in ctrl.io_queues:
            await asyncio.wait_for(q.wait_closed(), 10)
        assert served.pool.placement() == {}
        assert cntlid not in served.daemon.target.controllers
    finally:
        await ctrl.close()
    # The host's own disconnect (admin queue closed by the host) does the same.
    ctrl = await served.connect()
    queues = list(ctrl.io_queues)
    await ctrl.close()
    for q in queues:
        await asyncio.wait_for(q.wait_closed(), 10)
    await eventually(lambda: served.pool.placement() == {}, what="worker queues to go")
    # And the workers keep serving new controllers.
    async with served.connect(nr_io_queues=2) as ctrl:
        await write(ctrl.io_queues[0], 1, 0, block(3))
        assert await read(ctrl.io_queues[1], 1, 0, 8) == block(3)


async def test_handoff_carries_a_half_received_capsule_and_the_digests(served: Served) -> None:
    """The host's next capsule is half in when its Connect completes: the worker goes on from the main
    process's TcpConnection.export_state() (those bytes, both digests), with no IC exchange replayed."""
    from raw_pdu import RawPeer, admin_host, capsule_cmd, connect_pdu, sqe

    from nvmeof.spec.nvme import Command

    states = []
    hand_off = served.pool.hand_off

    def spy(conn, fd, state):  # type: ignore[no-untyped-def]
        states.append(state)
        return hand_off(conn, fd, state)

    served.pool.hand_off = spy  # type: ignore[method-assign]
    admin, cntlid = await admin_host(served.io, subnqn=NQN)
    peer = await RawPeer.open(served.io)
    try:
        await peer.handshake(hdgst=True, ddgst=True)
        data = block(9, 4096)
        write_pdu = capsule_cmd(sqe(Command(WRITE, nsid=1, cdw10=64, cdw12=7), cid=2, data_len=4096, incapsule=True),
                                data, hdgst=True, ddgst=True)
        half = len(write_pdu) // 2
        await peer.send(connect_pdu(1, NQN, qid=1, cntlid=cntlid, hdgst=True, ddgst=True) + write_pdu[:half])
        assert await peer.wait_for(lambda o: o.done(1), 10)
        assert peer.out.cqe(1) is not None and peer.out.cqe(1).status_code == 0
        await eventually(lambda: (cntlid, 1) in served.pool.placement(), what="the hand-off")
        [state] = states
        assert state.unconsumed == write_pdu[:half] and (state.hdgst, state.ddgst) == (True, True)
        await peer.send(write_pdu[half:])
        assert (await peer.command(b"", 2)).status_code == 0
        read_pdu = capsule_cmd(sqe(Command(READ, nsid=1, cdw10=64, cdw12=7), cid=3, data_len=4096),
                               hdgst=True, ddgst=True)
        assert (await peer.command(read_pdu, 3)).status_code == 0
        assert peer.out.read_data(3) == data and not peer.out.errors
        owner = socket_owner(served.io, peer.writer.get_extra_info("sockname")[1], served.pool.pids())
        assert owner == served.pool.placement()[(cntlid, 1)]
    finally:
        await peer.close()
        assert admin.transport is not None
        admin.transport.close()


async def test_io_keeps_the_controller_alive(served: Served) -> None:
    async with served.connect(nr_io_queues=2, kato=60_000) as ctrl:
        main_ctrl = served.daemon.target.controllers[ctrl.cntlid]
        # With KATO 60 s the host's own Keep Alive is 30 s away: only I/O in the workers can move it.
        main_ctrl.last_keep_alive = 0.0
        await read(ctrl.io_queues[0], 1, 0, 8)
        await eventually(lambda: main_ctrl.last_keep_alive > 0.0, timeout=3, what="keep-alive from worker I/O")


async def test_a_dead_worker_fails_only_its_queues(served: Served) -> None:
    async with served.connect() as ctrl:
        placement = served.pool.placement()
        victim = placement[(ctrl.cntlid, 1)]
        survivor = next(pid for pid in served.pool.pids() if pid != victim)
        os.kill(victim, signal.SIGKILL)
        victims = [q for q in ctrl.io_queues if placement[(ctrl.cntlid, q.qid)] == victim]
        others = [q for q in ctrl.io_queues if placement[(ctrl.cntlid, q.qid)] == survivor]
        assert victims and others
        for q in victims:
            await asyncio.wait_for(q.wait_closed(), 10)
            with pytest.raises(TransportError):
                await read(q, 1, 0, 8)
        await eventually(lambda: len(served.pool.pids()) == 2 and victim not in served.pool.pids(),
                         what="a new worker")
        assert set(served.pool.placement().values()) == {survivor}
        # The controller, its admin queue and its other queues live on.
        for q in others:
            await write(q, 1, 0, block(9))
            assert await read(q, 1, 0, 8) == block(9)
        assert (await ctrl.identify_controller()).cntlid == ctrl.cntlid
        assert ctrl.cntlid in served.daemon.target.controllers
    # A new controller gets queues on the new worker too, and sees the same data.
    async with served.connect() as ctrl2:
        assert set(served.pool.placement().values()) == set(served.pool.pids())
        for q in ctrl2.io_queues:
            assert await read(q, 1, 0, 8) == block(9)


async def test_sigterm_stops_the_target_and_its_workers() -> None:
    io, disc = free_ports(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "nvmeof", "serve", "--workers", "2", "--api", "none", "--ramdisk-size", "4M",
         "-l", f"127.0.0.1:{io}", "-d", f"127.0.0.1:{disc}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        loop = asyncio.get_running_loop()
        banner = ""
        while "Stop with" not in banner:
            line = await loop.run_in_executor(None, proc.stdout.readline)  # type: ignore[union-attr]
            assert line, f"serve exited early:\n{banner}"
            banner += line
        workers = child_pids(proc.pid)
        assert len(workers) == 2, banner
        async with initiator.connect("127.0.0.1", io, NQN, hostnqn=HOST, nr_io_queues=2, timeout=10) as ctrl:
            await write(ctrl.io_queues[0], 1, 0, block(5))
            assert await read(ctrl.io_queues[1], 1, 0, 8) == block(5)
            owners = {socket_owner(io, host_port(q), workers) for q in ctrl.io_queues}
            assert owners == set(workers)
            proc.send_signal(signal.SIGTERM)
            rc = await loop.run_in_executor(None, proc.wait, 20)
            assert rc == 0
            for q in ctrl.io_queues:
                await asyncio.wait_for(q.wait_closed(), 10)
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}")], "worker processes left behind"
        output = proc.stdout.read()  # type: ignore[union-attr]
        assert "Traceback" not in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_worker_log_lines_have_the_main_process_layout() -> None:
    """`nvmeof serve` and its workers share one stderr log: a worker's ERROR must read "<date> <time> ERROR"
    like the main process's, or log checks keyed on that layout (tests/interop/ourtarget.py) miss it."""
    import json
    import re

    from target.worker_channel import socket_pair

    parent, child = socket_pair()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "target.worker", "--fd", str(child.fileno()), "--index", "3",
                                 "--log-level", "INFO"], pass_fds=(child.fileno(),), cwd=ROOT,
                                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    finally:
        child.close()
    try:
        parent.settimeout(10)
        assert json.loads(parent.recv(1 << 16))["op"] == "ready"
        parent.send(json.dumps({"op": "no-such-op"}).encode())
        parent.send(json.dumps({"op": "exit"}).encode())
        _out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
    finally:
        parent.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    errors = [line for line in err.splitlines() if "no-such-op" in line]
    assert len(errors) == 1, err
    assert re.match(r"^\S+ \S+ ERROR worker3 nvmeof\.worker: ", errors[0]), errors[0]


async def test_a_worker_serves_the_checked_file_not_whatever_its_path_names_now(tmp_path: Path) -> None:
    """Issue 10 item 1: a worker reopened the namespace's path, so a file swapped for another (a link
    to /etc/shadow, say) after the main process checked it was served. It now gets the descriptor."""
    from target.backends import attach_backend
    from target.backends.file import FileBackend

    path = tmp_path / "disk.img"
    path.write_bytes(b"A" * 4096)
    checked = FileBackend(path)
    description, fds = checked.describe_for_worker()   # what the main process sends the worker
    path.unlink()
    path.write_bytes(b"B" * 4096)  # swapped after the check
    fd = os.dup(fds[0])             # the worker's copy, as SCM_RIGHTS gives it
    checked.close()
    backend = attach_backend(description, [fd])
    try:
        assert bytes(await backend.read(0, 4)) == b"AAAA"
    finally:
        backend.close()


async def test_a_qos_limit_is_enforced_in_the_workers(served: Served) -> None:
    """Each of the N workers enforces 1/N of the namespace's rates (ARCHITECTURE.md, QoS); what they delay is
    reported to the main process's counters."""
    service = served.daemon.service
    ns = service.get_namespace(NQN, 1)
    await service.set_namespace_qos(NQN, 1, {"rw_ios_per_second": 100})
    async with served.connect() as ctrl:
        q = ctrl.io_queues
        data = await asyncio.gather(*(read(q[i % 4], 1, i, 8) for i in range(40)))
        assert data == [bytes(4096)] * 40   # delayed, none failed
        await eventually(lambda: ns.stats.reads >= 40 and ns.stats.throttled > 0, what="throttled reads reported")
        # lifted live: the workers are told, and the next reads do not wait
        await service.set_namespace_qos(NQN, 1, {"rw_ios_per_second": 0})
        await eventually(lambda: ns.stats.reads >= 40, what="reads reported")
        before = ns.stats.throttled
        await asyncio.gather(*(read(q[i % 4], 1, i, 8) for i in range(40)))
        await eventually(lambda: ns.stats.reads >= 80, what="the second reads reported")
        assert ns.stats.throttled == before
