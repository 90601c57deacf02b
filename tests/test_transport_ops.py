"""The transport seam: queues carry an ops table, the registry is injected, and a new transport plugs
in from outside the core (target/transport_ops.py, target/lifecycle.py, target/transports/__init__.py)."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import os
import types
from pathlib import Path
from typing import Any

import pytest
from target_host import CC_ENABLE_VALUE, HOSTNQN, SUBNQN, connect_data, make_target, open_tcp

from nvmeof.spec import identify as idf
from nvmeof.spec.fabrics import TrType
from nvmeof.spec.identify import IdentifyController
from nvmeof.spec.logs import ErrorLogEntry
from nvmeof.spec.nvme import (
    SGL_ID_KEYED,
    SGL_ID_TRANSPORT,
    SQE_FLAGS_PSDT_SGL,
    AdminOpcode,
    Command,
    Completion,
    Direction,
    FabricsType,
    IoOpcode,
)
from nvmeof.status import NvmeError, Status
from target.core import Target, check_sgl
from target.model import Listener
from target.request import Request, TargetQueue
from target.transports import TransportRegistry
from target.transports.rdma import RDMA_OPS, RdmaListener
from target.transports.tcp import TCP_OPS, TargetConnection, TcpListener
from target.transports.tcp_batch import BatchTcpListener
from target.workers import BatchPooledTcpListener, PooledTarget

ROOT = Path(__file__).resolve().parent.parent

# A transport the core has never heard of: NVMe/TCP bytes under another trtype, a smaller in-capsule
# size and its own TRTYPE for error log entries (what a TLS-wrapped TCP or another TCP engine would be).
SHADOW_OPS = dataclasses.replace(TCP_OPS, trtype="tcp-shadow", name="NVMe/TCP-shadow", nvme_trtype=TrType.FC,
                                 io_incapsule=4096)


class ShadowConnection(TargetConnection):
    ops = SHADOW_OPS


class ShadowListener(TcpListener):
    connection_class = ShadowConnection


async def test_a_new_transport_serves_connect_and_io_without_touching_the_core() -> None:
    tgt = make_target(transports={"tcp-shadow": ShadowListener})
    # the in-capsule size a listener serves is its own (nvmet's port inline_data_size), here the transport's
    listener = Listener("tcp-shadow", "ipv4", "127.0.0.1", 0, portid=1,   # type: ignore[arg-type]
                        inline_data_size=SHADOW_OPS.io_incapsule)
    tgt.listeners[listener.id] = listener
    server = await tgt.start_listener(listener)
    assert isinstance(server, ShadowListener)
    assert tgt.transports.get("tcp") is BatchTcpListener   # the standard entries stay beside the injected one
    try:
        admin = await open_tcp(server.port)
        res = await admin.connect(SUBNQN, kato=0)
        assert res.status == 0
        cntlid = res.cqe.dw0 & 0xFFFF
        await admin.enable()
        idc = await admin.cmd(Command(AdminOpcode.IDENTIFY, cdw10=1), read_len=4096)
        assert idc.status == 0 and IdentifyController.parse(idc.data).ioccsz == (64 + 4096) // 16
        io = await open_tcp(server.port)
        assert (await io.connect(SUBNQN, qid=1, cntlid=cntlid, sqsize=31)).status == 0
        info = tgt.controllers_info()[0]
        assert info["transport"] == "tcp-shadow" and [q["qid"] for q in info["queues"]] == [0, 1]
        data = os.urandom(64 * 1024)   # beyond the capsule: R2T + H2CData
        assert (await io.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=8, cdw12=127), data)).status == 0
        small = os.urandom(4096)       # in-capsule, within this transport's 4 KiB
        assert (await io.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=200, cdw12=7), small)).status == 0
        back = await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=8, cdw12=127), read_len=len(data))
        assert back.status == 0 and back.data == data
        assert (await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=200, cdw12=7), read_len=4096)).data == small
        # the failure is logged with this transport's TRTYPE
        assert (await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=1 << 30, cdw12=0), read_len=512)).status \
            == Status.LBA_RANGE
        page = await admin.cmd(Command(AdminOpcode.GET_LOG_PAGE, cdw10=0x01 | (15 << 16)), read_len=64)
        entry = ErrorLogEntry.parse(page.data)
        assert entry.trtype == TrType.FC and entry.sqid == 1
        for host in (admin, io):
            host.close()
    finally:
        await tgt.close()


def _request(ops: object, sgl_id: int, length: int) -> Request:
    cmd = Command(IoOpcode.WRITE, nsid=1, flags=SQE_FLAGS_PSDT_SGL)
    cmd.dptr = Command.make_sgl(sgl_id, 0x1000, length, 0x1234)
    req = Request(TargetQueue(ops=ops), cmd)   # type: ignore[arg-type]
    req.direction, req.data_len = Direction.H2C, length
    return req


def test_check_sgl_asks_the_queues_ops_not_a_name() -> None:
    keyed_tcp = dataclasses.replace(TCP_OPS, sgl_types=frozenset({SGL_ID_KEYED}))
    check_sgl(_request(keyed_tcp, SGL_ID_KEYED, 4096))
    with pytest.raises(NvmeError, match=r"NVMe/TCP takes in-capsule \(0x01\) or keyed") as info:
        check_sgl(_request(keyed_tcp, SGL_ID_TRANSPORT, 4096))
    assert info.value.status == Status.SGL_INVALID_TYPE
    assert RDMA_OPS.keyed_sgls and not TCP_OPS.keyed_sgls and keyed_tcp.keyed_sgls


def test_registry_entries_are_imported_when_first_asked_for() -> None:
    reg = TransportRegistry({"tcp": "target.transports.tcp:TcpListener", "x": "no_such_module_anywhere:Listener"})
    assert reg.get("tcp") is TcpListener
    with pytest.raises(ModuleNotFoundError):
        reg.get("x")
    with pytest.raises(ValueError, match="no target transport for trtype 'fc' \\(available: tcp, x\\)"):
        reg.get("fc")
    assert Target(transports=reg).transports is reg


def test_pooled_target_injects_its_tcp_listener_instead_of_copying_start_listener() -> None:
    assert PooledTarget.start_listener is Target.start_listener
    pooled = PooledTarget(1, transports={"tcp-shadow": ShadowListener})
    assert pooled.transports.get("tcp") is BatchPooledTcpListener   # the one NVMe/TCP engine, batch
    assert pooled.transports.get("rdma") is RdmaListener
    assert pooled.transports.get("tcp-shadow") is ShadowListener
    assert Target().transports.get("tcp") is BatchTcpListener   # the standard registry is not changed by it


def test_transport_ops_is_a_leaf() -> None:
    """The interface imports no target module at run time, so every layer can depend on it."""
    tree = ast.parse((ROOT / "target" / "transport_ops.py").read_text())
    runtime = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    names = [n.module or "" for n in runtime if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in runtime if isinstance(n, ast.Import) for a in n.names]
    assert names and not [name for name in names if name.split(".")[0] in ("target", "initiator", "api")]


# --- the NVMe/RDMA command lifecycle without a device (the verbs calls are faked; the VM runs the real ones)


class _Region:
    def __init__(self, size: int, addr: int) -> None:
        self.size, self.addr, self.lkey = size, addr, 7
        self.view = memoryview(bytearray(size))


class _QueuePair:
    def __init__(self) -> None:
        self.posted: list[tuple[int, int, int, int, tuple[int, int] | None]] = []

    def post_send(self, wr_id: int, opcode: int, addr: int, length: int, lkey: int, *,
                  remote: tuple[int, int] | None = None, invalidate_rkey: int | None = None) -> None:
        self.posted.append((wr_id >> 32, wr_id & 0xFFFFFFFF, addr, length, remote))

    def post_recv(self, wr_id: int, addr: int, length: int, lkey: int) -> None:
        pass


def _rdma_queue(monkeypatch: pytest.MonkeyPatch, tgt: Target) -> Any:
    from nvmeof import rdma as core
    from target.transports import rdma

    monkeypatch.setattr(rdma.rv, "cmid_addresses", lambda cmid: ("10.0.0.1:4420", "10.0.0.2:40000"))
    e = types.SimpleNamespace(IBV_WC_SUCCESS=0, IBV_WR_RDMA_READ=4, IBV_WR_RDMA_WRITE=0, IBV_WR_SEND=2,
                              IBV_WR_SEND_WITH_INV=9)
    listener = types.SimpleNamespace(target=tgt, pv=types.SimpleNamespace(e=e), connections={},
                                     listener=Listener("rdma", "ipv4", "10.0.0.1", 4420, portid=1))
    decision = core.accept_connect_request(core.host_connect_private_data(0, 32), cntlid_valid=lambda c: True)
    conn = rdma.RdmaTargetConnection(listener, object(), 1, decision.params, 4)   # type: ignore[arg-type]
    conn.qp, conn.recv = _QueuePair(), _Region(32 * conn.rq.recv_buffer_size, 0x100000)
    conn.rsp, conn.pool = _Region(36 * 16, 0x200000), rdma.rv.BufferPool(_Region(1 << 20, 0x300000))
    conn._free_slots = list(range(35, -1, -1))
    return conn


async def _rdma_command(conn: Any, cmd: Command, host_data: bytes = b"") -> tuple[Any, bytes]:
    """Receive ``cmd`` (keyed SGL at 0x5000, rkey 0x77), serve its RDMA READ with ``host_data``, return the
    response's CQE and what its RDMA WRITE carried."""
    from nvmeof import verbs as rv

    conn.recv.view[:64] = cmd.to_bytes()
    start = len(conn.qp.posted)
    conn._on_capsule(0, 64)
    written = b""
    for _ in range(100):
        await asyncio.sleep(0)
        for kind, index, addr, length, _ in conn.qp.posted[start:]:
            start += 1
            region = conn.pool.region
            if kind == rv.WR_READ:
                region.view[addr - region.addr:addr - region.addr + length] = host_data[:length]
                conn._on_completion(types.SimpleNamespace(wr_id=(kind << 32) | index, status=0, byte_len=0))
            elif kind == rv.WR_WRITE:
                written += bytes(region.view[addr - region.addr:addr - region.addr + length])
            elif kind == rv.WR_SEND:
                cqe = Completion.from_bytes(conn.rsp.view[index * 16:index * 16 + 16])
                conn._on_completion(types.SimpleNamespace(wr_id=(kind << 32) | index, status=0, byte_len=0))
                return cqe, written
    raise AssertionError(f"no response for {cmd!r}")


def _keyed(cmd: Command, length: int) -> Command:
    cmd.flags = SQE_FLAGS_PSDT_SGL
    cmd.dptr = Command.make_sgl(SGL_ID_KEYED, 0x5000, length, 0x77)
    return cmd


async def test_rdma_queue_runs_the_shared_lifecycle(monkeypatch: pytest.MonkeyPatch) -> None:
    tgt = make_target()
    conn = _rdma_queue(monkeypatch, tgt)
    connect = _keyed(Command(AdminOpcode.FABRICS, cid=1, nsid=FabricsType.CONNECT, cdw11=31), 1024)
    cqe, _ = await _rdma_command(conn, connect, connect_data(SUBNQN, HOSTNQN, 0xFFFF))   # data by RDMA READ
    assert cqe.status_code == 0 and conn.queue.ctrl is not None and conn.queue.trtype == "rdma"
    for value in (CC_ENABLE_VALUE, CC_ENABLE_VALUE | 1):
        prop = _keyed(Command(AdminOpcode.FABRICS, cid=2, nsid=FabricsType.PROPERTY_SET, cdw11=0x14, cdw12=value), 0)
        assert (await _rdma_command(conn, prop))[0].status_code == 0
    cqe, written = await _rdma_command(conn, _keyed(Command(AdminOpcode.IDENTIFY, cid=3, cdw10=1), 4096))
    assert cqe.status_code == 0 and len(written) == 4096   # reply by RDMA WRITE before the SEND
    assert IdentifyController.parse(written).sgls & idf.SGLS_KEYED
    cqe, written = await _rdma_command(conn, _keyed(Command(0xEE, cid=4), 0))
    assert cqe.status_code == Status.INVALID_OPCODE and written == b""
    cqe, written = await _rdma_command(conn, _keyed(Command(AdminOpcode.IDENTIFY, cid=5, cdw10=0x55), 4096))
    assert cqe.status_code == Status.INVALID_FIELD and written == b""   # failures carry no data
    assert conn.pool.try_acquire(1 << 20) == 0   # every buffer came back
    conn.closed = True
    await tgt.close()
