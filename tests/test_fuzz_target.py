"""Malformed NVMe/TCP input against a live target over TCP on 127.0.0.1.

Two parts: a table with one row per malformation the target defines, each with the exact C2HTermReq
FES/FEI and the log line it must produce; and a hypothesis fuzz test that mutates valid PDU streams
(admin and I/O) and checks, per example, that the target answered with well-formed PDUs or a
C2HTermReq followed by a close, raised nothing into the event loop, stayed within a memory bound,
left no controller, queue or task behind, and still served a well-behaved host correctly.

The fuzz test is deterministic by default (hypothesis ``derandomize=True``: the same examples every
run, so CI failures reproduce). Environment variables for a longer or a fresh hunt:

- ``NVMEOF_FUZZ_EXAMPLES=1000``: examples per run (default 150);
- ``NVMEOF_FUZZ_RANDOM=1``: random examples, a new set each run; a failure prints its case and a
  ``@reproduce_failure`` blob to replay it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import random
import tracemalloc
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from raw_pdu import (
    C2H,
    C2H_TERM,
    R2T,
    RSP,
    SUBNQN,
    RawPeer,
    Served,
    admin_host,
    capsule_cmd,
    connect_pdu,
    good_host_roundtrip,
    h2c_data,
    h2c_term_req,
    icreq,
    serve,
    set_byte,
    set_le32,
    sqe,
    wait_until,
)

from nvmeof import defaults
from nvmeof.auth import DhchapSecret, HostTransaction, generate_secret
from nvmeof.crc32c import digest_bytes
from nvmeof.spec import tcp as spec
from nvmeof.spec.fabrics import Property
from nvmeof.spec.nvme import AdminOpcode, Command, FabricsType, IoOpcode
from nvmeof.spec.tcp import FatalErrorStatus as Fes
from nvmeof.status import Status

CC_ENABLE = (6 << 16) | (4 << 20)


def _prop_get_sqe(cid: int, offset: int = Property.CSTS, size8: bool = False) -> bytes:
    return sqe(Command(AdminOpcode.FABRICS, nsid=FabricsType.PROPERTY_GET, cdw10=int(size8), cdw11=offset),
               cid=cid)


def _prop_set_sqe(cid: int, offset: int, value: int) -> bytes:
    return sqe(Command(AdminOpcode.FABRICS, nsid=FabricsType.PROPERTY_SET, cdw11=offset, cdw12=value), cid=cid)


def _write_sqe(cid: int, slba: int, length: int, *, incapsule: bool) -> bytes:
    return sqe(Command(IoOpcode.WRITE, nsid=1, cdw10=slba, cdw12=length // 512 - 1), cid=cid, data_len=length,
               incapsule=incapsule)


def _read_sqe(cid: int, slba: int, length: int) -> bytes:
    return sqe(Command(IoOpcode.READ, nsid=1, cdw10=slba, cdw12=length // 512 - 1), cid=cid, data_len=length)


# ============================================================================ the malformation table

R2T_CID = 5
R2T_LEN = 8192


@dataclass
class Ctx:
    hdgst: bool = False
    ddgst: bool = False
    ttag: int = -1


@dataclass
class Row:
    name: str
    setup: str          # none | ic | ic_hd | ic_dd | r2t
    build: object       # Ctx -> bytes
    fes: int
    fei: int
    log: str


def _pg(c: Ctx) -> bytes:
    return capsule_cmd(_prop_get_sqe(1), hdgst=c.hdgst, ddgst=c.ddgst)


def _incapsule_write(c: Ctx, *, hdgst: bool | None = None, ddgst: bool | None = None) -> bytes:
    return capsule_cmd(_write_sqe(2, 0, 512, incapsule=True), b"\xa5" * 512,
                       hdgst=c.hdgst if hdgst is None else hdgst, ddgst=c.ddgst if ddgst is None else ddgst)


def _bad_hdgst(c: Ctx) -> bytes:
    pdu = bytearray(_pg(c))
    pdu[72] ^= 0xFF
    return bytes(pdu)


def _h2c(c: Ctx, *, cccid: int = R2T_CID, ttag: int | None = None, offset: int = 0, length: int = R2T_LEN,
         last: bool = True) -> bytes:
    return h2c_data(cccid, c.ttag if ttag is None else ttag, offset, bytes([7]) * length, last=last,
                    hdgst=c.hdgst, ddgst=c.ddgst)


def _header_only(pdu: bytes, plen: int, datal_at: int | None = None, datal: int = 0) -> bytes:
    hdr = set_le32(pdu[:pdu[2]], 4, plen)
    return set_le32(hdr, datal_at, datal) if datal_at is not None else hdr


_ROWS = [
    # initialize connection
    Row("icreq_pfv", "none", lambda c: icreq(pfv=1), Fes.UNSUPPORTED_PARAMETER, spec.OFF_PFV,
        "ICREQ pfv 1 is not supported"),
    Row("icreq_hpda", "none", lambda c: icreq(hpda=2), Fes.UNSUPPORTED_PARAMETER, spec.OFF_PDA,
        "ICREQ hpda 2 is not supported"),
    Row("icreq_hlen", "none", lambda c: icreq(hlen=127), Fes.INVALID_HEADER_FIELD, spec.OFF_HLEN,
        "ICREQ hlen 127, expected 128"),
    Row("icreq_plen", "none", lambda c: icreq(plen=4096), Fes.INVALID_HEADER_FIELD, spec.OFF_PLEN,
        "ICREQ plen 4096, expected 128"),
    Row("capsule_before_icreq", "none", _pg, Fes.PDU_SEQUENCE_ERROR, 0,
        "CAPSULE_CMD is not expected by the controller in state await-ic"),
    # PDU types
    Row("unknown_type", "ic", lambda c: bytes([0x0A, 0, 24, 0]) + (24).to_bytes(4, "little") + bytes(16),
        Fes.INVALID_HEADER_FIELD, spec.OFF_TYPE, "unknown PDU type 0x0a"),
    Row("type_0xff", "ic", lambda c: bytes([0xFF, 0, 24, 0]) + (0xFFFFFFFF).to_bytes(4, "little"),
        Fes.INVALID_HEADER_FIELD, spec.OFF_TYPE, "unknown PDU type 0xff"),
    Row("second_icreq", "ic", lambda c: icreq(), Fes.PDU_SEQUENCE_ERROR, 0,
        "ICREQ is not expected by the controller in state ready"),
    Row("c2h_data_from_host", "ic", lambda c: set_byte(_h2c(c, ttag=0), 0, C2H), Fes.PDU_SEQUENCE_ERROR, 0,
        "C2H_DATA is not expected by the controller"),
    Row("capsule_resp_from_host", "ic", lambda c: bytes([RSP, 0, 24, 0]) + (24).to_bytes(4, "little") + bytes(16),
        Fes.PDU_SEQUENCE_ERROR, 0, "CAPSULE_RESP is not expected by the controller"),
    Row("r2t_from_host", "ic", lambda c: spec.DATA_PDU_HDR.pack(R2T, 0, 24, 0, 24, 1, 0, 0, 512),
        Fes.PDU_SEQUENCE_ERROR, 0, "R2T is not expected by the controller"),
    Row("c2h_term_from_host", "ic", lambda c: set_byte(h2c_term_req(1), 0, C2H_TERM), Fes.PDU_SEQUENCE_ERROR, 0,
        "C2H_TERM_REQ is not expected by the controller"),
    Row("term_req_plen", "ic", lambda c: set_le32(h2c_term_req(1), 4, 200) + bytes(176),
        Fes.INVALID_HEADER_FIELD, spec.OFF_PLEN, "H2C_TERM_REQ plen 200 outside 24..152"),
    # CapsuleCmd framing
    Row("capsule_hlen", "ic", lambda c: set_byte(_pg(c), 2, 71), Fes.INVALID_HEADER_FIELD, spec.OFF_HLEN,
        "CAPSULE_CMD hlen 71, expected 72"),
    Row("capsule_pdo_inside_header", "ic", lambda c: set_byte(_incapsule_write(c), 3, 64),
        Fes.INVALID_HEADER_FIELD, spec.OFF_PDO, "CAPSULE_CMD pdo 64, expected 72"),
    Row("capsule_plen_short", "ic", lambda c: set_le32(_pg(c), 4, 70), Fes.INVALID_HEADER_FIELD, spec.OFF_PLEN,
        "CAPSULE_CMD plen 70 shorter than its header (72)"),
    Row("capsule_plen_huge", "ic", lambda c: _header_only(_incapsule_write(c), 0xFFFFFFFF),
        Fes.DATA_LIMIT_EXCEEDED, 0, "CAPSULE_CMD carries 4294967223 bytes of in-capsule data, more than 8192"),
    Row("capsule_incapsule_over_limit", "ic",
        lambda c: _header_only(_incapsule_write(c), 72 + defaults.IO_INCAPSULE_SIZE + 1),
        Fes.DATA_LIMIT_EXCEEDED, 0, "CAPSULE_CMD carries 8193 bytes of in-capsule data"),
    # digests
    Row("capsule_no_hdgstf", "ic_hd", lambda c: capsule_cmd(_prop_get_sqe(1)), Fes.INVALID_HEADER_FIELD,
        spec.OFF_FLAGS, "CAPSULE_CMD without HDGSTF although header digest was negotiated"),
    Row("capsule_unexpected_hdgstf", "ic", lambda c: capsule_cmd(_prop_get_sqe(1), hdgst=True),
        Fes.INVALID_HEADER_FIELD, spec.OFF_FLAGS, "CAPSULE_CMD has HDGSTF but header digest was not negotiated"),
    Row("capsule_bad_hdgst", "ic_hd", _bad_hdgst, Fes.HEADER_DIGEST_ERROR, 0, "CAPSULE_CMD header digest"),
    Row("capsule_unexpected_ddgstf", "ic", lambda c: _incapsule_write(c, ddgst=True), Fes.INVALID_HEADER_FIELD,
        spec.OFF_FLAGS, "CAPSULE_CMD has DDGSTF but data digest was not negotiated"),
    Row("capsule_no_ddgstf", "ic_dd", lambda c: _incapsule_write(c, ddgst=False), Fes.INVALID_HEADER_FIELD,
        spec.OFF_FLAGS, "CAPSULE_CMD carries data without DDGSTF although data digest was negotiated"),
    # H2CData against an outstanding R2T (cid 5, 8192 bytes)
    Row("h2c_unknown_ttag", "r2t", lambda c: _h2c(c, ttag=c.ttag + 1), Fes.INVALID_HEADER_FIELD, spec.OFF_TTAG,
        "which no outstanding R2T carries"),
    Row("h2c_without_r2t", "ic", lambda c: _h2c(c, ttag=0), Fes.INVALID_HEADER_FIELD, spec.OFF_TTAG,
        "H2CData with ttag 0, which no outstanding R2T carries"),
    Row("h2c_wrong_cccid", "r2t", lambda c: _h2c(c, cccid=R2T_CID + 1), Fes.INVALID_HEADER_FIELD, spec.OFF_CCCID,
        f"H2CData cccid {R2T_CID + 1} but ttag"),
    Row("h2c_wrong_offset", "r2t", lambda c: _h2c(c, offset=512, length=4096, last=False),
        Fes.DATA_OUT_OF_RANGE, spec.OFF_DATAO, f"H2CData offset 512 for command {R2T_CID}; expected 0"),
    Row("h2c_beyond_r2t", "r2t", lambda c: _h2c(c, length=R2T_LEN + 512), Fes.DATA_OUT_OF_RANGE, spec.OFF_DATAL,
        f"does not fit its R2T of {R2T_LEN} bytes"),
    Row("h2c_last_too_early", "r2t", lambda c: _h2c(c, length=4096, last=True), Fes.DATA_OUT_OF_RANGE,
        spec.OFF_DATAL, "H2CData 0+4096 (LAST)"),
    Row("h2c_datal_zero", "r2t", lambda c: set_le32(_h2c(c, length=512), 16, 0), Fes.INVALID_HEADER_FIELD,
        spec.OFF_DATAL, "H2C_DATA with datal 0"),
    Row("h2c_datal_disagrees", "r2t", lambda c: set_le32(_h2c(c, length=512), 16, 1024), Fes.INVALID_HEADER_FIELD,
        spec.OFF_DATAL, "H2C_DATA datal 1024 disagrees with plen 536"),
    Row("h2c_over_maxh2cdata", "r2t",
        lambda c: _header_only(_h2c(c, length=512), 24 + defaults.MAXH2CDATA + 4, 16, defaults.MAXH2CDATA + 4),
        Fes.DATA_LIMIT_EXCEEDED, 0, f"H2C_DATA datal {defaults.MAXH2CDATA + 4} exceeds MAXH2CDATA"),
    Row("h2c_datal_huge", "r2t", lambda c: _header_only(_h2c(c, length=512), 0xFFFFFFFF, 16, 0xFFFFFFFF - 24),
        Fes.DATA_LIMIT_EXCEEDED, 0, "exceeds MAXH2CDATA"),
    Row("h2c_pdo_wrong", "r2t", lambda c: set_byte(_h2c(c), 3, 28), Fes.INVALID_HEADER_FIELD, spec.OFF_PDO,
        "H2C_DATA pdo 28, expected 24"),
    Row("h2c_hlen_wrong", "r2t", lambda c: set_byte(_h2c(c), 2, 20), Fes.INVALID_HEADER_FIELD, spec.OFF_HLEN,
        "H2C_DATA hlen 20, expected 24"),
]


@pytest.fixture
async def served():
    s = await serve()
    yield s
    await s.target.close()


async def _raw_setup(s: Served, setup: str, cntlid: int) -> tuple[RawPeer, Ctx]:
    ctx = Ctx(hdgst=setup == "ic_hd", ddgst=setup in ("ic_dd", "r2t_dd"))
    peer = await RawPeer.open(s.port)
    if setup == "none":
        return peer, ctx
    await peer.handshake(hdgst=ctx.hdgst, ddgst=ctx.ddgst)
    if setup.startswith("r2t"):
        cqe = await peer.command(connect_pdu(1, SUBNQN, qid=1, cntlid=cntlid, ddgst=ctx.ddgst), 1)
        assert cqe.status_code == 0, cqe
        await peer.send(capsule_cmd(_write_sqe(R2T_CID, 0, R2T_LEN, incapsule=False), ddgst=ctx.ddgst))
        assert await peer.wait_for(lambda o: o.r2t(R2T_CID), 5)
        r2t = peer.out.r2t(R2T_CID)
        assert r2t is not None and r2t.fields["length"] == R2T_LEN and r2t.fields["offset"] == 0
        ctx.ttag = r2t.fields["ttag"]
    return peer, ctx


@pytest.mark.parametrize("row", _ROWS, ids=[r.name for r in _ROWS])
async def test_malformed_pdu_gets_exact_term_req(served, row: Row, caplog):
    s = served
    caplog.set_level(logging.INFO)
    admin, cntlid = await admin_host(s.port)
    peer, ctx = await _raw_setup(s, row.setup, cntlid)
    pdu = row.build(ctx)  # type: ignore[operator]
    await peer.send(pdu)
    assert await peer.wait_for(lambda o: False, 5)
    assert not peer.out.errors, peer.out.errors
    term = peer.out.term
    assert term is not None, f"no C2HTermReq; got {[p.kind for p in peer.out.pdus]}"
    assert (term.fields["fes"], term.fields["fei"]) == (row.fes, row.fei), term.fields
    # The TermReq's data, when present, is the start of the PDU we sent (the header in error).
    data = term.fields["data"]
    assert len(data) <= spec.TERM_REQ_MAX_DATA and pdu.startswith(data)
    assert await peer.wait_eof(2), "the target did not close the connection after its C2HTermReq"
    assert row.log in caplog.text, caplog.text
    # Only that connection went away: the admin controller and its queue are intact and serve.
    await wait_until(lambda: len(s.server.connections) == 1, what="the bad connection to go")
    assert list(s.target.controllers) == [cntlid]
    assert list(s.target.controllers[cntlid].queues) == [0]
    res = await admin.prop_get(Property.CSTS)
    assert res.status == 0 and res.cqe.dw0 & 1
    admin.close()
    await wait_until(lambda: not s.target.controllers, what="teardown")


async def test_huge_lengths_answered_before_any_data(served):
    """A header claiming 4 GiB is refused from its 8 + hlen bytes: the target never waits for the data."""
    s = served
    for pdu in (_header_only(_incapsule_write(Ctx()), 0xFFFFFFFF),
                _header_only(h2c_data(1, 0, 0, bytes(512), last=True), 0xFFFFFFFF, 16, 0xFFFFFFFF - 24)):
        peer = await RawPeer.open(s.port)
        await peer.handshake()
        await peer.send(pdu)
        assert await peer.wait_for(lambda o: False, 2)
        assert peer.out.term is not None and peer.out.term.fields["fes"] == Fes.DATA_LIMIT_EXCEEDED
        assert await peer.wait_eof(2)


@pytest.mark.parametrize("where", ["in-capsule", "h2c"])
async def test_bad_data_digest_fails_the_command_not_the_connection(served, where, caplog):
    s = served
    caplog.set_level(logging.INFO)
    admin, cntlid = await admin_host(s.port)
    peer = await RawPeer.open(s.port)
    await peer.handshake(ddgst=True)
    assert (await peer.command(connect_pdu(1, SUBNQN, qid=1, cntlid=cntlid, ddgst=True), 1)).status_code == 0
    data = os.urandom(4096)
    if where == "in-capsule":
        pdu = capsule_cmd(_write_sqe(2, 0, 4096, incapsule=True), data, ddgst=True)
        await peer.send(pdu[:-4] + bytes(b ^ 0xFF for b in pdu[-4:]))
    else:
        await peer.send(capsule_cmd(_write_sqe(2, 0, 4096, incapsule=False), ddgst=True))
        assert await peer.wait_for(lambda o: o.r2t(2), 5)
        ttag = peer.out.r2t(2).fields["ttag"]  # type: ignore[union-attr]
        pdu = h2c_data(2, ttag, 0, data, last=True, ddgst=True)
        await peer.send(pdu[:-4] + bytes(b ^ 0xFF for b in pdu[-4:]))
    assert await peer.wait_for(lambda o: o.done(2), 5)
    cqe = peer.out.cqe(2)
    assert cqe is not None and cqe.status_code == Status.TRANSIENT_TR_ERR and not cqe.dnr, cqe
    assert "failed its data digest" in caplog.text
    # The queue is still usable: the retried write lands and reads back.
    cqe = await peer.command(capsule_cmd(_write_sqe(3, 0, 4096, incapsule=True), data, ddgst=True), 3)
    assert cqe.status_code == 0
    await peer.send(capsule_cmd(_read_sqe(4, 0, 4096), ddgst=True))
    assert await peer.wait_for(lambda o: o.done(4), 5)
    assert peer.out.read_data(4) == data and peer.out.term is None and not peer.out.errors
    await peer.close()
    admin.close()


# ======================================================================================= the fuzzer

FUZZ_EXAMPLES = int(os.environ.get("NVMEOF_FUZZ_EXAMPLES", "150"))   # raise it for a longer hunt
FUZZ_RANDOM = os.environ.get("NVMEOF_FUZZ_RANDOM", "") not in ("", "0")   # fresh examples each run
EXAMPLE_TIMEOUT = 10.0
MEMORY_BOUND = 16 << 20     # peak traced allocations per example, far above one MDTS (1 MiB) of data
GOOD_SLBA = 1024            # the well-behaved host's region; the fuzzed streams write from LBA 0


@dataclass
class Step:
    build: object            # TargetOutput -> bytes (an H2CData needs the ttag of the R2T it answers)
    wait: object = None      # TargetOutput -> bool: the answer the unmutated stream gets for this PDU
    pdu: bytes = b""


@dataclass
class Stream:
    steps: list[Step]
    expect: object           # TargetOutput -> None, asserts the unmutated stream's answers
    truncated: bool = False


def _cqe_ok(out, cid: int) -> None:  # type: ignore[no-untyped-def]
    cqe = out.cqe(cid)
    assert cqe is not None and cqe.status_code == 0, (cid, cqe)


def _io_stream(cntlid: int, hd: bool, dd: bool, seed: int) -> Stream:
    small = seed.to_bytes(4, "little") * 1024                  # 4 KiB in-capsule, LBA 0
    big = random.Random(seed).randbytes(64 * 1024)              # 64 KiB via R2T, LBA 8, two H2CData

    def ttag(out) -> int:  # type: ignore[no-untyped-def]
        r2t = out.r2t(3)
        return r2t.fields["ttag"] if r2t is not None else 0

    steps = [
        Step(lambda out: icreq(hdgst=hd, ddgst=dd), lambda out: out.of_kind("icresp")),
        Step(lambda out: connect_pdu(1, SUBNQN, qid=1, cntlid=cntlid, hdgst=hd, ddgst=dd), lambda out: out.done(1)),
        Step(lambda out: capsule_cmd(_write_sqe(2, 0, 4096, incapsule=True), small, hdgst=hd, ddgst=dd),
             lambda out: out.done(2)),
        Step(lambda out: capsule_cmd(_write_sqe(3, 8, len(big), incapsule=False), hdgst=hd, ddgst=dd),
             lambda out: out.r2t(3) or out.done(3)),
        Step(lambda out: h2c_data(3, ttag(out), 0, big[:32768], last=False, hdgst=hd, ddgst=dd)),
        Step(lambda out: h2c_data(3, ttag(out), 32768, big[32768:], last=True, hdgst=hd, ddgst=dd),
             lambda out: out.done(3)),
        Step(lambda out: capsule_cmd(_read_sqe(4, 0, 4096 + len(big)), hdgst=hd, ddgst=dd), lambda out: out.done(4)),
        Step(lambda out: capsule_cmd(sqe(Command(IoOpcode.FLUSH, nsid=1), cid=5), hdgst=hd, ddgst=dd),
             lambda out: out.done(5)),
    ]

    def expect(out) -> None:  # type: ignore[no-untyped-def]
        icresp = out.of_kind("icresp")[0]
        assert icresp.fields["dgst"] == (1 if hd else 0) | (2 if dd else 0)
        for cid in (1, 2, 3, 5):
            _cqe_ok(out, cid)
        r2t = out.r2t(3)
        assert r2t is not None and (r2t.fields["offset"], r2t.fields["length"]) == (0, len(big))
        assert out.read_data(4) == small + big
        assert out.done(4) and (out.cqe(4) is None or out.cqe(4).status_code == 0)
    return Stream(steps, expect)


# DH-HMAC-CHAP (issue 13): an admin queue of a host that must authenticate, on its own subsystem
AUTH_SUBNQN = "nqn.2026-01.com.example:fuzz-auth"
AUTH_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-2222-3333-4444-555555555555"
AUTH_KEY = generate_secret(hmac_id=1, nqn=AUTH_HOSTNQN)
AUTH_CTRL_KEY = generate_secret(key_len=48)
AUTH_CDW10 = (0xE9 << 24) | (0x01 << 16) | (0x01 << 8)   # SECP DH-HMAC-CHAP, SPSP1 1, SPSP0 1
AUTH_AL = 4096


def _auth_send_sqe(cid: int, length: int) -> bytes:
    return sqe(Command(AdminOpcode.FABRICS, nsid=FabricsType.AUTH_SEND, cdw10=AUTH_CDW10, cdw11=length), cid=cid,
               data_len=length, incapsule=True)


def _auth_receive_sqe(cid: int) -> bytes:
    return sqe(Command(AdminOpcode.FABRICS, nsid=FabricsType.AUTH_RECEIVE, cdw10=AUTH_CDW10, cdw11=AUTH_AL), cid=cid,
               data_len=AUTH_AL)


def _auth_stream(hd: bool, dd: bool, seed: int) -> Stream:
    """Connect, Negotiate, Challenge, Reply, Success1 (and Success2 when bidirectional), then a command
    the gate lets through only now. Each Send is built from what the controller answered (the host's
    transaction reads the Challenge), so mutations reach every step of the protocol."""
    bidirectional = bool(seed & 1)
    txn = HostTransaction(hostnqn=AUTH_HOSTNQN, subnqn=AUTH_SUBNQN, qid=0, host_secret=DhchapSecret.parse(AUTH_KEY),
                          ctrl_secret=DhchapSecret.parse(AUTH_CTRL_KEY) if bidirectional else None,
                          hashes=((seed >> 1) % 3 + 1,), dhgroups=((0,), (1,))[(seed >> 3) & 1],
                          seqnum=seed | 1, t_id=seed & 0xFFFF)
    built: dict[int, bytes] = {}

    def send(cid: int, after: int | None) -> Step:
        def build(out) -> bytes:  # type: ignore[no-untyped-def]
            if cid not in built:   # once: a duplicated step sends the same bytes again (a replay)
                try:
                    if after is not None:
                        txn.receive(out.read_data(after))
                    built[cid] = txn.next_send() or bytes(16)
                except Exception:   # the controller's answer was mutated away: send what a lost host would
                    built[cid] = bytes(16)
            return capsule_cmd(_auth_send_sqe(cid, len(built[cid])), built[cid], hdgst=hd, ddgst=dd)
        return Step(build, lambda out: out.done(cid))

    def receive(cid: int) -> Step:
        return Step(lambda out: capsule_cmd(_auth_receive_sqe(cid), hdgst=hd, ddgst=dd), lambda out: out.done(cid))

    steps = [
        Step(lambda out: icreq(hdgst=hd, ddgst=dd), lambda out: out.of_kind("icresp")),
        Step(lambda out: connect_pdu(1, AUTH_SUBNQN, qid=0, hostnqn=AUTH_HOSTNQN, hdgst=hd, ddgst=dd),
             lambda out: out.done(1)),
        send(2, None),          # AUTH_Negotiate
        receive(3),             # DH-HMAC-CHAP_Challenge
        send(4, 3),             # DH-HMAC-CHAP_Reply
        receive(5),             # DH-HMAC-CHAP_Success1
    ]
    last = [1, 2, 3, 4, 5]
    if bidirectional:
        steps.append(send(6, 5))   # DH-HMAC-CHAP_Success2
        last.append(6)
    steps.append(Step(lambda out: capsule_cmd(_prop_get_sqe(7, Property.CAP, size8=True), hdgst=hd, ddgst=dd),
                      lambda out: out.done(7)))
    last.append(7)

    def expect(out) -> None:  # type: ignore[no-untyped-def]
        for cid in last:
            _cqe_ok(out, cid)
        assert out.cqe(1).dw0 & (1 << 17), "Connect without AUTHREQ.ATR for a host with a key"
        if not bidirectional:
            txn.receive(out.read_data(5))
        assert txn.authenticated, txn.state
    return Stream(steps, expect)


def _admin_stream(hd: bool, dd: bool) -> Stream:
    def cmd(cid: int, raw: bytes, data: bytes | None = None) -> Step:
        return Step(lambda out: capsule_cmd(raw, data, hdgst=hd, ddgst=dd), lambda out: out.done(cid))

    identify = sqe(Command(AdminOpcode.IDENTIFY, cdw10=1), cid=6, data_len=4096)
    features = sqe(Command(AdminOpcode.SET_FEATURES, cdw10=0x07, cdw11=(1 << 16) | 1), cid=7)
    smart = sqe(Command(AdminOpcode.GET_LOG_PAGE, cdw10=0x02 | ((512 // 4 - 1) << 16)), cid=8, data_len=512)
    steps = [
        Step(lambda out: icreq(hdgst=hd, ddgst=dd), lambda out: out.of_kind("icresp")),
        Step(lambda out: connect_pdu(1, SUBNQN, qid=0, hdgst=hd, ddgst=dd), lambda out: out.done(1)),
        cmd(2, _prop_get_sqe(2, Property.CAP, size8=True)),
        cmd(3, _prop_set_sqe(3, Property.CC, CC_ENABLE)),
        cmd(4, _prop_set_sqe(4, Property.CC, CC_ENABLE | 1)),
        cmd(5, _prop_get_sqe(5, Property.CSTS)),
        cmd(6, identify),
        cmd(7, features),
        cmd(8, smart),
        cmd(9, sqe(Command(AdminOpcode.KEEP_ALIVE), cid=9)),
    ]

    def expect(out) -> None:  # type: ignore[no-untyped-def]
        for cid in range(1, 10):
            _cqe_ok(out, cid)
        assert out.cqe(5).dw0 & 1, "CSTS.RDY after CC.EN"
        assert len(out.read_data(6)) == 4096 and len(out.read_data(8)) == 512
    return Stream(steps, expect)


# Mutations: (op, step index, ...). Indices wrap around the stream's length.
_idx = st.integers(0, 15)
_len32 = st.one_of(st.sampled_from([0, 1, 7, 8, 23, 24, 25, 71, 72, 76, 128, 152, 4096, 8264, 0x20018, 0xFFFF,
                                    0x7FFFFFFF, 0xFFFFFFFF]), st.integers(0, 0xFFFFFFFF))
MUTATION = st.one_of(
    st.tuples(st.just("flip"), _idx, st.integers(0, 8 * 132 - 1)),
    st.tuples(st.just("byte"), _idx, st.sampled_from([0, 1, 2, 3]), st.integers(0, 255)),
    st.tuples(st.just("type"), _idx, st.sampled_from([0x08, 0x0A, 0x0B, 0x10, 0x7F, 0x80, 0xFF])),
    st.tuples(st.just("plen"), _idx, _len32),
    st.tuples(st.just("le32"), _idx, st.integers(8, 68), _len32),
    st.tuples(st.just("hdgst"), _idx, st.integers(0, 31)),
    st.tuples(st.just("ddgst"), _idx, st.integers(0, 31)),
    st.tuples(st.just("truncate"), _idx, st.integers(0, 1 << 17)),
    st.tuples(st.just("swap"), _idx, _idx),
    st.tuples(st.just("dup"), _idx),
    st.tuples(st.just("drop"), _idx),
    st.tuples(st.just("garbage"), _idx, st.binary(min_size=1, max_size=160)),
    st.tuples(st.just("term"), _idx, st.integers(0, 7)),
    # A byte of the data (Connect data, in-capsule or H2C data) with the data digest made to match,
    # so the change reaches the command instead of failing the digest.
    st.tuples(st.just("data"), _idx, st.integers(0, 1 << 17), st.integers(0, 255)),
)


@dataclass
class Case:
    kind: str
    hdgst: bool
    ddgst: bool
    mutations: list[tuple]
    chunks: list[int]
    abort: bool
    seed: int = 0
    notes: list[str] = field(default_factory=list)


CASE = st.builds(
    Case,
    kind=st.sampled_from(["io", "admin", "auth"]),
    hdgst=st.booleans(),
    ddgst=st.booleans(),
    # One example in eight is the valid stream, checked answer by answer.
    mutations=st.sampled_from([True] * 7 + [False]).flatmap(
        lambda mutate: st.lists(MUTATION, min_size=1, max_size=4) if mutate else st.just([])),
    chunks=st.one_of(st.just([]), st.lists(st.integers(1, 100), min_size=1, max_size=8)),
    abort=st.booleans(),
    seed=st.integers(0, 0xFFFFFFFF),
)


def _mutate(pdu: bytes, m: tuple) -> bytes:
    op = m[0]
    buf = bytearray(pdu)
    if not buf:
        return pdu
    hlen = min(len(buf), max(8, buf[2] if len(buf) > 2 else 8))
    hd = 4 if len(buf) > 1 and buf[1] & spec.HDGSTF else 0
    if op == "flip":
        bit = m[2] % (8 * min(len(buf), hlen + hd))
        buf[bit // 8] ^= 1 << (bit % 8)
    elif op == "byte" and len(buf) > m[2]:
        buf[m[2]] = m[3]
    elif op == "type":
        buf[0] = m[2]
    elif op == "plen" and len(buf) >= 8:
        buf[4:8] = m[2].to_bytes(4, "little")
    elif op == "le32" and len(buf) >= m[2] + 4:
        buf[m[2]:m[2] + 4] = m[3].to_bytes(4, "little")
    elif op == "hdgst":
        if hd and len(buf) >= hlen + 4:
            buf[hlen + m[2] // 8 % 4] ^= 1 << (m[2] % 8)
        else:
            buf[1] ^= spec.HDGSTF
    elif op == "data" and len(buf) > 3 and buf[3] and buf[3] < len(buf):
        pdo = buf[3]
        end = len(buf) - (4 if buf[1] & spec.DDGSTF else 0)
        if end > pdo:
            buf[pdo + m[2] % (end - pdo)] = m[3]
            if end < len(buf):
                buf[end:] = digest_bytes(bytes(buf[pdo:end]))
    elif op == "ddgst" and len(buf) > 1:
        if buf[1] & spec.DDGSTF:
            buf[-1 - m[2] // 8 % 4] ^= 1 << (m[2] % 8)
        else:
            buf[1] ^= spec.DDGSTF
    return bytes(buf)


_PER_PDU = {"flip", "byte", "type", "plen", "le32", "hdgst", "ddgst", "data"}


def _apply(stream: Stream, mutations: list[tuple]) -> Stream:
    steps = list(stream.steps)
    per_pdu: dict[int, list[tuple]] = {}
    for m in mutations:
        i = m[1] % len(steps)
        op = m[0]
        if op in _PER_PDU:
            per_pdu.setdefault(id(steps[i]), []).append(m)
        elif op == "truncate":
            victim = steps[i]
            steps = steps[:i + 1]
            steps[i] = Step(victim.build, None)
            per_pdu.setdefault(id(steps[i]), []).append(m)
            stream.truncated = True
        elif op == "swap":
            j = m[2] % len(steps)
            steps[i], steps[j] = steps[j], steps[i]
        elif op == "dup":
            steps.insert(i, Step(steps[i].build, None))
        elif op == "drop" and len(steps) > 1:
            del steps[i]
        elif op == "garbage":
            steps.insert(i, Step(lambda out, g=m[2]: g))
        elif op == "term":
            steps.insert(i, Step(lambda out, f=m[2]: h2c_term_req(f, 0)))
    for step in steps:
        muts = per_pdu.get(id(step), [])
        if muts:
            build = step.build

            def mutated(out, build=build, muts=muts):  # type: ignore[no-untyped-def]
                pdu = build(out)  # type: ignore[operator]
                for m in muts:
                    pdu = pdu[:m[2] % (len(pdu) + 1)] if m[0] == "truncate" else _mutate(pdu, m)
                return pdu
            step.build = mutated
    stream.steps = steps
    return stream


class _ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Fuzzer:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.loop_errors: list[dict] = []
        loop.set_exception_handler(lambda _loop, ctx: self.loop_errors.append(ctx))
        self.served: Served | None = None
        self.admin = None
        self.cntlid = 0
        self.examples = 0
        self.peaks: list[int] = []
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.kinds: collections.Counter[str] = collections.Counter()
        self.log = _ErrorLog()
        self.dirty = False

    async def start(self) -> None:
        self.served = await serve()
        await self.served.service.add_subsystem(  # type: ignore[attr-defined]
            AUTH_SUBNQN, allow_any_host=False, hosts=[AUTH_HOSTNQN],
            host_auth={AUTH_HOSTNQN: {"dhchap_key": AUTH_KEY, "dhchap_ctrl_key": AUTH_CTRL_KEY}})
        self.admin, self.cntlid = await admin_host(self.served.port)
        self.baseline_tasks = len(asyncio.all_tasks())

    async def stop(self) -> None:
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        if self.served is not None:
            await self.served.target.close()  # type: ignore[attr-defined]
            self.served = None
        self.loop_errors.clear()

    async def run(self, case: Case) -> None:
        if self.dirty:
            # A failed example may have left connections behind: later examples start from a fresh target.
            await self.stop()
            await self.start()
        self.dirty = True
        try:
            await self._run(case)
        except BaseException as exc:
            exc.add_note(f"case: {case!r}")
            raise
        self.dirty = False

    async def _run(self, case: Case) -> None:
        s = self.served
        assert s is not None
        self.examples += 1
        self.log.records.clear()
        tracemalloc.reset_peak()
        mem_before = tracemalloc.get_traced_memory()[0]
        if case.kind == "io":
            stream = _io_stream(self.cntlid, case.hdgst, case.ddgst, case.seed)
        elif case.kind == "auth":
            stream = _auth_stream(case.hdgst, case.ddgst, case.seed)
        else:
            stream = _admin_stream(case.hdgst, case.ddgst)
        stream = _apply(stream, case.mutations)
        patient = not case.mutations
        peer = await RawPeer.open(s.port)
        waiting = True
        for step in stream.steps:
            data = step.build(peer.out)  # type: ignore[operator]
            await peer.send(data, case.chunks)
            if peer.eof or peer.out.term is not None or peer.out.broken:
                break
            if waiting and step.wait is not None:
                answered = await peer.wait_for(step.wait, 5.0 if patient else 0.3)
                assert answered or not patient, f"no answer to a valid PDU; got {[p.kind for p in peer.out.pdus]}"
                waiting = answered
        if not stream.truncated and not peer.eof and peer.out.term is None:
            await asyncio.sleep(0.01)   # let the last answers arrive before checking them
        out = peer.out
        assert not out.errors, f"the target sent a malformed PDU: {out.errors}"
        if out.term is not None:
            assert await peer.wait_eof(3), "C2HTermReq but the target kept the connection open"
        closed_by_target = peer.eof
        outcome = (f"C2HTermReq FES {out.term.fields['fes']}" if out.term is not None
                   else "closed without TermReq" if closed_by_target else "answered, still open")
        self.outcomes[outcome + (" (valid stream)" if patient else "")] += 1
        self.kinds[case.kind + (" valid" if patient else "")] += 1
        if closed_by_target and out.term is None:
            reasons = " | ".join(r.getMessage() for r in self.log.records)
            # Only the host may end a connection without a C2HTermReq: by H2CTermReq or Disconnect.
            assert "sending C2HTermReq" not in reasons, f"logged a C2HTermReq that never arrived: {reasons}"
            # ... or DH-HMAC-CHAP refused it (target/auth.py tears the controller down, as nvmet does)
            assert any(w in reasons for w in ("terminated the connection", "disconnects qid",
                                              "authentication refused")), \
                f"the target closed the connection without a C2HTermReq or a logged reason: {reasons}"
        if patient:
            stream.expect(out)  # type: ignore[operator]
            assert not closed_by_target and out.term is None
        await peer.close(abort=case.abort)
        # Nothing of the fuzzed connection is left: connection, controllers, queues, tasks.
        await wait_until(lambda: len(s.server.connections) == 1, what="the fuzzed connection to go")
        await wait_until(lambda: list(s.target.controllers) == [self.cntlid], what="fuzzed controllers to go")
        assert list(s.target.controllers[self.cntlid].queues) == [0], "the long-lived admin lost its queue"
        await wait_until(lambda: len(asyncio.all_tasks()) <= self.baseline_tasks + 1, what="tasks to finish")
        peak = tracemalloc.get_traced_memory()[1] - mem_before
        self.peaks.append(peak)
        assert peak < MEMORY_BOUND, f"peak allocation {peak} bytes"
        unexpected = [r for r in self.log.records if r.levelno >= logging.ERROR]
        assert not unexpected, [r.getMessage() for r in unexpected]
        assert not self.loop_errors, self.loop_errors
        # A well-behaved host on a separate connection still gets correct data.
        pattern = (self.examples.to_bytes(4, "little") + case.seed.to_bytes(4, "little")) * 2048
        await good_host_roundtrip(s, GOOD_SLBA, pattern)


def test_fuzz_live_target_over_tcp():
    loop = asyncio.new_event_loop()
    fuzzer = Fuzzer(loop)
    loggers = [logging.getLogger(name) for name in ("target", "nvmeof")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(fuzzer.log)
        lg.setLevel(logging.INFO)
    tracemalloc.start()
    try:
        loop.run_until_complete(fuzzer.start())

        # No explain phase: its line tracing makes a live-socket example too slow to rerun.
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, print_blob=True,
                  derandomize=not FUZZ_RANDOM,
                  phases=[Phase.explicit, Phase.generate, Phase.shrink],
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(case=CASE)
        # The auth stream whole, one- and two-way (seed bit 0), then with its Reply replayed (dup of
        # step 4) and the Negotiate dropped: each must be served or refused cleanly.
        @example(case=Case("auth", False, False, [], [], False, seed=8))
        @example(case=Case("auth", True, True, [], [], False, seed=13))
        @example(case=Case("auth", False, False, [("dup", 4)], [], False, seed=9))
        @example(case=Case("auth", False, True, [("drop", 2)], [], True, seed=2))
        def run_example(case: Case) -> None:
            loop.run_until_complete(asyncio.wait_for(fuzzer.run(case), EXAMPLE_TIMEOUT))

        run_example()
    finally:
        tracemalloc.stop()
        with contextlib.suppress(Exception):
            loop.run_until_complete(fuzzer.stop())
        loop.close()
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(fuzzer.log)
            lg.setLevel(level)
    assert fuzzer.examples >= FUZZ_EXAMPLES
    print(f"fuzz outcomes: {dict(fuzzer.outcomes)}; streams {dict(fuzzer.kinds)}; "
          f"peak allocation {max(fuzzer.peaks)} bytes")
    # The fuzzer must have reached both sides: valid streams served and malformed ones refused.
    assert fuzzer.outcomes["answered, still open (valid stream)"] > 0, fuzzer.outcomes
    assert fuzzer.kinds["auth valid"] >= 2 and fuzzer.kinds["auth"] > 0, fuzzer.kinds
    assert any(k.startswith("C2HTermReq") for k in fuzzer.outcomes), fuzzer.outcomes
    assert not fuzzer.loop_errors, fuzzer.loop_errors
