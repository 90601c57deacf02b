"""What the core knows of a transport: its ops table (`TransportOps`) and what it asks of the connection
serving one queue (`TransportQueue`).

Mirrors Linux ``struct nvmet_fabrics_ops`` (``type``, ``NVMF_KEYED_SGLS``, ``queue_response``) and SPDK
``spdk_nvmf_transport_ops``. A `TargetQueue` carries its transport's `TransportOps`: constants only, so
``check_sgl`` and Identify ask them instead of comparing names, and a queue never keeps its connection
alive (a queue handed to a worker outlives its first connection). The connection implements
`TransportQueue`, which the per-command lifecycle (target/lifecycle.py) drives: parse, ``fetch_data``,
execute, ``queue_response``. A new transport (TLS-wrapped TCP, another TCP engine) is one ops value,
one connection class and one registry entry (target/transports/__init__.py); the core does not change.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from nvmeof.spec.nvme import SGL_ID_KEYED, SGL_ID_KEYED_INVALIDATE, SGL_ID_TRANSPORT

if TYPE_CHECKING:
    from target.request import Request, TargetQueue

_KEYED = frozenset({SGL_ID_KEYED, SGL_ID_KEYED_INVALIDATE})
_SGL_NAMES = {SGL_ID_TRANSPORT: "transport (0x5A)", SGL_ID_KEYED: "keyed (0x40/0x4F)",
              SGL_ID_KEYED_INVALIDATE: "keyed (0x40/0x4F)"}


@dataclass(frozen=True, slots=True)
class TransportOps:
    """One transport's constants (one value per transport, like nvmet_tcp_ops / nvmet_rdma_ops)."""

    trtype: str                # the listener's trtype; controllers_info's "transport" ("tcp", "rdma", "loop")
    name: str                  # how refusals name it ("NVMe/TCP")
    nvme_trtype: int           # TRTYPE in Error Information log entries (nvmeof.spec.fabrics.TrType; 0: none)
    sgl_types: frozenset[int]  # data descriptors accepted besides in-capsule (0x01): 0x5A, or keyed 0x40/0x4F
    admin_incapsule: int       # in-capsule bytes check_sgl accepts on admin queues and for Connect
    io_incapsule: int          # ... on I/O queues; Identify's IOCCSZ is (64 + this) / 16

    @property
    def keyed_sgls(self) -> bool:
        """Keyed SGL data block descriptors (Identify SGLS bit 2; nvmet's NVMF_KEYED_SGLS)."""
        return not self.sgl_types.isdisjoint(_KEYED)

    def sgl_choices(self, *, incapsule: bool = True) -> str:
        """The descriptors a command may carry, as refusals spell them."""
        names = sorted({_SGL_NAMES.get(t, f"{t:#04x}") for t in self.sgl_types})
        return " or ".join(["in-capsule (0x01)", *names] if incapsule else names)


class TransportQueue(Protocol):
    """The connection serving one queue, as the command lifecycle drives it.

    Both methods return None when they are done at once and an awaitable otherwise, so a command that
    never waits (in-capsule data, a RAM disk, admin commands) runs without a Task (lifecycle.start_command).
    """

    ops: TransportOps
    queue: TargetQueue
    # Run each command's coroutine inline first and make a Task only if it suspends; False: a Task per command.
    eager: bool

    @property
    def closed(self) -> bool:
        """The queue is torn down: nothing more is sent for its commands."""
        ...

    def fetch_data(self, req: Request) -> Awaitable[None] | None:
        """After parse: check the data descriptor against what the command moves and, for host-to-controller
        data, put it in ``req.data`` (in-capsule; R2T + H2CData; RDMA READ). Raises NvmeError to fail it."""
        ...

    def release(self, req: Request) -> None:
        """The command is done with the data an awaited ``fetch_data`` holds (a buffer, an R2T budget)."""
        ...

    def queue_response(self, req: Request, cqe: bytes, data: bytes | bytearray | memoryview | None
                       ) -> Awaitable[None] | None:
        """Send ``data`` (controller-to-host, exactly ``req.data_len`` bytes; None on failure) and the CQE."""
        ...
