"""Errors are found and reported in stream order, one PDU at a time, as Linux nvmet does.

The controller-role TcpConnection keeps the R2Ts it sent and checks every H2CData header against
them (ttag, cccid, offset, length) while parsing, so a bad H2CData ends the parse right there with
its own FES/FEI; what the PDUs before it asked for still goes out ahead of the TermReq.
"""

from __future__ import annotations

import os
import struct

import pytest
from raw_pdu import SUBNQN as RAW_SUBNQN
from raw_pdu import RawPeer, admin_host, capsule_cmd, connect_pdu, h2c_data, h2c_term_req, serve, sqe

from nvmeof.spec import tcp as spec
from nvmeof.spec.nvme import Command, IoOpcode
from nvmeof.spec.tcp import FatalErrorStatus as Fes
from nvmeof.tcp import CommandReceived, H2CDataReceived, ProtocolError, Role, State, TcpConnection

UNKNOWN_PDU = bytes([0x0A, 0, 24, 0]) + (24).to_bytes(4, "little") + bytes(16)


def _wire(conn: TcpConnection) -> bytes:
    return b"".join(bytes(b) for b in conn.data_to_send())


def _pair(hdgst: bool = False, ddgst: bool = False) -> tuple[TcpConnection, TcpConnection]:
    host, ctrl = TcpConnection(Role.HOST), TcpConnection(Role.CONTROLLER)
    host.send_icreq(hdgst, ddgst)
    ctrl.receive_data(_wire(host))
    ctrl.send_icresp()
    host.receive_data(_wire(ctrl))
    return host, ctrl


def _sqe(cid: int) -> bytes:
    return struct.pack("<BBH60x", 0x02, 0x40, cid)


def _term(raw: bytes) -> tuple[int, int, int, bytes]:
    ptype, _flags, _hlen, _pdo, plen, fes, fei = spec.TERM_REQ_HDR.unpack_from(raw)
    assert plen == len(raw)
    return ptype, fes, fei, raw[24:]


# ----------------------------------------------------------------------- the R2T table (sans-IO)

# (name, H2CData fields (cccid, ttag, datao, datal, last) against an R2T of cccid 5, ttag 9, 0+8192,
#  the FES, the FEI and words of the reason)
_BAD_H2C = [
    ("unknown_ttag", (5, 10, 0, 8192, True), Fes.INVALID_HEADER_FIELD, spec.OFF_TTAG,
     "H2CData with ttag 10, which no outstanding R2T carries"),
    ("wrong_cccid", (6, 9, 0, 8192, True), Fes.INVALID_HEADER_FIELD, spec.OFF_CCCID,
     "H2CData cccid 6 but ttag 9 belongs to command 5"),
    ("wrong_offset", (5, 9, 512, 512, False), Fes.DATA_OUT_OF_RANGE, spec.OFF_DATAO,
     "H2CData offset 512 for command 5; expected 0"),
    ("beyond_r2t", (5, 9, 0, 8704, True), Fes.DATA_OUT_OF_RANGE, spec.OFF_DATAL,
     "H2CData 0+8704 (LAST) for command 5 does not fit its R2T of 8192 bytes"),
    ("last_too_early", (5, 9, 0, 4096, True), Fes.DATA_OUT_OF_RANGE, spec.OFF_DATAL,
     "H2CData 0+4096 (LAST) for command 5 does not fit"),
]


@pytest.mark.parametrize(("hd", "dd"), [(False, False), (True, True)])
@pytest.mark.parametrize(("name", "fields", "fes", "fei", "reason"), _BAD_H2C, ids=[r[0] for r in _BAD_H2C])
def test_h2c_checked_against_its_r2t_while_parsing(name, fields, fes, fei, reason, hd, dd):
    host, ctrl = _pair(hd, dd)
    ctrl.send_r2t(5, 9, 0, 8192)
    _wire(ctrl)
    cccid, ttag, datao, datal, last = fields
    host.send_h2c_data(cccid, ttag, datao, bytes(datal), last=last)
    bad = _wire(host)
    host.send_command(_sqe(1))
    # A good capsule, then an H2CTermReq: neither is parsed once the H2CData failed.
    events = ctrl.receive_data(bad + _wire(host) + h2c_term_req(3))
    assert len(events) == 1 and isinstance(events[0], ProtocolError), events
    assert (events[0].fes, events[0].fei) == (fes, fei) and reason in events[0].reason
    assert ctrl.state is State.CLOSED
    ptype, tfes, tfei, data = _term(_wire(ctrl))
    assert (ptype, tfes, tfei) == (spec.PduType.C2H_TERM_REQ, fes, fei)
    assert data == bad[:24]   # the header in error


def test_h2c_header_alone_is_enough_to_refuse_it():
    """Like nvmet, the check needs only the header: the bad PDU's data is never waited for."""
    host, ctrl = _pair()
    ctrl.send_r2t(5, 9, 0, 8192)
    _wire(ctrl)
    host.send_h2c_data(5, 9, 4096, bytes(4096), last=True)
    [err] = ctrl.receive_data(_wire(host)[:24])
    assert isinstance(err, ProtocolError) and err.fei == spec.OFF_DATAO


def test_r2t_table_follows_the_data():
    host, ctrl = _pair(True, True)
    ctrl.send_r2t(5, 9, 4096, 8192)            # an R2T need not start at 0
    ctrl.send_r2t(6, 10, 0, 512)
    with pytest.raises(ValueError, match="ttag 9 already has an outstanding R2T"):
        ctrl.send_r2t(7, 9, 0, 512)
    with pytest.raises(ValueError, match="16 bits"):
        ctrl.send_r2t(7, 0x10000, 0, 512)
    _wire(ctrl)
    host.send_h2c_data(6, 10, 0, b"b" * 512, last=True)
    host.send_h2c_data(5, 9, 4096, b"a" * 4096, last=False)
    host.send_h2c_data(5, 9, 8192, b"c" * 4096, last=True)
    raw = _wire(host)
    # byte at a time: the table moves per PDU header, never twice for one PDU
    events = []
    for i in range(len(raw)):
        events += [(e.cccid, e.ttag, e.offset, bytes(e.data), e.last, e.digest_ok)
                   for e in ctrl.receive_data(raw[i:i + 1]) if isinstance(e, H2CDataReceived)]
    assert events == [(6, 10, 0, b"b" * 512, True, True), (5, 9, 4096, b"a" * 4096, False, True),
                      (5, 9, 8192, b"c" * 4096, True, True)]
    assert ctrl.state is State.READY
    # both R2Ts are done: their ttags may be used again, and more data for them is fatal
    host.send_h2c_data(5, 9, 12288, bytes(512), last=True)
    [err] = ctrl.receive_data(_wire(host))
    assert isinstance(err, ProtocolError) and err.fei == spec.OFF_TTAG


def test_dropped_r2t_takes_no_more_data():
    host, ctrl = _pair()
    ctrl.send_r2t(5, 9, 0, 8192)
    ctrl.drop_r2t(9)
    ctrl.drop_r2t(9)   # idempotent
    ctrl.send_r2t(6, 9, 0, 512)   # the ttag is free again
    _wire(ctrl)
    host.send_h2c_data(5, 9, 0, bytes(512), last=False)
    [err] = ctrl.receive_data(_wire(host))
    assert isinstance(err, ProtocolError) and err.fei == spec.OFF_CCCID


def test_placement_is_never_asked_for_an_unchecked_h2c():
    host, ctrl = _pair()
    asked: list[tuple[int, ...]] = []
    ctrl.place = lambda *args: asked.append(args) or None   # type: ignore[func-returns-value]
    ctrl.send_r2t(5, 9, 0, 64 * 1024)
    _wire(ctrl)
    host.send_h2c_data(5, 8, 0, bytes(64 * 1024), last=True)   # wrong ttag
    raw = _wire(host)
    [err] = ctrl.receive_data(raw[:4096])
    assert isinstance(err, ProtocolError) and not asked


# --------------------------------------------------------------- replies go out before the TermReq

def test_replies_to_good_pdus_precede_the_term_req():
    host, ctrl = _pair()
    host.send_command(_sqe(1))
    host.send_command(_sqe(2))
    events = ctrl.receive_data(_wire(host) + UNKNOWN_PDU)
    assert [type(e) for e in events] == [CommandReceived, CommandReceived, ProtocolError]
    assert ctrl.closed
    # the adapter answers the two commands while handling their events, then flushes
    for cid in (1, 2):
        ctrl.send_response(struct.pack("<IIHHHH", 0, 0, 1, 1, cid, 0))
    out = [bytes(b) for b in ctrl.data_to_send()]
    assert [b[0] for b in out] == [spec.PduType.CAPSULE_RESP, spec.PduType.CAPSULE_RESP, spec.PduType.C2H_TERM_REQ]
    # nothing follows the TermReq
    ctrl.send_response(struct.pack("<IIHHHH", 0, 0, 1, 1, 3, 0))
    ctrl.send_term_req(Fes.PDU_SEQUENCE_ERROR)
    assert ctrl.data_to_send() == [] and ctrl.receive_data(UNKNOWN_PDU) == []


def test_error_before_ready_still_drops_later_sends():
    ctrl = TcpConnection(Role.CONTROLLER)
    host = TcpConnection(Role.HOST)
    host.send_icreq()
    events = ctrl.receive_data(_wire(host) + UNKNOWN_PDU)
    assert [type(e).__name__ for e in events] == ["ICReqReceived", "ProtocolError"]
    ctrl.send_icresp()   # dropped: the connection closed before it was initialized
    [term] = ctrl.data_to_send()
    assert bytes(term)[0] == spec.PduType.C2H_TERM_REQ


# ------------------------------------------------------------------------------- over real TCP

@pytest.fixture
async def served():
    s = await serve()
    yield s
    await s.target.close()


@pytest.mark.parametrize("after", ["unknown_pdu", "bad_h2c", "bad_h2c_then_term_req"])
async def test_live_answers_then_term_req_in_stream_order(served, after):
    """Reads, an R2T'd write's data and a bad PDU in one write: every answer, then one C2HTermReq, then EOF."""
    s = served
    admin, cntlid = await admin_host(s.port)
    peer = await RawPeer.open(s.port)
    await peer.handshake()
    assert (await peer.command(connect_pdu(1, RAW_SUBNQN, qid=1, cntlid=cntlid), 1)).status_code == 0
    data = os.urandom(8192)
    assert (await peer.command(capsule_cmd(sqe(Command(IoOpcode.WRITE, nsid=1, cdw10=0, cdw12=15), cid=2,
                                               data_len=8192, incapsule=True), data), 2)).status_code == 0
    await peer.send(capsule_cmd(sqe(Command(IoOpcode.WRITE, nsid=1, cdw10=16, cdw12=15), cid=3, data_len=8192)))
    assert await peer.wait_for(lambda o: o.r2t(3), 5)
    ttag = peer.out.r2t(3).fields["ttag"]   # type: ignore[union-attr]
    batch = h2c_data(3, ttag, 0, data, last=True)
    batch += b"".join(capsule_cmd(sqe(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=15), cid=10 + i, data_len=8192))
                      for i in range(4))
    bad = {"unknown_pdu": UNKNOWN_PDU, "bad_h2c": h2c_data(3, ttag, 0, bytes(512), last=True),
           "bad_h2c_then_term_req": h2c_data(3, ttag, 0, bytes(512), last=True) + h2c_term_req(1)}[after]
    await peer.send(batch + bad + capsule_cmd(sqe(Command(IoOpcode.FLUSH, nsid=1), cid=20)))
    assert await peer.wait_eof(5), "the target did not close"
    out = peer.out
    assert not out.errors, out.errors   # includes "no PDU after a C2HTermReq"
    assert out.term is not None
    expect = (Fes.INVALID_HEADER_FIELD, spec.OFF_TYPE) if after == "unknown_pdu" \
        else (Fes.INVALID_HEADER_FIELD, spec.OFF_TTAG)   # ttag of a finished R2T
    assert (out.term.fields["fes"], out.term.fields["fei"]) == expect
    # The reads ran inline and were answered, and so was the write: the batch engine's fast path took its
    # R2T and finishes it inline once its data is in, before the bad PDU is parsed (on the stream engine
    # it waits for its Task to resume and is not answered). The Flush after the bad PDU is not: a fatal
    # error ends what is in flight, as with nvmet.
    for cid in (10, 11, 12, 13):
        assert out.done(cid), f"no answer to cid {cid} before the C2HTermReq"
    for cid in (10, 11, 12, 13):
        assert out.read_data(cid) == data
    write = out.cqe(3)
    assert write is not None and write.status_code == 0
    assert not out.done(20)
    admin.close()
