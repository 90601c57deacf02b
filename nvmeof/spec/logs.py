"""Log pages returned by Get Log Page (admin opcode 02h).

Layouts follow NVMe Base 2.0: Linux include/linux/nvme.h (`nvme_smart_log`, `nvme_fw_slot_info_log`,
`nvme_effects_log`) and libnvme src/nvme/types.h (`nvme_error_log_page`). Every field has a default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from construct import Array, Default, Int8ul, Int16ul, Int32ul, Int64ul, Padding, Struct

from nvmeof.spec.fields import Int128ul, SpacePaddedString
from nvmeof.spec.identify import check_nsid, parse_ns_list

__all__ = [
    "CHANGED_NS_LIST_OVERFLOW",
    "CHANGED_NS_MAX",
    "EFFECTS_CCC",
    "EFFECTS_CSUPP",
    "EFFECTS_LBCC",
    "EFFECTS_NCC",
    "EFFECTS_NIC",
    "ChangedNsList",
    "CommandsSupportedEffects",
    "ErrorLogEntry",
    "FirmwareSlotLog",
    "Int128ul",
    "SmartLog",
    "build_changed_ns_list",
    "build_effects_log",
    "log_slice",
    "parse_changed_ns_list",
]

_U8 = Default(Int8ul, 0)
_U16 = Default(Int16ul, 0)
_U32 = Default(Int32ul, 0)
_U64 = Default(Int64ul, 0)
_U128 = Default(Int128ul, 0)

# Log identifier 01h: one 64-byte entry per error, newest first.
ErrorLogEntry = Struct(
    "error_count" / _U64,
    "sqid" / _U16,
    "cmdid" / _U16,
    "status_field" / _U16,  # CQE status bits 15:1 plus the phase tag in bit 0
    "param_error_location" / _U16,
    "lba" / _U64,
    "nsid" / _U32,
    "vs" / _U8,
    "trtype" / _U8,
    "csi" / _U8,
    "opcode" / _U8,
    "cs" / _U64,
    "trtype_spec_info" / _U16,
    Padding(21),
    "log_page_version" / _U8,
)

# Log identifier 02h. Temperatures are in Kelvin; the 128-bit counters are little-endian integers.
SmartLog = Struct(
    "critical_warning" / _U8,
    "temperature" / _U16,
    "avail_spare" / _U8,
    "spare_thresh" / _U8,
    "percent_used" / _U8,
    "endu_grp_crit_warn_sumry" / _U8,
    Padding(25),
    "data_units_read" / _U128,
    "data_units_written" / _U128,
    "host_reads" / _U128,
    "host_writes" / _U128,
    "ctrl_busy_time" / _U128,
    "power_cycles" / _U128,
    "power_on_hours" / _U128,
    "unsafe_shutdowns" / _U128,
    "media_errors" / _U128,
    "num_err_log_entries" / _U128,
    "warning_temp_time" / _U32,
    "critical_comp_time" / _U32,
    "temp_sensor" / Default(Array(8, Int16ul), [0] * 8),
    "thm_temp1_trans_count" / _U32,
    "thm_temp2_trans_count" / _U32,
    "thm_temp1_total_time" / _U32,
    "thm_temp2_total_time" / _U32,
    Padding(280),
)

# Log identifier 03h. An empty or unsupported slot reads as eight zero bytes.
FirmwareSlotLog = Struct(
    "afi" / _U8,
    Padding(7),
    "frs" / Default(Array(7, SpacePaddedString(8, zero_if_empty=True)), [""] * 7),
    Padding(448),
)

# Log identifier 04h: up to 1024 changed NSIDs, zero-terminated.
CHANGED_NS_MAX = 1024
CHANGED_NS_LIST_OVERFLOW = 0xFFFFFFFF  # first entry when more than 1024 namespaces changed
ChangedNsList = Array(CHANGED_NS_MAX, Int32ul)


def build_changed_ns_list(nsids: Iterable[int]) -> bytes:
    """The 4096-byte Changed Namespace List: ascending NSIDs, or FFFFFFFFh alone past 1024 changes."""
    chosen: set[int] = set()
    for nsid in nsids:
        chosen.add(check_nsid(nsid))
    entries = [CHANGED_NS_LIST_OVERFLOW] if len(chosen) > CHANGED_NS_MAX else sorted(chosen)
    return ChangedNsList.build(entries + [0] * (CHANGED_NS_MAX - len(entries)))


def parse_changed_ns_list(buf: bytes | bytearray | memoryview) -> list[int]:
    """NSIDs up to the first zero; `[CHANGED_NS_LIST_OVERFLOW]` means "more than 1024, rescan all"."""
    return parse_ns_list(buf, "changed namespace list")


# Log identifier 05h: one dword per admin (acs) and I/O (iocs) opcode.
EFFECTS_CSUPP = 1 << 0  # command supported
EFFECTS_LBCC = 1 << 1  # logical block content change
EFFECTS_NCC = 1 << 2  # namespace capability change
EFFECTS_NIC = 1 << 3  # namespace inventory change
EFFECTS_CCC = 1 << 4  # controller capability change

CommandsSupportedEffects = Struct(
    "acs" / Default(Array(256, Int32ul), [0] * 256),
    "iocs" / Default(Array(256, Int32ul), [0] * 256),
    Padding(2048),
)


def _effects_array(name: str, effects: Mapping[int, int]) -> list[int]:
    out = [0] * 256
    for opcode, flags in effects.items():
        if not isinstance(opcode, int) or not 0 <= opcode <= 0xFF:
            raise ValueError(f"{name}: opcode {opcode!r} is outside 0..0xFF")
        if not isinstance(flags, int) or not 0 <= flags <= 0xFFFFFFFF:
            raise ValueError(f"{name}: effects 0x{opcode:02x} -> {flags!r} is not a 32-bit value")
        out[opcode] = flags
    return out


def build_effects_log(acs: Mapping[int, int], iocs: Mapping[int, int]) -> bytes:
    """The 4096-byte Commands Supported and Effects log from {opcode: effect bits} maps."""
    return CommandsSupportedEffects.build(
        {"acs": _effects_array("acs", acs), "iocs": _effects_array("iocs", iocs)}
    )


def log_slice(page: bytes | bytearray | memoryview, offset: int, length: int) -> bytes:
    """Exactly `length` bytes of `page` from byte `offset`, zero-filled past its end.

    Hosts read large logs in pieces (LPO + NUMD), and may ask for more than the page holds.
    """
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"log page offset must be a non-negative int, got {offset!r}")
    if not isinstance(length, int) or length < 0:
        raise ValueError(f"log page length must be a non-negative int, got {length!r}")
    chunk = bytes(page[offset : offset + length])
    return chunk + bytes(length - len(chunk))
