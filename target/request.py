"""One command in flight (`Request`) and the transport-agnostic state of one queue (`TargetQueue`).

Modelled on Linux nvmet's ``struct nvmet_req`` / ``struct nvmet_sq``: parse sets what a command moves
and what executes it; completing a request never names a transport. The transport owns the bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nvmeof import defaults
from nvmeof.spec.fabrics import SQHD_DISABLED
from nvmeof.spec.nvme import Command, pack_cqe
from nvmeof.status import encode_status

if TYPE_CHECKING:
    from target.controller import Controller
    from target.model import Listener, Namespace


class Direction(enum.IntEnum):
    NONE = 0
    H2C = 1   # host to controller: the command carries data (Write, Connect, Set Features ...)
    C2H = 2   # controller to host: the command returns data (Read, Identify, Get Log Page ...)


class TargetQueue:
    """A submission/completion queue pair on the target, bound to a controller by Connect."""

    __slots__ = ("close", "connected_at", "ctrl", "listener", "local_addr", "peer", "qid", "sqflow_disabled",
                 "sqhd", "sqsize", "transport")

    def __init__(self, *, peer: str = "", transport: str = "tcp", listener: Listener | None = None,
                 local_addr: str = "", close: Callable[[], None] | None = None) -> None:
        self.qid = 0
        self.ctrl: Controller | None = None
        self.sqsize = 0           # 0-based, as Connect carries it
        self.sqhd = 0
        self.sqflow_disabled = False
        self.peer = peer
        self.transport = transport
        self.listener = listener
        self.local_addr = local_addr  # our IP address on this connection (fills wildcard listeners' entries)
        self.connected_at = 0.0   # wall-clock time of the Connect that bound this queue
        self.close: Callable[[], None] = close or _no_close

    @property
    def max_incapsule(self) -> int:
        """In-capsule data this queue accepts: 8 KiB on admin queues and for Connect (NVME_TCP_ADMIN_CCSZ)."""
        if self.ctrl is None or self.qid == 0:
            return defaults.ADMIN_INCAPSULE_SIZE
        return defaults.IO_INCAPSULE_SIZE

    def complete(self, req: Request, status: int = 0, dw0: int = 0, dw1: int = 0, dnr: bool = False) -> bytes:
        """The 16-byte CQE for ``req``; advances SQHD (nvmet_update_sq_head) unless flow control is off."""
        if self.sqflow_disabled:
            sqhd = SQHD_DISABLED
        else:
            if self.sqsize:
                self.sqhd = (self.sqhd + 1) % (self.sqsize + 1)
            else:
                self.sqhd = (self.sqhd + 1) & 0xFFFF
            sqhd = self.sqhd
        return pack_cqe(req.cmd.cid, encode_status(status, dnr=dnr), dw0 & 0xFFFFFFFF, dw1 & 0xFFFFFFFF,
                        sqhd, self.qid)


def _no_close() -> None:
    return None


Execute = Callable[["Request"], Awaitable[None]]


class Request:
    """One command: what parse decided, the payloads, and the result dwords."""

    __slots__ = ("cmd", "data", "data_len", "direction", "dw0", "dw1", "execute", "ns", "queue", "reply",
                 "start_ns")

    def __init__(self, queue: TargetQueue, cmd: Command) -> None:
        self.queue = queue
        self.cmd = cmd
        self.data: memoryview | None = None
        self.data_len = 0
        self.direction = Direction.NONE
        self.execute: Execute | None = None
        self.reply: bytes | bytearray | memoryview | None = None
        self.dw0 = 0
        self.dw1 = 0
        self.ns: Namespace | None = None
        self.start_ns = 0

    def expect(self, direction: Direction, length: int, execute: Execute) -> None:
        """Called by parse: the command moves ``length`` bytes in ``direction`` and runs ``execute``."""
        self.direction = direction if length else Direction.NONE
        self.data_len = length
        self.execute = execute

    def reply_payload(self) -> bytes | bytearray | memoryview:
        """The controller-to-host data to send: ``reply`` cut or zero-padded to exactly ``data_len``."""
        reply = self.reply if self.reply is not None else b""
        if len(reply) != self.data_len:
            reply = bytes(reply[:self.data_len]).ljust(self.data_len, b"\x00")
        return reply

    def __repr__(self) -> str:
        return f"Request(qid={self.queue.qid}, {self.cmd!r}, {self.direction.name}, data_len={self.data_len})"
