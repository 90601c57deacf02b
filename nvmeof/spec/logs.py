"""Log pages returned by Get Log Page (admin opcode 02h).

Layouts follow NVMe Base 2.0: Linux include/linux/nvme.h (`nvme_smart_log`, `nvme_fw_slot_info_log`,
`nvme_effects_log`, `nvme_ana_rsp_hdr`, `nvme_ana_group_desc`) and libnvme src/nvme/types.h
(`nvme_error_log_page`). Every field has a default.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from construct import Array, Default, Int8ul, Int16ul, Int32ul, Int64ul, Padding, Struct

from nvmeof.spec.fields import Int128ul, SpacePaddedString
from nvmeof.spec.identify import check_nsid, parse_ns_list

__all__ = [
    "ANA_LOG_RGO",
    "ANA_STATE_NAMES",
    "CHANGED_NS_LIST_OVERFLOW",
    "CHANGED_NS_MAX",
    "EFFECTS_CCC",
    "EFFECTS_CSUPP",
    "EFFECTS_LBCC",
    "EFFECTS_NCC",
    "EFFECTS_NIC",
    "AnaGroup",
    "AnaGroupDescriptor",
    "AnaLog",
    "AnaLogHeader",
    "AnaState",
    "ChangedNsList",
    "CommandsSupportedEffects",
    "ErrorLogEntry",
    "FirmwareSlotLog",
    "Int128ul",
    "SmartLog",
    "ana_log_size",
    "build_ana_log",
    "build_changed_ns_list",
    "build_effects_log",
    "log_slice",
    "parse_ana_log",
    "parse_ana_state",
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


# Log identifier 0Ch: Asymmetric Namespace Access. A header, then one descriptor per ANA group, each
# followed by its NSIDs (none when the host sets RGO, LSP bit 0: "return groups only").
ANA_LOG_RGO = 1 << 0  # NVME_ANA_LOG_RGO, in the Get Log Page LSP field (CDW10 bits 11:8)


class AnaState(enum.IntEnum):
    """An ANA group's state on one controller (``enum nvme_ana_state``)."""

    OPTIMIZED = 0x01
    NON_OPTIMIZED = 0x02
    INACCESSIBLE = 0x03
    PERSISTENT_LOSS = 0x04
    CHANGE = 0x0F


# The words users type (CLI, REST, configuration); nvmetcli's ana_state words are the same.
ANA_STATE_NAMES: dict[AnaState, str] = {
    AnaState.OPTIMIZED: "optimized",
    AnaState.NON_OPTIMIZED: "non-optimized",
    AnaState.INACCESSIBLE: "inaccessible",
    AnaState.PERSISTENT_LOSS: "persistent-loss",
    AnaState.CHANGE: "change",
}
_ANA_STATE_BY_NAME = {name: state for state, name in ANA_STATE_NAMES.items()}


def parse_ana_state(text: object) -> AnaState:
    """The AnaState a user's word names ("optimized", "non-optimized", ...), or an AnaState as is.

    Accepts "_" for "-" and any case; ValueError naming the allowed words otherwise."""
    if isinstance(text, AnaState):
        return text
    if isinstance(text, str):
        state = _ANA_STATE_BY_NAME.get(text.strip().lower().replace("_", "-"))
        if state is not None:
            return state
    raise ValueError(f"ANA state {text!r} is not one of: {', '.join(ANA_STATE_NAMES.values())}")


AnaLogHeader = Struct(
    "chgcnt" / _U64,
    "ngrps" / _U16,
    Padding(6),
)

AnaGroupDescriptor = Struct(
    "anagrpid" / _U32,
    "nnsids" / _U32,
    "chgcnt" / _U64,
    "state" / _U8,  # bits 3:0; 7:4 reserved
    Padding(15),
)

_ANA_HEADER_SIZE = AnaLogHeader.sizeof()
_ANA_DESC_SIZE = AnaGroupDescriptor.sizeof()


def ana_log_size(ngrps: int, nnsids: int) -> int:
    """Bytes of an ANA log with ``ngrps`` descriptors listing ``nnsids`` NSIDs in all.

    The Linux host sizes its buffer as header + NANAGRPID descriptors + MNAN (else NN) NSIDs
    (nvme_mpath_init_identify) and refuses a controller whose worst case exceeds MDTS."""
    return _ANA_HEADER_SIZE + ngrps * _ANA_DESC_SIZE + nnsids * 4


@dataclass(frozen=True)
class AnaGroup:
    anagrpid: int
    chgcnt: int
    state: AnaState | int  # an AnaState, or the raw value when a device reports a reserved one
    nsids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class AnaLog:
    chgcnt: int
    groups: list[AnaGroup] = field(default_factory=list)

    def states(self) -> dict[int, AnaState | int]:
        """{anagrpid: state}."""
        return {g.anagrpid: g.state for g in self.groups}


def build_ana_log(chgcnt: int, groups: Iterable[tuple[int, int, AnaState | int, Iterable[int]]],
                  rgo: bool = False) -> bytes:
    """The ANA log page from (anagrpid, chgcnt, state, nsids) per group, in the order given.

    With ``rgo`` the NSID lists are left out and every NNSIDS is 0, as nvmet_execute_get_log_page_ana
    does (the spec: "the controller shall clear NNSIDS to 0h")."""
    parts: list[bytes] = []
    count = 0
    for anagrpid, grp_chgcnt, state, nsids in groups:
        if not isinstance(anagrpid, int) or not 1 <= anagrpid <= 0xFFFFFFFF:
            raise ValueError(f"ANA group id {anagrpid!r} is outside 1..0xFFFFFFFF")
        listed = [] if rgo else [check_nsid(nsid) for nsid in nsids]
        parts.append(AnaGroupDescriptor.build({"anagrpid": anagrpid, "nnsids": len(listed), "chgcnt": grp_chgcnt,
                                               "state": int(state) & 0x0F}))
        if listed:
            parts.append(b"".join(n.to_bytes(4, "little") for n in listed))
        count += 1
    if count > 0xFFFF:
        raise ValueError(f"an ANA log holds at most 65535 group descriptors, got {count}")
    return AnaLogHeader.build({"chgcnt": chgcnt, "ngrps": count}) + b"".join(parts)


def _ana_state(value: int) -> AnaState | int:
    try:
        return AnaState(value)
    except ValueError:
        return value


def parse_ana_log(buf: bytes | bytearray | memoryview) -> AnaLog:
    """Parse an ANA log page; ValueError when a descriptor or its NSIDs run past the buffer
    (the Linux host's nvme_parse_ana_log makes the same bounds checks and also refuses group id 0)."""
    data = bytes(buf)
    if len(data) < _ANA_HEADER_SIZE:
        raise ValueError(f"ANA log of {len(data)} bytes is shorter than its {_ANA_HEADER_SIZE}-byte header")
    header = AnaLogHeader.parse(data)
    offset = _ANA_HEADER_SIZE
    groups: list[AnaGroup] = []
    for index in range(header.ngrps):
        if offset + _ANA_DESC_SIZE > len(data):
            raise ValueError(f"ANA log: descriptor {index} of {header.ngrps} runs past the {len(data)}-byte buffer")
        desc = AnaGroupDescriptor.parse(data[offset : offset + _ANA_DESC_SIZE])
        if desc.anagrpid == 0:
            raise ValueError(f"ANA log: descriptor {index} has the invalid group id 0")
        offset += _ANA_DESC_SIZE
        end = offset + desc.nnsids * 4
        if end > len(data):
            raise ValueError(f"ANA log: group {desc.anagrpid} lists {desc.nnsids} NSIDs past the "
                             f"{len(data)}-byte buffer")
        nsids = [int.from_bytes(data[o : o + 4], "little") for o in range(offset, end, 4)]
        offset = end
        groups.append(AnaGroup(desc.anagrpid, desc.chgcnt, _ana_state(desc.state & 0x0F), nsids))
    return AnaLog(header.chgcnt, groups)
