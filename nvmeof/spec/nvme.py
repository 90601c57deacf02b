"""NVMe submission/completion entries, SGL descriptors and the opcode/identifier enums.

Layouts: NVMe Base Specification 2.0 §4.2 (SQE), §4.6 (CQE), §4.1.2 (SGL); Linux
include/linux/nvme.h ``struct nvme_common_command``, ``struct nvme_completion``,
``struct nvme_sgl_desc`` / ``struct nvme_keyed_sgl_desc``.

The construct definitions are the source of truth; ``Command`` and ``Completion`` are the struct-based
fast path used per I/O, and tests prove both read and write the same bytes.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from construct import Bytes, Int8ul, Int16ul, Int24ul, Int32ul, Int64ul, Struct

SQE_SIZE = 64
CQE_SIZE = 16
NSID_ALL = 0xFFFFFFFF  # broadcast NSID (Flush, Get Log Page for the controller)


class AdminOpcode(enum.IntEnum):
    DELETE_SQ = 0x00
    CREATE_SQ = 0x01
    GET_LOG_PAGE = 0x02
    DELETE_CQ = 0x04
    CREATE_CQ = 0x05
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A
    ASYNC_EVENT_REQUEST = 0x0C
    NS_MANAGEMENT = 0x0D
    FW_COMMIT = 0x10
    FW_DOWNLOAD = 0x11
    NS_ATTACH = 0x15
    KEEP_ALIVE = 0x18
    DIRECTIVE_SEND = 0x19
    DIRECTIVE_RECV = 0x1A
    DBBUF = 0x7C
    FABRICS = 0x7F
    FORMAT_NVM = 0x80
    SECURITY_SEND = 0x81
    SECURITY_RECV = 0x82
    SANITIZE = 0x84


class Direction(enum.IntEnum):
    """Which way a command's data moves; the values are those of an opcode's bits 1:0 (NVMe Base 2.0
    §3.3.1 "data transfer" 01b/10b). One enum for both transports and both roles."""

    NONE = 0
    H2C = 1   # host to controller: the command carries data (Write, Connect, Set Features ...)
    C2H = 2   # controller to host: the command returns data (Read, Identify, Get Log Page ...)


class IoOpcode(enum.IntEnum):
    FLUSH = 0x00
    WRITE = 0x01
    READ = 0x02
    WRITE_UNCORRECTABLE = 0x04
    COMPARE = 0x05
    WRITE_ZEROES = 0x08
    DATASET_MANAGEMENT = 0x09
    VERIFY = 0x0C
    RESV_REGISTER = 0x0D
    RESV_REPORT = 0x0E
    RESV_ACQUIRE = 0x11
    RESV_RELEASE = 0x15
    COPY = 0x19
    FABRICS = 0x7F


# I/O commands that address an LBA range starting at SLBA (CDW10-11): an Error Information log entry
# for one of them reports that LBA (NVMe Base 2.0 §5.16.1.2); for other commands the field is 0.
LBA_OPCODES = frozenset({IoOpcode.WRITE, IoOpcode.READ, IoOpcode.COMPARE, IoOpcode.WRITE_ZEROES})


class FabricsType(enum.IntEnum):
    PROPERTY_SET = 0x00
    CONNECT = 0x01
    PROPERTY_GET = 0x04
    AUTH_SEND = 0x05
    AUTH_RECEIVE = 0x06
    DISCONNECT = 0x08


class FeatureId(enum.IntEnum):
    ARBITRATION = 0x01
    POWER_MGMT = 0x02
    LBA_RANGE = 0x03
    TEMP_THRESHOLD = 0x04
    ERR_RECOVERY = 0x05
    VOLATILE_WC = 0x06
    NUM_QUEUES = 0x07
    IRQ_COALESCE = 0x08
    IRQ_CONFIG = 0x09
    WRITE_ATOMIC = 0x0A
    ASYNC_EVENT = 0x0B
    AUTO_PST = 0x0C
    HOST_MEM_BUF = 0x0D
    TIMESTAMP = 0x0E
    KATO = 0x0F
    HOST_BEHAVIOR = 0x16
    HOST_ID = 0x81
    RESV_MASK = 0x82
    RESV_PERSIST = 0x83


# Feature names as nvme-cli prints them (src/nvme-print.c ``nvme_feature_to_string``; others: "Unknown"),
# and Get Features SEL names (``nvme_select_to_string``).
FEATURE_NAMES = {
    FeatureId.ARBITRATION: "Arbitration", FeatureId.POWER_MGMT: "Power Management",
    FeatureId.LBA_RANGE: "LBA Range Type", FeatureId.TEMP_THRESHOLD: "Temperature Threshold",
    FeatureId.ERR_RECOVERY: "Error Recovery", FeatureId.VOLATILE_WC: "Volatile Write Cache",
    FeatureId.NUM_QUEUES: "Number of Queues", FeatureId.IRQ_COALESCE: "Interrupt Coalescing",
    FeatureId.IRQ_CONFIG: "Interrupt Vector Configuration", FeatureId.WRITE_ATOMIC: "Write Atomicity Normal",
    FeatureId.ASYNC_EVENT: "Async Event Configuration", FeatureId.AUTO_PST: "Autonomous Power State Transition",
    FeatureId.HOST_MEM_BUF: "Host Memory Buffer", FeatureId.TIMESTAMP: "Timestamp",
    FeatureId.KATO: "Keep Alive Timer", FeatureId.HOST_BEHAVIOR: "Host Behavior",
    FeatureId.HOST_ID: "Host Identifier", FeatureId.RESV_MASK: "Reservation Notification Mask",
    FeatureId.RESV_PERSIST: "Reservation Persistence",
}
SELECT_NAMES = {0: "Current", 1: "Default", 2: "Saved", 3: "Supported capabilities"}


class LogPageId(enum.IntEnum):
    ERROR = 0x01
    SMART = 0x02
    FW_SLOT = 0x03
    CHANGED_NS = 0x04
    CMD_EFFECTS = 0x05
    ANA = 0x0C
    DISCOVERY = 0x70
    RESERVATION = 0x80


class Cns(enum.IntEnum):
    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NS_LIST = 0x02
    NS_DESC_LIST = 0x03
    CS_NS = 0x05
    CS_CTRL = 0x06
    CS_ACTIVE_NS_LIST = 0x07
    NS_CS_INDEP = 0x08


class AsyncEventType(enum.IntEnum):
    ERROR = 0x0
    SMART = 0x1
    NOTICE = 0x2
    IO_CMD_SET = 0x6
    VENDOR = 0x7


class AsyncEventNotice(enum.IntEnum):
    NS_ATTR_CHANGED = 0x00
    FW_ACT_STARTING = 0x01
    ANA_CHANGE = 0x03
    DISC_LOG_CHANGE = 0xF0


# SGL descriptor identifier byte: (type << 4) | subtype (NVMe 2.0 Figure 117/118)
SGL_TYPE_DATA_BLOCK = 0x0
SGL_TYPE_KEYED_DATA_BLOCK = 0x4
SGL_TYPE_TRANSPORT_DATA_BLOCK = 0x5
SGL_SUBTYPE_ADDRESS = 0x0
SGL_SUBTYPE_OFFSET = 0x1
SGL_SUBTYPE_TRANSPORT = 0xA
SGL_SUBTYPE_INVALIDATE = 0xF
SGL_ID_INCAPSULE = (SGL_TYPE_DATA_BLOCK << 4) | SGL_SUBTYPE_OFFSET              # 0x01
SGL_ID_TRANSPORT = (SGL_TYPE_TRANSPORT_DATA_BLOCK << 4) | SGL_SUBTYPE_TRANSPORT  # 0x5A
SGL_ID_KEYED = (SGL_TYPE_KEYED_DATA_BLOCK << 4) | SGL_SUBTYPE_ADDRESS           # 0x40
SGL_ID_KEYED_INVALIDATE = (SGL_TYPE_KEYED_DATA_BLOCK << 4) | SGL_SUBTYPE_INVALIDATE  # 0x4F

# SQE flags byte: FUSE bits 1:0, PSDT bits 7:6 (01b = SGL for data, MPTR an address)
SQE_FLAGS_PSDT_SGL = 0x40
SQE_FLAGS_PSDT_MASK = 0xC0

# CDW12 bits of Read/Write/Write Zeroes/Compare
RW_FUA = 1 << 30
RW_LIMITED_RETRY = 1 << 31
WZ_DEAC = 1 << 25
# Dataset Management CDW11 attributes
DSM_IDR = 1 << 0
DSM_IDW = 1 << 1
DSM_AD = 1 << 2


SglDataBlock = Struct(
    "addr" / Int64ul,
    "length" / Int32ul,
    "rsvd" / Bytes(3),
    "sgl_id" / Int8ul,
)

SglKeyedDataBlock = Struct(
    "addr" / Int64ul,
    "length" / Int24ul,
    "key" / Int32ul,
    "sgl_id" / Int8ul,
)

SQE = Struct(
    "opcode" / Int8ul,
    "flags" / Int8ul,
    "cid" / Int16ul,
    "nsid" / Int32ul,
    "cdw2" / Int32ul,
    "cdw3" / Int32ul,
    "mptr" / Int64ul,
    "dptr" / Bytes(16),
    "cdw10" / Int32ul,
    "cdw11" / Int32ul,
    "cdw12" / Int32ul,
    "cdw13" / Int32ul,
    "cdw14" / Int32ul,
    "cdw15" / Int32ul,
)

CQE = Struct(
    "dw0" / Int32ul,
    "dw1" / Int32ul,
    "sqhd" / Int16ul,
    "sqid" / Int16ul,
    "cid" / Int16ul,
    "status" / Int16ul,
)

# Dataset Management range: context attributes, length in blocks, starting LBA (16 B)
DsmRange = Struct(
    "cattr" / Int32ul,
    "nlb" / Int32ul,
    "slba" / Int64ul,
)
DSM_RANGE_SIZE = 16


class SglFields(NamedTuple):
    sgl_id: int
    addr: int
    length: int
    key: int


_SQE = struct.Struct("<BBHIIIQ16sIIIIII")
_CQE = struct.Struct("<IIHHHH")
_SGL = struct.Struct("<QI3xB")
_SGL_KEYED = struct.Struct("<Q3sIB")


class Command:
    """One submission queue entry, parsed with ``struct`` for the per-command path."""

    __slots__ = ("cdw2", "cdw3", "cdw10", "cdw11", "cdw12", "cdw13", "cdw14", "cdw15", "cid", "dptr",
                 "flags", "mptr", "nsid", "opcode")

    def __init__(self, opcode: int = 0, *, flags: int = SQE_FLAGS_PSDT_SGL, cid: int = 0, nsid: int = 0,
                 cdw2: int = 0, cdw3: int = 0, mptr: int = 0, dptr: bytes = bytes(16), cdw10: int = 0,
                 cdw11: int = 0, cdw12: int = 0, cdw13: int = 0, cdw14: int = 0, cdw15: int = 0) -> None:
        self.opcode = opcode
        self.flags = flags
        self.cid = cid
        self.nsid = nsid
        self.cdw2 = cdw2
        self.cdw3 = cdw3
        self.mptr = mptr
        self.dptr = dptr
        self.cdw10 = cdw10
        self.cdw11 = cdw11
        self.cdw12 = cdw12
        self.cdw13 = cdw13
        self.cdw14 = cdw14
        self.cdw15 = cdw15

    @classmethod
    def from_bytes(cls, buf: bytes | bytearray | memoryview) -> Command:
        c = cls.__new__(cls)
        (c.opcode, c.flags, c.cid, c.nsid, c.cdw2, c.cdw3, c.mptr, c.dptr, c.cdw10, c.cdw11, c.cdw12,
         c.cdw13, c.cdw14, c.cdw15) = _SQE.unpack(buf)
        return c

    def to_bytes(self) -> bytes:
        return _SQE.pack(self.opcode, self.flags, self.cid, self.nsid, self.cdw2, self.cdw3, self.mptr,
                         self.dptr, self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15)

    def pack_into(self, buf: bytearray | memoryview, offset: int = 0) -> None:
        _SQE.pack_into(buf, offset, self.opcode, self.flags, self.cid, self.nsid, self.cdw2, self.cdw3,
                       self.mptr, self.dptr, self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14,
                       self.cdw15)

    @property
    def fctype(self) -> int:
        """Fabrics command type: byte 4 of a Fabrics SQE, where other commands keep NSID."""
        return self.nsid & 0xFF

    @property
    def slba(self) -> int:
        return self.cdw10 | (self.cdw11 << 32)

    @property
    def nlb(self) -> int:
        """Number of logical blocks, 1-based (CDW12 bits 15:0 hold it 0-based)."""
        return (self.cdw12 & 0xFFFF) + 1

    @property
    def sgl_id(self) -> int:
        return self.dptr[15]

    def sgl(self) -> SglFields:
        sgl_id = self.dptr[15]
        if sgl_id >> 4 == SGL_TYPE_KEYED_DATA_BLOCK:
            addr, length, key, _ = _SGL_KEYED.unpack(self.dptr)
            return SglFields(sgl_id, addr, int.from_bytes(length, "little"), key)
        addr, length, _ = _SGL.unpack(self.dptr)
        return SglFields(sgl_id, addr, length, 0)

    @staticmethod
    def make_sgl(sgl_id: int, addr: int = 0, length: int = 0, key: int = 0) -> bytes:
        if sgl_id >> 4 == SGL_TYPE_KEYED_DATA_BLOCK:
            if length >= 1 << 24:
                raise ValueError(f"keyed SGL length {length} does not fit 24 bits")
            return _SGL_KEYED.pack(addr, length.to_bytes(3, "little"), key, sgl_id)
        return _SGL.pack(addr, length, sgl_id)

    def __repr__(self) -> str:
        return (f"Command(opcode={self.opcode:#04x}, cid={self.cid}, nsid={self.nsid}, "
                f"cdw10={self.cdw10:#x}, cdw11={self.cdw11:#x}, cdw12={self.cdw12:#x}, sgl={self.sgl()})")


class Completion:
    """One completion queue entry; ``status`` is the raw last u16 (phase bit 0, status field 15:1)."""

    __slots__ = ("cid", "dw0", "dw1", "sqhd", "sqid", "status")

    def __init__(self, cid: int = 0, *, dw0: int = 0, dw1: int = 0, sqhd: int = 0, sqid: int = 0,
                 status: int = 0) -> None:
        self.dw0 = dw0
        self.dw1 = dw1
        self.sqhd = sqhd
        self.sqid = sqid
        self.cid = cid
        self.status = status

    @classmethod
    def from_bytes(cls, buf: bytes | bytearray | memoryview) -> Completion:
        c = cls.__new__(cls)
        c.dw0, c.dw1, c.sqhd, c.sqid, c.cid, c.status = _CQE.unpack(buf)
        return c

    def to_bytes(self) -> bytes:
        return _CQE.pack(self.dw0, self.dw1, self.sqhd, self.sqid, self.cid, self.status)

    @property
    def status_code(self) -> int:
        """(SCT << 8) | SC, comparable with :class:`nvmeof.status.Status`."""
        return (self.status >> 1) & 0x7FF

    @property
    def dnr(self) -> bool:
        return bool(self.status & 0x8000)

    @property
    def more(self) -> bool:
        return bool(self.status & 0x4000)

    @property
    def result(self) -> int:
        return self.dw0 | (self.dw1 << 32)

    def __repr__(self) -> str:
        return (f"Completion(cid={self.cid}, status={self.status_code:#05x}, dw0={self.dw0:#x}, "
                f"sqhd={self.sqhd}, sqid={self.sqid})")


def pack_cqe(cid: int, status_field: int = 0, dw0: int = 0, dw1: int = 0, sqhd: int = 0,
             sqid: int = 0) -> bytes:
    """Build a CQE from the 15-bit status field (see :func:`nvmeof.status.encode_status`)."""
    return _CQE.pack(dw0, dw1, sqhd, sqid, cid, (status_field << 1) & 0xFFFF)
