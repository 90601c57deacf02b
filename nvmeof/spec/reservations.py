"""Reservations (NVMe Base 2.0, "Reservations"; NVM command set opcodes 0Dh, 0Eh, 11h, 15h).

Command dword fields, the data each command carries, the Reservation Status data structure that
Reservation Report returns (regular and extended, EDS), and the Reservation Notification log page
(80h). Layouts checked against Linux include/linux/nvme.h (``nvme_reservation_status``,
``nvme_reservation_status_ext``, ``nvme_registered_ctrl(_ext)``, ``nvme_pr_log``) and nvme-cli.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from construct import Bytes, Default, Int8ul, Int16ul, Int32ul, Int64ul, Padding, Struct

_U8 = Default(Int8ul, 0)
_U16 = Default(Int16ul, 0)
_U32 = Default(Int32ul, 0)
_U64 = Default(Int64ul, 0)


class ReservationType(enum.IntEnum):
    """RTYPE (Acquire/Release CDW10 bits 15:8, Report byte 4)."""

    WRITE_EXCLUSIVE = 1
    EXCLUSIVE_ACCESS = 2
    WRITE_EXCLUSIVE_REG_ONLY = 3
    EXCLUSIVE_ACCESS_REG_ONLY = 4
    WRITE_EXCLUSIVE_ALL_REGS = 5
    EXCLUSIVE_ACCESS_ALL_REGS = 6

    @property
    def all_registrants(self) -> bool:
        """Types 5 and 6: every registrant is a holder."""
        return self in (ReservationType.WRITE_EXCLUSIVE_ALL_REGS, ReservationType.EXCLUSIVE_ACCESS_ALL_REGS)

    @property
    def registrants_only(self) -> bool:
        """Types 3 to 6: registrants keep access; 1 and 2 give it to the holder alone."""
        return self >= ReservationType.WRITE_EXCLUSIVE_REG_ONLY

    @property
    def exclusive_access(self) -> bool:
        """Types 2, 4 and 6 also keep reads from those without access (1, 3, 5 only writes)."""
        return self in (ReservationType.EXCLUSIVE_ACCESS, ReservationType.EXCLUSIVE_ACCESS_REG_ONLY,
                        ReservationType.EXCLUSIVE_ACCESS_ALL_REGS)


# nvme-cli's names (nvme-print.c ``nvme_show_resv_report``: "Write Exclusive", ...) as words
RTYPE_NAMES = {
    ReservationType.WRITE_EXCLUSIVE: "write-exclusive",
    ReservationType.EXCLUSIVE_ACCESS: "exclusive-access",
    ReservationType.WRITE_EXCLUSIVE_REG_ONLY: "write-exclusive-registrants-only",
    ReservationType.EXCLUSIVE_ACCESS_REG_ONLY: "exclusive-access-registrants-only",
    ReservationType.WRITE_EXCLUSIVE_ALL_REGS: "write-exclusive-all-registrants",
    ReservationType.EXCLUSIVE_ACCESS_ALL_REGS: "exclusive-access-all-registrants",
}


class RegisterAction(enum.IntEnum):
    """RREGA, Reservation Register CDW10 bits 2:0."""

    REGISTER = 0
    UNREGISTER = 1
    REPLACE = 2


class AcquireAction(enum.IntEnum):
    """RACQA, Reservation Acquire CDW10 bits 2:0."""

    ACQUIRE = 0
    PREEMPT = 1
    PREEMPT_AND_ABORT = 2


class ReleaseAction(enum.IntEnum):
    """RRELA, Reservation Release CDW10 bits 2:0."""

    RELEASE = 0
    CLEAR = 1


class Cptpl(enum.IntEnum):
    """Change Persist Through Power Loss State, Reservation Register CDW10 bits 31:30 (01b reserved)."""

    NO_CHANGE = 0
    CLEAR = 2
    SET = 3


ACTION_MASK = 0x7
IEKEY = 1 << 3            # Ignore Existing Key (Register; Acquire and Release must leave it clear)
CPTPL_SHIFT = 30
RTYPE_SHIFT = 8
REPORT_EDS = 1 << 0       # Reservation Report CDW11 bit 0: extended data structure (128-bit host ids)

# Identify Namespace RESCAP (byte 31): PTPL, the six types, and bit 7: IEKEY as NVMe 1.3 defines it
RESCAP_PTPL = 1 << 0
RESCAP_IEKEY_13 = 1 << 7
RESCAP_ALL = RESCAP_PTPL | sum(1 << int(t) for t in ReservationType) | RESCAP_IEKEY_13
NMIC_SHARED = 1 << 0      # Identify Namespace NMIC bit 0: may be reached through several controllers

# Feature 82h (Reservation Notification Mask) CDW11 bits; a set bit suppresses that notification
MASK_REGISTRATION_PREEMPTED = 1 << 1
MASK_RESERVATION_RELEASED = 1 << 2
MASK_RESERVATION_PREEMPTED = 1 << 3
MASK_ALL = MASK_REGISTRATION_PREEMPTED | MASK_RESERVATION_RELEASED | MASK_RESERVATION_PREEMPTED
PTPL_FEATURE_BIT = 1 << 0  # Feature 83h (Reservation Persistence) CDW11 / DW0 bit 0

# Asynchronous event: type 6h (I/O command specific status), info 00h: Reservation Log Page Available
AEN_INFO_RESERVATION_LOG = 0x00

CNTLID_DYNAMIC = 0xFFFF   # Report: a registrant is a host, not one controller (nvmet does the same)

# Register: CRKEY, NRKEY. Acquire: CRKEY, PRKEY. Release: CRKEY.
RegisterData = Struct("crkey" / _U64, "nrkey" / _U64)
AcquireData = Struct("crkey" / _U64, "prkey" / _U64)
ReleaseData = Struct("crkey" / _U64)
REGISTER_DATA_SIZE = 16
ACQUIRE_DATA_SIZE = 16
RELEASE_DATA_SIZE = 8

ReservationStatusHeader = Struct(
    "gen" / _U32,
    "rtype" / _U8,
    "regctl" / _U16,
    Padding(2),
    "ptpls" / _U8,
    Padding(14),
)
ReservationStatusExtHeader = Struct(
    "gen" / _U32,
    "rtype" / _U8,
    "regctl" / _U16,
    Padding(2),
    "ptpls" / _U8,
    Padding(54),
)
RegisteredController = Struct(
    "cntlid" / _U16,
    "rcsts" / _U8,          # bit 0: this registrant holds the reservation
    Padding(5),
    "hostid" / Default(Bytes(8), bytes(8)),
    "rkey" / _U64,
)
RegisteredControllerExt = Struct(
    "cntlid" / _U16,
    "rcsts" / _U8,
    Padding(5),
    "rkey" / _U64,
    "hostid" / Default(Bytes(16), bytes(16)),
    Padding(32),
)
HEADER_SIZE = 24
EXT_HEADER_SIZE = 64
ENTRY_SIZE = 24
EXT_ENTRY_SIZE = 64
RCSTS_HOLDS = 1 << 0


class NotificationType(enum.IntEnum):
    """Reservation Notification log page type (byte 8)."""

    EMPTY = 0
    REGISTRATION_PREEMPTED = 1
    RESERVATION_RELEASED = 2
    RESERVATION_PREEMPTED = 3


ReservationNotificationLog = Struct(
    "count" / _U64,          # 64-bit counter of log pages made for this controller; 0 is never used
    "type" / _U8,
    "nalp" / _U8,            # how many more pages are waiting (255 means 255 or more)
    Padding(2),
    "nsid" / _U32,
    Padding(48),
)
NOTIFICATION_LOG_SIZE = 64


@dataclass(frozen=True, slots=True)
class Registrant:
    """One entry of a Reservation Report."""

    cntlid: int
    holds: bool
    hostid: bytes       # 16 bytes (extended) or 8
    rkey: int


@dataclass(frozen=True, slots=True)
class ReservationReport:
    gen: int
    rtype: int          # 0: no reservation
    ptpls: bool
    regctl: int         # registrants in all; ``registrants`` holds those that fitted the buffer
    registrants: tuple[Registrant, ...]


def build_report(gen: int, rtype: int, ptpls: bool, registrants: Iterable[Registrant], *, eds: bool,
                 size: int) -> bytes:
    """The Reservation Status data structure, cut (or zero-padded) to ``size`` bytes, as the host asked
    with NUMD; REGCTL counts every registrant, even those the buffer has no room for (nvmet does so)."""
    regs = list(registrants)
    header = ReservationStatusExtHeader if eds else ReservationStatusHeader
    entry = RegisteredControllerExt if eds else RegisteredController
    out = bytearray(header.build({"gen": gen, "rtype": rtype, "regctl": len(regs), "ptpls": int(ptpls)}))
    for reg in regs:
        hostid = reg.hostid if eds else reg.hostid[:8]
        out += entry.build({"cntlid": reg.cntlid, "rcsts": RCSTS_HOLDS if reg.holds else 0,
                            "hostid": hostid.ljust(16 if eds else 8, b"\0"), "rkey": reg.rkey})
        if len(out) >= size:
            break
    return bytes(out[:size].ljust(size, b"\0"))


def parse_report(data: bytes, *, eds: bool) -> ReservationReport:
    """Decode what Reservation Report returned; entries the host's buffer cut off are left out."""
    header = ReservationStatusExtHeader if eds else ReservationStatusHeader
    hsize = EXT_HEADER_SIZE if eds else HEADER_SIZE
    esize = EXT_ENTRY_SIZE if eds else ENTRY_SIZE
    if len(data) < hsize:
        raise ValueError(f"reservation report of {len(data)} bytes is shorter than its {hsize}-byte header")
    h = header.parse(data[:hsize])
    entry = RegisteredControllerExt if eds else RegisteredController
    regs = []
    for i in range(h.regctl):
        start = hsize + i * esize
        if start + esize > len(data):
            break
        e = entry.parse(data[start:start + esize])
        regs.append(Registrant(e.cntlid, bool(e.rcsts & RCSTS_HOLDS), bytes(e.hostid), e.rkey))
    return ReservationReport(h.gen, h.rtype, bool(h.ptpls), h.regctl, tuple(regs))


__all__ = [
    "ACQUIRE_DATA_SIZE",
    "ACTION_MASK",
    "AEN_INFO_RESERVATION_LOG",
    "CNTLID_DYNAMIC",
    "CPTPL_SHIFT",
    "ENTRY_SIZE",
    "EXT_ENTRY_SIZE",
    "EXT_HEADER_SIZE",
    "HEADER_SIZE",
    "IEKEY",
    "MASK_ALL",
    "MASK_REGISTRATION_PREEMPTED",
    "MASK_RESERVATION_PREEMPTED",
    "MASK_RESERVATION_RELEASED",
    "NMIC_SHARED",
    "NOTIFICATION_LOG_SIZE",
    "PTPL_FEATURE_BIT",
    "RCSTS_HOLDS",
    "REGISTER_DATA_SIZE",
    "RELEASE_DATA_SIZE",
    "REPORT_EDS",
    "RESCAP_ALL",
    "RESCAP_IEKEY_13",
    "RESCAP_PTPL",
    "RTYPE_NAMES",
    "RTYPE_SHIFT",
    "AcquireAction",
    "AcquireData",
    "Cptpl",
    "NotificationType",
    "RegisterAction",
    "RegisterData",
    "RegisteredController",
    "RegisteredControllerExt",
    "Registrant",
    "ReleaseAction",
    "ReleaseData",
    "ReservationNotificationLog",
    "ReservationReport",
    "ReservationStatusExtHeader",
    "ReservationStatusHeader",
    "ReservationType",
    "build_report",
    "parse_report",
]
