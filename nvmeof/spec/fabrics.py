"""NVMe over Fabrics command layouts, Connect data, properties and the Discovery log page.

Layouts: NVMe over Fabrics 1.1 §3 and NVMe Base 2.0 §6; Linux include/linux/nvme.h
``struct nvmf_connect_command``, ``struct nvmf_connect_data``, ``struct nvmf_property_{get,set}_command``,
``struct nvmf_disc_rsp_page_hdr`` / ``nvmf_disc_rsp_page_entry``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from construct import Bytes, Const, Int8ul, Int16ul, Int32ul, Int64ul, PaddedString, Padding, Struct

FABRICS_OPCODE = 0x7F
CONNECT_DATA_SIZE = 1024
DISCOVERY_LOG_HEADER_SIZE = 1024
DISCOVERY_LOG_ENTRY_SIZE = 1024
NQN_FIELD_SIZE = 256
NVMF_NQN_SIZE = 223  # longest NQN, bytes of UTF-8
# Discovery Log Page Entry PORTID is 16 bits with no value reserved; nvmet takes any u16 for a port
# (nvmet_ports_make) and a referral (nvmet_addr_portid_store), and nvmetcli passes it through.
PORTID_MAX = 0xFFFF

# Connect CATTR bits
CATTR_PRIORITY_MASK = 0x3
CATTR_DISABLE_SQFLOW = 1 << 2   # NVME_CONNECT_DISABLE_SQFLOW
# Property Get/Set ATTRIB: bit 0 selects an 8-byte property
PROPERTY_SIZE_8 = 1
CONNECT_ADMIN_CNTLID = 0xFFFF  # dynamic controller model: "allocate one"
SQHD_DISABLED = 0xFFFF         # SQ flow control disabled (CATTR bit 2)


class Property(enum.IntEnum):
    CAP = 0x00
    VS = 0x08
    INTMS = 0x0C
    INTMC = 0x10
    CC = 0x14
    CSTS = 0x1C
    NSSR = 0x20
    AQA = 0x24
    CRTO = 0x68


class TrType(enum.IntEnum):
    RDMA = 1
    FC = 2
    TCP = 3
    LOOP = 254


class AdrFam(enum.IntEnum):
    IPV4 = 1
    IPV6 = 2
    IB = 3
    FC = 4
    LOOP = 254


class SubType(enum.IntEnum):
    REFERRAL = 1   # NVME_NQN_DISC: another discovery service
    NVME = 2       # NVME_NQN_NVME: an NVM subsystem
    CURRENT = 3    # NVME_NQN_CURR: the discovery controller being asked


# TREQ: secure channel bits 1:0, SQ flow control disable bit 2
TREQ_NOT_SPECIFIED = 0
TREQ_REQUIRED = 1
TREQ_NOT_REQUIRED = 2
TREQ_DISABLE_SQFLOW = 1 << 2
# EFLAGS
EFLAGS_EPCSD = 1 << 1   # explicit persistent connection support for discovery
EFLAGS_DUPRETINFO = 1 << 0

# TSAS for TCP: security type
TCP_SECTYPE_NONE = 0
# TSAS for RDMA
RDMA_QPTYPE_CONNECTED = 1
RDMA_PRTYPE_NOT_SPECIFIED = 1
RDMA_CMS_RDMA_CM = 1
EFLAGS_NCC = 1 << 2     # no CDC connectivity
TCP_SECTYPE_TLS = 1
TCP_SECTYPE_TLS13 = 2

# Discovery log field values as nvme-cli prints them, normal and JSON output alike: libnvme
# src/nvme/fabrics.c ``libnvmf_trtype_str`` / ``_adrfam_str`` / ``_subtype_str`` / ``_treq_str`` /
# ``_eflags_str`` / ``_sectype_str`` / ``_prtype_str`` / ``_qptype_str`` / ``_cms_str``. A value missing
# from a table is "unrecognized", as libnvme's ``arg_str`` answers.
UNRECOGNIZED = "unrecognized"
_SQFLOW_NOTE = ", sq flow control disable supported"
_EPCSD_NAME, _DUPRET_NAME, _NCC_NAME = ("explicit discovery connections", "duplicate discovery information",
                                        "no cdc connectivity")
TRTYPE_NAMES = {TrType.RDMA: "rdma", TrType.FC: "fc", TrType.TCP: "tcp", TrType.LOOP: "loop"}
# libnvme's table stops at FC: loop (254) prints as "unrecognized"; 0 is PCIe
ADRFAM_NAMES = {0: "pci", AdrFam.IPV4: "ipv4", AdrFam.IPV6: "ipv6", AdrFam.IB: "infiniband",
                AdrFam.FC: "fibre-channel"}
SUBTYPE_NAMES = {SubType.REFERRAL: "discovery subsystem referral", SubType.NVME: "nvme subsystem",
                 SubType.CURRENT: "current discovery subsystem"}
_TREQ_BASE = {TREQ_NOT_SPECIFIED: "not specified", TREQ_REQUIRED: "required", TREQ_NOT_REQUIRED: "not required"}
TREQ_NAMES = {**_TREQ_BASE, **{v | TREQ_DISABLE_SQFLOW: name + _SQFLOW_NOTE for v, name in _TREQ_BASE.items()}}
EFLAGS_NAMES = {
    bits: ", ".join(name for bit, name in ((EFLAGS_EPCSD, _EPCSD_NAME), (EFLAGS_DUPRETINFO, _DUPRET_NAME),
                                           (EFLAGS_NCC, _NCC_NAME)) if bits & bit) or "none"
    for bits in range(8)
}
SECTYPE_NAMES = {TCP_SECTYPE_NONE: "none", TCP_SECTYPE_TLS: "tls", TCP_SECTYPE_TLS13: "tls13"}
PRTYPE_NAMES = {RDMA_PRTYPE_NOT_SPECIFIED: "not specified", 2: "infiniband", 3: "roce", 4: "roce-v2", 5: "iwarp"}
QPTYPE_NAMES = {RDMA_QPTYPE_CONNECTED: "connected", 2: "datagram"}
CMS_NAMES = {RDMA_CMS_RDMA_CM: "rdma-cm"}


def _namer(table: dict[int, str]) -> Callable[[int], str]:
    """The name of a code in ``table``, "unrecognized" for one it does not hold: one lookup for every
    discovery log field, as libnvme's nvmf_*_str() all go through arg_str()."""
    return lambda value: table.get(value, UNRECOGNIZED)


trtype_str = _namer(TRTYPE_NAMES)
adrfam_str = _namer(ADRFAM_NAMES)
subtype_str = _namer(SUBTYPE_NAMES)
treq_str = _namer(TREQ_NAMES)
eflags_str = _namer(EFLAGS_NAMES)
sectype_str = _namer(SECTYPE_NAMES)
prtype_str = _namer(PRTYPE_NAMES)
qptype_str = _namer(QPTYPE_NAMES)
cms_str = _namer(CMS_NAMES)

# Connect response DW0 bits used for IATTR/IPO on INVALID_PARAM: IATTR in bits 23:16 (0 = SQE field,
# 1 = Connect data field), IPO (byte offset) in bits 15:0 (NVMe-oF 1.1 Figure 23).
CONNECT_IATTR_SQE = 0
CONNECT_IATTR_DATA = 1


def connect_invalid_param_result(iattr: int, ipo: int) -> int:
    return ((iattr & 0xFF) << 16) | (ipo & 0xFFFF)


def parse_connect_invalid_param(result: int) -> tuple[int, int]:
    """(IATTR, IPO) of a refused Connect's DW0."""
    return (result >> 16) & 0xFF, result & 0xFFFF


# Every Fabrics command capsule's SQE starts alike (NVMe-oF "Fabrics Command" format; Linux struct
# nvmf_common_command): opcode 7Fh, a reserved byte, the command identifier and FCTYPE.
FABRICS_COMMAND_HEAD = (
    "opcode" / Const(FABRICS_OPCODE, Int8ul),
    "rsvd1" / Int8ul,
    "cid" / Int16ul,
    "fctype" / Int8ul,
)

ConnectCommand = Struct(
    *FABRICS_COMMAND_HEAD,
    "rsvd2" / Bytes(19),
    "dptr" / Bytes(16),
    "recfmt" / Int16ul,
    "qid" / Int16ul,
    "sqsize" / Int16ul,
    "cattr" / Int8ul,
    "rsvd3" / Int8ul,
    "kato" / Int32ul,
    "rsvd4" / Bytes(12),
)

ConnectData = Struct(
    "hostid" / Bytes(16),
    "cntlid" / Int16ul,
    "rsvd4" / Padding(238),
    "subsysnqn" / PaddedString(NQN_FIELD_SIZE, "utf8"),
    "hostnqn" / PaddedString(NQN_FIELD_SIZE, "utf8"),
    "rsvd5" / Padding(256),
)

PropertySetCommand = Struct(
    *FABRICS_COMMAND_HEAD,
    "rsvd2" / Bytes(35),
    "attrib" / Int8ul,
    "rsvd3" / Bytes(3),
    "offset" / Int32ul,
    "value" / Int64ul,
    "rsvd4" / Bytes(8),
)

PropertyGetCommand = Struct(
    *FABRICS_COMMAND_HEAD,
    "rsvd2" / Bytes(35),
    "attrib" / Int8ul,
    "rsvd3" / Bytes(3),
    "offset" / Int32ul,
    "rsvd4" / Bytes(16),
)

DisconnectCommand = Struct(
    *FABRICS_COMMAND_HEAD,
    "rsvd2" / Bytes(19),
    "dptr" / Bytes(16),
    "recfmt" / Int16ul,
    "rsvd3" / Bytes(22),
)

DiscoveryLogHeader = Struct(
    "genctr" / Int64ul,
    "numrec" / Int64ul,
    "recfmt" / Int16ul,
    "rsvd" / Padding(DISCOVERY_LOG_HEADER_SIZE - 18),
)

TsasTcp = Struct("sectype" / Int8ul, "rsvd" / Padding(255))
TsasRdma = Struct(
    "qptype" / Int8ul,
    "prtype" / Int8ul,
    "cms" / Int8ul,
    "rsvd3" / Padding(5),
    "pkey" / Int16ul,
    "rsvd10" / Padding(246),
)

DiscoveryLogEntry = Struct(
    "trtype" / Int8ul,
    "adrfam" / Int8ul,
    "subtype" / Int8ul,
    "treq" / Int8ul,
    "portid" / Int16ul,
    "cntlid" / Int16ul,
    "asqsz" / Int16ul,
    "eflags" / Int16ul,
    "rsvd12" / Padding(20),
    "trsvcid" / PaddedString(32, "ascii"),
    "rsvd64" / Padding(192),
    "subnqn" / PaddedString(NQN_FIELD_SIZE, "utf8"),
    "traddr" / PaddedString(256, "ascii"),
    "tsas" / Bytes(256),
)

# Compiled parsers for structures read per connection (Connect data) or per discovery entry.
ConnectDataCompiled = ConnectData.compile()
DiscoveryLogEntryCompiled = DiscoveryLogEntry.compile()

# Authentication Send (fctype 0x05) / Receive (0x06): Linux ``struct nvmf_auth_send_command`` /
# ``nvmf_auth_receive_command``. SECP/SPSP0/SPSP1 select the security protocol (DH-HMAC-CHAP: 0xE9, 1, 1,
# nvmeof.spec.auth); ``tl`` is the transfer length of the Send payload, ``al`` the allocation length of Receive.
def _auth_command(length: str) -> Struct:
    """The two differ only in the name of the length field (``tl`` / ``al``)."""
    return Struct(
        *FABRICS_COMMAND_HEAD,
        "rsvd2" / Bytes(19),
        "dptr" / Bytes(16),
        "rsvd3" / Int8ul,
        "spsp0" / Int8ul,
        "spsp1" / Int8ul,
        "secp" / Int8ul,
        length / Int32ul,
        "rsvd4" / Bytes(16),
    )


AuthSendCommand = _auth_command("tl")
AuthReceiveCommand = _auth_command("al")
