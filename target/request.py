"""One command in flight (`Request`) and the transport-agnostic state of one queue (`TargetQueue`).

Modelled on Linux nvmet's ``struct nvmet_req`` / ``struct nvmet_sq``: parse sets what a command moves
and what executes it; completing a request never names a transport. The transport owns the bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nvmeof.spec.fabrics import SQHD_DISABLED
from nvmeof.spec.nvme import Command, Direction, pack_cqe
from nvmeof.status import encode_status

if TYPE_CHECKING:
    from nvmeof.tls.psk import PskIdentity
    from target.auth import QueueAuth
    from target.controller import Controller
    from target.model import Listener, Namespace
    from target.transport_ops import TransportOps


class TargetQueue:
    """A submission/completion queue pair on the target, bound to a controller by Connect."""

    __slots__ = ("auth", "close", "connected_at", "ctrl", "ddgst", "hdgst", "io_incapsule", "listener", "local_addr",
                 "ops", "peer", "qid", "sqflow_disabled", "sqhd", "sqsize", "tls")

    def __init__(self, *, ops: TransportOps, peer: str = "", listener: Listener | None = None,
                 local_addr: str = "", close: Callable[[], None] | None = None) -> None:
        self.qid = 0
        self.ctrl: Controller | None = None
        self.sqsize = 0           # 0-based, as Connect carries it
        self.sqhd = 0
        self.sqflow_disabled = False
        self.peer = peer
        self.ops = ops            # the transport's constants: check_sgl and Identify ask these
        self.listener = listener
        # In-capsule data an I/O queue through this listener accepts and Identify's IOCCSZ advertises: the
        # listener's inline_data_size (nvmet reads req->port's), the transport's without one (loop); a worker
        # process's queue has no listener and is told it with the handoff
        self.io_incapsule = ops.io_incapsule if listener is None else listener.inline_data_size
        self.local_addr = local_addr  # our IP address on this connection (fills wildcard listeners' entries)
        self.connected_at = 0.0   # wall-clock time of the Connect that bound this queue
        self.auth: QueueAuth | None = None   # DH-HMAC-CHAP state when the host must authenticate (target/auth.py)
        self.hdgst = False        # NVMe/TCP header / data digests (CRC32C) the ICReq/ICResp exchange enabled
        self.ddgst = False
        self.tls: PskIdentity | None = None   # NVMe/TCP over TLS: the PSK identity the handshake proved
        self.close: Callable[[], None] = close or _no_close

    @property
    def trtype(self) -> str:
        """The transport's name: "tcp", "rdma", "loop"."""
        return self.ops.trtype

    @property
    def max_incapsule(self) -> int:
        """In-capsule data this queue accepts: the transport's admin size (8 KiB, NVME_TCP_ADMIN_CCSZ) on
        admin queues and for Connect, its listener's I/O size (IOCCSZ) on I/O queues."""
        if self.ctrl is None or self.qid == 0:
            return self.ops.admin_incapsule
        return self.io_incapsule

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

    __slots__ = ("cmd", "coalesce", "data", "data_len", "direction", "dw0", "dw1", "execute", "ns", "qos_paid", "queue",
                 "reply", "start_ns")

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
        # Its reply may wait for the end of this loop iteration, to leave in one write with the others that
        # finish in it (a QoS release: target/qos.py); a transport that does not batch ignores it.
        self.coalesce = False
        # Its QoS tokens were taken already (a read the batch engine parked at a limit, let go, whose backend
        # then could not answer inline): io.parse's gate lets it through without charging it again.
        self.qos_paid = False

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
