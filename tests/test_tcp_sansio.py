"""The sans-IO NVMe/TCP connection: exchanges between two TcpConnections, framing defences, fuzzing."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvmeof.crc32c import crc32c, digest_bytes
from nvmeof.spec import tcp as spec
from nvmeof.spec.nvme import Direction
from nvmeof.spec.tcp import FatalErrorStatus as Fes
from nvmeof.tcp import (
    C2HDataReceived,
    CommandReceived,
    H2CDataReceived,
    HandoffRefused,
    HandoffState,
    ICReqReceived,
    ICRespReceived,
    ProtocolError,
    R2TReceived,
    ResponseReceived,
    Role,
    State,
    TcpConnection,
    TermReqReceived,
)

DIGESTS = [(False, False), (True, False), (False, True), (True, True)]


def wire(conn: TcpConnection) -> bytes:
    return b"".join(bytes(b) for b in conn.data_to_send())


def pair(hdgst: bool = False, ddgst: bool = False, **ctrl_kw):
    host = TcpConnection(Role.HOST)
    ctrl = TcpConnection(Role.CONTROLLER, **ctrl_kw)
    host.send_icreq(hdgst, ddgst)
    [ev] = ctrl.receive_data(wire(host))
    assert ev == ICReqReceived(0, 0, hdgst, ddgst, 0)
    ctrl.send_icresp()
    [ev] = host.receive_data(wire(ctrl))
    assert isinstance(ev, ICRespReceived) and (ev.hdgst, ev.ddgst) == (hdgst, ddgst)
    assert host.state is ctrl.state is State.READY
    assert (host.hdgst, host.ddgst, ctrl.hdgst, ctrl.ddgst) == (hdgst, ddgst, hdgst, ddgst)
    assert host.maxh2cdata == ctrl.maxh2cdata
    return host, ctrl


def sqe(cid: int, opcode: int = 0x02) -> bytes:
    return struct.pack("<BBH60x", opcode, 0x40, cid)


def cqe(cid: int, status: int = 0) -> bytes:
    return struct.pack("<IIHHHH", 0, 0, 1, 1, cid, status)


def hdr(ptype, flags, hlen, pdo, plen, rest=b"", hdgst=False) -> bytes:
    """A PDU header built by hand (plus a correct header digest when asked)."""
    h = struct.pack("<BBBBI", ptype, flags, hlen, pdo, plen) + rest
    h = h.ljust(hlen, b"\0")
    return h + digest_bytes(h) if hdgst else h


def data_hdr(ptype, flags, cccid, ttag, datao, datal, *, pdo=None, plen=None, hd=False, dd=False, hlen=24):
    if pdo is None:
        pdo = hlen + (4 if hd else 0)
    if hd:
        flags |= spec.HDGSTF
    if dd:
        flags |= spec.DDGSTF
    if plen is None:
        plen = pdo + datal + (4 if dd else 0)
    return hdr(ptype, flags, hlen, pdo, plen, struct.pack("<HHII4x", cccid, ttag, datao, datal), hd)


def freeze(events):
    """Events with their memoryviews copied out, comparable after the next receive_data."""
    out = []
    for ev in events:
        d = {k: getattr(ev, k) for k in ev.__slots__}
        for k, v in d.items():
            if isinstance(v, memoryview):
                d[k] = bytes(v)
        out.append((type(ev).__name__, d))
    return out


def parse_term(raw: bytes):
    t, flags, hlen, pdo, plen, fes, fei = spec.TERM_REQ_HDR.unpack_from(raw)
    assert (flags, hlen, pdo, plen) == (0, 24, 0, len(raw)) and 24 <= plen <= 152
    return t, fes, fei, raw[24:]


# ------------------------------------------------------------------------------ full exchanges


@pytest.mark.parametrize(("hdgst", "ddgst"), DIGESTS)
def test_full_exchange(hdgst, ddgst):
    host, ctrl = pair(hdgst, ddgst)
    hd = 4 if hdgst else 0
    dd = 4 if ddgst else 0

    # a command without data
    host.send_command(sqe(1, 0x00))
    [out] = host.data_to_send()
    assert len(out) == 72 + hd and out[0] == 4 and out[3] == 0
    [ev] = ctrl.receive_data(out)
    assert isinstance(ev, CommandReceived) and bytes(ev.sqe) == sqe(1, 0x00) and ev.data is None
    ctrl.send_response(cqe(1))
    [ev] = host.receive_data(wire(ctrl))
    assert isinstance(ev, ResponseReceived) and bytes(ev.cqe) == cqe(1)

    # a write with in-capsule data: header, data and digest are separate buffers
    payload = bytes(range(256)) * 16
    host.send_command(sqe(2, 0x01), payload)
    bufs = host.data_to_send()
    assert bufs[1] is payload and len(bufs) == (3 if ddgst else 2)
    assert bufs[0][3] == 72 + hd  # pdo
    assert struct.unpack_from("<I", bufs[0], 4)[0] == 72 + hd + len(payload) + dd
    [ev] = ctrl.receive_data(b"".join(bufs))
    assert bytes(ev.sqe) == sqe(2, 0x01) and bytes(ev.data) == payload and ev.digest_ok

    # a write through R2T / H2CData, in two PDUs
    big = bytes(i % 251 for i in range(20000))
    host.send_command(sqe(3, 0x01), direction=Direction.H2C, data_len=len(big))
    [ev] = ctrl.receive_data(wire(host))
    ctrl.send_r2t(3, 77, 0, len(big))
    [ev] = host.receive_data(wire(ctrl))
    assert ev == R2TReceived(3, 77, 0, len(big))
    host.send_h2c_data(3, 77, 0, big[:16384], last=False)
    host.send_h2c_data(3, 77, 16384, memoryview(big)[16384:], last=True)
    evs = ctrl.receive_data(wire(host))
    assert [(e.cccid, e.ttag, e.offset, bytes(e.data), e.last, e.digest_ok) for e in evs] == [
        (3, 77, 0, big[:16384], False, True), (3, 77, 16384, big[16384:], True, True)]
    assert all(isinstance(e, H2CDataReceived) for e in evs)

    # a read answered by C2HData and CapsuleResp
    host.send_command(sqe(4), direction=Direction.C2H, data_len=len(big))
    ctrl.receive_data(wire(host))
    ctrl.send_c2h_data(4, 0, big, last=True, success=False)
    ctrl.send_response(cqe(4))
    bufs = ctrl.data_to_send()
    assert bufs[1] is big
    evs = host.receive_data(b"".join(bytes(b) for b in bufs))
    assert isinstance(evs[0], C2HDataReceived) and isinstance(evs[1], ResponseReceived)
    assert (evs[0].cccid, evs[0].offset, bytes(evs[0].data), evs[0].last, evs[0].success,
            evs[0].digest_ok) == (4, 0, big, True, False, True)

    # a read completed by C2HData with SUCCESS alone
    host.send_command(sqe(5), direction=Direction.C2H, data_len=400)
    ctrl.receive_data(wire(host))
    ctrl.send_c2h_data(5, 0, b"abcd" * 100, last=True, success=True)
    [ev] = host.receive_data(wire(ctrl))
    assert ev.success and ev.last and bytes(ev.data) == b"abcd" * 100
    assert host.state is ctrl.state is State.READY


@pytest.mark.parametrize(("hdgst", "ddgst"), DIGESTS)
def test_wire_bytes_of_data_pdu(hdgst, ddgst):
    _host, ctrl = pair(hdgst, ddgst)
    ctrl.send_c2h_data(0x0102, 4096, b"\xaa" * 8, last=True, success=False)
    raw = wire(ctrl)
    hd = 4 if hdgst else 0
    dd = 4 if ddgst else 0
    flags = spec.DATA_LAST | (spec.HDGSTF if hdgst else 0) | (spec.DDGSTF if ddgst else 0)
    assert spec.DATA_PDU_HDR.unpack_from(raw) == (7, flags, 24, 24 + hd, 24 + hd + 8 + dd, 0x0102, 0, 4096, 8)
    if hdgst:
        assert raw[24:28] == struct.pack("<I", crc32c(raw[:24]))
    if ddgst:
        assert raw[-4:] == digest_bytes(b"\xaa" * 8)
    assert len(raw) == 24 + hd + 8 + dd


def stream_of_many(host, ctrl, n=50):
    """Host->controller bytes of n mixed PDUs, and the events the controller must produce."""
    expected = []
    for i in range(n):
        if i % 3 == 0:
            host.send_command(sqe(i), bytes([i % 256]) * (i + 1))
            expected.append(("CommandReceived", sqe(i), bytes([i % 256]) * (i + 1)))
        elif i % 3 == 1:
            host.send_command(sqe(i))
            expected.append(("CommandReceived", sqe(i), None))
        else:
            # the controller's R2T this H2CData answers (the controller checks each H2CData against it)
            ctrl.send_r2t(i, i + 1, 4 * i, 10 + i)
            host.send_h2c_data(i, i + 1, 4 * i, bytes([7]) * (10 + i), last=bool(i % 2))
            expected.append(("H2CDataReceived", i, bytes([7]) * (10 + i)))
    ctrl.data_to_send()
    return wire(host), expected


def summarize(events):
    out = []
    for name, d in freeze(events):
        if name == "CommandReceived":
            out.append((name, d["sqe"], d["data"]))
        else:
            out.append((name, d["cccid"], d["data"]))
    return out


@pytest.mark.parametrize(("hdgst", "ddgst"), DIGESTS)
def test_many_pdus_in_one_chunk_and_byte_at_a_time(hdgst, ddgst):
    host, ctrl = pair(hdgst, ddgst)
    raw, expected = stream_of_many(host, ctrl)
    assert summarize(ctrl.receive_data(raw)) == expected

    host, ctrl = pair(hdgst, ddgst)
    raw, expected = stream_of_many(host, ctrl)
    got = []
    for i in range(len(raw)):
        got += freeze(ctrl.receive_data(raw[i:i + 1]))
    assert [(n, d["sqe"], d["data"]) if n == "CommandReceived" else (n, d["cccid"], d["data"])
            for n, d in got] == expected
    assert ctrl.state is State.READY


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=1, max_value=700), min_size=1, max_size=40), st.sampled_from(DIGESTS))
def test_random_chunking_gives_same_events(cuts, digests):
    host, ctrl = pair(*digests)
    raw, expected = stream_of_many(host, ctrl, 30)
    got, pos, i = [], 0, 0
    while pos < len(raw):
        step = cuts[i % len(cuts)]
        got += freeze(ctrl.receive_data(memoryview(raw)[pos:pos + step]))
        pos += step
        i += 1
    assert [(n, d["sqe"], d["data"]) if n == "CommandReceived" else (n, d["cccid"], d["data"])
            for n, d in got] == expected


def test_held_views_survive_later_receives():
    host, ctrl = pair(True, True)
    payloads = [bytes([n]) * 3000 for n in range(1, 6)]
    for p in payloads:
        host.send_command(sqe(p[0], 0x01), p)
    raw = wire(host)
    held = []
    # odd cuts so that PDUs straddle calls on both the in-place and the buffered path
    for start in range(0, len(raw), 1777):
        held += ctrl.receive_data(raw[start:start + 1777])
    assert [bytes(e.data) for e in held] == payloads


# ---------------------------------------------------------------------------- data digest errors


def test_data_digest_mismatch_is_not_fatal():
    host, ctrl = pair(False, True)
    host.send_command(sqe(9, 0x01), b"x" * 100)
    raw = bytearray(wire(host))
    raw[-5] ^= 0xFF  # a data byte
    host.send_command(sqe(10))
    [bad, good] = ctrl.receive_data(bytes(raw) + wire(host))
    assert isinstance(bad, CommandReceived) and bad.digest_ok is False
    assert good.digest_ok and bytes(good.sqe) == sqe(10)
    assert ctrl.state is State.READY and ctrl.data_to_send() == []

    host.send_command(sqe(3), direction=Direction.C2H, data_len=64)
    host.data_to_send()
    ctrl.send_c2h_data(3, 0, b"y" * 64, last=True, success=False)
    raw = bytearray(wire(ctrl))
    raw[-1] ^= 1  # the digest itself
    [ev] = host.receive_data(bytes(raw))
    assert isinstance(ev, C2HDataReceived) and not ev.digest_ok and host.state is State.READY

    ctrl.send_r2t(3, 4, 0, 64)
    ctrl.data_to_send()
    host.send_h2c_data(3, 4, 0, b"z" * 64, last=True)
    raw = bytearray(wire(host))
    raw[30] ^= 1
    [ev] = ctrl.receive_data(bytes(raw))
    assert isinstance(ev, H2CDataReceived) and not ev.digest_ok and ctrl.state is State.READY


# --------------------------------------------------------------------------------- malformed input


def expect_error(conn: TcpConnection, raw: bytes, fes: Fes, fei: int, reason_part: str = ""):
    events = conn.receive_data(raw)
    assert len(events) >= 1 and isinstance(events[-1], ProtocolError), events
    err = events[-1]
    assert (err.fes, err.fei) == (fes, fei), err.reason
    assert reason_part in err.reason
    assert conn.state is State.CLOSED
    [term] = conn.data_to_send()
    ptype, got_fes, got_fei, data = parse_term(bytes(term))
    assert ptype == (spec.PduType.C2H_TERM_REQ if conn.role is Role.CONTROLLER else spec.PduType.H2C_TERM_REQ)
    assert (got_fes, got_fei) == (fes, fei)
    assert 8 <= len(data) <= 128 and raw.startswith(data)  # the offending header is echoed
    # closed: everything later is ignored, nothing more is sent
    assert conn.receive_data(raw) == [] and conn.data_to_send() == []
    return err, data


def ready_ctrl(hdgst=False, ddgst=False, **kw):
    return pair(hdgst, ddgst, **kw)[1]


def ready_host(hdgst=False, ddgst=False):
    return pair(hdgst, ddgst)[0]


ICREQ = hdr(0, 0, 128, 0, 128, struct.pack("<HBBI", 0, 0, 0, 0))


def icresp(pfv=0, cpda=0, dgst=0, maxdata=0x400000, plen=128):
    return hdr(1, 0, 128, 0, plen, struct.pack("<HBBI", pfv, cpda, dgst, maxdata))


def test_unknown_type_is_invalid_header_field_at_0():
    for t in (8, 0x0A, 0xFF):
        expect_error(ready_ctrl(), hdr(t, 0, 24, 0, 24), Fes.INVALID_HEADER_FIELD, 0, "unknown")


def test_sequence_errors():
    ctrl = TcpConnection(Role.CONTROLLER)
    _err, data = expect_error(ctrl, hdr(4, 0, 72, 0, 72), Fes.PDU_SEQUENCE_ERROR, 0, "CAPSULE_CMD")
    assert data == hdr(4, 0, 72, 0, 72)  # the offending header is echoed
    ctrl = TcpConnection(Role.CONTROLLER)
    [_ev] = ctrl.receive_data(ICREQ)
    expect_error(ctrl, ICREQ, Fes.PDU_SEQUENCE_ERROR, 0, "ICREQ")  # before ICResp
    expect_error(ready_ctrl(), ICREQ, Fes.PDU_SEQUENCE_ERROR, 0)  # ICReq twice
    expect_error(ready_ctrl(), data_hdr(7, 4, 1, 0, 0, 4) + b"abcd", Fes.PDU_SEQUENCE_ERROR, 0, "C2H_DATA")
    expect_error(ready_ctrl(), hdr(5, 0, 24, 0, 24), Fes.PDU_SEQUENCE_ERROR, 0)
    expect_error(ready_ctrl(), hdr(3, 0, 24, 0, 24), Fes.PDU_SEQUENCE_ERROR, 0)  # C2HTermReq to ctrl
    expect_error(ready_host(), hdr(4, 0, 72, 0, 72), Fes.PDU_SEQUENCE_ERROR, 0)
    expect_error(ready_host(), data_hdr(6, 0, 1, 1, 0, 4) + b"abcd", Fes.PDU_SEQUENCE_ERROR, 0)
    expect_error(TcpConnection(Role.HOST), icresp(), Fes.PDU_SEQUENCE_ERROR, 0)  # no ICReq sent


def test_icreq_checks():
    ctrl = TcpConnection(Role.CONTROLLER)
    expect_error(ctrl, hdr(0, 0, 128, 0, 132, struct.pack("<HBBI", 0, 0, 0, 0)),
                 Fes.INVALID_HEADER_FIELD, spec.OFF_PLEN)
    expect_error(TcpConnection(Role.CONTROLLER), hdr(0, 0, 120, 0, 128), Fes.INVALID_HEADER_FIELD, 2)
    expect_error(TcpConnection(Role.CONTROLLER), hdr(0, 0, 128, 0, 128, struct.pack("<HBBI", 1, 0, 0, 0)),
                 Fes.UNSUPPORTED_PARAMETER, 8, "pfv")
    expect_error(TcpConnection(Role.CONTROLLER), hdr(0, 0, 128, 0, 128, struct.pack("<HBBI", 0, 3, 0, 0)),
                 Fes.UNSUPPORTED_PARAMETER, 10, "hpda")


def host_ic_pending(hdgst=False, ddgst=False):
    host = TcpConnection(Role.HOST)
    host.send_icreq(hdgst, ddgst)
    host.data_to_send()
    return host


def test_icresp_checks_like_linux_host():
    expect_error(host_ic_pending(), icresp(pfv=1), Fes.UNSUPPORTED_PARAMETER, 8)
    expect_error(host_ic_pending(), icresp(cpda=1), Fes.UNSUPPORTED_PARAMETER, 10)
    expect_error(host_ic_pending(), icresp(dgst=1), Fes.INVALID_HEADER_FIELD, 11, "echo")
    expect_error(host_ic_pending(True, True), icresp(dgst=1), Fes.INVALID_HEADER_FIELD, 11)
    expect_error(host_ic_pending(), icresp(maxdata=4094), Fes.INVALID_HEADER_FIELD, 12)
    expect_error(host_ic_pending(), icresp(maxdata=8190), Fes.INVALID_HEADER_FIELD, 12)
    expect_error(host_ic_pending(), icresp(plen=129), Fes.INVALID_HEADER_FIELD, 4)
    host = host_ic_pending(True, False)
    [ev] = host.receive_data(icresp(dgst=1, maxdata=4096))
    assert ev == ICRespReceived(0, 0, True, False, 4096) and host.maxh2cdata == 4096


def test_host_requires_hlen_24():
    for ptype in (3, 5, 7, 9):
        expect_error(ready_host(), hdr(ptype, 0, 28, 0, 28), Fes.INVALID_HEADER_FIELD, 2, "hlen")


@pytest.mark.parametrize("hd", [False, True])
def test_capsule_cmd_framing(hd):
    h4 = 4 if hd else 0
    f = spec.HDGSTF if hd else 0
    s = bytes(64)
    expect_error(ready_ctrl(hd), hdr(4, f, 64, 0, 68 + h4, s[:56], hd), Fes.INVALID_HEADER_FIELD, 2)
    expect_error(ready_ctrl(hd), hdr(4, f, 72, 0, 40, s, hd), Fes.INVALID_HEADER_FIELD, 4, "shorter")
    # in-capsule data with a pdo that is not right after the header
    expect_error(ready_ctrl(hd), hdr(4, f, 72, 80 + h4, 72 + h4 + 16, s, hd) + bytes(16),
                 Fes.INVALID_HEADER_FIELD, 3)
    # no data, pdo pointing inside the header
    expect_error(ready_ctrl(hd), hdr(4, f, 72, 10, 72 + h4, s, hd), Fes.INVALID_HEADER_FIELD, 3)
    # in-capsule data above the limit is refused from the first 8 bytes
    expect_error(ready_ctrl(hd, max_incapsule=4096),
                 hdr(4, f, 72, 72 + h4, 72 + h4 + 4097, s, hd)[:8], Fes.DATA_LIMIT_EXCEEDED, 0)
    ctrl = ready_ctrl(hd, max_incapsule=4096)
    [ev] = ctrl.receive_data(hdr(4, f, 72, 72 + h4, 72 + h4 + 4096, s, hd) + bytes(4096))
    assert len(ev.data) == 4096


def test_header_digest_rules():
    good = hdr(4, spec.HDGSTF, 72, 0, 76, bytes(64), True)
    expect_error(ready_ctrl(True), hdr(4, 0, 72, 0, 76, bytes(64)) + bytes(4), Fes.INVALID_HEADER_FIELD, 1)
    expect_error(ready_ctrl(False), good, Fes.INVALID_HEADER_FIELD, 1, "HDGSTF")
    bad = bytearray(good)
    bad[20] ^= 1
    expect_error(ready_ctrl(True), bytes(bad), Fes.HEADER_DIGEST_ERROR, 0, "digest")
    bad = bytearray(good)
    bad[-1] ^= 1
    expect_error(ready_ctrl(True), bytes(bad), Fes.HEADER_DIGEST_ERROR, 0)
    # the digest is checked as soon as the header is in, before any data arrives
    bad = bytearray(hdr(4, spec.HDGSTF, 72, 76, 76 + 100, bytes(64), True))
    bad[9] ^= 1
    expect_error(ready_ctrl(True), bytes(bad), Fes.HEADER_DIGEST_ERROR, 0)


def test_response_header_digest_on_host():
    host, ctrl = pair(True, False)
    host.send_command(sqe(7))
    host.data_to_send()
    ctrl.send_response(cqe(7))
    good = wire(ctrl)
    [ev] = host.receive_data(good)
    assert bytes(ev.cqe) == cqe(7)
    bad = bytearray(good)
    bad[12] ^= 0x40
    expect_error(host, bytes(bad), Fes.HEADER_DIGEST_ERROR, 0)


def test_data_digest_flag_rules():
    expect_error(ready_ctrl(False, True), hdr(4, 0, 72, 72, 72 + 8, bytes(64)) + bytes(8),
                 Fes.INVALID_HEADER_FIELD, 1, "DDGSTF")
    expect_error(ready_ctrl(False, False), hdr(4, spec.DDGSTF, 72, 72, 84, bytes(64)) + bytes(12),
                 Fes.INVALID_HEADER_FIELD, 1)
    # DDGSTF with a plen that leaves only the digest: no data at all
    expect_error(ready_ctrl(False, True), hdr(4, spec.DDGSTF, 72, 72, 76, bytes(64)) + bytes(4),
                 Fes.INVALID_HEADER_FIELD, 4)
    expect_error(ready_host(False, True), data_hdr(7, 4, 1, 0, 0, 8) + bytes(8), Fes.INVALID_HEADER_FIELD, 1)
    # a capsule without data needs no DDGSTF
    ctrl = ready_ctrl(False, True)
    [ev] = ctrl.receive_data(hdr(4, 0, 72, 0, 72, sqe(5)))
    assert ev.data is None


@pytest.mark.parametrize(("hd", "dd"), DIGESTS)
def test_h2c_data_framing(hd, dd):
    def mk(**kw):
        datal = kw.pop("datal", 16)
        return ready_ctrl(hd, dd, maxh2cdata=8192), data_hdr(6, 0, 1, 2, 0, datal, hd=hd, dd=dd, **kw)

    h4 = 4 if hd else 0
    ctrl, raw = mk(datal=8193)
    expect_error(ctrl, raw, Fes.DATA_LIMIT_EXCEEDED, 0, "MAXH2CDATA")  # header alone is enough
    ctrl, raw = mk(datal=0, plen=24 + h4 + 8)
    expect_error(ctrl, raw, Fes.INVALID_HEADER_FIELD, 16, "datal 0")
    ctrl, raw = mk(datal=16, plen=24 + h4 + 20 + (4 if dd else 0))
    expect_error(ctrl, raw, Fes.INVALID_HEADER_FIELD, 16, "disagrees")
    ctrl, raw = mk(pdo=32 + h4)
    expect_error(ctrl, raw, Fes.INVALID_HEADER_FIELD, 3)
    ctrl, raw = mk(pdo=0, plen=24 + h4 + 16 + (4 if dd else 0))
    expect_error(ctrl, raw, Fes.INVALID_HEADER_FIELD, 3)
    ctrl, raw = mk(hlen=32, pdo=32 + h4)
    expect_error(ctrl, raw, Fes.INVALID_HEADER_FIELD, 2)
    ctrl, raw = mk(datal=8192)
    ctrl.send_r2t(1, 2, 0, 8192)
    tail = bytes(8192) + (digest_bytes(bytes(8192)) if dd else b"")
    [ev] = ctrl.receive_data(raw + tail)
    assert isinstance(ev, H2CDataReceived) and len(ev.data) == 8192 and ev.digest_ok


def test_c2h_data_and_r2t_framing():
    expect_error(ready_host(), data_hdr(7, spec.DATA_SUCCESS, 1, 0, 0, 4) + bytes(4),
                 Fes.INVALID_HEADER_FIELD, 1, "SUCCESS")
    host = TcpConnection(Role.HOST, max_data=4096)
    host.send_icreq()
    host.data_to_send()
    host.receive_data(icresp())
    expect_error(host, data_hdr(7, 4, 1, 0, 0, 4097), Fes.DATA_LIMIT_EXCEEDED, 0)
    expect_error(ready_host(), hdr(9, 0, 24, 0, 24, struct.pack("<HHII", 1, 1, 0, 0)),
                 Fes.INVALID_HEADER_FIELD, 16, "r2tl")
    expect_error(ready_host(), hdr(9, 0, 24, 0, 28, struct.pack("<HHII", 1, 1, 0, 8)),
                 Fes.INVALID_HEADER_FIELD, 4)
    expect_error(ready_host(), hdr(5, 0, 24, 0, 40, bytes(16)) + bytes(16), Fes.INVALID_HEADER_FIELD, 4)
    expect_error(ready_host(), hdr(5, 0, 24, 8, 24, bytes(16)), Fes.INVALID_HEADER_FIELD, 3)


def test_term_req_limits_and_receipt():
    expect_error(ready_ctrl(), hdr(2, 0, 24, 0, 153) + bytes(129), Fes.INVALID_HEADER_FIELD, 4)
    expect_error(ready_ctrl(), hdr(2, 0, 24, 0, 23), Fes.INVALID_HEADER_FIELD, 4)
    ctrl = ready_ctrl(True, True)  # TermReqs never carry digests, even when negotiated
    [ev] = ctrl.receive_data(hdr(2, 0, 24, 0, 32, struct.pack("<HI", 3, 0)) + b"ABCDEFGH")
    assert ev == TermReqReceived(3, 0, b"ABCDEFGH")
    assert ctrl.state is State.CLOSED and ctrl.data_to_send() == []
    assert ctrl.receive_data(hdr(4, 0, 72, 0, 72)) == []
    # a TermReq before the IC exchange is accepted too
    host = TcpConnection(Role.HOST)
    [ev] = host.receive_data(hdr(3, 0, 24, 0, 24, struct.pack("<HI", 6, 8)))
    assert (ev.fes, ev.fei, ev.raw) == (6, 8, b"")


def test_our_term_req():
    host, ctrl = pair()
    host.send_term_req(Fes.PDU_SEQUENCE_ERROR, 0, b"\x07" * 24)
    raw = wire(host)
    assert parse_term(raw) == (2, 2, 0, b"\x07" * 24)
    assert host.state is State.CLOSED
    [ev] = ctrl.receive_data(raw)
    assert ev == TermReqReceived(2, 0, b"\x07" * 24)
    host.send_command(sqe(1))  # dropped once closed
    assert host.data_to_send() == []


def test_error_after_good_pdus_in_same_chunk():
    host, ctrl = pair()
    host.send_command(sqe(1))
    host.send_command(sqe(2))
    events = ctrl.receive_data(wire(host) + hdr(0x0C, 0, 24, 0, 24) + wire(host))
    assert [type(e) for e in events] == [CommandReceived, CommandReceived, ProtocolError]


# ---------------------------------------------------------------------------------- send side API


def test_send_api_misuse():
    host = TcpConnection(Role.HOST)
    with pytest.raises(RuntimeError, match="before the connection is initialized"):
        host.send_command(sqe(1))
    with pytest.raises(RuntimeError, match="controller PDU"):
        host.send_response(cqe(1))
    with pytest.raises(RuntimeError, match="sent by the controller"):
        host.send_icresp()
    host.send_icreq()
    with pytest.raises(RuntimeError, match="already sent"):
        host.send_icreq()
    host, ctrl = pair()
    with pytest.raises(ValueError, match="64 bytes"):
        host.send_command(bytes(63))
    with pytest.raises(ValueError, match="16 bytes"):
        ctrl.send_response(bytes(17))
    with pytest.raises(ValueError, match="LAST"):
        ctrl.send_c2h_data(1, 0, b"x", last=False, success=True)
    with pytest.raises(ValueError, match="MAXH2CDATA"):
        host.send_h2c_data(1, 1, 0, bytes(host.maxh2cdata + 4), last=True)
    with pytest.raises(ValueError, match="length"):
        ctrl.send_r2t(1, 1, 0, 0)
    with pytest.raises(ValueError, match="maxh2cdata"):
        TcpConnection(Role.CONTROLLER, maxh2cdata=1000)
    with pytest.raises(ValueError, match="cpda"):
        c = TcpConnection(Role.CONTROLLER)
        c.receive_data(ICREQ)
        c.send_icresp(cpda=1)


def test_icresp_advertises_and_enforces_maxh2cdata():
    host = TcpConnection(Role.HOST)
    ctrl = TcpConnection(Role.CONTROLLER)
    host.send_icreq(False, True)
    ctrl.receive_data(wire(host))
    ctrl.send_icresp(maxh2cdata=16384)
    raw = wire(ctrl)
    assert spec.IC_HDR.unpack(raw) == (1, 0, 128, 0, 128, 0, 0, 2, 16384)
    [_ev] = host.receive_data(raw)
    assert host.maxh2cdata == ctrl.maxh2cdata == 16384


def test_send_c2h_data_split():
    host, ctrl = pair(True, True)
    data = bytes(range(256)) * 40  # 10240
    host.send_command(sqe(5), direction=Direction.C2H, data_len=100 + len(data))
    host.data_to_send()
    ctrl.send_c2h_data(5, 0, bytes(100), last=False, success=False)
    ctrl.send_c2h_data_split(5, data, 4096, offset=100, success=True)
    evs = host.receive_data(wire(ctrl))[1:]
    assert [(e.offset, len(e.data), e.last, e.success, e.digest_ok) for e in evs] == [
        (100, 4096, False, False, True), (4196, 4096, False, False, True), (8292, 2048, True, True, True)]
    assert b"".join(bytes(e.data) for e in evs) == data


# ------------------------------------------------------------------------------------- fuzzing


def max_pdu(conn: TcpConnection) -> int:
    return max(72 + 8 + conn.max_incapsule, 24 + 8 + max(conn.maxh2cdata, 0), 152)


def check_never_raises(conn: TcpConnection, raw: bytes, cuts: list[int]):
    pos = i = 0
    closed_seen = False
    while pos < len(raw):
        step = cuts[i % len(cuts)]
        events = conn.receive_data(raw[pos:pos + step])
        pos += step
        i += 1
        errors = [e for e in events if isinstance(e, ProtocolError)]
        if errors:
            assert len(errors) == 1 and events[-1] is errors[0] and not closed_seen
            closed_seen = True
            out = conn.data_to_send()
            assert len(out) == 1 and parse_term(bytes(out[-1]))[1] == errors[0].fes
        pending = len(conn._buf) - conn._pos
        assert 0 <= pending <= max_pdu(conn), pending
    return closed_seen


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.lists(st.integers(1, 200), min_size=1, max_size=8),
       st.sampled_from(DIGESTS), st.booleans())
def test_random_bytes_never_raise(raw, cuts, digests, as_host):
    conn = ready_host(*digests) if as_host else ready_ctrl(*digests, max_incapsule=1024, maxh2cdata=4096)
    check_never_raises(conn, raw, cuts)
    fresh = TcpConnection(Role.HOST if as_host else Role.CONTROLLER, max_incapsule=1024, maxh2cdata=4096)
    check_never_raises(fresh, raw, cuts)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(DIGESTS))
def test_mutated_streams_never_raise(data, digests):
    host, ctrl = pair(*digests, max_incapsule=1024, maxh2cdata=4096)
    raw, _ = stream_of_many(host, ctrl, 12)
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 6))):
        idx = data.draw(st.integers(0, len(raw) - 1))
        raw[idx] = data.draw(st.integers(0, 255))
    cuts = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    check_never_raises(ctrl, bytes(raw), cuts)

    host, ctrl = pair(*digests)
    host.send_command(sqe(1, 0x01), direction=Direction.H2C, data_len=100)
    host.send_command(sqe(3), direction=Direction.C2H, data_len=300)
    host.send_command(sqe(2), direction=Direction.C2H, data_len=50)
    host.data_to_send()
    ctrl.send_r2t(1, 2, 0, 100)
    ctrl.send_c2h_data(3, 0, bytes(300), last=True, success=False)
    ctrl.send_response(cqe(3))
    ctrl.send_c2h_data(2, 0, bytes(50), last=True, success=True)
    ctrl.send_response(cqe(1))
    raw = bytearray(wire(ctrl))
    for _ in range(data.draw(st.integers(1, 4))):
        idx = data.draw(st.integers(0, len(raw) - 1))
        raw[idx] = data.draw(st.integers(0, 255))
    check_never_raises(host, bytes(raw), cuts)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 0xFF), st.integers(0, 0xFF), st.integers(0, 0xFF), st.integers(0, 0xFFFFFFFF))
def test_huge_lengths_never_buffer_beyond_one_header(flags, hlen, pdo, plen):
    for ptype in (4, 6):
        ctrl = ready_ctrl(max_incapsule=1024, maxh2cdata=4096)
        head = struct.pack("<BBBBI", ptype, flags, hlen, pdo, plen) + bytes(16)
        ctrl.receive_data(head)
        if ctrl.state is not State.CLOSED:
            # stream data; the connection either waits for a bounded PDU or gives up
            for _ in range(10):
                ctrl.receive_data(bytes(1000))
                assert len(ctrl._buf) - ctrl._pos <= max_pdu(ctrl)


# ------------------------------------------------------------------ host: commands in flight


def host_with(*cmds, hdgst=False):
    """A READY host with commands (cid, direction, data_len) sent; its output drained."""
    host = ready_host(hdgst)
    for cid, direction, length in cmds:
        host.send_command(sqe(cid), direction=direction, data_len=length)
    host.data_to_send()
    return host


_C2H_READ = (1, Direction.C2H, 8192)
_H2C_WRITE = (2, Direction.H2C, 8192)

# (name, commands in flight, PDU from the controller, FES, FEI, words of the reason)
_BAD_HOST_PDUS = [
    ("c2h_unknown_cid", [_C2H_READ], data_hdr(7, 0, 9, 0, 0, 512) + bytes(512), Fes.INVALID_HEADER_FIELD,
     spec.OFF_CCCID, "C2HData for cid 9, which has no command in flight"),
    ("c2h_for_a_write", [_H2C_WRITE], data_hdr(7, 0, 2, 0, 0, 512) + bytes(512), Fes.INVALID_HEADER_FIELD,
     spec.OFF_CCCID, "a command that reads no data"),
    ("c2h_wrong_offset", [_C2H_READ], data_hdr(7, 0, 1, 0, 512, 512) + bytes(512), Fes.DATA_OUT_OF_RANGE,
     spec.OFF_DATAO, "C2HData for cid 1 at offset 512 length 512: expected offset 0 within a 8192-byte buffer"),
    ("c2h_beyond_the_read", [_C2H_READ], data_hdr(7, 0, 1, 0, 0, 8196) + bytes(8196), Fes.DATA_OUT_OF_RANGE,
     spec.OFF_DATAL, "length 8196"),
    ("r2t_unknown_cid", [_H2C_WRITE], data_hdr(9, 0, 7, 1, 0, 512, pdo=0, plen=24),
     Fes.INVALID_HEADER_FIELD, spec.OFF_CCCID, "R2T for cid 7, which has no command in flight"),
    ("r2t_for_a_read", [_C2H_READ], data_hdr(9, 0, 1, 1, 0, 512, pdo=0, plen=24),
     Fes.INVALID_HEADER_FIELD, spec.OFF_CCCID, "no data to send by R2T"),
    ("r2t_beyond_the_write", [_H2C_WRITE], data_hdr(9, 0, 2, 1, 4096, 8192, pdo=0, plen=24),
     Fes.DATA_OUT_OF_RANGE, spec.OFF_R2TL, "asks offset 4096 length 8192; the command has 8192 bytes"),
    ("rsp_unknown_cid", [_C2H_READ], hdr(5, 0, 24, 0, 24, cqe(4)), Fes.INVALID_HEADER_FIELD,
     spec.OFF_RSP_CID, "CapsuleResp for cid 4, which has no command in flight"),
]


@pytest.mark.parametrize(("name", "cmds", "raw", "fes", "fei", "reason"), _BAD_HOST_PDUS,
                         ids=[r[0] for r in _BAD_HOST_PDUS])
def test_host_checks_data_pdus_against_its_commands(name, cmds, raw, fes, fei, reason):
    _err, echoed = expect_error(host_with(*cmds), raw, fes, fei, reason)
    assert echoed == raw[:24]   # the header in error goes back in the H2CTermReq


def test_host_refuses_a_bad_c2h_from_its_header_alone():
    host = host_with(_C2H_READ)
    [err] = host.receive_data(data_hdr(7, 0, 1, 0, 4096, 4096))
    assert (err.fes, err.fei) == (Fes.DATA_OUT_OF_RANGE, spec.OFF_DATAO)


def test_host_r2t_may_not_ask_again_for_data_already_asked():
    host = host_with(_H2C_WRITE)
    [ev] = host.receive_data(data_hdr(9, 0, 2, 1, 0, 4096, pdo=0, plen=24))
    assert ev == R2TReceived(2, 1, 0, 4096)
    expect_error(host, data_hdr(9, 0, 2, 2, 0, 4096, pdo=0, plen=24), Fes.DATA_OUT_OF_RANGE, spec.OFF_R2TO,
                 "4096 already asked for")


@pytest.mark.parametrize("hd", [False, True])
def test_host_follows_reads_and_retires_answered_commands(hd):
    host, ctrl = pair(hd)
    host.send_command(sqe(1), direction=Direction.C2H, data_len=6000)
    host.send_command(sqe(2), direction=Direction.C2H, data_len=100)
    host.send_command(sqe(3))
    host.data_to_send()
    ctrl.send_c2h_data_split(1, bytes(6000), 4096, success=False)
    ctrl.send_response(cqe(1))
    ctrl.send_c2h_data(2, 0, bytes(100), last=True, success=True)
    ctrl.send_response(cqe(3))
    raw = wire(ctrl)
    kinds = []
    for i in range(len(raw)):    # byte at a time: each header moves its command on once
        kinds += [type(e).__name__ for e in host.receive_data(raw[i:i + 1])]
    assert kinds == ["C2HDataReceived", "C2HDataReceived", "ResponseReceived", "C2HDataReceived",
                     "ResponseReceived"]
    # all three are done: a second answer to any of them is fatal (SUCCESS stood for cid 2's CapsuleResp)
    ctrl.send_response(cqe(2))
    expect_error(host, wire(ctrl), Fes.INVALID_HEADER_FIELD, spec.OFF_RSP_CID, "cid 2")
    # the cid may be used again once answered
    host2 = host_with(_C2H_READ)
    host2.receive_data(hdr(5, 0, 24, 0, 24, cqe(1)))
    host2.send_command(sqe(1), direction=Direction.H2C, data_len=512)
    assert host2.state is State.READY


def test_send_command_data_arguments():
    host = ready_host()
    with pytest.raises(ValueError, match=r"Direction\.H2C or Direction\.C2H"):
        host.send_command(sqe(1), direction=Direction.C2H)
    with pytest.raises(ValueError, match="data_len 512"):
        host.send_command(sqe(1), data_len=512)
    with pytest.raises(ValueError, match="in-capsule"):
        host.send_command(sqe(1), b"x" * 16, direction=Direction.H2C, data_len=16)
    host.send_command(sqe(1))
    with pytest.raises(ValueError, match="cid 1 is still in flight"):
        host.send_command(sqe(1))


# -------------------------------------------------------------------------------- hand-off


def moved(conn: TcpConnection) -> TcpConnection:
    """``conn`` exported, sent through JSON (as to a worker process) and resumed."""
    import json

    state = conn.export_state()
    again = HandoffState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state
    return TcpConnection.resume(again)


@pytest.mark.parametrize(("hdgst", "ddgst"), DIGESTS)
def test_handoff_mid_pdu_carries_the_bytes_and_the_digests(hdgst, ddgst):
    host, ctrl = pair(hdgst, ddgst, max_incapsule=4096)
    host.send_command(sqe(1, 0x01), bytes(range(200)))
    host.send_command(sqe(2))
    raw = wire(host)
    first = 72 + (4 if hdgst else 0) + 200 + (4 if ddgst else 0)
    [ev] = ctrl.receive_data(raw[:first + 30])          # the second capsule is half here
    state = ctrl.export_state()
    assert state.unconsumed == raw[first:first + 30] and (state.hdgst, state.ddgst) == (hdgst, ddgst)
    assert (state.role, state.max_incapsule, state.maxh2cdata) == (Role.CONTROLLER, 4096, ctrl.maxh2cdata)
    new = moved(ctrl)
    assert new.state is State.READY and (new.hdgst, new.ddgst) == (hdgst, ddgst)
    [ev] = new.receive_data(raw[first + 30:])
    assert isinstance(ev, CommandReceived) and bytes(ev.sqe) == sqe(2)
    # what it sends carries the negotiated digests: the host parses and checks it
    host.send_command(sqe(3), direction=Direction.C2H, data_len=64)
    host.data_to_send()
    new.send_c2h_data(3, 0, b"q" * 64, last=True, success=False)
    for cid in (1, 2, 3):
        new.send_response(cqe(cid))
    evs = host.receive_data(wire(new))
    assert [type(e) for e in evs] == [C2HDataReceived] + [ResponseReceived] * 3 and evs[0].digest_ok
    # its limits came along: in-capsule data above 4096 bytes is refused
    host.send_command(sqe(4, 0x01), bytes(4097))
    expect_error(new, b"".join(bytes(b) for b in host.data_to_send())[:8], Fes.DATA_LIMIT_EXCEEDED, 0)
    # the old connection is untouched: a hand-off that is given up goes on there
    [ev] = ctrl.receive_data(raw[first + 30:])
    assert bytes(ev.sqe) == sqe(2)


def test_handoff_carries_outstanding_r2ts():
    host, ctrl = pair()
    ctrl.send_r2t(5, 9, 0, 8192)
    ctrl.data_to_send()
    new = moved(ctrl)
    host.send_h2c_data(5, 9, 0, bytes(4096), last=False)
    [ev] = new.receive_data(wire(host))
    assert (ev.cccid, ev.ttag, ev.offset) == (5, 9, 0)
    host.send_h2c_data(5, 9, 0, bytes(4096), last=True)     # the R2T moved on: offset 0 again is bad
    expect_error(new, wire(host), Fes.DATA_OUT_OF_RANGE, spec.OFF_DATAO)


def test_handoff_of_a_host_carries_its_commands():
    host, ctrl = pair(True, True)
    host.send_command(sqe(1), direction=Direction.C2H, data_len=8192)
    host.data_to_send()
    ctrl.send_c2h_data(1, 0, bytes(4096), last=False, success=False)
    ctrl.send_c2h_data(1, 4096, bytes(4096), last=True, success=True)
    raw = wire(ctrl)
    [ev] = host.receive_data(raw[:4096 + 32 + 10])
    state = host.export_state()
    assert state.role is Role.HOST and state.commands == ((1, Direction.C2H, 4096, 8192),)
    new = moved(host)
    [ev] = new.receive_data(raw[4096 + 32 + 10:])
    assert (ev.offset, ev.success, ev.digest_ok) == (4096, True, True)
    assert new.export_state().commands == ()


def test_handoff_refused_where_it_is_not_safe():
    fresh = TcpConnection(Role.CONTROLLER)
    with pytest.raises(HandoffRefused, match="await-ic, not ready"):
        fresh.export_state()
    fresh.receive_data(ICREQ)
    with pytest.raises(HandoffRefused, match="ic-pending"):
        fresh.export_state()
    closed = ready_ctrl()
    closed.send_term_req(Fes.PDU_SEQUENCE_ERROR)
    with pytest.raises(HandoffRefused, match="closed"):
        closed.export_state()
    # output not taken yet
    host, ctrl = pair()
    ctrl.send_response(cqe(1))
    with pytest.raises(HandoffRefused, match="data_to_send"):
        ctrl.export_state()
    ctrl.data_to_send()
    # an H2CData whose header was checked (its R2T moved on) but whose data is not all in
    ctrl.send_r2t(5, 9, 0, 8192)
    ctrl.data_to_send()
    host.send_h2c_data(5, 9, 0, bytes(8192), last=True)
    raw = wire(host)
    assert ctrl.receive_data(raw[:100]) == []
    with pytest.raises(HandoffRefused, match="H2C_DATA PDU is half received"):
        ctrl.export_state()
    assert [type(e) for e in ctrl.receive_data(raw[100:])] == [H2CDataReceived]
    ctrl.export_state()   # at the PDU boundary again
    # a payload being placed directly
    ctrl.send_r2t(6, 10, 0, 64 * 1024)
    ctrl.data_to_send()
    ctrl.place = lambda cccid, ttag, datao, datal: memoryview(bytearray(datal))
    host.send_h2c_data(6, 10, 0, bytes(64 * 1024), last=True)
    ctrl.receive_data(wire(host)[:1000])
    assert ctrl.direct_buffer() is not None
    with pytest.raises(HandoffRefused, match="placed directly"):
        ctrl.export_state()


def test_resume_refuses_another_protocol_version():
    state = ready_ctrl().export_state()
    with pytest.raises(ValueError, match="pfv 1"):
        TcpConnection.resume(HandoffState.from_dict({**state.to_dict(), "pfv": 1}))
