"""A tiny NVMe/TCP host for the target tests, built on the sans-IO TcpConnection (not the initiator).

It speaks the PDUs the Linux host sends: ICReq, CapsuleCmd with in-capsule data or a transport SGL,
H2CData answering R2T, and it collects C2HData and CapsuleResp per command id.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from nvmeof import defaults
from nvmeof.spec.fabrics import ConnectData
from nvmeof.spec.nvme import (
    SGL_ID_INCAPSULE,
    SGL_ID_TRANSPORT,
    AdminOpcode,
    Command,
    Completion,
    Direction,
    FabricsType,
)
from nvmeof.tcp import (
    C2HDataReceived,
    ICRespReceived,
    ProtocolError,
    R2TReceived,
    ResponseReceived,
    Role,
    TcpConnection,
    TermReqReceived,
)
from target.transports.loop import create_loop_connection

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
HOSTID = bytes(range(16))
CC_ENABLE_VALUE = (6 << 16) | (4 << 20)   # IOSQES=6, IOCQES=4, CSS NVM, MPS 0, AMS RR, SHN none


@dataclass
class Result:
    cqe: Completion
    data: bytes | None

    @property
    def status(self) -> int:
        return self.cqe.status_code


class TinyHost(asyncio.Protocol):
    def __init__(self, *, hdgst: bool = False, ddgst: bool = False, incapsule_limit: int = 8192) -> None:
        self.conn = TcpConnection(Role.HOST)
        self.hdgst = hdgst
        self.ddgst = ddgst
        self.incapsule_limit = incapsule_limit
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[ICRespReceived] = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending: dict[int, asyncio.Future[Result]] = {}
        self.c2h: dict[int, bytearray] = {}
        self.outgoing: dict[int, bytes] = {}
        self.term_reqs: list[TermReqReceived] = []
        self.r2ts: list[R2TReceived] = []
        self.success_flags: list[int] = []
        self.corrupt_h2c_digest = False
        self.r2t_hook = None   # callable(R2TReceived) -> True when it handled the R2T itself
        self.next_cid = 1

    # asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.conn.send_icreq(hdgst=self.hdgst, ddgst=self.ddgst)
        self.flush()

    def data_received(self, data: bytes) -> None:
        for ev in self.conn.receive_data(data):
            if isinstance(ev, ICRespReceived):
                self.ready.set_result(ev)
            elif isinstance(ev, ResponseReceived):
                cqe = Completion.from_bytes(ev.cqe)
                fut = self.pending.pop(cqe.cid, None)
                buf = self.c2h.pop(cqe.cid, None)
                if fut is not None and not fut.done():
                    fut.set_result(Result(cqe, bytes(buf) if buf is not None else None))
            elif isinstance(ev, C2HDataReceived):
                assert ev.digest_ok
                buf = self.c2h.setdefault(ev.cccid, bytearray())
                assert ev.offset == len(buf)
                buf += ev.data
                if ev.success:
                    self.success_flags.append(ev.cccid)
                    fut = self.pending.pop(ev.cccid, None)
                    self.c2h.pop(ev.cccid, None)
                    if fut is not None:
                        fut.set_result(Result(Completion(ev.cccid, sqhd=0xFFFF), bytes(buf)))
            elif isinstance(ev, R2TReceived):
                self.r2ts.append(ev)
                if self.r2t_hook is not None and self.r2t_hook(ev):
                    continue
                data_out = self.outgoing[ev.cccid]
                chunk = self.conn.maxh2cdata
                stop = ev.offset + ev.length
                for off in range(ev.offset, stop, chunk):
                    end = min(off + chunk, stop)
                    self.conn.send_h2c_data(ev.cccid, ev.ttag, off, data_out[off:end], last=end == stop)
                if self.corrupt_h2c_digest:
                    out = self.conn.data_to_send()
                    out[-1] = bytes(b ^ 0xFF for b in out[-1])   # the last buffer is the data digest
                    assert self.transport is not None
                    self.transport.writelines(out)
            elif isinstance(ev, TermReqReceived):
                self.term_reqs.append(ev)
            elif isinstance(ev, ProtocolError):
                raise AssertionError(f"target sent a bad PDU: {ev.reason}")
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("connection lost"))
        self.pending.clear()

    def flush(self) -> None:
        out = self.conn.data_to_send()
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(out)

    # commands
    def send(self, cmd: Command, data: bytes | None = None, *, read_len: int = 0,
             incapsule: bool | None = None) -> asyncio.Future[Result]:
        cid = self.next_cid
        self.next_cid = (self.next_cid % 0xFFFE) + 1
        cmd.cid = cid
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_consume)   # AERs left pending fail at teardown; nobody awaits them
        self.pending[cid] = fut
        if data:
            if incapsule is None:
                incapsule = len(data) <= self.incapsule_limit
            if incapsule:
                cmd.dptr = Command.make_sgl(SGL_ID_INCAPSULE, 0, len(data))
                self.conn.send_command(cmd.to_bytes(), data)
            else:
                cmd.dptr = Command.make_sgl(SGL_ID_TRANSPORT, 0, len(data))
                self.outgoing[cid] = data
                self.conn.send_command(cmd.to_bytes(), direction=Direction.H2C, data_len=len(data))
        else:
            if cmd.dptr == bytes(16):
                cmd.dptr = Command.make_sgl(SGL_ID_TRANSPORT, 0, read_len)
            # The data the controller may move for it: as much as its SGL describes, in the direction
            # of the opcode's bits 1:0 (a write sent without data still gets its R2T).
            length = cmd.sgl().length
            direction = Direction.H2C if cmd.opcode & 3 == Direction.H2C else Direction.C2H
            self.conn.send_command(cmd.to_bytes(), direction=direction if length else Direction.NONE,
                                   data_len=length)
        self.flush()
        return fut

    async def cmd(self, cmd: Command, data: bytes | None = None, *, read_len: int = 0,
                  incapsule: bool | None = None, timeout: float = 5.0) -> Result:
        return await asyncio.wait_for(self.send(cmd, data, read_len=read_len, incapsule=incapsule), timeout)

    async def connect(self, subnqn: str, *, qid: int = 0, cntlid: int = 0xFFFF, hostnqn: str = HOSTNQN,
                      sqsize: int = 31, kato: int = 0, cattr: int = 0, recfmt: int = 0,
                      hostid: bytes = HOSTID) -> Result:
        data = connect_data(subnqn, hostnqn, cntlid, hostid)
        cmd = Command(AdminOpcode.FABRICS, nsid=FabricsType.CONNECT, cdw10=recfmt | (qid << 16),
                      cdw11=sqsize | (cattr << 16), cdw12=kato)
        return await self.cmd(cmd, data)

    async def prop_get(self, offset: int, size8: bool = False) -> Result:
        return await self.cmd(Command(AdminOpcode.FABRICS, nsid=FabricsType.PROPERTY_GET,
                                      cdw10=1 if size8 else 0, cdw11=offset))

    async def prop_set(self, offset: int, value: int) -> Result:
        return await self.cmd(Command(AdminOpcode.FABRICS, nsid=FabricsType.PROPERTY_SET, cdw10=0, cdw11=offset,
                                      cdw12=value & 0xFFFFFFFF, cdw13=value >> 32))

    async def enable(self) -> None:
        """PROTOCOL.md §2.1: read CAP, write CC without EN, re-read CAP, set EN, poll CSTS.RDY."""
        cap = await self.prop_get(0x00, size8=True)
        assert cap.status == 0
        assert (await self.prop_set(0x14, CC_ENABLE_VALUE)).status == 0
        assert (await self.prop_get(0x00, size8=True)).status == 0
        assert (await self.prop_set(0x14, CC_ENABLE_VALUE | 1)).status == 0
        csts = await self.prop_get(0x1C)
        assert csts.status == 0 and csts.cqe.dw0 & 1, csts

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _consume(fut: asyncio.Future[Result]) -> None:
    if not fut.cancelled():
        fut.exception()


def connect_data(subnqn: str, hostnqn: str, cntlid: int, hostid: bytes = HOSTID) -> bytes:
    return ConnectData.build({"hostid": hostid, "cntlid": cntlid, "subsysnqn": subnqn, "hostnqn": hostnqn})


async def open_loop(target, **kwargs) -> TinyHost:  # type: ignore[no-untyped-def]
    _, host = await create_loop_connection(target, lambda: TinyHost(**kwargs))
    assert isinstance(host, TinyHost)
    await asyncio.wait_for(host.ready, 5)
    return host


async def open_tcp(port: int, **kwargs) -> TinyHost:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    _, host = await loop.create_connection(lambda: TinyHost(**kwargs), "127.0.0.1", port)
    await asyncio.wait_for(host.ready, 5)
    return host


async def admin_session(target, subnqn: str, *, kato: int = 0, **kwargs) -> tuple[TinyHost, int]:  # type: ignore[no-untyped-def]
    host = await open_loop(target, **kwargs)
    res = await host.connect(subnqn, kato=kato)
    assert res.status == 0, res
    await host.enable()
    return host, res.cqe.dw0 & 0xFFFF


async def io_session(target, subnqn: str, cntlid: int, *, qid: int = 1, cattr: int = 0, **kwargs) -> TinyHost:  # type: ignore[no-untyped-def]
    host = await open_loop(target, **kwargs)
    res = await host.connect(subnqn, qid=qid, cntlid=cntlid, sqsize=127, cattr=cattr)
    assert res.status == 0, res
    return host


def le32(buf: bytes, off: int) -> int:
    return struct.unpack_from("<I", buf, off)[0]


__all__ = ["HOSTID", "HOSTNQN", "Result", "TinyHost", "admin_session", "connect_data", "defaults", "io_session",
           "le32", "open_loop", "open_tcp"]


SUBNQN = "nqn.2026-01.com.example:target-test"
NS_SIZE = 1 << 20


def make_target(**kwargs):  # type: ignore[no-untyped-def]
    from target.backends.ram import RamBackend
    from target.core import Target
    from target.model import Namespace, Subsystem

    tgt = Target(**kwargs)
    sub = Subsystem(nqn=SUBNQN, serial="SN0001")
    sub.namespaces[1] = Namespace(1, RamBackend(NS_SIZE), nguid=bytes(range(1, 17)), eui64=bytes(range(1, 9)))
    tgt.subsystems[SUBNQN] = sub
    return tgt


async def serve_tls(mode: str, key: str, *, hostnqn: str = HOSTNQN, engine: str = "batch", allow: bool = True):  # type: ignore[no-untyped-def]
    """make_target() with one NVMe/TCP listener on 127.0.0.1 (``mode``: the listener's tls, none|optional|required)
    on the ``engine`` (batch|stream) listener; ``allow``: only ``hostnqn`` may connect, with the TLS PSK ``key``
    (else any host, no key). Returns the target and the started listener."""
    from nvmeof.tls.psk import TlsKey
    from target.model import HostAuth, Listener
    from target.transports import tcp, tcp_batch

    tgt = make_target(transports={"tcp": tcp_batch.BatchTcpListener if engine == "batch" else tcp.TcpListener})
    sub = tgt.subsystems[SUBNQN]
    if allow:
        sub.allow_any_host = False
        sub.hosts.add(hostnqn)
        sub.host_auth[hostnqn] = HostAuth(tls_key=TlsKey.parse(key))
    listener = Listener("tcp", "ipv4", "127.0.0.1", 0, portid=1, tls=mode)
    tgt.listeners[listener.id] = listener
    return tgt, await tgt.start_listener(listener)
