"""NVMe/TCP PDU layouts (NVMe/TCP Transport Specification 1.0, §3.6; Linux include/linux/nvme-tcp.h).

The construct Structs are the definitions; the ``*_HDR`` ``struct.Struct`` objects below are the fast
path used per PDU by nvmeof.tcp, and tests prove they read and write the same bytes.

Every PDU starts with the 8-byte common header (type, flags, hlen, pdo, plen). ``hlen`` is the PDU
header length without the header digest; ``pdo`` is where the data starts (0 when there is none);
``plen`` is the whole PDU including digests and data.
"""

from __future__ import annotations

import enum
import struct

from construct import Bytes, Int8ul, Int16ul, Int32ul, Padding, Struct


class PduType(enum.IntEnum):
    ICREQ = 0x0
    ICRESP = 0x1
    H2C_TERM_REQ = 0x2
    C2H_TERM_REQ = 0x3
    CAPSULE_CMD = 0x4
    CAPSULE_RESP = 0x5
    H2C_DATA = 0x6
    C2H_DATA = 0x7
    R2T = 0x9


# Common header flags (enum nvme_tcp_pdu_flags)
HDGSTF = 0x01
DDGSTF = 0x02
DATA_LAST = 0x04
DATA_SUCCESS = 0x08

# ICReq/ICResp DGST field (enum nvme_tcp_digest_option)
HDR_DIGEST_ENABLE = 0x01
DATA_DIGEST_ENABLE = 0x02

PFV_1_0 = 0  # enum nvme_tcp_pfv
DIGEST_LENGTH = 4  # NVME_TCP_DIGEST_LENGTH
MIN_MAXH2CDATA = 4096  # NVME_TCP_MIN_MAXH2CDATA: the smallest MAXH2CDATA an ICResp may give

COMMON_HEADER_SIZE = 8
IC_PDU_SIZE = 128
TERM_REQ_HEADER_SIZE = 24
TERM_REQ_MAX_DATA = 128  # the offending PDU header copied into a TermReq is cut at 128 bytes
TERM_REQ_MIN_PLEN = TERM_REQ_HEADER_SIZE  # NVME_TCP_MIN_C2HTERM_PLEN
TERM_REQ_MAX_PLEN = TERM_REQ_HEADER_SIZE + TERM_REQ_MAX_DATA  # NVME_TCP_MAX_C2HTERM_PLEN = 152
CAPSULE_CMD_HEADER_SIZE = 72
CAPSULE_RESP_SIZE = 24
DATA_PDU_HEADER_SIZE = 24
R2T_SIZE = 24


class FatalErrorStatus(enum.IntEnum):
    """TermReq FES (enum nvme_tcp_fatal_error_status)."""

    INVALID_HEADER_FIELD = 0x01
    PDU_SEQUENCE_ERROR = 0x02
    HEADER_DIGEST_ERROR = 0x03
    DATA_OUT_OF_RANGE = 0x04
    DATA_LIMIT_EXCEEDED = 0x05  # also "R2T limit exceeded": the spec gives both one value
    UNSUPPORTED_PARAMETER = 0x06


CommonHeader = Struct(
    "type" / Int8ul,
    "flags" / Int8ul,
    "hlen" / Int8ul,
    "pdo" / Int8ul,
    "plen" / Int32ul,
)

ICReq = Struct(
    "ch" / CommonHeader,
    "pfv" / Int16ul,
    "hpda" / Int8ul,     # host PDU data alignment, dwords, 0's based
    "dgst" / Int8ul,     # HDR_DIGEST_ENABLE | DATA_DIGEST_ENABLE
    "maxr2t" / Int32ul,  # 0's based: 0 = one outstanding R2T per command
    Padding(112),
)

ICResp = Struct(
    "ch" / CommonHeader,
    "pfv" / Int16ul,
    "cpda" / Int8ul,     # controller PDU data alignment, dwords, 0's based
    "dgst" / Int8ul,
    "maxh2cdata" / Int32ul,
    Padding(112),
)

# H2CTermReq and C2HTermReq share this header; up to 128 bytes of the offending PDU header follow it.
# FEI sits at byte 10 (unaligned): the kernel spells it feil/feiu, two le16 halves.
TermReqHeader = Struct(
    "ch" / CommonHeader,
    "fes" / Int16ul,
    "fei" / Int32ul,
    Padding(10),
)

CapsuleCmdHeader = Struct(
    "ch" / CommonHeader,
    "sqe" / Bytes(64),
)

CapsuleResp = Struct(
    "ch" / CommonHeader,
    "cqe" / Bytes(16),
)

# H2CData and C2HData share one layout (struct nvme_tcp_data_pdu); ttag is reserved in C2HData.
DataPduHeader = Struct(
    "ch" / CommonHeader,
    "cccid" / Int16ul,
    "ttag" / Int16ul,
    "datao" / Int32ul,
    "datal" / Int32ul,
    Padding(4),
)
H2CDataHeader = DataPduHeader
C2HDataHeader = DataPduHeader

R2T = Struct(
    "ch" / CommonHeader,
    "cccid" / Int16ul,
    "ttag" / Int16ul,
    "r2to" / Int32ul,
    "r2tl" / Int32ul,
    Padding(4),
)

CommonHeaderCompiled = CommonHeader.compile()
ICReqCompiled = ICReq.compile()
ICRespCompiled = ICResp.compile()
TermReqHeaderCompiled = TermReqHeader.compile()
CapsuleCmdHeaderCompiled = CapsuleCmdHeader.compile()
CapsuleRespCompiled = CapsuleResp.compile()
DataPduHeaderCompiled = DataPduHeader.compile()
R2TCompiled = R2T.compile()

# Fast path, field order as above: type, flags, hlen, pdo, plen, then the PDU-specific fields.
COMMON_HDR = struct.Struct("<BBBBI")
IC_HDR = struct.Struct("<BBBBIHBBI112x")           # ... pfv, hpda|cpda, dgst, maxr2t|maxh2cdata
TERM_REQ_HDR = struct.Struct("<BBBBIHI10x")        # ... fes, fei
CAPSULE_CMD_HDR = struct.Struct("<BBBBI64s")       # ... sqe
CAPSULE_RESP_HDR = struct.Struct("<BBBBI16s")      # ... cqe
DATA_PDU_HDR = struct.Struct("<BBBBIHHII4x")       # ... cccid, ttag, datao|r2to, datal|r2tl

# Byte offsets of fields, reported as FEI when a field is invalid.
OFF_TYPE, OFF_FLAGS, OFF_HLEN, OFF_PDO, OFF_PLEN = 0, 1, 2, 3, 4
OFF_PFV, OFF_PDA, OFF_DGST, OFF_MAXR2T, OFF_MAXH2CDATA = 8, 10, 11, 12, 12
OFF_CCCID, OFF_TTAG, OFF_DATAO, OFF_DATAL = 8, 10, 12, 16
OFF_R2TO, OFF_R2TL = 12, 16
OFF_RSP_CID = 20   # a CapsuleResp's CQE command identifier (8-byte common header + CQE byte 12)
