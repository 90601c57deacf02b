"""Raw NVMe/TCP bytes for the robustness and fuzz tests: PDU builders and an independent checker.

The builders write PDUs byte by byte (not through nvmeof.tcp), so a test can break any field. The
checker (`TargetOutput`) parses what the target sends with its own small rules, so a framing bug in
the sans-IO code cannot hide itself by agreeing with itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field

from target_host import HOSTNQN, connect_data

from nvmeof.crc32c import digest_bytes
from nvmeof.spec import tcp as spec
from nvmeof.spec.nvme import SGL_ID_INCAPSULE, SGL_ID_TRANSPORT, AdminOpcode, Command, Completion, FabricsType

ICREQ, ICRESP, H2C_TERM, C2H_TERM = 0x00, 0x01, 0x02, 0x03
CMD, RSP, H2C, C2H, R2T = 0x04, 0x05, 0x06, 0x07, 0x09
HDGSTF, DDGSTF, LAST, SUCCESS = spec.HDGSTF, spec.DDGSTF, spec.DATA_LAST, spec.DATA_SUCCESS

_le32 = struct.Struct("<I")


# --------------------------------------------------------------------------------------- builders

def icreq(*, hdgst: bool = False, ddgst: bool = False, pfv: int = 0, hpda: int = 0, maxr2t: int = 0,
          hlen: int = 128, plen: int = 128) -> bytes:
    dgst = (spec.HDR_DIGEST_ENABLE if hdgst else 0) | (spec.DATA_DIGEST_ENABLE if ddgst else 0)
    return spec.IC_HDR.pack(ICREQ, 0, hlen, 0, plen, pfv, hpda, dgst, maxr2t)


def capsule_cmd(sqe: bytes, data: bytes | None = None, *, hdgst: bool = False, ddgst: bool = False) -> bytes:
    hd = 4 if hdgst else 0
    flags = HDGSTF if hdgst else 0
    if data:
        dd = 4 if ddgst else 0
        flags |= DDGSTF if dd else 0
        pdo = 72 + hd
        plen = pdo + len(data) + dd
    else:
        pdo, plen, dd = 0, 72 + hd, 0
    hdr = spec.CAPSULE_CMD_HDR.pack(CMD, flags, 72, pdo, plen, sqe)
    out = hdr + (digest_bytes(hdr) if hd else b"")
    if data:
        out += data + (digest_bytes(data) if dd else b"")
    return out


def h2c_data(cccid: int, ttag: int, offset: int, data: bytes, *, last: bool, hdgst: bool = False,
             ddgst: bool = False) -> bytes:
    hd = 4 if hdgst else 0
    dd = 4 if ddgst else 0
    flags = (LAST if last else 0) | (HDGSTF if hd else 0) | (DDGSTF if dd else 0)
    pdo = 24 + hd
    hdr = spec.DATA_PDU_HDR.pack(H2C, flags, 24, pdo, pdo + len(data) + dd, cccid, ttag, offset, len(data))
    return hdr + (digest_bytes(hdr) if hd else b"") + data + (digest_bytes(data) if dd else b"")


def h2c_term_req(fes: int, fei: int = 0, data: bytes = b"") -> bytes:
    return spec.TERM_REQ_HDR.pack(H2C_TERM, 0, 24, 0, 24 + len(data), fes, fei) + data


def set_le32(pdu: bytes, offset: int, value: int) -> bytes:
    buf = bytearray(pdu)
    _le32.pack_into(buf, offset, value & 0xFFFFFFFF)
    return bytes(buf)


def set_byte(pdu: bytes, offset: int, value: int) -> bytes:
    buf = bytearray(pdu)
    buf[offset] = value & 0xFF
    return bytes(buf)


def redigest(pdu: bytes) -> bytes:
    """Recompute the header digest after a header field was changed on purpose."""
    hlen = pdu[2]
    return pdu[:hlen] + digest_bytes(pdu[:hlen]) + pdu[hlen + 4:]


# SQEs

def sqe(cmd: Command, *, cid: int, data_len: int = 0, incapsule: bool = False) -> bytes:
    cmd.cid = cid
    if data_len:
        cmd.dptr = Command.make_sgl(SGL_ID_INCAPSULE if incapsule else SGL_ID_TRANSPORT, 0, data_len)
    else:
        cmd.dptr = Command.make_sgl(SGL_ID_TRANSPORT, 0, 0)
    return cmd.to_bytes()


def rw_capsule(opcode: int, cid: int, slba: int, size: int) -> bytes:
    """A Read or Write capsule on nsid 1 moving ``size`` bytes through a transport SGL (R2T / C2HData)."""
    return capsule_cmd(sqe(Command(opcode, nsid=1, cdw10=slba, cdw12=size // 512 - 1), cid=cid, data_len=size))


def connect_sqe(cid: int, *, qid: int, sqsize: int = 31, kato: int = 0) -> bytes:
    cmd = Command(AdminOpcode.FABRICS, nsid=FabricsType.CONNECT, cdw10=qid << 16, cdw11=sqsize, cdw12=kato)
    return sqe(cmd, cid=cid, data_len=1024, incapsule=True)


def connect_pdu(cid: int, subnqn: str, *, qid: int, cntlid: int = 0xFFFF, hostnqn: str = HOSTNQN,
                kato: int = 0, hdgst: bool = False, ddgst: bool = False) -> bytes:
    return capsule_cmd(connect_sqe(cid, qid=qid, kato=kato), connect_data(subnqn, hostnqn, cntlid),
                       hdgst=hdgst, ddgst=ddgst)


# ------------------------------------------------------------------------------------ the checker

@dataclass
class Pdu:
    kind: str                 # icresp, term, cqe, c2h, r2t
    raw: bytes
    fields: dict = field(default_factory=dict)


_EXPECTED_HLEN = {ICRESP: 128, C2H_TERM: 24, RSP: 24, C2H: 24, R2T: 24}


class TargetOutput:
    """Splits the target's byte stream into PDUs and records every rule it breaks."""

    def __init__(self, *, max_data: int = 2 << 20) -> None:
        self.buf = bytearray()
        self.pdus: list[Pdu] = []
        self.errors: list[str] = []
        self.hdgst = False
        self.ddgst = False
        self.max_data = max_data
        self.broken = False

    def feed(self, data: bytes) -> None:
        self.buf += data
        while not self.broken and len(self.buf) >= 8:
            ptype, flags, hlen, pdo, plen = spec.COMMON_HDR.unpack_from(self.buf, 0)
            problem = self._check_common(ptype, flags, hlen, pdo, plen)
            if problem:
                self._error(problem)
                return
            if len(self.buf) < plen:
                return
            raw = bytes(self.buf[:plen])
            del self.buf[:plen]
            self._take(raw, ptype, flags, hlen, pdo, plen)

    def _error(self, what: str) -> None:
        self.errors.append(what)
        self.broken = True

    def _check_common(self, ptype: int, flags: int, hlen: int, pdo: int, plen: int) -> str | None:
        if ptype not in _EXPECTED_HLEN:
            return f"the target sent PDU type {ptype:#x}"
        if self.pdus and self.pdus[-1].kind == "term":
            return f"PDU type {ptype:#x} after a C2HTermReq"
        if not self.pdus and ptype not in (ICRESP, C2H_TERM):
            return f"first PDU is type {ptype:#x}, not ICResp or C2HTermReq"
        if self.pdus and ptype == ICRESP:
            return "a second ICResp"
        if hlen != _EXPECTED_HLEN[ptype]:
            return f"PDU type {ptype:#x} with hlen {hlen}"
        if ptype == ICRESP:
            return None if plen == 128 and not flags else f"ICResp plen {plen} flags {flags:#x}"
        if ptype == C2H_TERM:
            return None if 24 <= plen <= 152 and not flags else f"C2HTermReq plen {plen} flags {flags:#x}"
        hd = 4 if self.hdgst else 0
        if bool(flags & HDGSTF) != self.hdgst:
            return f"PDU type {ptype:#x} flags {flags:#x} disagree with hdgst={self.hdgst}"
        if ptype == C2H:
            dd = 4 if self.ddgst else 0
            if bool(flags & DDGSTF) != self.ddgst:
                return f"C2HData flags {flags:#x} disagree with ddgst={self.ddgst}"
            if pdo != 24 + hd or not pdo + dd < plen <= pdo + self.max_data + dd:
                return f"C2HData pdo {pdo} plen {plen}"
            if flags & SUCCESS and not flags & LAST:
                return "C2HData with SUCCESS but not LAST"
            return None
        if pdo or plen != 24 + hd or flags & ~HDGSTF:
            return f"PDU type {ptype:#x} pdo {pdo} plen {plen} flags {flags:#x}"
        return None

    def _take(self, raw: bytes, ptype: int, flags: int, hlen: int, pdo: int, plen: int) -> None:
        if ptype == ICRESP:
            _t, _f, _h, _p, _l, pfv, cpda, dgst, maxh2cdata = spec.IC_HDR.unpack(raw)
            self.hdgst = bool(dgst & spec.HDR_DIGEST_ENABLE)
            self.ddgst = bool(dgst & spec.DATA_DIGEST_ENABLE)
            if pfv or cpda or maxh2cdata % 4 or maxh2cdata < 4096:
                self._error(f"ICResp pfv {pfv} cpda {cpda} maxh2cdata {maxh2cdata}")
            self.pdus.append(Pdu("icresp", raw, {"dgst": dgst, "maxh2cdata": maxh2cdata}))
            return
        if ptype == C2H_TERM:
            _t, _f, _h, _p, _l, fes, fei = spec.TERM_REQ_HDR.unpack_from(raw)
            if fes not in {int(f) for f in spec.FatalErrorStatus}:
                self._error(f"C2HTermReq with FES {fes:#x}")
            self.pdus.append(Pdu("term", raw, {"fes": fes, "fei": fei, "data": raw[24:]}))
            return
        hd = 4 if self.hdgst else 0
        if hd and digest_bytes(raw[:hlen]) != raw[hlen:hlen + 4]:
            self._error(f"PDU type {ptype:#x} with a wrong header digest")
            return
        if ptype == RSP:
            self.pdus.append(Pdu("cqe", raw, {"cqe": Completion.from_bytes(raw[8:24])}))
        elif ptype == R2T:
            _t, _f, _h, _p, _l, cccid, ttag, r2to, r2tl = spec.DATA_PDU_HDR.unpack_from(raw)
            if not r2tl:
                self._error("R2T with r2tl 0")
            self.pdus.append(Pdu("r2t", raw, {"cccid": cccid, "ttag": ttag, "offset": r2to, "length": r2tl}))
        else:
            _t, _f, _h, _p, _l, cccid, _ttag, datao, datal = spec.DATA_PDU_HDR.unpack_from(raw)
            dd = 4 if self.ddgst else 0
            if plen != pdo + datal + dd:
                self._error(f"C2HData datal {datal} disagrees with plen {plen}")
                return
            data = raw[pdo:pdo + datal]
            if dd and digest_bytes(data) != raw[pdo + datal:]:
                self._error("C2HData with a wrong data digest")
                return
            self.pdus.append(Pdu("c2h", raw, {"cccid": cccid, "offset": datao, "data": data,
                                              "last": bool(flags & LAST), "success": bool(flags & SUCCESS)}))

    # views
    def of_kind(self, kind: str) -> list[Pdu]:
        return [p for p in self.pdus if p.kind == kind]

    @property
    def term(self) -> Pdu | None:
        return self.pdus[-1] if self.pdus and self.pdus[-1].kind == "term" else None

    def done(self, cid: int) -> bool:
        """True once command ``cid`` has its CQE (or its C2HData with SUCCESS)."""
        for p in self.pdus:
            if p.kind == "cqe" and p.fields["cqe"].cid == cid:
                return True
            if p.kind == "c2h" and p.fields["success"] and p.fields["cccid"] == cid:
                return True
        return False

    def cqe(self, cid: int) -> Completion | None:
        for p in self.pdus:
            if p.kind == "cqe" and p.fields["cqe"].cid == cid:
                return p.fields["cqe"]
        return None

    def read_data(self, cid: int) -> bytes:
        return b"".join(p.fields["data"] for p in self.pdus if p.kind == "c2h" and p.fields["cccid"] == cid)

    def r2t(self, cid: int) -> Pdu | None:
        for p in self.pdus:
            if p.kind == "r2t" and p.fields["cccid"] == cid:
                return p
        return None


class RawPeer:
    """A TCP connection to the target that sends whatever bytes a test builds and checks the answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.out = TargetOutput()
        self.eof = False
        self._changed = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, port: int) -> RawPeer:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def _read(self) -> None:
        try:
            while True:
                data = await self.reader.read(1 << 20)
                if not data:
                    break
                self.out.feed(data)
                self._changed.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.eof = True
            self._changed.set()

    async def send(self, data: bytes, chunks: list[int] | None = None) -> None:
        if self.writer.is_closing():
            return
        if not chunks:
            self.writer.write(data)
        else:
            # Each size in ``chunks`` is one separate write (and a chance for the target to parse a
            # partial PDU); what is left goes out in one write.
            pos = 0
            for step in chunks:
                if pos >= len(data):
                    break
                self.writer.write(data[pos:pos + step])
                pos += step
                with contextlib.suppress(ConnectionError):
                    await self.writer.drain()
                await asyncio.sleep(0.001)
            if pos < len(data):
                self.writer.write(data[pos:])
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()

    async def wait_for(self, predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
        """Wait until predicate(out) holds, the target closed, or it sent a TermReq; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if predicate(self.out) or self.eof or self.out.term is not None or self.out.broken:
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def wait_eof(self, timeout: float) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        return self.eof

    async def handshake(self, *, hdgst: bool = False, ddgst: bool = False) -> None:
        await self.send(icreq(hdgst=hdgst, ddgst=ddgst))
        assert await self.wait_for(lambda o: o.of_kind("icresp"), 5)
        assert self.out.of_kind("icresp"), self.out.pdus

    async def command(self, pdu: bytes, cid: int, timeout: float = 5.0) -> Completion:
        await self.send(pdu)
        assert await self.wait_for(lambda o: o.done(cid), timeout), f"no answer to cid {cid}"
        cqe = self.out.cqe(cid)
        assert cqe is not None, self.out.pdus[-1:]
        return cqe

    async def close(self, *, abort: bool = False) -> None:
        if abort:
            self.writer.transport.abort()
        else:
            self.writer.close()
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError, OSError):
            await asyncio.wait_for(self._task, 2)


# ------------------------------------------------------------------------------------ the target

SUBNQN = "nqn.2026-01.com.example:robust"


@dataclass
class Served:
    target: object
    service: object
    server: object          # the TcpListener
    port: int


async def serve(*, ns_size: int = 4 << 20, keep_alive_interval: float = 1.0, allow_any_host: bool = True,
                hosts: tuple[str, ...] = ()) -> Served:
    """A Target set up through TargetService (RAM namespace 1) with a TcpListener on 127.0.0.1, port 0."""
    from target.core import Target
    from target.model import Listener
    from target.service import TargetService

    tgt = Target(keep_alive_interval=keep_alive_interval)
    service = TargetService(tgt)
    await service.add_subsystem(SUBNQN, serial="ROBUST01", allow_any_host=allow_any_host, hosts=hosts)
    await service.add_namespace(SUBNQN, backend="ram", size=ns_size, nsid=1)
    # TargetService.add_listener wants a real port; port 0 needs the listener started by hand.
    listener = Listener("tcp", "ipv4", "127.0.0.1", 0, portid=1)
    tgt.listeners[listener.id] = listener
    server = await tgt.start_listener(listener)
    return Served(tgt, service, server, server.port)


async def wait_until(predicate, timeout: float = 5.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def admin_host(port: int, *, kato: int = 0, hdgst: bool = False, ddgst: bool = False,
                     subnqn: str = SUBNQN):  # type: ignore[no-untyped-def]
    """A well-behaved TinyHost admin queue over TCP, connected and enabled; returns (host, cntlid)."""
    from target_host import open_tcp

    host = await open_tcp(port, hdgst=hdgst, ddgst=ddgst)
    res = await host.connect(subnqn, kato=kato)
    assert res.status == 0, res
    await host.enable()
    return host, res.cqe.dw0 & 0xFFFF


async def io_host(port: int, cntlid: int, qid: int, *, hdgst: bool = False, ddgst: bool = False,
                  subnqn: str = SUBNQN):  # type: ignore[no-untyped-def]
    from target_host import open_tcp

    host = await open_tcp(port, hdgst=hdgst, ddgst=ddgst)
    res = await host.connect(subnqn, qid=qid, cntlid=cntlid, sqsize=127)
    assert res.status == 0, res
    return host


async def write_read_verify(host, slba: int, data: bytes, *, incapsule: bool | None = None) -> None:  # type: ignore[no-untyped-def]
    from nvmeof.spec.nvme import IoOpcode

    nlb = len(data) // 512
    res = await host.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=slba, cdw12=nlb - 1), data, incapsule=incapsule)
    assert res.status == 0, res
    res = await host.cmd(Command(IoOpcode.READ, nsid=1, cdw10=slba, cdw12=nlb - 1), read_len=len(data))
    assert res.status == 0, res
    assert res.data == data, f"read back differs at LBA {slba}"


async def good_host_roundtrip(served: Served, slba: int, pattern: bytes) -> None:
    """A fresh, well-behaved host connects, writes ``pattern`` in-capsule and via R2T, reads both back."""
    admin, cntlid = await admin_host(served.port)
    io = await io_host(served.port, cntlid, 1)
    try:
        await write_read_verify(io, slba, pattern[:4096], incapsule=True)
        await write_read_verify(io, slba + 8, pattern, incapsule=False)
    finally:
        io.close()
        admin.close()
    await wait_until(lambda: cntlid not in served.target.controllers, what=f"controller {cntlid} to go")  # type: ignore[attr-defined]
