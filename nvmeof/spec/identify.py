"""Identify data structures (Identify admin command, opcode 06h).

Layouts follow NVMe Base 2.0 (with the later fields libnvme names, which older controllers leave
zero): Linux include/linux/nvme.h, libnvme src/nvme/types.h, SPDK spdk_nvme_ctrlr_data. Every field
has a default (zero, empty string), so a builder passes only the fields it cares about.
"""

from __future__ import annotations

from collections.abc import Iterable

from construct import Array, Bytes, Default, Int8ul, Int16ul, Int32ul, Int64ul, Padding, Struct, this

from nvmeof.spec.fields import Int128ul, NqnString, SpacePaddedString

IDENTIFY_DATA_SIZE = 4096

_U8 = Default(Int8ul, 0)
_U16 = Default(Int16ul, 0)
_U32 = Default(Int32ul, 0)
_U64 = Default(Int64ul, 0)
_U128 = Default(Int128ul, 0)


def _raw(length: int) -> Default:
    return Default(Bytes(length), bytes(length))


# --- Identify Controller bit fields (values checked against include/linux/nvme.h and libnvme) ---

CMIC_MULTI_PORT = 1 << 0
CMIC_MULTI_CTRL = 1 << 1
CMIC_ANA = 1 << 3

# ANACAP: the ANA states this controller reports (bits 4:0); bit 6 set would promise that a namespace's
# ANAGRPID never changes while attached (it may here, so it stays clear); bit 7: non-zero ANAGRPID in
# Namespace Management (not implemented)
ANACAP_OPTIMIZED = 1 << 0
ANACAP_NON_OPTIMIZED = 1 << 1
ANACAP_INACCESSIBLE = 1 << 2
ANACAP_PERSISTENT_LOSS = 1 << 3
ANACAP_CHANGE = 1 << 4
ANACAP_GRPID_FIXED = 1 << 6
ANACAP_GRPID_MGMT = 1 << 7

OAES_NS_ATTR = 1 << 8
OAES_FW_ACT = 1 << 9
OAES_ANA = 1 << 11
OAES_DISC_CHANGE = 1 << 31

CTRATT_HOST_ID_128 = 1 << 0
CTRATT_TBKAS = 1 << 6
CTRATT_ELBAS = 1 << 15

CNTRLTYPE_IO = 1
CNTRLTYPE_DISCOVERY = 2
CNTRLTYPE_ADMIN = 3

DCTYPE_NOT_REPORTED = 0
DCTYPE_DDC = 1
DCTYPE_CDC = 2

LPA_SMART_PER_NS = 1 << 0
LPA_CMD_EFFECTS = 1 << 1
LPA_EXT_DATA = 1 << 2

ONCS_COMPARE = 1 << 0
ONCS_WRITE_UNCOR = 1 << 1
ONCS_DSM = 1 << 2
ONCS_WRITE_ZEROES = 1 << 3
ONCS_FEATURES_SAVE = 1 << 4
ONCS_RESERVATIONS = 1 << 5
ONCS_TIMESTAMP = 1 << 6

VWC_PRESENT = 1 << 0

# SGLS bits 1:0: 01b = SGLs supported, 10b = supported with dword alignment, 00b = none.
SGLS_SUPPORTED = 1
SGLS_DWORD_ALIGNED = 2
SGLS_SUPPORT_MASK = 3
SGLS_KEYED = 1 << 2
SGLS_OFFSET = 1 << 20  # SAOS: in-capsule data addressed by an offset SGL

# --- Identify Namespace bit fields ---

NSFEAT_THIN = 1 << 0
NMIC_SHARED = 1 << 0
FLBAS_LBA_MASK = 0x0F
FLBAS_LBA_UPPER_MASK = 0x60  # bits 6:5 are bits 5:4 of the format index once more than 16 formats exist


PowerStateDescriptor = Struct(
    "mp" / _U16,
    Padding(1),
    "flags" / _U8,
    "enlat" / _U32,
    "exlat" / _U32,
    "rrt" / _U8,
    "rrl" / _U8,
    "rwt" / _U8,
    "rwl" / _U8,
    "idlp" / _U16,
    "ips" / _U8,
    Padding(1),
    "actp" / _U16,
    "apws" / _U8,
    "epfrt" / _U8,
    "fqvt" / _U8,
    "epfvt" / _U8,
    "epfr_fqv_ts" / _U8,
    "epfvts" / _U8,
    Padding(4),
)

_EMPTY_PSD = [{}] * 32

IdentifyController = Struct(
    "vid" / _U16,
    "ssvid" / _U16,
    "sn" / Default(SpacePaddedString(20), ""),
    "mn" / Default(SpacePaddedString(40), ""),
    "fr" / Default(SpacePaddedString(8), ""),
    "rab" / _U8,
    "ieee" / _raw(3),
    "cmic" / _U8,
    "mdts" / _U8,
    "cntlid" / _U16,
    "ver" / _U32,
    "rtd3r" / _U32,
    "rtd3e" / _U32,
    "oaes" / _U32,
    "ctratt" / _U32,
    "rrls" / _U16,
    Padding(9),
    "cntrltype" / _U8,
    "fguid" / _raw(16),
    "crdt1" / _U16,
    "crdt2" / _U16,
    "crdt3" / _U16,
    Padding(119),
    "nvmsr" / _U8,
    "vwci" / _U8,
    "mec" / _U8,
    # 256: admin command set attributes
    "oacs" / _U16,
    "acl" / _U8,
    "aerl" / _U8,
    "frmw" / _U8,
    "lpa" / _U8,
    "elpe" / _U8,
    "npss" / _U8,
    "avscc" / _U8,
    "apsta" / _U8,
    "wctemp" / _U16,
    "cctemp" / _U16,
    "mtfa" / _U16,
    "hmpre" / _U32,
    "hmmin" / _U32,
    "tnvmcap" / _U128,
    "unvmcap" / _U128,
    "rpmbs" / _U32,
    "edstt" / _U16,
    "dsto" / _U8,
    "fwug" / _U8,
    "kas" / _U16,
    "hctma" / _U16,
    "mntmt" / _U16,
    "mxtmt" / _U16,
    "sanicap" / _U32,
    "hmminds" / _U32,
    "hmmaxd" / _U16,
    "nsetidmax" / _U16,
    "endgidmax" / _U16,
    "anatt" / _U8,
    "anacap" / _U8,
    "anagrpmax" / _U32,
    "nanagrpid" / _U32,
    "pels" / _U32,
    "domainid" / _U16,
    Padding(10),
    "megcap" / _U128,
    "tmpthha" / _U8,
    Padding(127),
    # 512: NVM command set attributes
    "sqes" / _U8,
    "cqes" / _U8,
    "maxcmd" / _U16,
    "nn" / _U32,
    "oncs" / _U16,
    "fuses" / _U16,
    "fna" / _U8,
    "vwc" / _U8,
    "awun" / _U16,
    "awupf" / _U16,
    "icsvscc" / _U8,
    "nwpc" / _U8,
    "acwu" / _U16,
    "ocfs" / _U16,
    "sgls" / _U32,
    "mnan" / _U32,
    "maxdna" / _U128,
    "maxcna" / _U32,
    "oaqd" / _U32,
    Padding(2),
    "cmmrtd" / _U16,
    "nmmrtd" / _U16,
    "minmrtg" / _U8,
    "maxmrtg" / _U8,
    "trattr" / _U8,
    Padding(1),
    "mcudmq" / _U16,
    "mnsudmq" / _U16,
    "mcmr" / _U16,
    "nmcmr" / _U16,
    "mcdqpc" / _U16,
    Padding(180),
    "subnqn" / Default(NqnString(256), ""),
    Padding(768),
    # 1792: fabrics only
    "ioccsz" / _U32,
    "iorcsz" / _U32,
    "icdoff" / _U16,
    "fcatt" / _U8,
    "msdbd" / _U8,
    "ofcs" / _U16,
    "dctype" / _U8,
    Padding(241),
    "psd" / Default(Array(32, PowerStateDescriptor), _EMPTY_PSD),
    "vs" / _raw(1024),
)

LbaFormat = Struct(
    "ms" / _U16,
    "lbads" / _U8,  # log2 of the LBA data size; 0 marks an unsupported format
    "rp" / _U8,
)

_EMPTY_LBAF = [{}] * 64

IdentifyNamespace = Struct(
    "nsze" / _U64,
    "ncap" / _U64,
    "nuse" / _U64,
    "nsfeat" / _U8,
    "nlbaf" / _U8,
    "flbas" / _U8,
    "mc" / _U8,
    "dpc" / _U8,
    "dps" / _U8,
    "nmic" / _U8,
    "rescap" / _U8,
    "fpi" / _U8,
    "dlfeat" / _U8,
    "nawun" / _U16,
    "nawupf" / _U16,
    "nacwu" / _U16,
    "nabsn" / _U16,
    "nabo" / _U16,
    "nabspf" / _U16,
    "noiob" / _U16,
    "nvmcap" / _U128,
    "npwg" / _U16,
    "npwa" / _U16,
    "npdg" / _U16,
    "npda" / _U16,
    "nows" / _U16,
    "mssrl" / _U16,
    "mcl" / _U32,
    "msrc" / _U8,
    "kpios" / _U8,
    "nulbaf" / _U8,
    Padding(1),
    "kpiodaag" / _U32,
    Padding(4),
    "anagrpid" / _U32,
    Padding(3),
    "nsattr" / _U8,
    "nvmsetid" / _U16,
    "endgid" / _U16,
    "nguid" / _raw(16),
    "eui64" / _raw(8),
    "lbaf" / Default(Array(64, LbaFormat), _EMPTY_LBAF),
    Padding(3456),
    "vs" / _raw(256),
)


def flbas_index(flbas: int) -> int:
    """The LBA format index FLBAS selects (bits 3:0, plus bits 6:5 as the index's bits 5:4)."""
    return (flbas & FLBAS_LBA_MASK) | ((flbas & FLBAS_LBA_UPPER_MASK) >> 1)


# --- Namespace Identification Descriptor list (CNS 03h) ---

NIDT_EUI64 = 1
NIDT_NGUID = 2
NIDT_UUID = 3
NIDT_CSI = 4

NIDT_LENGTHS = {NIDT_EUI64: 8, NIDT_NGUID: 16, NIDT_UUID: 16, NIDT_CSI: 1}
_NIDT_NAMES = {NIDT_EUI64: "eui64", NIDT_NGUID: "nguid", NIDT_UUID: "uuid", NIDT_CSI: "csi"}

NsIdDescriptor = Struct(
    "nidt" / Int8ul,
    "nidl" / Int8ul,
    Padding(2),
    "nid" / Bytes(this.nidl),
)

_NS_DESC_HEADER = 4


def _check_id(name: str, value: bytes | None, length: int) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    value = bytes(value)
    if len(value) != length:
        raise ValueError(f"{name} must be {length} bytes, got {len(value)}")
    return value if any(value) else None


def build_ns_descriptor_list(
    eui64: bytes | None, nguid: bytes | None, uuid: bytes | None, csi: int | None = None
) -> bytes:
    """The 4096-byte CNS 03h reply; all-zero or None identifiers are left out, as the spec asks."""
    entries: list[tuple[int, bytes]] = []
    given = ((NIDT_EUI64, eui64), (NIDT_NGUID, nguid), (NIDT_UUID, uuid))
    for nidt, value in given:
        checked = _check_id(_NIDT_NAMES[nidt], value, NIDT_LENGTHS[nidt])
        if checked is not None:
            entries.append((nidt, checked))
    if csi is not None:
        if not isinstance(csi, int) or not 0 <= csi <= 0xFF:
            raise ValueError(f"csi must be an int in 0..255, got {csi!r}")
        entries.append((NIDT_CSI, bytes([csi])))
    out = b"".join(
        NsIdDescriptor.build({"nidt": nidt, "nidl": len(nid), "nid": nid}) for nidt, nid in entries
    )
    return out.ljust(IDENTIFY_DATA_SIZE, b"\x00")


def parse_ns_descriptor_list(buf: bytes | bytearray | memoryview) -> dict[str, bytes | int]:
    """Decode a CNS 03h reply to {"eui64"|"nguid"|"uuid": bytes, "csi": int}.

    Stops at the first descriptor with NIDL 0 (the list terminator); skips unknown types as the Linux
    host does; rejects a known type with the wrong length, a duplicate type, or a descriptor that
    runs past the buffer.
    """
    data = bytes(buf)
    result: dict[str, bytes | int] = {}
    pos = 0
    while pos + _NS_DESC_HEADER <= len(data):
        nidt, nidl = data[pos], data[pos + 1]
        if nidl == 0:
            break
        end = pos + _NS_DESC_HEADER + nidl
        if end > len(data):
            raise ValueError(
                f"descriptor at byte {pos} (NIDT {nidt}, NIDL {nidl}) runs past the {len(data)}-byte list"
            )
        nid = data[pos + _NS_DESC_HEADER : end]
        name = _NIDT_NAMES.get(nidt)
        if name is not None:
            if nidl != NIDT_LENGTHS[nidt]:
                raise ValueError(
                    f"descriptor at byte {pos}: NIDT {nidt} ({name}) "
                    f"needs NIDL {NIDT_LENGTHS[nidt]}, got {nidl}"
                )
            if name in result:
                raise ValueError(f"descriptor at byte {pos}: duplicate NIDT {nidt} ({name})")
            result[name] = nid[0] if nidt == NIDT_CSI else nid
        pos = end
    return result


# --- Namespace List: 1024 NSIDs, zero-terminated (Identify CNS 02h, Changed Namespace List log) ---

NS_LIST_ENTRIES = IDENTIFY_DATA_SIZE // 4
NSID_MAX = 0xFFFFFFFE  # FFFFFFFFh is the broadcast value, never a namespace

ActiveNsList = Array(NS_LIST_ENTRIES, Int32ul)


def check_nsid(nsid: object) -> int:
    """``nsid`` if it names a namespace (1..FFFFFFFEh), else ValueError."""
    if not isinstance(nsid, int) or not 1 <= nsid <= NSID_MAX:
        raise ValueError(f"NSID {nsid!r} is outside 1..0x{NSID_MAX:X}")
    return nsid


def parse_ns_list(buf: bytes | bytearray | memoryview, what: str = "namespace list") -> list[int]:
    """NSIDs of a Namespace List, up to the first zero entry. Accepts a short (dword-multiple) read;
    ``what`` names the list in the error."""
    data = bytes(buf)
    if len(data) % 4 or len(data) > IDENTIFY_DATA_SIZE:
        raise ValueError(f"{what} must be a multiple of 4 bytes up to {IDENTIFY_DATA_SIZE}, got {len(data)}")
    out: list[int] = []
    for off in range(0, len(data), 4):
        nsid = int.from_bytes(data[off : off + 4], "little")
        if nsid == 0:
            break
        out.append(nsid)
    return out


def build_active_ns_list(nsids: Iterable[int], start_after: int) -> bytes:
    """Ascending NSIDs greater than `start_after`, at most 1024, zero-filled to 4096 bytes."""
    if not isinstance(start_after, int) or not 0 <= start_after <= 0xFFFFFFFF:
        raise ValueError(f"start_after must be an NSID in 0..0xFFFFFFFF, got {start_after!r}")
    chosen: set[int] = set()
    for nsid in nsids:
        if check_nsid(nsid) > start_after:
            chosen.add(nsid)
    entries = sorted(chosen)[:NS_LIST_ENTRIES]
    return ActiveNsList.build(entries + [0] * (NS_LIST_ENTRIES - len(entries)))


def parse_active_ns_list(buf: bytes | bytearray | memoryview) -> list[int]:
    """NSIDs of a CNS 02h reply, up to the first zero entry. Accepts a short (dword-multiple) read."""
    return parse_ns_list(buf)
