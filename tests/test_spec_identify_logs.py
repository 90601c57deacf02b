"""Identify and log page structures: sizes, offsets, round trips, compiled parsers, list helpers."""

from __future__ import annotations

import random
import struct

import pytest
from construct import Array, Construct, ConstructError, Default, Padded, Renamed, Struct

from nvmeof.spec import identify as idf
from nvmeof.spec import logs
from nvmeof.spec.fields import Int128ul, field_offset

# (structure, size, {field name: byte range that must hold printable text})
STRUCTS = [
    (idf.IdentifyController, 4096, {"sn": 20, "mn": 40, "fr": 8, "subnqn": 256}),
    (idf.IdentifyNamespace, 4096, {}),
    (idf.PowerStateDescriptor, 32, {}),
    (idf.LbaFormat, 4, {}),
    (logs.ErrorLogEntry, 64, {}),
    (logs.SmartLog, 512, {}),
    (logs.FirmwareSlotLog, 512, {"frs": 56}),
    (logs.CommandsSupportedEffects, 4096, {}),
]
NAMES = ["IdentifyController", "IdentifyNamespace", "PowerStateDescriptor", "LbaFormat", "ErrorLogEntry",
         "SmartLog", "FirmwareSlotLog", "CommandsSupportedEffects"]


def _reserved_ranges(sc: Construct, base: int = 0) -> list[tuple[int, int]]:
    """Byte ranges of every Padding, nested structs and arrays included."""
    while isinstance(sc, Renamed | Default):
        sc = sc.subcon
    if isinstance(sc, Padded):
        return [(base, base + sc.sizeof())]
    out: list[tuple[int, int]] = []
    if isinstance(sc, Struct):
        for sub in sc.subcons:
            out += _reserved_ranges(sub, base)
            base += sub.sizeof()
    elif isinstance(sc, Array):
        step = sc.subcon.sizeof()
        for i in range(sc.count):
            out += _reserved_ranges(sc.subcon, base + i * step)
    return out


def _sample(st: Struct, text_fields: dict[str, int], seed: int) -> bytes:
    """Random bytes with reserved ranges zero and text fields holding valid, padded text."""
    rng = random.Random(seed)
    buf = bytearray(rng.randbytes(st.sizeof()))
    for start, end in _reserved_ranges(st):
        buf[start:end] = bytes(end - start)
    for name, size in text_fields.items():
        start = field_offset(st, name)
        if name == "subnqn":
            value = b"nqn.2014-08.org.example:subsys".ljust(size, b"\x00")
        elif name == "frs":
            value = b"".join(f"FW{i}".encode().ljust(8, b" ") for i in range(6)) + bytes(8)
        else:
            value = f"{name.upper()}-{seed}".encode().ljust(size, b" ")
        buf[start : start + size] = value
    return bytes(buf)


@pytest.mark.parametrize(("st", "size", "text"), STRUCTS, ids=NAMES)
def test_size_roundtrip_and_compiled(st: Struct, size: int, text: dict[str, int]) -> None:
    assert st.sizeof() == size
    compiled = st.compile()
    for seed in (1, 2):
        raw = _sample(st, text, seed)
        parsed = st.parse(raw)
        assert st.build(parsed) == raw
        assert compiled.parse(raw) == parsed
        assert compiled.build(parsed) == raw
    # every field defaults: an empty dict builds all zeros apart from padded text
    empty = st.build({})
    assert len(empty) == size
    assert st.parse(empty) == compiled.parse(empty)


def test_empty_identify_controller_is_space_padded_strings_else_zero() -> None:
    raw = idf.IdentifyController.build({})
    assert raw[4:72] == b" " * 68  # sn, mn, fr
    assert raw[:4] == bytes(4) and not any(raw[72:])


# Offsets from PROTOCOL.md 2.3 (libnvme struct nvme_id_ctrl compiled with gcc) and the kernel header.
ID_CTRL_OFFSETS = {
    "vid": (0, "<H"), "ssvid": (2, "<H"), "rab": (72, "<B"), "cmic": (76, "<B"), "mdts": (77, "<B"),
    "cntlid": (78, "<H"), "ver": (80, "<I"), "rtd3r": (84, "<I"), "rtd3e": (88, "<I"), "oaes": (92, "<I"),
    "ctratt": (96, "<I"), "rrls": (100, "<H"), "cntrltype": (111, "<B"), "crdt1": (128, "<H"),
    "crdt2": (130, "<H"), "crdt3": (132, "<H"), "oacs": (256, "<H"), "acl": (258, "<B"), "aerl": (259, "<B"),
    "frmw": (260, "<B"), "lpa": (261, "<B"), "elpe": (262, "<B"), "npss": (263, "<B"), "avscc": (264, "<B"),
    "apsta": (265, "<B"), "wctemp": (266, "<H"), "cctemp": (268, "<H"), "mtfa": (270, "<H"),
    "hmpre": (272, "<I"), "hmmin": (276, "<I"), "rpmbs": (312, "<I"), "edstt": (316, "<H"),
    "dsto": (318, "<B"), "fwug": (319, "<B"), "kas": (320, "<H"), "hctma": (322, "<H"), "mntmt": (324, "<H"),
    "mxtmt": (326, "<H"), "sanicap": (328, "<I"), "hmminds": (332, "<I"), "hmmaxd": (336, "<H"),
    "nsetidmax": (338, "<H"), "endgidmax": (340, "<H"), "anatt": (342, "<B"), "anacap": (343, "<B"),
    "anagrpmax": (344, "<I"), "nanagrpid": (348, "<I"), "pels": (352, "<I"), "domainid": (356, "<H"),
    "sqes": (512, "<B"), "cqes": (513, "<B"), "maxcmd": (514, "<H"), "nn": (516, "<I"), "oncs": (520, "<H"),
    "fuses": (522, "<H"), "fna": (524, "<B"), "vwc": (525, "<B"), "awun": (526, "<H"), "awupf": (528, "<H"),
    "icsvscc": (530, "<B"), "nwpc": (531, "<B"), "acwu": (532, "<H"), "ocfs": (534, "<H"),
    "sgls": (536, "<I"), "mnan": (540, "<I"), "maxcna": (560, "<I"), "ioccsz": (1792, "<I"),
    "iorcsz": (1796, "<I"), "icdoff": (1800, "<H"), "fcatt": (1802, "<B"), "msdbd": (1803, "<B"),
    "ofcs": (1804, "<H"), "dctype": (1806, "<B"),
}


@pytest.mark.parametrize(("name", "spec"), sorted(ID_CTRL_OFFSETS.items()))
def test_identify_controller_offsets(name: str, spec: tuple[int, str]) -> None:
    offset, fmt = spec
    assert field_offset(idf.IdentifyController, name) == offset
    sentinel = {"<B": 0xA5, "<H": 0xA55A, "<I": 0xA55A1234}[fmt]
    raw = idf.IdentifyController.build({name: sentinel})
    assert struct.unpack_from(fmt, raw, offset)[0] == sentinel
    # nothing else changed: the sentinel is the only non-default data (sn/mn/fr are spaces)
    blank = bytearray(idf.IdentifyController.build({}))
    struct.pack_into(fmt, blank, offset, sentinel)
    assert raw == bytes(blank)


def test_identify_controller_array_and_text_offsets() -> None:
    expect = {"sn": 4, "mn": 24, "fr": 64, "ieee": 73, "fguid": 112, "tnvmcap": 280, "unvmcap": 296,
              "megcap": 368, "maxdna": 544, "subnqn": 768, "psd": 2048, "vs": 3072}
    for name, offset in expect.items():
        assert field_offset(idf.IdentifyController, name) == offset, name
    raw = idf.IdentifyController.build({
        "sn": "SN1", "mn": "Model", "fr": "1.0", "subnqn": "nqn.2014-08.org.example:a",
        "ieee": b"\x01\x02\x03", "fguid": bytes(range(16)), "tnvmcap": 1 << 100, "unvmcap": 7,
        "vs": b"\xee" * 1024,
        "psd": [{"mp": 0x1234, "enlat": 5, "exlat": 6, "actp": 0x0102}] + [{}] * 31,
    })
    assert raw[4:24] == b"SN1".ljust(20, b" ")
    assert raw[24:64] == b"Model".ljust(40, b" ")
    assert raw[64:72] == b"1.0     "
    assert raw[768:1024] == b"nqn.2014-08.org.example:a".ljust(256, b"\x00")
    assert raw[73:76] == b"\x01\x02\x03"
    assert raw[112:128] == bytes(range(16))
    assert raw[280:296] == (1 << 100).to_bytes(16, "little")
    assert raw[296] == 7
    assert raw[3072:] == b"\xee" * 1024
    assert struct.unpack_from("<HxxII", raw, 2048) == (0x1234, 5, 6)
    assert struct.unpack_from("<H", raw, 2048 + 20)[0] == 0x0102


def test_identify_namespace_offsets() -> None:
    expect = {"nsze": 0, "ncap": 8, "nuse": 16, "nsfeat": 24, "nlbaf": 25, "flbas": 26, "nmic": 30,
              "dlfeat": 33, "nawun": 34, "nawupf": 36, "noiob": 46, "nvmcap": 48, "npwg": 64, "npwa": 66,
              "npdg": 68, "npda": 70, "nows": 72, "mssrl": 74, "mcl": 76, "msrc": 80, "anagrpid": 92,
              "nsattr": 99, "nvmsetid": 100, "endgid": 102, "nguid": 104, "eui64": 120, "lbaf": 128,
              "vs": 3840}
    for name, offset in expect.items():
        assert field_offset(idf.IdentifyNamespace, name) == offset, name
    lbaf = [{"ms": 0, "lbads": 9, "rp": 0}, {"ms": 8, "lbads": 12, "rp": 2}] + [{}] * 62
    raw = idf.IdentifyNamespace.build({
        "nsze": 0x1_0000_0000, "ncap": 2, "nuse": 3, "nsfeat": idf.NSFEAT_THIN, "nlbaf": 1, "flbas": 1,
        "nmic": idf.NMIC_SHARED, "anagrpid": 0x11223344, "nsattr": 1, "nguid": b"\x22" * 16,
        "eui64": b"\x33" * 8, "lbaf": lbaf, "nvmcap": (1 << 64) + 5,
    })
    assert struct.unpack_from("<QQQBBB", raw, 0) == (0x1_0000_0000, 2, 3, 1, 1, 1)
    assert raw[30] == 1
    assert struct.unpack_from("<I", raw, 92)[0] == 0x11223344 and raw[99] == 1
    assert raw[104:120] == b"\x22" * 16 and raw[120:128] == b"\x33" * 8
    assert raw[128:136] == b"\x00\x00\x09\x00\x08\x00\x0c\x02"
    assert raw[48:64] == ((1 << 64) + 5).to_bytes(16, "little")
    parsed = idf.IdentifyNamespace.parse(raw)
    assert parsed.lbaf[idf.flbas_index(parsed.flbas)].lbads == 12


def test_flbas_index_uses_upper_bits() -> None:
    assert idf.flbas_index(0x01) == 1
    assert idf.flbas_index(0x10) == 0  # bit 4 is "metadata at end of LBA", not index
    assert idf.flbas_index(0x6F) == 0x3F


def test_string_fields_reject_bad_input_naming_the_field() -> None:
    with pytest.raises(ConstructError, match=r"sn[\s\S]*21 characters"):
        idf.IdentifyController.build({"sn": "x" * 21})
    with pytest.raises(ConstructError, match=r"mn[\s\S]*printable ASCII"):
        idf.IdentifyController.build({"mn": "caf\u00e9"})
    with pytest.raises(ConstructError, match=r"subnqn[\s\S]*256 bytes"):
        idf.IdentifyController.build({"subnqn": "n" * 256})
    idf.IdentifyController.build({"subnqn": "n" * 255})
    with pytest.raises(ConstructError, match=r"ieee"):
        idf.IdentifyController.build({"ieee": b"\x00"})
    raw = bytearray(idf.IdentifyController.build({}))
    raw[4] = 0xFF
    # parsing a peer's page is lenient: the odd byte is shown, not fatal
    assert idf.IdentifyController.parse(bytes(raw)).sn == "\\xff"


def test_nqn_parse_stops_at_first_nul() -> None:
    raw = bytearray(idf.IdentifyController.build({"subnqn": "nqn.a"}))
    raw[768 + 10] = ord("z")  # junk after the terminator
    assert idf.IdentifyController.parse(bytes(raw)).subnqn == "nqn.a"


def test_sn_parse_strips_nul_padding() -> None:
    raw = bytearray(idf.IdentifyController.build({}))
    raw[4:24] = b"ABC".ljust(20, b"\x00")
    assert idf.IdentifyController.parse(bytes(raw)).sn == "ABC"


def test_int128_adapter() -> None:
    assert Int128ul.sizeof() == 16
    assert Int128ul.build(0x0102) == b"\x02\x01" + bytes(14)
    assert Int128ul.build((1 << 128) - 1) == b"\xff" * 16
    assert Int128ul.parse(bytes(15) + b"\x80") == 1 << 127
    with pytest.raises(ConstructError, match="does not fit"):
        Int128ul.build(1 << 128)
    with pytest.raises(ConstructError, match="does not fit"):
        Int128ul.build(-1)
    with pytest.raises(ConstructError, match="needs an int"):
        Int128ul.build("1")
    with pytest.raises(ConstructError, match=r"data_units_read[\s\S]*does not fit"):
        logs.SmartLog.build({"data_units_read": -5})


def test_bit_constants_match_kernel_header() -> None:
    # values from include/linux/nvme.h (CMIC, ONCS, VWC, SGLS, CTRATT, AEN_CFG, NS_FEAT, NMIC, effects)
    # and libnvme types.h (LPA, ONCS_SAVE_FEATURES, CNTRLTYPE)
    assert (idf.CMIC_MULTI_PORT, idf.CMIC_MULTI_CTRL, idf.CMIC_ANA) == (1, 2, 8)
    assert (idf.OAES_NS_ATTR, idf.OAES_FW_ACT, idf.OAES_ANA, idf.OAES_DISC_CHANGE) == (
        0x100, 0x200, 0x800, 0x8000_0000)
    assert (idf.LPA_SMART_PER_NS, idf.LPA_CMD_EFFECTS, idf.LPA_EXT_DATA) == (1, 2, 4)
    oncs = [idf.ONCS_COMPARE, idf.ONCS_WRITE_UNCOR, idf.ONCS_DSM, idf.ONCS_WRITE_ZEROES,
            idf.ONCS_FEATURES_SAVE, idf.ONCS_RESERVATIONS, idf.ONCS_TIMESTAMP]
    assert oncs == [1, 2, 4, 8, 0x10, 0x20, 0x40]
    assert (idf.VWC_PRESENT, idf.SGLS_SUPPORTED, idf.SGLS_KEYED, idf.SGLS_OFFSET) == (1, 1, 4, 0x100000)
    assert (idf.CTRATT_HOST_ID_128, idf.CTRATT_TBKAS, idf.CTRATT_ELBAS) == (1, 0x40, 0x8000)
    assert (idf.CNTRLTYPE_IO, idf.CNTRLTYPE_DISCOVERY, idf.NSFEAT_THIN, idf.NMIC_SHARED) == (1, 2, 1, 1)
    assert (logs.EFFECTS_CSUPP, logs.EFFECTS_LBCC, logs.EFFECTS_NCC, logs.EFFECTS_NIC, logs.EFFECTS_CCC) == (
        1, 2, 4, 8, 0x10)
    assert (idf.NIDT_EUI64, idf.NIDT_NGUID, idf.NIDT_UUID, idf.NIDT_CSI) == (1, 2, 3, 4)


# --- Namespace identification descriptors ---

EUI = bytes(range(1, 9))
NGUID = bytes(range(0x10, 0x20))
UUID = bytes(range(0x20, 0x30))


def test_ns_descriptor_list_layout() -> None:
    raw = idf.build_ns_descriptor_list(EUI, NGUID, UUID, csi=0)
    assert len(raw) == 4096
    assert raw[0:4] == b"\x01\x08\x00\x00" and raw[4:12] == EUI
    assert raw[12:16] == b"\x02\x10\x00\x00" and raw[16:32] == NGUID
    assert raw[32:36] == b"\x03\x10\x00\x00" and raw[36:52] == UUID
    assert raw[52:57] == b"\x04\x01\x00\x00\x00"
    assert not any(raw[57:])
    assert idf.parse_ns_descriptor_list(raw) == {"eui64": EUI, "nguid": NGUID, "uuid": UUID, "csi": 0}
    one = idf.NsIdDescriptor.parse(raw[12:])
    assert (one.nidt, one.nidl, one.nid) == (2, 16, NGUID)
    assert idf.NsIdDescriptor.build({"nidt": 4, "nidl": 1, "nid": b"\x02"}) == b"\x04\x01\x00\x00\x02"


def test_ns_descriptor_list_skips_zero_and_none() -> None:
    raw = idf.build_ns_descriptor_list(bytes(8), None, UUID)
    assert raw[0:4] == b"\x03\x10\x00\x00" and raw[4:20] == UUID and not any(raw[20:])
    assert idf.parse_ns_descriptor_list(raw) == {"uuid": UUID}
    empty = idf.build_ns_descriptor_list(None, bytes(16), None)
    assert empty == bytes(4096)
    assert idf.parse_ns_descriptor_list(empty) == {}


def test_ns_descriptor_list_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nguid must be 16 bytes, got 8"):
        idf.build_ns_descriptor_list(None, EUI, None)
    with pytest.raises(ValueError, match="csi"):
        idf.build_ns_descriptor_list(EUI, None, None, csi=256)
    with pytest.raises(TypeError, match="uuid must be bytes"):
        idf.build_ns_descriptor_list(None, None, "not-bytes")  # type: ignore[arg-type]


def test_parse_ns_descriptor_list_errors_and_unknown_types() -> None:
    unknown = b"\x09\x03\x00\x00abc"
    raw = (unknown + b"\x01\x08\x00\x00" + EUI).ljust(4096, b"\x00")
    assert idf.parse_ns_descriptor_list(raw) == {"eui64": EUI}
    with pytest.raises(ValueError, match=r"NIDT 2 \(nguid\) needs NIDL 16, got 8"):
        idf.parse_ns_descriptor_list(b"\x02\x08\x00\x00" + EUI)
    with pytest.raises(ValueError, match="duplicate NIDT 1"):
        idf.parse_ns_descriptor_list((b"\x01\x08\x00\x00" + EUI) * 2)
    with pytest.raises(ValueError, match="runs past"):
        idf.parse_ns_descriptor_list(b"\x03\x10\x00\x00" + UUID[:4])


# --- Active namespace list ---


def test_active_ns_list_sorted_after_start() -> None:
    raw = idf.build_active_ns_list([7, 3, 10, 1, 3], start_after=2)
    assert len(raw) == 4096
    assert struct.unpack_from("<4I", raw) == (3, 7, 10, 0)
    assert not any(raw[12:])
    assert idf.parse_active_ns_list(raw) == [3, 7, 10]
    assert idf.ActiveNsList.parse(raw)[:4] == [3, 7, 10, 0]
    assert idf.parse_active_ns_list(idf.build_active_ns_list([1, 2], start_after=2)) == []


def test_active_ns_list_full_and_truncated() -> None:
    full = idf.build_active_ns_list(range(1, 1025), start_after=0)
    assert idf.parse_active_ns_list(full) == list(range(1, 1025))  # no room for a terminator
    more = idf.build_active_ns_list(range(1, 3001), start_after=1000)
    assert idf.parse_active_ns_list(more) == list(range(1001, 2025))
    assert idf.ActiveNsList.sizeof() == 4096


def test_active_ns_list_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="NSID 0 is outside"):
        idf.build_active_ns_list([0], start_after=0)
    with pytest.raises(ValueError, match="NSID 4294967295 is outside"):
        idf.build_active_ns_list([0xFFFFFFFF], start_after=0)
    with pytest.raises(ValueError, match="start_after"):
        idf.build_active_ns_list([1], start_after=-1)
    with pytest.raises(ValueError, match="multiple of 4"):
        idf.parse_active_ns_list(b"\x01\x00\x00")
    assert idf.parse_active_ns_list(b"\x05\x00\x00\x00") == [5]


# --- Logs ---


def test_error_log_entry_offsets() -> None:
    raw = logs.ErrorLogEntry.build({
        "error_count": 9, "sqid": 1, "cmdid": 0x22, "status_field": 0x4004, "param_error_location": 0x28,
        "lba": 0x1122, "nsid": 5, "vs": 0x77, "trtype": 3, "csi": 0, "opcode": 2, "cs": 0xABCDEF,
        "trtype_spec_info": 0x3344, "log_page_version": 1,
    })
    assert struct.unpack_from("<QHHHHQIBBBBQH", raw) == (
        9, 1, 0x22, 0x4004, 0x28, 0x1122, 5, 0x77, 3, 0, 2, 0xABCDEF, 0x3344)
    assert raw[42:63] == bytes(21) and raw[63] == 1


def test_smart_log_offsets() -> None:
    raw = logs.SmartLog.build({
        "critical_warning": 0x04, "temperature": 300, "avail_spare": 100, "spare_thresh": 10,
        "percent_used": 3, "data_units_read": (1 << 96) + 1, "num_err_log_entries": 12,
        "warning_temp_time": 0x01020304, "critical_comp_time": 7, "temp_sensor": [301, 302] + [0] * 6,
        "thm_temp2_total_time": 0x55,
    })
    assert raw[0] == 4 and struct.unpack_from("<H", raw, 1)[0] == 300 and raw[3:6] == bytes([100, 10, 3])
    assert raw[32:48] == ((1 << 96) + 1).to_bytes(16, "little")
    assert raw[176:192] == (12).to_bytes(16, "little")
    assert struct.unpack_from("<II8H", raw, 192) == (0x01020304, 7, 301, 302, 0, 0, 0, 0, 0, 0)
    assert struct.unpack_from("<I", raw, 228)[0] == 0x55
    parsed = logs.SmartLog.parse(raw)
    assert parsed.data_units_read == (1 << 96) + 1 and parsed.temperature == 300


def test_firmware_slot_log() -> None:
    raw = logs.FirmwareSlotLog.build({"afi": 1, "frs": ["0.1.0", "", "", "", "", "", ""]})
    assert raw[0] == 1 and raw[8:16] == b"0.1.0   " and not any(raw[16:])
    parsed = logs.FirmwareSlotLog.parse(raw)
    assert list(parsed.frs) == ["0.1.0", "", "", "", "", "", ""]
    with pytest.raises(ConstructError, match=r"frs[\s\S]*holds 8"):
        logs.FirmwareSlotLog.build({"frs": ["123456789"] + [""] * 6})


def test_changed_ns_list_and_overflow() -> None:
    raw = logs.build_changed_ns_list({9, 2, 5})
    assert len(raw) == 4096 and struct.unpack_from("<4I", raw) == (2, 5, 9, 0)
    assert logs.parse_changed_ns_list(raw) == [2, 5, 9]
    full = logs.build_changed_ns_list(range(1, 1025))
    assert logs.parse_changed_ns_list(full) == list(range(1, 1025))
    over = logs.build_changed_ns_list(range(1, 1026))
    assert over[:4] == b"\xff\xff\xff\xff" and not any(over[4:])
    assert logs.parse_changed_ns_list(over) == [logs.CHANGED_NS_LIST_OVERFLOW]
    assert logs.parse_changed_ns_list(logs.build_changed_ns_list([])) == []
    with pytest.raises(ValueError, match="NSID 0 is outside"):
        logs.build_changed_ns_list([0])
    assert logs.ChangedNsList.sizeof() == 4096


def test_effects_log() -> None:
    raw = logs.build_effects_log(
        {0x06: logs.EFFECTS_CSUPP, 0x09: logs.EFFECTS_CSUPP | logs.EFFECTS_CCC},
        {0x01: logs.EFFECTS_CSUPP | logs.EFFECTS_LBCC},
    )
    assert len(raw) == 4096
    assert struct.unpack_from("<I", raw, 0x06 * 4)[0] == 1
    assert struct.unpack_from("<I", raw, 0x09 * 4)[0] == 0x11
    assert struct.unpack_from("<I", raw, 1024 + 0x01 * 4)[0] == 3
    assert sum(raw) == 1 + 0x11 + 3
    parsed = logs.CommandsSupportedEffects.parse(raw)
    assert parsed.acs[6] == 1 and parsed.iocs[1] == 3
    with pytest.raises(ValueError, match="acs: opcode 256"):
        logs.build_effects_log({256: 1}, {})
    with pytest.raises(ValueError, match="iocs: effects 0x02"):
        logs.build_effects_log({}, {2: 1 << 32})


def test_log_slice() -> None:
    page = bytes(range(1, 101))
    assert logs.log_slice(page, 0, 100) == page
    assert logs.log_slice(page, 10, 5) == bytes(range(11, 16))
    assert logs.log_slice(page, 96, 8) == bytes([97, 98, 99, 100, 0, 0, 0, 0])
    assert logs.log_slice(page, 200, 4) == bytes(4)
    assert logs.log_slice(page, 5, 0) == b""
    assert logs.log_slice(memoryview(page), 98, 4) == b"\x63\x64\x00\x00"
    with pytest.raises(ValueError, match="offset"):
        logs.log_slice(page, -1, 4)
    with pytest.raises(ValueError, match="length"):
        logs.log_slice(page, 0, -4)


def test_field_offset_unknown_name() -> None:
    with pytest.raises(KeyError, match="nope"):
        field_offset(idf.IdentifyController, "nope")
