"""NVMe/RDMA connection-manager private data (NVMe/RDMA Transport Specification; Linux
include/linux/nvme-rdma.h ``struct nvme_rdma_cm_req`` / ``_rep`` / ``_rej``).

The host puts a 32-byte request in the RDMA CM REQ; the controller accepts with a 32-byte reply in
the REP or refuses with a 4-byte reject (record format + status) in the REJ. On RoCE/IB the passive
side sees the CM message's whole private-data area (56 bytes for a REQ), so parsers accept a
buffer at least as long as the structure and ignore the tail, as nvmet does.

The keyed SGL data block descriptor the capsules carry is ``nvmeof.spec.nvme.SglKeyedDataBlock``.
"""

from __future__ import annotations

import enum
import struct

from construct import Bytes, Const, Int16ul, Struct

CM_FMT_1_0 = 0x0  # enum nvme_rdma_cm_fmt NVME_RDMA_CM_FMT_1_0

CM_REQ_SIZE = 32
CM_REP_SIZE = 32
CM_REJ_SIZE = 4

IP_PORT = 4420  # NVME_RDMA_IP_PORT
MAX_QUEUE_SIZE = 256  # NVME_RDMA_MAX_QUEUE_SIZE: the Linux host's cap on hrqsize / hsqsize + 1
MAX_METADATA_QUEUE_SIZE = 128  # NVME_RDMA_MAX_METADATA_QUEUE_SIZE
DEFAULT_QUEUE_SIZE = 128  # NVME_RDMA_DEFAULT_QUEUE_SIZE
AQ_DEPTH = 32  # NVME_AQ_DEPTH: the admin queue's hrqsize; its hsqsize is 31 (0's based)


class RejectStatus(enum.IntEnum):
    """``sts`` of a CM reject (enum nvme_rdma_cm_status)."""

    INVALID_LEN = 0x01
    INVALID_RECFMT = 0x02
    INVALID_QID = 0x03
    INVALID_HSQSIZE = 0x04
    INVALID_HRQSIZE = 0x05
    NO_RSC = 0x06
    INVALID_IRD = 0x07
    INVALID_ORD = 0x08
    INVALID_CNTLID = 0x09

    @property
    def message(self) -> str:
        """The text Linux logs for this status (nvme_rdma_cm_msg)."""
        return _REJECT_MESSAGES[self]


_REJECT_MESSAGES = {
    RejectStatus.INVALID_LEN: "invalid length",
    RejectStatus.INVALID_RECFMT: "invalid record format",
    RejectStatus.INVALID_QID: "invalid queue ID",
    RejectStatus.INVALID_HSQSIZE: "invalid host SQ size",
    RejectStatus.INVALID_HRQSIZE: "invalid host RQ size",
    RejectStatus.NO_RSC: "resource not found",
    RejectStatus.INVALID_IRD: "invalid IRD",
    RejectStatus.INVALID_ORD: "invalid ORD",
    RejectStatus.INVALID_CNTLID: "invalid controller ID",
}


# hsqsize is 0's based (the host's SQ holds hsqsize + 1 entries); hrqsize is 1's based. Older
# kernels had rsvd[24] and no cntlid; a zero cntlid reads the same either way.
CmRequest = Struct(
    "recfmt" / Int16ul,
    "qid" / Int16ul,
    "hrqsize" / Int16ul,
    "hsqsize" / Int16ul,
    "cntlid" / Int16ul,
    "rsvd" / Const(bytes(22)),
)

CmReply = Struct(
    "recfmt" / Int16ul,
    "crqsize" / Int16ul,
    "rsvd" / Const(bytes(28)),
)

CmReject = Struct(
    "recfmt" / Int16ul,
    "sts" / Int16ul,
)

# Parsing what a peer sent must not fail on non-zero reserved bytes (a newer peer may use them).
CmRequestLenient = Struct(
    "recfmt" / Int16ul,
    "qid" / Int16ul,
    "hrqsize" / Int16ul,
    "hsqsize" / Int16ul,
    "cntlid" / Int16ul,
    "rsvd" / Bytes(22),
)

CmRequestCompiled = CmRequestLenient.compile()
CmReplyCompiled = Struct("recfmt" / Int16ul, "crqsize" / Int16ul, "rsvd" / Bytes(28)).compile()
CmRejectCompiled = CmReject.compile()

# struct fast path: what the adapters use per connection
CM_REQ = struct.Struct("<HHHHH22x")
CM_REP = struct.Struct("<HH28x")
CM_REJ = struct.Struct("<HH")


class PrivateDataError(ValueError):
    """CM private data too short to hold the structure it must carry."""


def pack_cm_request(qid: int, hrqsize: int, hsqsize: int, cntlid: int = 0, recfmt: int = CM_FMT_1_0) -> bytes:
    """The host's 32-byte REQ private data; ``hsqsize`` is 0's based, ``hrqsize`` 1's based."""
    for name, value in (("qid", qid), ("hrqsize", hrqsize), ("hsqsize", hsqsize), ("cntlid", cntlid),
                        ("recfmt", recfmt)):
        if not 0 <= value <= 0xFFFF:
            raise ValueError(f"CM request {name}={value} does not fit 16 bits")
    return CM_REQ.pack(recfmt, qid, hrqsize, hsqsize, cntlid)


def unpack_cm_request(data: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int]:
    """(recfmt, qid, hrqsize, hsqsize, cntlid) from REQ private data of at least 32 bytes."""
    if len(data) < CM_REQ_SIZE:
        raise PrivateDataError(f"CM request private data is {len(data)} bytes; it needs {CM_REQ_SIZE}")
    return CM_REQ.unpack_from(data)


def pack_cm_reply(crqsize: int, recfmt: int = CM_FMT_1_0) -> bytes:
    if not 0 <= crqsize <= 0xFFFF:
        raise ValueError(f"CM reply crqsize={crqsize} does not fit 16 bits")
    return CM_REP.pack(recfmt, crqsize)


def unpack_cm_reply(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(recfmt, crqsize) from REP private data of at least 32 bytes."""
    if len(data) < CM_REP_SIZE:
        raise PrivateDataError(f"CM reply private data is {len(data)} bytes; it needs {CM_REP_SIZE}")
    return CM_REP.unpack_from(data)


def pack_cm_reject(sts: RejectStatus | int, recfmt: int = CM_FMT_1_0) -> bytes:
    if not 0 <= sts <= 0xFFFF:
        raise ValueError(f"CM reject sts={sts} does not fit 16 bits")
    return CM_REJ.pack(recfmt, int(sts))


def unpack_cm_reject(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(recfmt, sts) from REJ private data of at least 4 bytes; sts may be a value we do not name."""
    if len(data) < CM_REJ_SIZE:
        raise PrivateDataError(f"CM reject private data is {len(data)} bytes; it needs {CM_REJ_SIZE}")
    return CM_REJ.unpack_from(data)


def describe_reject(sts: int) -> str:
    try:
        status = RejectStatus(sts)
    except ValueError:
        return f"unknown NVMe/RDMA reject status {sts:#x}"
    return f"{status.name} ({status.message})"
