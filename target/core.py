"""The target: subsystems, listeners and controllers, and the per-command routing with its state gates.

Modelled on Linux nvmet core.c ``nvmet_req_init``: before Connect only Connect is legal; Fabrics
commands go to fabrics.py; other admin commands (discovery.py on a discovery controller) and I/O
commands need CC.EN=1 and CSTS.RDY=1; the SGL is checked against what the command moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from nvmeof import defaults
from nvmeof.spec.fabrics import FABRICS_OPCODE
from nvmeof.spec.logs import AnaState
from nvmeof.spec.nvme import SGL_ID_INCAPSULE, SQE_FLAGS_PSDT_MASK, SQE_FLAGS_PSDT_SGL, Direction, FabricsType
from nvmeof.status import NvmeError, Status, describe
from target import admin, auth, discovery, fabrics, io
from target.controller import Controller, host_label
from target.model import Listener, Referral, Subsystem
from target.pr import PrStore
from target.request import Request, TargetQueue
from target.transports import ListenerServer, TransportEntry, TransportRegistry, transports_for

log = logging.getLogger(__name__)

CNTLID_MIN = defaults.CNTLID_MIN
CNTLID_MAX = defaults.CNTLID_MAX   # NVME_CNTLID_MAX: FFF0h..FFFFh are reserved

# Failures hosts provoke while probing (optional CNS, features, log pages): not worth a warning.
_PROBE_STATUSES = frozenset({Status.INVALID_FIELD, Status.INVALID_LOG_PAGE, Status.INVALID_OPCODE})


class Target:
    """Everything the target serves, and the routing of each command to its command set."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 keep_alive_interval: float = 1.0, discovery_serial: str = "discovery",
                 transports: TransportRegistry | Mapping[str, TransportEntry] | None = None,
                 auth_timeout: float = defaults.AUTH_TIMEOUT) -> None:
        self.subsystems: dict[str, Subsystem] = {}
        self.listeners: dict[str, Listener] = {}
        self.referrals: list[Referral] = []
        # A gateway group member's view of the other live members' I/O listeners (set_peer_listeners):
        # its discovery log lists them too, so a host discovering one gateway finds every path.
        self.peer_listeners: list[Listener] = []
        self.discovery_subsystem = Subsystem(nqn=defaults.DISCOVERY_NQN, serial=discovery_serial,
                                             allow_any_host=True, max_namespaces=0, subtype="discovery")
        self.controllers: dict[int, Controller] = {}
        self.genctr = 0
        self.clock = clock
        self.keep_alive_interval = keep_alive_interval
        self.auth_timeout = auth_timeout   # seconds a DH-HMAC-CHAP transaction may stall (target/auth.py)
        self.started = time.time()
        self.cntlid_min = CNTLID_MIN      # controllers get IDs in [cntlid_min, cntlid_max] (set_cntlid_range)
        self.cntlid_max = CNTLID_MAX
        self._next_cntlid = CNTLID_MIN
        # ANA change counts (nvmet_ana_chgcnt): the log header's, bumped on every state or membership
        # change, and each group's, bumped when that group changes
        self.ana_chgcnt = 0
        self.ana_group_chgcnt: dict[int, int] = {}
        # the state of a group no listener names explicitly (set_ana_default); every new listener starts with it
        self.ana_default = AnaState.OPTIMIZED
        # trtype -> listener factory: the standard ones, or what the daemon (or PooledTarget) injects
        self.transports = transports_for(transports)
        self._servers: dict[str, ListenerServer] = {}
        # What a transport keeps per Target across its listeners, by trtype (TcpPort.of: limits, caps, budget)
        self.transport_state: dict[str, Any] = {}
        self._ka_task: asyncio.Task[None] | None = None
        self._closing = False
        # Reservations (target/pr.py): where committed states go (None: RAM only, PTPL not offered; the
        # daemon sets a LocalPrStore, a gateway group its group store), and whether this target serves them
        self.pr_store: PrStore | None = None
        self.reservations_supported = True

    def set_pr_store(self, store: PrStore | None) -> None:
        """Keep reservation states in ``store`` from now on (a gateway group's store once it joined)."""
        self.pr_store = store

    # --- lookups --------------------------------------------------------------------------------

    def find_subsystem(self, nqn: str) -> Subsystem | None:
        if nqn == defaults.DISCOVERY_NQN:
            return self.discovery_subsystem
        return self.subsystems.get(nqn)

    # --- controllers ----------------------------------------------------------------------------

    def set_cntlid_range(self, lo: int, hi: int) -> None:
        """Hand out controller IDs only in [lo, hi] (nvmet subsystems' cntlid_min/cntlid_max): gateways
        of one group serve the same subsystem with disjoint ranges, so a host never sees one CNTLID twice."""
        if not (isinstance(lo, int) and isinstance(hi, int) and CNTLID_MIN <= lo <= hi <= CNTLID_MAX):
            raise ValueError(f"controller ID range {lo!r}-{hi!r} must lie within {CNTLID_MIN}-{CNTLID_MAX:#x} "
                             "with LO <= HI (nvmeof serve --cntlid-range LO-HI)")
        self.cntlid_min, self.cntlid_max = lo, hi
        self._next_cntlid = lo

    def _alloc_cntlid(self) -> int | None:
        lo, hi = self.cntlid_min, self.cntlid_max
        if not lo <= self._next_cntlid <= hi:
            self._next_cntlid = lo
        for _ in range(hi - lo + 1):
            cntlid = self._next_cntlid
            self._next_cntlid = lo if cntlid >= hi else cntlid + 1
            if cntlid not in self.controllers:
                return cntlid
        return None

    def create_controller(self, subsystem: Subsystem, hostnqn: str, hostid: bytes, kato_ms: int) -> Controller:
        cntlid = self._alloc_cntlid()
        if cntlid is None:
            span = self.cntlid_max - self.cntlid_min + 1
            raise NvmeError(Status.CONNECT_CTRL_BUSY,
                            f"all {span} controller IDs of this target's range {self.cntlid_min}-{self.cntlid_max} "
                            "are in use; disconnect idle hosts or widen nvmeof serve --cntlid-range")
        ctrl = Controller(self, subsystem, cntlid, hostnqn, hostid, kato_ms, clock=self.clock)
        self.controllers[cntlid] = ctrl
        self._ensure_keep_alive_task()
        return ctrl

    def remove_controller(self, ctrl: Controller, reason: str) -> None:
        if self.controllers.get(ctrl.cntlid) is ctrl:
            del self.controllers[ctrl.cntlid]
        ctrl.shutdown(reason)

    def queue_closed(self, queue: TargetQueue) -> None:
        """A transport lost a queue: an admin queue takes its controller with it (nvmet does too)."""
        auth.cancel(queue)
        ctrl = queue.ctrl
        if ctrl is None:
            return
        queue.ctrl = None
        if queue.qid == 0:
            self.remove_controller(ctrl, "admin queue connection closed")
        elif ctrl.queues.get(queue.qid) is queue:
            del ctrl.queues[queue.qid]

    def disconnect_controller(self, cntlid: int) -> bool:
        ctrl = self.controllers.get(cntlid)
        if ctrl is None:
            return False
        self.remove_controller(ctrl, "disconnected by the administrator")
        return True

    def _disconnect(self, victims: list[Controller], reason: str) -> int:
        for ctrl in victims:
            log.debug("disconnecting controller %d of subsystem %s (host %s): %s", ctrl.cntlid,
                      ctrl.subsystem.nqn, host_label(ctrl.hostnqn), reason)  # its teardown line says why
            self.remove_controller(ctrl, reason)
        return len(victims)

    def disconnect_subsystem(self, subnqn: str) -> int:
        victims = [c for c in self.controllers.values() if c.subsystem.nqn == subnqn]
        return self._disconnect(victims, f"subsystem {subnqn} was removed or disconnected")

    def disconnect_disallowed(self, subnqn: str) -> int:
        """Access revocation: tear down the controllers of ``subnqn`` whose host its allow-list no longer
        admits (a host was denied, or allow_any_host was turned off). Mirrors SPDK
        spdk_nvmf_subsystem_remove_host, which disconnects that host's controllers; returns how many."""
        victims = [c for c in self.controllers.values()
                   if c.subsystem.nqn == subnqn and not c.subsystem.host_allowed(c.hostnqn)]
        return self._disconnect(victims, f"the host is no longer allowed on subsystem {subnqn}")

    def disconnect_listener(self, listener: Listener) -> int:
        """Before a listener stops: tear down every controller with a queue that came through it
        (SPDK nvmf_stop_listen disconnects the qpairs of that listener; a controller missing a queue
        would be recovered by its host anyway). Returns how many controllers went."""
        victims = [c for c in self.controllers.values()
                   if any(q.listener is listener for q in c.queues.values())]
        return self._disconnect(victims, f"listener {listener.id} was removed")

    def controllers_info(self) -> list[dict[str, Any]]:
        return [ctrl.info() for _, ctrl in sorted(self.controllers.items())]

    # --- keep-alive -----------------------------------------------------------------------------

    def _ensure_keep_alive_task(self) -> None:
        if self._ka_task is None or self._ka_task.done():
            with contextlib.suppress(RuntimeError):
                self._ka_task = asyncio.get_running_loop().create_task(self._keep_alive_loop())

    async def _keep_alive_loop(self) -> None:
        while self.controllers:
            await asyncio.sleep(self.keep_alive_interval)
            self.check_keep_alive()

    def check_keep_alive(self) -> list[int]:
        """Tear down every controller whose host has been silent past KATO; returns their cntlids."""
        now = self.clock()
        expired = [c for c in self.controllers.values() if c.keep_alive_expired(now)]
        for ctrl in expired:
            silent_ms = int((now - ctrl.last_keep_alive) * 1000)
            log.warning("keep-alive timeout: host %s silent for %d ms (KATO %d ms), tearing down controller %d "
                        "of subsystem %s", host_label(ctrl.hostnqn), silent_ms, ctrl.kato_ms, ctrl.cntlid,
                        ctrl.subsystem.nqn, extra={"event": "failure", "host": ctrl.hostnqn,
                                                   "subnqn": ctrl.subsystem.nqn, "cntlid": ctrl.cntlid,
                                                   "reason": f"keep-alive timeout after {silent_ms} ms"})
            self.remove_controller(ctrl, f"keep-alive timeout after {silent_ms} ms")
        return [c.cntlid for c in expired]

    # --- live-change hooks (TargetService calls these) ------------------------------------------

    def namespace_changed(self, subsystem_nqn: str, nsid: int, concerns: Callable[[str], bool] | None = None) -> None:
        """Namespace Attribute Changed (log 04h + AEN) to the subsystem's controllers, or, with masking, only
        to those whose host NQN ``concerns`` names: the hosts that see the namespace, or whose view changed
        (SPDK nvmf_ns_visible tells exactly the controllers whose visibility flipped). By default a masked
        namespace's change reaches the hosts that see it: no other host learns the NSID is in use."""
        if concerns is None:
            sub = self.subsystems.get(subsystem_nqn)
            ns = sub.namespaces.get(nsid) if sub is not None else None
            if ns is not None and not ns.auto_visible:
                concerns = ns.visible_to
        for ctrl in list(self.controllers.values()):
            if ctrl.subsystem.nqn == subsystem_nqn and (concerns is None or concerns(ctrl.hostnqn)):
                ctrl.namespace_changed(nsid)

    def ana_changed(self, *, subnqn: str | None = None, listeners: Iterable[Listener] | None = None,
                    groups: Iterable[int] = (), concerns: Callable[[str], bool] | None = None) -> int:
        """ANA states (on ``listeners``) or a group's namespaces (in ``subnqn``) changed: bump the change
        counts and send the ANA change AEN to each controller concerned (nvmet_send_ana_event: the
        controllers of the subsystem, or of the port; with ``concerns``, only those of the host NQNs it
        names: a masked namespace is in no other controller's log 0Ch); returns how many were told."""
        self.ana_chgcnt += 1
        for grp in set(groups):
            self.ana_group_chgcnt[grp] = self.ana_group_chgcnt.get(grp, 0) + 1
        ports = None if listeners is None else {id(lst) for lst in listeners}
        told = 0
        for ctrl in list(self.controllers.values()):
            if ctrl.is_discovery or (subnqn is not None and ctrl.subsystem.nqn != subnqn):
                continue
            if ports is not None and id(ctrl.listener) not in ports:
                continue
            if concerns is not None and not concerns(ctrl.hostnqn):
                continue
            ctrl.ana_changed()
            told += 1
        return told

    def set_ana_default(self, state: AnaState) -> None:
        """Every ANA group not set explicitly on a listener is in ``state`` on every listener, present and
        future (a gateway group member: its standby state, so it never serves optimized a group whose
        lock it does not hold); listeners that changed get the ANA change AEN."""
        self.ana_default = AnaState(state)
        moved = [lst for lst in self.listeners.values() if lst.ana_default != self.ana_default]
        for lst in moved:
            lst.set_ana_default(self.ana_default)
        if moved:
            self.ana_changed(listeners=moved, groups=range(1, defaults.ANAGRPMAX + 1))

    def discovery_changed(self) -> None:
        self.genctr += 1
        for ctrl in list(self.controllers.values()):
            if ctrl.is_discovery:
                ctrl.discovery_changed()

    def ceph_clients(self) -> list[dict[str, Any]]:
        """The librados clients of other processes serving this target's queues ({"entity", "addrs", ...}), which
        a gateway group publishes and fences with its own (target/gateway/fencing.py); PooledTarget's workers
        have some, this Target none."""
        return []

    def set_peer_listeners(self, peers: list[Listener]) -> None:
        """The gateway group's other members' I/O listeners as they are now; a change is a discovery log change."""
        if [p.id for p in peers] != [p.id for p in self.peer_listeners]:
            self.peer_listeners = list(peers)
            self.discovery_changed()

    async def settle(self) -> None:
        """Return once every process serving I/O queues has applied the changes announced so far;
        this Target serves them all itself (PooledTarget waits for its workers)."""

    async def start_workers(self) -> None:
        """Start the processes that serve I/O queues: none here (PooledTarget, `serve --workers`)."""

    # --- listeners --------------------------------------------------------------------------------

    async def start_listener(self, listener: Listener) -> Any:
        if listener.id in self._servers:
            raise ValueError(f"listener {listener.id} is already running")
        if listener.ana_default != self.ana_default:
            listener.set_ana_default(self.ana_default)
        server = self.transports.get(listener.trtype)(self, listener)
        await server.start()
        self._servers[listener.id] = server
        return server

    async def stop_listener(self, listener: Listener) -> None:
        server = self._servers.pop(listener.id, None)
        if server is not None:
            await server.stop()

    def listening_port(self, listener: Listener) -> int:
        """The port ``listener`` serves on: its trsvcid, or for 0 the one the kernel chose when it bound."""
        server = self._servers.get(listener.id)
        return server.port if listener.trsvcid == 0 and server is not None else listener.trsvcid

    async def connect_loop(self, protocol_factory: Callable[[], asyncio.BaseProtocol]) -> tuple[Any, Any]:
        """An in-memory connection to this target, the twin of ``loop.create_connection``.

        The host's ``transport="loop"`` calls it on the object given as ``target=``, so the initiator
        needs no import of the target (layers point down: tests/test_layers.py).
        """
        from target.transports.loop import create_loop_connection

        return await create_loop_connection(self, protocol_factory)

    async def close(self) -> None:
        self._closing = True
        for listener_id in list(self._servers):
            server = self._servers.pop(listener_id)
            await server.stop()
        for ctrl in list(self.controllers.values()):
            self.remove_controller(ctrl, "target shutting down")
        if self._ka_task is not None:
            self._ka_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ka_task
            self._ka_task = None

    # --- per-command routing ----------------------------------------------------------------------

    def parse(self, req: Request) -> None:
        """Decide what ``req`` does; raises NvmeError for a command that must fail at once."""
        cmd = req.cmd
        queue = req.queue
        ctrl = queue.ctrl
        if ctrl is None:
            if cmd.opcode == FABRICS_OPCODE and cmd.fctype == FabricsType.CONNECT:
                fabrics.parse_connect(self, req)
            else:
                raise NvmeError(Status.CMD_SEQ_ERROR,
                                f"opcode {cmd.opcode:#04x} on a queue that is not connected yet; "
                                "the first command on a queue must be a Fabrics Connect")
        else:
            ctrl.keep_alive()
            if queue.auth is not None and not queue.auth.authenticated:
                auth.gate(queue, cmd.opcode, cmd.fctype)
            if cmd.opcode == FABRICS_OPCODE:
                fabrics.parse(self, req)
            else:
                if not ctrl.enabled:
                    raise NvmeError(Status.CMD_SEQ_ERROR,
                                    f"opcode {cmd.opcode:#04x} on qid {queue.qid} of controller {ctrl.cntlid} "
                                    f"before the host enabled it (CC.EN={ctrl.cc & 1}, CSTS.RDY={ctrl.csts & 1})")
                if queue.qid != 0:
                    io.parse(req)
                elif ctrl.is_discovery:
                    discovery.parse(req)
                else:
                    admin.parse(req)
        check_sgl(req)

    def complete(self, req: Request) -> bytes:
        return req.queue.complete(req, 0, req.dw0, req.dw1)

    def fail(self, req: Request, err: NvmeError) -> bytes:
        """Log the failure, record it in the error log, and build its CQE (DW0 carries err.result)."""
        queue = req.queue
        ctrl = queue.ctrl
        level = logging.INFO if err.status in _PROBE_STATUSES and queue.qid == 0 else logging.WARNING
        if not err.logged and log.isEnabledFor(level):
            who = f"controller {ctrl.cntlid} (host {host_label(ctrl.hostnqn)})" if ctrl else \
                f"peer {queue.peer}"
            log.log(level, "%s qid %d cid %d opcode %#04x failed with %s: %s", who, queue.qid, req.cmd.cid,
                    req.cmd.opcode, describe(err.status), err.detail or "no detail")
        if ctrl is not None:
            ctrl.record_error(req, err.status, err.dnr)
        if req.ns is not None:
            req.ns.stats.errors += 1
            if ctrl is not None:
                ctrl.host_stats.errors += 1
        return queue.complete(req, err.status, err.result, 0, err.dnr)


def check_sgl(req: Request) -> None:
    """The data pointer must be an SGL describing exactly what the command moves (nvmet_check_transfer_len)."""
    cmd = req.cmd
    if cmd.flags & SQE_FLAGS_PSDT_MASK != SQE_FLAGS_PSDT_SGL:
        raise NvmeError(Status.INVALID_FIELD,
                        f"SQE flags {cmd.flags:#04x}: PSDT must select SGLs (fabrics has no PRPs)")
    sgl_id, addr, length, _ = cmd.sgl()
    if length != req.data_len:
        raise NvmeError(Status.SGL_INVALID_DATA,
                        f"SGL length {length} differs from the {req.data_len} bytes opcode {cmd.opcode:#04x} moves")
    if not length:
        return
    if sgl_id == SGL_ID_INCAPSULE:
        if req.direction != Direction.H2C:
            raise NvmeError(Status.INVALID_FIELD, "in-capsule data SGL on a command that returns data; use a "
                            f"{req.queue.ops.sgl_choices(incapsule=False)} SGL")
        if addr != 0:
            raise NvmeError(Status.SGL_INVALID_OFFSET, f"in-capsule data offset {addr}; ICDOFF is 0")
        if length > req.queue.max_incapsule:
            raise NvmeError(Status.SGL_INVALID_OFFSET,
                            f"{length} bytes of in-capsule data; this queue accepts {req.queue.max_incapsule}")
    elif sgl_id not in req.queue.ops.sgl_types:
        ops = req.queue.ops
        raise NvmeError(Status.SGL_INVALID_TYPE,
                        f"SGL identifier {sgl_id:#04x}; {ops.name} takes {ops.sgl_choices()} SGLs")
