"""Size, offset, build/parse and compiled-parser checks for the SQE/CQE/SGL and Fabrics structures."""

import uuid

import pytest
from construct import Container

from nvmeof.spec import fabrics as f
from nvmeof.spec import nvme as n
from nvmeof.status import Status, encode_status

STRUCTS = [
    (n.SQE, 64), (n.CQE, 16), (n.SglDataBlock, 16), (n.SglKeyedDataBlock, 16), (n.DsmRange, 16),
    (f.ConnectCommand, 64), (f.ConnectData, 1024), (f.PropertySetCommand, 64), (f.PropertyGetCommand, 64),
    (f.DisconnectCommand, 64), (f.DiscoveryLogHeader, 1024), (f.DiscoveryLogEntry, 1024),
    (f.TsasTcp, 256), (f.TsasRdma, 256),
]


@pytest.mark.parametrize(("struct", "size"), STRUCTS, ids=lambda s: getattr(s, "name", None) or str(s))
def test_size_and_roundtrip(struct, size):
    assert struct.sizeof() == size
    raw = bytes(size)
    if struct in (f.ConnectCommand, f.PropertySetCommand, f.PropertyGetCommand, f.DisconnectCommand):
        raw = b"\x7f" + raw[1:]
    parsed = struct.parse(raw)
    assert struct.build(parsed) == raw
    assert struct.compile().parse(raw) == parsed


def test_sqe_offsets_match_linux_nvme_common_command():
    raw = n.SQE.build(Container(opcode=0x02, flags=0x40, cid=0x1234, nsid=0x55667788, cdw2=0, cdw3=0,
                                mptr=0, dptr=bytes(range(16)), cdw10=0xA, cdw11=0xB, cdw12=0xC, cdw13=0xD,
                                cdw14=0xE, cdw15=0xF))
    assert raw[0] == 0x02 and raw[1] == 0x40 and raw[2:4] == b"\x34\x12"
    assert raw[4:8] == bytes.fromhex("88776655")
    assert raw[24:40] == bytes(range(16))
    cdws = [int.from_bytes(raw[o:o + 4], "little") for o in range(40, 64, 4)]
    assert cdws == [0xA, 0xB, 0xC, 0xD, 0xE, 0xF]


def test_command_fast_path_equals_construct():
    sgl = n.Command.make_sgl(n.SGL_ID_TRANSPORT, 0, 4096)
    cmd = n.Command(n.IoOpcode.READ, cid=7, nsid=1, dptr=sgl, cdw10=0x89ABCDEF, cdw11=0x1, cdw12=7 | n.RW_FUA)
    raw = cmd.to_bytes()
    c = n.SQE.parse(raw)
    assert (c.opcode, c.flags, c.cid, c.nsid, c.dptr, c.cdw10, c.cdw12) == (
        2, n.SQE_FLAGS_PSDT_SGL, 7, 1, sgl, 0x89ABCDEF, 7 | n.RW_FUA)
    assert n.SQE.build(c) == raw
    back = n.Command.from_bytes(memoryview(raw))
    assert back.to_bytes() == raw
    assert back.slba == 0x1_89ABCDEF and back.nlb == 8
    buf = bytearray(70)
    back.pack_into(buf, 3)
    assert bytes(buf[3:67]) == raw


def test_sgl_descriptors():
    data = n.Command.make_sgl(n.SGL_ID_INCAPSULE, 0, 8192)
    assert n.SglDataBlock.parse(data) == Container(addr=0, length=8192, rsvd=bytes(3), sgl_id=0x01)
    keyed = n.Command.make_sgl(n.SGL_ID_KEYED_INVALIDATE, 0x1000_2000, 0x123456, 0xCAFEBABE)
    p = n.SglKeyedDataBlock.parse(keyed)
    assert (p.addr, p.length, p.key, p.sgl_id) == (0x1000_2000, 0x123456, 0xCAFEBABE, 0x4F)
    cmd = n.Command(dptr=keyed)
    assert cmd.sgl() == n.SglFields(0x4F, 0x1000_2000, 0x123456, 0xCAFEBABE)
    assert n.Command(dptr=data).sgl() == n.SglFields(0x01, 0, 8192, 0)
    with pytest.raises(ValueError, match="24 bits"):
        n.Command.make_sgl(n.SGL_ID_KEYED, 0, 1 << 24, 1)


def test_completion_fast_path_and_status_bits():
    raw = n.pack_cqe(cid=9, status_field=encode_status(Status.LBA_RANGE, dnr=True), dw0=5, sqhd=3, sqid=1)
    c = n.CQE.parse(raw)
    assert (c.cid, c.dw0, c.sqhd, c.sqid) == (9, 5, 3, 1)
    assert c.status == (0x80 << 1) | 0x8000
    comp = n.Completion.from_bytes(raw)
    assert comp.status_code == Status.LBA_RANGE and comp.dnr and not comp.more
    assert comp.to_bytes() == raw == n.CQE.build(c)


def test_connect_command_offsets_match_protocol_facts():
    raw = f.ConnectCommand.build(Container(rsvd1=0, cid=1, fctype=n.FabricsType.CONNECT, rsvd2=bytes(19),
                                           dptr=bytes(16), recfmt=0, qid=0x0102, sqsize=31,
                                           cattr=f.CATTR_DISABLE_SQFLOW, rsvd3=0, kato=5000, rsvd4=bytes(12)))
    assert raw[4] == 0x01
    assert raw[42:44] == b"\x02\x01" and raw[44:46] == (31).to_bytes(2, "little")
    assert raw[46] == 4 and int.from_bytes(raw[48:52], "little") == 5000
    # the fast path reads the same fields
    cmd = n.Command.from_bytes(raw)
    assert cmd.fctype == n.FabricsType.CONNECT and cmd.cdw10 & 0xFFFF == 0 and cmd.cdw10 >> 16 == 0x0102


def test_connect_data_offsets():
    hostid = uuid.UUID("12345678-1234-5678-1234-567812345678").bytes
    raw = f.ConnectData.build(dict(hostid=hostid, cntlid=0xFFFF, subsysnqn="nqn.sub", hostnqn="nqn.host"))
    assert len(raw) == 1024 and raw[:16] == hostid and raw[16:18] == b"\xff\xff"
    assert raw[256:263] == b"nqn.sub" and raw[263] == 0
    assert raw[512:520] == b"nqn.host"
    p = f.ConnectDataCompiled.parse(raw)
    assert (p.subsysnqn, p.hostnqn, p.cntlid) == ("nqn.sub", "nqn.host", 0xFFFF)


def test_property_commands():
    raw = f.PropertySetCommand.build(dict(rsvd1=0, cid=3, fctype=0, rsvd2=bytes(35), attrib=0, rsvd3=bytes(3),
                                          offset=f.Property.CC, value=0x460001, rsvd4=bytes(8)))
    assert raw[40] == 0 and raw[44:48] == b"\x14\x00\x00\x00"
    assert int.from_bytes(raw[48:56], "little") == 0x460001
    cmd = n.Command.from_bytes(raw)
    assert cmd.cdw11 == f.Property.CC and cmd.cdw12 == 0x460001
    raw = f.PropertyGetCommand.build(dict(rsvd1=0, cid=3, fctype=4, rsvd2=bytes(35), attrib=1,
                                          rsvd3=bytes(3), offset=f.Property.CAP, rsvd4=bytes(16)))
    assert raw[4] == 4 and raw[40] == 1


def test_discovery_log_entry_offsets():
    raw = f.DiscoveryLogEntry.build(dict(trtype=f.TrType.TCP, adrfam=f.AdrFam.IPV4, subtype=f.SubType.NVME,
                                         treq=f.TREQ_NOT_SPECIFIED | f.TREQ_DISABLE_SQFLOW, portid=1,
                                         cntlid=0xFFFF, asqsz=32, eflags=0, trsvcid="4420",
                                         subnqn="nqn.x", traddr="10.0.2.2",
                                         tsas=f.TsasTcp.build(dict(sectype=0))))
    assert raw[0] == 3 and raw[1] == 1 and raw[2] == 2 and raw[3] == 4
    assert raw[4:6] == b"\x01\x00" and raw[6:8] == b"\xff\xff" and raw[8:10] == b"\x20\x00"
    assert raw[32:36] == b"4420" and raw[256:261] == b"nqn.x" and raw[512:520] == b"10.0.2.2"
    hdr = f.DiscoveryLogHeader.build(dict(genctr=7, numrec=2, recfmt=0))
    assert hdr[:8] == (7).to_bytes(8, "little") and hdr[8:16] == (2).to_bytes(8, "little")
    assert f.DiscoveryLogEntryCompiled.parse(raw).traddr == "10.0.2.2"


def test_connect_invalid_param_result_layout():
    """IATTR in DW0 bits 23:16, IPO in bits 15:0; the target builds it and the initiator reads it with one pair."""
    assert f.connect_invalid_param_result(f.CONNECT_IATTR_DATA, 512) == 0x0001_0200
    assert f.connect_invalid_param_result(f.CONNECT_IATTR_SQE, 44) == 44
    assert f.parse_connect_invalid_param(0x0001_0100) == (f.CONNECT_IATTR_DATA, 256)
    assert f.parse_connect_invalid_param(0xFF00_002C) == (0, 44)
