"""NVMe/TCP on asyncio: one `TargetConnection` protocol per queue around nvmeof.tcp.TcpConnection.

Modelled on Linux nvmet tcp.c: ICReq -> ICResp; each command capsule becomes a Request run through the
command lifecycle (target/lifecycle.py: inline, a Task only once it waits; a queue's commands may
complete out of order), for which this connection is the TransportQueue (``TCP_OPS``). Host data
arrives in-capsule or, for larger writes, after one R2T for the whole length (the host's MAXR2T is 0),
its H2CData PDUs checked against that R2T before a buffer is allocated. R2Ts are paced by a
per-connection byte budget (``h2c_budget``): a write whose R2T would exceed it waits, first come first
served, for earlier ones to finish, while commands without host data go on; on top of it, all
connections of a process share one global budget (``H2CBudget``), granted round-robin between the
connections that wait for it. Large H2CData payloads are received straight into the write's buffer
(the sans-IO ``place`` hook). Reads go out as C2HData (SUCCESS only when SQ flow control is off and
nothing else must be said) plus a CapsuleResp. Losing the admin queue tears the controller down.

Port limits (``TcpLimits``, per Target in ``TcpPort``): a connection must send ICReq within
``ic_timeout`` and its Fabrics Connect within ``connect_timeout`` after our ICResp, or it is closed
(one timer per connection, cancelled at Connect); connections are capped per listener and in total,
and the total is kept below RLIMIT_NOFILE, so idle sockets cannot take the fds the API, backing
files and established hosts need. At a cap, the oldest connection that has not completed Connect
yet makes room for the new one (an attacker's half-open connections cannot lock a host out); with
none, the new connection is closed at once. Receive buffers start at TCP_RECV_BUFFER_MIN, grow while
reads fill them and drop back when a read leaves the small buffer enough room.

There is one NVMe/TCP engine (issue 26): target/transports/tcp_batch.py. `TargetConnection` is its slow
path (the batch connection classes mix its fast path in front of it), the loop transport's connection, and
alone the reference model tests compare the fast path with. `TcpListener` keeps the caps and deadlines the
batch listener inherits; its asyncio server (``start``) is not in the registry, only tests start it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nvmeof import defaults
from nvmeof.spec.fabrics import TrType
from nvmeof.spec.nvme import SGL_ID_INCAPSULE, SGL_ID_TRANSPORT, Command, Direction
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
from nvmeof.tls.openssl import TlsError, TlsSession, looks_like_tls
from target.lifecycle import start_command
from target.request import Request, TargetQueue
from target.tls import PskRefused, find_psk, handshake_hint
from target.transport_ops import TransportOps

if TYPE_CHECKING:
    from target.model import Listener
    from target.ports import TransportHost

log = logging.getLogger(__name__)

RECV_BUFFER_MIN = defaults.TCP_RECV_BUFFER_MIN
RECV_BUFFER_MAX = defaults.TCP_RECV_BUFFER_MAX
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


# nvmet_tcp_ops: transport SGLs (0x5A) for data beyond the capsule; 8 KiB in-capsule (NVME_TCP_ADMIN_CCSZ).
TCP_OPS = TransportOps(trtype="tcp", name="NVMe/TCP", nvme_trtype=TrType.TCP, sgl_types=frozenset({SGL_ID_TRANSPORT}),
                       admin_incapsule=defaults.ADMIN_INCAPSULE_SIZE, io_incapsule=defaults.IO_INCAPSULE_SIZE)


class TcpRequest(Request):
    """A Request with what its CapsuleCmd brought: in-capsule data and whether its data digest held."""

    __slots__ = ("digest_ok", "incapsule")

    incapsule: bytes | None
    digest_ok: bool


def _queue_gone() -> None:
    """TargetQueue.close of a connection that is gone: nothing left to close."""


def _format_peer(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(addr) if addr else ""


# --- port limits --------------------------------------------------------------------------------


@dataclass
class TcpLimits:
    """What `nvmeof serve` lets NVMe/TCP connections hold (the --ic-timeout ... --h2c-budget options)."""

    ic_timeout: float = defaults.TCP_ICREQ_TIMEOUT          # seconds from accept to ICReq
    connect_timeout: float = defaults.TCP_CONNECT_TIMEOUT   # seconds from ICResp to the queue's Connect
    max_connections: int = defaults.TCP_MAX_CONNECTIONS     # across all listeners (and worker processes)
    max_connections_per_listener: int = defaults.TCP_MAX_CONNECTIONS_PER_LISTENER
    h2c_global_budget: int = defaults.TCP_H2C_GLOBAL_BUDGET  # R2T'd bytes of all connections of this process
    poll_us: int = defaults.POLL_US   # batch engine: µs of busy receives after a batch before sleeping (--poll-us)

    def check(self) -> None:
        """Raise ValueError naming the option whose value cannot work."""
        for name, value in (("--ic-timeout", self.ic_timeout), ("--connect-timeout", self.connect_timeout)):
            if not value > 0:
                raise ValueError(f"{name} {value}: give a positive number of seconds")
        for name, count in (("--max-connections", self.max_connections),
                            ("--max-connections-per-listener", self.max_connections_per_listener)):
            if count < 1:
                raise ValueError(f"{name} {count}: give at least 1 connection")
        if self.poll_us < 0:
            raise ValueError(f"--poll-us {self.poll_us}: give 0 (no polling) or a positive number of microseconds")
        if self.poll_us > defaults.POLL_US_MAX:
            # SocketTransport polls at most TCP_POLL_SLICE_US per wake-up: more would hold the event loop
            raise ValueError(f"--poll-us {self.poll_us}: give at most {defaults.POLL_US_MAX} µs (one connection's "
                             "polling may hold the event loop only that long per wake-up)")
        if self.h2c_global_budget < 1:
            # Any positive budget works: one write always goes when none holds any (a budget below
            # one transfer serializes the writes, it never stops them).
            raise ValueError(f"--h2c-budget {self.h2c_global_budget}: give a positive size")


class _LogThrottle:
    """At most one log line per ``interval`` for one kind of event; what comes in between is counted
    and said in one summary line at the end of the interval (a flood must not flood the log too)."""

    def __init__(self, level: int, interval: float = defaults.TCP_LIMIT_LOG_INTERVAL) -> None:
        self.level = level
        self.interval = interval
        self.total = 0
        self._quiet_until = 0.0
        self._held = 0
        self._last = ""
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self, text: str) -> None:
        self.total += 1
        now = time.monotonic()
        if now >= self._quiet_until and not self._held:
            log.log(self.level, "%s", text, extra={"event": "refused", "reason": text})
            self._quiet_until = now + self.interval
            return
        self._held += 1
        self._last = text
        if self._timer is None:
            with contextlib.suppress(RuntimeError):
                self._timer = asyncio.get_running_loop().call_later(max(0.0, self._quiet_until - now), self._flush)

    def _flush(self) -> None:
        self._timer = None
        held, self._held = self._held, 0
        fields = {"event": "refused", "reason": self._last}
        if held == 1:
            log.log(self.level, "%s", self._last, extra=fields)
        elif held:
            log.log(self.level, "%s (and %d more like it in the last %.1f s; %d in all)", self._last, held - 1,
                    self.interval, self.total, extra={**fields, "count": held})
        self._quiet_until = time.monotonic() + self.interval


class H2CBudget:
    """R2T'd write bytes all connections of one process may have outstanding (--h2c-budget).

    A connection whose next write fits its own budget but not this one joins ``queue``; released bytes
    go to the queued connections in order, one write each before a connection queues again at the
    end, so a host with many writes waiting cannot starve one with few. One write always goes when
    nothing is outstanding, whatever its size.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.queue: deque[TargetConnection] = deque()

    def fits(self, nbytes: int) -> bool:
        return self.used == 0 or self.used + nbytes <= self.limit

    def wait(self, conn: TargetConnection) -> None:
        if not conn._h2c_queued:
            conn._h2c_queued = True
            self.queue.append(conn)

    def forget(self, conn: TargetConnection) -> None:
        if conn._h2c_queued:
            conn._h2c_queued = False
            with contextlib.suppress(ValueError):
                self.queue.remove(conn)

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        queue = self.queue
        while queue:
            conn = queue[0]
            want = conn._h2c_next()
            if want is None:   # closed, or waiting for its own writes to finish: it queues again then
                queue.popleft()
                conn._h2c_queued = False
                continue
            if not self.fits(want):
                return
            queue.popleft()
            conn._h2c_queued = False
            conn._h2c_grant()
            if conn._h2c_next() is not None:
                self.wait(conn)   # more to ask for: behind everyone who waits now


def _load_malloc_trim() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None).malloc_trim   # glibc; elsewhere there is nothing to call
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()
TRIM_AFTER_CLOSES = 256   # connections closed since the last peak before freed heap pages go back to the OS


def _fds_in_use() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1   # minus the directory listdir itself opened
    except OSError:
        return 0


def fd_headroom(wanted: int, *, raise_limit: bool = False) -> tuple[int, str | None]:
    """The connection cap RLIMIT_NOFILE allows for ``wanted``, and why it is lower if it is.

    Every connection is one fd in this process (handed-off ones one in a worker, which inherits the
    same limit); the API's connections, backing files, listeners and worker channels need fds too,
    so TCP_FD_RESERVE of them stay free beyond those already open. With ``raise_limit`` the soft
    limit is raised towards the hard one first, as far as ``wanted`` needs (as Go's runtime does).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = _fds_in_use()
    need = wanted + in_use + defaults.TCP_FD_RESERVE
    if soft == resource.RLIM_INFINITY:
        return wanted, None
    if raise_limit and soft < need and (hard == resource.RLIM_INFINITY or hard > soft):
        new = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (OSError, ValueError) as exc:
            log.warning("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, new, exc)
        else:
            log.info("raised the RLIMIT_NOFILE soft limit from %d to %d for up to %d NVMe/TCP connections",
                     soft, new, wanted)
            soft = new
    room = soft - in_use - defaults.TCP_FD_RESERVE
    if room >= wanted:
        return wanted, None
    cap = max(room, 1)
    return cap, (f"RLIMIT_NOFILE is {soft} (hard {hard if hard != resource.RLIM_INFINITY else 'unlimited'}), "
                 f"{in_use} fds are open and {defaults.TCP_FD_RESERVE} stay free for the API, backing files and "
                 "listeners; raise it with `ulimit -n` or LimitNOFILE=")


class TcpPort:
    """One Target's NVMe/TCP port state: limits, the connection counts behind the caps, the global
    H2C budget, and the rate-limited log lines of refusals and timeouts."""

    def __init__(self) -> None:
        self.limits = TcpLimits()
        self.h2c = H2CBudget(self.limits.h2c_global_budget)
        self.open = 0                  # connections counted against max_connections (in workers too)
        self.max_total = self.limits.max_connections   # after fd_headroom
        self._fd_checked = False
        self._raise_fd_limit = False
        # Connections that have not completed Connect, oldest first: the ones a cap may close.
        self.unconnected: dict[TargetConnection, None] = {}
        # One rate-limited log line per kind: ICReq and Connect timeouts, refusals, evictions.
        self.log_icreq_timeout = _LogThrottle(logging.WARNING)
        self.log_connect_timeout = _LogThrottle(logging.WARNING)
        self.log_refused = _LogThrottle(logging.WARNING)
        self.log_evicted = _LogThrottle(logging.WARNING)
        self._peak = 0                 # most connections open since the last trim
        self._trim: asyncio.TimerHandle | None = None

    def opened(self) -> None:
        self.open += 1
        if self.open > self._peak:
            self._peak = self.open

    def closed(self) -> None:
        """One connection fewer. After a crowd has gone (a flood that timed out, say), give the heap
        pages their buffers used back to the OS: glibc keeps freed memory inside its heap otherwise,
        and the daemon's RSS would stay at the flood's peak."""
        self.open -= 1
        if self._peak - self.open >= TRIM_AFTER_CLOSES and self._trim is None and _malloc_trim is not None:
            with contextlib.suppress(RuntimeError):
                self._trim = asyncio.get_running_loop().call_later(1.0, self._trim_heap)

    def _trim_heap(self) -> None:
        self._trim = None
        self._peak = self.open
        _malloc_trim(0)

    @classmethod
    def of(cls, target: TransportHost) -> TcpPort:
        """The one TcpPort of ``target``, kept in its declared ``transport_state``."""
        port = target.transport_state.get("tcp")
        if port is None:
            port = target.transport_state["tcp"] = cls()
        return port

    def configure(self, limits: TcpLimits, *, raise_fd_limit: bool = False) -> None:
        """Take new limits (raises ValueError naming a bad option). The fd check runs again at the
        next listener start, or now with ``raise_fd_limit`` (before worker processes inherit the limit)."""
        limits.check()
        self.limits = limits
        self.h2c.limit = limits.h2c_global_budget
        self.max_total = limits.max_connections
        self._raise_fd_limit = raise_fd_limit
        self._fd_checked = False
        if raise_fd_limit:
            self.check_fds()

    def check_fds(self) -> None:
        """Cap the total below RLIMIT_NOFILE (once per configuration; listeners call it at start)."""
        if self._fd_checked:
            return
        self._fd_checked = True
        wanted = self.limits.max_connections
        self.max_total, why = fd_headroom(wanted, raise_limit=self._raise_fd_limit)
        if why:
            log.warning("NVMe/TCP connection cap lowered from %d (--max-connections) to %d: %s", wanted,
                        self.max_total, why)


class TargetConnection(asyncio.BufferedProtocol):
    """The controller end of one NVMe/TCP queue (also used over the in-memory loop transport): the
    TransportQueue the command lifecycle (target/lifecycle.py) drives."""

    ops = TCP_OPS
    # Run each command's coroutine inline first and make a Task only if it suspends; False makes a
    # Task per command (the general path the fast path is tested against).
    eager = True
    # Seconds a closing connection may spend flushing to a peer that does not read before it is aborted.
    close_grace = defaults.TCP_CLOSE_GRACE
    # Bytes of host data our outstanding R2Ts may ask for at once: each such write holds a buffer of its
    # full length until it has executed. One write always goes when none holds any, so a budget below
    # one transfer slows the queue down but never stops it.
    h2c_budget = defaults.TCP_H2C_BUDGET

    def __init__(self, target: TransportHost, listener: Listener | None = None, *, on_lost: Any = None) -> None:
        self.target = target
        self.listener = listener
        ops = self.ops
        io_incapsule = ops.io_incapsule if listener is None else listener.inline_data_size
        # The PDU layer's bound (a larger CapsuleCmd is a fatal error, a TermReq); check_sgl then holds
        # each queue to its own size (admin or I/O)
        self.conn = TcpConnection(Role.CONTROLLER, maxh2cdata=defaults.MAXH2CDATA,
                                  max_incapsule=max(ops.admin_incapsule, io_incapsule))
        # Large H2CData payloads go straight into the write's buffer (see _place).
        self.conn.place = self._place
        self.queue = TargetQueue(ops=ops, listener=listener, close=self.close)
        self.transport: asyncio.Transport | None = None
        # Small while the connection is idle; grows while reads fill it (see buffer_updated).
        self._recv = memoryview(bytearray(RECV_BUFFER_MIN))
        self._recv_direct = False   # the last get_buffer() handed out a direct-placement buffer
        self._tasks: set[asyncio.Task[None]] = set()
        self._h2c: dict[int, _PendingH2C] = {}
        self._next_ttag = 0
        self._port = TcpPort.of(target)
        self._h2c_bytes = 0   # of h2c_budget (and of the port's global budget), held by writes with an R2T
        self._h2c_waiters: deque[tuple[asyncio.Future[None], int]] = deque()   # writes waiting for budget
        self._h2c_queued = False    # in the global budget's queue
        # Set by the TcpListener that accepted us: the caps count us, the deadlines apply.
        self._server: TcpListener | None = None
        self._counted = False
        self._accepted_at = 0.0
        self._deadline: asyncio.TimerHandle | None = None   # ICReq, then Connect; None once connected
        self._closed = False
        self._on_lost = on_lost
        self._write_paused = False
        self._read_paused = False
        # Set while data_received handles one batch of PDUs: what they queue goes out in one write.
        self._batching = False
        # A flush is due at the end of this loop iteration: replies of commands a QoS release let go together
        # (Request.coalesce) wait for it, so they leave in one write (_flush_coalesced).
        self._flush_due = False
        self._linger: asyncio.TimerHandle | None = None   # aborts a graceful close that never finishes
        # NVMe/TCP over TLS (TP 8011): the listener's mode; the first bytes decide (a TLS record starts 0x16)
        self.tls_mode = listener.tls if listener is not None else "none"
        self._first = True
        self._tls: TlsSession | None = None
        # Set by the batch engine once it decrypts this connection's records itself (past the handshake):
        # data_received then gets plaintext (target/transports/tcp_batch.py BatchMixin._tls_take).
        self._tls_plain = False
        # ... and while it takes one socket read's records: what they make the queue send is encrypted as it comes
        # and written once, at the end (_tls_write leaves the ciphertext in the session until then).
        self._tls_defer = False

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
        if self._server is not None and not self._closed:
            self._arm_deadline(self._port.limits.ic_timeout, "ICReq")

    def get_buffer(self, sizehint: int) -> memoryview:
        direct = self.conn.direct_buffer()
        if direct is not None:
            self._recv_direct = True
            return direct
        self._recv_direct = False
        return self._recv

    def buffer_updated(self, nbytes: int) -> None:
        if self._recv_direct:
            self._recv_direct = False
            if not self._closed:
                self._handle(self.conn.direct_received(nbytes))
            return
        self.data_received(self._received(nbytes))

    def _received(self, filled: int) -> memoryview:
        """The ``filled`` bytes at the start of the receive buffer; the next read gets a new buffer when
        this one was too small or is bigger than needed (the batch engine's receive shares this)."""
        buf = self._recv
        size = len(buf)
        if filled == size:
            if size < RECV_BUFFER_MAX:
                # The read filled the buffer, so more is waiting: take it in fewer, larger reads.
                self._recv = memoryview(bytearray(min(size * 4, RECV_BUFFER_MAX)))
        elif size > RECV_BUFFER_MIN and filled < RECV_BUFFER_MIN:
            # The socket is drained and the small buffer would have done: give the big one back, so an
            # idle connection holds RECV_BUFFER_MIN (the events below use the old one, which goes then).
            self._recv = memoryview(bytearray(RECV_BUFFER_MIN))
        return buf[:filled]

    def data_received(self, data: bytes | memoryview) -> None:  # type: ignore[override]
        if self._closed:
            return
        if self._first:
            if not data or not self._tls_gate(data):
                return
        if self._tls is not None and not self._tls_plain:
            self._tls_received(data)
            return
        self._handle(self.conn.receive_data(data))

    # --- TLS (target/tls.py picks the PSK) ------------------------------------------------------

    def _tls_gate(self, data: bytes | memoryview) -> bool:
        """The connection's first bytes: TLS or clear, against the listener's mode (nvmet_tcp_try_peek_pdu).

        False when the connection was refused (one log line says why)."""
        self._first = False
        tls = looks_like_tls(data)
        peer = self.queue.peer or "?"
        where = self.listener.id if self.listener is not None else "loop"
        if tls and self.tls_mode == "none":
            self._refuse(f"NVMe/TCP connection from {peer} to {where} starts a TLS handshake, but this listener "
                         "takes no TLS (listener add ... --tls optional|required); closing it")
            return False
        if not tls and self.tls_mode == "required":
            self._refuse(f"NVMe/TCP connection from {peer} to {where} sent clear NVMe/TCP, but this listener "
                         "requires TLS (the host must connect with --tls / a TLS PSK); closing it")
            return False
        if tls:
            try:
                self._tls = TlsSession(server=True, lookup=self._tls_lookup)
            except TlsError as exc:
                self._refuse(f"NVMe/TCP connection from {peer} to {where}: TLS unavailable: {exc}; closing it")
                return False
            self.conn.place = None   # records are decrypted into new buffers: no direct placement
        return True

    def _tls_lookup(self, raw: bytes) -> tuple[bytes, int] | None:
        try:
            identity, psk, cipher = find_psk(self.target.subsystems, raw)
        except PskRefused as exc:
            if self._tls is not None:
                self._tls.lookup_failure = str(exc)
            return None
        self.queue.tls = identity
        return psk, cipher

    def _tls_received(self, data: bytes | memoryview) -> None:
        tls = self._tls
        assert tls is not None
        was_done = tls.handshake_done
        try:
            plain = tls.receive(data)
        except TlsError as exc:
            self._tls_failed(exc, was_done)
            return
        if not was_done and tls.handshake_done:
            log.info("NVMe/TCP TLS from %s: %s %s, PSK identity %s%s", self.queue.peer, tls.version, tls.cipher_name,
                     self.queue.tls, " (the host bound its SHA-384 PSK to a SHA-256 binder, as GnuTLS before 3.8.11 "
                     "does: SHA-256 suite)" if tls.sha256_binder else "", extra=self._fields("tls", "handshake done"))
            if self._deadline is not None:   # the ICReq gets its own window after the handshake
                self._arm_deadline(self._port.limits.ic_timeout, "ICReq")
            self._tls_established()
        if plain:
            self._handle(self.conn.receive_data(plain))
        else:
            self._send_tls()
        if tls.closed and not self._closed:
            self.close()

    def _tls_established(self) -> None:
        """The handshake is done (the batch engine then takes the records itself)."""

    def _tls_failed(self, exc: TlsError, was_done: bool) -> None:
        """The session failed (``was_done``: after its handshake): the alert goes out, the connection closes."""
        assert self._tls is not None
        out = self._tls.data_to_send()   # the alert, if any, tells the host why
        if out and self.transport is not None:
            self.transport.write(out)
        # a version-0 identity that found a PSK and still failed: name the likely cause (target/tls.py)
        hint = "" if was_done else handshake_hint(self.target.subsystems, self.queue.tls, str(exc))
        self._refuse(f"NVMe/TCP TLS handshake with {self.queue.peer or '?'} failed: {exc}; closing it{hint}"
                     if not was_done else f"NVMe/TCP TLS from {self.queue.peer or '?'} failed: {exc}; closing it")

    def _send_tls(self) -> None:
        out = self._tls.data_to_send() if self._tls is not None else b""
        if out and self.transport is not None:
            self.transport.write(out)

    def _tls_write(self, bufs: list[Any]) -> None:
        """Plaintext PDUs out through the session: encrypted together (records of up to 16 KiB each, not one
        per PDU) and written in one go (at the end of the batch engine's wake-up while _tls_defer is set)."""
        assert self._tls is not None
        if bufs:
            self._tls.send(b"".join(bufs) if len(bufs) > 1 else bufs[0])
        if not self._tls_defer:
            self._send_tls()

    def _refuse(self, text: str) -> None:
        log.warning(text, extra=self._fields("failure", text))
        self.close()

    def _handle(self, events: list[Any]) -> None:
        # Inside a wider batch (the batch engine's wake-up, tcp_batch._receive) its end does the one write.
        outer = self._batching
        self._batching = True
        try:
            for event in events:
                kind = type(event)
                if kind is CommandReceived:
                    self._on_command(event)
                elif kind is H2CDataReceived:
                    self._on_h2c_data(event)
                elif kind is ICReqReceived:
                    self.conn.send_icresp(maxh2cdata=defaults.MAXH2CDATA)
                    self.queue.hdgst, self.queue.ddgst = self.conn.hdgst, self.conn.ddgst   # shown by Controller.info
                    if self._deadline is not None:
                        self._arm_deadline(self._port.limits.connect_timeout, "Connect")
                elif kind is ProtocolError:
                    log.warning("NVMe/TCP protocol error from %s (fes %#x, fei %d): %s; sending C2HTermReq and closing",
                                self.queue.peer, event.fes, event.fei, event.reason, extra=self._fields(
                                    "failure", f"protocol error: {event.reason}"))
                    self.close()
                    return
                elif kind is TermReqReceived:
                    log.warning("host %s terminated the connection (H2CTermReq fes %#x fei %d)",
                                self.queue.peer, event.fes, event.fei, extra=self._fields(
                                    "failure", f"H2CTermReq fes {event.fes:#x}"))
                    self.close()
                    return
                if self._closed:
                    return   # a command tore the connection down; close() flushed what it queued
        finally:
            if not self._closed:
                self._batching = outer
        if self._deadline is not None and self.queue.ctrl is not None:
            self._connected()
        if not outer:
            self._flush()

    def eof_received(self) -> bool:
        return False   # let the transport close; connection_lost cleans up

    # --- port limits ----------------------------------------------------------------------------

    def _arm_deadline(self, seconds: float, what: str) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = asyncio.get_running_loop().call_later(seconds, self._deadline_passed, what, seconds)

    def _deadline_passed(self, what: str, seconds: float) -> None:
        self._deadline = None
        if self._closed:
            return
        if self.queue.ctrl is not None:
            self._connected()   # a Connect that completed outside a receive batch
            return
        port = self._port
        if what == "ICReq" and self._tls is not None and not self._tls.handshake_done:
            port.log_icreq_timeout(f"NVMe/TCP connection from {self.queue.peer or '?'} did not complete its TLS "
                                   f"handshake within {seconds:g} s of connecting; closing it (--ic-timeout SECONDS "
                                   "sets the limit)")
            self.close()
            return
        if what == "ICReq":
            since, option, say = "connecting", "--ic-timeout", port.log_icreq_timeout
        else:
            since, option, say = "our ICResp", "--connect-timeout", port.log_connect_timeout
        say(f"NVMe/TCP connection from {self.queue.peer or '?'} sent no {what} within "
                               f"{seconds:g} s of {since}; closing it ({option} SECONDS sets the limit)")
        self.close()

    def _connected(self) -> None:
        """The queue's Connect succeeded: no deadline any more, and no cap may close it to make room."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._forget_unconnected()

    def _forget_unconnected(self) -> None:
        server = self._server
        if server is not None:
            server.unconnected.pop(self, None)
            self._port.unconnected.pop(self, None)

    def release_slot(self) -> None:
        """The connection's socket is gone: it no longer counts against the caps."""
        release = self.detach_slot()
        if release is not None:
            release()

    def detach_slot(self) -> Any:
        """Hand the cap accounting to whoever keeps the socket (a worker process): returns the
        callable that ends it, or None when this connection is not counted."""
        if not self._counted or self._server is None:
            return None
        self._counted = False
        return self._server.release

    def connection_lost(self, exc: Exception | None) -> None:
        self.release_slot()
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
        self._break_cycles()

    def _break_cycles(self) -> None:
        # The sans-IO ``place`` hook and the queue's ``close`` are bound methods of this protocol: left
        # in place, a closed connection (and its buffers) would wait for the cyclic GC instead of
        # going when its last reference does. A queue handed to a worker has another ``close``.
        self.conn.place = None
        if getattr(self.queue.close, "__self__", None) is self:
            self.queue.close = _queue_gone

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

    def _fields(self, event: str, reason: str) -> dict[str, object]:
        """Structured fields of a log line about this connection (`--log-format json`)."""
        queue = self.queue
        fields: dict[str, object] = {"event": event, "peer": queue.peer, "qid": queue.qid, "reason": reason}
        if queue.ctrl is not None:
            fields.update(host=queue.ctrl.hostnqn, subnqn=queue.ctrl.subsystem.nqn, cntlid=queue.ctrl.cntlid)
        return fields

    def close(self) -> None:
        """Close the connection (after flushing what is queued) and fail everything in flight."""
        if self._closed:
            return
        self._batching = False
        self._tls_defer = False
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
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._forget_unconnected()
        for pending in self._h2c.values():
            if not pending.future.done():
                pending.future.cancel()
        self._h2c.clear()
        for fut, _ in self._h2c_waiters:
            fut.cancel()
        self._h2c_waiters.clear()
        self._port.h2c.forget(self)   # what its running writes hold comes back as their tasks end
        for task in list(self._tasks):
            task.cancel()
        self.target.queue_closed(self.queue)

    def _flush(self) -> None:
        if self._batching:
            return   # data_received writes everything the batch queued at its end
        out = self.conn.data_to_send()
        if self._tls is not None:
            self._tls_write(out)
            return
        if out and self.transport is not None:
            self.transport.writelines(out)

    # --- commands -------------------------------------------------------------------------------

    def _on_command(self, event: CommandReceived) -> None:
        req = TcpRequest(self.queue, Command.from_bytes(event.sqe))
        # The event's views die at the next receive_data: keep a copy of in-capsule data.
        req.incapsule = bytes(event.data) if event.data is not None else None
        req.digest_ok = event.digest_ok
        # Digest connections run every command here: the replies of I/O commands that complete later in one
        # loop iteration (woken together: a backend, a QoS release) leave in one write too (_flush_soon). Not
        # a Connect (ctrl still None): its reply takes _send_cqe, where PoolConnection starts the hand-off.
        conn = self.conn
        req.coalesce = (conn.hdgst or conn.ddgst) and self.queue.ctrl is not None
        task = start_command(self.target, self, req)
        if task is None:
            return   # completed without waiting: no Task
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        if len(self._tasks) >= MAX_INFLIGHT:
            self._update_reading()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._read_paused:
            self._update_reading()

    # --- TransportQueue: what the command lifecycle asks of this queue --------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def fetch_data(self, req: TcpRequest) -> Awaitable[None] | None:
        """In-capsule data is checked and taken; a larger write gets its R2T (nvmet_tcp_map_data)."""
        data = req.incapsule
        if req.direction == Direction.H2C:
            if req.cmd.sgl_id == SGL_ID_INCAPSULE or data is not None:
                req.data = self._incapsule_data(req, data, req.digest_ok)
                return None
            return self._fetch_r2t(req)
        if data is not None:
            raise NvmeError(Status.INVALID_FIELD, f"{len(data)} bytes of in-capsule data for a command that takes none")
        return None

    async def _fetch_r2t(self, req: Request) -> None:
        await self._reserve_h2c(req.data_len)
        try:
            req.data = await self._r2t_data(req)
        except BaseException:
            self._release_h2c(req.data_len)
            raise

    def release(self, req: Request) -> None:
        self._release_h2c(req.data_len)   # the write is done with its buffer

    def queue_response(self, req: Request, cqe: bytes, data: bytes | bytearray | memoryview | None) -> None:
        if data is not None:
            if req.queue.sqflow_disabled and not req.dw0 and not req.dw1:
                # The SUCCESS flag stands in for the CapsuleResp (nvmet/SPDK do this only without SQ flow control)
                self.conn.send_c2h_data(req.cmd.cid, 0, data, last=True, success=True)
                if req.coalesce:
                    self._flush_soon()
                else:
                    self._flush()
                return
            self.conn.send_c2h_data(req.cmd.cid, 0, data, last=True, success=False)
        if req.coalesce and not self._closed:
            self.conn.send_response(cqe)
            self._flush_soon()
            return
        self._send_cqe(cqe)

    def _send_cqe(self, cqe: bytes) -> None:
        if self._closed:
            return
        self.conn.send_response(cqe)
        self._flush()

    def _flush_soon(self) -> None:
        """A reply of a command a QoS release let go with others, which all run in this loop iteration: one
        write at its end carries all their replies (the Tasks the release woke were queued before this
        call_soon, so they run first)."""
        if self._batching or self._flush_due:
            return   # the batch's own flush, or the one already due, takes it along
        self._flush_due = True
        asyncio.get_running_loop().call_soon(self._flush_coalesced)

    def _flush_coalesced(self) -> None:
        self._flush_due = False
        if not self._closed:
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
        """Take ``nbytes`` of this connection's H2C budget, after every write of it that asked before
        (FIFO: none starves), and of the global one, in turn with the other connections waiting for it."""
        budget = self._port.h2c
        if not self._h2c_waiters and self._h2c_fits(nbytes) and not budget.queue and budget.fits(nbytes):
            self._h2c_bytes += nbytes
            budget.used += nbytes
            return
        waiter = (asyncio.get_running_loop().create_future(), nbytes)
        self._h2c_waiters.append(waiter)
        self._h2c_pump()
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
        self._port.h2c.release(nbytes)   # other connections waiting for the global budget first
        self._h2c_pump()

    def _h2c_next(self) -> int | None:
        """What the first waiting write asks for, when only the global budget can hold it back."""
        if self._closed:
            return None
        waiters = self._h2c_waiters
        while waiters and waiters[0][0].done():   # cancelled while waiting: its coroutine will not find it
            waiters.popleft()
        if not waiters:
            return None
        want = waiters[0][1]
        return want if self._h2c_fits(want) else None

    def _h2c_grant(self) -> None:
        fut, want = self._h2c_waiters.popleft()
        self._h2c_bytes += want
        self._port.h2c.used += want
        fut.set_result(None)

    def _h2c_pump(self) -> None:
        """Grant waiting writes while both budgets allow; queue at the global one when it does not."""
        budget = self._port.h2c
        while (want := self._h2c_next()) is not None:
            if self._h2c_queued or budget.queue or not budget.fits(want):
                budget.wait(self)
                return
            self._h2c_grant()

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

    def _place(self, cccid: int, ttag: int, datao: int, datal: int) -> memoryview | None:
        """Where a large H2CData payload goes (nvmeof.tcp direct placement): its part of the write's
        buffer, after the sans-IO connection checked the PDU against our R2T."""
        pending = self._h2c.get(ttag)
        if pending is None or datao != pending.received:
            return None
        if pending.buf is None:
            pending.buf = bytearray(pending.req.data_len)
        return memoryview(pending.buf)[datao:datao + datal]

    def _on_h2c_data(self, event: H2CDataReceived) -> None:
        # The sans-IO connection checked this PDU against the R2T we sent (ttag, cccid, offset, length)
        # before parsing on: an event is only made for data that fits the next part of a live R2T,
        # whose ttag stays in _h2c until the command's finally drops both entries together.
        pending = self._h2c[event.ttag]
        req = pending.req
        end = pending.received + len(event.data)
        if not event.placed:
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


class _Refused(asyncio.Protocol):
    """A connection past a cap: closed as soon as it is made, with one (rate-limited) log line."""

    def __init__(self, server: TcpListener, why: str) -> None:
        self.server = server
        self.why = why

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = _format_peer(transport.get_extra_info("peername"))
        transport.abort()   # nothing to flush: the fd goes at once
        server = self.server
        server.port_state.log_refused(f"NVMe/TCP listener {server.listener.id}: refused a connection from "
                                      f"{peer or '?'}: {self.why} ({server.refused} refused on it so far)")


class TcpListener:
    """Accepts NVMe/TCP connections on one listener address, within the port's caps."""

    connection_class: type[TargetConnection] = TargetConnection

    def __init__(self, target: TransportHost, listener: Listener) -> None:
        self.target = target
        self.listener = listener
        self.connections: set[TargetConnection] = set()
        self.port_state = TcpPort.of(target)
        self.open = 0        # connections counted against the per-listener cap (handed-off ones too)
        self.refused = 0
        self.evicted = 0
        # This listener's connections that have not completed Connect, oldest first.
        self.unconnected: dict[TargetConnection, None] = {}
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        if self._server is None or not self._server.sockets:
            return self.listener.trsvcid
        return int(self._server.sockets[0].getsockname()[1])

    def _factory(self) -> asyncio.BaseProtocol:
        why = self._make_room()
        if why is not None:
            self.refused += 1
            return _Refused(self, why)
        conn = self.connection_class(self.target, self.listener, on_lost=self.connections.discard)
        port = self.port_state
        conn._server = self
        conn._counted = True
        conn._accepted_at = time.monotonic()
        self.open += 1
        port.opened()
        self.unconnected[conn] = None
        port.unconnected[conn] = None
        self.connections.add(conn)
        return conn

    def release(self) -> None:
        """One counted connection's socket is gone (here, or in the worker it was handed to)."""
        self.open -= 1
        self.port_state.closed()

    def _make_room(self) -> str | None:
        """None if a new connection may come in (closing the oldest unconnected one at a cap, if any);
        else why not."""
        port = self.port_state
        limits = port.limits
        cap = limits.max_connections_per_listener
        if self.open >= cap and not self._evict(self.unconnected, f"its cap of {cap} connections"):
            return (f"it holds {self.open} connections that all completed Connect, its cap "
                    f"(--max-connections-per-listener {cap})")
        cap = port.max_total
        if port.open >= cap:
            what = f"the cap of {cap} NVMe/TCP connections in all"
            if not self._evict(port.unconnected, what):
                lowered = "" if cap == limits.max_connections else \
                    f", lowered from {limits.max_connections} by RLIMIT_NOFILE"
                return (f"{port.open} connections that all completed Connect are open across all listeners, "
                        f"the cap (--max-connections {limits.max_connections}{lowered})")
        return None

    def _evict(self, candidates: dict[TargetConnection, None], what: str) -> bool:
        victim = next(iter(candidates), None)
        if victim is None:
            return False
        victim._forget_unconnected()
        victim.release_slot()   # its fd goes with the abort below: count the new connection in its place
        self.evicted += 1
        age = time.monotonic() - victim._accepted_at
        self.port_state.log_evicted(
            f"NVMe/TCP listener {self.listener.id} reached {what}: closing the oldest connection that has not "
            f"completed Connect ({victim.queue.peer or '?'}, {age:.1f} s old) to admit a new one")
        victim.abort()
        return True

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.port_state.check_fds()
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
