"""NVMe/TCP batch engine: the target's TCP transport with commands run per received batch, not per event.

The stream engine (target/transports/tcp.py) turns every PDU into an event, a ``Request`` and a run
through the command lifecycle. That general path stays, unchanged, for everything; this engine puts a
fast path in front of it for the commands that dominate a data plane and can finish at once:

- per wake-up, one ``recv_into`` into the connection's preallocated receive buffer; every complete
  CapsuleCmd of the batch is looked at with one precompiled ``struct`` layout (``CMD_FAST``; the
  construct definitions in nvmeof/spec stay the source of truth, tests/test_tcp_batch.py proves the
  layouts equal);
- a Read, or a Write with in-capsule data, of an enabled namespace whose backend answers without
  waiting (``Backend.read_nowait`` / ``write_nowait``: the RAM disk, a file's page cache) runs inline:
  no Request, no coroutine, no Task, no Future, no closure, no dict per command. Its C2HData header
  and CapsuleResp live in a 48-byte slot of the queue (layout ``REPLY_FAST``), made once per CID
  (SPDK's request pools); while a CID keeps moving the same length only its SQHD is written again.
  A RAM disk's read goes out as a view of the disk's memory (``Backend.memory_view``: no copy, no
  call per command);
- all replies of the wake-up leave in one ``writelines``, which `SocketTransport` turns into one
  ``socket.sendmsg`` with the list of buffers; a batch stops taking commands once its replies pass
  ``TCP_WRITE_HIGH_WATER`` bytes and, while the socket does not take them, the rest of the receive
  buffer waits (carried) until the backlog drained (a host that never reads cannot make one wake-up
  queue more than that); it also stops after the first command whose backend call (a file's inline write
  or page-cache read; never a RAM disk's view) ends past ``TCP_BATCH_TIME_BUDGET_US`` from the start of
  the receive, and the rest is carried to a ``call_soon`` (nvmet_tcp_io_work's budget): 32 inline file
  writes do not hold the event loop, every other connection and timer, for all of them at once.

An R2T Write whose H2C budgets fit takes the fast path too: its R2T leaves with the batch's replies
through ``TcpConnection.send_r2t``, so the sans-IO layer registers the transfer, and the write completes
inline. Its H2CData header is read with one precompiled ``struct`` (``H2C_FAST``) and taken by the
engine only when it is exactly what the R2T expects, with the checks ``TcpConnection`` makes (no digest
flags, hlen, pdo, datal 1..MAXH2CDATA against plen, ttag, cccid, datao, within the R2T, LAST only at
its end); ``TcpConnection.take_h2c`` moves the sans-IO record on. Any other header goes, whole, to the
sans-IO connection, which reports it (tests/test_batch_r2t.py compares the TermReqs byte for byte, also
after PDUs the engine took). A payload cut by the end of a read is received straight into the write's
buffer by the next reads (``get_buffer``), and a cut H2CData header is carried like a cut CapsuleCmd.
The H2CData of a larger (R2T) Write is received into the write's own buffer (the stream engine's
``place`` hook on the sans-IO path), not byte by byte into a RAM disk's memory: H2CData arrives cut at
any byte, so a read running meanwhile would see half a block, and two overlapping writes on two queues
could leave one block mixing both (AWUN 0 promises single-block atomicity). nvmet receives into its own
pages too (nvmet_tcp_map_data) and the backend copies them when the command executes, in one step.
The exception is a RAM disk's write on this engine's socket that does not come whole in one read (cut by
its end, or in several H2CData): each H2CData is received into the disk in whole blocks only, as many as
the socket holds (FIONREAD), a cut block gathered aside and copied in once whole (``_h2c_direct_start``):
the same atomicity without the copy of the whole write.

Anything else (ICReq, Fabrics and admin commands, a queue that is not connected, enabled or
authenticated yet, any command that fails a check, TermReq, a backend that would wait, and every
connection with header or data digests) goes, from the first
PDU the fast path does not take, through the stream engine's sans-IO ``TcpConnection`` and the
lifecycle, so the bytes on the wire are the stream engine's: the fast path makes exactly the
C2HData/CapsuleResp bytes ``queue_response`` makes (tests compare both engines byte for byte).
A partial CapsuleCmd at the end of a read stays at the start of the receive buffer and completes
with the next one (nothing is handed to the sans-IO layer that the fast path might still take).

A TLS queue (TP 8011) runs all of this on plaintext once its handshake is done: its records are read into a
buffer of their own and ``TlsSession.read_into`` decrypts them where the socket's bytes would have gone, to be
taken as they would have been (``_tls_take``/``_tls_pump``); what one socket read's records make the queue
send is encrypted together and written once (``_tls_write`` while ``_tls_defer`` holds the writes). The
handshake itself stays with ``TargetConnection._tls_received``.

`SocketTransport` is the engine's own asyncio transport on a non-blocking socket, driven by
``loop.add_reader``/``add_writer`` (any loop, uvloop included): receives into the protocol's
buffer (BufferedProtocol), ``sendmsg`` of buffer lists without joining them, a backlog of views
kept when the socket is full (pause/resume_writing at high/low water marks; a RAM disk view the
socket took in part is copied, ``_owned_rest``: its cut block must not change before it is sent) and, with
``poll_us`` (``nvmeof serve --poll-us N``), hybrid polling: after a batch it keeps trying
non-blocking receives for up to N µs before going back to sleep in the selector (SPDK's pollers,
the kernel's busy-poll), bounded per callback so other connections and timers still run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
import select
import socket
import struct
import sys
import termios
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from nvmeof import defaults
from nvmeof.spec import tcp as spec
from nvmeof.spec.nvme import (
    RW_FUA,
    SGL_ID_INCAPSULE,
    SGL_ID_TRANSPORT,
    SQE_FLAGS_PSDT_MASK,
    SQE_FLAGS_PSDT_SGL,
    Command,
    IoOpcode,
    pack_cqe,
)
from nvmeof.tls.openssl import TlsError
from target.lifecycle import start_command
from target.model import LATENCY_SHIFT
from target.transports.tcp import RECV_BUFFER_MAX, RECV_BUFFER_MIN, TargetConnection, TcpListener, TcpRequest

if TYPE_CHECKING:
    from target.model import Listener
    from target.ports import TransportHost

log = logging.getLogger(__name__)

# --- precompiled layouts (construct definitions: nvmeof/spec/tcp.py CapsuleCmdHeader, DataPduHeader,
# CapsuleResp; nvmeof/spec/nvme.py SQE, CQE) ------------------------------------------------------

# A whole CapsuleCmd header from its first byte: the common header as one integer (compared with the
# connection's ``fast_command_key``), then opcode | flags << 8, cid, nsid, the SGL's length and identifier,
# SLBA (CDW10 | CDW11 << 32) and CDW12.
CMD_FAST = struct.Struct("<QHHI24xI3xBQI")
# The common header of a CapsuleCmd with in-capsule data: type, flags, hlen, pdo, plen.
COMMON_FAST = struct.Struct("<BBBBI")
# One slot: a C2HData header (type, flags, hlen, pdo, plen, cccid, ttag, datao, datal) followed by a
# CapsuleResp (type, flags, hlen, pdo, plen, then the CQE: dw0, dw1, sqhd, sqid, cid, status).
REPLY_FAST = struct.Struct("<BBBBIHHII4xBBBBIIIHHHH")
RESP_FAST = struct.Struct("<BBBBIIIHHHH")
# An H2CData header (DataPduHeader): type, flags, hlen and pdo as one integer (compared with _H2C_HEAD /
# _H2C_HEAD_LAST), then plen, cccid, ttag, datao, datal.
H2C_FAST = struct.Struct("<IIHHII")
SLOT_SIZE = REPLY_FAST.size   # 48

_unpack_cmd = CMD_FAST.unpack_from
_unpack_common = COMMON_FAST.unpack_from
_unpack_h2c = H2C_FAST.unpack_from
_unpack_u32 = struct.Struct("<I").unpack_from
_unpack_int = struct.Struct("i").unpack_from
_pack_resp = RESP_FAST.pack_into
_pack_c2h = spec.DATA_PDU_HDR.pack_into
_pack_sqhd = struct.Struct("<H").pack_into
_SLOT_SQHD = spec.DATA_PDU_HEADER_SIZE + 16   # the CapsuleResp's CQE SQHD (CQE bytes 8-9) in a slot
_NATIVE_LE = sys.byteorder == "little"

_CMD = spec.PduType.CAPSULE_CMD.value
_C2H = spec.PduType.C2H_DATA.value
_RSP = spec.PduType.CAPSULE_RESP.value
_CMD_HLEN = spec.CAPSULE_CMD_HEADER_SIZE
_DATA_HLEN = spec.DATA_PDU_HEADER_SIZE
_RSP_LEN = spec.CAPSULE_RESP_SIZE
_LAST = spec.DATA_LAST
_LAST_SUCCESS = spec.DATA_LAST | spec.DATA_SUCCESS
_READ = IoOpcode.READ.value
_WRITE = IoOpcode.WRITE.value
_SGL_FLAGS = SQE_FLAGS_PSDT_SGL
_HOT_READ = _READ | _SGL_FLAGS << 8   # opcode and flags of the hot lane's reads (other flag bits: the general path)
_MAX_TRANSFER = defaults.MAX_TRANSFER
# A host may cycle through all 65,536 CIDs (Linux: a generation counter in the top bits, nvme_cid): with
# a slot each, ~737 bytes apiece, one queue would hold ~48 MB. Only so many CIDs keep theirs.
_MAX_SLOTS = defaults.TCP_BATCH_REPLY_SLOTS
_HIGH_WATER = defaults.TCP_WRITE_HIGH_WATER
_TIME_BUDGET_NS = defaults.TCP_BATCH_TIME_BUDGET_US * 1000
_WRITE_POOL = defaults.TCP_BATCH_WRITE_POOL
_SQHD_DISABLED = 0xFFFF
_NO_OFFSET = bytes(8)
# An H2CData's first four bytes without digests (hpda 0: pdo right behind the header), with and without LAST
_H2C_TYPE = spec.PduType.H2C_DATA.value
_H2C_HEAD = _H2C_TYPE | _DATA_HLEN << 16 | _DATA_HLEN << 24
_H2C_HEAD_LAST = _H2C_HEAD | _LAST << 8
_perf_ns = time.perf_counter_ns
_ioctl = fcntl.ioctl
# While R2Ts wait for their data, a read from a PDU boundary may take at most an H2CData header and 4 KiB
# (whole blocks) of its payload: the rest of a RAM disk's write is then received into the disk
# (_h2c_direct_start), not into the receive buffer and copied from there.
_H2C_FIRST_READ = spec.DATA_PDU_HEADER_SIZE + 4096
# ... when the next PDU in the socket is an H2CData of a fast-path write with at least this much payload (a
# peek at its header, _h2c_next_is_large, skipped while the cut reads begin with one): capsules of other
# commands, and smaller H2CData, which the read would cut to more receives and wake-ups than the copy it
# saves, are read as usual.
_H2C_CAP_MIN = 32 * 1024
_PEEK = socket.MSG_PEEK
_FIONREAD = termios.FIONREAD   # SIOCINQ on a TCP socket: the bytes queued in order, ready to read


class _Slot:
    """The reply bytes of one CID, made the first time the CID is used on the queue: a C2HData header
    and a CapsuleResp, and a view of each (what the write list carries). Everything but SQHD stays
    as packed while the CID keeps moving the same length, so most commands write two bytes here."""

    __slots__ = ("buf", "hdr", "length", "resp", "sqhd")

    def __init__(self, cid: int, qid: int, flow_off: bool) -> None:
        self.buf = bytearray(SLOT_SIZE)
        view = memoryview(self.buf)
        self.hdr = view[:_DATA_HLEN]
        self.resp = view[_DATA_HLEN:]
        # the CQE's SQHD as one 16-bit item: ``slot.sqhd[0] = n`` is one store, not a pack call
        self.sqhd: Any = view[_SLOT_SQHD:_SLOT_SQHD + 2].cast("H") if _NATIVE_LE else _SqhdField(self.buf)
        self.length = -1   # what the C2HData header describes; -1: not packed yet
        _pack_resp(self.buf, _DATA_HLEN, _RSP, 0, _RSP_LEN, 0, _RSP_LEN, 0, 0, _SQHD_DISABLED if flow_off else 0,
                   qid, cid, 0)

    def pack_c2h(self, cid: int, length: int, flow_off: bool) -> None:
        # SUCCESS stands in for the CapsuleResp only without SQ flow control (TargetConnection.queue_response)
        _pack_c2h(self.buf, 0, _C2H, _LAST_SUCCESS if flow_off else _LAST, _DATA_HLEN, _DATA_HLEN,
                  _DATA_HLEN + length, cid, 0, 0, length)
        self.length = length


class _SqhdField:
    """A slot's SQHD where native byte order is not the wire's (little-endian): packed on assignment."""

    __slots__ = ("buf",)

    def __init__(self, buf: bytearray) -> None:
        self.buf = buf

    def __setitem__(self, index: int, value: int) -> None:
        _pack_sqhd(self.buf, _SLOT_SQHD, value)


class _FastWrite:
    """A Write the fast path sent its R2T for: what its H2CData completes (the stream engine's
    ``_PendingH2C`` fields ``buf``/``received``, which its ``_place`` hook reads, plus the command)."""

    __slots__ = ("backend", "bs", "buf", "cid", "disk", "fua", "length", "ns", "offset", "qos", "received", "span",
                 "sqe", "tail", "ttag")

    def __init__(self, cid: int, ttag: int, ns: Any, offset: int, length: int, fua: bool, qos: Any,
                 sqe: bytes) -> None:
        self.cid = cid
        self.ttag = ttag
        self.ns = ns
        self.backend = ns.backend
        self.offset = offset
        self.length = length
        self.fua = fua
        self.qos = qos          # the namespace's QoS limits the R2T was charged to (None: none)
        self.sqe = sqe          # the 64-byte SQE, for the lifecycle if the backend cannot take it inline
        # The write's own buffer (the buffered road: H2CData goes here, not into the disk), taken at its first
        # H2CData that does not carry the whole write: one that does is written from where it was received.
        self.buf: bytearray | None = None
        self.received = 0
        # ... or, a RAM disk's write, received into the disk itself (_h2c_direct_start): its range of the
        # disk view it started with (a resize replaces the view), the LBA size, and between two H2CData the
        # start of a block the first one cut (all its other bytes so far are in the disk)
        self.span: memoryview | None = None
        self.disk: memoryview | None = None
        self.bs = 0
        self.tail: bytes | None = None


class _FetchedRequest(TcpRequest):
    """A fast-path R2T Write whose data is in but which the backend could not take inline: the
    lifecycle runs it from its parse on, with the data already fetched (``fetch_data`` hands it over)."""

    __slots__ = ("fetched",)

    fetched: memoryview


class BatchMixin:
    """The batch fast path in front of a TargetConnection (see the module docstring); mixed into the
    connection classes of this process, of ``--workers`` (main and worker processes) and of tests."""

    # The stream engine's state this mixin reads (TargetConnection sets them).
    conn: Any
    queue: Any
    transport: Any
    _recv: memoryview
    _recv_direct: bool
    _closed: bool
    _deadline: Any
    _write_paused: bool
    _tls: Any
    _tls_plain: bool
    _tls_defer: bool
    _tls_failed: Any
    _tls_write: Any
    _send_tls: Any
    close: Any
    # ... and for the R2T writes: the transfer tags, the H2C budgets, the tasks (stream engine's methods too)
    target: Any
    _h2c: dict[int, Any]
    _h2c_bytes: int
    _h2c_waiters: Any
    _port: Any
    _tasks: set[Any]
    _h2c_fits: Any
    _alloc_ttag: Any
    _release_h2c: Any
    _task_done: Any
    _flush: Any
    _received: Any
    _batching: bool

    def _batch_init(self) -> None:
        self._carry = 0                       # bytes of a partial CapsuleCmd kept at the start of _recv
        self._slots: dict[int, _Slot] = {}    # cid -> its reply slot, made once (at most _MAX_SLOTS of them)
        self._fast_sgl = SGL_ID_TRANSPORT if SGL_ID_TRANSPORT in self.queue.ops.sgl_types else -1
        self.fast_commands = 0                # commands the fast path completed (tests, diagnostics)
        self._fast_full = False               # the last _fast stopped at its bound of queued reply bytes
        self._held = False                    # the carry is the rest of a read waiting for the socket to drain
                                              # (or for the next loop iteration: the batch's time budget ran out)
        self._yield_at = 0                    # perf_counter_ns past which _fast stops after a backend call
        self._fast_over = False               # the last _fast stopped there
        self._wbufs: dict[int, list[bytearray]] = {}   # length -> R2T write buffers free for reuse
        self._wbuf_bytes = 0                  # ... their bytes (at most TCP_BATCH_WRITE_POOL)
        # A fast-path H2CData cut by the end of a read: the rest of its payload in the write's buffer, which
        # the next reads fill directly (the sans-IO connection's direct placement, done here), and its write.
        self._h2c_dest: memoryview | None = None
        self._h2c_fw: _FastWrite | None = None
        self._h2c_stop = 0
        # ... or, for a RAM disk's write, its range of the disk (_h2c_direct_start, the write's ``span``): then
        # _h2c_bs is the LBA size and the rest of the H2CData is received there in whole blocks, a block cut
        # by what the socket holds gathered in _h2c_stage first
        self._h2c_bs = 0
        self._h2c_stage = memoryview(bytearray(0))
        self._h2c_into_disk = False                # the last get_buffer handed out a part of the range
        self._h2c_fd = -1
        self._h2c_inq = bytearray(4)
        self._h2c_peek = bytearray(_DATA_HLEN)   # the next PDU's header, peeked at (_h2c_next_is_large)
        self._h2c_more = False     # the last cut read began with a large H2CData: cut the next without a peek
        self._h2c_capped = False   # the read under way was cut to _H2C_FIRST_READ
        self._parked: set[Any] = set()       # reads parked at a QoS limit (qos.Parked), not let go yet
        self._released: list[Any] = []       # ... let go, to run in _run_released (one call_soon)
        self._release_due = False
        self._tls_records = False   # TLS past the handshake: the socket's reads are records (_tls_take)
        self._tls_cipher: memoryview | None = None   # ... read into this buffer (see _tls_in)

    # --- BufferedProtocol -----------------------------------------------------------------------
    # A TLS queue past its handshake (_tls_records) receives records into a buffer of their own; _tls_pump then
    # decrypts into what get_buffer gives and hands it to buffer_updated, as the socket would have.

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._tls_records:
            return self._tls_in
        dest = self._h2c_dest
        if dest is not None:
            self._recv_direct = False
            return self._h2c_disk_buffer() if self._h2c_bs else dest
        buf = super().get_buffer(sizehint)   # type: ignore[misc]
        carry = self._carry
        # A carry exists only while the sans-IO connection holds nothing (no payload being placed), so
        # ``buf`` is the receive buffer: the next read goes behind the carried bytes.
        if carry:
            return buf[carry:]
        # (not under TLS: the socket carries records, which the session opens whole)
        if self._h2c and not self._recv_direct and self._tls is None and (self._h2c_more or self._h2c_next_is_large()):
            self._h2c_capped = True
            return buf[:_H2C_FIRST_READ]
        return buf

    def buffer_updated(self, nbytes: int) -> None:
        if self._tls_records:
            self._tls_update(nbytes)
            return
        if self._h2c_dest is not None:
            self._h2c_received(nbytes)
            return
        if self._recv_direct:
            super().buffer_updated(nbytes)   # type: ignore[misc]
            return
        if self._h2c_capped:
            # a cut read that began with a large H2CData: the next one is cut without a peek too (a host
            # sends a write's H2CData back to back, and large writes come in a row); anything else: peek again
            self._h2c_capped = False
            self._h2c_more = nbytes >= _DATA_HLEN and self._h2c_large(self._recv)
        total = self._carry + nbytes
        self._carry = 0
        self._held = False   # what was held goes now, with what came behind it
        self._receive(self._received(total))

    def data_received(self, data: bytes | memoryview) -> None:
        """Bytes handed over without get_buffer (a transport that is not buffered)."""
        if self._tls_records:
            self._tls_take(data)
            return
        dest = self._h2c_dest
        if dest is not None:
            fw = self._h2c_fw
            if self._h2c_bs and fw is not None:
                # (no FIONREAD for these bytes: the buffered road, as after a change of the namespace)
                self._h2c_unplace(fw, fw.received, fw.received % fw.bs)
                dest = self._h2c_dest
                assert dest is not None
            mv = memoryview(data).cast("B")
            n = min(len(mv), len(dest))
            dest[:n] = mv[:n]
            self._h2c_received(n)
            if n == len(mv) or self._closed:
                return
            data = mv[n:]
        if self._carry:
            joined = bytes(self._recv[:self._carry]) + bytes(data)
            self._carry = 0
            self._held = False
            data = joined
        mv = data if isinstance(data, memoryview) else memoryview(data)
        self._receive(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)

    # --- TLS: records in, plaintext to the fast path ------------------------------------------------

    @property
    def _tls_in(self) -> memoryview:
        """The ciphertext receive buffer (a TLS queue past its handshake; made on first use)."""
        buf = self._tls_cipher
        if buf is None:
            buf = self._tls_cipher = memoryview(bytearray(RECV_BUFFER_MIN))
        return buf

    def _tls_update(self, nbytes: int) -> None:
        buf = self._tls_in
        self._tls_take(buf[:nbytes])
        # sized as the receive buffer is (TargetConnection._received): bigger while reads fill it, small when idle
        size = len(buf)
        if nbytes == size and size < RECV_BUFFER_MAX:
            self._tls_cipher = memoryview(bytearray(min(size * 4, RECV_BUFFER_MAX)))
        elif size > RECV_BUFFER_MIN and nbytes < RECV_BUFFER_MIN:
            self._tls_cipher = None

    def _tls_established(self) -> None:
        # Called by TargetConnection._tls_received in the read that ends the handshake: the rest of that read
        # goes on through it, and the reads after it come here (get_buffer, buffer_updated).
        self._tls_records = True

    def _tls_take(self, ciphertext: bytes | memoryview) -> None:
        """Records of a TLS queue past its handshake (the handshake and the records that arrived with its
        end went through TargetConnection._tls_received): fed to the session, then decrypted (_tls_pump)."""
        tls = self._tls
        self._tls_plain = True   # from now on the sans-IO side (data_received) gets plaintext
        if self._closed:
            return
        try:
            tls.feed(ciphertext)
        except TlsError as exc:
            self._tls_failed(exc, True)
            return
        self._tls_pump()

    def _tls_pump(self) -> None:
        """Decrypt into the buffer the socket would have filled and take it as received bytes, until the
        session holds no more plaintext or a batch is held (then _release_held pumps on)."""
        tls = self._tls
        self._tls_defer = True   # what the records make us send leaves in one write, below
        self._tls_records = False   # get_buffer/buffer_updated: the clear path's, for the plaintext
        try:
            while not self._closed:
                dest = self.get_buffer(-1)
                try:
                    n = tls.read_into(dest)
                except TlsError as exc:
                    self._tls_failed(exc, True)
                    return
                if n:
                    self.buffer_updated(n)
                if n < len(dest) or not n or self._held:
                    break
        finally:
            self._tls_defer = False
            self._tls_records = True
        if not self._closed:
            if tls.closed:
                self.close()   # the host's close_notify (close flushes first)
            else:
                self._send_tls()   # the wake-up's replies (and what reading made the session say, a KeyUpdate's)

    # --- the fast path --------------------------------------------------------------------------

    def _receive(self, mv: memoryview) -> None:
        # What the slow path queues in this wake-up (every PDU of a digest connection, admin commands, the
        # replies of R2T writes completing now) leaves in one write at its end, not one per PDU handed over.
        # (An exception closes the connection, and close() flushes.)
        self._batching = True
        streamed = False
        try:
            streamed = self._receive_batch(mv)
        finally:
            if not self._closed:
                self._batching = False
                if streamed:
                    self._flush()

    def _receive_batch(self, mv: memoryview) -> bool:
        """Take the PDUs of ``mv``: True when the slow path got any whose output is still queued."""
        end = len(mv)
        pos = 0
        streamed = False
        self._yield_at = _perf_ns() + _TIME_BUDGET_NS
        while not self._closed:
            ready = self._fast_ready()
            # (_fast takes CapsuleCmds: a read starting with H2CData goes to _fast_h2c without its set-up)
            if ready and pos < end and mv[pos] == _CMD:
                if streamed:
                    streamed = False
                    self._send_queued()   # the slow path's replies so far go ahead of the fast path's
                pos = self._fast(mv, pos)
                if self._fast_over and pos < end:
                    # The batch's backend calls (inline file writes, page-cache reads) ran past its time budget:
                    # the rest waits behind the loop's other callbacks (every connection, timers), as nvmet's
                    # io_work stops after its budget and requeues itself (nvmet_tcp_io_work). Its replies so
                    # far have left; a read meanwhile takes the carried rest with it (buffer_updated).
                    self._hold(mv, pos, end - pos)
                    asyncio.get_running_loop().call_soon(self._release_held)
                    return False   # (streamed is False here: what the slow path queued left before _fast)
                if self._fast_full and pos < end:
                    # The batch's replies reached the high-water mark: if the socket did not take them
                    # (pause_writing came), the rest waits for the backlog to drain (resume_writing).
                    if self._write_paused:
                        self._hold(mv, pos, end - pos)
                        return False
                    continue
                ready = self._fast_ready()
            rest = end - pos
            if not rest or self._closed:
                return streamed
            if ready and mv[pos] == _H2C_TYPE:
                if rest < _DATA_HLEN:
                    # a cut H2CData header: kept at the start of the receive buffer for the next read (given
                    # to the sans-IO connection, it would take every later PDU until a read ends on a boundary)
                    self._recv[:rest] = mv[pos:pos + rest]
                    self._carry = rest
                    return streamed
                taken = self._fast_h2c(mv, pos, rest)
                if taken:
                    streamed = True   # a write it completed queued its CapsuleResp on the sans-IO connection
                    pos += taken
                    continue
            elif self._fast_tail(mv, pos, rest):
                return streamed
            # One whole PDU the fast path did not take goes through the slow path, then the fast
            # path goes on; a PDU cut by the end of the read (or anything while the sans-IO layer
            # holds bytes) goes there with everything after it.
            if rest >= 8 and self.conn.idle_ready():
                plen = _unpack_u32(mv, pos + 4)[0]
                if 8 <= plen <= rest:
                    self._stream(mv[pos:pos + plen])
                    streamed = True
                    pos += plen
                    continue
            self._stream(mv[pos:] if pos else mv)
            return True
        return False

    def _send_queued(self) -> None:
        out = self.conn.data_to_send()
        if out and self.transport is not None:
            if self._tls is not None:
                self._tls_write(out)
            else:
                self.transport.writelines(out)

    def _hold(self, mv: memoryview, pos: int, rest: int) -> None:
        """Keep the unread rest of a batch at the start of the receive buffer, with room behind it."""
        recv = self._recv
        if len(recv) - rest < RECV_BUFFER_MIN:
            recv = memoryview(bytearray(rest + RECV_BUFFER_MIN))
        recv[:rest] = mv[pos:pos + rest]   # memoryview assignment copies overlapping bytes as memmove does
        self._recv = recv
        self._carry = rest
        self._held = True

    def resume_writing(self) -> None:
        super().resume_writing()   # type: ignore[misc]
        if self._held and not self._closed:
            # Not from inside the transport's write callback: the commands held may queue and close.
            asyncio.get_running_loop().call_soon(self._release_held)

    def _release_held(self) -> None:
        if not self._held or self._closed or self._write_paused:
            return   # taken with a read meanwhile, gone, or the socket is full again (resume_writing comes)
        self._held = False
        carry = self._carry
        self._carry = 0
        self._receive(self._recv[:carry])
        if self._tls_plain and not self._held:
            self._tls_pump()   # what the session decrypted meanwhile, or still holds, no socket read announces

    def _stream(self, data: memoryview) -> None:
        """Bytes for the stream engine: the data_received of the connection class this is mixed into."""
        super().data_received(data)   # type: ignore[misc]

    def _fast_ready(self) -> bool:
        """The queue may take the fast path now: an I/O queue of an enabled, authenticated controller,
        past its Connect, no digests, and the sans-IO connection at a PDU boundary with nothing held."""
        queue = self.queue
        ctrl = queue.ctrl
        if ctrl is None or not queue.qid or self._deadline is not None:
            return False
        if self._tls is not None and not self._tls_plain:
            return False   # TLS: until _tls_take decrypts, the bytes here are records
        conn = self.conn
        if conn.hdgst or conn.ddgst or not conn.idle_ready():
            return False
        auth = queue.auth
        return (auth is None or auth.authenticated) and bool(ctrl.enabled)

    def _fast_tail(self, mv: memoryview, pos: int, rest: int) -> bool:
        """Keep a CapsuleCmd the fast path may take, cut by the end of this read, at the start of the
        receive buffer (where the next read appends); False hands the rest to the sans-IO connection."""
        if not self._fast_ready():
            return False
        recv = self._recv
        if rest >= 8:
            ptype, flags, hlen, pdo, plen = _unpack_common(mv, pos)
            if ptype != _CMD or flags or hlen != _CMD_HLEN or rest >= plen:
                return False
            if not ((pdo == 0 and plen == _CMD_HLEN) or (pdo == _CMD_HLEN and plen <= self.queue.max_incapsule + pdo)):
                return False
            if plen >= len(recv):
                # A capsule larger than the buffer (a listener's inline_data_size above it): a buffer that
                # holds it whole, and what follows it, so the write still runs inline; bounded by the
                # listener's size, and given back by _received once reads are small again.
                recv = self._recv = memoryview(bytearray(plen + RECV_BUFFER_MIN))
        elif mv[pos] != _CMD:
            return False
        recv[:rest] = mv[pos:pos + rest]
        self._carry = rest
        return True

    def _fast(self, mv: memoryview, pos: int) -> int:
        """Run the commands of ``mv`` from ``pos`` on that the fast path can finish; return where it stopped."""
        start = _perf_ns()
        queue = self.queue
        ctrl = queue.ctrl
        ctrl.keep_alive()   # nvmet: any command counts (once per batch is the same)
        namespaces = ctrl.subsystem.namespaces
        # ANA groups this controller's port may not reach (Listener.ana_blocked, shared by reference):
        # such a command leaves the fast path and io.parse answers it with the ANA status.
        ana_blocked = ctrl.ana_blocked
        conn = self.conn
        key = conn.fast_command_key
        fast_sgl = self._fast_sgl
        max_incapsule = queue.max_incapsule
        slots = self._slots
        qid = queue.qid
        flow_off = queue.sqflow_disabled
        sqsize = queue.sqsize + 1
        sqhd = queue.sqhd
        out: list[Any] = []
        append = out.append
        last_nsid = -1
        ns: Any = None
        disk: memoryview | None = None
        hot_nsid = -1   # last_nsid while its reads may take the hot lane: a RAM disk (a view) without QoS limits
        qos: Any = None
        hostnqn = ctrl.hostnqn
        read_nowait: Any = None
        write_nowait: Any = None
        shift = nsze = 0
        writable = False
        end = len(mv)
        reads = writes = read_bytes = write_bytes = r2t_bytes = 0
        done_reads = done_writes = done_read_bytes = 0   # of the namespaces counted before the current one
        wrap = sqsize if sqsize > 1 else 0x10000   # SQHD wraps at the queue size (nvmet_update_sq_head)
        # Reply bytes this batch may queue: past them it stops, so that a host that does not read its
        # replies cannot make one wake-up queue what a whole receive buffer of reads asks for.
        budget = _HIGH_WATER
        # A backend call that is not a RAM disk's view (file page cache) checks the clock after it: past
        # _yield_at the batch stops after that command (over), and _receive leaves the rest for later.
        yield_at = self._yield_at
        over = False
        while end - pos >= _CMD_HLEN and read_bytes < budget and not over:
            head, opflags, cid, nsid, sgl_len, sgl_id, slba, cdw12 = _unpack_cmd(mv, pos)
            # The hot lane: a RAM-disk read of the namespace and length this CID had last time. Every
            # check of the general path below, in the fewest steps; anything else goes there.
            if head == key and opflags == _HOT_READ and nsid == hot_nsid and sgl_id == fast_sgl:
                nlb = (cdw12 & 0xFFFF) + 1
                length = nlb << shift
                slot = slots.get(cid)
                if slot is not None and slot.length == length and slba + nlb <= nsze and sgl_len == length:
                    offset = slba << shift
                    pos += _CMD_HLEN
                    reads += 1
                    read_bytes += length
                    if flow_off:
                        out += (slot.hdr, disk[offset:offset + length])
                    else:
                        sqhd += 1
                        if sqhd == wrap:
                            sqhd = 0
                        slot.sqhd[0] = sqhd
                        out += (slot.hdr, disk[offset:offset + length], slot.resp)
                    continue
            opcode = opflags & 0xFF
            flags = opflags >> 8
            if head == key:
                plen = _CMD_HLEN
                if sgl_id != fast_sgl or (opcode != _READ and opcode != _WRITE):
                    break
            else:
                ptype, pflags, hlen, pdo, plen = _unpack_common(mv, pos)
                if (ptype != _CMD or pflags or hlen != _CMD_HLEN or pdo != _CMD_HLEN or opcode != _WRITE
                        or sgl_id != SGL_ID_INCAPSULE or plen - _CMD_HLEN > max_incapsule or end - pos < plen):
                    break
            if flags & SQE_FLAGS_PSDT_MASK != _SGL_FLAGS:
                break
            if nsid != last_nsid:
                if last_nsid != -1:
                    self._count(ns, reads, read_bytes, writes, write_bytes, start)
                    done_reads += reads
                    done_writes += writes
                    done_read_bytes += read_bytes
                    budget = _HIGH_WATER - done_read_bytes
                    reads = writes = read_bytes = write_bytes = 0
                    start = _perf_ns()
                ns = namespaces.get(nsid)
                # a namespace with registrants takes io.parse's road: the access table, and the count of
                # each host's commands in flight that a preempt and abort waits for
                if ns is None or not ns.enabled or (ana_blocked and ns.anagrpid in ana_blocked) or \
                        ns.pr.registrants or not (ns.auto_visible or ctrl.hostnqn in ns.hosts):
                    break
                backend = ns.backend
                disk = backend.memory_view()
                qos = ns.qos
                hot_nsid = nsid if disk is not None and qos is None else -1
                read_nowait = backend.read_nowait
                write_nowait = backend.write_nowait
                shift = ns.lba_shift
                nsze = ns.nsze
                writable = ns.writable
                last_nsid = nsid
            nlb = (cdw12 & 0xFFFF) + 1
            length = nlb << shift
            if slba + nlb > nsze or length > _MAX_TRANSFER or sgl_len != length:
                break
            # A QoS-limited namespace: a command runs inline only while its buckets allow it now; else it
            # leaves the fast path, and io.parse's gate makes it wait in its own Task (the loop goes on).
            if opcode == _READ:
                # The tokens first: a read the limit delays is not read now (and again when it goes).
                if qos is not None and not qos.try_take(hostnqn, True, length):
                    # Parked at the limit (no Request, no Task): it runs inline when the throttle lets it go
                    # (_run_released). Past sqsize parked on this queue it takes io.parse's road.
                    if len(self._parked) >= sqsize:
                        break
                    self._parked.add(qos.park(hostnqn, True, length, self._on_released,
                                              (ns, qos, cid, nsid, slba << shift, length, shift,
                                               bytes(mv[pos + 8:pos + _CMD_HLEN]), ns.backend)))
                    pos += _CMD_HLEN
                    continue
                if disk is not None:
                    offset = slba << shift
                    data = disk[offset:offset + length]   # in range: checked against NSZE above
                else:
                    try:
                        data = read_nowait(slba << shift, length)
                    except Exception:   # the stream path runs it again and reports the error
                        data = None
                    if data is None or len(data) != length:
                        if qos is not None:
                            qos.refund(hostnqn, True, length)   # the stream path charges it again
                        break
                    over = _perf_ns() >= yield_at
                reads += 1
                read_bytes += length
            elif plen == _CMD_HLEN:
                # A Write whose data comes by R2T (nvmet_tcp_map_data, nvmet_tcp_queue_r2t): the R2T for the
                # whole length goes out with this batch's replies; its H2CData is checked by the sans-IO
                # connection and placed in the write's own buffer, and _fast_write_done answers it.
                if not writable:
                    break
                h2c = self._port.h2c
                # _reserve_h2c's no-wait case: both budgets fit and nobody waits before it (FIFO)
                if self._h2c_waiters or not self._h2c_fits(length) or h2c.queue or not h2c.fits(length):
                    break
                if qos is not None and not qos.try_take(hostnqn, False, length):
                    break
                ttag = self._alloc_ttag()
                if ttag is None:
                    if qos is not None:
                        qos.refund(hostnqn, False, length)
                    break   # the stream path answers it
                self._h2c_bytes += length
                h2c.used += length
                self._h2c[ttag] = _FastWrite(cid, ttag, ns, slba << shift, length, bool(cdw12 & RW_FUA), qos,
                                             bytes(mv[pos + 8:pos + _CMD_HLEN]))
                conn.send_r2t(cid, ttag, 0, length)   # checks and registers it: H2CData is held to it
                r2t_pdu = conn.data_to_send()          # in stream order with the replies around it
                out += r2t_pdu
                r2t_bytes += sum(map(len, r2t_pdu))
                pos += plen
                continue   # no reply yet: the CapsuleResp follows the data
            else:
                if not writable or plen - _CMD_HLEN != length or mv[pos + 32:pos + 40] != _NO_OFFSET:
                    break   # the SGL's offset must be 0 (ICDOFF); anything odd: the stream path says why
                if qos is not None and not qos.try_take(hostnqn, False, length):
                    break
                try:
                    done = write_nowait(slba << shift, mv[pos + _CMD_HLEN:pos + plen], fua=bool(cdw12 & RW_FUA))
                except Exception:
                    done = False
                if not done:
                    if qos is not None:
                        qos.refund(hostnqn, False, length)   # the stream path charges it again
                    break
                over = _perf_ns() >= yield_at
                writes += 1
                write_bytes += length
            pos += plen
            slot = slots.get(cid) or self._new_slot(cid, qid, flow_off)
            # TargetQueue.complete (nvmet_update_sq_head), then TargetConnection.queue_response
            if opcode == _READ:
                if slot.length != length:
                    slot.pack_c2h(cid, length, flow_off)
                append(slot.hdr)
                append(data)
                if flow_off:
                    continue   # C2HData with SUCCESS: no CapsuleResp
            if not flow_off:
                sqhd += 1
                if sqhd == wrap:
                    sqhd = 0
                slot.sqhd[0] = sqhd
            append(slot.resp)
        self._fast_full = read_bytes >= budget
        self._fast_over = over
        if last_nsid != -1 and ns is not None and (reads or writes):
            self._count(ns, reads, read_bytes, writes, write_bytes, start)
        if out:
            if not flow_off:
                queue.sqhd = sqhd
            reads += done_reads
            writes += done_writes
            self.fast_commands += reads + writes
            # per read: C2HData header, data and (with SQ flow control) CapsuleResp; per write: CapsuleResp
            wire = read_bytes + done_read_bytes + (reads + writes) * _RSP_LEN + r2t_bytes
            self._send_out(out, wire if flow_off else wire + reads * _RSP_LEN)
        return pos

    def _new_slot(self, cid: int, qid: int, flow_off: bool) -> _Slot:
        """A reply slot for ``cid``, kept for the next command with that CID while fewer than _MAX_SLOTS are
        (past the cap the reply has a slot of its own, gone once it is sent)."""
        slot = _Slot(cid, qid, flow_off)
        if len(self._slots) < _MAX_SLOTS:
            self._slots[cid] = slot
        return slot

    def _send_out(self, out: list[Any], wire: int) -> None:
        """The batch's reply buffers (``wire`` bytes) in one write: one sendmsg on the engine's own transport."""
        transport = self.transport
        if transport is None:
            return
        if self._tls is not None:
            self._tls_write(out)   # one encryption of the whole batch; written at the end of the wake-up
            if self._fast_full:
                self._send_tls()   # ... unless it reached the high-water mark: the socket says whether to hold
            return
        send_batch = getattr(transport, "send_batch", None)
        if send_batch is not None:
            send_batch(out, wire)
        else:
            transport.writelines(out)

    # --- R2T writes of the fast path ---------------------------------------------------------------

    def _take_wbuf(self, length: int) -> bytearray:
        free = self._wbufs.get(length)
        if free:
            self._wbuf_bytes -= length
            return free.pop()
        return bytearray(length)

    def _fast_h2c(self, mv: memoryview, pos: int, rest: int) -> int:
        """Take the H2CData at ``pos`` of a fast-path write when it is exactly what its R2T expects, with the
        checks the sans-IO connection makes (_check_header, _check_data_header: no digests, hlen, pdo,
        datal 1..MAXH2CDATA and plen, ttag, cccid, datao, within the R2T, LAST only on its last byte);
        return the bytes taken, 0 when anything differs: the sans-IO path takes the PDU and reports it."""
        head, plen, cccid, ttag, datao, datal = _unpack_h2c(mv, pos)
        fw = self._h2c.get(ttag)
        if type(fw) is not _FastWrite or cccid != fw.cid or datao != fw.received:
            return 0
        stop = datao + datal
        length = fw.length
        if head != _H2C_HEAD and (head != _H2C_HEAD_LAST or stop != length):
            return 0
        if not 0 < datal <= self.conn.maxh2cdata or plen != _DATA_HLEN + datal or stop > length:
            return 0
        if not self.conn.take_h2c(ttag, cccid, datao, stop):
            return 0
        whole = rest >= plen
        data = mv[pos + _DATA_HLEN:pos + plen if whole else pos + rest]
        if not datao:
            if whole and stop == length:
                fw.received = stop
                self._fast_write_done(fw, data)   # the whole write in one PDU: no copy to its buffer
                return plen
            self._h2c_direct_start(fw)   # cut, or the first of several: into the disk if it is a RAM disk's
        if fw.span is not None:
            if self._h2c_unchanged(fw):
                self._h2c_take(fw, data, stop, whole)
                return plen if whole else rest
            self._h2c_unplace(fw, fw.received, fw.received % fw.bs)
        buf = fw.buf
        if buf is None:
            buf = fw.buf = self._take_wbuf(length)
        have = datao + len(data)
        buf[datao:have] = data
        if not whole:
            # the rest of the payload is received straight into the write's buffer (get_buffer), however
            # short: one more recv, and the next read starts at a PDU boundary (the engine's again)
            self._h2c_dest = memoryview(buf)[have:stop]
            self._h2c_fw = fw
            self._h2c_stop = stop
            return rest
        fw.received = stop
        if stop == length:
            self._fast_write_done(fw, buf)
        return plen

    def _h2c_next_is_large(self) -> bool:
        """The next PDU in the socket is an H2CData of a fast-path write carrying at least _H2C_CAP_MIN bytes
        (its header peeked at: the socket keeps it). Not on a transport of another kind (no socket to peek):
        True there, the read is cut as before."""
        transport = self.transport
        if type(transport) is not SocketTransport:
            return True
        peek = self._h2c_peek
        try:
            if transport._sock.recv_into(peek, _DATA_HLEN, _PEEK) < _DATA_HLEN:
                return False
        except OSError:
            return False   # (the receive that follows meets it again)
        return self._h2c_large(peek)

    def _h2c_large(self, header: Any) -> bool:
        """``header`` starts an H2CData of a fast-path write with at least _H2C_CAP_MIN bytes of payload."""
        head, _plen, _cccid, ttag, _datao, datal = _unpack_h2c(header)
        return (head == _H2C_HEAD or head == _H2C_HEAD_LAST) and datal >= _H2C_CAP_MIN \
            and type(self._h2c.get(ttag)) is _FastWrite

    def _h2c_received(self, nbytes: int) -> None:
        """``nbytes`` of a cut fast-path H2CData landed in its write's buffer (or its range of the disk)."""
        if self._h2c_bs:
            self._h2c_disk_received(nbytes)
            return
        dest = self._h2c_dest
        assert dest is not None
        if nbytes < len(dest):
            self._h2c_dest = dest[nbytes:]
            return
        fw = self._h2c_fw
        self._h2c_dest = self._h2c_fw = None
        if fw is None or self._closed or self._h2c.get(fw.ttag) is not fw:
            return
        fw.received = self._h2c_stop
        if fw.received == fw.length:
            self._fast_write_done(fw, fw.buf)

    # A RAM disk's write is received into the disk itself, each of its H2CData in turn (the write's buffer and
    # the copy out of it, the whole write again into memory that is rarely in cache, are gone). Single-block
    # atomicity (AWUN 0) holds as with that copy: between two callbacks of the loop, where any read runs, every
    # block of the range is all old or all new. From the socket, whole blocks are received into the disk only
    # as many as it holds (FIONREAD: a receive of no more than that returns all of it in one copy, nothing else
    # running meanwhile); a block that is only partly there (cut by what the socket holds, by the end of a
    # read, or by the end of an H2CData that is not a multiple of the block size) is gathered in _h2c_stage
    # (between two H2CData, in the write's ``tail``) and copied in once whole. The write's ``received`` counts
    # its bytes in hand: all of them in the disk but the last ``received % bs``, which are in the stage. Before
    # each placement the namespace is checked as the copy would be (_h2c_unchanged): if it changed (disabled,
    # resized, write-protected, another backend, the controller gone), what came so far moves to a write buffer
    # and the write takes the buffered road, whose end judges it as before (_fast_write_done, the lifecycle);
    # so does an H2CData of it that the sans-IO connection takes (_place). A write once placed in part is done
    # whole: as nvmet, it was admitted at its command (reservations and all) before its R2T.

    def _h2c_direct_start(self, fw: _FastWrite) -> None:
        """Receive ``fw`` into the disk from its first H2CData on, where it can be (a RAM disk on this engine's
        own socket: FIONREAD; not TLS: the socket holds records, whose byte count says nothing of the
        plaintext's, and _h2c_pull would receive ciphertext into the disk)."""
        transport = self.transport
        if type(transport) is not SocketTransport or self._tls is not None:
            return
        disk = fw.backend.memory_view()
        ns = fw.ns
        # (registrants that came since the R2T: the buffered road, whose end hands it to io.parse's check)
        if disk is None or ns.pr.registrants or not (self.queue.ctrl is not None and ns.enabled
                                                     and ns.backend is fw.backend and not fw.backend.read_only
                                                     and not ns.read_only):
            return
        bs = ns.block_size
        if len(self._h2c_stage) < bs:
            self._h2c_stage = memoryview(bytearray(bs))
        self._h2c_fd = transport._fd
        fw.bs = bs
        fw.disk = disk
        fw.span = disk[fw.offset:fw.offset + fw.length]

    def _h2c_take(self, fw: _FastWrite, data: memoryview, stop: int, whole: bool) -> None:
        """Place ``data``, the start (``whole``: all) of an H2CData of ``fw`` ending at ``stop``, in the disk;
        the rest of a cut one is received there (get_buffer), the whole blocks waiting now at once."""
        tail = fw.tail
        if tail is not None:
            self._h2c_stage[:len(tail)] = tail
            fw.tail = None
        self._h2c_place(fw, data)
        if whole:
            self._h2c_pdu_end(fw)
            return
        self._h2c_fw = fw
        self._h2c_stop = stop
        self._h2c_bs = fw.bs
        self._h2c_dest = fw.span   # (not None: a cut H2CData is being received; _h2c_bs: into the disk)
        self._h2c_pull(self.transport)

    def _h2c_place(self, fw: _FastWrite, data: memoryview) -> None:
        """Copy ``data``, the next bytes of ``fw``, into the disk in whole blocks; a block's part to the stage
        (the namespace is checked already)."""
        bs = fw.bs
        span = fw.span
        stage = self._h2c_stage
        at = fw.received
        n = len(data)
        fw.received = at + n
        pos = 0
        staged = at % bs
        if staged:
            pos = min(bs - staged, n)
            stage[staged:staged + pos] = data[:pos]
            if staged + pos < bs:
                return
            span[at - staged:at - staged + bs] = stage[:bs]
            at += pos
        end = n - (n - pos) % bs
        if end > pos:
            span[at:at + end - pos] = data[pos:end]
        if end < n:
            stage[:n - end] = data[end:]

    def _h2c_pdu_end(self, fw: _FastWrite) -> None:
        """An H2CData of ``fw`` is all in: a block it cut waits in the write's tail for the next one; the
        last one ends the write."""
        staged = fw.received % fw.bs
        if staged:
            fw.tail = bytes(self._h2c_stage[:staged])
        if fw.received == fw.length:
            self._fast_write_done(fw, None)

    def _h2c_pull(self, transport: SocketTransport) -> None:
        """Receive the whole blocks the socket holds now, into the disk, without another trip through the
        selector and the loop first (the header's read usually leaves most of the payload waiting). An error
        or the end of the stream is left to the transport's next receive, which meets it again."""
        if not transport._reading:
            return
        buf = self._h2c_disk_buffer()
        if not self._h2c_into_disk:
            return   # less than a block there (or the namespace changed): the transport's reads go on
        try:
            n = transport._sock.recv_into(buf)
        except OSError:
            return
        if n:
            self._h2c_received(n)

    def _h2c_unchanged(self, fw: _FastWrite) -> bool:
        """The namespace of ``fw`` still takes its data as when it started into the disk (``fw.disk``)."""
        ns = fw.ns
        backend = fw.backend
        return (self.queue.ctrl is not None and ns.enabled and ns.backend is backend and not backend.read_only
                and not ns.read_only and backend.memory_view() is fw.disk)

    def _h2c_disk_buffer(self) -> memoryview:
        """get_buffer while an H2CData is received into the disk: the whole blocks the socket holds (up to the
        H2CData's end), else the rest of the block being gathered."""
        # Why a receive of no more than FIONREAD returns all of it (Linux TCP), so a block is never left half
        # new: FIONREAD is tcp_inq(), rcv_nxt - copied_seq, the in-order bytes of sk_receive_queue, stopped
        # at a pending urgent mark. tcp_recvmsg_locked, non-blocking, copies from that queue until the length
        # asked is done; it stops early only when the queue is empty (only then does it look at signals and
        # socket errors), at the urgent mark (where tcp_inq stopped already; an urgent pointer that arrives
        # later cannot point below rcv_nxt, tcp_check_urg ignores it), or at a fault writing the buffer
        # (EFAULT: the disk's memory could not be faulted in). And nothing else reads this socket: only this
        # loop's transport holds its descriptor (a --workers hand-off stops reading and closes it here). A
        # receive cut anyway (a fault, another reader, another kernel) has its block finished before the
        # callback ends (_h2c_finish_block; tests/test_batch_r2t.py forces one).
        fw = self._h2c_fw
        assert fw is not None and fw.span is not None
        bs = self._h2c_bs
        at = fw.received
        left = self._h2c_stop - at
        staged = at % bs
        if not staged:
            _ioctl(self._h2c_fd, _FIONREAD, self._h2c_inq, True)
            whole = min(_unpack_int(self._h2c_inq)[0], left)
            whole -= whole % bs
            if whole:
                if self._h2c_unchanged(fw):
                    self._h2c_into_disk = True
                    return fw.span[at:at + whole]
                self._h2c_unplace(fw, at, 0)
                assert self._h2c_dest is not None
                return self._h2c_dest
        self._h2c_into_disk = False
        return self._h2c_stage[staged:min(bs, staged + left)]

    def _h2c_disk_received(self, nbytes: int) -> None:
        fw = self._h2c_fw
        assert fw is not None
        bs = self._h2c_bs
        at = fw.received
        if self._h2c_into_disk:
            cut = nbytes % bs
            if cut:
                nbytes += self._h2c_finish_block(fw, at + nbytes, bs - cut)
            fw.received = at + nbytes
        else:
            staged = at % bs
            if staged + nbytes == bs:   # the block gathered is whole
                if not self._h2c_unchanged(fw):
                    self._h2c_unplace(fw, at + nbytes, bs)
                    self._h2c_received(nbytes)   # (as received into the write's buffer)
                    return
                fw.span[at - staged:at - staged + bs] = self._h2c_stage[:bs]
            fw.received = at + nbytes
        if fw.received < self._h2c_stop:
            return
        self._h2c_direct_end()
        if not self._closed and self._h2c.get(fw.ttag) is fw:
            self._h2c_pdu_end(fw)

    def _h2c_finish_block(self, fw: _FastWrite, at: int, need: int) -> int:
        """A receive into the disk ended at ``at``, ``need`` bytes short of a block's end: receive those now,
        before this callback ends, so that no callback sees the block half new (the socket holds them:
        FIONREAD counted them). Returns the bytes received; short of ``need`` (something else reads the
        socket, an error), the block's new start is moved to the stage and is torn in the disk until its
        rest comes, which is logged."""
        span = fw.span
        assert span is not None
        sock = self.transport._sock
        got = 0
        with contextlib.suppress(OSError):
            while got < need:
                n = sock.recv_into(span[at + got:at + need])
                if not n:
                    break
                got += n
        if got < need:
            bs = self._h2c_bs
            start = at + need - bs
            self._h2c_stage[:bs - need + got] = span[start:at + got]
            log.error("NVMe/TCP queue %s: the socket held less than FIONREAD said; a block of a write stays torn "
                      "in the RAM disk until its rest comes", getattr(self.queue, "qid", "?"))
        return got

    def _h2c_unplace(self, fw: _FastWrite, have: int, staged: int) -> None:
        """The namespace changed under a write being received into the disk (or the sans-IO connection takes
        its next H2CData): its ``have`` bytes so far go to a write buffer (from the old range: its view keeps
        that memory), the last ``staged`` of them from the stage (or the write's tail), and the rest of an
        H2CData being received goes there (from ``fw.received`` on)."""
        span = fw.span
        assert span is not None
        placed = have - staged
        buf = fw.buf = self._take_wbuf(fw.length)
        buf[:placed] = span[:placed]
        if staged:
            buf[placed:have] = fw.tail if fw.tail is not None else self._h2c_stage[:staged]
        fw.span = fw.disk = fw.tail = None
        if self._h2c_fw is fw:
            # an H2CData being received: its rest into the buffer (the buffered road's _h2c_received)
            self._h2c_direct_end()
            self._h2c_fw = fw
            self._h2c_dest = memoryview(buf)[fw.received:self._h2c_stop]

    def _h2c_direct_end(self) -> None:
        self._h2c_bs = 0
        self._h2c_dest = self._h2c_fw = None
        self._h2c_into_disk = False

    def _place(self, cccid: int, ttag: int, datao: int, datal: int) -> memoryview | None:
        """The sans-IO ``place`` hook: a large H2CData payload of a fast-path write goes straight into the
        write's buffer (the sans-IO connection checked the PDU against our R2T first)."""
        pending = self._h2c.get(ttag)
        if type(pending) is not _FastWrite:
            return super()._place(cccid, ttag, datao, datal)   # type: ignore[misc]
        if datao != pending.received:
            return None
        if pending.span is not None:   # received into the disk so far: the buffered road from here on
            self._h2c_unplace(pending, datao, datao % pending.bs)
        if pending.buf is None:
            pending.buf = self._take_wbuf(pending.length)
        return memoryview(pending.buf)[datao:datao + datal]

    def _on_h2c_data(self, event: Any) -> None:
        """H2CData the sans-IO connection checked against our R2T (ttag, cccid, offset, length, MAXH2CDATA):
        a fast-path write's goes into its buffer (placed there already when it was large), or, carrying the
        whole write, to the backend from the receive buffer; the rest is the stream engine's."""
        pending = self._h2c.get(event.ttag)
        if type(pending) is not _FastWrite:
            super()._on_h2c_data(event)   # type: ignore[misc]
            return
        data = event.data
        start = pending.received
        if pending.span is not None:   # (as _place)
            self._h2c_unplace(pending, start, start % pending.bs)
        end = start + len(data)
        pending.received = end
        if not start and end == pending.length and not event.placed:
            self._fast_write_done(pending, data)   # the whole write in one PDU: no copy to its buffer
            return
        if not event.placed:
            if pending.buf is None:
                pending.buf = self._take_wbuf(pending.length)
            pending.buf[start:end] = data
        if end == pending.length:
            self._fast_write_done(pending, pending.buf)

    def _fast_write_done(self, fw: _FastWrite, data: Any) -> None:
        """All of a fast-path write's data is in: the backend takes it inline (one copy out of the write's
        buffer, as nvmet's backends copy out of its pages) and the CapsuleResp is queued; a backend that
        would wait, a namespace that changed meanwhile or an error hands it to the lifecycle. ``data``
        None: it is in the RAM disk already (_h2c_direct_start)."""
        del self._h2c[fw.ttag]
        self.conn.drop_r2t(fw.ttag)   # the sans-IO layer forgot it with its last byte; this states it
        ns = fw.ns
        queue = self.queue
        ctrl = queue.ctrl
        start = _perf_ns()
        done = False
        if data is None:
            done = True   # placed in the disk as it came, each part after _h2c_unchanged
        elif (ctrl is not None and ns.enabled and not ns.read_only and not ns.pr.registrants
              and ns.backend is fw.backend):
            # (as _h2c_unchanged judges a write received into the disk: what changed since the R2T goes to
            # the lifecycle, whose io.parse refuses it)
            try:
                done = fw.backend.write_nowait(fw.offset, data, fua=fw.fua)
            except Exception:   # the lifecycle runs it again and reports the error
                done = False
        if not done:
            self._fast_write_fallback(fw, data)
            return
        buf = fw.buf
        if buf is not None and self._wbuf_bytes + fw.length <= _WRITE_POOL:
            # the backend copied it (write_nowait returned True): the buffer serves the next write
            self._wbufs.setdefault(fw.length, []).append(buf)
            self._wbuf_bytes += fw.length
        self._release_h2c(fw.length)
        self._count(ns, 0, 0, 1, fw.length, start)
        self.fast_commands += 1
        # TargetQueue.complete (nvmet_update_sq_head), then the CapsuleResp queue_response sends
        if queue.sqflow_disabled:
            sqhd = _SQHD_DISABLED
        else:
            sqhd = queue.sqhd + 1
            if sqhd == (queue.sqsize + 1 if queue.sqsize else 0x10000):
                sqhd = 0
            queue.sqhd = sqhd
        self.conn.send_response(pack_cqe(fw.cid, 0, 0, 0, sqhd, queue.qid))
        self._flush()   # inside a receive batch, _handle sends everything at its end

    def _fast_write_fallback(self, fw: _FastWrite, data: Any) -> None:
        """Run a fast-path write whose data is in through the command lifecycle: parsed again (what
        changed since its R2T is judged as on the stream path), its data handed over by fetch_data."""
        queue = self.queue
        if fw.qos is not None and queue.ctrl is not None:
            fw.qos.refund(queue.ctrl.hostnqn, False, fw.length)   # io.parse's gate charges it again
        req = _FetchedRequest(queue, Command.from_bytes(fw.sqe))
        req.incapsule = None
        req.digest_ok = True
        # the lifecycle keeps the data past this receive batch: a view of the receive buffer is copied
        req.fetched = memoryview(fw.buf if fw.buf is not None else bytearray(data))
        length = fw.length
        task = start_command(self.target, self, req)
        if task is None:
            self._release_h2c(length)
            return
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        task.add_done_callback(lambda _task: self._release_h2c(length))

    # --- reads parked at a QoS limit --------------------------------------------------------------

    def _on_released(self, parked: Any) -> None:
        """A throttle let a parked read go (from its pump): the reads one release lets go run in the coalesced
        flush (_flush_coalesced), with the replies of the io.parse commands it let go, in one write. That flush
        is asked for one callback later: the Tasks the same release woke were queued after this call, and
        their replies must be queued before the flush runs."""
        self._released.append(parked)
        if not self._release_due:
            self._release_due = True
            asyncio.get_running_loop().call_soon(self._flush_soon)

    def _flush_coalesced(self) -> None:
        if self._released:
            self._run_released()
        super()._flush_coalesced()   # type: ignore[misc]

    def _run_released(self) -> None:
        """Run the reads the throttles let go, inline as _fast would have (the namespace checks again: what
        changed while they waited is judged by io.parse, which they are handed to with their tokens back)."""
        self._release_due = False
        released = self._released
        self._released = []
        parked = self._parked
        for p in released:
            parked.discard(p)
        queue = self.queue
        ctrl = queue.ctrl
        if self._closed or ctrl is None:
            return
        hostnqn = ctrl.hostnqn
        namespaces = ctrl.subsystem.namespaces
        ana_blocked = ctrl.ana_blocked
        ready = bool(ctrl.enabled) and (queue.auth is None or queue.auth.authenticated)
        flow_off = queue.sqflow_disabled
        sqsize = queue.sqsize + 1
        wrap = sqsize if sqsize > 1 else 0x10000
        sqhd = queue.sqhd
        slots = self._slots
        qid = queue.qid
        out: list[Any] = []
        wire = 0
        for p in released:
            ns, qos, cid, nsid, offset, length, shift, sqe, backend = p.cmd
            data = None
            same = False
            start = _perf_ns()
            if (ready and ns.enabled and namespaces.get(nsid) is ns and ns.backend is backend
                    and ns.lba_shift == shift and offset + length <= ns.nsze << shift and not ns.pr.registrants
                    and not (ana_blocked and ns.anagrpid in ana_blocked)
                    and (ns.auto_visible or hostnqn in ns.hosts)):
                same = True
                disk = backend.memory_view()
                if disk is not None:
                    data = disk[offset:offset + length]
                else:
                    try:
                        data = backend.read_nowait(offset, length)
                    except Exception:   # io.parse runs it again and reports the error
                        data = None
                    if data is not None and len(data) != length:
                        data = None
            if same:   # it waited at the limit (io.parse's _throttled counts the same)
                waited = max(1, _perf_ns() - p.at)
                for stats in (ns.stats, ctrl.host_stats):
                    stats.throttled += 1
                    stats.throttled_ns += waited
            if data is None:
                # Unchanged but the backend would wait: the lifecycle reads it, its tokens taken already. Else
                # io.parse judges what changed (and its gate charges it again).
                if not same:
                    qos.refund(hostnqn, True, length)
                self._fast_fallback(sqe, paid=same)
                continue
            self._count(ns, 1, length, 0, 0, start)   # as io.parse counts it: the read, not the wait
            self.fast_commands += 1
            slot = slots.get(cid) or self._new_slot(cid, qid, flow_off)
            if slot.length != length:
                slot.pack_c2h(cid, length, flow_off)
            out += (slot.hdr, data)
            wire += _DATA_HLEN + length
            if flow_off:
                continue
            sqhd += 1
            if sqhd == wrap:
                sqhd = 0
            _pack_sqhd(slot.buf, _SLOT_SQHD, sqhd)
            out.append(slot.resp)
            wire += _RSP_LEN
        if not flow_off:
            queue.sqhd = sqhd
        if out and self.transport is not None:
            # what the stream path queued goes first, all in one write
            queued = self.conn.data_to_send()
            if queued:
                wire += sum(map(len, queued))
                out[:0] = queued
            self._send_out(out, wire)

    def _fast_fallback(self, sqe: bytes, paid: bool) -> None:
        """A read the fast path parked but cannot finish inline: the lifecycle runs it from its parse on
        (``paid``: its QoS tokens are taken; its reply leaves with the others of the release)."""
        req = TcpRequest(self.queue, Command.from_bytes(sqe))
        req.incapsule = None
        req.digest_ok = True
        req.qos_paid = paid
        req.coalesce = True
        task = start_command(self.target, self, req)
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def fetch_data(self, req: Any) -> Any:
        if type(req) is _FetchedRequest:
            req.data = req.fetched
            return None
        return super().fetch_data(req)   # type: ignore[misc]

    def _cleanup(self) -> None:
        # The fast-path writes still waiting for data give their budget back now (the stream engine's
        # writes do as their cancelled tasks end).
        self._h2c_direct_end()
        h2c = self._h2c
        for ttag in [t for t, p in h2c.items() if type(p) is _FastWrite]:
            fw = h2c.pop(ttag)
            self._h2c_bytes -= fw.length
            self._port.h2c.release(fw.length)
        # Reads parked at a QoS limit leave their throttles' queues (the next in line moves up).
        parked = self._parked
        self._parked = set()
        self._released = []
        for p in parked:
            p.cancel()
        super()._cleanup()   # type: ignore[misc]

    def _count(self, ns: Any, reads: int, read_bytes: int, writes: int, write_bytes: int, start: int) -> None:
        """The namespace's and the host's counters for one batch of one namespace (target/io.py counts
        per command): each command's latency is the batch's inline time shared out equally."""
        done = reads + writes
        if not done:
            return
        each = (_perf_ns() - start) // done
        bucket = (each >> LATENCY_SHIFT).bit_length()
        host = self.queue.ctrl.host_stats
        for stats in (ns.stats, host):
            if reads:
                stats.reads += reads
                stats.read_bytes += read_bytes
                stats.read_latency_ns += each * reads
                stats.read_hist[bucket] += reads
            if writes:
                stats.writes += writes
                stats.write_bytes += write_bytes
                stats.write_latency_ns += each * writes
                stats.write_hist[bucket] += writes


# --- the socket transport -----------------------------------------------------------------------

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_TRY_AGAIN = (BlockingIOError, InterruptedError)


def _owned_rest(view: memoryview) -> memoryview:
    """The unsent rest of a buffer the socket took in part. A view of a RAM disk (a read sent without a copy)
    is copied: its cut block would otherwise be finished from the disk as it is when the socket drains, and a
    write landing meanwhile would show the host a block half old, half new (single-block atomicity, AWUN 0).
    Whole views still queued are sent whole later, each block as it is then: that is only a later read."""
    return memoryview(bytes(view)) if type(view.obj) is mmap.mmap else view


class SocketTransport(asyncio.Transport):
    """A non-blocking TCP socket as an asyncio transport for a BufferedProtocol (see the module
    docstring). Closing flushes the backlog first; ``abort`` drops it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: Any, *,
                 poll_us: int = 0) -> None:
        super().__init__()
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._poll_ns = max(0, poll_us) * 1000
        # Polling renews its deadline with every receive that finds data: one wake-up of a busy connection
        # would never end but for this bound, whatever poll_us says (TcpLimits.check keeps it below).
        self._slice_ns = defaults.TCP_POLL_SLICE_US * 1000
        if self._poll_ns:
            self._poller = select.poll()
            self._poller.register(self._fd, select.POLLIN)
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._backlog_bytes = 0
        self._high = defaults.TCP_WRITE_HIGH_WATER
        self._low = defaults.TCP_WRITE_LOW_WATER
        self._write_paused = False
        self._reading = False
        self._closing = False
        self._lost = False
        self._extra: dict[str, Any] = {"socket": sock}
        with contextlib.suppress(OSError):
            self._extra["peername"] = sock.getpeername()
        with contextlib.suppress(OSError):
            self._extra["sockname"] = sock.getsockname()
        sock.setblocking(False)
        protocol.connection_made(self)
        if not self._closing:
            self.resume_reading()

    # --- BaseTransport ------------------------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._stop_reading()
        if not self._backlog:
            self._release_fd()
            self._loop.call_soon(self._connection_lost, None)

    def abort(self) -> None:
        self._force_close(None)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    # --- reading ------------------------------------------------------------------------------------

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        self._stop_reading()

    def resume_reading(self) -> None:
        if self._reading or self._closing:
            return
        self._reading = True
        self._loop.add_reader(self._fd, self._read_ready)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def _read_ready(self) -> None:
        if not self._recv_once() or not self._poll_ns:
            return
        # Hybrid polling: more may come within poll_us; a receive that finds it saves the sleep and
        # wake-up of the selector. Bounded per callback: other connections and timers must run.
        # poll(0) asks without the exception a non-blocking recv raises when nothing is there (4x cheaper).
        ready = self._poller.poll
        now = _perf_ns()
        stop = now + self._slice_ns
        deadline = now + self._poll_ns
        while self._reading and now < deadline and now < stop:
            if ready(0) and self._recv_once():
                deadline = _perf_ns() + self._poll_ns
            now = _perf_ns()

    def _recv_once(self) -> bool:
        """One non-blocking receive into the protocol's buffer; False when nothing came."""
        protocol = self._protocol
        try:
            buf = protocol.get_buffer(-1)
            if not len(buf):
                # recv_into an empty view returns 0, which would read as the host's FIN (the host engine's
                # 512 KiB bug, 58bf46e): a buffer with no room is the protocol's error, said as one
                raise RuntimeError("the receive buffer has no room left (a PDU would be read as end of stream)")
        except Exception as exc:
            self._fatal_error(exc, "get_buffer")
            return False
        try:
            n = self._sock.recv_into(buf)
        except _TRY_AGAIN:
            return False
        except OSError as exc:
            self._force_close(exc)
            return False
        try:
            if not n:
                self._stop_reading()
                if not protocol.eof_received():
                    self.close()
                return False
            protocol.buffer_updated(n)
        except Exception as exc:
            self._fatal_error(exc, "eof_received" if not n else "buffer_updated")
            return False
        return True

    def _fatal_error(self, exc: Exception, where: str) -> None:
        """The protocol failed on received bytes: what it had half done cannot go on, so the connection
        goes (asyncio's _SelectorTransport._fatal_error), instead of the exception reaching the loop's
        handler with the connection still registered."""
        queue = getattr(self._protocol, "queue", None)
        peer = getattr(queue, "peer", None) or self._extra.get("peername") or "?"
        log.error("NVMe/TCP connection from %s (qid %s): %s raised %s: %s; closing it", peer,
                  getattr(queue, "qid", "?"), where, type(exc).__name__, exc, exc_info=exc)
        self._force_close(exc)

    # --- writing ------------------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writelines((data,))

    def send_batch(self, bufs: list[Any], nbytes: int) -> None:
        """``writelines`` of a list whose total size the caller knows (the batch engine's replies): one
        sendmsg, and nothing to count unless the socket took less."""
        if self._closing or self._lost:
            return
        if not self._backlog and len(bufs) <= _IOV_MAX:
            try:
                sent = self._sock.sendmsg(bufs)
            except _TRY_AGAIN:
                sent = 0
            except OSError as exc:
                self._force_close(exc)
                return
            if sent == nbytes:
                return
            self._queue_after(bufs, sent)
            return
        self.writelines(bufs)

    def _queue_after(self, bufs: list[Any], sent: int) -> None:
        """Queue what follows the first ``sent`` bytes of ``bufs``."""
        for i, buf in enumerate(bufs):
            size = buf.nbytes if type(buf) is memoryview else len(buf)
            if sent < size:
                self._queue(bufs[i:], sent)
                return
            sent -= size

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        if self._closing or self._lost:
            return
        bufs = list_of_data if isinstance(list_of_data, list) else list(list_of_data)
        if self._backlog:
            self._queue(bufs, 0)
            return
        count = len(bufs)
        start = 0
        while start < count:
            chunk = bufs if not start and count <= _IOV_MAX else bufs[start:start + _IOV_MAX]
            try:
                sent = self._sock.sendmsg(chunk)
            except _TRY_AGAIN:
                sent = 0
            except OSError as exc:
                self._force_close(exc)
                return
            # Skip the buffers that went whole; queue the rest from the first one that did not.
            whole = 0
            for buf in chunk:
                size = buf.nbytes if type(buf) is memoryview else len(buf)
                if sent < size:
                    break
                sent -= size
                whole += 1
            start += whole
            if whole < len(chunk):
                self._queue(bufs[start:], sent)
                return

    def _queue(self, bufs: list[Any], skip: int) -> None:
        """Keep what the socket did not take (views, no copy: a backend's result is ours to hold)."""
        backlog = self._backlog
        was_empty = not backlog
        for i, buf in enumerate(bufs):
            view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf
            if i == 0 and skip:
                view = _owned_rest(view[skip:])
            if len(view):
                backlog.append(view)
                self._backlog_bytes += len(view)
        if was_empty and backlog:
            self._loop.add_writer(self._fd, self._write_ready)
        if not self._write_paused and self._backlog_bytes > self._high:
            self._write_paused = True
            with contextlib.suppress(Exception):
                self._protocol.pause_writing()

    def _write_ready(self) -> None:
        backlog = self._backlog
        while backlog:
            chunk = list(itertools.islice(backlog, _IOV_MAX))
            try:
                sent = self._sock.sendmsg(chunk)
            except _TRY_AGAIN:
                return
            except OSError as exc:
                self._force_close(exc)
                return
            self._backlog_bytes -= sent
            for _ in range(len(chunk)):
                head = backlog[0]
                if sent < len(head):
                    backlog[0] = _owned_rest(head[sent:])
                    return   # the socket is full again: wait for the next writable
                sent -= len(head)
                backlog.popleft()
        self._loop.remove_writer(self._fd)
        if self._write_paused and self._backlog_bytes <= self._low:
            self._write_paused = False
            with contextlib.suppress(Exception):
                self._protocol.resume_writing()
        if self._closing:
            self._release_fd()
            self._connection_lost(None)

    def get_write_buffer_size(self) -> int:
        return self._backlog_bytes

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = defaults.TCP_WRITE_HIGH_WATER if high is None else high
        self._low = self._high // 4 if low is None else low

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError("NVMe/TCP never half-closes")

    # --- teardown -----------------------------------------------------------------------------------

    def _force_close(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._closing = True
        self._stop_reading()
        if self._backlog:
            self._backlog.clear()
            self._backlog_bytes = 0
            self._loop.remove_writer(self._fd)
        self._release_fd()
        self._loop.call_soon(self._connection_lost, exc)

    def _release_fd(self) -> None:
        """Close the descriptor now, not at connection_lost: a listener evicting or refusing connections
        while it accepts a burst must get their descriptors back at once (RLIMIT_NOFILE)."""
        self._sock.close()

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        if self._backlog:
            self._backlog.clear()
            self._loop.remove_writer(self._fd)
        try:
            self._protocol.connection_lost(exc)
        finally:
            self._sock.close()
            self._protocol = None


# --- connections and the listener ---------------------------------------------------------------


class BatchConnection(BatchMixin, TargetConnection):
    """The controller end of one NVMe/TCP queue on the batch engine."""

    def __init__(self, target: TransportHost, listener: Listener | None = None, *, on_lost: Any = None) -> None:
        TargetConnection.__init__(self, target, listener, on_lost=on_lost)
        self._batch_init()


def attach_socket(conn: Any, sock: socket.socket, poll_us: int) -> SocketTransport:
    """Serve an accepted (or handed-over) socket with ``conn`` on the running loop."""
    return SocketTransport(asyncio.get_running_loop(), sock, conn, poll_us=poll_us)


class BatchTcpListener(TcpListener):
    """Accepts NVMe/TCP connections itself (``loop.add_reader`` on the listening sockets) and serves
    each on a `SocketTransport` with a batch connection, within the port's caps."""

    connection_class: type[TargetConnection] = BatchConnection   # type: ignore[assignment]

    def __init__(self, target: TransportHost, listener: Listener) -> None:
        super().__init__(target, listener)
        self._socks: list[socket.socket] = []
        self._accept_paused: asyncio.TimerHandle | None = None

    @property
    def port(self) -> int:
        if not self._socks:
            return self.listener.trsvcid
        return int(self._socks[0].getsockname()[1])

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.port_state.check_fds()
        host = self.listener.traddr or None
        try:
            infos = await loop.getaddrinfo(host, self.listener.trsvcid, family=socket.AF_UNSPEC,
                                           type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            seen: set[Any] = set()
            for family, kind, proto, _name, addr in infos:
                if (family, addr) in seen:
                    continue
                seen.add((family, addr))
                sock = socket.socket(family, kind, proto)
                self._socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)   # as asyncio's create_server
                sock.bind(addr)
                sock.listen(defaults.TCP_LISTEN_BACKLOG)
                sock.setblocking(False)
        except OSError as exc:
            self._close_socks()
            raise OSError(exc.errno, f"cannot listen on {self.listener.id}: {exc.strerror or exc}") from exc
        for sock in self._socks:
            loop.add_reader(sock.fileno(), self._accept, sock)
        log.info("NVMe/TCP listening on %s:%d%s (batch engine%s)", self.listener.traddr, self.port,
                 " (discovery)" if self.listener.discovery else "",
                 f", polling {self.port_state.limits.poll_us} µs" if self.port_state.limits.poll_us else "")

    def _accept(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(defaults.TCP_LISTEN_BACKLOG):
            try:
                sock, _addr = lsock.accept()
            except _TRY_AGAIN:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors or memory: stop accepting for a second (asyncio does the same).
                    log.warning("NVMe/TCP listener %s cannot accept: %s; retrying in 1 s", self.listener.id, exc)
                    self._pause_accepting(loop)
                return
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                attach_socket(self._factory(), sock, self.port_state.limits.poll_us)
            except Exception:
                log.exception("NVMe/TCP listener %s: cannot serve an accepted connection", self.listener.id)
                sock.close()

    def _pause_accepting(self, loop: asyncio.AbstractEventLoop) -> None:
        for sock in self._socks:
            loop.remove_reader(sock.fileno())

        def resume() -> None:
            self._accept_paused = None
            for sock in self._socks:
                loop.add_reader(sock.fileno(), self._accept, sock)

        self._accept_paused = loop.call_later(1.0, resume)

    def _close_socks(self) -> None:
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
            for sock in self._socks:
                with contextlib.suppress(Exception):
                    loop.remove_reader(sock.fileno())
        for sock in self._socks:
            sock.close()
        self._socks = []

    async def stop(self) -> None:
        if self._accept_paused is not None:
            self._accept_paused.cancel()
            self._accept_paused = None
        self._close_socks()
        for conn in list(self.connections):
            conn.abort()
        self.connections.clear()
