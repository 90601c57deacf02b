"""NVMe/TCP on asyncio: one `TargetConnection` protocol per queue around nvmeof.tcp.TcpConnection.

Modelled on Linux nvmet tcp.c: ICReq -> ICResp; each command capsule becomes a Request run as its own
task (a queue's commands may complete out of order); host data arrives in-capsule or, for larger
writes, after one R2T for the whole length (the host's MAXR2T is 0), its H2CData PDUs checked against
that R2T before a buffer is allocated. R2Ts are paced by a per-connection byte budget (``h2c_budget``):
a write whose R2T would exceed it waits, first come first served, for earlier ones to finish, while
commands without host data go on. Reads go out as C2HData (SUCCESS only when SQ flow control is
off and nothing else must be said) plus a CapsuleResp. Losing the admin queue tears the controller down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Coroutine, Generator
from typing import TYPE_CHECKING, Any

from nvmeof import defaults
from nvmeof.spec.nvme import SGL_ID_INCAPSULE, Command
from nvmeof.status import NvmeError, Status
from nvmeof.tcp import (
    CommandReceived,
    H2CDataReceived,
    ICReqReceived,
    ProtocolError,
    Role,
    TcpConnection,
    TermReqReceived,
)
from target.request import Direction, Request, TargetQueue

if TYPE_CHECKING:
    from target.core import Target
    from target.model import Listener

log = logging.getLogger(__name__)

RECV_BUFFER_SIZE = 256 * 1024
# Commands in flight per connection before we stop reading: a queue holds at most MQES+1 commands
# (plus the AERs parked on an admin queue), so a host exceeding this is not waiting for completions.
MAX_INFLIGHT = defaults.MAX_QUEUE_SIZE + 8
MAX_TTAGS = 0xFFFF   # ttag 0xFFFF is left unused


class _PendingH2C:
    """A write waiting for H2CData after our R2T."""

    __slots__ = ("buf", "digest_ok", "future", "received", "req", "ttag")

    def __init__(self, req: Request, ttag: int, future: asyncio.Future[memoryview]) -> None:
        self.req = req
        self.ttag = ttag
        self.future = future
        self.buf: bytearray | None = None   # allocated at the first H2CData that passes the checks
        self.received = 0
        self.digest_ok = True


class _Continue:
    """Awaitable that finishes a coroutine which was started by hand and suspended at ``first``.

    The target runs each command's coroutine eagerly inside ``data_received``; most (RAM-disk I/O,
    admin commands) finish without suspending and never cost a Task. One that does suspend yields
    the future it waits on; a Task running this relays that future and every later one, and
    forwards whatever the Task sends or throws (cancellation), as if the Task had run it from the start.
    """

    __slots__ = ("coro", "first")

    def __init__(self, coro: Coroutine[Any, Any, None], first: Any) -> None:
        self.coro = coro
        self.first = first

    def __await__(self) -> Generator[Any, None, None]:
        coro = self.coro
        value = self.first
        while True:
            try:
                yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:   # relayed to the coroutine, which decides
                try:
                    value = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = coro.send(None)
                except StopIteration:
                    return


async def _finish(coro: Coroutine[Any, Any, None], first: Any) -> None:
    await _Continue(coro, first)


def _format_peer(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(addr) if addr else ""


class TargetConnection(asyncio.BufferedProtocol):
    """The controller end of one NVMe/TCP queue (also used over the in-memory loop transport)."""

    # Run each command's coroutine inline first and make a Task only if it suspends; False makes a
    # Task per command (the general path the fast path is tested against).
    eager = True
    # Seconds a closing connection may spend flushing to a peer that does not read before it is aborted.
    close_grace = defaults.TCP_CLOSE_GRACE
    # Bytes of host data our outstanding R2Ts may ask for at once: each such write holds a buffer of its
    # full length until it has executed. One write always goes when none holds any, so a budget below
    # one transfer slows the queue down but never stops it.
    h2c_budget = defaults.TCP_H2C_BUDGET

    def __init__(self, target: Target, listener: Listener | None = None, *, transport_name: str = "tcp",
                 on_lost: Any = None) -> None:
        self.target = target
        self.listener = listener
        self.conn = TcpConnection(Role.CONTROLLER, maxh2cdata=defaults.MAXH2CDATA,
                                  max_incapsule=max(defaults.ADMIN_INCAPSULE_SIZE, defaults.IO_INCAPSULE_SIZE))
        self.queue = TargetQueue(transport=transport_name, listener=listener, close=self.close)
        self.transport: asyncio.Transport | None = None
        self._recv = bytearray(RECV_BUFFER_SIZE)
        self._recv_view = memoryview(self._recv)
        self._tasks: set[asyncio.Task[None]] = set()
        self._h2c: dict[int, _PendingH2C] = {}
        self._next_ttag = 0
        self._h2c_bytes = 0   # of h2c_budget, held by the writes that got (or are getting) their R2T
        self._h2c_waiters: deque[tuple[asyncio.Future[None], int]] = deque()   # writes waiting for budget
        self._closed = False
        self._on_lost = on_lost
        self._write_paused = False
        self._read_paused = False
        # Set while data_received handles one batch of PDUs: what they queue goes out in one write.
        self._batching = False
        self._linger: asyncio.TimerHandle | None = None   # aborts a graceful close that never finishes

    # --- asyncio protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # No isinstance check: uvloop's TCPTransport (used by `nvmeof serve` when installed) does not
        # subclass asyncio.Transport, yet has every method this protocol calls.
        self.transport = transport  # type: ignore[assignment]
        self.queue.peer = _format_peer(transport.get_extra_info("peername"))
        sockname = transport.get_extra_info("sockname")
        if isinstance(sockname, tuple) and sockname:
            self.queue.local_addr = str(sockname[0])
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._recv_view

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._recv_view[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:  # type: ignore[override]
        if self._closed:
            return
        self._batching = True
        try:
            for event in self.conn.receive_data(data):
                kind = type(event)
                if kind is CommandReceived:
                    self._on_command(event)
                elif kind is H2CDataReceived:
                    self._on_h2c_data(event)
                elif kind is ICReqReceived:
                    self.conn.send_icresp(maxh2cdata=defaults.MAXH2CDATA)
                elif kind is ProtocolError:
                    log.warning("NVMe/TCP protocol error from %s (fes %#x, fei %d): %s; sending C2HTermReq and closing",
                                self.queue.peer, event.fes, event.fei, event.reason)
                    self.close()
                    return
                elif kind is TermReqReceived:
                    log.warning("host %s terminated the connection (H2CTermReq fes %#x fei %d)",
                                self.queue.peer, event.fes, event.fei)
                    self.close()
                    return
                if self._closed:
                    return   # a command tore the connection down; close() flushed what it queued
        finally:
            self._batching = False
        self._flush()

    def eof_received(self) -> bool:
        return False   # let the transport close; connection_lost cleans up

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._closed and self.transport is None:
            return
        self._closed = True
        self.transport = None
        self._cleanup()
        if self._on_lost is not None:
            self._on_lost(self)

    def pause_writing(self) -> None:
        # The peer is not reading our replies: stop reading its commands until they drain.
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    def _update_reading(self) -> None:
        want_pause = self._write_paused or len(self._tasks) >= MAX_INFLIGHT
        transport = self.transport
        if transport is None or self._closed or want_pause == self._read_paused:
            return
        self._read_paused = want_pause
        with contextlib.suppress(RuntimeError, AttributeError):
            if want_pause:
                transport.pause_reading()
            else:
                transport.resume_reading()

    # --- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (after flushing what is queued) and fail everything in flight."""
        if self._closed:
            return
        self._batching = False
        self._flush()   # what earlier commands of this batch queued goes out before the FIN
        self._closed = True
        transport = self.transport
        self._cleanup()
        if transport is not None:
            transport.close()
            # close() waits until the peer has taken everything queued; one that stops reading (after
            # a C2HTermReq, say) would hold the socket open for ever.
            with contextlib.suppress(RuntimeError):   # no running loop: nothing can linger either
                self._linger = asyncio.get_running_loop().call_later(
                    self.close_grace, self._abort_lingering, transport)

    def _abort_lingering(self, transport: asyncio.Transport) -> None:
        self._linger = None
        if self.transport is not transport:
            return   # connection_lost came first
        log.warning("NVMe/TCP peer %s did not read the last %d bytes within %.1f s of the close; aborting",
                    self.queue.peer, transport.get_write_buffer_size(), self.close_grace)
        transport.abort()

    def abort(self) -> None:
        transport = self.transport
        self.close()
        if transport is not None:
            transport.abort()

    def _cleanup(self) -> None:
        for pending in self._h2c.values():
            if not pending.future.done():
                pending.future.cancel()
        self._h2c.clear()
        for fut, _ in self._h2c_waiters:
            fut.cancel()
        self._h2c_waiters.clear()
        for task in list(self._tasks):
            task.cancel()
        self.target.queue_closed(self.queue)

    def _flush(self) -> None:
        if self._batching:
            return   # data_received writes everything the batch queued at its end
        out = self.conn.data_to_send()
        if out and self.transport is not None:
            self.transport.writelines(out)

    # --- commands -------------------------------------------------------------------------------

    def _on_command(self, event: CommandReceived) -> None:
        req = Request(self.queue, Command.from_bytes(event.sqe))
        # The event's views die at the next receive_data: keep a copy of in-capsule data.
        data = bytes(event.data) if event.data is not None else None
        coro = self._run(req, data, event.digest_ok)
        if self.eager:
            try:
                first = coro.send(None)
            except StopIteration:
                return   # completed without waiting: no Task
            task = asyncio.get_running_loop().create_task(_finish(coro, first))
        else:
            task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        if len(self._tasks) >= MAX_INFLIGHT:
            self._update_reading()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._read_paused:
            self._update_reading()

    async def _run(self, req: Request, data: bytes | None, digest_ok: bool) -> None:
        target = self.target
        reserved = 0
        try:
            target.parse(req)
            if req.direction == Direction.H2C:
                if req.cmd.sgl_id == SGL_ID_INCAPSULE or data is not None:
                    req.data = self._incapsule_data(req, data, digest_ok)
                else:
                    await self._reserve_h2c(req.data_len)
                    reserved = req.data_len
                    req.data = await self._r2t_data(req)
            elif data is not None:
                raise NvmeError(Status.INVALID_FIELD,
                                f"{len(data)} bytes of in-capsule data for a command that takes none")
            assert req.execute is not None
            await req.execute(req)
        except NvmeError as err:
            self._send_cqe(target.fail(req, err))
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("command %r failed unexpectedly", req)
            self._send_cqe(target.fail(req, NvmeError(Status.INTERNAL, f"internal error: {exc}")))
            return
        finally:
            if reserved:
                self._release_h2c(reserved)   # the write is done with its buffer
        if self._closed:
            return
        if req.direction == Direction.C2H and req.reply is not None:
            reply = req.reply
            if len(reply) != req.data_len:
                reply = bytes(reply[:req.data_len]).ljust(req.data_len, b"\x00")
            queue = req.queue
            if queue.sqflow_disabled and not req.dw0 and not req.dw1:
                # The SUCCESS flag stands in for the CapsuleResp (nvmet/SPDK do this only without SQ flow control)
                self.conn.send_c2h_data(req.cmd.cid, 0, reply, last=True, success=True)
                self._flush()
                return
            self.conn.send_c2h_data(req.cmd.cid, 0, reply, last=True, success=False)
        self._send_cqe(target.complete(req))

    def _send_cqe(self, cqe: bytes) -> None:
        if self._closed:
            return
        self.conn.send_response(cqe)
        self._flush()

    def _incapsule_data(self, req: Request, data: bytes | None, digest_ok: bool) -> memoryview:
        if req.cmd.sgl_id == SGL_ID_INCAPSULE:
            if data is None or len(data) != req.data_len:
                got = 0 if data is None else len(data)
                raise NvmeError(Status.SGL_INVALID_DATA,
                                f"the SGL announces {req.data_len} bytes of in-capsule data, the capsule has {got}")
            if not digest_ok:
                raise NvmeError(Status.TRANSIENT_TR_ERR, "in-capsule data failed its data digest", dnr=False)
            return memoryview(data)
        raise NvmeError(Status.INVALID_FIELD, "in-capsule data with a transport SGL (0x5A)")

    def _h2c_fits(self, nbytes: int) -> bool:
        return self._h2c_bytes == 0 or self._h2c_bytes + nbytes <= self.h2c_budget

    async def _reserve_h2c(self, nbytes: int) -> None:
        """Take ``nbytes`` of the H2C budget, after every write that asked before (FIFO: none starves)."""
        if not self._h2c_waiters and self._h2c_fits(nbytes):
            self._h2c_bytes += nbytes
            return
        waiter = (asyncio.get_running_loop().create_future(), nbytes)
        self._h2c_waiters.append(waiter)
        try:
            await waiter[0]
        except BaseException:
            if waiter[0].done() and not waiter[0].cancelled():
                self._release_h2c(nbytes)   # granted, then cancelled before it could resume
            else:
                with contextlib.suppress(ValueError):
                    self._h2c_waiters.remove(waiter)
            raise

    def _release_h2c(self, nbytes: int) -> None:
        self._h2c_bytes -= nbytes
        waiters = self._h2c_waiters
        while waiters and not self._closed:
            fut, want = waiters[0]
            if fut.done():   # cancelled while waiting: its coroutine will not find it
                waiters.popleft()
                continue
            if not self._h2c_fits(want):
                break
            waiters.popleft()
            self._h2c_bytes += want
            fut.set_result(None)

    async def _r2t_data(self, req: Request) -> memoryview:
        ttag = self._alloc_ttag()
        if ttag is None:
            raise NvmeError(Status.INTERNAL, "no transfer tag free for an R2T")
        fut: asyncio.Future[memoryview] = asyncio.get_running_loop().create_future()
        pending = _PendingH2C(req, ttag, fut)
        self._h2c[ttag] = pending
        try:
            self.conn.send_r2t(req.cmd.cid, ttag, 0, req.data_len)
            self._flush()
            return await fut
        finally:
            self._h2c.pop(ttag, None)
            self.conn.drop_r2t(ttag)

    def _alloc_ttag(self) -> int | None:
        for _ in range(MAX_TTAGS):
            ttag = self._next_ttag
            self._next_ttag = (ttag + 1) % MAX_TTAGS
            if ttag not in self._h2c:
                return ttag
        return None

    def _on_h2c_data(self, event: H2CDataReceived) -> None:
        # The sans-IO connection checked this PDU against the R2T we sent (ttag, cccid, offset, length)
        # before parsing on: an event is only made for data that fits the next part of a live R2T,
        # whose ttag stays in _h2c until the command's finally drops both entries together.
        pending = self._h2c[event.ttag]
        req = pending.req
        end = pending.received + len(event.data)
        if pending.buf is None:
            pending.buf = bytearray(req.data_len)
        pending.buf[pending.received:end] = event.data
        pending.received = end
        if not event.digest_ok:
            pending.digest_ok = False
        if end == req.data_len and not pending.future.done():
            if pending.digest_ok:
                pending.future.set_result(memoryview(pending.buf))
            else:
                pending.future.set_exception(
                    NvmeError(Status.TRANSIENT_TR_ERR, "H2CData failed its data digest", dnr=False))


class TcpListener:
    """Accepts NVMe/TCP connections on one listener address."""

    def __init__(self, target: Target, listener: Listener) -> None:
        self.target = target
        self.listener = listener
        self.connections: set[TargetConnection] = set()
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        if self._server is None or not self._server.sockets:
            return self.listener.trsvcid
        return int(self._server.sockets[0].getsockname()[1])

    def _factory(self) -> TargetConnection:
        conn = TargetConnection(self.target, self.listener, on_lost=self.connections.discard)
        self.connections.add(conn)
        return conn

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(self._factory, self.listener.traddr, self.listener.trsvcid,
                                                    reuse_address=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {self.listener.id}: {exc.strerror or exc}") from exc
        log.info("NVMe/TCP listening on %s:%d%s", self.listener.traddr, self.port,
                 " (discovery)" if self.listener.discovery else "")

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in list(self.connections):
            conn.abort()
        self.connections.clear()
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)
