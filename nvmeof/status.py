"""NVMe completion status: one enum for every status code the product returns or decodes.

Values are ``(SCT << 8) | SC`` so one integer names a status; the CQE status field (bits 15:1 of
CQE DW3 upper half) also carries More and DNR, which travel separately in :class:`NvmeError`.
Sources: include/linux/nvme.h ``NVME_SC_*``; NVMe Base Specification 2.0 Figures 100-103.
"""

from __future__ import annotations

import enum


class StatusCodeType(enum.IntEnum):
    GENERIC = 0x0
    COMMAND_SPECIFIC = 0x1
    MEDIA = 0x2
    PATH = 0x3
    VENDOR = 0x7


class Status(enum.IntEnum):
    # Generic command status (SCT 0)
    SUCCESS = 0x000
    INVALID_OPCODE = 0x001
    INVALID_FIELD = 0x002
    CMDID_CONFLICT = 0x003
    DATA_XFER_ERROR = 0x004
    POWER_LOSS = 0x005
    INTERNAL = 0x006
    ABORT_REQ = 0x007
    ABORT_QUEUE = 0x008
    FUSED_FAIL = 0x009
    FUSED_MISSING = 0x00A
    INVALID_NS = 0x00B
    CMD_SEQ_ERROR = 0x00C
    SGL_INVALID_LAST = 0x00D
    SGL_INVALID_COUNT = 0x00E
    SGL_INVALID_DATA = 0x00F
    SGL_INVALID_METADATA = 0x010
    SGL_INVALID_TYPE = 0x011
    CMB_INVALID_USE = 0x012
    PRP_INVALID_OFFSET = 0x013
    ATOMIC_WU_EXCEEDED = 0x014
    OP_DENIED = 0x015
    SGL_INVALID_OFFSET = 0x016
    HOST_ID_INCONSIST = 0x018
    KA_TIMEOUT_EXPIRED = 0x019
    KA_TIMEOUT_INVALID = 0x01A
    ABORTED_PREEMPT_ABORT = 0x01B
    SANITIZE_FAILED = 0x01C
    SANITIZE_IN_PROGRESS = 0x01D
    SGL_INVALID_GRANULARITY = 0x01E
    CMD_NOT_SUP_CMB_QUEUE = 0x01F
    NS_WRITE_PROTECTED = 0x020
    CMD_INTERRUPTED = 0x021
    TRANSIENT_TR_ERR = 0x022
    ADMIN_CMD_MEDIA_NOT_READY = 0x024
    INVALID_IO_CMD_SET = 0x02C
    LBA_RANGE = 0x080
    CAP_EXCEEDED = 0x081
    NS_NOT_READY = 0x082
    RESERVATION_CONFLICT = 0x083
    FORMAT_IN_PROGRESS = 0x084
    # Command specific status (SCT 1)
    CQ_INVALID = 0x100
    QID_INVALID = 0x101
    QUEUE_SIZE = 0x102
    ABORT_LIMIT = 0x103
    ASYNC_LIMIT = 0x105
    FIRMWARE_SLOT = 0x106
    FIRMWARE_IMAGE = 0x107
    INVALID_VECTOR = 0x108
    INVALID_LOG_PAGE = 0x109
    INVALID_FORMAT = 0x10A
    FW_NEEDS_CONV_RESET = 0x10B
    INVALID_QUEUE = 0x10C
    FEATURE_NOT_SAVEABLE = 0x10D
    FEATURE_NOT_CHANGEABLE = 0x10E
    FEATURE_NOT_PER_NS = 0x10F
    NS_ID_UNAVAILABLE = 0x116
    # Fabrics command specific (SCT 1; include/linux/nvme.h NVME_SC_CONNECT_*). The I/O command set
    # reuses 0x180-0x182 (Conflicting Attributes, Invalid PI, Write to Read Only Range); we never
    # return those, so the Fabrics names own the code points.
    CONNECT_FORMAT = 0x180
    CONNECT_CTRL_BUSY = 0x181
    CONNECT_INVALID_PARAM = 0x182
    CONNECT_RESTART_DISC = 0x183
    CONNECT_INVALID_HOST = 0x184
    DISCOVERY_RESTART = 0x190
    AUTH_REQUIRED = 0x191
    # Media and data integrity errors (SCT 2)
    WRITE_FAULT = 0x280
    READ_ERROR = 0x281
    GUARD_CHECK = 0x282
    APPTAG_CHECK = 0x283
    REFTAG_CHECK = 0x284
    COMPARE_FAILED = 0x285
    ACCESS_DENIED = 0x286
    UNWRITTEN_BLOCK = 0x287
    # Path related status (SCT 3)
    ANA_PERSISTENT_LOSS = 0x301
    ANA_INACCESSIBLE = 0x302
    ANA_TRANSITION = 0x303
    HOST_PATH_ERROR = 0x370
    HOST_ABORTED_CMD = 0x371

    @property
    def sct(self) -> int:
        return self.value >> 8

    @property
    def sc(self) -> int:
        return self.value & 0xFF


STATUS_DNR = 0x4000   # bit 14 of the 15-bit status field (CQE DW3 bit 31)
STATUS_MORE = 0x2000  # bit 13 (CQE DW3 bit 30)


def describe(value: int) -> str:
    """Readable name for an SCT/SC pair, falling back to hex for codes we do not name."""
    try:
        return Status(value).name
    except ValueError:
        return f"SCT {value >> 8:#x} SC {value & 0xFF:#04x}"


class NvmeError(Exception):
    """An NVMe command completed, or must complete, with a non-success status.

    ``status`` is ``(SCT << 8) | SC``; ``dnr`` and ``more`` are the CQE bits; ``result`` is DW0
    (for example the IATTR/IPO of a failed Connect). ``detail`` is the human reason that gets logged;
    ``logged`` says it has been already (where the failure was found), so the target's completion
    path (Target.fail) does not log it twice.
    """

    status: int
    dnr: bool
    more: bool
    result: int
    detail: str
    logged: bool

    def __init__(self, status: int, detail: str = "", *, dnr: bool = True, more: bool = False,
                 result: int = 0, logged: bool = False) -> None:
        self.status = int(status)
        self.dnr = dnr
        self.more = more
        self.result = result
        self.detail = detail
        self.logged = logged
        super().__init__(f"{describe(self.status)} (sct={self.sct:#x}, sc={self.sc:#04x}"
                         f"{', dnr' if dnr else ''}){': ' + detail if detail else ''}")

    @property
    def sct(self) -> int:
        return self.status >> 8

    @property
    def sc(self) -> int:
        return self.status & 0xFF

    @property
    def name(self) -> str:
        return describe(self.status)

    def cqe_status(self) -> int:
        """The 15-bit status field as it sits in CQE bits 31:17 (phase bit excluded)."""
        return encode_status(self.status, dnr=self.dnr, more=self.more)

    def mark_logged(self) -> NvmeError:
        """Record that the failure has been logged; returns the error, for ``raise err.mark_logged()``."""
        self.logged = True
        return self


def encode_status(status: int, *, dnr: bool = False, more: bool = False) -> int:
    """15-bit CQE status (SC bits 7:0, SCT 10:8, CRD 12:11, More 13, DNR 14)."""
    return (status & 0x7FF) | (STATUS_MORE if more else 0) | (STATUS_DNR if dnr else 0)
