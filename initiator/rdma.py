"""One NVMe/RDMA queue on the host side: the RDMA CM active side and an RC QP, with HostQueue's API.

Follows the Linux host (drivers/nvme/host/rdma.c): resolve the address and route, create the QP and
post the response receives, connect with the NVMe/RDMA private data (qid, hrqsize, hsqsize, cntlid),
move the QP to RTS on CONNECT_RESPONSE and establish. Data moves through one registered buffer pool
per queue (no registration per command): writes are copied into it (or sent in-capsule on I/O queues
when the controller advertises SGLS.SAOS and IOCCSZ allows), reads land in it; the keyed SGL names
the pool's rkey without the invalidate subtype, so a remote invalidation is bogus and breaks the
queue (nvmeof.rdma.RdmaHostQueue checks it). A command completes once both its capsule SEND and its
response RECV completed, as in the Linux host. A CM reject raises TransportError with the NVMe/RDMA
status; a disconnect, a failed work completion or a timeout breaks the queue like a lost TCP
connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

from initiator.queue import DEFAULT_TIMEOUT, CommandTimeout, TransportError, data_views
from nvmeof import defaults
from nvmeof import rdma as core
from nvmeof import verbs as rv
from nvmeof.spec.nvme import SQE_SIZE, Command, Completion
from nvmeof.status import NvmeError, Status

CQE_SIZE = 16


class _Pending:
    __slots__ = ("cid", "data", "data_in", "future", "opcode", "response", "sent", "timer")

    def __init__(self, cid: int, opcode: int, future: asyncio.Future[Completion],
                 data: tuple[int, int] | None, data_in: memoryview | None) -> None:
        self.cid = cid
        self.opcode = opcode
        self.future = future
        self.data = data          # (pool offset, length)
        self.data_in = data_in
        self.sent = False
        self.response: core.HostResponse | None = None
        self.timer: asyncio.TimerHandle | None = None


class RdmaQueue:
    """One host queue over NVMe/RDMA; the same interface HostController uses on HostQueue."""

    def __init__(self, qid: int, *, queue_size: int, name: str = "", incapsule_size: int = 0,
                 timeout: float | None = 30.0, cntlid: int = 0) -> None:
        self.qid = qid
        self.name = name or f"rdma queue {qid}"
        self.queue_size = queue_size
        self.incapsule_size = 0 if qid == 0 else incapsule_size
        self.timeout = timeout
        self.cntlid = cntlid
        self.commands_submitted = 0
        self.on_broken: Any = None
        self.rq = core.RdmaHostQueue(qid, queue_size, incapsule_size=self.incapsule_size)
        self.pv: Any = None
        self.cm: rv.CmEventChannel | None = None
        self.cmid: Any = None
        self.qp: rv.VerbsQueuePair | None = None
        self.regions: list[rv.Region] = []
        self.pool: rv.BufferPool | None = None
        self.crqsize: int | None = None
        self._events: asyncio.Queue[tuple[int, bytes, str]] = asyncio.Queue()
        self._pending: dict[int, _Pending] = {}
        self._send_slots: dict[int, _Pending] = {}
        self._free_send: list[int] = []
        self._slots = asyncio.Semaphore(queue_size - 1)
        self._error: TransportError | None = None
        self._closed: asyncio.Future[None] | None = None
        self._connected = False

    # ---- interface shared with HostQueue ---------------------------------------------------------

    @property
    def inflight(self) -> int:
        return len(self._pending)

    @property
    def broken(self) -> TransportError | None:
        return self._error

    @property
    def negotiated_digests(self) -> tuple[bool, bool]:
        return False, False   # NVMe/RDMA has no digests

    def close(self) -> None:
        self._break(TransportError(self.name, "queue closed by the host"))

    async def wait_closed(self) -> None:
        if self._closed is not None:
            await self._closed

    # ---- connect -------------------------------------------------------------------------------

    async def open(self, traddr: str, trsvcid: int, timeout: float | None) -> RdmaQueue:
        try:
            self.pv = pv = rv.load_pyverbs()
        except rv.RdmaUnavailable as exc:
            raise TransportError(self.name, str(exc)) from None
        loop = asyncio.get_running_loop()
        self._closed = loop.create_future()
        ce, e = pv.ce, pv.e
        try:
            self.cm = rv.CmEventChannel(pv, self.name)
            self.cm.start(self._on_cm_event)
            self.cmid = pv.CMID(creator=self.cm.channel, port_space=ce.RDMA_PS_TCP)
            ms = defaults.RDMA_CM_TIMEOUT_MS
            self.cmid.resolve_addr(pv.AddrInfo(dst=traddr, dst_service=str(trsvcid), port_space=ce.RDMA_PS_TCP), ms)
            await self._expect(ce.RDMA_CM_EVENT_ADDR_RESOLVED, timeout, f"resolving {traddr} to an RDMA device")
            self.cmid.resolve_route(ms)
            await self._expect(ce.RDMA_CM_EVENT_ROUTE_RESOLVED, timeout, f"resolving the route to {traddr}")
            self._setup_verbs()
            assert self.qp is not None
            self.qp.to_state(self.cmid, e.IBV_QPS_INIT)
            for slot in range(self.queue_size):
                self._post_recv(slot)
            private = self.rq.connect_private_data(self.cntlid)
            # the Linux host's CM parameters: flow control, retry/RNR retry 7
            param = pv.ConnParam(resources=defaults.RDMA_READ_DEPTH, depth=defaults.RDMA_READ_DEPTH, flow_control=1,
                                 retry=7, rnr_retry=7, qp_num=self.qp.qp.qp_num, data_len=len(private))
            param.set_private_data(private)
            self.cmid.connect(param)
            data = await self._expect(ce.RDMA_CM_EVENT_CONNECT_RESPONSE, timeout,
                                      f"connecting to {traddr}:{trsvcid}")
            self.crqsize = core.parse_accept(data)
            self.qp.to_state(self.cmid, e.IBV_QPS_RTR)
            self.qp.to_state(self.cmid, e.IBV_QPS_RTS)
            self.cmid.establish()
            self._connected = True
        except core.ConnectRejected as exc:
            err = TransportError(self.name, str(exc))
            self._break(err)
            raise err from None
        except (core.RdmaQueueError, rv.RdmaUnavailable) as exc:
            err = TransportError(self.name, str(exc))
            self._break(err)
            raise err from None
        except pv.PyverbsError as exc:
            err = TransportError(self.name, f"cannot connect to {traddr}:{trsvcid} over RDMA: {exc}")
            self._break(err)
            raise err from None
        except BaseException as exc:
            if not isinstance(exc, TransportError):
                self._break(TransportError(self.name, f"connect aborted: {exc!r}"))
            else:
                self._break(exc)
            raise
        return self

    def _setup_verbs(self) -> None:
        pv, e = self.pv, self.pv.e
        ctx, pd = self.cmid.context, self.cmid.pd
        n = self.queue_size
        self.qp = rv.VerbsQueuePair(pv, ctx, pd, send_wr=n + 4, recv_wr=n, on_completion=self._on_completion)
        self.send_stride = SQE_SIZE + self.incapsule_size
        self.send = rv.Region(pv, pd, n * self.send_stride, e.IBV_ACCESS_LOCAL_WRITE)
        self.recv = rv.Region(pv, pd, n * CQE_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        size = defaults.RDMA_ADMIN_BUFFER_POOL if self.qid == 0 else defaults.RDMA_IO_BUFFER_POOL
        data = rv.Region(pv, pd, size, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE)
        self.regions = [self.send, self.recv, data]
        self.pool = rv.BufferPool(data)
        self._free_send = list(range(n - 1, -1, -1))

    async def _expect(self, kind: int, timeout: float | None, what: str) -> bytes:
        try:
            got, data, text = await asyncio.wait_for(self._events.get(), timeout)
        except TimeoutError:
            raise TransportError(self.name, f"{what}: no RDMA CM event within {timeout} s") from None
        if got == kind:
            return data
        ce = self.pv.ce
        if got == ce.RDMA_CM_EVENT_REJECTED:
            raise core.rejection(data)
        raise TransportError(self.name, f"{what} failed: RDMA CM event {text or got}")

    def _on_cm_event(self, ev: Any) -> None:
        ce = self.pv.ce
        kind, text = ev.event_type, ev.event_str()
        data = ev.private_data if kind in (ce.RDMA_CM_EVENT_CONNECT_RESPONSE, ce.RDMA_CM_EVENT_REJECTED) else b""
        ev.ack_cm_event()   # before _break destroys the CM id (rdma_destroy_id waits for unacked events)
        if not self._connected:
            self._events.put_nowait((kind, data, text))
        elif kind in (ce.RDMA_CM_EVENT_DISCONNECTED, ce.RDMA_CM_EVENT_DEVICE_REMOVAL,
                      ce.RDMA_CM_EVENT_TIMEWAIT_EXIT):
            self._break(TransportError(self.name, f"controller {'disconnected' if 'DISCONN' in text else text}"))

    # ---- commands ------------------------------------------------------------------------------

    def _post_recv(self, slot: int) -> None:
        assert self.qp is not None
        self.qp.post_recv((rv.WR_RECV << 32) | slot, self.recv.addr + slot * CQE_SIZE, CQE_SIZE, self.recv.lkey)

    async def submit(self, cmd: Command, *, data_out: Any = None, data_in: bytearray | memoryview | None = None,
                     timeout: Any = DEFAULT_TIMEOUT) -> Completion:
        if self._error is not None:
            raise self._error
        out_view, in_view = data_views(data_out, data_in)
        length = len(out_view) if out_view is not None else len(in_view) if in_view is not None else 0
        if length > core.KEYED_SGL_MAX_LENGTH:
            raise ValueError(f"{length} bytes do not fit one keyed SGL (24-bit length)")
        async with self._slots:
            return await self._submit(cmd, out_view, in_view, length, timeout)

    async def _submit(self, cmd: Command, out_view: memoryview | None, in_view: memoryview | None, length: int,
                      timeout: Any) -> Completion:
        pool = self.pool
        assert pool is not None and self.qp is not None
        held: tuple[int, int] | None = None
        incapsule = None
        if out_view is not None and length <= self.incapsule_size:
            incapsule = out_view
        elif length:
            try:
                held = (await pool.acquire(length), length)
            except ConnectionError:
                raise self._error or TransportError(self.name, "queue torn down") from None
            if out_view is not None:
                pool.view(held[0], length)[:] = out_view
        if self._error is not None:
            if held:
                pool.release(*held)
            raise self._error
        buffer = core.RemoteBuffer(pool.region.addr + held[0], length, pool.region.rkey) if held else None
        sqe = self.rq.submit(cmd, buffer=buffer, incapsule=incapsule)
        loop = asyncio.get_running_loop()
        pending = _Pending(cmd.cid, cmd.opcode, loop.create_future(), held, in_view)
        self._pending[cmd.cid] = pending
        slot = self._free_send.pop()
        base = slot * self.send_stride
        view = self.send.view
        view[base:base + SQE_SIZE] = sqe
        size = SQE_SIZE
        if incapsule is not None:
            view[base + SQE_SIZE:base + SQE_SIZE + len(incapsule)] = incapsule
            size += len(incapsule)
        self._send_slots[slot] = pending
        if timeout is DEFAULT_TIMEOUT:
            timeout = self.timeout
        if timeout is not None:
            pending.timer = loop.call_later(timeout, self._on_timeout, pending, timeout)
        try:
            self.qp.post_send((rv.WR_SEND << 32) | slot, self.pv.e.IBV_WR_SEND, self.send.addr + base, size,
                              self.send.lkey)
        except self.pv.PyverbsError as exc:
            self._break(TransportError(self.name, f"posting the command capsule failed: {exc}"))
        self.commands_submitted += 1
        return await pending.future

    def _on_completion(self, wc: Any) -> None:
        kind, index = wc.wr_id >> 32, wc.wr_id & 0xFFFFFFFF
        if wc.status != self.pv.e.IBV_WC_SUCCESS:
            what = "receiving a response" if kind == rv.WR_RECV else "sending a command capsule"
            self._break(TransportError(self.name, f"{what} failed: {rv.wc_status_text(wc)}"))
            return
        if kind == rv.WR_SEND:
            pending = self._send_slots.pop(index, None)
            self._free_send.append(index)
            if pending is not None:
                pending.sent = True
                self._maybe_finish(pending)
        elif kind == rv.WR_RECV:
            raw = bytes(self.recv.view[index * CQE_SIZE:index * CQE_SIZE + CQE_SIZE])
            self._post_recv(index)
            invalidated = wc.imm_data if wc.wc_flags & self.pv.e.IBV_WC_WITH_INV else None
            try:
                response = self.rq.receive_response(raw[:wc.byte_len], invalidated)
            except core.RdmaQueueError as err:
                self._break(TransportError(self.name, str(err)))
                return
            pending = self._pending.pop(response.completion.cid, None)
            if pending is None:
                return
            pending.response = response
            self._maybe_finish(pending)

    def _maybe_finish(self, pending: _Pending) -> None:
        response = pending.response
        if response is None or not pending.sent:
            return
        if pending.timer is not None:
            pending.timer.cancel()
        if pending.data is not None:
            if pending.data_in is not None and self.pool is not None:
                n = len(pending.data_in)
                pending.data_in[:] = self.pool.view(pending.data[0], n)
            if self.pool is not None:
                self.pool.release(*pending.data)
            pending.data = None
        fut = pending.future
        if fut.done():
            return
        cqe = response.completion
        if cqe.status_code != Status.SUCCESS:
            fut.set_exception(NvmeError(cqe.status_code, f"{self.name} cid {pending.cid} opcode {pending.opcode:#04x}",
                                        dnr=cqe.dnr, more=cqe.more, result=cqe.dw0))
        else:
            fut.set_result(cqe)

    def _on_timeout(self, pending: _Pending, timeout: float) -> None:
        pending.timer = None
        err = CommandTimeout(self.name, f"cid {pending.cid} opcode {pending.opcode:#04x} got no completion in "
                                        f"{timeout} s; the queue is torn down")
        if not pending.future.done():
            pending.future.set_exception(err)
        self._break(TransportError(self.name, f"torn down after cid {pending.cid} timed out"))

    # ---- teardown ------------------------------------------------------------------------------

    def _break(self, err: TransportError) -> None:
        if self._error is not None:
            return
        self._error = err
        for pending in [*self._pending.values(), *self._send_slots.values()]:
            if pending.timer is not None:
                pending.timer.cancel()
            if not pending.future.done():
                pending.future.set_exception(err)
                pending.future.exception()
        self._pending.clear()
        self._send_slots.clear()
        self.rq.abort_all()
        if self.pool is not None:
            self.pool.close()
        if self.cm is not None:
            self.cm.stop()
        pv = self.pv
        if self.cmid is not None and self._connected:
            try:
                self.cmid.disconnect()
            except pv.PyverbsError:
                pass
        if self.qp is not None:
            self.qp.to_error()
            self.qp.close()
        for region in self.regions:
            region.close()
        rv.close_quietly(self.cmid)
        if self.cm is not None:
            self.cm.close()
        self.cmid = self.cm = None
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)
        if self.on_broken is not None and self._connected:
            self.on_broken(err)


async def open_rdma_queue(queue: RdmaQueue, traddr: str, trsvcid: int, timeout: float | None) -> RdmaQueue:
    """Connect ``queue`` (CM resolve, QP, private data, establish)."""
    return await queue.open(traddr, trsvcid, timeout)
