"""NVMe/RDMA on asyncio through pyverbs: the RDMA CM passive side and one RC QP per NVMe queue.

Modelled on Linux nvmet rdma.c: a CONNECT_REQUEST's private data sizes the queue or is rejected
with an NVMe/RDMA status (nvmeof.rdma.accept_connect_request); the QP is ours, driven through the
CM (INIT/RTR/RTS), its receives posted before the accept. Each received capsule becomes a Request
run through the command lifecycle (target/lifecycle.py) as a Task, this connection its TransportQueue
(``RDMA_OPS``), with nvmeof.rdma.RdmaControllerQueue deciding the data movement: keyed SGLs are
served by RDMA READ into the queue's registered buffer pool (host writes and the admin Connect data)
and by RDMA WRITE chained before the response SEND (host reads); SEND_WITH_INV when the descriptor
asks for it. A broken capsule, a failed work completion (an SGL beyond the host's registration, an
overrun receive) or a CM disconnect tears only that queue down (and its controller, for an admin
queue). CM and completion events are read in the event loop from their fds (nvmeof/verbs.py).

Without pyverbs this module still imports; starting a listener raises RdmaUnavailable saying how to
install Debian's python3-pyverbs.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from nvmeof import defaults
from nvmeof import rdma as core
from nvmeof import verbs as rv
from nvmeof.spec.fabrics import CONNECT_IATTR_SQE, FABRICS_OPCODE, TrType
from nvmeof.spec.nvme import SGL_ID_KEYED, SGL_ID_KEYED_INVALIDATE, Command, Direction, FabricsType
from nvmeof.spec.rdma import RejectStatus, pack_cm_reject
from nvmeof.status import NvmeError, Status
from target.lifecycle import start_command
from target.request import Request, TargetQueue
from target.transport_ops import TransportOps

if TYPE_CHECKING:
    import types

    from target.model import Listener
    from target.ports import TransportHost

log = logging.getLogger(__name__)

_IPO_SQE_QID = 42   # Connect SQE byte offset of QID, for Connect Invalid Parameter


# nvmet_rdma_ops: keyed SGLs (0x40/0x4F). check_sgl allows the TCP in-capsule sizes; the queue's own
# receive buffers (nvmeof.rdma.RdmaControllerQueue) then bound what an admin queue can take (nothing).
RDMA_OPS = TransportOps(trtype="rdma", name="NVMe/RDMA", nvme_trtype=TrType.RDMA,
                        sgl_types=frozenset({SGL_ID_KEYED, SGL_ID_KEYED_INVALIDATE}),
                        admin_incapsule=defaults.ADMIN_INCAPSULE_SIZE, io_incapsule=defaults.IO_INCAPSULE_SIZE)


class RdmaRequest(Request):
    """A Request with the pool range its host data was read into (given back by release)."""

    __slots__ = ("held",)

    def __init__(self, queue: TargetQueue, cmd: Command) -> None:
        super().__init__(queue, cmd)
        self.held: tuple[int, int] | None = None


class RdmaTargetConnection:
    """The controller end of one NVMe/RDMA queue (one CM id, one RC QP): the TransportQueue the
    command lifecycle (target/lifecycle.py) drives. Commands run as Tasks (``eager`` off, as before)."""

    ops = RDMA_OPS
    eager = False

    def __init__(self, listener: RdmaListener, cmid: Any, handle: int, params: core.QueueParams,
                 read_depth: int) -> None:
        self.listener = listener
        self.target = listener.target
        self.pv = listener.pv
        self.cmid = cmid
        self.handle = handle
        self.params = params
        self.read_depth = read_depth
        # The admin queue's receives hold an SQE only (the Linux host never sends admin data inline).
        incapsule = 0 if params.is_admin else listener.listener.inline_data_size
        self.rq = core.RdmaControllerQueue(params, incapsule_size=incapsule)
        local, peer = rv.cmid_addresses(cmid)
        self.queue = TargetQueue(ops=self.ops, peer=peer, listener=listener.listener,
                                 local_addr=rv.host_of(local), close=self._close_by_target)
        self.established = False
        self.closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._reads: dict[int, asyncio.Future[None]] = {}
        self._next_read = 0
        self._sends: dict[int, tuple[int, int] | None] = {}   # response slot -> data range to free after it
        self._free_slots: list[int] = []
        self._slot_waiters: list[asyncio.Future[None]] = []
        self.qp: rv.VerbsQueuePair | None = None
        self.regions: list[rv.Region] = []
        self.pool: rv.BufferPool | None = None

    # --- setup ----------------------------------------------------------------------------------

    def accept(self, private_data: bytes) -> None:
        """Create the QP and buffers, post the receives, move the QP to RTS and accept."""
        pv, e = self.pv, self.pv.e
        listen = self.listener.listen_id
        ctx, pd = listen.context, listen.pd
        nrecv = self.params.recv_queue_size
        nslots = nrecv + 4
        self.qp = rv.VerbsQueuePair(pv, ctx, pd, send_wr=2 * nrecv + 8, recv_wr=nrecv,
                                    on_completion=self._on_completion)
        self.recv = rv.Region(pv, pd, nrecv * self.rq.recv_buffer_size, e.IBV_ACCESS_LOCAL_WRITE)
        self.rsp = rv.Region(pv, pd, nslots * 16, e.IBV_ACCESS_LOCAL_WRITE)
        size = defaults.RDMA_ADMIN_BUFFER_POOL if self.params.is_admin else defaults.RDMA_IO_BUFFER_POOL
        data = rv.Region(pv, pd, size, e.IBV_ACCESS_LOCAL_WRITE)
        self.regions = [self.recv, self.rsp, data]
        self.pool = rv.BufferPool(data)
        self._free_slots = list(range(nslots - 1, -1, -1))
        self.qp.to_state(self.cmid, e.IBV_QPS_INIT)
        for i in range(nrecv):
            self._post_recv(i)
        self.qp.to_state(self.cmid, e.IBV_QPS_RTR)
        self.qp.to_state(self.cmid, e.IBV_QPS_RTS)
        param = pv.ConnParam(resources=defaults.RDMA_READ_DEPTH, depth=self.read_depth, qp_num=self.qp.qp.qp_num,
                             data_len=len(private_data))
        param.set_private_data(private_data)
        self.cmid.accept(param)

    def _post_recv(self, slot: int) -> None:
        assert self.qp is not None
        size = self.rq.recv_buffer_size
        self.qp.post_recv((rv.WR_RECV << 32) | slot, self.recv.addr + slot * size, size, self.recv.lkey)

    # --- completions ----------------------------------------------------------------------------

    def _on_completion(self, wc: Any) -> None:
        kind, index = wc.wr_id >> 32, wc.wr_id & 0xFFFFFFFF
        if wc.status != self.pv.e.IBV_WC_SUCCESS:
            if wc.status == rv.WC_WR_FLUSH_ERR:
                reason = "work requests flushed (QP in error)"
            elif kind == rv.WR_RECV:
                reason = f"receiving a command capsule failed, {rv.wc_status_text(wc)} (oversized capsule?)"
            elif kind == rv.WR_READ:
                reason = (f"RDMA READ of host data failed, {rv.wc_status_text(wc)} (SGL outside the host's "
                          "registered memory?)")
            else:
                reason = f"work request kind {kind} failed, {rv.wc_status_text(wc)}"
            self.close(reason)
            return
        if kind == rv.WR_RECV:
            if not self.closed:
                self._on_capsule(index, wc.byte_len)
        elif kind == rv.WR_READ:
            fut = self._reads.pop(index, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif kind == rv.WR_SEND:
            data = self._sends.pop(index, None)
            if data is not None and self.pool is not None:
                self.pool.release(*data)
            self._free_slots.append(index)
            waiters, self._slot_waiters = self._slot_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def _on_capsule(self, slot: int, length: int) -> None:
        size = self.rq.recv_buffer_size
        # copy, so the receive goes back to the host at once
        capsule = bytes(self.recv.view[slot * size:slot * size + length])
        try:
            cmd = self.rq.receive_capsule(capsule)
        except core.RdmaQueueError as err:
            self.close(f"bad command capsule: {err}")
            return
        self._post_recv(slot)
        task = start_command(self.target, self, RdmaRequest(self.queue, cmd))
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # --- commands -------------------------------------------------------------------------------

    # --- TransportQueue: what the command lifecycle asks of this queue --------------------------

    def fetch_data(self, req: RdmaRequest) -> Awaitable[None] | None:
        """Check the descriptor (nvmeof.rdma plan); host data comes in-capsule or by RDMA READ into the
        queue's registered pool (nvmet_rdma_map_sgl_keyed + nvmet_rdma_rdma_read)."""
        plan = self.rq.plan(req.cmd.cid, req.direction, req.data_len)
        cmd = req.cmd
        if cmd.opcode == FABRICS_OPCODE and cmd.fctype == FabricsType.CONNECT and cmd.cdw10 >> 16 != self.params.qid:
            raise NvmeError(Status.CONNECT_INVALID_PARAM,
                            f"Connect for qid {cmd.cdw10 >> 16} on the RDMA queue the CM set up as qid "
                            f"{self.params.qid}", result=(CONNECT_IATTR_SQE << 16) | _IPO_SQE_QID)
        if req.direction != Direction.H2C:
            return None
        if plan.data is not None:
            req.data = plan.data
            return None
        return self._fetch_keyed(req, plan.reads)

    async def _fetch_keyed(self, req: RdmaRequest, reads: list[core.RdmaRead]) -> None:
        pool = self.pool
        assert pool is not None
        held = (await pool.acquire(req.data_len), req.data_len)
        try:
            await self._read(reads, held[0])
        except BaseException:
            if not self.closed:
                pool.release(*held)
            raise
        req.held = held
        req.data = pool.view(*held)

    def release(self, req: RdmaRequest) -> None:
        if req.held is not None and not self.closed and self.pool is not None:
            self.pool.release(*req.held)
        req.held = None

    async def queue_response(self, req: Request, cqe: bytes, data: bytes | bytearray | memoryview | None) -> None:
        """Reply data by RDMA WRITE from the pool, chained before the response SEND (nvmet_rdma_queue_response)."""
        pool = self.pool
        assert pool is not None
        held: tuple[int, int] | None = None
        try:
            if data is not None:
                held = (await pool.acquire(len(data)), len(data))
                if self.closed:
                    return
                pool.view(*held)[:] = data
            actions = self.rq.complete(req.cmd.cid, cqe, len(data) if data is not None else 0)
            await self._respond(actions, held)
            held = None   # freed when the SEND completes (the WRITE before it has then completed)
        except ConnectionError:
            return   # torn down while waiting for the pool
        finally:
            if held is not None and not self.closed:
                pool.release(*held)

    async def _read(self, reads: list[core.RdmaRead], offset: int) -> None:
        assert self.qp is not None
        futures = []
        region = self.pool.region if self.pool else None
        assert region is not None
        for action in reads:
            token = self._next_read = (self._next_read + 1) & 0xFFFFFFFF
            fut = asyncio.get_running_loop().create_future()
            self._reads[token] = fut
            futures.append(fut)
            # the QP's max_rd_atomic (the negotiated initiator depth) bounds how many are on the wire
            self.qp.post_send((rv.WR_READ << 32) | token, self.pv.e.IBV_WR_RDMA_READ,
                              region.addr + offset + action.local_offset, action.length, region.lkey,
                              remote=(action.addr, action.rkey))
        await asyncio.gather(*futures)

    async def _respond(self, actions: list[core.RdmaWrite | core.Send], data: tuple[int, int] | None) -> None:
        while not self._free_slots:
            fut = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(fut)
            await fut
            if self.closed:
                return
        qp, e = self.qp, self.pv.e
        assert qp is not None and self.pool is not None
        region = self.pool.region
        slot = self._free_slots.pop()
        for action in actions:
            if isinstance(action, core.RdmaWrite):
                assert data is not None
                qp.post_send((rv.WR_WRITE << 32) | slot, e.IBV_WR_RDMA_WRITE,
                             region.addr + data[0] + action.local_offset, action.length, region.lkey,
                             remote=(action.addr, action.rkey))
            else:
                self.rsp.view[slot * 16:slot * 16 + 16] = action.cqe
                self._sends[slot] = data
                opcode = e.IBV_WR_SEND if action.invalidate_rkey is None else e.IBV_WR_SEND_WITH_INV
                qp.post_send((rv.WR_SEND << 32) | slot, opcode, self.rsp.addr + slot * 16, 16, self.rsp.lkey,
                             invalidate_rkey=action.invalidate_rkey)

    # --- teardown -------------------------------------------------------------------------------

    def _close_by_target(self) -> None:
        self.close("closed by the target", graceful=True)

    def close(self, reason: str = "closed by the target", *, graceful: bool = False) -> None:
        """Tear this queue down: fail what is in flight, disconnect, flush, free the verbs objects.

        ``graceful`` (the target closing a healthy queue, e.g. after a Disconnect command) lets the
        responses already posted reach the host first, as nvmet drains its QP.
        """
        if self.closed:
            return
        self.closed = True
        level = logging.INFO if graceful or "disconnected" in reason else logging.WARNING
        log.log(level, "NVMe/RDMA qid %d from %s torn down: %s", self.params.qid, self.queue.peer or "?", reason)
        self.listener.connections.pop(self.handle, None)
        for task in list(self._tasks):
            task.cancel()
        for fut in [*self._reads.values(), *self._slot_waiters]:
            if not fut.done():
                fut.cancel()
        self._reads.clear()
        self.rq.abort_all()
        if self.pool is not None:
            self.pool.close()
        self.target.queue_closed(self.queue)
        if graceful and self._sends and self.qp is not None:
            asyncio.get_running_loop().create_task(self._drain_then_release())
        else:
            self._release()

    async def _drain_then_release(self) -> None:
        for _ in range(100):
            if not self._sends or self.qp is None or self.qp.closed:
                break
            await asyncio.sleep(0.01)
        self._release()

    def _release(self) -> None:
        try:
            self.cmid.disconnect()
        except self.pv.PyverbsError:
            pass   # never established, or the peer went first
        if self.qp is not None:
            self.qp.to_error()
            self.qp.close()
        for region in self.regions:
            region.close()
        try:
            self.cmid.close()
        except self.pv.PyverbsError as exc:
            log.debug("destroying the CM id failed: %s", exc)


class RdmaListener:
    """Accepts NVMe/RDMA connections on one address through the RDMA connection manager."""

    def __init__(self, target: TransportHost, listener: Listener) -> None:
        self.target = target
        self.listener = listener
        self.connections: dict[int, RdmaTargetConnection] = {}
        self.pv: types.SimpleNamespace = None  # type: ignore[assignment]
        self.cm: rv.CmEventChannel | None = None
        self.listen_id: Any = None
        self._bare_id: Any = None
        self._handle = 0

    @property
    def port(self) -> int:
        return self.listener.trsvcid

    async def start(self) -> None:
        self.pv = pv = rv.load_pyverbs()
        addr = self.listener.traddr
        if ipaddress.ip_address(addr).is_unspecified:
            raise ValueError(f"NVMe/RDMA listeners need the address of an RDMA device, not {addr}: pyverbs 44 "
                             "cannot serve a wildcard RDMA CM listener")
        if not self.listener.trsvcid:
            raise ValueError("NVMe/RDMA listeners need an explicit port (4420 is the NVMe/RDMA port)")
        ce = pv.ce
        self.cm = rv.CmEventChannel(pv, f"NVMe/RDMA listener {self.listener.id}")
        try:
            self.listen_id = pv.CMID(creator=self.cm.channel, port_space=ce.RDMA_PS_TCP)
            self._handle = rv.cmid_handle(self.listen_id, self.cm.channel)
            ai = pv.AddrInfo(src=addr, src_service=str(self.listener.trsvcid), port_space=ce.RDMA_PS_TCP,
                             flags=ce.RAI_PASSIVE)
            try:
                self.listen_id.bind_addr(ai)
            except pv.PyverbsError as exc:
                raise OSError(errno.EADDRNOTAVAIL,
                              f"no RDMA device has address {addr} port {self.listener.trsvcid} free ({exc}); add "
                              "one (Soft-RoCE: rdma link add rxe0 type rxe netdev eth0) or pick another "
                              "address") from None
            if self.listen_id.context is None or self.listen_id.pd is None:
                raise OSError(errno.EADDRNOTAVAIL, f"{addr} is not the address of an RDMA device")
            self.listen_id.listen(128)
        except BaseException:
            self._close_ids()
            raise
        self._bare_id = pv.CMID()   # a listen_id without verbs objects: see _on_request
        self.cm.start(self._dispatch)
        log.info("NVMe/RDMA listening on %s:%d%s", addr, self.listener.trsvcid,
                 " (discovery)" if self.listener.discovery else "")

    async def stop(self) -> None:
        if self.cm is not None:
            self.cm.stop()
        for conn in list(self.connections.values()):
            conn.close("listener stopped")
        self.connections.clear()
        self._close_ids()

    def _close_ids(self) -> None:
        rv.close_quietly(self.listen_id)
        if self.cm is not None:
            self.cm.close()
        self.listen_id = self.cm = None

    # --- CM events ------------------------------------------------------------------------------

    def _dispatch(self, ev: Any) -> None:
        ce = self.pv.ce
        kind = ev.event_type
        handle = rv.event_handle(ev)
        if kind == ce.RDMA_CM_EVENT_CONNECT_REQUEST:
            self._on_request(ev, handle)
            return
        conn = self.connections.get(handle)
        if kind == ce.RDMA_CM_EVENT_ESTABLISHED:
            if conn is not None:
                conn.established = True
        elif kind == ce.RDMA_CM_EVENT_DEVICE_REMOVAL and handle == self._handle:
            log.error("NVMe/RDMA listener %s: the RDMA device went away; no longer listening", self.listener.id)
            asyncio.get_running_loop().create_task(self.stop())
        elif conn is not None and kind in (ce.RDMA_CM_EVENT_DISCONNECTED, ce.RDMA_CM_EVENT_TIMEWAIT_EXIT,
                                           ce.RDMA_CM_EVENT_CONNECT_ERROR, ce.RDMA_CM_EVENT_UNREACHABLE,
                                           ce.RDMA_CM_EVENT_REJECTED, ce.RDMA_CM_EVENT_DEVICE_REMOVAL,
                                           ce.RDMA_CM_EVENT_ADDR_CHANGE):
            ev.ack_cm_event()   # the id is destroyed below; its events must be acked first
            conn.close(f"host {'disconnected' if kind == ce.RDMA_CM_EVENT_DISCONNECTED else ev.event_str()}")

    def _on_request(self, ev: Any, handle: int) -> None:
        pv = self.pv
        private = ev.private_data
        responder_resources, _ = rv.event_rd_atomic(ev)
        # The CM id gets no verbs wrappers of its own: pyverbs' CMID.close() would null the
        # listener's Context/PD, which every connection of this listener shares.
        cmid = pv.CMID(creator=ev, listen_id=self._bare_id)
        ev.ack_cm_event()
        target = self.target
        decision = core.accept_connect_request(private, cntlid_valid=lambda c: c in target.controllers)
        _, peer = rv.cmid_addresses(cmid)
        if not handle:
            log.error("NVMe/RDMA connect from %s: cannot tell which CM id the request is for (pyverbs layout); "
                      "rejecting", peer or "?")
            self._reject(cmid, pack_cm_reject(RejectStatus.NO_RSC))
            return
        if isinstance(decision, core.CmReject):
            log.warning("NVMe/RDMA connect from %s rejected with %s: %s", peer or "?", decision.status.name,
                        decision.reason)
            self._reject(cmid, decision.private_data)
            return
        depth = min(defaults.RDMA_READ_DEPTH, responder_resources or defaults.RDMA_READ_DEPTH)
        conn = RdmaTargetConnection(self, cmid, handle, decision.params, depth)
        try:
            conn.accept(decision.private_data)
        except Exception as exc:
            log.warning("NVMe/RDMA connect from %s (qid %d): cannot set the queue up (%s); rejecting with NO_RSC",
                        peer or "?", decision.params.qid, exc)
            conn.closed = True
            if conn.qp is not None:
                conn.qp.close()
            for region in conn.regions:
                region.close()
            self._reject(cmid, pack_cm_reject(RejectStatus.NO_RSC))
            return
        self.connections[handle] = conn
        log.debug("NVMe/RDMA qid %d from %s accepted (hsqsize %d, hrqsize %d)", decision.params.qid, peer,
                  decision.params.hsqsize, decision.params.hrqsize)

    def _reject(self, cmid: Any, private_data: bytes) -> None:
        try:
            cmid.reject(private_data)
        except self.pv.PyverbsError as exc:
            log.warning("NVMe/RDMA reject failed: %s", exc)
        cmid.close()
