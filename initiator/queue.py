"""One NVMe/TCP queue on the host side: an asyncio protocol around ``TcpConnection(Role.HOST)``.

The queue owns a command-id free list bounded by its size (callers wait for a free slot rather than
fail), one future per command id, and the data movement of each command: in-capsule data when it
fits, otherwise a Transport SGL Data Block answered by R2T/H2CData (writes) or C2HData (reads).
Error handling follows the Linux host (drivers/nvme/host/tcp.c): a digest mismatch fails that
command with Data Transfer Error; a protocol violation, a TermReq, a dropped connection or a
command timeout breaks the whole queue and every command in flight fails with ``TransportError``.

HostQueue is the slow path of the one host NVMe/TCP engine (initiator/engine.py ``BatchQueue`` is a
subclass that owns its socket; it decrypts TLS queues' records into its own receive buffer) and, alone,
serves the queues without a socket of their own (``transport="loop"``). Tests run TCP on it as the reference
model the batch engine's fast path is compared against (``HostController._reference_queues``).
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import Any

from nvmeof import defaults
from nvmeof.spec.nvme import (
    SGL_ID_INCAPSULE,
    SGL_ID_TRANSPORT,
    SQE_FLAGS_PSDT_SGL,
    Command,
    Completion,
    Direction,
)
from nvmeof.spec.tcp import MIN_MAXH2CDATA, FatalErrorStatus
from nvmeof.status import NvmeError, Status
from nvmeof.tcp import (
    C2HDataReceived,
    ICRespReceived,
    ProtocolError,
    R2TReceived,
    ResponseReceived,
    Role,
    TcpConnection,
    TermReqReceived,
)
from nvmeof.tls.openssl import TlsError, TlsSession

DEFAULT_TIMEOUT = object()  # sentinel: use the queue's own command timeout


class TransportError(ConnectionError):
    """The queue's connection is gone or unusable; every command in flight on it failed."""

    def __init__(self, queue: str, reason: str) -> None:
        self.queue = queue
        self.reason = reason
        super().__init__(f"{queue}: {reason}")


class CommandTimeout(TransportError, TimeoutError):
    """A command got no completion in time; like the Linux host, the queue is then torn down."""


class _Pending:
    __slots__ = ("cid", "data_in", "data_out", "deadline", "error", "future", "opcode", "timeout")

    def __init__(self, cid: int, opcode: int, future: asyncio.Future[Completion],
                 data_out: memoryview | None, data_in: memoryview | None) -> None:
        self.cid = cid
        self.opcode = opcode
        self.future = future
        self.data_out = data_out
        self.data_in = data_in
        self.error: NvmeError | None = None  # set by a data digest mismatch; reported at completion
        self.timeout: float | None = None   # seconds, as given to submit
        self.deadline = 0.0                 # loop.time() by which the completion must arrive


def _as_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def data_views(data_out: bytes | bytearray | memoryview | None,
               data_in: bytearray | memoryview | None) -> tuple[memoryview | None, memoryview | None]:
    """A command's data buffers as byte views (out, in); ValueError when both are given or
    ``data_in`` cannot be written."""
    if data_out is not None and data_in is not None:
        raise ValueError("a command moves data in one direction only: pass data_out or data_in")
    out_view = _as_view(data_out) if data_out is not None else None
    in_view = _as_view(data_in) if data_in is not None else None
    if in_view is not None and in_view.readonly:
        raise ValueError("data_in must be a writable buffer (bytearray or writable memoryview)")
    return out_view, in_view


RECV_BUFFER_SIZE = 256 * 1024


class HostQueue(asyncio.BufferedProtocol):
    """One queue (admin qid 0 or an I/O queue) over one transport connection.

    Use :meth:`open` (or build it as the protocol of ``create_connection``, then call
    :meth:`initialize`); then :meth:`submit` commands. ``incapsule_size`` is the largest write
    sent inside the command capsule: 8192 on the admin queue (NVME_TCP_ADMIN_CCSZ), IOCCSZ*16-64
    on I/O queues.
    """

    def __init__(self, qid: int, *, queue_size: int, name: str = "", hdr_digest: bool = False,
                 data_digest: bool = False, incapsule_size: int = defaults.ADMIN_INCAPSULE_SIZE,
                 timeout: float | None = 30.0, tls: TlsSession | None = None) -> None:
        if not 2 <= queue_size <= 65536:
            raise ValueError(f"queue_size must be 2..65536, got {queue_size}")
        self.qid = qid
        self.name = name or f"queue {qid}"
        self.queue_size = queue_size
        self.hdr_digest = hdr_digest
        self.data_digest = data_digest
        self.incapsule_size = incapsule_size
        self.timeout = timeout
        self.maxh2cdata = 0
        self.commands_submitted = 0
        self._conn = TcpConnection(Role.HOST)
        # Large C2HData payloads are received straight into the reader's buffer (see _place).
        self._conn.place = self._place
        self._recv = memoryview(bytearray(RECV_BUFFER_SIZE))
        self._recv_direct = False   # the last get_buffer() handed out a direct-placement buffer
        self._transport: asyncio.Transport | None = None
        self._pending: dict[int, _Pending] = {}
        # A circular SQ of N entries holds N-1 commands (full when tail+1 == head), so at most
        # queue_size-1 are in flight; cids come from the same bounded pool.
        depth = queue_size - 1
        self._free_cids = list(range(depth - 1, -1, -1))
        self._cid_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ic_future: asyncio.Future[ICRespReceived] | None = None
        self._error: TransportError | None = None
        self._closed_future: asyncio.Future[None] | None = None
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.on_broken: Any = None  # optional callback(TransportError) run once when the queue breaks
        # One timer for the whole queue, armed at the earliest deadline of the commands in flight
        # (a timer per command costs more than the command itself at high queue depth).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        # Commands submitted in one loop iteration leave in one write (see _flush_soon).
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # NVMe/TCP over TLS 1.3 (TP 8011): the handshake runs before ICReq and every PDU then travels in
        # records; a TLS queue receives into new buffers (no direct placement).
        self._tls = tls
        self._tls_ready: asyncio.Future[None] | None = None
        if tls is not None:
            self._conn.place = None

    # ---- opening -------------------------------------------------------------------------------

    async def initialize(self, timeout: float | None) -> None:
        """Send ICReq and check ICResp the way the Linux host does (nvme_tcp_init_connection)."""
        loop = asyncio.get_running_loop()
        if self._tls is not None:
            await self._tls_handshake(timeout)
        self._ic_future = loop.create_future()
        self._conn.send_icreq(self.hdr_digest, self.data_digest)
        self._flush()
        try:
            resp = await asyncio.wait_for(asyncio.shield(self._ic_future), timeout)
        except TimeoutError:
            err = TransportError(self.name, f"no ICResp within {timeout} s")
            self._break(err)
            raise err from None
        problem = None
        if resp.pfv != 0:
            problem = f"ICResp PFV {resp.pfv} is not 0 (NVMe/TCP 1.0)"
        elif resp.hdgst != self.hdr_digest or resp.ddgst != self.data_digest:
            problem = (f"digest mismatch: asked header={self.hdr_digest} data={self.data_digest}, "
                       f"controller answered header={resp.hdgst} data={resp.ddgst}")
        elif resp.cpda != 0:
            problem = f"ICResp CPDA {resp.cpda} is not supported (the host needs 0)"
        elif resp.maxh2cdata < MIN_MAXH2CDATA or resp.maxh2cdata % 4:
            problem = (f"ICResp MAXH2CDATA {resp.maxh2cdata} is not a multiple of 4 "
                       f"of at least {MIN_MAXH2CDATA}")
        if problem:
            err = TransportError(self.name, problem)
            self._break(err)
            raise err
        self.maxh2cdata = resp.maxh2cdata

    async def _tls_handshake(self, timeout: float | None) -> None:
        tls = self._tls
        assert tls is not None
        self._tls_ready = asyncio.get_running_loop().create_future()
        try:
            tls.start()
        except TlsError as exc:
            err = TransportError(self.name, f"TLS handshake failed: {exc}")
            self._break(err)
            raise err from None
        self._send_tls()
        try:
            await asyncio.wait_for(asyncio.shield(self._tls_ready), timeout)
        except TimeoutError:
            err = TransportError(self.name, f"TLS handshake not completed within {timeout} s")
            self._break(err)
            raise err from None
        if self._error is not None:
            raise self._error

    def _tls_received(self, data: bytes | memoryview) -> None:
        tls = self._tls
        assert tls is not None
        try:
            plain = tls.receive(data)
        except TlsError as exc:
            self._tls_failed(exc)
            return
        if tls.handshake_done:
            self._tls_wake()
        if plain:
            self._on_events(self._conn.receive_data(plain))
        else:
            self._send_tls()
        if tls.closed and self._error is None:
            self._break(TransportError(self.name, "controller closed the TLS session"))

    def _tls_failed(self, exc: TlsError) -> None:
        """The session failed: its alert goes out, the queue breaks (and a handshake waiting is told)."""
        assert self._tls is not None
        self._send_tls()
        what = "TLS" if self._tls.handshake_done else "TLS handshake failed"
        self._break(TransportError(self.name, f"{what}: {exc}"))
        self._tls_wake()

    def _tls_wake(self) -> None:
        fut = self._tls_ready
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _send_tls(self) -> None:
        out = self._tls.data_to_send() if self._tls is not None else b""
        if out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(out)

    # ---- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()
        self._closed_future = self._loop.create_future()
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        direct = self._conn.direct_buffer()
        if direct is not None:
            self._recv_direct = True
            return direct
        self._recv_direct = False
        return self._recv

    def buffer_updated(self, nbytes: int) -> None:
        if self._recv_direct:
            self._recv_direct = False
            if self._error is None:
                self._on_events(self._conn.direct_received(nbytes))
        else:
            self.data_received(self._recv[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:  # type: ignore[override]
        if self._error is not None:
            return
        if self._tls is not None:
            self._tls_received(data)
            return
        self._on_events(self._conn.receive_data(data))

    def _on_events(self, events: list[Any]) -> None:
        for event in events:
            kind = type(event)
            if kind is ResponseReceived:
                self._on_response(event.cqe)
            elif kind is C2HDataReceived:
                self._on_c2h_data(event)
            elif kind is R2TReceived:
                self._on_r2t(event)
            elif kind is ICRespReceived:
                if self._ic_future is not None and not self._ic_future.done():
                    self._ic_future.set_result(event)
                else:
                    self._protocol_failure(FatalErrorStatus.PDU_SEQUENCE_ERROR, "unexpected second ICResp")
            elif kind is TermReqReceived:
                self._break(TransportError(
                    self.name, f"controller sent C2HTermReq: FES {_fes_name(event.fes)}, FEI {event.fei:#x}"))
            elif kind is ProtocolError:
                # The connection has already queued an H2CTermReq; flush it before closing.
                self._flush()
                self._break(TransportError(self.name, f"protocol error from controller: {event.reason}"))
            else:
                self._protocol_failure(FatalErrorStatus.PDU_SEQUENCE_ERROR,
                                       f"unexpected {kind.__name__} on a host queue")
            if self._error is not None:
                return
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f"connection lost: {exc}" if exc else "connection closed by the controller"
        self._break(TransportError(self.name, reason), close=False)
        if self._closed_future is not None and not self._closed_future.done():
            self._closed_future.set_result(None)
        self._wake_drain_waiters()
        self._tls_wake()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain_waiters()

    # ---- commands ------------------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return len(self._pending)

    @property
    def negotiated_digests(self) -> tuple[bool, bool]:
        """(header, data) digests in force on the wire, as the IC exchange fixed them."""
        return self._conn.hdgst, self._conn.ddgst

    @property
    def broken(self) -> TransportError | None:
        return self._error

    @property
    def sockname(self) -> Any:
        """The local address of the queue's connection (a (host, port, ...) tuple over TCP), or None."""
        return self._transport.get_extra_info("sockname") if self._transport is not None else None

    async def submit(self, cmd: Command, *, data_out: bytes | bytearray | memoryview | None = None,
                     data_in: bytearray | memoryview | None = None,
                     timeout: Any = DEFAULT_TIMEOUT) -> Completion:
        """Send ``cmd`` and return its completion; raise NvmeError for a non-success status.

        ``data_out`` is sent to the controller; ``data_in`` (writable) receives controller data at the
        offsets the C2HData PDUs name. ``timeout`` None waits forever (used for AERs).
        """
        if self._error is not None:
            raise self._error
        out_view, in_view = data_views(data_out, data_in)
        cid = self._free_cids.pop() if self._free_cids and not self._cid_waiters else await self._acquire_cid()
        loop = self._loop or asyncio.get_running_loop()
        pending = _Pending(cid, cmd.opcode, loop.create_future(), out_view, in_view)
        self._pending[cid] = pending
        cmd.cid = cid
        cmd.flags |= SQE_FLAGS_PSDT_SGL
        incapsule = None
        direction, length = Direction.NONE, 0   # what the controller moves by R2T/H2CData or C2HData
        if out_view is not None and len(out_view) <= self.incapsule_size:
            cmd.dptr = Command.make_sgl(SGL_ID_INCAPSULE, 0, len(out_view))
            incapsule = out_view
        else:
            if out_view is not None:
                direction, length = Direction.H2C, len(out_view)
            elif in_view is not None:
                direction, length = Direction.C2H, len(in_view)
            cmd.dptr = Command.make_sgl(SGL_ID_TRANSPORT, 0, length)
        if timeout is DEFAULT_TIMEOUT:
            timeout = self.timeout
        if timeout is not None:
            pending.timeout = timeout
            pending.deadline = deadline = loop.time() + timeout
            if self._timer is None or deadline < self._timer_at:
                self._arm_timer(deadline)
        self._conn.send_command(cmd.to_bytes(), incapsule, direction=direction if length else Direction.NONE,
                                data_len=length)
        self.commands_submitted += 1
        self._flush_soon()
        if self._write_paused:
            await self._drain()
        try:
            return await pending.future
        finally:
            # A cancelled caller leaves its cid reserved until the controller answers (see _finish),
            # so a cid is never reused while the controller may still use it.
            if not pending.future.cancelled() and self._pending.get(cid) is pending:
                self._retire(pending)

    def close(self) -> None:
        """Drop the connection; commands still in flight fail with TransportError."""
        self._break(TransportError(self.name, "queue closed by the host"))

    async def wait_closed(self) -> None:
        if self._closed_future is not None:
            await self._closed_future

    # ---- internals -----------------------------------------------------------------------------

    async def _acquire_cid(self) -> int:
        while not self._free_cids:
            if self._error is not None:
                raise self._error
            fut = asyncio.get_running_loop().create_future()
            self._cid_waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake_cid_waiter()  # pass the wake-up on rather than lose it
                raise
        if self._error is not None:
            self._wake_cid_waiter()
            raise self._error
        return self._free_cids.pop()

    def _wake_cid_waiter(self) -> None:
        while self._cid_waiters:
            fut = self._cid_waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _retire(self, pending: _Pending) -> None:
        del self._pending[pending.cid]
        pending.timeout = None
        self._free_cids.append(pending.cid)
        self._wake_cid_waiter()

    def _finish(self, pending: _Pending, cqe: Completion) -> None:
        fut = pending.future
        pending.timeout = None
        if fut.done():
            # The caller was cancelled; the cid becomes free only now that the controller is done.
            self._retire(pending)
            return
        status = cqe.status_code
        if pending.error is not None:
            fut.set_exception(pending.error)
        elif status != Status.SUCCESS:
            fut.set_exception(NvmeError(status, f"{self.name} cid {pending.cid} opcode {pending.opcode:#04x}",
                                        dnr=cqe.dnr, more=cqe.more, result=cqe.dw0))
        else:
            fut.set_result(cqe)

    # The connection checked each CapsuleResp, C2HData and R2T against the command it names (its cid,
    # direction, offsets and length) before the event, so the handlers below only move the data.

    def _on_response(self, raw: memoryview) -> None:
        cqe = Completion.from_bytes(raw)
        self._finish(self._pending[cqe.cid], cqe)

    def _place(self, cccid: int, ttag: int, datao: int, datal: int) -> memoryview | None:
        """Where a large C2HData payload goes directly: the reader's buffer, which the PDU fits."""
        buf = self._pending[cccid].data_in
        assert buf is not None
        return buf[datao:datao + datal]

    def _on_c2h_data(self, ev: C2HDataReceived) -> None:
        pending = self._pending[ev.cccid]
        buf = pending.data_in
        assert buf is not None
        if not ev.placed:
            buf[ev.offset:ev.offset + len(ev.data)] = ev.data
        if not ev.digest_ok and pending.error is None:
            pending.error = NvmeError(Status.DATA_XFER_ERROR,
                                      f"{self.name} cid {ev.cccid}: data digest mismatch in C2HData at "
                                      f"offset {ev.offset}", dnr=False)
        if ev.success:
            self._finish(pending, Completion(ev.cccid, sqid=self.qid))

    def _on_r2t(self, ev: R2TReceived) -> None:
        data = self._pending[ev.cccid].data_out
        assert data is not None
        offset, end = ev.offset, ev.offset + ev.length
        chunk = self.maxh2cdata
        while offset < end:
            n = min(chunk, end - offset)
            self._conn.send_h2c_data(ev.cccid, ev.ttag, offset, data[offset:offset + n], offset + n == end)
            offset += n

    def _arm_timer(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._check_timeouts)

    def _check_timeouts(self) -> None:
        """The timer fired: time out the first expired command, or re-arm at the earliest deadline."""
        self._timer = None
        if self._error is not None:
            return
        assert self._loop is not None
        now = self._loop.time()
        earliest: float | None = None
        for pending in self._pending.values():
            if pending.timeout is None:
                continue
            if pending.deadline <= now:
                self._on_timeout(pending)
                return
            if earliest is None or pending.deadline < earliest:
                earliest = pending.deadline
        if earliest is not None:
            self._arm_timer(earliest)

    def _on_timeout(self, pending: _Pending) -> None:
        cid, timeout = pending.cid, pending.timeout
        pending.timeout = None
        err = CommandTimeout(self.name, f"cid {cid} opcode {pending.opcode:#04x} got no completion in "
                                        f"{timeout} s; the queue is torn down")
        if not pending.future.done():
            pending.future.set_exception(err)
        self._break(TransportError(self.name, f"torn down after cid {cid} timed out"))

    def _protocol_failure(self, fes: int, reason: str) -> None:
        self._conn.send_term_req(fes)
        self._flush()
        self._break(TransportError(self.name, f"protocol error: {reason}"))

    def _break(self, err: TransportError, *, close: bool = True) -> None:
        """Fail every command in flight and every waiter, then close the connection (once)."""
        if self._error is not None:
            return
        self._error = err
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ic_future is not None and not self._ic_future.done():
            self._ic_future.set_exception(err)
            self._ic_future.exception()  # retrieved here so an unawaited future does not warn
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(err)
            self._retire(pending)
        waiters, self._cid_waiters = self._cid_waiters, collections.deque()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        if close and self._transport is not None:
            self._transport.close()
        self._wake_drain_waiters()
        if self.on_broken is not None:
            self.on_broken(err)

    def _flush_soon(self) -> None:
        """Write what submit queued: now if it is the only command in flight (no one to wait for),
        else once at the next loop iteration, together with whatever else is submitted meanwhile."""
        if self._flush_scheduled:
            return
        if len(self._pending) <= 1 or self._loop is None:
            self._flush()
            return
        self._flush_scheduled = True
        self._loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self._flush()

    def _flush(self) -> None:
        out = self._conn.data_to_send()
        if self._tls is not None:
            if out:
                self._tls.send(b"".join(out) if len(out) > 1 else out[0])
            self._send_tls()
            return
        if out and self._transport is not None and not self._transport.is_closing():
            self._transport.writelines(out)

    async def _drain(self) -> None:
        if not self._write_paused or self._error is not None:
            return
        fut = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(fut)
        await fut

    def _wake_drain_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


def _fes_name(fes: int) -> str:
    try:
        return f"{FatalErrorStatus(fes).name} ({fes:#x})"
    except ValueError:
        return f"{fes:#x}"


async def open_queue(loop_factory: Any, queue: HostQueue, timeout: float | None) -> HostQueue:
    """Connect ``queue`` with ``loop_factory(protocol_factory)`` and run the IC exchange."""
    try:
        await asyncio.wait_for(loop_factory(lambda: queue), timeout)
    except TimeoutError:
        raise TransportError(queue.name, f"TCP connect timed out after {timeout} s") from None
    except OSError as exc:
        raise TransportError(queue.name, f"cannot connect: {exc.strerror or exc}") from exc
    await queue.initialize(timeout)
    return queue
