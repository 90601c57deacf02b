"""What the target's modules ask of the Target that runs them, each as a small Protocol.

target.core.Target (and PooledTarget / WorkerTarget, which build on it) satisfies all of them; the
modules below it (the command sets, the controller, the transports, reservations) name one of these
instead of importing target.core, so no import of theirs, TYPE_CHECKING ones included, leads back up
to the class that imports them (tests/test_layers.py checks it).

A leaf: it imports nothing from target but the model. Where a member carries another module's object
(a Controller, a Request, a TargetQueue, a PrStore, a ListenerServer), its type is written ``Any``
with the class named in a comment, since importing that module here would close the circle again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from nvmeof.status import NvmeError
    from target.model import Listener, Referral, Subsystem


class CommandRouter(Protocol):
    """target/lifecycle.py: where a command is parsed and completed (``req``: a target.request.Request)."""

    def parse(self, req: Any) -> None: ...
    def complete(self, req: Any) -> bytes: ...
    def fail(self, req: Any, err: NvmeError) -> bytes: ...


class TransportHost(CommandRouter, Protocol):
    """A transport's listener and its connections (target/transports/)."""

    controllers: Mapping[int, Any]       # cntlid -> target.controller.Controller
    # what a transport keeps per Target across its listeners, by trtype (TcpPort.of: limits, caps, budget)
    transport_state: dict[str, Any]
    subsystems: Mapping[str, Subsystem]  # NVMe/TCP TLS finds a connection's PSK here (target/tls.py)

    def queue_closed(self, queue: Any) -> None: ...   # a target.request.TargetQueue whose connection ended


class ReservationHost(Protocol):
    """target/pr.py: where reservation states are kept and who is told of a change."""

    controllers: Mapping[int, Any]       # cntlid -> target.controller.Controller
    pr_store: Any                        # a target.pr.PrStore, or None: states live in RAM only
    reservations_supported: bool


class ControllerHost(ReservationHost, Protocol):
    """What a Controller keeps as ``target``: read by the admin, discovery, auth and reservation commands."""

    subsystems: Mapping[str, Subsystem]
    listeners: Mapping[str, Listener]
    referrals: list[Referral]
    peer_listeners: list[Listener]       # a gateway group's other members' I/O listeners
    genctr: int                          # Discovery Log Page generation counter
    started: float                       # time.time() at start (SMART power-on hours)
    ana_chgcnt: int
    ana_group_chgcnt: Mapping[int, int]
    auth_timeout: float

    def listening_port(self, listener: Listener) -> int: ...   # its trsvcid, or the one bound for 0
    def remove_controller(self, ctrl: Any, reason: str) -> None: ...


class ControllerRegistry(ControllerHost, Protocol):
    """target/fabrics.py: Connect finds the subsystem and makes or joins a controller; a queue's end is reported."""

    def find_subsystem(self, nqn: str) -> Subsystem | None: ...
    def create_controller(self, subsystem: Subsystem, hostnqn: str, hostid: bytes, kato_ms: int) -> Any: ...
    def queue_closed(self, queue: Any) -> None: ...


class SubsystemTable(ReservationHost, Protocol):
    """A gateway group's reservation store (target/gateway/prstore.py): the namespaces whose states it applies."""

    subsystems: Mapping[str, Subsystem]
