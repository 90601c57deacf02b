"""Sans-IO NVMe/TCP connection: bytes in, events out, bytes to send drained by the adapter.

One class serves both ends of a queue (``Role.HOST`` and ``Role.CONTROLLER``). Nothing here touches
a socket, a clock or asyncio; the adapters in target/transports/tcp.py and initiator/queue.py feed
``receive_data`` and write ``data_to_send()`` with ``writelines``.

Framing rules follow the NVMe/TCP transport specification and what the Linux host and nvmet check
(drivers/nvme/host/tcp.c ``nvme_tcp_recv_pdu``, drivers/nvme/target/tcp.c ``nvmet_tcp_try_recv_pdu``):
each PDU header is checked (type legal for role and state, hlen, digest flags, pdo, plen) from its
first 8 bytes and then its full header, before any of its data is waited for, so a bad length never
makes us buffer more than one PDU header. A framing violation yields a ``ProtocolError`` event, queues
a TermReq of our role and closes the connection; nothing after the bad PDU is parsed. A data digest
mismatch is not fatal: the event carries ``digest_ok=False`` and the command fails with a transport
status instead.

The controller keeps the R2Ts it sent (``send_r2t``) until their data is in, and checks each H2CData
header against them (ttag, cccid, offset, length) in the same pass as its framing, as nvmet does, so
a bad H2CData is reported with its own FES/FEI even when later PDUs of the same read are bad too.
The host likewise knows every command it sent (``send_command(..., direction=, data_len=)``) and checks
each R2T, C2HData and CapsuleResp against it (nvme_tcp_handle_r2t, nvme_tcp_handle_c2h_data,
nvme_tcp_process_nvme_cqe), so both roles report a bad data PDU with the FEI of the offending field.

A READY connection can move to another process at a PDU boundary: ``export_state()`` gives a
``HandoffState`` of plain values (negotiated parameters, limits, outstanding R2Ts or commands, the
received bytes of a PDU not yet complete) and ``TcpConnection.resume(state)`` goes on from it.

Memoryviews in events point into the received bytes and stay valid until the next ``receive_data``
call; a consumer keeping data longer copies it.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nvmeof import defaults
from nvmeof.crc32c import crc32c, digest_bytes
from nvmeof.spec import tcp as spec
from nvmeof.spec.nvme import Direction
from nvmeof.spec.tcp import FatalErrorStatus as Fes
from nvmeof.spec.tcp import PduType

__all__ = [
    "C2HDataReceived",
    "CommandReceived",
    "Event",
    "H2CDataReceived",
    "HandoffRefused",
    "HandoffState",
    "ICReqReceived",
    "ICRespReceived",
    "ProtocolError",
    "R2TReceived",
    "ResponseReceived",
    "Role",
    "State",
    "TcpConnection",
    "TermReqReceived",
]


class Role(enum.Enum):
    HOST = "host"
    CONTROLLER = "controller"


class State(enum.Enum):
    AWAIT_IC = "await-ic"      # nothing exchanged yet
    IC_PENDING = "ic-pending"  # host: ICReq sent, ICResp awaited; controller: ICReq in, ICResp not sent
    READY = "ready"
    CLOSED = "closed"


# ---------------------------------------------------------------------------------------------- events


@dataclass(slots=True)
class ICReqReceived:
    pfv: int
    hpda: int
    hdgst: bool
    ddgst: bool
    maxr2t: int


@dataclass(slots=True)
class ICRespReceived:
    pfv: int
    cpda: int
    hdgst: bool
    ddgst: bool
    maxh2cdata: int


@dataclass(slots=True)
class CommandReceived:
    sqe: memoryview                 # 64 bytes
    data: memoryview | None         # in-capsule data
    digest_ok: bool = True          # False: in-capsule data failed its data digest


@dataclass(slots=True)
class ResponseReceived:
    cqe: memoryview                 # 16 bytes


@dataclass(slots=True)
class H2CDataReceived:
    cccid: int
    ttag: int
    offset: int
    data: memoryview
    last: bool
    digest_ok: bool
    placed: bool = False            # data already sits in the buffer the ``place`` callback returned


@dataclass(slots=True)
class C2HDataReceived:
    cccid: int
    offset: int
    data: memoryview
    last: bool
    success: bool
    digest_ok: bool
    placed: bool = False            # data already sits in the buffer the ``place`` callback returned


@dataclass(slots=True)
class R2TReceived:
    cccid: int
    ttag: int
    offset: int
    length: int


@dataclass(slots=True)
class TermReqReceived:
    fes: int
    fei: int
    raw: bytes                      # the TermReq's data: the peer's copy of the PDU header it rejected


@dataclass(slots=True)
class ProtocolError:
    fes: Fes
    fei: int
    reason: str


Event = (
    ICReqReceived | ICRespReceived | CommandReceived | ResponseReceived | H2CDataReceived
    | C2HDataReceived | R2TReceived | TermReqReceived | ProtocolError
)


# ------------------------------------------------------------------------------------- hand-off


class HandoffRefused(RuntimeError):
    """``export_state()`` was asked at a moment the connection cannot move (the message says why)."""


@dataclass(frozen=True, slots=True)
class HandoffState:
    """What a READY connection needs to go on elsewhere (``export_state`` / ``TcpConnection.resume``).

    ``unconsumed`` is the start of the next PDU, received but not yet complete (never a whole PDU:
    ``receive_data`` parses every complete one). ``to_dict``/``from_dict`` give a JSON-able form.
    """

    role: Role
    hdgst: bool
    ddgst: bool
    maxr2t: int
    maxh2cdata: int
    max_incapsule: int
    max_data: int
    pfv: int = spec.PFV_1_0
    hpda: int = 0
    cpda: int = 0
    unconsumed: bytes = b""
    r2ts: tuple[tuple[int, ...], ...] = ()       # controller: (ttag, cccid, next datao, end, r2to) per R2T
    commands: tuple[tuple[int, ...], ...] = ()   # host: (cccid, direction, next offset, end) per command

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role.value, "hdgst": self.hdgst, "ddgst": self.ddgst, "maxr2t": self.maxr2t,
            "maxh2cdata": self.maxh2cdata, "max_incapsule": self.max_incapsule, "max_data": self.max_data,
            "pfv": self.pfv, "hpda": self.hpda, "cpda": self.cpda, "unconsumed": self.unconsumed.hex(),
            "r2ts": [list(r) for r in self.r2ts], "commands": [list(c) for c in self.commands],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HandoffState:
        return cls(
            Role(d["role"]), bool(d["hdgst"]), bool(d["ddgst"]), int(d["maxr2t"]), int(d["maxh2cdata"]),
            int(d["max_incapsule"]), int(d["max_data"]), int(d["pfv"]), int(d["hpda"]), int(d["cpda"]),
            bytes.fromhex(d["unconsumed"]), tuple(tuple(int(v) for v in r) for r in d["r2ts"]),
            tuple(tuple(int(v) for v in c) for c in d["commands"]),
        )


# ----------------------------------------------------------------------------------------- tables

_ICREQ = PduType.ICREQ.value
_ICRESP = PduType.ICRESP.value
_H2C_TERM = PduType.H2C_TERM_REQ.value
_C2H_TERM = PduType.C2H_TERM_REQ.value
_CMD = PduType.CAPSULE_CMD.value
_RSP = PduType.CAPSULE_RESP.value
_H2C = PduType.H2C_DATA.value
_C2H = PduType.C2H_DATA.value
_R2T = PduType.R2T.value

_HLEN = {
    _ICREQ: spec.IC_PDU_SIZE,
    _ICRESP: spec.IC_PDU_SIZE,
    _H2C_TERM: spec.TERM_REQ_HEADER_SIZE,
    _C2H_TERM: spec.TERM_REQ_HEADER_SIZE,
    _CMD: spec.CAPSULE_CMD_HEADER_SIZE,
    _RSP: spec.CAPSULE_RESP_SIZE,
    _H2C: spec.DATA_PDU_HEADER_SIZE,
    _C2H: spec.DATA_PDU_HEADER_SIZE,
    _R2T: spec.R2T_SIZE,
}

# PDU types each end may receive, per state. The host's own ICReq moves it to IC_PENDING; the
# controller's ICResp moves it to READY. A TermReq is legal at any time before CLOSED.
_LEGAL: dict[tuple[Role, State], frozenset[int]] = {
    (Role.CONTROLLER, State.AWAIT_IC): frozenset({_ICREQ, _H2C_TERM}),
    (Role.CONTROLLER, State.IC_PENDING): frozenset({_H2C_TERM}),
    (Role.CONTROLLER, State.READY): frozenset({_CMD, _H2C, _H2C_TERM}),
    (Role.CONTROLLER, State.CLOSED): frozenset(),
    (Role.HOST, State.AWAIT_IC): frozenset({_C2H_TERM}),
    (Role.HOST, State.IC_PENDING): frozenset({_ICRESP, _C2H_TERM}),
    (Role.HOST, State.READY): frozenset({_RSP, _C2H, _R2T, _C2H_TERM}),
    (Role.HOST, State.CLOSED): frozenset(),
}

_COMMON = spec.COMMON_HDR
_IC = spec.IC_HDR
_TERM = spec.TERM_REQ_HDR
_CMD_HDR = spec.CAPSULE_CMD_HDR
_RSP_HDR = spec.CAPSULE_RESP_HDR
_DATA_HDR = spec.DATA_PDU_HDR
_unpack_common = _COMMON.unpack_from
_unpack_data_hdr = _DATA_HDR.unpack_from
_unpack_le16 = struct.Struct("<H").unpack_from
_unpack_le32 = struct.Struct("<I").unpack_from
_unpack_le64 = struct.Struct("<Q").unpack_from

_HDGSTF = spec.HDGSTF
_DDGSTF = spec.DDGSTF
_LAST = spec.DATA_LAST
_SUCCESS = spec.DATA_SUCCESS
_DGST_LEN = spec.DIGEST_LENGTH
_TERM_DATA_MAX = spec.TERM_REQ_MAX_DATA
_DIRECT_MIN = defaults.TCP_DIRECT_PLACEMENT_MIN
_RSP_CID = spec.OFF_RSP_CID
_DIR_H2C = Direction.H2C
_DIR_C2H = Direction.C2H
_DATA_DIRS = (_DIR_H2C, _DIR_C2H)


def _pdu_name(ptype: int) -> str:
    try:
        return PduType(ptype).name
    except ValueError:
        return f"type {ptype:#04x}"


class _Fatal(Exception):
    """Internal: a framing violation found while checking one PDU header."""

    def __init__(self, fes: Fes, fei: int, reason: str) -> None:
        super().__init__(reason)
        self.fes = fes
        self.fei = fei
        self.reason = reason


# ------------------------------------------------------------------------------------- connection


class TcpConnection:
    """One NVMe/TCP queue's PDU layer (see the module docstring)."""

    def __init__(
        self,
        role: Role,
        *,
        maxh2cdata: int = defaults.MAXH2CDATA,
        max_incapsule: int = defaults.ADMIN_INCAPSULE_SIZE,
        max_data: int = defaults.TCP_MAX_C2H_DATA,
    ) -> None:
        if not isinstance(role, Role):
            raise TypeError(f"role must be a Role, not {role!r}")
        _check_maxh2cdata(maxh2cdata)
        if max_incapsule < 0:
            raise ValueError(f"max_incapsule must be >= 0, got {max_incapsule}")
        if max_data <= 0:
            raise ValueError(f"max_data must be > 0, got {max_data}")
        self.role = role
        self.state = State.AWAIT_IC
        # Controller: the MAXH2CDATA it advertises and enforces. Host: the ICResp's value once READY.
        self.maxh2cdata = maxh2cdata
        self.max_incapsule = max_incapsule  # controller: in-capsule bytes accepted per CapsuleCmd
        self.max_data = max_data            # host: largest C2HData payload accepted per PDU
        self.hdgst = False
        self.ddgst = False
        self.maxr2t = 0
        self.hpda = 0
        self.cpda = 0
        self._req_hdgst = False   # digests asked for in the ICReq (sent by us or received)
        self._req_ddgst = False
        self._legal = _LEGAL[(role, State.AWAIT_IC)]
        self._out: list[bytes | memoryview] = []
        # Receive buffer: unparsed bytes are self._buf[self._pos:]. Once events have handed out
        # views into it, it is never resized again (a resize would fail with exported buffers);
        # a new bytearray takes over the leftover bytes instead.
        self._buf = bytearray()
        self._pos = 0
        self._exported = False
        # The PDU at self._pos has passed its header checks; these are its parsed lengths.
        self._pending: tuple[int, int, int, int, int, int, int] | None = None
        # Fast path for the commonest PDU once READY (controller: CapsuleCmd without data; host:
        # CapsuleResp): its whole 8-byte common header as one integer, and its plen.
        self._fast_key = -1
        self._fast_hlen = 0
        self._fast_plen = 0
        # Direct data placement: when a data PDU we receive (host: C2HData, controller: H2CData)
        # still misses at least TCP_DIRECT_PLACEMENT_MIN payload bytes, ``place(cccid, ttag, datao,
        # datal)`` may return a writable view of exactly ``datal`` bytes; the payload then goes there
        # (the adapter can receive straight into ``direct_buffer()``) instead of through our buffer.
        # Only without data digests. None, or a callback returning None, keeps the general path.
        self.place: Callable[[int, int, int, int], memoryview | None] | None = None
        self._direct: memoryview | None = None
        self._direct_got = 0
        self._direct_pdu: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)   # ptype, flags, cccid, ttag, datao
        # Controller: the R2Ts we sent whose data is still due, ttag -> [cccid, next datao, end, r2to]. Each
        # H2CData header is checked against it as soon as it is parsed (nvmet_tcp_handle_h2c_data_pdu),
        # so a bad one fails in stream order, before any later PDU of the same read is looked at.
        self._r2t: dict[int, list[int]] = {}
        # Host: every command sent and not yet answered, cccid -> [direction, next offset, end]: what
        # its R2Ts may still ask for (H2C) or where its next C2HData must start (C2H). Checked per PDU
        # header like the controller's R2T table; a CapsuleResp (or a C2HData with SUCCESS) retires it.
        self._cmds: dict[int, list[int]] = {}
        # A TermReq for a PDU found bad while parsing, held back until data_to_send() (see _fail).
        self._term: bytes | None = None

    # ------------------------------------------------------------------------------------ state

    def _set_state(self, state: State) -> None:
        self.state = state
        self._legal = _LEGAL[(self.role, state)]
        self._fast_key = -1
        if state is State.READY:
            hd = _DGST_LEN if self.hdgst else 0
            flags = _HDGSTF if hd else 0
            if self.role is Role.CONTROLLER:
                ptype, hlen = _CMD, spec.CAPSULE_CMD_HEADER_SIZE
            else:
                ptype, hlen = _RSP, spec.CAPSULE_RESP_SIZE
            self._fast_hlen = hlen
            self._fast_plen = hlen + hd
            self._fast_key = _unpack_le64(_COMMON.pack(ptype, flags, hlen, 0, hlen + hd))[0]

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    @property
    def fast_command_key(self) -> int:
        """Controller role, READY: the common header of a CapsuleCmd without in-capsule data as one
        little-endian 64-bit integer (-1 before READY), for adapters that take such PDUs themselves."""
        return self._fast_key

    def idle_ready(self) -> bool:
        """READY at a PDU boundary with nothing held: no buffered bytes, no header checked and waiting
        for its payload, no payload being placed, no TermReq pending. An adapter may then consume
        whole PDUs itself (target/transports/tcp_batch.py) and hand this connection the rest later."""
        return (self.state is State.READY and self._pos == len(self._buf) and self._pending is None
                and self._direct is None and self._term is None)

    # --------------------------------------------------------------------------------- hand-off

    def export_state(self) -> HandoffState:
        """Snapshot this READY connection for ``resume`` in another process; raise HandoffRefused when
        it is not at a point where it can move. The connection itself is unchanged: once the state has
        gone elsewhere, stop feeding it (or keep using it if the hand-off is given up)."""
        if self.state is not State.READY:
            raise HandoffRefused(f"the connection is {self.state.value}, not ready: only an initialized "
                                 "connection that sent no TermReq can move")
        if self._direct is not None:
            raise HandoffRefused("a data PDU's payload is being placed directly")
        if self._out or self._term is not None:
            raise HandoffRefused("PDUs queued for the peer were not taken by data_to_send() yet")
        if self._pending is not None and self._pending[0] in (_H2C, _C2H):
            # Its header was checked and moved the R2T (or the read) on: it cannot be checked twice.
            raise HandoffRefused(f"a {_pdu_name(self._pending[0])} PDU is half received")
        return HandoffState(
            self.role, self.hdgst, self.ddgst, self.maxr2t, self.maxh2cdata, self.max_incapsule, self.max_data,
            spec.PFV_1_0, self.hpda, self.cpda, bytes(self._buf[self._pos:]),
            tuple((ttag, *r) for ttag, r in self._r2t.items()),
            tuple((cid, *c) for cid, c in self._cmds.items()),
        )

    @classmethod
    def resume(cls, state: HandoffState) -> TcpConnection:
        """A READY connection going on from ``state`` (see export_state): no IC exchange; the bytes
        of the PDU that was half received are buffered and complete with the next ``receive_data``."""
        if state.pfv != spec.PFV_1_0:
            raise ValueError(f"cannot resume a connection with pfv {state.pfv}")
        conn = cls(state.role, maxh2cdata=state.maxh2cdata, max_incapsule=state.max_incapsule,
                   max_data=state.max_data)
        conn.hdgst = conn._req_hdgst = state.hdgst
        conn.ddgst = conn._req_ddgst = state.ddgst
        conn.maxr2t, conn.hpda, conn.cpda = state.maxr2t, state.hpda, state.cpda
        conn._r2t = {ttag: [cccid, nxt, end, r2to] for ttag, cccid, nxt, end, r2to in state.r2ts}
        conn._cmds.update({cid: [Direction(d), nxt, end] for cid, d, nxt, end in state.commands})
        conn._buf = bytearray(state.unconsumed)
        conn._set_state(State.READY)
        return conn

    # ---------------------------------------------------------------------------------- receive

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Feed received bytes; return the events of every PDU completed by them (never raises)."""
        if self.state is State.CLOSED or not data:
            return []
        if self._direct is not None:
            # The payload being placed comes first; what follows it is parsed as usual.
            mv = data if isinstance(data, memoryview) else memoryview(data)
            if mv.format != "B" or mv.ndim != 1:
                mv = mv.cast("B")
            take = min(len(mv), len(self._direct) - self._direct_got)
            self._direct[self._direct_got:self._direct_got + take] = mv[:take]
            events = self.direct_received(take)
            if take < len(mv):
                events += self.receive_data(mv[take:])
            return events
        buf = self._buf
        pos = self._pos
        if pos == len(buf):
            # Nothing buffered: parse the caller's bytes in place (no copy on the common path).
            mv = data if isinstance(data, memoryview) else memoryview(data)
            if mv.format != "B" or mv.ndim != 1:
                mv = mv.cast("B")
            events: list[Event] = []
            consumed = self._parse(mv, 0, events)
            if consumed == len(mv) or self.state is State.CLOSED:
                if self._buf:
                    self._buf = bytearray()
                self._pos = 0
            else:
                self._buf = bytearray(mv[consumed:])
                self._pos = 0
                self._exported = False
            return events
        if self._exported:
            buf = self._buf = buf[pos:]  # slicing a bytearray copies: the old one keeps its views
            self._exported = False
        elif pos:
            del buf[:pos]
        self._pos = 0
        # The buffer holds the start of one PDU. Append only what that PDU still needs, one step at
        # a time (common header, full header, whole PDU), so its payload may still be placed
        # directly and the PDUs after it are parsed in place instead of being copied behind it.
        src = data if isinstance(data, memoryview) else memoryview(data)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        events = []
        while True:
            have = len(buf)
            if self._pending is not None:
                want = self._pending[4]
            elif have < 8:
                want = 8
            else:
                plen = _unpack_le32(buf, 4)[0]
                want = min(plen, buf[2] + (_DGST_LEN if self.hdgst else 0))
            n = min(len(src), want - have) if want > have else 0
            if n:
                buf += src[:n]
                src = src[n:]
            mv = memoryview(buf)
            consumed = self._parse(mv, 0, events)
            del mv
            if self.state is State.CLOSED:
                self._buf = bytearray()
                self._pos = 0
                return events
            if consumed == len(buf):
                # That PDU is done (or its payload is being placed): the rest goes the usual way.
                self._pos = consumed
                self._exported = bool(events)
                if src:
                    events += self.receive_data(src)
                return events
            if not src:
                self._pos = consumed
                self._exported = bool(events)
                return events
            if consumed or (n == 0 and self._pending is None and have >= 8):
                # Not expected (one PDU at most is buffered); take the general path for the rest.
                if events:
                    buf = self._buf = buf[consumed:]
                elif consumed:
                    del buf[:consumed]
                buf += src
                mv = memoryview(buf)
                consumed = self._parse(mv, 0, events)
                del mv
                if self.state is State.CLOSED:
                    self._buf = bytearray()
                    self._pos = 0
                else:
                    self._pos = consumed
                    self._exported = bool(events)
                return events

    def _parse(self, mv: memoryview, pos: int, events: list[Event]) -> int:
        end = len(mv)
        fast_key = self._fast_key
        fast_hlen = self._fast_hlen
        fast_plen = self._fast_plen
        fast_cmd = self.role is Role.CONTROLLER
        retire = self._cmds.pop
        while self.state is not State.CLOSED:
            avail = end - pos
            pending = self._pending
            if pending is None:
                if avail < 8:
                    break
                if avail >= fast_plen and _unpack_le64(mv, pos)[0] == fast_key:
                    # Same checks as the general path, which a bad header digest falls back to.
                    hlen = fast_hlen
                    if hlen == fast_plen or crc32c(mv[pos:pos + hlen]) == _unpack_le32(mv, pos + hlen)[0]:
                        if fast_cmd:
                            events.append(CommandReceived(mv[pos + 8:pos + hlen], None, True))
                            pos += fast_plen
                            continue
                        # A response retires its command; one for no command takes the general path,
                        # which reports it.
                        if retire(mv[pos + 20] | mv[pos + 21] << 8, None) is not None:   # the CQE's cid
                            events.append(ResponseReceived(mv[pos + 8:pos + hlen]))
                            pos += fast_plen
                            continue
                try:
                    pending = self._check_header(mv, pos, avail)
                except _Fatal as err:
                    self._fail(events, mv, pos, avail, err)
                    break
                if pending is None:
                    break
                self._pending = pending
            ptype, flags, hlen, pdo, plen, hd, dd = pending
            if avail < plen:
                if (self.place is not None and not dd and (ptype == _C2H or ptype == _H2C) and avail >= pdo
                        and plen - avail >= _DIRECT_MIN and self._start_direct(mv, pos, avail, ptype, flags, pdo)):
                    pos = end
                break
            self._pending = None
            try:
                self._dispatch(mv, pos, ptype, flags, hlen, pdo, plen, hd, dd, events)
            except _Fatal as err:
                self._fail(events, mv, pos, avail, err)
                break
            pos += plen
        return pos

    def _start_direct(self, mv: memoryview, pos: int, avail: int, ptype: int, flags: int, pdo: int) -> bool:
        _t, _f, _h, _p, _l, cccid, ttag, datao, datal = _unpack_data_hdr(mv, pos)
        assert self.place is not None
        dest = self.place(cccid, ttag, datao, datal)
        if dest is None:
            return False
        if len(dest) != datal or dest.readonly:
            raise ValueError(f"place() must return a writable view of {datal} bytes, got {len(dest)}")
        have = avail - pdo
        dest[:have] = mv[pos + pdo:pos + avail]
        self._pending = None
        self._direct = dest
        self._direct_got = have
        self._direct_pdu = (ptype, flags, cccid, ttag, datao)
        return True

    def direct_buffer(self) -> memoryview | None:
        """Where the next received bytes belong while a payload is being placed, else None."""
        if self._direct is None:
            return None
        return self._direct[self._direct_got:]

    def direct_received(self, nbytes: int) -> list[Event]:
        """``nbytes`` were written into ``direct_buffer()``; the data event once the payload is whole."""
        dest = self._direct
        if dest is None or not 0 <= nbytes <= len(dest) - self._direct_got:
            raise ValueError(f"direct_received({nbytes}) without that much room in a direct buffer")
        self._direct_got += nbytes
        if self._direct_got < len(dest):
            return []
        self._direct = None
        ptype, flags, cccid, ttag, datao = self._direct_pdu
        if ptype == _H2C:
            return [H2CDataReceived(cccid, ttag, datao, dest, bool(flags & _LAST), True, True)]
        return [C2HDataReceived(cccid, datao, dest, bool(flags & _LAST), bool(flags & _SUCCESS), True, True)]

    def _check_header(self, mv: memoryview, pos: int, avail: int):
        """Check one PDU header; return its lengths, or None until the whole header is here."""
        ptype, flags, hlen, pdo, plen = _unpack_common(mv, pos)
        exp_hlen = _HLEN.get(ptype)
        if exp_hlen is None:
            raise _Fatal(Fes.INVALID_HEADER_FIELD, spec.OFF_TYPE, f"unknown PDU type {ptype:#04x}")
        if ptype not in self._legal:
            raise _Fatal(
                Fes.PDU_SEQUENCE_ERROR, 0,
                f"{_pdu_name(ptype)} is not expected by the {self.role.value} in state {self.state.value}",
            )
        if hlen != exp_hlen:
            raise _Fatal(
                Fes.INVALID_HEADER_FIELD, spec.OFF_HLEN,
                f"{_pdu_name(ptype)} hlen {hlen}, expected {exp_hlen}",
            )
        hd = dd = 0
        if ptype == _ICREQ or ptype == _ICRESP:
            if plen != spec.IC_PDU_SIZE:
                raise _Fatal(
                    Fes.INVALID_HEADER_FIELD, spec.OFF_PLEN,
                    f"{_pdu_name(ptype)} plen {plen}, expected {spec.IC_PDU_SIZE}",
                )
        elif ptype == _H2C_TERM or ptype == _C2H_TERM:
            # TermReqs never carry digests: the error may be the digest itself.
            if not spec.TERM_REQ_MIN_PLEN <= plen <= spec.TERM_REQ_MAX_PLEN:
                raise _Fatal(
                    Fes.INVALID_HEADER_FIELD, spec.OFF_PLEN,
                    f"{_pdu_name(ptype)} plen {plen} outside "
                    f"{spec.TERM_REQ_MIN_PLEN}..{spec.TERM_REQ_MAX_PLEN}",
                )
        else:
            if self.hdgst:
                if not flags & _HDGSTF:
                    raise _Fatal(
                        Fes.INVALID_HEADER_FIELD, spec.OFF_FLAGS,
                        f"{_pdu_name(ptype)} without HDGSTF although header digest was negotiated",
                    )
                hd = _DGST_LEN
            elif flags & _HDGSTF:
                raise _Fatal(
                    Fes.INVALID_HEADER_FIELD, spec.OFF_FLAGS,
                    f"{_pdu_name(ptype)} has HDGSTF but header digest was not negotiated",
                )
            hdr_end = hlen + hd
            if plen < hdr_end:
                raise _Fatal(
                    Fes.INVALID_HEADER_FIELD, spec.OFF_PLEN,
                    f"{_pdu_name(ptype)} plen {plen} shorter than its header ({hdr_end})",
                )
            if ptype == _RSP or ptype == _R2T or (ptype == _CMD and plen == hdr_end):
                if plen != hdr_end:
                    raise _Fatal(
                        Fes.INVALID_HEADER_FIELD, spec.OFF_PLEN,
                        f"{_pdu_name(ptype)} plen {plen}, expected {hdr_end}",
                    )
                if pdo and pdo < hdr_end:
                    raise _Fatal(
                        Fes.INVALID_HEADER_FIELD, spec.OFF_PDO,
                        f"{_pdu_name(ptype)} pdo {pdo} inside its header ({hdr_end})",
                    )
            else:
                # CapsuleCmd with in-capsule data, H2CData, C2HData: data starts right after the
                # header (we advertise cpda 0 and accept only hpda 0).
                if pdo != hdr_end:
                    raise _Fatal(
                        Fes.INVALID_HEADER_FIELD, spec.OFF_PDO,
                        f"{_pdu_name(ptype)} pdo {pdo}, expected {hdr_end}",
                    )
                if self.ddgst:
                    if not flags & _DDGSTF:
                        raise _Fatal(
                            Fes.INVALID_HEADER_FIELD, spec.OFF_FLAGS,
                            f"{_pdu_name(ptype)} carries data without DDGSTF although data digest "
                            "was negotiated",
                        )
                    dd = _DGST_LEN
                elif flags & _DDGSTF:
                    raise _Fatal(
                        Fes.INVALID_HEADER_FIELD, spec.OFF_FLAGS,
                        f"{_pdu_name(ptype)} has DDGSTF but data digest was not negotiated",
                    )
                datal = plen - hdr_end - dd
                if datal <= 0:
                    raise _Fatal(
                        Fes.INVALID_HEADER_FIELD, spec.OFF_PLEN,
                        f"{_pdu_name(ptype)} plen {plen} leaves no room for data",
                    )
                if ptype == _CMD and datal > self.max_incapsule:
                    raise _Fatal(
                        Fes.DATA_LIMIT_EXCEEDED, 0,
                        f"CAPSULE_CMD carries {datal} bytes of in-capsule data, more than "
                        f"{self.max_incapsule}",
                    )
        if avail < hlen + hd:
            return None
        if hd:
            expected = crc32c(mv[pos:pos + hlen])
            got = _unpack_le32(mv, pos + hlen)[0]
            if got != expected:
                raise _Fatal(
                    Fes.HEADER_DIGEST_ERROR, 0,
                    f"{_pdu_name(ptype)} header digest {got:#010x}, expected {expected:#010x}",
                )
        if ptype == _H2C or ptype == _C2H:
            self._check_data_header(mv, pos, ptype, flags, pdo, plen, dd)
        elif ptype == _R2T:
            self._check_r2t(mv, pos)
        elif ptype == _RSP:
            cid = _unpack_le16(mv, pos + _RSP_CID)[0]
            if self._cmds.pop(cid, None) is None:
                # nvme_tcp_process_nvme_cqe: "got bad cqe.command_id"
                raise _Fatal(Fes.INVALID_HEADER_FIELD, _RSP_CID,
                             f"CapsuleResp for cid {cid}, which has no command in flight")
        return ptype, flags, hlen, pdo, plen, hd, dd

    def _check_r2t(self, mv: memoryview, pos: int) -> None:
        """Host: an R2T must ask for data its command has and has not asked for yet (nvme_tcp_handle_r2t,
        nvme_tcp_setup_h2c_data_pdu); it moves the command on once, when its header is in."""
        _t, _f, _h, _p, _l, cccid, _ttag, r2to, r2tl = _unpack_data_hdr(mv, pos)
        if r2tl == 0:
            raise _Fatal(Fes.INVALID_HEADER_FIELD, spec.OFF_R2TL, "R2T with r2tl 0")
        cmd = _command_for("R2T", cccid, self._cmds.get(cccid), _DIR_H2C, "a command with no data to send by R2T")
        _d, asked, end = cmd
        if r2to < asked or r2to + r2tl > end:
            raise _Fatal(
                Fes.DATA_OUT_OF_RANGE, spec.OFF_R2TO if r2to < asked else spec.OFF_R2TL,
                f"R2T for cid {cccid} asks offset {r2to} length {r2tl}; the command has {end} bytes, "
                f"{asked} already asked for",
            )
        cmd[1] = r2to + r2tl

    @staticmethod
    def _bad_c2h(cccid: int, datao: int, datal: int, cmd: list[int] | None) -> None:
        """Host: why a C2HData does not continue its read where the last one ended, within its length."""
        _d, expected, end = _command_for("C2HData", cccid, cmd, _DIR_C2H, "a command that reads no data")
        if datao != expected or datao + datal > end:
            raise _Fatal(
                Fes.DATA_OUT_OF_RANGE, spec.OFF_DATAO if datao != expected else spec.OFF_DATAL,
                f"C2HData for cid {cccid} at offset {datao} length {datal}: expected offset {expected} "
                f"within a {end}-byte buffer",
            )

    def _check_data_header(
        self, mv: memoryview, pos: int, ptype: int, flags: int, pdo: int, plen: int, dd: int
    ) -> None:
        _t, _f, _h, _p, _l, cccid, ttag, datao, datal = _unpack_data_hdr(mv, pos)
        if datal == 0:
            raise _Fatal(Fes.INVALID_HEADER_FIELD, spec.OFF_DATAL, f"{_pdu_name(ptype)} with datal 0")
        limit = self.maxh2cdata if ptype == _H2C else self.max_data
        if datal > limit:
            raise _Fatal(
                Fes.DATA_LIMIT_EXCEEDED, 0,
                f"{_pdu_name(ptype)} datal {datal} exceeds "
                f"{'MAXH2CDATA' if ptype == _H2C else 'max_data'} {limit}",
            )
        if plen != pdo + datal + dd:
            raise _Fatal(
                Fes.INVALID_HEADER_FIELD, spec.OFF_DATAL,
                f"{_pdu_name(ptype)} datal {datal} disagrees with plen {plen} (pdo {pdo}, data digest {dd})",
            )
        if ptype == _C2H:
            if flags & _SUCCESS and not flags & _LAST:
                # The Linux host rejects this combination too (nvme_tcp_handle_c2h_data).
                raise _Fatal(Fes.INVALID_HEADER_FIELD, spec.OFF_FLAGS, "C2H_DATA with SUCCESS but not LAST")
            # The read it continues (nvme_tcp_handle_c2h_data), moved on once, now that its header is in.
            cmds = self._cmds
            cmd = cmds.get(cccid)
            if cmd is None or cmd[0] != _DIR_C2H or cmd[1] != datao or datao + datal > cmd[2]:
                self._bad_c2h(cccid, datao, datal, cmd)
            if flags & _SUCCESS:
                del cmds[cccid]   # SUCCESS stands for the CapsuleResp: the command is done
            else:
                cmd[1] = datao + datal   # type: ignore[index]
            return
        # H2CData: it must continue the R2T its ttag names (nvmet_tcp_handle_h2c_data_pdu), and
        # moves that R2T on here, once per PDU, before its data is waited for.
        r2t = self._r2t.get(ttag)
        if r2t is None:
            raise _Fatal(
                Fes.INVALID_HEADER_FIELD, spec.OFF_TTAG,
                f"H2CData with ttag {ttag}, which no outstanding R2T carries",
            )
        r2t_cccid, expected, end, r2to = r2t
        if cccid != r2t_cccid:
            raise _Fatal(
                Fes.INVALID_HEADER_FIELD, spec.OFF_CCCID,
                f"H2CData cccid {cccid} but ttag {ttag} belongs to command {r2t_cccid}",
            )
        if datao != expected:
            raise _Fatal(
                Fes.DATA_OUT_OF_RANGE, spec.OFF_DATAO,
                f"H2CData offset {datao} for command {cccid}; expected {expected}",
            )
        stop = datao + datal
        if stop > end or (flags & _LAST and stop != end):
            raise _Fatal(
                Fes.DATA_OUT_OF_RANGE, spec.OFF_DATAL,
                f"H2CData {datao}+{datal}{' (LAST)' if flags & _LAST else ''} for command {cccid} does not "
                f"fit its R2T of {end - r2to} bytes{f' at offset {r2to}' if r2to else ''}",
            )
        if stop == end:
            del self._r2t[ttag]   # all the R2T asked for is on its way: that ttag is done
        else:
            r2t[1] = stop

    def _dispatch(
        self, mv: memoryview, pos: int, ptype: int, flags: int, hlen: int, pdo: int, plen: int,
        hd: int, dd: int, events: list[Event],
    ) -> None:
        if ptype == _CMD:
            sqe = mv[pos + 8:pos + 72]
            if pdo:
                dstart = pos + pdo
                dend = pos + plen - dd
                data = mv[dstart:dend]
                ok = True
                if dd:
                    ok = crc32c(data) == _unpack_le32(mv, dend)[0]
                events.append(CommandReceived(sqe, data, ok))
            else:
                events.append(CommandReceived(sqe, None, True))
        elif ptype == _RSP:
            events.append(ResponseReceived(mv[pos + 8:pos + 24]))
        elif ptype == _H2C or ptype == _C2H:
            _t, _f, _h, _p, _l, cccid, ttag, datao, datal = _unpack_data_hdr(mv, pos)
            dstart = pos + pdo
            dend = dstart + datal
            data = mv[dstart:dend]
            ok = True
            if dd:
                ok = crc32c(data) == _unpack_le32(mv, dend)[0]
            if ptype == _H2C:
                events.append(H2CDataReceived(cccid, ttag, datao, data, bool(flags & _LAST), ok))
            else:
                events.append(
                    C2HDataReceived(cccid, datao, data, bool(flags & _LAST), bool(flags & _SUCCESS), ok)
                )
        elif ptype == _R2T:
            _t, _f, _h, _p, _l, cccid, ttag, r2to, r2tl = _unpack_data_hdr(mv, pos)
            events.append(R2TReceived(cccid, ttag, r2to, r2tl))
        elif ptype == _ICREQ:
            self._on_icreq(mv, pos, events)
        elif ptype == _ICRESP:
            self._on_icresp(mv, pos, events)
        else:  # a TermReq
            _t, _f, _h, _p, _l, fes, fei = _TERM.unpack_from(mv, pos)
            raw = bytes(mv[pos + spec.TERM_REQ_HEADER_SIZE:pos + plen])
            events.append(TermReqReceived(fes, fei, raw))
            self._set_state(State.CLOSED)

    def _on_icreq(self, mv: memoryview, pos: int, events: list[Event]) -> None:
        _t, _f, _h, _p, _l, pfv, hpda, dgst, maxr2t = _IC.unpack_from(mv, pos)
        if pfv != spec.PFV_1_0:
            raise _Fatal(Fes.UNSUPPORTED_PARAMETER, spec.OFF_PFV, f"ICREQ pfv {pfv} is not supported")
        if hpda != 0:
            # A nonzero HPDA asks us to pad C2H data; like nvmet, we only do HPDA 0.
            raise _Fatal(Fes.UNSUPPORTED_PARAMETER, spec.OFF_PDA, f"ICREQ hpda {hpda} is not supported")
        self.hpda = hpda
        self.maxr2t = maxr2t
        self._req_hdgst = bool(dgst & spec.HDR_DIGEST_ENABLE)
        self._req_ddgst = bool(dgst & spec.DATA_DIGEST_ENABLE)
        self._set_state(State.IC_PENDING)
        events.append(ICReqReceived(pfv, hpda, self._req_hdgst, self._req_ddgst, maxr2t))

    def _on_icresp(self, mv: memoryview, pos: int, events: list[Event]) -> None:
        _t, _f, _h, _p, _l, pfv, cpda, dgst, maxh2cdata = _IC.unpack_from(mv, pos)
        if pfv != spec.PFV_1_0:
            raise _Fatal(Fes.UNSUPPORTED_PARAMETER, spec.OFF_PFV, f"ICRESP pfv {pfv} is not supported")
        if cpda != 0:
            raise _Fatal(Fes.UNSUPPORTED_PARAMETER, spec.OFF_PDA, f"ICRESP cpda {cpda} is not supported")
        hdgst = bool(dgst & spec.HDR_DIGEST_ENABLE)
        ddgst = bool(dgst & spec.DATA_DIGEST_ENABLE)
        if hdgst != self._req_hdgst or ddgst != self._req_ddgst:
            raise _Fatal(
                Fes.INVALID_HEADER_FIELD, spec.OFF_DGST,
                f"ICRESP digests hdgst={hdgst} ddgst={ddgst} do not echo the ICREQ's "
                f"hdgst={self._req_hdgst} ddgst={self._req_ddgst}",
            )
        if maxh2cdata % 4 or maxh2cdata < spec.MIN_MAXH2CDATA:
            raise _Fatal(
                Fes.INVALID_HEADER_FIELD, spec.OFF_MAXH2CDATA,
                f"ICRESP maxh2cdata {maxh2cdata} is not a multiple of 4 >= {spec.MIN_MAXH2CDATA}",
            )
        self.cpda = cpda
        self.hdgst = hdgst
        self.ddgst = ddgst
        self.maxh2cdata = maxh2cdata
        self._set_state(State.READY)
        events.append(ICRespReceived(pfv, cpda, hdgst, ddgst, maxh2cdata))

    def _fail(self, events: list[Event], mv: memoryview, pos: int, avail: int, err: _Fatal) -> None:
        hlen = mv[pos + 2] if avail > 2 else 8
        copy_len = min(avail, max(hlen, 8), _TERM_DATA_MAX)
        self._pending = None
        events.append(ProtocolError(err.fes, err.fei, err.reason))
        # The PDUs before the bad one were good: what the adapter sends while handling their events
        # (ahead of this ProtocolError) still goes out, and the TermReq follows it, in stream order.
        self._queue_term_req(err.fes, err.fei, bytes(mv[pos:pos + copy_len]), after_replies=True)

    # ------------------------------------------------------------------------------------- send

    def data_to_send(self) -> list[bytes | memoryview]:
        """Return and forget the buffers queued for the peer (header and data kept apart)."""
        out = self._out
        self._out = []
        if self._term is not None:
            out.append(self._term)   # last: nothing is sent after a TermReq
            self._term = None
        return out

    def _require(self, role: Role, what: str) -> bool:
        """Check a send call is legal; False means the connection is closed and it is dropped."""
        if self.role is not role:
            raise RuntimeError(f"{what} is a {role.value} PDU; this connection is the {self.role.value}")
        if self.state is State.CLOSED:
            return self._term is not None   # replies to the PDUs before a bad one, until the TermReq leaves
        if self.state is not State.READY:
            raise RuntimeError(f"{what} before the connection is initialized (state {self.state.value})")
        return True

    def _header(self, hdr: bytes) -> bytes:
        return hdr + digest_bytes(hdr) if self.hdgst else hdr

    # host role

    def send_icreq(self, hdgst: bool = False, ddgst: bool = False, hpda: int = 0, maxr2t: int = 0) -> None:
        if self.role is not Role.HOST:
            raise RuntimeError("ICREQ is sent by the host")
        if self.state is not State.AWAIT_IC:
            raise RuntimeError(f"ICREQ already sent (state {self.state.value})")
        if not 0 <= hpda <= 31:
            raise ValueError(f"hpda must be 0..31, got {hpda}")
        if not 0 <= maxr2t <= 0xFFFFFFFF:
            raise ValueError(f"maxr2t must fit 32 bits, got {maxr2t}")
        self._req_hdgst = bool(hdgst)
        self._req_ddgst = bool(ddgst)
        self.hpda = hpda
        self.maxr2t = maxr2t
        dgst = (spec.HDR_DIGEST_ENABLE if hdgst else 0) | (spec.DATA_DIGEST_ENABLE if ddgst else 0)
        size = spec.IC_PDU_SIZE
        self._out.append(_IC.pack(_ICREQ, 0, size, 0, size, spec.PFV_1_0, hpda, dgst, maxr2t))
        self._set_state(State.IC_PENDING)

    def send_command(
        self, sqe: bytes | memoryview, incapsule: bytes | memoryview | None = None, *,
        direction: Direction = Direction.NONE, data_len: int = 0,
    ) -> None:
        """Queue a CapsuleCmd. ``direction`` and ``data_len`` say what data the controller moves for it
        with data PDUs (C2H: C2HData filling ``data_len`` bytes; H2C: R2Ts asking for up to ``data_len``
        bytes); in-capsule data is not counted. The R2Ts, C2HData and CapsuleResp are checked against it."""
        if not self._require(Role.HOST, "CAPSULE_CMD"):
            return
        if len(sqe) != 64:
            raise ValueError(f"an SQE is 64 bytes, got {len(sqe)}")
        if (data_len or direction) and (data_len <= 0 or incapsule or direction not in _DATA_DIRS):
            raise ValueError(f"direction {direction!r} with data_len {data_len}"
                             f"{' and in-capsule data' if incapsule else ''}: data moved by data PDUs needs "
                             "Direction.H2C or Direction.C2H, a length > 0 and no in-capsule data")
        entry = [direction, 0, data_len]
        if self._cmds.setdefault(cid := _unpack_le16(sqe, 2)[0], entry) is not entry:
            raise ValueError(f"cid {cid} is still in flight on this queue")
        hd = _DGST_LEN if self.hdgst else 0
        flags = _HDGSTF if hd else 0
        hlen = spec.CAPSULE_CMD_HEADER_SIZE
        if incapsule:
            dlen = len(incapsule)
            dd = _DGST_LEN if self.ddgst else 0
            if dd:
                flags |= _DDGSTF
            out = self._out
            out.append(self._header(_CMD_HDR.pack(_CMD, flags, hlen, hlen + hd, hlen + hd + dlen + dd, sqe)))
            out.append(incapsule)
            if dd:
                out.append(digest_bytes(incapsule))
        else:
            self._out.append(self._header(_CMD_HDR.pack(_CMD, flags, hlen, 0, hlen + hd, sqe)))

    def send_h2c_data(
        self, cccid: int, ttag: int, offset: int, data: bytes | memoryview, last: bool
    ) -> None:
        if not self._require(Role.HOST, "H2C_DATA"):
            return
        dlen = len(data)
        if not 0 < dlen <= self.maxh2cdata:
            raise ValueError(f"H2C_DATA carries 1..MAXH2CDATA ({self.maxh2cdata}) bytes, got {dlen}")
        self._send_data(_H2C, _LAST if last else 0, cccid, ttag, offset, data, dlen)

    # controller role

    def send_icresp(self, maxh2cdata: int | None = None, cpda: int = 0) -> None:
        if self.role is not Role.CONTROLLER:
            raise RuntimeError("ICRESP is sent by the controller")
        if self.state is State.CLOSED:
            return
        if self.state is not State.IC_PENDING:
            raise RuntimeError(f"ICRESP answers an ICREQ (state {self.state.value})")
        if maxh2cdata is not None:
            _check_maxh2cdata(maxh2cdata)
            self.maxh2cdata = maxh2cdata
        if cpda != 0:
            raise ValueError(f"cpda {cpda} is not supported (the Linux host requires 0)")
        self.hdgst = self._req_hdgst
        self.ddgst = self._req_ddgst
        dgst = (spec.HDR_DIGEST_ENABLE if self.hdgst else 0) | (spec.DATA_DIGEST_ENABLE if self.ddgst else 0)
        size = spec.IC_PDU_SIZE
        self._out.append(_IC.pack(_ICRESP, 0, size, 0, size, spec.PFV_1_0, cpda, dgst, self.maxh2cdata))
        self.cpda = cpda
        self._set_state(State.READY)

    def send_response(self, cqe: bytes | memoryview) -> None:
        if not self._require(Role.CONTROLLER, "CAPSULE_RESP"):
            return
        if len(cqe) != 16:
            raise ValueError(f"a CQE is 16 bytes, got {len(cqe)}")
        if self.hdgst:
            hdr = _RSP_HDR.pack(_RSP, _HDGSTF, 24, 0, 24 + _DGST_LEN, cqe)
            self._out.append(hdr + digest_bytes(hdr))
        else:
            self._out.append(_RSP_HDR.pack(_RSP, 0, 24, 0, 24, cqe))

    def send_c2h_data(
        self, cccid: int, offset: int, data: bytes | memoryview, *, last: bool, success: bool
    ) -> None:
        if not self._require(Role.CONTROLLER, "C2H_DATA"):
            return
        if success and not last:
            raise ValueError("C2H_DATA with SUCCESS must also be LAST")
        dlen = len(data)
        if dlen == 0:
            raise ValueError("C2H_DATA must carry data")
        flags = (_LAST if last else 0) | (_SUCCESS if success else 0)
        self._send_data(_C2H, flags, cccid, 0, offset, data, dlen)

    def send_c2h_data_split(
        self, cccid: int, data: bytes | memoryview, max_pdu: int, *, offset: int = 0, success: bool
    ) -> None:
        """Send ``data`` as C2H_DATA PDUs of at most ``max_pdu`` bytes; LAST (and SUCCESS) on the last."""
        if max_pdu <= 0:
            raise ValueError(f"max_pdu must be > 0, got {max_pdu}")
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        total = len(view)
        for start in range(0, total, max_pdu):
            stop = min(start + max_pdu, total)
            final = stop == total
            self.send_c2h_data(cccid, offset + start, view[start:stop], last=final, success=success and final)

    def send_r2t(self, cccid: int, ttag: int, offset: int, length: int) -> None:
        if not self._require(Role.CONTROLLER, "R2T"):
            return
        if length <= 0:
            raise ValueError(f"R2T length must be > 0, got {length}")
        if not 0 <= ttag <= 0xFFFF:
            raise ValueError(f"ttag must fit 16 bits, got {ttag}")
        if ttag in self._r2t:
            raise ValueError(f"ttag {ttag} already has an outstanding R2T (command {self._r2t[ttag][0]})")
        self._r2t[ttag] = [cccid, offset, offset + length, offset]
        hd = _DGST_LEN if self.hdgst else 0
        hdr = _DATA_HDR.pack(_R2T, _HDGSTF if hd else 0, 24, 0, 24 + hd, cccid, ttag, offset, length)
        self._out.append(self._header(hdr))

    def take_h2c(self, ttag: int, cccid: int, datao: int, stop: int) -> bool:
        """An adapter takes an H2CData for R2T ``ttag`` itself (header checked as ``_check_data_header``
        does: target/transports/tcp_batch.py): move that R2T on as parsing the header would. False when
        the R2T does not expect exactly that (the PDU must then come through ``receive_data``)."""
        r2t = self._r2t.get(ttag)
        if r2t is None or r2t[0] != cccid or r2t[1] != datao or stop > r2t[2]:
            return False
        if stop == r2t[2]:
            del self._r2t[ttag]
        else:
            r2t[1] = stop
        return True

    def drop_r2t(self, ttag: int) -> None:
        """Forget an R2T whose data is no longer wanted (its command ended); later H2CData for it is fatal."""
        self._r2t.pop(ttag, None)

    # both roles

    def send_term_req(self, fes: int, fei: int = 0, data: bytes = b"") -> None:
        """Queue a TermReq of our role (H2C from the host, C2H from the controller) and close."""
        if self.state is State.CLOSED:
            return
        self._queue_term_req(fes, fei, data)

    def _queue_term_req(self, fes: int, fei: int, data: bytes, *, after_replies: bool = False) -> None:
        data = bytes(data[:_TERM_DATA_MAX])
        ptype = _H2C_TERM if self.role is Role.HOST else _C2H_TERM
        hlen = spec.TERM_REQ_HEADER_SIZE
        pdu = _TERM.pack(ptype, 0, hlen, 0, hlen + len(data), fes, fei & 0xFFFFFFFF) + data
        if after_replies and self.state is State.READY:
            self._term = pdu          # data_to_send() appends it after whatever is sent until then
        else:
            self._out.append(pdu)
        self._direct = None
        self._set_state(State.CLOSED)

    def _send_data(
        self, ptype: int, flags: int, cccid: int, ttag: int, offset: int, data: bytes | memoryview, dlen: int
    ) -> None:
        hd = _DGST_LEN if self.hdgst else 0
        dd = _DGST_LEN if self.ddgst else 0
        if hd:
            flags |= _HDGSTF
        if dd:
            flags |= _DDGSTF
        pdo = 24 + hd
        hdr = _DATA_HDR.pack(ptype, flags, 24, pdo, pdo + dlen + dd, cccid, ttag, offset, dlen)
        out = self._out
        out.append(hdr + digest_bytes(hdr) if hd else hdr)
        out.append(data)
        if dd:
            out.append(digest_bytes(data))


def _command_for(pdu: str, cccid: int, cmd: list[int] | None, direction: Direction, wrong: str) -> list[int]:
    """Host: the command in flight a data PDU names, if it moves data that way; else the fatal error,
    its FEI the PDU's CCCID."""
    if cmd is None:
        raise _Fatal(Fes.INVALID_HEADER_FIELD, spec.OFF_CCCID, f"{pdu} for cid {cccid}, which has no command in flight")
    if cmd[0] != direction:
        raise _Fatal(Fes.INVALID_HEADER_FIELD, spec.OFF_CCCID, f"{pdu} for cid {cccid}, {wrong}")
    return cmd


def _check_maxh2cdata(value: int) -> None:
    if value % 4 or value < spec.MIN_MAXH2CDATA:
        raise ValueError(f"maxh2cdata must be a multiple of 4 and >= {spec.MIN_MAXH2CDATA}, got {value}")
