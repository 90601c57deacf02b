"""The control channel between `nvmeof serve` and one of its worker processes.

One AF_UNIX SOCK_SEQPACKET socket pair per worker: each message is one JSON object in one packet
(message boundaries come free), and descriptors (a handed-off TCP socket, a RAM disk's memfd) ride
along with SCM_RIGHTS. Sending never blocks the event loop: what the socket does not take at once
waits in a queue drained by a writer callback.

Main -> worker: ``ns`` (add or update one namespace, a RAM disk's memfd attached when new),
``ns_del``, ``queue`` (an I/O queue whose Connect the main process accepted, its socket attached),
``drop`` (tear a queue down), ``ctrl`` (a controller's CC.EN/CSTS.RDY state), ``exit``.
Worker -> main: ``ready``, ``ack`` (namespace changes applied up to ``seq``), ``closed`` (a queue
ended on the worker's side), ``report`` (keep-alive activity, namespace statistics, error log
entries), ``ns_error`` (a namespace the worker could not open).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 16
MAX_FDS = 4

Handler = Callable[[dict[str, Any], list[int]], None]


def socket_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class Channel:
    """Message framing over one end of the socket pair, driven by the running event loop."""

    def __init__(self, sock: socket.socket, on_message: Handler, on_lost: Callable[[], None]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._on_message = on_message
        self._on_lost = on_lost
        # (packet, descriptors, close the descriptors once sent)
        self._out: collections.deque[tuple[bytes, list[int], bool]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writing = False
        self.closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.fileno(), self._readable)

    def send(self, msg: dict[str, Any], fds: Sequence[int] = (), *, close_fds: bool = False) -> None:
        """Queue one message; with ``close_fds`` the descriptors are closed once the kernel has them."""
        if self.closed:
            if close_fds:
                for fd in fds:
                    os.close(fd)
            return
        packet = json.dumps(msg, separators=(",", ":")).encode()
        if len(packet) > MAX_MESSAGE:
            raise ValueError(f"control message {msg.get('op')!r} is {len(packet)} bytes; the limit is {MAX_MESSAGE}")
        self._out.append((packet, list(fds), close_fds))
        if not self._writing:
            self._drain()

    def _drain(self) -> None:
        while self._out:
            packet, fds, close_fds = self._out[0]
            try:
                if fds:
                    socket.send_fds(self.sock, [packet], fds)
                else:
                    self.sock.send(packet)
            except (BlockingIOError, InterruptedError):
                if not self._writing and self._loop is not None:
                    self._writing = True
                    self._loop.add_writer(self.sock.fileno(), self._drain)
                return
            except OSError:
                self._lost()
                return
            self._out.popleft()
            if close_fds:
                for fd in fds:
                    os.close(fd)
        if self._writing and self._loop is not None:
            self._writing = False
            self._loop.remove_writer(self.sock.fileno())

    def _readable(self) -> None:
        while not self.closed:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, MAX_FDS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._lost()
                return
            if not data:
                for fd in fds:
                    os.close(fd)
                self._lost()
                return
            try:
                msg = json.loads(data)
            except ValueError:
                log.error("control channel: dropped a message that is not JSON: %r", data[:80])
                for fd in fds:
                    os.close(fd)
                continue
            try:
                self._on_message(msg, fds)
            except Exception:
                log.exception("control channel: handling %r failed", msg.get("op"))

    def _lost(self) -> None:
        if self.closed:
            return
        self.close()
        self._on_lost()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
            if self._writing:
                self._loop.remove_writer(self.sock.fileno())
        while self._out:
            _packet, fds, close_fds = self._out.popleft()
            if close_fds:
                for fd in fds:
                    os.close(fd)
        self.sock.close()
