"""NVMe/RDMA CM private data: construct definitions, compiled parsers and the struct fast path agree."""

from __future__ import annotations

import pytest
from construct import ConstError
from hypothesis import given
from hypothesis import strategies as st

from nvmeof.spec import rdma as r

u16 = st.integers(0, 0xFFFF)


def test_sizes() -> None:
    assert r.CmRequest.sizeof() == r.CM_REQ_SIZE == 32
    assert r.CmReply.sizeof() == r.CM_REP_SIZE == 32
    assert r.CmReject.sizeof() == r.CM_REJ_SIZE == 4
    assert r.CM_REQ.size == 32 and r.CM_REP.size == 32 and r.CM_REJ.size == 4


def test_request_bytes_match_the_linux_admin_connect() -> None:
    # nvme_rdma_route_resolved for the admin queue: qid 0, hrqsize 32, hsqsize 31, cntlid 0
    raw = r.pack_cm_request(0, 32, 31)
    assert raw == bytes.fromhex("0000" "0000" "2000" "1f00" "0000") + bytes(22)
    assert r.CmRequest.build({"recfmt": 0, "qid": 0, "hrqsize": 32, "hsqsize": 31, "cntlid": 0}) == raw
    parsed = r.CmRequestCompiled.parse(raw)
    assert (parsed.recfmt, parsed.qid, parsed.hrqsize, parsed.hsqsize, parsed.cntlid) == (0, 0, 32, 31, 0)


@given(u16, u16, u16, u16)
def test_request_roundtrip(qid: int, hrqsize: int, hsqsize: int, cntlid: int) -> None:
    raw = r.pack_cm_request(qid, hrqsize, hsqsize, cntlid)
    values = {"recfmt": 0, "qid": qid, "hrqsize": hrqsize, "hsqsize": hsqsize, "cntlid": cntlid}
    assert r.CmRequest.build(values) == raw
    assert r.unpack_cm_request(raw) == (0, qid, hrqsize, hsqsize, cntlid)
    parsed = r.CmRequest.parse(raw)
    assert {k: parsed[k] for k in values} == values
    compiled = r.CmRequestCompiled.parse(raw)
    assert {k: compiled[k] for k in values} == values


@given(u16)
def test_reply_roundtrip(crqsize: int) -> None:
    raw = r.pack_cm_reply(crqsize)
    assert raw == b"\0\0" + crqsize.to_bytes(2, "little") + bytes(28)
    assert r.CmReply.build({"recfmt": 0, "crqsize": crqsize}) == raw
    assert r.unpack_cm_reply(raw) == (0, crqsize)
    assert r.CmReplyCompiled.parse(raw).crqsize == crqsize


@pytest.mark.parametrize("status", list(r.RejectStatus))
def test_reject_roundtrip(status: r.RejectStatus) -> None:
    raw = r.pack_cm_reject(status)
    assert raw == b"\0\0" + int(status).to_bytes(2, "little")
    assert r.CmReject.build({"recfmt": 0, "sts": status}) == raw
    assert r.CmRejectCompiled.parse(raw).sts == status
    assert r.unpack_cm_reject(raw) == (0, status)
    assert status.name in r.describe_reject(status) and status.message in r.describe_reject(status)


def test_reject_status_values_follow_nvme_rdma_h() -> None:
    assert [(s.name, s.value) for s in r.RejectStatus] == [
        ("INVALID_LEN", 1), ("INVALID_RECFMT", 2), ("INVALID_QID", 3), ("INVALID_HSQSIZE", 4),
        ("INVALID_HRQSIZE", 5), ("NO_RSC", 6), ("INVALID_IRD", 7), ("INVALID_ORD", 8), ("INVALID_CNTLID", 9),
    ]
    assert "unknown" in r.describe_reject(0x42)


def test_parsers_accept_the_padded_cm_private_data_area() -> None:
    # RoCE delivers the REQ's whole 56-byte private data area; the tail is ignored
    raw = r.pack_cm_request(3, 128, 127, 7) + b"\xff" * 24
    assert r.unpack_cm_request(raw) == (0, 3, 128, 127, 7)
    assert r.unpack_cm_reply(r.pack_cm_reply(64) + bytes(164)) == (0, 64)
    assert r.unpack_cm_reject(r.pack_cm_reject(r.RejectStatus.NO_RSC) + bytes(10)) == (0, 6)


@pytest.mark.parametrize(("fn", "size"), [(r.unpack_cm_request, 32), (r.unpack_cm_reply, 32),
                                          (r.unpack_cm_reject, 4)])
def test_short_private_data_is_named(fn, size: int) -> None:
    with pytest.raises(r.PrivateDataError, match=f"{size - 1} bytes; it needs {size}"):
        fn(bytes(size - 1))


def test_builders_check_ranges_and_reserved_bytes() -> None:
    with pytest.raises(ValueError, match="hsqsize=65536"):
        r.pack_cm_request(0, 32, 0x10000)
    with pytest.raises(ValueError, match="crqsize=-1"):
        r.pack_cm_reply(-1)
    with pytest.raises(ValueError, match="sts=65536"):
        r.pack_cm_reject(0x10000)
    # the strict construct refuses non-zero reserved bytes; the lenient one reads them
    odd = r.pack_cm_request(1, 2, 1)[:10] + b"\x01" + bytes(21)
    with pytest.raises(ConstError):
        r.CmRequest.parse(odd)
    assert r.CmRequestLenient.parse(odd).rsvd[0] == 1
