"""An in-memory transport pair: the host side speaks real NVMe/TCP PDUs to a Target without sockets.

Each end is an ``asyncio.Transport``; ``write`` hands a copy of the bytes to the peer protocol on the
next loop iteration (``loop.call_soon``), so ordering, pause/resume and close behave like a socket's.
The target end is the TCP listener's protocol with its own ops (`LOOP_OPS`: trtype "loop", no
TRTYPE in error log entries): just another transport to the core.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

from target.transports.tcp import TCP_OPS, TargetConnection

_ports = itertools.count(49152)

LOOP_OPS = dataclasses.replace(TCP_OPS, trtype="loop", nvme_trtype=0)


class LoopConnection(TargetConnection):
    """The target end of an in-memory connection: NVMe/TCP PDUs, reported as trtype "loop"."""

    ops = LOOP_OPS


class LoopTransport(asyncio.Transport):
    """One end of an in-memory byte pipe."""

    def __init__(self, loop: asyncio.AbstractEventLoop, peername: tuple[str, int], sockname: tuple[str, int]) -> None:
        super().__init__()
        self._loop = loop
        self._extra = {"peername": peername, "sockname": sockname}
        self._peer: LoopTransport | None = None
        self._protocol: asyncio.BaseProtocol | None = None
        self._closing = False
        self._lost = False
        self._reading = True
        self._backlog: collections.deque[bytes] = collections.deque()

    # --- BaseTransport ----------------------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Deliver what was written, then close both ends (like a FIN after the send buffer drains)."""
        if self._closing:
            return
        self._closing = True
        self._loop.call_soon(self._shutdown)

    def abort(self) -> None:
        """Close at once; data written but not yet delivered is dropped."""
        self._closing = True
        self._shutdown()

    def _shutdown(self) -> None:
        self._lost_now()
        peer = self._peer
        if peer is not None:
            peer._closing = True
            peer._lost_now()

    def _lost_now(self) -> None:
        if self._lost:
            return
        self._lost = True
        self._backlog.clear()
        if self._protocol is not None:
            self._loop.call_soon(self._protocol.connection_lost, None)

    # --- ReadTransport ------------------------------------------------------------------------------

    def is_reading(self) -> bool:
        return self._reading and not self._lost

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        if self._reading or self._lost:
            return
        self._reading = True
        while self._backlog and self._reading and not self._lost:
            self._feed(self._backlog.popleft())

    # --- WriteTransport -----------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._lost or not data:
            return
        peer = self._peer
        if peer is not None:
            self._loop.call_soon(peer._deliver, bytes(data))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))

    def write_eof(self) -> None:
        self.close()

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (0, 0)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        return None

    # --- delivery -----------------------------------------------------------------------------------

    def _deliver(self, data: bytes) -> None:
        if self._lost:
            return
        if not self._reading or self._backlog:
            self._backlog.append(data)
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        protocol = self._protocol
        if isinstance(protocol, asyncio.BufferedProtocol):
            view = memoryview(data)
            while view and not self._lost:
                buf = protocol.get_buffer(len(view))
                n = min(len(buf), len(view))
                if n == 0:
                    raise RuntimeError("get_buffer() returned an empty buffer")
                buf[:n] = view[:n]
                protocol.buffer_updated(n)
                view = view[n:]
        elif isinstance(protocol, asyncio.Protocol):
            protocol.data_received(data)


def transport_pair(loop: asyncio.AbstractEventLoop) -> tuple[LoopTransport, LoopTransport]:
    """Two connected ends: (host end, target end)."""
    port = next(_ports)
    host = LoopTransport(loop, peername=("loop", 4420), sockname=("loop", port))
    tgt = LoopTransport(loop, peername=("loop", port), sockname=("loop", 4420))
    host._peer, tgt._peer = tgt, host
    return host, tgt


async def create_loop_connection(target: Any, protocol_factory: Callable[[], asyncio.BaseProtocol], *,
                                 listener: Any = None) -> tuple[LoopTransport, asyncio.BaseProtocol]:
    """The in-memory twin of ``loop.create_connection`` to ``target`` (a target.core.Target); ``listener``:
    the target.model.Listener the connection counts as accepted by (its in-capsule size, its ANA states)."""
    loop = asyncio.get_running_loop()
    host_end, target_end = transport_pair(loop)
    target_protocol = LoopConnection(target, listener)
    target_end.set_protocol(target_protocol)
    target_protocol.connection_made(target_end)
    protocol = protocol_factory()
    host_end.set_protocol(protocol)
    protocol.connection_made(host_end)
    return host_end, protocol
