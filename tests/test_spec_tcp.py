"""NVMe/TCP PDU layouts: construct definitions, compiled parsers and the struct fast path agree."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvmeof import crc32c as crcmod
from nvmeof.spec import tcp as t


def ch(type_: int, flags: int, hlen: int, pdo: int, plen: int) -> dict:
    return {"type": type_, "flags": flags, "hlen": hlen, "pdo": pdo, "plen": plen}


def strip(obj):
    """A parsed construct Container as plain dicts, without construct's private keys."""
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if not k.startswith("_")}
    return obj


# (construct, compiled, fast struct, sample values for the construct, the same as a flat tuple)
CASES = {
    "CommonHeader": (
        t.CommonHeader, t.CommonHeaderCompiled, t.COMMON_HDR,
        ch(4, 3, 72, 76, 0x01020304), (4, 3, 72, 76, 0x01020304),
    ),
    "ICReq": (
        t.ICReq, t.ICReqCompiled, t.IC_HDR,
        {"ch": ch(0, 0, 128, 0, 128), "pfv": 0, "hpda": 0, "dgst": 3, "maxr2t": 0},
        (0, 0, 128, 0, 128, 0, 0, 3, 0),
    ),
    "ICResp": (
        t.ICResp, t.ICRespCompiled, t.IC_HDR,
        {"ch": ch(1, 0, 128, 0, 128), "pfv": 0, "cpda": 0, "dgst": 1, "maxh2cdata": 0x400000},
        (1, 0, 128, 0, 128, 0, 0, 1, 0x400000),
    ),
    "TermReqHeader": (
        t.TermReqHeader, t.TermReqHeaderCompiled, t.TERM_REQ_HDR,
        {"ch": ch(3, 0, 24, 0, 32), "fes": 1, "fei": 0xA1B2C3D4},
        (3, 0, 24, 0, 32, 1, 0xA1B2C3D4),
    ),
    "CapsuleCmdHeader": (
        t.CapsuleCmdHeader, t.CapsuleCmdHeaderCompiled, t.CAPSULE_CMD_HDR,
        {"ch": ch(4, 1, 72, 0, 76), "sqe": bytes(range(64))},
        (4, 1, 72, 0, 76, bytes(range(64))),
    ),
    "CapsuleResp": (
        t.CapsuleResp, t.CapsuleRespCompiled, t.CAPSULE_RESP_HDR,
        {"ch": ch(5, 0, 24, 0, 24), "cqe": bytes(range(100, 116))},
        (5, 0, 24, 0, 24, bytes(range(100, 116))),
    ),
    "H2CData": (
        t.H2CDataHeader, t.DataPduHeaderCompiled, t.DATA_PDU_HDR,
        {"ch": ch(6, 4, 24, 24, 4120), "cccid": 0x1234, "ttag": 0x5678, "datao": 8192, "datal": 4096},
        (6, 4, 24, 24, 4120, 0x1234, 0x5678, 8192, 4096),
    ),
    "C2HData": (
        t.C2HDataHeader, t.DataPduHeaderCompiled, t.DATA_PDU_HDR,
        {"ch": ch(7, 0x0F, 24, 28, 4128), "cccid": 7, "ttag": 0, "datao": 0, "datal": 4096},
        (7, 0x0F, 24, 28, 4128, 7, 0, 0, 4096),
    ),
    "R2T": (
        t.R2T, t.R2TCompiled, t.DATA_PDU_HDR,
        {"ch": ch(9, 0, 24, 0, 24), "cccid": 3, "ttag": 9, "r2to": 4096, "r2tl": 65536},
        (9, 0, 24, 0, 24, 3, 9, 4096, 65536),
    ),
}

SIZES = {
    "CommonHeader": 8, "ICReq": 128, "ICResp": 128, "TermReqHeader": 24, "CapsuleCmdHeader": 72,
    "CapsuleResp": 24, "H2CData": 24, "C2HData": 24, "R2T": 24,
}


@pytest.mark.parametrize("name", list(CASES))
def test_build_parse_size_compiled_fast(name):
    con, compiled, fast, values, flat = CASES[name]
    raw = con.build(values)
    assert len(raw) == SIZES[name] == con.sizeof() == fast.size
    assert strip(con.parse(raw)) == values
    assert strip(compiled.parse(raw)) == values
    assert fast.pack(*flat) == raw
    assert fast.unpack(raw) == flat
    assert compiled.build(values) == raw


def test_key_offsets_match_nvme_tcp_h():
    # include/linux/nvme-tcp.h: plen le32 at 4; icreq pfv@8 hpda@10 digest@11 maxr2t@12;
    # data pdu command_id@8 ttag@10 data_offset@12 data_length@16; term fes@8 fei@10.
    raw = t.ICReq.build({"ch": ch(0, 0, 128, 0, 128), "pfv": 0x0102, "hpda": 0x03, "dgst": 0x04,
                         "maxr2t": 0x05060708})
    assert raw[4:8] == struct.pack("<I", 128)
    assert raw[8:10] == b"\x02\x01" and raw[10] == 3 and raw[11] == 4
    assert raw[12:16] == b"\x08\x07\x06\x05" and raw[16:] == bytes(112)
    raw = t.DataPduHeader.build({"ch": ch(6, 0, 24, 24, 25), "cccid": 0x0A0B, "ttag": 0x0C0D,
                                 "datao": 0x11223344, "datal": 0x55667788})
    assert raw[8:10] == b"\x0b\x0a" and raw[10:12] == b"\x0d\x0c"
    assert raw[12:16] == bytes.fromhex("44332211") and raw[16:20] == bytes.fromhex("88776655")
    assert raw[20:24] == bytes(4)
    raw = t.TermReqHeader.build({"ch": ch(2, 0, 24, 0, 24), "fes": 0x0201, "fei": 0x06050403})
    assert raw[8:14] == bytes([1, 2, 3, 4, 5, 6]) and raw[14:] == bytes(10)
    assert (t.OFF_PFV, t.OFF_PDA, t.OFF_DGST, t.OFF_MAXR2T) == (8, 10, 11, 12)
    assert (t.OFF_CCCID, t.OFF_TTAG, t.OFF_DATAO, t.OFF_DATAL) == (8, 10, 12, 16)


@pytest.mark.parametrize("dgst", [0, 1, 2, 3])
def test_linux_host_icreq_bytes(dgst):
    # What nvme_tcp_init_connection sends: type 0, flags 0, hlen 128, pdo 0, plen 128, pfv 0,
    # hpda 0, digest bits per --hdr-digest/--data-digest, maxr2t 0, 112 reserved zero bytes.
    wire = bytes([0, 0, 128, 0, 128, 0, 0, 0, 0, 0, 0, dgst, 0, 0, 0, 0]) + bytes(112)
    parsed = t.ICReqCompiled.parse(wire)
    assert parsed.ch.type == t.PduType.ICREQ and parsed.ch.hlen == 128 and parsed.ch.plen == 128
    assert parsed.pfv == t.PFV_1_0 and parsed.hpda == 0 and parsed.maxr2t == 0
    assert bool(parsed.dgst & t.HDR_DIGEST_ENABLE) == bool(dgst & 1)
    assert bool(parsed.dgst & t.DATA_DIGEST_ENABLE) == bool(dgst & 2)
    assert t.IC_HDR.pack(0, 0, 128, 0, 128, 0, 0, dgst, 0) == wire


def test_enum_values_match_kernel():
    assert [int(p) for p in t.PduType] == [0, 1, 2, 3, 4, 5, 6, 7, 9]
    assert (t.HDGSTF, t.DDGSTF, t.DATA_LAST, t.DATA_SUCCESS) == (1, 2, 4, 8)
    assert [int(f) for f in t.FatalErrorStatus] == [1, 2, 3, 4, 5, 6]
    assert t.TERM_REQ_MAX_PLEN == 152 and t.TERM_REQ_MIN_PLEN == 24


@given(st.binary(min_size=24, max_size=24))
def test_fast_data_header_equals_construct_on_any_bytes(raw):
    c = t.DataPduHeaderCompiled.parse(raw)
    assert t.DATA_PDU_HDR.unpack(raw) == (
        c.ch.type, c.ch.flags, c.ch.hlen, c.ch.pdo, c.ch.plen, c.cccid, c.ttag, c.datao, c.datal
    )
    r = t.R2TCompiled.parse(raw)
    assert (r.r2to, r.r2tl) == (c.datao, c.datal)


@given(st.binary(min_size=24, max_size=24))
def test_fast_resp_and_term_equal_construct_on_any_bytes(raw):
    c = t.CapsuleRespCompiled.parse(raw)
    assert t.CAPSULE_RESP_HDR.unpack(raw) == (c.ch.type, c.ch.flags, c.ch.hlen, c.ch.pdo, c.ch.plen, c.cqe)
    tr = t.TermReqHeaderCompiled.parse(raw)
    assert t.TERM_REQ_HDR.unpack(raw)[5:] == (tr.fes, tr.fei)


# ------------------------------------------------------------------------------------------ crc32c

def test_crc32c_check_value_and_chaining():
    assert crcmod.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    part = crcmod.crc32c(b"12345")
    assert crcmod.crc32c(memoryview(b"6789"), part) == 0xE3069283
    assert crcmod.crc32c(bytearray(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros


def test_digest_bytes_little_endian():
    # Linux stores cpu_to_le32(~crc32c(~0, ...)): the standard CRC32C value, little-endian.
    assert crcmod.digest_bytes(b"123456789") == bytes.fromhex("839206e3")
    assert crcmod.digest_bytes(bytes(32)) == bytes.fromhex("aa36918a")
