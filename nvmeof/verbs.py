"""pyverbs plumbing shared by the NVMe/RDMA target listener (target/transports/rdma.py) and the host
queues (initiator/rdma.py): the one module of the protocol core that touches verbs and the event loop.
pyverbs itself is imported only by :func:`load_pyverbs`, so the core imports without it.

What pyverbs 44 (Debian bookworm's python3-pyverbs, rdma-core 44) lacks, and how this module fills it
in (facts proven in the guest; docs/RDMA-NOTES.md):

- It exposes neither the completion channel's nor the CM event channel's file descriptor, nor the
  ``rdma_cm_id`` an event belongs to. Those live in the C structures behind the Cython objects: the
  first C field of CMEventChannel / CMEvent / CMID / CompChannel sits right after PyObject_HEAD,
  ``__weakref__``, ``logger`` and the vtable pointer (offset 40 on 64-bit). :func:`_c_field` reads it
  and every use is checked against something independent (the fd's /proc link, the event type, the
  id's channel pointer), so a different layout fails loudly instead of misbehaving.
- Blocking verbs calls keep the GIL, so both fds are made non-blocking and read only from
  ``loop.add_reader`` callbacks: an empty channel raises instead of blocking the event loop.
- MRs are registered over memory we own (an anonymous mmap): a memoryview handed to a backend thread
  keeps the memory alive even if the queue is torn down and the MR deregistered meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import mmap
import os
import types
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

INSTALL_HINT = ("NVMe/RDMA needs pyverbs: install Debian's python3-pyverbs (apt-get install python3-pyverbs) "
                "and make /usr/lib/python3/dist-packages importable (for example "
                "PYTHONPATH=/usr/lib/python3/dist-packages)")

# Struct offsets (librdmacm/rdma_cma.h, libibverbs/verbs.h, x86-64)
_PYOBJ_FIELD = 40          # first C field of the pyverbs Cython objects named above
_COMP_CHANNEL_FD = 8       # struct ibv_comp_channel { ibv_context *context; int fd; ... }
_CM_ID_CHANNEL = 8         # struct rdma_cm_id { ibv_context *verbs; rdma_event_channel *channel; ...
_CM_ID_ROUTE = 32          #   void *context; ibv_qp *qp; struct rdma_route route (addr: src, dst 128 B each)
_SOCKADDR_STORAGE = 128
_CM_EVENT_TYPE = 16        # struct rdma_cm_event { rdma_cm_id *id; *listen_id; int event; int status;
_CM_EVENT_CONN = 24        #   union { struct rdma_conn_param conn; ... } param; }
_CONN_RESPONDER_RESOURCES = 9   # rdma_conn_param: private_data ptr (8), private_data_len (1), then these
_CONN_INITIATOR_DEPTH = 10

CM_CHANNEL_LINK = "/dev/infiniband/rdma_cm"
COMP_CHANNEL_LINK = "anon_inode:[infinibandevent]"

# wr_id = (kind << 32) | index: what a work completion belongs to
WR_RECV = 1
WR_SEND = 2
WR_READ = 3
WR_WRITE = 4


class RdmaUnavailable(RuntimeError):
    """pyverbs cannot be imported (or does not look like rdma-core 44's); the message says what to do."""


def load_pyverbs() -> types.SimpleNamespace:
    """The pyverbs names the adapters use, or RdmaUnavailable with installation advice."""
    try:
        import pyverbs.cm_enums as ce
        import pyverbs.enums as e
        from pyverbs.cmid import CMID, AddrInfo, CMEvent, CMEventChannel, ConnParam
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, RecvWR, SendWR
    except ImportError as exc:
        raise RdmaUnavailable(f"{INSTALL_HINT} (import failed: {exc})") from None
    return types.SimpleNamespace(
        ce=ce, e=e, CMID=CMID, AddrInfo=AddrInfo, CMEvent=CMEvent, CMEventChannel=CMEventChannel,
        ConnParam=ConnParam, CQ=CQ, CompChannel=CompChannel, MR=MR, PyverbsError=PyverbsError, QP=QP,
        QPAttr=QPAttr, QPCap=QPCap, QPInitAttr=QPInitAttr, SGE=SGE, RecvWR=RecvWR, SendWR=SendWR)


# --------------------------------------------------------------------------- C structure access


def _c_field(obj: object) -> int:
    cls = type(obj)
    if getattr(cls, "__weakrefoffset__", 0) != 16 or cls.__basicsize__ < _PYOBJ_FIELD + 8:
        raise RdmaUnavailable(f"pyverbs {cls.__name__} has an unexpected object layout; this transport "
                              "was written against rdma-core 44 (Debian bookworm)")
    return ctypes.c_void_p.from_address(id(obj) + _PYOBJ_FIELD).value or 0


def _checked_fd(fd: int, link: str, what: str) -> int:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = "nothing"
    if target != link:
        raise RdmaUnavailable(f"cannot find the {what} file descriptor (fd {fd} is {target}, expected {link}); "
                              "this pyverbs is not laid out like rdma-core 44's")
    os.set_blocking(fd, False)
    return fd


def cm_channel_fd(channel: object) -> int:
    """The (now non-blocking) fd of a CMEventChannel: struct rdma_event_channel { int fd; }."""
    ptr = _c_field(channel)
    if not ptr:
        raise RdmaUnavailable("CMEventChannel has no rdma_event_channel")
    return _checked_fd(ctypes.c_int.from_address(ptr).value, CM_CHANNEL_LINK, "RDMA CM event channel")


def comp_channel_fd(channel: object) -> int:
    """The (now non-blocking) fd of a CompChannel."""
    ptr = _c_field(channel)
    if not ptr:
        raise RdmaUnavailable("CompChannel has no ibv_comp_channel")
    return _checked_fd(ctypes.c_int.from_address(ptr + _COMP_CHANNEL_FD).value, COMP_CHANNEL_LINK,
                       "completion channel")


def cmid_handle(cmid: object, channel: object | None = None) -> int:
    """The rdma_cm_id pointer behind a CMID (events name their id by it); checked against its channel."""
    ptr = _c_field(cmid)
    if ptr and channel is not None:
        got = ctypes.c_void_p.from_address(ptr + _CM_ID_CHANNEL).value or 0
        if got != _c_field(channel):
            raise RdmaUnavailable("CMID's rdma_cm_id does not point at its event channel; unexpected pyverbs layout")
    return ptr


def event_handle(event: Any) -> int:
    """The rdma_cm_id pointer an event is about (0 if the event structure does not check out)."""
    ptr = _c_field(event)
    if not ptr or ctypes.c_int.from_address(ptr + _CM_EVENT_TYPE).value != event.event_type:
        return 0
    return ctypes.c_void_p.from_address(ptr).value or 0


def event_rd_atomic(event: Any) -> tuple[int, int]:
    """(responder_resources, initiator_depth) of a CONNECT_REQUEST / CONNECT_RESPONSE event."""
    ptr = _c_field(event)
    if not ptr:
        return 0, 0
    conn = ptr + _CM_EVENT_CONN
    return (ctypes.c_uint8.from_address(conn + _CONN_RESPONDER_RESOURCES).value,
            ctypes.c_uint8.from_address(conn + _CONN_INITIATOR_DEPTH).value)


def _format_sockaddr(ptr: int) -> str:
    family = ctypes.c_uint16.from_address(ptr).value
    port = int.from_bytes(ctypes.string_at(ptr + 2, 2), "big")
    if family == 2:   # AF_INET
        return f"{'.'.join(str(b) for b in ctypes.string_at(ptr + 4, 4))}:{port}"
    if family == 10:  # AF_INET6
        import ipaddress

        return f"[{ipaddress.IPv6Address(ctypes.string_at(ptr + 8, 16))}]:{port}"
    return ""


def cmid_addresses(cmid: object) -> tuple[str, str]:
    """(local, peer) "addr:port" of a connected CMID, from its route; empty strings if unknown."""
    ptr = _c_field(cmid)
    if not ptr:
        return "", ""
    route = ptr + _CM_ID_ROUTE
    return _format_sockaddr(route), _format_sockaddr(route + _SOCKADDR_STORAGE)


def close_quietly(*objs: Any) -> None:
    """Close each object given (None is skipped); teardown goes on whatever one of them says."""
    for obj in objs:
        if obj is not None:
            try:
                obj.close()
            except Exception as exc:
                log.debug("closing %s failed: %s", type(obj).__name__, exc)


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]") if address else ""


# --------------------------------------------------------------------------- CM events


class CmEventChannel:
    """An RDMA CM event channel read in the event loop; every event goes to ``on_event`` and is then acked.

    Both roles drain their channel the same way, as SPDK's nvmf_process_cm_event does: read events from
    the non-blocking fd until it is empty (pyverbs raises on EAGAIN), hand each to the role, and ack it
    afterwards unless the handler acked it first (it must before destroying the event's CM id, as
    rdma_destroy_id waits for its events to be acked).
    """

    def __init__(self, pv: types.SimpleNamespace, name: str) -> None:
        self.pv = pv
        self.name = name
        self.channel: Any = pv.CMEventChannel()
        try:
            self.fd = cm_channel_fd(self.channel)
        except BaseException:
            close_quietly(self.channel)
            raise
        self._reading = False

    def start(self, on_event: Callable[[Any], None]) -> None:
        """Deliver the events to ``on_event(event)`` from now on (an exception in it is logged)."""
        self.on_event = on_event
        asyncio.get_running_loop().add_reader(self.fd, self._readable)
        self._reading = True

    def stop(self) -> None:
        """Deliver no more events (idempotent); the channel stays open for close()."""
        if self._reading:
            self._reading = False
            asyncio.get_running_loop().remove_reader(self.fd)

    def close(self) -> None:
        """Stop reading and destroy the channel; close the CM ids created on it first."""
        self.stop()
        close_quietly(self.channel)
        self.channel = None

    def _readable(self) -> None:
        pv = self.pv
        while self._reading and self.channel is not None:
            try:
                ev = pv.CMEvent(self.channel)
            except pv.PyverbsError:
                return   # drained (EAGAIN)
            try:
                self.on_event(ev)
            except Exception:
                log.exception("%s: handling RDMA CM event %s failed", self.name, ev.event_str())
            finally:
                ev.close()   # acks it unless the handler already did


# --------------------------------------------------------------------------- memory


class Region:
    """One registered memory region over an anonymous mmap we own; ``view`` is zero-copy."""

    def __init__(self, pv: types.SimpleNamespace, pd: Any, size: int, access: int) -> None:
        self.size = size
        self.mem = mmap.mmap(-1, size)
        self._anchor = (ctypes.c_char * size).from_buffer(self.mem)
        self.addr = ctypes.addressof(self._anchor)
        self.mr = pv.MR(pd, size, access, address=self.addr)
        self.lkey = self.mr.lkey
        self.rkey = self.mr.rkey
        self.view = memoryview(self.mem)

    def close(self) -> None:
        # deregister only: views handed out keep the mmap alive until they are dropped
        self.mr.close()


class BufferPool:
    """First-fit ranges of one Region, lent to commands for their data and given back."""

    def __init__(self, region: Region, unit: int = 4096) -> None:
        self.region = region
        self.unit = unit
        self._free: list[list[int]] = [[0, region.size]]   # sorted [offset, length]
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.closed = False

    def _round(self, length: int) -> int:
        return max(self.unit, -(-length // self.unit) * self.unit)

    def try_acquire(self, length: int) -> int | None:
        need = self._round(length)
        for extent in self._free:
            if extent[1] >= need:
                offset = extent[0]
                extent[0] += need
                extent[1] -= need
                if not extent[1]:
                    self._free.remove(extent)
                return offset
        return None

    async def acquire(self, length: int) -> int:
        if self._round(length) > self.region.size:
            raise ValueError(f"{length} bytes exceed the {self.region.size}-byte registered buffer pool")
        while True:
            if self.closed:
                raise ConnectionError("queue torn down")
            offset = self.try_acquire(length)
            if offset is not None:
                return offset
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    def release(self, offset: int, length: int) -> None:
        need = self._round(length)
        free = self._free
        free.append([offset, need])
        free.sort()
        merged: list[list[int]] = []
        for extent in free:
            if merged and merged[-1][0] + merged[-1][1] == extent[0]:
                merged[-1][1] += extent[1]
            else:
                merged.append(extent)
        self._free = merged
        waiters, self._waiters = self._waiters, collections.deque()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def close(self) -> None:
        self.closed = True
        waiters, self._waiters = self._waiters, collections.deque()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def view(self, offset: int, length: int) -> memoryview:
        return self.region.view[offset:offset + length]


# --------------------------------------------------------------------------- queue pair


class VerbsQueuePair:
    """An RC QP with one CQ and completion channel, its completions delivered in the event loop.

    ``on_completion(wc)`` runs for every work completion (sq_sig_all: sends, RDMA ops and receives).
    The QP's states are driven through the CM (``cmid.init_qp_attr``), as the Linux ULPs do.
    """

    def __init__(self, pv: types.SimpleNamespace, ctx: Any, pd: Any, *, send_wr: int, recv_wr: int,
                 on_completion: Callable[[Any], None]) -> None:
        self.pv = pv
        self.loop = asyncio.get_running_loop()
        self.on_completion = on_completion
        self.channel = pv.CompChannel(ctx)
        self.fd = comp_channel_fd(self.channel)
        self.cq = pv.CQ(ctx, send_wr + recv_wr, None, self.channel, 0)
        self.cq.req_notify()
        cap = pv.QPCap(max_send_wr=send_wr, max_recv_wr=recv_wr, max_send_sge=1, max_recv_sge=1)
        self.qp = pv.QP(pd, pv.QPInitAttr(qp_type=pv.e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1))
        self.closed = False
        self.loop.add_reader(self.fd, self._readable)

    def to_state(self, cmid: Any, state: int) -> None:
        e = self.pv.e
        attr, mask = cmid.init_qp_attr(state)
        if state == e.IBV_QPS_INIT:
            # The active side reaches INIT before the CM knows the responder resources and would not
            # grant REMOTE_READ: the controller's RDMA READs then fail (IBV_WC_REM_INV_REQ_ERR).
            attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
            mask |= e.IBV_QP_ACCESS_FLAGS
        self.qp.modify(attr, mask)

    def to_error(self) -> None:
        """Flush everything posted (IBV_WC_WR_FLUSH_ERR completions) and stop the QP."""
        e = self.pv.e
        try:
            self.qp.modify(self.pv.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
        except self.pv.PyverbsError as exc:
            log.debug("moving QP %d to ERR failed: %s", self.qp.qp_num, exc)

    def post_recv(self, wr_id: int, addr: int, length: int, lkey: int) -> None:
        pv = self.pv
        self.qp.post_recv(pv.RecvWR(wr_id=wr_id, num_sge=1, sg=[pv.SGE(addr, length, lkey)]))

    def post_send(self, wr_id: int, opcode: int, addr: int, length: int, lkey: int, *,
                  remote: tuple[int, int] | None = None, invalidate_rkey: int | None = None) -> None:
        pv = self.pv
        kw = {}
        if invalidate_rkey is not None:
            kw["imm_data"] = invalidate_rkey   # ibv_send_wr: imm_data and invalidate_rkey share a union
        wr = pv.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[pv.SGE(addr, length, lkey)],
                       send_flags=pv.e.IBV_SEND_SIGNALED, **kw)
        if remote is not None:
            wr.set_wr_rdma(remote[1], remote[0])   # (rkey, remote address)
        self.qp.post_send(wr)

    def _readable(self) -> None:
        if self.closed:
            return
        try:
            self.channel.get_cq_event(self.cq)
        except self.pv.PyverbsError:
            return   # spurious wake-up: the fd is non-blocking
        self.cq.ack_events(1)
        self.cq.req_notify()   # re-arm before the last poll so nothing completes unseen
        self.poll()

    def poll(self) -> None:
        while not self.closed:
            n, wcs = self.cq.poll(32)
            if n <= 0:
                return
            for wc in wcs[:n]:
                if self.closed:
                    return
                self.on_completion(wc)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        close_quietly(self.qp, self.cq, self.channel)


_WC_STATUS = {1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 4: "LOC_PROT_ERR", 5: "WR_FLUSH_ERR", 9: "REM_INV_REQ_ERR",
              10: "REM_ACCESS_ERR", 11: "REM_OP_ERR", 12: "RETRY_EXC_ERR", 13: "RNR_RETRY_EXC_ERR"}
WC_WR_FLUSH_ERR = 5


def wc_status_text(wc: Any) -> str:
    """A work completion error for logs, named as enum ibv_wc_status names it."""
    name = _WC_STATUS.get(wc.status, "")
    return f"IBV_WC_{name or 'status'} ({wc.status}, opcode {wc.opcode}, vendor_err {wc.vendor_err})"
