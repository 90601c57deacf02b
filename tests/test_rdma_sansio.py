"""The sans-IO NVMe/RDMA queue logic (nvmeof/rdma.py): CM validation, controller data movement, host checks."""

from __future__ import annotations

import pytest

from nvmeof import rdma
from nvmeof.spec import rdma as spec
from nvmeof.spec.nvme import SGL_ID_INCAPSULE, SGL_ID_KEYED, Command, Completion, Direction, IoOpcode, pack_cqe
from nvmeof.status import NvmeError, Status

RS = spec.RejectStatus


# --------------------------------------------------------------------------- CM request


def test_linux_admin_and_io_requests_are_accepted() -> None:
    admin = rdma.accept_connect_request(spec.pack_cm_request(0, 32, 31))
    assert isinstance(admin, rdma.CmAccept)
    assert admin.params.recv_queue_size == 32 and admin.params.send_queue_size == 32
    assert spec.unpack_cm_reply(admin.private_data) == (0, 32)
    io = rdma.accept_connect_request(spec.pack_cm_request(4, 128, 127, 9), cntlid_valid=lambda c: c == 9)
    assert isinstance(io, rdma.CmAccept)
    assert (io.params.qid, io.params.cntlid, io.params.recv_queue_size) == (4, 9, 128)
    assert spec.unpack_cm_reply(io.private_data) == (0, 128)


@pytest.mark.parametrize(("data", "status", "words"), [
    (None, RS.INVALID_LEN, "private data none"),
    (bytes(31), RS.INVALID_LEN, "31 bytes"),
    (spec.pack_cm_request(0, 32, 31, recfmt=1), RS.INVALID_RECFMT, "recfmt 1"),
    (spec.pack_cm_request(65, 32, 31), RS.INVALID_QID, "qid 65"),
    (spec.pack_cm_request(0, 32, 32), RS.INVALID_HSQSIZE, "33 entries"),
    (spec.pack_cm_request(0, 32, 0), RS.INVALID_HSQSIZE, "hsqsize 0"),
    (spec.pack_cm_request(1, 129, 127), RS.INVALID_HRQSIZE, "hrqsize 129"),
    (spec.pack_cm_request(1, 128, 128), RS.INVALID_HSQSIZE, "129 entries"),
    (spec.pack_cm_request(1, 0, 127), RS.INVALID_HRQSIZE, "hrqsize 0"),
    (spec.pack_cm_request(0, 33, 31), RS.INVALID_HRQSIZE, "hrqsize 33"),
    (spec.pack_cm_request(2, 128, 127, 5), RS.INVALID_CNTLID, "controller 5"),
])
def test_bad_requests_are_rejected_with_the_right_status(data, status: RS, words: str) -> None:
    decision = rdma.accept_connect_request(data, cntlid_valid=lambda c: c == 1)
    assert isinstance(decision, rdma.CmReject)
    assert decision.status == status
    assert words in decision.reason
    assert decision.private_data == spec.pack_cm_reject(status)


def test_queue_size_limit_follows_the_argument() -> None:
    assert isinstance(rdma.accept_connect_request(spec.pack_cm_request(1, 256, 255), max_queue_size=256),
                      rdma.CmAccept)
    # old hosts send cntlid 0 on I/O queues: the Connect command decides
    assert isinstance(rdma.accept_connect_request(spec.pack_cm_request(1, 16, 15, 0),
                                                  cntlid_valid=lambda c: False), rdma.CmAccept)


def test_host_side_private_data_and_answers() -> None:
    assert rdma.host_connect_private_data(0, 32, cntlid=7) == spec.pack_cm_request(0, 32, 31, 0)
    assert rdma.host_connect_private_data(3, 128, cntlid=7) == spec.pack_cm_request(3, 128, 127, 7)
    with pytest.raises(ValueError, match="exceeds NVME_AQ_DEPTH"):
        rdma.host_connect_private_data(0, 64)
    assert rdma.parse_accept(spec.pack_cm_reply(77)) == 77
    assert rdma.parse_accept(b"") is None
    with pytest.raises(rdma.RdmaQueueError, match="recfmt 5"):
        rdma.parse_accept(spec.pack_cm_reply(1, recfmt=5))
    exc = rdma.rejection(spec.pack_cm_reject(RS.INVALID_HSQSIZE))
    assert exc.status == RS.INVALID_HSQSIZE and "invalid host SQ size" in str(exc)
    assert rdma.rejection(None).status == 0


# --------------------------------------------------------------------------- controller role

MIB = 1 << 20


def controller(qid: int = 1, incapsule: int = 8192, **kw) -> rdma.RdmaControllerQueue:
    decision = rdma.accept_connect_request(spec.pack_cm_request(qid, 32, 31))
    assert isinstance(decision, rdma.CmAccept)
    return rdma.RdmaControllerQueue(decision.params, incapsule_size=incapsule if qid else 0,
                                    max_transfer=MIB, **kw)


def capsule(cid: int, opcode: int, dptr: bytes, data: bytes = b"", flags: int = 0x40) -> bytes:
    return Command(opcode, cid=cid, nsid=1, dptr=dptr, flags=flags).to_bytes() + data


def keyed(addr: int, length: int, key: int, invalidate: bool = False) -> bytes:
    return rdma.keyed_sgl(rdma.RemoteBuffer(addr, length, key, invalidate))


def test_write_with_keyed_sgl_reads_from_the_host() -> None:
    q = controller()
    cmd = q.receive_capsule(capsule(5, IoOpcode.WRITE, keyed(0x1000, 8192, 0xABC)))
    assert cmd.cid == 5
    plan = q.plan(5, Direction.H2C, 8192)
    assert plan.reads == [rdma.RdmaRead(0x1000, 8192, 0xABC, 0)] and plan.data is None
    assert q.complete(5, pack_cqe(5)) == [rdma.Send(pack_cqe(5), None)]
    assert not q.inflight


def test_large_transfers_split_by_max_rdma_size() -> None:
    q = controller(max_rdma_size=4096)
    q.receive_capsule(capsule(1, IoOpcode.WRITE, keyed(0x10000, 10000, 7)))
    reads = q.plan(1, Direction.H2C, 10000).reads
    assert reads == [rdma.RdmaRead(0x10000, 4096, 7, 0), rdma.RdmaRead(0x11000, 4096, 7, 4096),
                     rdma.RdmaRead(0x12000, 1808, 7, 8192)]


def test_read_writes_then_sends_with_invalidate() -> None:
    q = controller()
    q.receive_capsule(capsule(9, IoOpcode.READ, keyed(0x2000, 4096, 0x55, invalidate=True)))
    assert q.plan(9, Direction.C2H, 4096).reads == []
    cqe = pack_cqe(9, sqid=1)
    assert q.complete(9, cqe, 4096) == [rdma.RdmaWrite(0x2000, 4096, 0x55, 0), rdma.Send(cqe, 0x55)]


def test_failed_command_still_invalidates_and_moves_no_data() -> None:
    q = controller()
    q.receive_capsule(capsule(3, IoOpcode.READ, keyed(0x2000, 4096, 0x66, invalidate=True)))
    with pytest.raises(NvmeError) as err:
        q.plan(3, Direction.C2H, 8192)
    assert err.value.status == Status.SGL_INVALID_DATA and "shorter than the 8192" in err.value.detail
    cqe = pack_cqe(3, err.value.cqe_status())
    assert q.complete(3, cqe) == [rdma.Send(cqe, 0x66)]


@pytest.mark.parametrize(("dptr", "direction", "length", "status", "words"), [
    (keyed(0, 2 * MIB, 1), Direction.H2C, 4096, Status.SGL_INVALID_DATA, "exceeds the 1048576-byte MDTS"),
    (keyed(0, 4096, 1), Direction.C2H, 2 * MIB, Status.INVALID_FIELD, "MDTS allows"),
    (keyed(0xFFFFFFFFFFFFF000, 8192, 1), Direction.H2C, 8192, Status.SGL_INVALID_DATA, "wraps"),
    (Command.make_sgl(0x5A, 0, 4096), Direction.H2C, 4096, Status.SGL_INVALID_TYPE, "0x5a"),
    (Command.make_sgl(SGL_ID_INCAPSULE, 0, 4096), Direction.C2H, 4096, Status.INVALID_FIELD,
     "in-capsule data descriptor"),
    (Command.make_sgl(SGL_ID_INCAPSULE, 4096, 8192), Direction.H2C, 8192, Status.SGL_INVALID_OFFSET,
     "exceeds the 8192 bytes this queue advertises"),
])
def test_bad_descriptors_become_statuses(dptr: bytes, direction, length: int, status: Status, words: str) -> None:
    q = controller()
    q.receive_capsule(capsule(2, IoOpcode.WRITE, dptr, bytes(4096)))
    with pytest.raises(NvmeError) as err:
        q.plan(2, direction, length)
    assert err.value.status == status
    assert words in err.value.detail
    assert len(q.complete(2, pack_cqe(2, err.value.cqe_status()))) == 1


def test_prp_commands_are_refused() -> None:
    q = controller()
    q.receive_capsule(capsule(2, IoOpcode.WRITE, keyed(0, 4096, 1), flags=0x00))
    with pytest.raises(NvmeError, match="PSDT 0") as err:
        q.plan(2, Direction.H2C, 4096)
    assert err.value.status == Status.INVALID_FIELD


def test_incapsule_data_is_checked_against_what_arrived() -> None:
    q = controller()
    payload = bytes(range(256)) * 16
    q.receive_capsule(capsule(4, IoOpcode.WRITE, Command.make_sgl(SGL_ID_INCAPSULE, 0, 4096), payload))
    plan = q.plan(4, Direction.H2C, 4096)
    assert plan.reads == [] and bytes(plan.data) == payload
    q.complete(4, pack_cqe(4))
    # the descriptor claims more than the capsule carried
    q.receive_capsule(capsule(5, IoOpcode.WRITE, Command.make_sgl(SGL_ID_INCAPSULE, 0, 4096), payload[:100]))
    with pytest.raises(NvmeError, match="exceeds the 100 data bytes received") as err:
        q.plan(5, Direction.H2C, 4096)
    assert err.value.status == Status.SGL_INVALID_DATA
    # an in-capsule descriptor never asks for an invalidation
    assert q.complete(5, pack_cqe(5)) == [rdma.Send(pack_cqe(5), None)]


def test_admin_queue_advertises_no_incapsule_data() -> None:
    q = controller(qid=0)
    assert q.recv_buffer_size == 64
    q.receive_capsule(capsule(1, 0x7F, Command.make_sgl(SGL_ID_INCAPSULE, 0, 1024), bytes(1024)))
    with pytest.raises(NvmeError) as err:
        q.plan(1, Direction.H2C, 1024)
    assert err.value.status == Status.SGL_INVALID_OFFSET


def test_no_data_command_with_null_sgl() -> None:
    q = controller()
    q.receive_capsule(capsule(6, IoOpcode.FLUSH, Command.make_sgl(SGL_ID_KEYED, 0, 0, 0)))
    assert q.plan(6, Direction.NONE, 0) == rdma.DataPlan([], None)
    assert q.complete(6, pack_cqe(6)) == [rdma.Send(pack_cqe(6), None)]


def test_fatal_capsule_errors() -> None:
    q = controller()
    with pytest.raises(rdma.RdmaQueueError, match="shorter than a 64-byte SQE"):
        q.receive_capsule(bytes(63))
    q.receive_capsule(capsule(1, IoOpcode.FLUSH, keyed(0, 0, 0)))
    with pytest.raises(rdma.RdmaQueueError, match="cid 1 received while still in flight"):
        q.receive_capsule(capsule(1, IoOpcode.FLUSH, keyed(0, 0, 0)))
    with pytest.raises(rdma.RdmaQueueError, match="cid 2 is not in flight"):
        q.plan(2, 0, 0)
    with pytest.raises(rdma.RdmaQueueError, match="completing cid 2"):
        q.complete(2, pack_cqe(2))
    for cid in range(2, 33):
        q.receive_capsule(capsule(cid, IoOpcode.FLUSH, keyed(0, 0, 0)))
    with pytest.raises(rdma.RdmaQueueError, match="more than 32 commands outstanding"):
        q.receive_capsule(capsule(40, IoOpcode.FLUSH, keyed(0, 0, 0)))
    assert len(q.abort_all()) == 32 and not q.inflight


def test_reply_longer_than_planned_is_a_programming_error() -> None:
    q = controller()
    q.receive_capsule(capsule(1, IoOpcode.READ, keyed(0, 4096, 1)))
    q.plan(1, Direction.C2H, 512)
    with pytest.raises(ValueError, match="exceeds the 512 planned"):
        q.complete(1, pack_cqe(1), 4096)


# --------------------------------------------------------------------------- host role


def test_host_builds_keyed_descriptors_and_tracks_cids() -> None:
    h = rdma.RdmaHostQueue(1, 4, incapsule_size=4096)
    sqe = h.submit(Command(IoOpcode.READ, nsid=1), buffer=rdma.RemoteBuffer(0x7000, 4096, 0x1234, True))
    cmd = Command.from_bytes(sqe)
    assert cmd.cid == 0 and cmd.flags & 0xC0 == 0x40
    assert tuple(cmd.sgl()) == (0x4F, 0x7000, 4096, 0x1234)
    sqe2 = Command.from_bytes(h.submit(Command(IoOpcode.WRITE, nsid=1), incapsule=bytes(512)))
    assert tuple(sqe2.sgl()) == (SGL_ID_INCAPSULE, 0, 512, 0) and sqe2.cid == 1
    resp = h.receive_response(pack_cqe(0), invalidated_rkey=0x1234)
    assert resp.remotely_invalidated and resp.local_invalidate_rkey is None
    assert resp.completion.cid == 0
    # without remote invalidation the host must invalidate the fast-registered MR itself
    h.submit(Command(IoOpcode.READ, nsid=1), buffer=rdma.RemoteBuffer(0x7000, 4096, 0x99, True))
    assert h.receive_response(pack_cqe(0)).local_invalidate_rkey == 0x99


def test_bogus_remote_invalidation_is_fatal() -> None:
    h = rdma.RdmaHostQueue(1, 4)
    h.submit(Command(IoOpcode.READ, nsid=1), buffer=rdma.RemoteBuffer(0x7000, 4096, 0x1234, True))
    with pytest.raises(rdma.RdmaQueueError, match="bogus remote invalidation for rkey 0x4321"):
        h.receive_response(pack_cqe(0), invalidated_rkey=0x4321)
    h.submit(Command(IoOpcode.FLUSH, nsid=1))
    with pytest.raises(rdma.RdmaQueueError, match="registered nothing"):
        h.receive_response(pack_cqe(1), invalidated_rkey=0x1)


def test_host_queue_limits() -> None:
    h = rdma.RdmaHostQueue(1, 2)
    h.submit(Command(IoOpcode.FLUSH))
    h.submit(Command(IoOpcode.FLUSH))
    with pytest.raises(rdma.RdmaQueueError, match="all 2 command ids are in use"):
        h.submit(Command(IoOpcode.FLUSH))
    with pytest.raises(rdma.RdmaQueueError, match="cid 7, which is not in flight"):
        h.receive_response(pack_cqe(7))
    with pytest.raises(ValueError, match="does not fit 24 bits"):
        h.submit(Command(IoOpcode.READ), buffer=rdma.RemoteBuffer(0, 1 << 24, 1))
    with pytest.raises(ValueError, match="512 in-capsule bytes exceed the 0"):
        rdma.RdmaHostQueue(1, 2).submit(Command(IoOpcode.WRITE), incapsule=bytes(512))
    with pytest.raises(ValueError, match="admin queue carries no in-capsule"):
        rdma.RdmaHostQueue(0, 32, incapsule_size=4096)
    assert sorted(h.abort_all()) == [0, 1]
    assert Completion.from_bytes(pack_cqe(0)).cid == 0


def test_host_and_controller_agree_end_to_end() -> None:
    host = rdma.RdmaHostQueue(1, 32)
    decision = rdma.accept_connect_request(host.connect_private_data(cntlid=1))
    assert isinstance(decision, rdma.CmAccept)
    assert rdma.parse_accept(decision.private_data) == 32
    ctrl = rdma.RdmaControllerQueue(decision.params, max_transfer=MIB)
    sqe = host.submit(Command(IoOpcode.READ, nsid=1), buffer=rdma.RemoteBuffer(0x9000, 4096, 0x77, True))
    cmd = ctrl.receive_capsule(sqe)
    ctrl.plan(cmd.cid, Direction.C2H, 4096)
    write, send = ctrl.complete(cmd.cid, pack_cqe(cmd.cid, sqid=1), 4096)
    assert write == rdma.RdmaWrite(0x9000, 4096, 0x77, 0)
    assert isinstance(send, rdma.Send)
    assert host.receive_response(send.cqe, send.invalidate_rkey).remotely_invalidated
