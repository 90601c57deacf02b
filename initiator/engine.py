"""The host's NVMe/TCP engine: every TCP queue of ``connect()``, TLS ones included (not the loop transport).

:class:`BatchQueue` is a :class:`initiator.queue.HostQueue` that owns its socket instead of an asyncio
transport, the way SPDK's initiator (lib/nvme/nvme_tcp.c) drives a qpair from its poller:

- one wake-up reads everything available with ``recv_into`` into one preallocated buffer, parses every
  complete PDU, and sends what the handlers queued (new commands, H2CData, a TermReq) in one ``sendmsg``
  of a list of buffers (capsule headers and views of the caller's data, never joined);
- commands started with :meth:`BatchQueue.start` use command slots indexed by cid, allocated once (SPDK's
  ``struct nvme_tcp_req`` array): no Future, Task or dict per command, the capsule PDU is packed with one
  precompiled ``struct`` into the cid's own reused 72-byte buffer, and the completion is a callback;
- the CapsuleResp and C2HData of those commands are parsed here from their fixed headers; C2HData goes
  straight into the caller's buffer (a payload missing at least ``TCP_DIRECT_PLACEMENT_MIN`` bytes, or one
  longer than the receive buffer, is received into it directly);
- a slot write above the in-capsule size is sent with a transport SGL: its R2Ts are parsed here (the checks
  of ``TcpConnection._check_r2t``, nvme_tcp_handle_r2t) and answered with H2CData PDUs of at most MAXH2CDATA,
  each a header packed with one precompiled ``struct`` plus a view of the caller's buffer, in the same
  ``sendmsg`` (nvme_tcp_setup_h2c_data_pdu);
- every other PDU (ICResp, TermReq, anything for a :meth:`submit` command, anything malformed) goes
  to the sans-IO ``TcpConnection``, which checks and parses it exactly as on the stream path. With header
  or data digests the slot commands go through ``TcpConnection`` too (it checks the digests);
- hybrid polling (``poll_us``): after a batch that sent commands, keep trying a non-blocking receive for
  up to ``poll_us`` µs before sleeping in the selector (SPDK pollers, the kernel's busy-poll).

The fast parser makes the checks ``TcpConnection`` makes for these PDUs (nvme_tcp_handle_c2h_data,
nvme_tcp_process_nvme_cqe): a PDU whose header is not exactly the expected layout is handed to
``TcpConnection``, which reports the framing error; a C2HData of a slot command at the wrong offset, too
long, or with SUCCESS but not LAST, and an R2T asking for nothing, for a command with no data to send, or
for data outside what is left, fail the queue with the same FES/FEI and H2CTermReq (tests/test_engine.py
compares them byte for byte with the sans-IO path's).
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from initiator.queue import CommandTimeout, HostQueue, TransportError
from nvmeof import defaults
from nvmeof.spec.nvme import (
    SGL_ID_INCAPSULE,
    SGL_ID_TRANSPORT,
    SQE_FLAGS_PSDT_SGL,
    Command,
    Completion,
    Direction,
)
from nvmeof.spec.tcp import (
    CAPSULE_CMD_HEADER_SIZE,
    CAPSULE_RESP_SIZE,
    DATA_LAST,
    DATA_PDU_HEADER_SIZE,
    DATA_SUCCESS,
    OFF_DATAL,
    OFF_DATAO,
    OFF_FLAGS,
    OFF_R2TL,
    OFF_R2TO,
    R2T_SIZE,
    FatalErrorStatus,
    PduType,
)
from nvmeof.status import NvmeError, Status
from nvmeof.tls.openssl import TlsError

log = logging.getLogger(__name__)

RECV_BUFFER_SIZE = 512 * 1024
COMPACT_BELOW = 64 * 1024       # free room at the buffer's end under which the unparsed tail moves to the front
SENDMSG_MAX_BUFFERS = 512       # below IOV_MAX (1024)
POLL_MAX_BATCHES = 256          # batches one poll may handle before it yields to the event loop

Callback = Callable[[Any, BaseException | None], None]
"""callback(token, error): error None on success, NvmeError for a failed status, TransportError when the
queue broke."""

# The CapsuleCmd PDU as one layout: common header, then the SQE (nvmeof.spec.nvme._SQE with the SGL Data
# Block descriptor of Command.make_sgl unfolded). tests/test_engine.py checks it against Command.to_bytes.
_CMD_PDU = struct.Struct("<BBBBI" "BBHIIIQ" "QI3xB" "IIIIII")
assert _CMD_PDU.size == CAPSULE_CMD_HEADER_SIZE
_SLBA_AT = _CMD_PDU.size - 24   # CDW10-11 (the SLBA) in the PDU: CDW10..CDW15 are its last 24 bytes
_pack_slba = struct.Struct("<Q").pack_into
_CMD = PduType.CAPSULE_CMD.value
_C2H = PduType.C2H_DATA.value
_CMD_HLEN = CAPSULE_CMD_HEADER_SIZE
_RSP_LEN = CAPSULE_RESP_SIZE
_DATA_HLEN = DATA_PDU_HEADER_SIZE
# A CapsuleResp without header digest, as one little-endian integer: type, flags 0, hlen, pdo 0, plen.
_RSP_KEY = struct.unpack("<Q", struct.pack("<BBBBI", PduType.CAPSULE_RESP.value, 0, _RSP_LEN, 0, _RSP_LEN))[0]
# A C2HData without digests: type, flags other than LAST and SUCCESS clear, hlen, pdo = hlen.
_C2H_MASK = 0xFFFFFFFF & ~((DATA_LAST | DATA_SUCCESS) << 8)
_C2H_KEY = _C2H | (_DATA_HLEN << 16) | (_DATA_HLEN << 24)
_unpack_le64 = struct.Struct("<Q").unpack_from
_unpack_le32 = struct.Struct("<I").unpack_from
# The first 24 bytes of a CapsuleResp or C2HData (both headers are that long, as is an R2T): the common header
# as one integer (flags: bits 8-15, plen: 32-63), then a C2HData's cccid, ttag, datao, datal, which are a
# CapsuleResp's CQE dw0-dw1, and the CQE's cid and status (bytes 20-23).
_HDR = struct.Struct("<QHHIIHH")
_unpack_hdr = _HDR.unpack_from
_HDR_LEN = _HDR.size
assert _HDR_LEN == _RSP_LEN == _DATA_HLEN == R2T_SIZE
_unpack_data_hdr = struct.Struct("<BBBBIHHII4x").unpack_from
# An R2T without header digest: type, flags 0, hlen, plen as one integer over bytes 0-2 and 4-7 (pdo is 0 or
# past the header: checked apart, as TcpConnection._check_header does).
_R2T_MASK = 0xFFFFFFFF00FFFFFF
_R2T_KEY = PduType.R2T.value | (R2T_SIZE << 16) | (R2T_SIZE << 32)
# An H2CData header without digests (nvmeof.spec.tcp.DATA_PDU_HDR): type, flags, hlen, pdo, plen, cccid, ttag,
# datao, datal; tests/test_engine.py checks it against TcpConnection.send_h2c_data.
_H2C_HDR = struct.Struct("<BBBBIHHII4x")
_pack_h2c = _H2C_HDR.pack
_H2C = PduType.H2C_DATA.value
_DIRECT_MIN = defaults.TCP_DIRECT_PLACEMENT_MIN
_M32 = 0xFFFFFFFF


class BatchQueue(HostQueue):
    """A HostQueue over its own non-blocking socket, with cid-indexed command slots (see the module doc).

    :meth:`submit` works as on HostQueue (a Future per command: admin commands, the public I/O API);
    :meth:`start` is the batch path. Open it with :func:`open_batch_queue`.
    """

    def __init__(self, qid: int, *, poll_us: int = defaults.POLL_US, **kwargs: Any) -> None:
        super().__init__(qid, **kwargs)
        if poll_us < 0:
            raise ValueError(f"poll_us must be >= 0 (0 = no polling), got {poll_us}")
        self.poll_us = poll_us
        self._recv = memoryview(bytearray(0))   # HostQueue's asyncio receive buffer: unused here
        self._sock: socket.socket | None = None
        self._fd = -1
        self._rbuf = bytearray(RECV_BUFFER_SIZE)
        self._rmv = memoryview(self._rbuf)
        self._rstart = 0          # unparsed received bytes are _rbuf[_rstart:_rend]
        self._rend = 0
        self._debt = 0            # bytes of a PDU TcpConnection is receiving that are still to come
        self._direct: memoryview | None = None   # rest of a slot's C2HData payload, received in place
        self._direct_cid = 0
        self._direct_flags = 0
        self._wq: list[Any] = []     # slot PDUs queued for the next flush
        self._wpend: list[Any] = []  # what a short sendmsg left, sent when the socket is writable
        self._sends = 0              # sendmsg calls so far (the poller continues after a batch that sent)
        self._fast = False           # slot PDUs parsed here: READY without digests
        self._max_data = self._conn.max_data
        self._polling = False
        self._poller: Any = None     # select.poll of the socket, for the polling window (made by its first use)
        self._closing = False
        depth = self.queue_size - 1
        # Command slots by cid, allocated once. _cb[cid] is None when the cid is no slot command.
        self._cb: list[Callback | None] = [None] * depth
        self._tok: list[Any] = [None] * depth
        self._dbuf: list[memoryview | None] = [None] * depth  # read: destination; write: source
        self._dnext = [0] * depth        # read: where the next C2HData must start
        self._dend = [0] * depth         # read: the buffer length
        # R2T write (no digests): the caller's data, what its R2Ts asked for so far (in _dnext) and its length.
        # Apart from _dbuf, which stays None for a write: a C2HData for it fails as "reads no data".
        self._wsrc: list[memoryview | None] = [None] * depth
        self._wend = [0] * depth
        self._via = [False] * depth      # sent through TcpConnection (digests, R2T writes)
        self._serr: list[NvmeError | None] = [None] * depth
        self._stamp = [0] * depth        # the timeout tick a slot command started in
        self._tick = 0
        self._tick_due: float | None = None   # loop time of the next slot-timeout tick (None: idle)
        self._pdu = [bytearray(_CMD_HLEN) for _ in range(depth)]
        self._shape: list[tuple[int, int, int, int, bool] | None] = [None] * depth   # what _pdu[cid] holds
        # start_awaitable: one bound method as every Future's completion callback, and whether this wake-up
        # completed any (then one flush is queued behind their tasks: see _flush_after_wakeups)
        self._settle_cb: Callback = self._settle
        self._awoken = False
        # TLS (HostQueue(tls=)): records are received here and decrypted into _rbuf (or a slot's buffer), where
        # the clear path's recv_into puts bytes; _tls_more: the last decrypt filled its room, more may be held.
        self._tls_cipher: memoryview | None = None
        self._tls_more = False

    # ---- opening -------------------------------------------------------------------------------

    def attach(self, sock: socket.socket) -> None:
        """Take over a connected socket (non-blocking from now on) and start reading it."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._closed_future = loop.create_future()
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._fd = sock.fileno()
        loop.add_reader(self._fd, self._on_readable)

    async def initialize(self, timeout: float | None) -> None:
        await super().initialize(timeout)
        hdgst, ddgst = self._conn.hdgst, self._conn.ddgst
        self._fast = not hdgst and not ddgst
        self._max_data = self._conn.max_data

    @property
    def inflight(self) -> int:
        # every cid not free is a submit() command (in _pending, cancelled ones included) or a slot
        return len(self._cb) - len(self._free_cids)

    @property
    def _slots_inflight(self) -> int:
        return len(self._cb) - len(self._free_cids) - len(self._pending)

    @property
    def sockname(self) -> Any:
        return self._sock.getsockname() if self._sock is not None else None

    @property
    def free_slots(self) -> int:
        return len(self._free_cids)

    # ---- the batch path ------------------------------------------------------------------------

    def start(self, opcode: int, nsid: int, slba: int, nlb: int, buf: memoryview, write: bool,
              callback: Callback, token: Any) -> None:
        """Queue one Read/Write-like LBA command on a free cid; ``callback(token, error)`` runs once it is
        done. ``buf`` is a byte memoryview of exactly the transfer (the destination of a read, the source
        of a write). Sent at the end of this wake-up (or by :meth:`kick`). IndexError when no cid is free
        (the caller keeps at most ``queue_size - 1`` in flight), the TransportError when broken."""
        if self._error is not None:
            raise self._error
        # Checked before a cid is taken: struct.error after it would leave a phantom command in flight, and
        # an nlb above 65536 would spill into CDW12's FUA/LR bits.
        if not 1 <= nlb <= 0x10000 or not 0 <= slba < 1 << 64:
            raise ValueError(f"nlb {nlb} must be 1..65536 and slba {slba} 0..2^64-1")
        cid = self._free_cids.pop()
        n = len(buf)
        self._cb[cid] = callback
        self._tok[cid] = token
        # Timeouts without a clock read per command: the cid is stamped with the current tick of a timer
        # that ticks every timeout/2 while slots are in flight; one stamped three ticks ago has waited at
        # least the timeout (at most 1.5 times it) and breaks the queue (see _check_timeouts).
        self._stamp[cid] = self._tick
        if self._tick_due is None and self.timeout is not None:
            assert self._loop is not None
            self._tick_due = self._loop.time() + self.timeout / 2
            if self._timer is None or self._tick_due < self._timer_at:
                self._arm_timer(self._tick_due)
        if self._fast:
            self._via[cid] = False
            pdu = self._pdu[cid]
            if write and n > self.incapsule_size:
                # An R2T write: the controller asks for the data (R2T), answered in _process with H2CData
                # headers and views of buf, in the wake-up's sendmsg.
                self._dbuf[cid] = None
                self._dend[cid] = 0
                self._wsrc[cid] = buf
                self._dnext[cid] = 0
                self._wend[cid] = n
                self._wq.append(pdu)
                incapsule = False
            elif write:
                self._dbuf[cid] = None
                self._dend[cid] = 0
                self._wend[cid] = 0
                self._wq += (pdu, buf)
                incapsule = True
            else:
                self._dbuf[cid] = buf
                self._dnext[cid] = 0
                self._dend[cid] = n
                self._wend[cid] = 0
                self._wq.append(pdu)
                incapsule = False
            # The cid's capsule keeps what was packed into it last: a command of the same shape (all but the
            # SLBA; the in-capsule choice follows from write and n) writes only CDW10-11, as the target's
            # reply slots write only SQHD.
            shape = (opcode, nsid, nlb, n, write)
            if self._shape[cid] == shape:
                _pack_slba(pdu, _SLBA_AT, slba)
            else:
                self._shape[cid] = shape
                _CMD_PDU.pack_into(pdu, 0, _CMD, 0, _CMD_HLEN, _CMD_HLEN if incapsule else 0,
                                   _CMD_HLEN + n if incapsule else _CMD_HLEN, opcode, SQE_FLAGS_PSDT_SGL, cid, nsid,
                                   0, 0, 0, 0, n, SGL_ID_INCAPSULE if incapsule else SGL_ID_TRANSPORT, slba & _M32,
                                   slba >> 32, nlb - 1, 0, 0, 0)
            self.commands_submitted += 1
            return
        # Digests: TcpConnection builds, registers and checks it; the events come back through _on_response /
        # _on_c2h_data / _on_r2t below.
        self._via[cid] = True
        self._serr[cid] = None
        self._dbuf[cid] = buf
        cmd = Command(opcode, cid=cid, nsid=nsid, cdw10=slba & _M32, cdw11=slba >> 32, cdw12=nlb - 1)
        if write and n <= self.incapsule_size:
            cmd.dptr = Command.make_sgl(SGL_ID_INCAPSULE, 0, n)
            self._conn.send_command(cmd.to_bytes(), buf)
        else:
            cmd.dptr = Command.make_sgl(SGL_ID_TRANSPORT, 0, n)
            self._conn.send_command(cmd.to_bytes(), None, direction=Direction.H2C if write else Direction.C2H,
                                    data_len=n)
        self.commands_submitted += 1

    def kick(self) -> None:
        """Send what :meth:`start` queued outside a wake-up of this queue (then poll, with poll_us)."""
        self._flush()
        if self.poll_us:
            self._poll()
        if self._awoken:
            self._flush_after_wakeups()

    def _retire_slot(self, cid: int) -> tuple[Callback, Any]:
        cb, tok = self._cb[cid], self._tok[cid]
        assert cb is not None
        self._cb[cid] = None
        self._tok[cid] = None
        self._dbuf[cid] = self._wsrc[cid] = None
        self._free_cids.append(cid)
        if self._cid_waiters:
            self._wake_cid_waiter()
        return cb, tok

    def _slot_done(self, cid: int, cqe: Completion | None) -> None:
        """Complete slot ``cid``: ``cqe`` None is a C2HData SUCCESS (no CapsuleResp)."""
        err: NvmeError | None = self._serr[cid] if self._via[cid] else None
        if err is None and cqe is not None and cqe.status_code != Status.SUCCESS:
            err = NvmeError(cqe.status_code, f"{self.name} cid {cid}", dnr=cqe.dnr, more=cqe.more, result=cqe.dw0)
        cb, tok = self._retire_slot(cid)
        cb(tok, err)

    # ---- receive -------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        if self._error is not None:
            return
        try:
            if self._receive():
                self._process()
                if self._tls_more:
                    self._tls_drain()
                if self.poll_us and self._error is None:
                    self._poll()
                if self._awoken:
                    self._flush_after_wakeups()
        except Exception as exc:
            # A bug here (or in a slot callback) must not leave the commands in flight hanging.
            log.exception("%s: batch engine failure", self.name)
            self._break(TransportError(self.name, f"batch engine failure: {exc!r}"))

    def _receive(self) -> bool:
        """One non-blocking receive; False when nothing came (or the connection is gone)."""
        if self._tls is not None:
            return self._tls_receive()
        sock = self._sock
        if sock is None:
            return False
        direct = self._direct
        try:
            if direct is not None:
                n = sock.recv_into(direct)
                if n:
                    self._direct_in(n)
                    return True
            elif self._debt and self._rstart == self._rend and self._conn.direct_buffer() is not None:
                dest = self._conn.direct_buffer()
                assert dest is not None
                n = sock.recv_into(dest[:self._debt])
                if n:
                    self._debt -= n
                    self._on_events(self._conn.direct_received(n))
                    return True
            else:
                end = self._rbuf_end()
                n = sock.recv_into(self._rmv[end:])
                if n:
                    self._rend = end + n
                    return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self.connection_lost(exc)
            return False
        self.connection_lost(None)
        return False

    def _rbuf_end(self) -> int:
        """Where the next received bytes go in _rbuf (socket or TLS session): at its start when all is
        parsed, else behind the unparsed tail, which moves to the front once less than COMPACT_BELOW is free."""
        end = self._rend
        if end == self._rstart:
            self._rstart = self._rend = end = 0
        elif len(self._rbuf) - end < COMPACT_BELOW:
            rest = bytes(self._rmv[self._rstart:end])
            end = len(rest)
            self._rbuf[:end] = rest
            self._rstart, self._rend = 0, end
            if end == len(self._rbuf):
                # _process places a PDU longer than _rbuf in its buffer, so this is a bug; said as one, since
                # a receive into no room returns 0 and would read as the controller closing the connection
                raise RuntimeError(f"receive buffer full of {end} unparsed bytes")
        return end

    # ---- TLS: records in, plaintext where the socket's bytes would go -------------------------------

    def _tls_receive(self) -> bool:
        """_receive of a TLS queue: one non-blocking receive of records (none while the session still holds
        plaintext), fed to the session (the handshake, before ICReq), then decrypted (_tls_decrypt)."""
        tls = self._tls
        sock = self._sock
        if sock is None or tls is None:
            return False
        if not self._tls_more:
            buf = self._tls_cipher
            if buf is None:
                buf = self._tls_cipher = memoryview(bytearray(RECV_BUFFER_SIZE))
            try:
                n = sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                self.connection_lost(exc)
                return False
            if not n:
                self.connection_lost(None)
                return False
            was_done = tls.handshake_done
            try:
                tls.feed(buf[:n])
            except TlsError as exc:
                self._tls_failed(exc)
                return False
            if not was_done:
                self._send_tls()   # the handshake's next flight (our Finished)
                if not tls.handshake_done:
                    return False
                self._tls_wake()   # initialize() sends ICReq next
        try:
            got = self._tls_decrypt()
        except TlsError as exc:
            self._tls_failed(exc)
            return False
        if tls.closed and self._error is None:
            if got:
                self._process()
            self._break(TransportError(self.name, "controller closed the TLS session"))
            return False
        return got

    def _tls_decrypt(self) -> bool:
        """Decrypt into a slot's C2HData payload being received in place, else behind the unparsed bytes of
        _rbuf (compacted as _receive does): the bytes _process then parses as clear ones."""
        tls = self._tls
        assert tls is not None
        direct = self._direct
        if direct is not None:
            n = tls.read_into(direct)
            self._tls_more = 0 < n == len(direct)
            if n:
                self._direct_in(n)
            return n > 0
        end = self._rbuf_end()
        room = self._rmv[end:]
        n = tls.read_into(room)
        self._tls_more = 0 < n == len(room)
        if n:
            self._rend = end + n
        return n > 0

    def _tls_drain(self) -> None:
        """Parse what the session still held after a batch: no socket read announces it."""
        while self._tls_more and self._error is None and self._receive():
            self._process()

    def _send_tls(self) -> None:
        out = self._tls.data_to_send() if self._tls is not None else b""
        if not out or self._sock is None or self._closing:
            return
        if self._wpend:
            self._wpend.append(out)
            return
        self._send([out])

    def _direct_in(self, n: int) -> None:
        """``n`` bytes of a slot's C2HData payload arrived in place."""
        assert self._direct is not None
        if n < len(self._direct):
            self._direct = self._direct[n:]
            return
        self._direct = None
        if self._direct_flags & DATA_SUCCESS:
            self._slot_done(self._direct_cid, None)
        self._flush()

    def _process(self) -> None:
        """Parse every complete PDU received, then send what their handlers queued."""
        mv = self._rmv
        pos, end = self._rstart, self._rend
        conn = self._conn
        fast = self._fast
        cbs = self._cb
        via = self._via
        free = self._free_cids
        depth = len(cbs)
        dbuf, dnext, dend, toks = self._dbuf, self._dnext, self._dend, self._tok
        wsrc = self._wsrc
        max_data = self._max_data
        rbuf_len = len(self._rbuf)
        waiters = self._cid_waiters
        unpack_key, unpack_hdr, unpack_data = _unpack_le64, _unpack_hdr, _unpack_data_hdr
        rsp_key, c2h_mask, c2h_key = _RSP_KEY, _C2H_MASK, _C2H_KEY
        while pos < end:
            debt = self._debt
            if debt:
                give = debt if debt < end - pos else end - pos
                self._debt = debt - give
                events = conn.receive_data(mv[pos:pos + give])
                pos += give
                if events:
                    self._on_events(events)
                    if self._error is not None:
                        break
                continue
            avail = end - pos
            if avail < 8:
                break
            if fast:
                if avail >= _HDR_LEN:
                    # One unpack serves a CapsuleResp (cid, status) and a C2HData (cccid, datao, datal)
                    key, cccid, _tt, datao, datal, cid, status = unpack_hdr(mv, pos)
                else:
                    key = unpack_key(mv, pos)[0]
                    if key == rsp_key or key & c2h_mask == c2h_key or key & _R2T_MASK == _R2T_KEY:
                        break   # a slot PDU's header, cut: the rest comes with the next receive
                if key == rsp_key:
                    if cid < depth and not via[cid]:
                        cb = cbs[cid]
                        if cb is not None:
                            pos += _RSP_LEN
                            if status & 0xFFFE:
                                self._slot_done(cid, Completion.from_bytes(mv[pos - _RSP_LEN + 8:pos]))
                            else:
                                # _retire_slot, inlined: the commonest completion
                                tok = toks[cid]
                                cbs[cid] = toks[cid] = dbuf[cid] = wsrc[cid] = None
                                free.append(cid)
                                if waiters:
                                    self._wake_cid_waiter()
                                cb(tok, None)
                            if self._error is not None:
                                break
                            continue
                elif key & c2h_mask == c2h_key:
                    flags = key >> 8 & 0xFF
                    plen = key >> 32
                    cid = cccid
                    if cid < depth and cbs[cid] is not None and not via[cid]:
                        dest = dbuf[cid]
                        stop = datao + datal
                        if (dest is None or datao != dnext[cid] or stop > dend[cid] or plen != _DATA_HLEN + datal
                                or not 0 < datal <= max_data or flags == DATA_SUCCESS):
                            self._bad_c2h(mv, pos, avail, flags, plen, cid, datao, datal)
                            break
                        data = pos + _DATA_HLEN
                        if avail >= plen:
                            dest[datao:stop] = mv[data:pos + plen]
                            dnext[cid] = stop
                            pos += plen
                            if flags & DATA_SUCCESS:
                                cb, tok = self._retire_slot(cid)
                                cb(tok, None)
                                if self._error is not None:
                                    break
                            continue
                        have = avail - _DATA_HLEN
                        # In place when much is missing, and always when the PDU is longer than _rbuf: left there,
                        # it would fill _rbuf to the last byte and the next receive would have no room.
                        if datal - have >= _DIRECT_MIN or plen > rbuf_len:
                            dest[datao:datao + have] = mv[data:end]
                            self._direct = dest[datao + have:stop]
                            self._direct_cid = cid
                            self._direct_flags = flags
                            dnext[cid] = stop
                            pos = end
                        break   # the rest of the PDU is still to come
                elif key & _R2T_MASK == _R2T_KEY:
                    _t, _f, _h, pdo, _l, cid, ttag, r2to, r2tl = unpack_data(mv, pos)
                    if (pdo == 0 or pdo >= R2T_SIZE) and cid < depth and cbs[cid] is not None and not via[cid]:
                        # nvme_tcp_handle_r2t: the R2T must ask for data the command has and has not asked
                        # for yet (TcpConnection._check_r2t, the same FES/FEI when it does not)
                        src = wsrc[cid]
                        asked = dnext[cid]
                        stop = r2to + r2tl
                        if src is None or r2tl == 0 or r2to < asked or stop > self._wend[cid]:
                            self._bad_r2t(mv, pos, cid, r2to, r2tl)
                            break
                        dnext[cid] = stop
                        pos += R2T_SIZE
                        # nvme_tcp_setup_h2c_data_pdu: H2CData of at most MAXH2CDATA each, LAST on the R2T's
                        # last one; a header packed per PDU and a view of the caller's buffer
                        chunk = self.maxh2cdata
                        wq = self._wq
                        while r2to < stop:
                            nxt = r2to + chunk if stop - r2to > chunk else stop
                            n = nxt - r2to
                            wq += (_pack_h2c(_H2C, DATA_LAST if nxt == stop else 0, _DATA_HLEN, _DATA_HLEN,
                                             _DATA_HLEN + n, cid, ttag, r2to, n), src[r2to:nxt])
                            r2to = nxt
                        continue
            # Not a slot PDU: TcpConnection takes it (all of it, or what is here and the rest as it comes).
            plen = _unpack_le32(mv, pos + 4)[0]
            need = plen if plen > 8 else 8
            give = need if need < avail else avail
            self._debt = need - give
            events = conn.receive_data(mv[pos:pos + give])
            pos += give
            if events:
                self._on_events(events)
                if self._error is not None:
                    break
        if pos >= end:
            pos = end = 0
        self._rstart, self._rend = pos, end
        if self._error is None:
            self._flush()

    def _bad_c2h(self, mv: memoryview, pos: int, avail: int, flags: int, plen: int, cid: int, datao: int,
                 datal: int) -> None:
        """The checks of TcpConnection._check_data_header for a slot's C2HData; fail the queue like it."""
        fes, fei = FatalErrorStatus.INVALID_HEADER_FIELD, OFF_DATAL
        if datal == 0:
            reason = "C2H_DATA with datal 0"
        elif datal > self._max_data:
            fes, fei = FatalErrorStatus.DATA_LIMIT_EXCEEDED, 0
            reason = f"C2H_DATA datal {datal} exceeds max_data {self._max_data}"
        elif plen != _DATA_HLEN + datal:
            reason = f"C2H_DATA datal {datal} disagrees with plen {plen} (pdo {_DATA_HLEN}, data digest 0)"
        elif flags & DATA_SUCCESS and not flags & DATA_LAST:
            fei = OFF_FLAGS
            reason = "C2H_DATA with SUCCESS but not LAST"
        elif self._dbuf[cid] is None:
            fei = 8   # OFF_CCCID
            reason = f"C2HData for cid {cid}, a command that reads no data"
        else:
            fes = FatalErrorStatus.DATA_OUT_OF_RANGE
            expected, end = self._dnext[cid], self._dend[cid]
            fei = OFF_DATAO if datao != expected else OFF_DATAL
            reason = (f"C2HData for cid {cid} at offset {datao} length {datal}: expected offset {expected} "
                      f"within a {end}-byte buffer")
        self._conn.send_term_req(fes, fei, bytes(mv[pos:pos + min(avail, _DATA_HLEN)]))
        self._flush()
        self._break(TransportError(self.name, f"protocol error from controller: {reason}"))

    def _bad_r2t(self, mv: memoryview, pos: int, cid: int, r2to: int, r2tl: int) -> None:
        """The checks of TcpConnection._check_r2t for a slot's R2T; fail the queue like it."""
        fes, fei = FatalErrorStatus.INVALID_HEADER_FIELD, OFF_R2TL
        if r2tl == 0:
            reason = "R2T with r2tl 0"
        elif self._wsrc[cid] is None:
            fei = 8   # OFF_CCCID
            reason = f"R2T for cid {cid}, a command with no data to send by R2T"
        else:
            asked, end = self._dnext[cid], self._wend[cid]
            fes = FatalErrorStatus.DATA_OUT_OF_RANGE
            fei = OFF_R2TO if r2to < asked else OFF_R2TL
            reason = (f"R2T for cid {cid} asks offset {r2to} length {r2tl}; the command has {end} bytes, "
                      f"{asked} already asked for")
        self._conn.send_term_req(fes, fei, bytes(mv[pos:pos + R2T_SIZE]))
        self._flush()
        self._break(TransportError(self.name, f"protocol error from controller: {reason}"))

    # ---- slot commands through TcpConnection (digests) ----------------------------------------

    def _is_slot(self, cid: int) -> bool:
        return cid < len(self._cb) and self._cb[cid] is not None

    def _on_response(self, raw: memoryview) -> None:
        cid = raw[12] | raw[13] << 8
        if self._is_slot(cid):
            self._slot_done(cid, Completion.from_bytes(raw))
        else:
            super()._on_response(raw)

    def _place(self, cccid: int, ttag: int, datao: int, datal: int) -> memoryview | None:
        if self._is_slot(cccid):
            buf = self._dbuf[cccid]
            return None if buf is None else buf[datao:datao + datal]
        return super()._place(cccid, ttag, datao, datal)

    def _on_c2h_data(self, ev: Any) -> None:
        cid = ev.cccid
        if not self._is_slot(cid):
            super()._on_c2h_data(ev)
            return
        buf = self._dbuf[cid]
        assert buf is not None
        if not ev.placed:
            buf[ev.offset:ev.offset + len(ev.data)] = ev.data
        if not ev.digest_ok and self._serr[cid] is None:
            self._serr[cid] = NvmeError(Status.DATA_XFER_ERROR, f"{self.name} cid {cid}: data digest mismatch "
                                        f"in C2HData at offset {ev.offset}", dnr=False)
        if ev.success:
            self._slot_done(cid, None)

    def _on_r2t(self, ev: Any) -> None:
        cid = ev.cccid
        if not self._is_slot(cid):
            super()._on_r2t(ev)
            return
        data = self._dbuf[cid]
        assert data is not None
        offset, end = ev.offset, ev.offset + ev.length
        while offset < end:
            n = min(self.maxh2cdata, end - offset)
            self._conn.send_h2c_data(cid, ev.ttag, offset, data[offset:offset + n], offset + n == end)
            offset += n

    # ---- polling -------------------------------------------------------------------------------

    def _flush_soon(self) -> None:
        super()._flush_soon()
        if self.poll_us and not self._flush_scheduled:
            self._poll()   # a lone submit(): its answer may come within the window

    def _poll(self) -> None:
        """Busy-try non-blocking receives for up to poll_us µs; a batch that sent new commands opens a new
        window (the bench), one that only completed commands ends it (their callers run next)."""
        if self._polling or self._error is not None:
            return
        self._polling = True
        try:
            self._poll_window()
        except Exception as exc:
            # Called from kick()/_flush_soon() too, outside _on_readable's guard: a failure (a slot callback
            # raising) must break the queue, not leave half-parsed bytes to be parsed again.
            log.exception("%s: batch engine failure", self.name)
            self._break(TransportError(self.name, f"batch engine failure: {exc!r}"))
        finally:
            self._polling = False

    def _poll_window(self) -> None:
        clock = time.perf_counter_ns
        sched_yield = os.sched_yield
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self._fd, select.POLLIN)
        # poll(0) asks whether anything came without the BlockingIOError an empty recv_into raises: an empty
        # turn of this loop took 2.7 µs with the exception, 1.6 µs with poll(0) (as the target's
        # SocketTransport._read_ready polls), so an answer is noticed sooner and the core is freer.
        ready = poller.poll
        window = self.poll_us * 1000
        deadline = clock() + window
        batches = 0
        while self._error is None and self.inflight:
            if (ready(0) or self._tls_more) and self._receive():
                sends = self._sends
                self._process()
                if self._tls_more:
                    self._tls_drain()
                batches += 1
                if self._sends == sends or batches >= POLL_MAX_BATCHES:
                    return
                deadline = clock() + window
            elif clock() >= deadline:
                return
            else:
                # Let a runnable peer (the target on a shared core) go first: on an idle core this
                # returns at once, on a busy one the spin would only delay the answer it waits for.
                # (Half of an empty turn's 1.6 µs here; unconditional, as nothing cheap tells a shared core.)
                sched_yield()

    # ---- send ----------------------------------------------------------------------------------

    def _flush(self) -> None:
        out = self._wq
        more = self._conn.data_to_send()
        if more:
            out += more     # after the slot PDUs: a TermReq stays last
        if not out:
            return
        self._wq = []
        if self._sock is None or self._closing:
            return
        tls = self._tls
        if tls is not None:
            # the batch in one encryption (records of up to 16 KiB, not one per PDU) and one sendmsg
            tls.send(b"".join(out))
            cipher = tls.data_to_send()
            if not cipher:
                return
            out = [cipher]
        if self._wpend:
            self._wpend += out
            return
        self._send(out)

    def _send(self, bufs: list[Any]) -> None:
        sock = self._sock
        assert sock is not None
        while bufs:
            chunk = bufs if len(bufs) <= SENDMSG_MAX_BUFFERS else bufs[:SENDMSG_MAX_BUFFERS]
            try:
                sent = sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self.connection_lost(exc)
                return
            self._sends += 1
            if sent == sum(map(len, chunk)):
                bufs = bufs[len(chunk):]
                continue
            i = 0
            while sent >= len(chunk[i]):
                sent -= len(chunk[i])
                i += 1
            # A short send: the rest waits for the socket to be writable, in order.
            rest = memoryview(chunk[i]).cast("B")[sent:] if sent else chunk[i]
            self._wpend = [rest, *chunk[i + 1:], *bufs[len(chunk):]]
            self._write_paused = True
            assert self._loop is not None
            self._loop.add_writer(self._fd, self._on_writable)
            return

    def _on_writable(self) -> None:
        assert self._loop is not None
        pending, self._wpend = self._wpend, []
        self._loop.remove_writer(self._fd)
        if self._sock is None or self._closing:
            return
        self._send(pending)
        if not self._wpend:
            self._write_paused = False
            self._wake_drain_waiters()

    # ---- timeouts and teardown -----------------------------------------------------------------

    def _check_timeouts(self) -> None:
        """The queue's one timer fired: the submit() commands (HostQueue), then a tick for the slots."""
        super()._check_timeouts()
        if self._error is not None or self.timeout is None:
            return
        if not self._slots_inflight:
            self._tick_due = None
            return
        assert self._loop is not None
        now = self._loop.time()
        # Only the tick's own deadline advances it: the timer also fires for submit() deadlines, and a tick
        # counted early would time a slot out before it waited the timeout.
        if self._tick_due is not None and now >= self._tick_due:
            self._tick += 1
            self._tick_due = None
            old = self._tick - 3   # stamped in [tick k, tick k+1), failed at tick k+3: waited > timeout
            for cid, cb in enumerate(self._cb):
                if cb is not None and self._stamp[cid] <= old:
                    self._break(CommandTimeout(self.name, f"cid {cid} got no completion in {self.timeout} s; "
                                                          "the queue is torn down"))
                    return
        if self._tick_due is None:
            self._tick_due = now + self.timeout / 2
        if self._timer is None or self._tick_due < self._timer_at:
            self._arm_timer(self._tick_due)

    def _break(self, err: TransportError, *, close: bool = True) -> None:
        if self._error is not None:
            return
        super()._break(err, close=close)
        for cid, cb in enumerate(self._cb):
            if cb is not None:
                cb, tok = self._retire_slot(cid)
                try:
                    cb(tok, err)
                except Exception:  # one failing callback must not keep the others waiting
                    log.exception("%s: slot callback failed while the queue broke", self.name)
        self._close_socket()

    def _close_socket(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._poller = None   # registered by fd number, which the closed socket frees for reuse
        sock, self._sock = self._sock, None
        if sock is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
            if self._wpend:
                self._loop.remove_writer(self._fd)
        self._wpend = []
        if sock is not None:
            sock.close()
        if self._closed_future is not None and not self._closed_future.done():
            self._closed_future.set_result(None)

    # ---- awaitable commands: the library API (HostController.read/write/compare) ----------------

    def start_awaitable(self, opcode: int, nsid: int, slba: int, nlb: int, buf: memoryview,
                        write: bool) -> asyncio.Future[None] | None:
        """:meth:`start` with a Future as its completion, for one ``await``: no Task, dict entry, closure or
        Command object per command, and the fast PDU parsing of slot commands. The Future gets None, the
        NvmeError of a failed status or the TransportError of a broken queue (the checks are start()'s).

        Sends are batched per loop iteration, not per command: a wake-up that completes Futures queues one
        flush (call_soon) behind the tasks it woke, so the commands those tasks start next leave together in
        one ``sendmsg``, as the bench's callbacks' do inside the wake-up; a command started otherwise queues
        that flush itself, and one alone in flight leaves at once (then polls, with poll_us), as
        HostQueue._flush_soon does for submit(). None when no cid is free or submit() callers already wait
        for one: the caller then takes submit(), which waits its turn."""
        free = self._free_cids
        if not free or self._cid_waiters:
            if self._error is not None:
                raise self._error
            return None
        loop = self._loop
        assert loop is not None
        fut = loop.create_future()
        self.start(opcode, nsid, slba, nlb, buf, write, self._settle_cb, fut)
        if not self._flush_scheduled:
            if len(free) >= len(self._cb) - 1:
                self.kick()
            else:
                self._flush_scheduled = True
                loop.call_soon(self._scheduled_flush)
        return fut

    def _settle(self, fut: asyncio.Future[None], err: BaseException | None) -> None:
        """The completion callback of :meth:`start_awaitable` (the Future is its token)."""
        self._awoken = True
        try:
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)
        except asyncio.InvalidStateError:
            pass   # the caller was cancelled; its cid was kept until now, when the controller is done with it

    def _flush_after_wakeups(self) -> None:
        """Queue one flush behind the task wake-ups the Futures just completed queued (call_soon runs in
        order), so the commands of every task this wake-up woke leave in one ``sendmsg``."""
        self._awoken = False
        if not self._flush_scheduled and self._error is None:
            assert self._loop is not None
            self._flush_scheduled = True
            self._loop.call_soon(self._scheduled_flush)


async def open_batch_queue(queue: BatchQueue, host: str, port: int, timeout: float | None) -> BatchQueue:
    """Connect ``queue`` to ``host:port`` over its own socket and run the IC exchange."""
    loop = asyncio.get_running_loop()

    async def connect() -> socket.socket:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        last: OSError | None = None
        for family, kind, proto, _name, addr in infos:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, addr)
                return sock
            except OSError as exc:
                sock.close()
                last = exc
            except BaseException:
                sock.close()
                raise
        raise last or OSError(f"no address for {host}:{port}")

    try:
        sock = await asyncio.wait_for(connect(), timeout)
    except TimeoutError:
        raise TransportError(queue.name, f"TCP connect timed out after {timeout} s") from None
    except OSError as exc:
        raise TransportError(queue.name, f"cannot connect: {exc.strerror or exc}") from exc
    queue.attach(sock)
    await queue.initialize(timeout)
    return queue
