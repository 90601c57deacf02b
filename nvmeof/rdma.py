"""Sans-IO NVMe/RDMA queue logic shared by the controller (target) and host (initiator) roles.

No verbs here: the pyverbs adapters post what these objects ask for and feed back what completes.

- :func:`accept_connect_request` validates the host's RDMA CM REQ private data and answers with the
  REP private data or a reject status (nvmet ``nvmet_rdma_parse_cm_connect_req``).
- :class:`RdmaControllerQueue` turns a received command capsule into data movement: a keyed SGL
  becomes RDMA READs (host to controller) or RDMA WRITEs chained before the response SEND
  (controller to host); an in-capsule descriptor is checked against what arrived and what was
  advertised. Every bound from the wire is checked; a bad descriptor is an :class:`NvmeError` to
  complete the command with, never an exception the adapter has to guess about.
- :class:`RdmaHostQueue` builds capsules with keyed SGL descriptors for registered buffers, tracks
  commands by cid and checks remote invalidations ("Bogus remote invalidation" in the Linux host).

Facts: ../shared/PROTOCOL.md §3.2; Linux drivers/nvme/{host,target}/rdma.c.
"""

from __future__ import annotations

import dataclasses

from nvmeof import defaults
from nvmeof.spec import rdma as spec
from nvmeof.spec.nvme import (
    SGL_ID_INCAPSULE,
    SGL_ID_KEYED,
    SGL_ID_KEYED_INVALIDATE,
    SQE_FLAGS_PSDT_MASK,
    SQE_FLAGS_PSDT_SGL,
    SQE_SIZE,
    Command,
    Completion,
    Direction,
    SglFields,
)
from nvmeof.spec.rdma import RejectStatus
from nvmeof.status import NvmeError, Status

KEYED_SGL_MAX_LENGTH = (1 << 24) - 1  # the keyed descriptor's length field is 24 bits


class RdmaQueueError(Exception):
    """The queue cannot go on (malformed capsule, bogus invalidation, unknown cid): tear it down."""


class ConnectRejected(Exception):
    """The controller rejected the RDMA CM connection; ``status`` is the NVMe/RDMA reject status."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        super().__init__(f"NVMe/RDMA connect rejected: {spec.describe_reject(status)}"
                         f"{': ' + detail if detail else ''}")


# --------------------------------------------------------------------------- connection manager


@dataclasses.dataclass(frozen=True, slots=True)
class QueueParams:
    """What an accepted CM request sets up for one queue."""

    qid: int
    hrqsize: int      # host receive queue entries: the controller may have this many responses out
    hsqsize: int      # 0's based host send queue size, as on the wire
    cntlid: int
    recv_queue_size: int  # hsqsize + 1: command capsules the controller keeps receives posted for
    send_queue_size: int  # hrqsize

    @property
    def is_admin(self) -> bool:
        return self.qid == 0


@dataclasses.dataclass(frozen=True, slots=True)
class CmAccept:
    params: QueueParams
    private_data: bytes  # 32-byte REP private data (crqsize = recv_queue_size)


@dataclasses.dataclass(frozen=True, slots=True)
class CmReject:
    status: RejectStatus
    reason: str
    private_data: bytes  # 4-byte REJ private data


def _reject(status: RejectStatus, reason: str) -> CmReject:
    return CmReject(status, reason, spec.pack_cm_reject(status))


def accept_connect_request(
    private_data: bytes | bytearray | memoryview | None,
    *,
    max_queue_size: int = defaults.MAX_QUEUE_SIZE,
    max_qid: int = defaults.MAX_IO_QUEUES,
    cntlid_valid: object = None,
) -> CmAccept | CmReject:
    """Validate a CM REQ's private data and decide: accept with crqsize, or reject with a status.

    The admin queue (qid 0) may have at most NVME_AQ_DEPTH (32) entries; I/O queues at most
    ``max_queue_size`` (advertised as CAP.MQES + 1). ``cntlid_valid``, if given, is a callable
    ``(cntlid) -> bool`` used for I/O queues whose request names a controller (cntlid != 0; older
    hosts leave it 0 and are let through for the Connect command to decide).
    """
    if private_data is None or len(private_data) < spec.CM_REQ_SIZE:
        got = "none" if private_data is None else f"{len(private_data)} bytes"
        return _reject(RejectStatus.INVALID_LEN, f"private data {got}, need {spec.CM_REQ_SIZE}")
    recfmt, qid, hrqsize, hsqsize, cntlid = spec.unpack_cm_request(private_data)
    if recfmt != spec.CM_FMT_1_0:
        return _reject(RejectStatus.INVALID_RECFMT, f"recfmt {recfmt}, only {spec.CM_FMT_1_0} is known")
    if qid > max_qid:
        return _reject(RejectStatus.INVALID_QID, f"qid {qid} above the {max_qid} I/O queues allowed")
    limit = spec.AQ_DEPTH if qid == 0 else max_queue_size
    # hsqsize is 0's based; an NVMe queue needs at least two entries
    if hsqsize < 1 or hsqsize + 1 > limit:
        return _reject(RejectStatus.INVALID_HSQSIZE,
                       f"qid {qid} hsqsize {hsqsize} ({hsqsize + 1} entries); allowed 2..{limit}")
    if hrqsize < 1 or hrqsize > limit:
        return _reject(RejectStatus.INVALID_HRQSIZE, f"qid {qid} hrqsize {hrqsize}; allowed 1..{limit}")
    if qid != 0 and cntlid != 0 and callable(cntlid_valid) and not cntlid_valid(cntlid):
        return _reject(RejectStatus.INVALID_CNTLID, f"qid {qid} names controller {cntlid}, which does not exist")
    params = QueueParams(qid=qid, hrqsize=hrqsize, hsqsize=hsqsize, cntlid=cntlid,
                         recv_queue_size=hsqsize + 1, send_queue_size=hrqsize)
    return CmAccept(params, spec.pack_cm_reply(params.recv_queue_size))


def host_connect_private_data(qid: int, queue_size: int, cntlid: int = 0) -> bytes:
    """The Linux host's REQ: hrqsize = queue size, hsqsize = queue size - 1 (admin: 32 and 31)."""
    if queue_size < 2:
        raise ValueError(f"queue_size {queue_size}: an NVMe queue needs at least 2 entries")
    if qid == 0 and queue_size > spec.AQ_DEPTH:
        raise ValueError(f"admin queue_size {queue_size} exceeds NVME_AQ_DEPTH {spec.AQ_DEPTH}")
    return spec.pack_cm_request(qid, queue_size, queue_size - 1, cntlid if qid else 0)


def parse_accept(private_data: bytes | bytearray | memoryview | None) -> int | None:
    """crqsize from REP private data; None when the controller sent none (the Linux host ignores it)."""
    if not private_data or len(private_data) < spec.CM_REP_SIZE:
        return None
    recfmt, crqsize = spec.unpack_cm_reply(private_data)
    if recfmt != spec.CM_FMT_1_0:
        raise RdmaQueueError(f"CM reply recfmt {recfmt}, expected {spec.CM_FMT_1_0}")
    return crqsize


def rejection(private_data: bytes | bytearray | memoryview | None, detail: str = "") -> ConnectRejected:
    """The exception to raise for a REJ event; a REJ without NVMe private data has status 0."""
    if not private_data or len(private_data) < spec.CM_REJ_SIZE:
        return ConnectRejected(0, detail or "no NVMe/RDMA private data (not an NVMe controller?)")
    _, sts = spec.unpack_cm_reject(private_data)
    return ConnectRejected(sts, detail)


# --------------------------------------------------------------------------- actions


@dataclasses.dataclass(frozen=True, slots=True)
class RdmaRead:
    """Read ``length`` bytes at the peer's (addr, rkey) into the command's buffer at local_offset."""

    addr: int
    length: int
    rkey: int
    local_offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class RdmaWrite:
    """Write ``length`` bytes from the command's buffer at local_offset to the peer's (addr, rkey)."""

    addr: int
    length: int
    rkey: int
    local_offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    """Send the 16-byte CQE; with invalidate_rkey, as SEND_WITH_INV of that rkey."""

    cqe: bytes
    invalidate_rkey: int | None


Action = RdmaRead | RdmaWrite | Send


def _split(cls: type[RdmaRead] | type[RdmaWrite], addr: int, length: int, rkey: int,
           max_rdma_size: int) -> list[RdmaRead] | list[RdmaWrite]:
    return [cls(addr + off, min(max_rdma_size, length - off), rkey, off)
            for off in range(0, length, max_rdma_size)]  # type: ignore[misc]


# --------------------------------------------------------------------------- controller role


@dataclasses.dataclass(slots=True)
class InflightCommand:
    """The controller's record of one command between capsule and response."""

    cmd: Command
    sgl: SglFields
    direction: Direction
    data_len: int
    invalidate_rkey: int | None
    incapsule: memoryview | None


@dataclasses.dataclass(frozen=True, slots=True)
class DataPlan:
    """How a command's host-to-controller data arrives.

    ``reads`` are posted before execution (the data is there once they all complete); ``data`` is
    the in-capsule payload when the host sent it inline (a view into the receive buffer: copy it
    or keep the buffer until the command completes).
    """

    reads: list[RdmaRead]
    data: memoryview | None


class RdmaControllerQueue:
    """Controller side of one NVMe/RDMA queue: capsule in, data movement and response out.

    ``incapsule_size`` is the in-capsule data this queue advertises (IOCCSZ*16 - 64 for I/O
    queues; 0 on the admin queue, where the Linux host never sends data inline);
    ``max_transfer`` is MDTS in bytes; ``max_rdma_size`` splits large transfers into several
    work requests (the device's max message size, or a buffer-pool chunk).
    """

    def __init__(self, params: QueueParams, *, incapsule_size: int = 0,
                 max_transfer: int = defaults.MAX_TRANSFER,
                 max_rdma_size: int | None = None) -> None:
        if incapsule_size < 0 or max_transfer <= 0:
            raise ValueError(f"incapsule_size {incapsule_size} / max_transfer {max_transfer} out of range")
        self.params = params
        self.incapsule_size = incapsule_size
        self.max_transfer = max_transfer
        self.max_rdma_size = max_rdma_size or max_transfer
        self.inflight: dict[int, InflightCommand] = {}

    @property
    def recv_buffer_size(self) -> int:
        """Bytes each posted receive needs: one SQE plus the advertised in-capsule data."""
        return SQE_SIZE + self.incapsule_size

    def receive_capsule(self, capsule: bytes | bytearray | memoryview) -> Command:
        """Parse a received capsule's SQE; raises RdmaQueueError when it cannot be answered at all."""
        capsule = memoryview(capsule)
        if len(capsule) < SQE_SIZE:
            raise RdmaQueueError(f"capsule of {len(capsule)} bytes is shorter than a {SQE_SIZE}-byte SQE")
        cmd = Command.from_bytes(capsule[:SQE_SIZE])
        if cmd.cid in self.inflight:
            # the host reused a cid whose response it has not seen: its queue state is broken
            raise RdmaQueueError(f"qid {self.params.qid}: cid {cmd.cid} received while still in flight")
        if len(self.inflight) >= self.params.recv_queue_size:
            raise RdmaQueueError(f"qid {self.params.qid}: more than {self.params.recv_queue_size} "
                                 "commands outstanding (host overran hsqsize)")
        sgl = cmd.sgl()
        rkey = sgl.key if sgl.sgl_id == SGL_ID_KEYED_INVALIDATE else None
        extra = capsule[SQE_SIZE:]
        self.inflight[cmd.cid] = InflightCommand(cmd, sgl, Direction.NONE, 0, rkey,
                                                 extra if len(extra) else None)
        return cmd

    def plan(self, cid: int, direction: Direction, data_len: int) -> DataPlan:
        """Check the command's data descriptor against what it transfers; say how H2C data arrives.

        Call after the command set parsed the command (direction, data_len). Raises NvmeError with
        the status to complete the command with; the command stays in flight until complete().
        """
        ic = self._get(cid)
        ic.direction = Direction(direction)
        ic.data_len = data_len
        cmd, sgl = ic.cmd, ic.sgl
        if cmd.flags & SQE_FLAGS_PSDT_MASK != SQE_FLAGS_PSDT_SGL:
            raise NvmeError(Status.INVALID_FIELD, f"PSDT {cmd.flags >> 6}: NVMe/RDMA commands must use SGLs")
        if data_len > self.max_transfer:
            raise NvmeError(Status.INVALID_FIELD, f"command moves {data_len} bytes, MDTS allows {self.max_transfer}")
        if sgl.sgl_id in (SGL_ID_KEYED, SGL_ID_KEYED_INVALIDATE):
            return self._plan_keyed(ic)
        if sgl.sgl_id == SGL_ID_INCAPSULE:
            return self._plan_incapsule(ic)
        ic.invalidate_rkey = None
        raise NvmeError(Status.SGL_INVALID_TYPE, f"SGL identifier {sgl.sgl_id:#04x} is not keyed (0x40/0x4F) "
                        "or in-capsule (0x01)")

    def _plan_keyed(self, ic: InflightCommand) -> DataPlan:
        sgl = ic.sgl
        if ic.direction == Direction.NONE or ic.data_len == 0:
            return DataPlan([], None)
        if sgl.length > self.max_transfer:
            raise NvmeError(Status.SGL_INVALID_DATA,
                            f"keyed SGL length {sgl.length} exceeds the {self.max_transfer}-byte MDTS")
        if sgl.length < ic.data_len:
            raise NvmeError(Status.SGL_INVALID_DATA,
                            f"keyed SGL length {sgl.length} is shorter than the {ic.data_len} bytes "
                            "the command transfers")
        if sgl.addr + ic.data_len > 1 << 64:
            raise NvmeError(Status.SGL_INVALID_DATA, f"keyed SGL address {sgl.addr:#x} + {ic.data_len} wraps")
        if ic.direction == Direction.H2C:
            return DataPlan(_split(RdmaRead, sgl.addr, ic.data_len, sgl.key, self.max_rdma_size), None)
        return DataPlan([], None)

    def _plan_incapsule(self, ic: InflightCommand) -> DataPlan:
        sgl = ic.sgl
        # not invalidating anything: the host registered nothing for this command
        ic.invalidate_rkey = None
        if sgl.length == 0 and ic.data_len == 0:
            return DataPlan([], None)
        if ic.direction != Direction.H2C:
            raise NvmeError(Status.INVALID_FIELD, "in-capsule data descriptor on a command that returns "
                            "data or moves none")
        end = sgl.addr + sgl.length  # addr is the offset into the in-capsule data
        if end > self.incapsule_size:
            raise NvmeError(Status.SGL_INVALID_OFFSET,
                            f"in-capsule SGL offset {sgl.addr} + length {sgl.length} exceeds the "
                            f"{self.incapsule_size} bytes this queue advertises")
        got = len(ic.incapsule) if ic.incapsule is not None else 0
        if end > got:
            raise NvmeError(Status.SGL_INVALID_DATA,
                            f"in-capsule SGL offset {sgl.addr} + length {sgl.length} exceeds the {got} "
                            "data bytes received with the command")
        if sgl.length < ic.data_len:
            raise NvmeError(Status.SGL_INVALID_DATA,
                            f"in-capsule SGL length {sgl.length} is shorter than the {ic.data_len} bytes "
                            "the command transfers")
        assert ic.incapsule is not None
        return DataPlan([], ic.incapsule[sgl.addr:sgl.addr + ic.data_len])

    def complete(self, cid: int, cqe: bytes, reply_len: int = 0) -> list[RdmaWrite | Send]:
        """Actions that finish command ``cid``: the RDMA WRITEs of ``reply_len`` bytes from the
        command's buffer (controller-to-host data; pass 0 on failure) and then the response SEND.

        The adapter posts them in order on the QP (an RC QP executes them in order, so the host
        sees the data before the CQE). The command leaves the in-flight table.
        """
        ic = self.inflight.pop(cid, None)
        if ic is None:
            raise RdmaQueueError(f"qid {self.params.qid}: completing cid {cid}, which is not in flight")
        if len(cqe) != 16:
            raise ValueError(f"CQE must be 16 bytes, got {len(cqe)}")
        actions: list[RdmaWrite | Send] = []
        if reply_len:
            if ic.direction != Direction.C2H or ic.sgl.sgl_id not in (SGL_ID_KEYED, SGL_ID_KEYED_INVALIDATE):
                raise ValueError(f"cid {cid}: {reply_len} reply bytes for a command with no keyed "
                                 "controller-to-host descriptor")
            if reply_len > min(ic.data_len, ic.sgl.length):
                raise ValueError(f"cid {cid}: reply of {reply_len} bytes exceeds the {ic.data_len} planned "
                                 f"/ {ic.sgl.length} described")
            actions.extend(_split(RdmaWrite, ic.sgl.addr, reply_len, ic.sgl.key, self.max_rdma_size))
        actions.append(Send(bytes(cqe), ic.invalidate_rkey))
        return actions

    def abort_all(self) -> list[int]:
        """Drop every in-flight command (queue teardown); returns their cids."""
        cids = list(self.inflight)
        self.inflight.clear()
        return cids

    def _get(self, cid: int) -> InflightCommand:
        try:
            return self.inflight[cid]
        except KeyError:
            raise RdmaQueueError(f"qid {self.params.qid}: cid {cid} is not in flight") from None


# --------------------------------------------------------------------------- host role


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteBuffer:
    """A host buffer registered for one command: the controller reaches it at (addr, rkey).

    ``invalidate`` asks the controller to invalidate ``rkey`` with SEND_WITH_INV (a fast-registered
    MR used for this command only); a long-lived MR must not be invalidated.
    """

    addr: int
    length: int
    rkey: int
    invalidate: bool = False


@dataclasses.dataclass(slots=True)
class HostPending:
    cid: int
    rkey: int | None          # the registration the controller may invalidate
    invalidate_requested: bool


@dataclasses.dataclass(frozen=True, slots=True)
class HostResponse:
    completion: Completion
    local_invalidate_rkey: int | None  # the adapter must invalidate this rkey itself before reusing it
    remotely_invalidated: bool


def keyed_sgl(buffer: RemoteBuffer) -> bytes:
    """The 16-byte keyed data block descriptor for ``buffer``."""
    if not 0 <= buffer.length <= KEYED_SGL_MAX_LENGTH:
        raise ValueError(f"keyed SGL length {buffer.length} does not fit 24 bits (max {KEYED_SGL_MAX_LENGTH})")
    if not 0 <= buffer.rkey < 1 << 32 or not 0 <= buffer.addr < 1 << 64:
        raise ValueError(f"rkey {buffer.rkey:#x} / addr {buffer.addr:#x} out of range")
    return Command.make_sgl(SGL_ID_KEYED_INVALIDATE if buffer.invalidate else SGL_ID_KEYED,
                            buffer.addr, buffer.length, buffer.rkey)


class RdmaHostQueue:
    """Host side of one NVMe/RDMA queue: cids, capsules and the checks on responses.

    ``incapsule_size`` is what the controller advertised for this queue (IOCCSZ*16 - 64 on I/O
    queues; 0 on the admin queue, where in-capsule data is never used).
    """

    def __init__(self, qid: int, queue_size: int, *, incapsule_size: int = 0) -> None:
        if queue_size < 2:
            raise ValueError(f"queue_size {queue_size}: an NVMe queue needs at least 2 entries")
        if qid == 0 and incapsule_size:
            raise ValueError("the admin queue carries no in-capsule data on NVMe/RDMA")
        self.qid = qid
        self.queue_size = queue_size
        self.incapsule_size = incapsule_size
        # the controller keeps hsqsize + 1 = queue_size receives posted: that many may be outstanding
        self._free = list(range(queue_size - 1, -1, -1))
        self.pending: dict[int, HostPending] = {}

    def connect_private_data(self, cntlid: int = 0) -> bytes:
        return host_connect_private_data(self.qid, self.queue_size, cntlid)

    def submit(self, cmd: Command, *, buffer: RemoteBuffer | None = None,
               incapsule: bytes | bytearray | memoryview | None = None) -> bytes:
        """Give ``cmd`` a cid and its data descriptor; returns the 64-byte SQE to send.

        With ``buffer`` the data moves by RDMA (keyed SGL); with ``incapsule`` the data follows the
        SQE in the same SEND (the adapter sends SQE + incapsule); with neither, a null keyed SGL.
        """
        if buffer is not None and incapsule is not None:
            raise ValueError("a command has either a registered buffer or in-capsule data, not both")
        if incapsule is not None:
            if len(incapsule) > self.incapsule_size:
                raise ValueError(f"{len(incapsule)} in-capsule bytes exceed the {self.incapsule_size} "
                                 f"qid {self.qid} allows")
            dptr = Command.make_sgl(SGL_ID_INCAPSULE, 0, len(incapsule))
        elif buffer is not None:
            dptr = keyed_sgl(buffer)
        else:
            dptr = Command.make_sgl(SGL_ID_KEYED, 0, 0, 0)
        if not self._free:
            raise RdmaQueueError(f"qid {self.qid}: all {self.queue_size} command ids are in use")
        cid = self._free.pop()
        cmd.cid = cid
        cmd.flags = (cmd.flags & ~SQE_FLAGS_PSDT_MASK) | SQE_FLAGS_PSDT_SGL
        cmd.dptr = dptr
        self.pending[cid] = HostPending(cid, buffer.rkey if buffer is not None else None,
                                        buffer is not None and buffer.invalidate)
        return cmd.to_bytes()

    def receive_response(self, cqe: bytes | bytearray | memoryview,
                         invalidated_rkey: int | None = None) -> HostResponse:
        """Match a received CQE to its command. ``invalidated_rkey`` is the work completion's
        invalidated rkey when it carried IBV_WC_WITH_INV. Raises RdmaQueueError on a response for
        no command or on a bogus remote invalidation (the Linux host starts error recovery).
        """
        if len(cqe) < 16:
            raise RdmaQueueError(f"qid {self.qid}: response of {len(cqe)} bytes is shorter than a CQE")
        completion = Completion.from_bytes(memoryview(cqe)[:16])
        pending = self.pending.get(completion.cid)
        if pending is None:
            raise RdmaQueueError(f"qid {self.qid}: response for cid {completion.cid}, which is not in flight")
        if invalidated_rkey is not None and (pending.rkey is None or invalidated_rkey != pending.rkey):
            raise RdmaQueueError(f"qid {self.qid}: bogus remote invalidation for rkey {invalidated_rkey:#x} "
                                 f"(cid {completion.cid} registered "
                                 f"{'nothing' if pending.rkey is None else hex(pending.rkey)})")
        del self.pending[completion.cid]
        self._free.append(completion.cid)
        local = None
        if invalidated_rkey is None and pending.invalidate_requested:
            local = pending.rkey
        return HostResponse(completion, local, invalidated_rkey is not None)

    def abort_all(self) -> list[int]:
        """Forget every pending command (queue teardown); returns their cids."""
        cids = list(self.pending)
        self.pending.clear()
        self._free = list(range(self.queue_size - 1, -1, -1))
        return cids
