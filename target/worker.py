"""One worker process of `nvmeof serve --workers N`: serves the I/O queues the main process hands it.

Run as ``python -m target.worker --fd FD --index I``. FD is this worker's end of the control
channel (target/worker_channel.py). The worker mirrors the namespaces of every subsystem (each
backend attached from the description and descriptors the main process sends: RAM disks map its
memfds, file backends serve the descriptors it checked, null backends are made here) and runs
the same TargetConnection / Target.parse / io.py code as the main process for each I/O queue it
receives. Controller state stays in the main process: a `RemoteController` here carries what
I/O commands read (cntlid, host, subsystem, enabled) and collects what they change (keep-alive
activity, error log entries, namespace statistics) for the periodic report to the main process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from typing import Any

from nvmeof import defaults
from nvmeof.spec.nvme import LBA_OPCODES
from nvmeof.tcp import HandoffState, TcpConnection
from target import qos
from target.backends import attach_backend
from target.backends import rbd as rbd_backend
from target.backends.base import BackendError, close_backends
from target.backends.rbd import exit_process
from target.core import Target
from target.gateway.fencing import identity
from target.model import Namespace, NamespaceStats, Subsystem
from target.request import Request, TargetQueue
from target.transports.tcp import TargetConnection, TcpLimits, TcpPort
from target.transports.tcp_batch import BatchMixin, attach_socket
from target.worker_channel import Channel

log = logging.getLogger("nvmeof.worker")

REPORT_INTERVAL = 0.25   # seconds between keep-alive/statistics reports (KATO is seconds at least)
_FABRICS = 0x7F


class RemoteController:
    """The part of a main-process Controller that I/O commands use."""

    is_discovery = False

    def __init__(self, ctrl_id: int, cntlid: int, hostnqn: str, subsystem: Subsystem, enabled: bool) -> None:
        self.ctrl_id = ctrl_id
        self.cntlid = cntlid
        self.hostnqn = hostnqn
        self.subsystem = subsystem
        self.enabled = enabled
        self.queues: dict[int, TargetQueue] = {}
        self.closed = False
        self.active = False
        self.errors: list[list[int]] = []
        self.host_stats = NamespaceStats()   # taken by each report; the main process adds it to its Controller's
        self.ana_blocked: dict[int, int] = {}   # the main process's Controller.ana_blocked (op "ana")

    @property
    def cc(self) -> int:
        return 1 if self.enabled else 0

    @property
    def csts(self) -> int:
        return 1 if self.enabled else 0

    def keep_alive(self) -> None:
        self.active = True

    def record_error(self, req: Request, status: int, dnr: bool) -> None:
        cmd = req.cmd
        qid = req.queue.qid
        lba = cmd.slba if qid and cmd.opcode in LBA_OPCODES else 0
        nsid = cmd.nsid if cmd.opcode != _FABRICS else 0
        self.errors.append([qid, cmd.cid, status, int(dnr), lba, nsid, cmd.opcode])


class WorkerTarget(Target):
    """The worker's Target: routing and parsing as in the main process; queue loss is reported."""

    def __init__(self, worker: Worker) -> None:
        super().__init__()
        self.worker = worker
        self.reservations_supported = False   # the state lives in the main process only

    def queue_closed(self, queue: TargetQueue) -> None:
        had_ctrl = queue.ctrl is not None
        super().queue_closed(queue)
        if had_ctrl:
            self.worker.queue_ended(queue)


class WorkerConnection(TargetConnection):
    """A TargetConnection resumed after Connect from the main process's ``TcpConnection.export_state()``:
    the negotiated digests and limits, and the bytes of a PDU the host had begun to send."""

    def __init__(self, target: Target, state: HandoffState, on_lost: Any) -> None:
        super().__init__(target, None, on_lost=on_lost)
        place = self.conn.place
        self.conn = TcpConnection.resume(state)
        self.conn.place = place

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._closed:
            # The main process dropped the queue while its socket was still being attached here.
            transport.close()
            return
        peer, local = self.queue.peer, self.queue.local_addr
        super().connection_made(transport)
        self.queue.peer, self.queue.local_addr = peer or self.queue.peer, local or self.queue.local_addr


class BatchWorkerConnection(BatchMixin, WorkerConnection):
    """WorkerConnection on the batch engine (target/transports/tcp_batch.py)."""

    def __init__(self, target: Target, state: HandoffState, on_lost: Any) -> None:
        super().__init__(target, state, on_lost)
        self._batch_init()


class Worker:
    def __init__(self, sock: socket.socket, index: int) -> None:
        self.index = index
        self.target = WorkerTarget(self)
        self.channel = Channel(sock, self._on_message, self._on_channel_lost)
        self.subsystems: dict[str, Subsystem] = {}
        self.namespaces: dict[int, tuple[str, Namespace]] = {}   # main's namespace key -> (subnqn, ns)
        self.controllers: dict[int, RemoteController] = {}
        self.connections: dict[int, WorkerConnection] = {}      # hid -> connection
        self.queue_hids: dict[TargetQueue, int] = {}
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- lifecycle ------------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        # Ctrl-C reaches the whole process group: the main process decides when workers stop.
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        self.channel.start()
        self.channel.send({"op": "ready", "pid": os.getpid()})
        # Its librados clients are the gateway's too: the main process publishes them for fencing, and steps
        # down when one of them is blocklisted (target/gateway/fencing.py). Callbacks come from librbd threads.
        rbd_backend.on_new_connection(lambda: loop.call_soon_threadsafe(self._send_clients))
        rbd_backend.on_blocklisted(lambda what: loop.call_soon_threadsafe(
            self.channel.send, {"op": "blocklisted", "what": f"worker {self.index}: {what}"}))
        reporter = loop.create_task(self._report_loop())
        try:
            await self._stop.wait()
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
            self._report()
            for conn in list(self.connections.values()):
                conn.abort()
            left = await close_backends([ns.backend for _subnqn, ns in self.namespaces.values()],
                                        defaults.BACKEND_CLOSE_WAIT)
            for backend in left:
                log.warning("worker %d: a %s backend did not close within %.0f s", self.index, backend.kind,
                            defaults.BACKEND_CLOSE_WAIT)
            self.channel.close()

    def _send_clients(self) -> None:
        clients = [ident for ident in map(identity, rbd_backend.client_clusters()) if ident is not None]
        self.channel.send({"op": "clients", "clients": clients})

    def _on_channel_lost(self) -> None:
        log.info("worker %d: control channel closed by the main process; exiting", self.index)
        self._stop.set()

    # --- messages from the main process ---------------------------------------------------------

    def _on_message(self, msg: dict[str, Any], fds: list[int]) -> None:
        op = msg.get("op")
        if op == "queue":
            self._add_queue(msg, fds)
            return
        if op == "ns":
            self._set_namespace(msg, fds)
        else:
            for fd in fds:
                os.close(fd)
            if op == "ns_del":
                self._del_namespace(msg["key"])
            elif op == "drop":
                self._drop_queue(msg["hid"])
            elif op == "ctrl":
                ctrl = self.controllers.get(msg["ctrl_id"])
                if ctrl is not None:
                    ctrl.enabled = bool(msg["enabled"])
            elif op == "ana":
                ctrl = self.controllers.get(msg["ctrl_id"])
                if ctrl is not None:
                    ctrl.ana_blocked = {int(g): int(st) for g, st in msg["blocked"]}
            elif op == "exit":
                self._stop.set()
            else:
                log.error("worker %d: unknown control message %r", self.index, op)
        if "seq" in msg:
            self.channel.send({"op": "ack", "seq": msg["seq"]})

    def _subsystem(self, nqn: str) -> Subsystem:
        sub = self.subsystems.get(nqn)
        if sub is None:
            sub = self.subsystems[nqn] = Subsystem(nqn=nqn, serial="")
        return sub

    def _set_namespace(self, msg: dict[str, Any], fds: list[int]) -> None:
        key = msg["key"]
        entry = self.namespaces.get(key)
        if entry is not None:
            for fd in fds:
                os.close(fd)
            _subnqn, ns = entry
            ns.enabled = bool(msg["enabled"])
            ns.read_only = bool(msg["read_only"])
            ns.anagrpid = int(msg.get("anagrpid", ns.anagrpid))
            _set_visibility(ns, msg)
            _set_qos(ns, msg)
            if msg["size"] != ns.backend.size:
                self._resize(key, ns, msg["size"])
            return
        try:
            backend = attach_backend(msg["backend"], fds)
        except (BackendError, OSError) as exc:
            log.error("worker %d: cannot open namespace %d of %s: %s", self.index, msg["nsid"], msg["subnqn"], exc)
            self.channel.send({"op": "ns_error", "key": key, "error": str(exc)})
            return
        ns = Namespace(nsid=msg["nsid"], backend=backend, block_size=msg["block_size"],
                       read_only=bool(msg["read_only"]), enabled=bool(msg["enabled"]),
                       anagrpid=int(msg.get("anagrpid", 1)))
        _set_visibility(ns, msg)
        _set_qos(ns, msg)
        sub = self._subsystem(msg["subnqn"])
        old = sub.namespaces.get(ns.nsid)
        if old is not None:
            # The main process removed that NSID and added a new one; the removal is still on its way.
            self._forget(old)
        sub.namespaces[ns.nsid] = ns
        self.namespaces[key] = (sub.nqn, ns)

    def _resize(self, key: int, ns: Namespace, size: int) -> None:
        try:
            ns.backend.follow_resize(size)
        except BackendError as exc:
            log.error("worker %d: namespace %d: %s", self.index, ns.nsid, exc)

    def _forget(self, ns: Namespace) -> None:
        for key, (_subnqn, other) in list(self.namespaces.items()):
            if other is ns:
                del self.namespaces[key]
                self._report_stats_of(key, ns)
        ns.backend.close()

    def _del_namespace(self, key: int) -> None:
        entry = self.namespaces.get(key)
        if entry is None:
            return
        subnqn, ns = entry
        sub = self.subsystems.get(subnqn)
        if sub is not None and sub.namespaces.get(ns.nsid) is ns:
            del sub.namespaces[ns.nsid]
        self._forget(ns)

    def _add_queue(self, msg: dict[str, Any], fds: list[int]) -> None:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            log.error("worker %d: queue message with %d descriptors", self.index, len(fds))
            self.channel.send({"op": "closed", "hid": msg.get("hid")})
            return
        hid = msg["hid"]
        ctrl = self.controllers.get(msg["ctrl_id"])
        if ctrl is None:
            ctrl = RemoteController(msg["ctrl_id"], msg["cntlid"], msg["hostnqn"], self._subsystem(msg["subnqn"]),
                                    bool(msg["enabled"]))
            self.controllers[ctrl.ctrl_id] = ctrl
        ctrl.ana_blocked = {int(g): int(st) for g, st in msg.get("ana_blocked", ())}
        conn = BatchWorkerConnection(self.target, HandoffState.from_dict(msg["tcp"]),
                   on_lost=lambda c, hid=hid: self._connection_lost(hid, c))
        queue = conn.queue
        queue.qid = msg["qid"]
        queue.sqsize = msg["sqsize"]
        queue.sqhd = msg["sqhd"]
        queue.sqflow_disabled = bool(msg["sqflow_disabled"])
        queue.io_incapsule = int(msg.get("io_incapsule", queue.io_incapsule))
        queue.connected_at = msg["connected_at"]
        queue.peer = msg["peer"]
        queue.local_addr = msg["local_addr"]
        queue.ctrl = ctrl   # type: ignore[assignment]  # the I/O path needs only what RemoteController has
        ctrl.queues[queue.qid] = queue
        self.connections[hid] = conn
        self.queue_hids[queue] = hid
        sock = socket.socket(fileno=fds[0])
        task = asyncio.get_running_loop().create_task(self._attach(hid, conn, sock))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _attach(self, hid: int, conn: WorkerConnection, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            if isinstance(conn, BatchMixin):
                attach_socket(conn, sock, TcpPort.of(self.target).limits.poll_us)
            else:
                await asyncio.get_running_loop().connect_accepted_socket(lambda: conn, sock)
        except OSError as exc:
            log.warning("worker %d: cannot take over queue %d: %s", self.index, hid, exc)
            sock.close()
            self.target.queue_closed(conn.queue)
            self.connections.pop(hid, None)

    def _drop_queue(self, hid: int) -> None:
        conn = self.connections.get(hid)
        if conn is None:
            return
        queue = conn.queue
        ctrl = queue.ctrl
        # The main process tore this queue down: no "closed" report back.
        self.queue_hids.pop(queue, None)
        queue.ctrl = None
        if ctrl is not None:
            ctrl.queues.pop(queue.qid, None)
            self._maybe_forget_controller(ctrl)   # type: ignore[arg-type]
        conn.close()

    def _connection_lost(self, hid: int, conn: WorkerConnection) -> None:
        if self.connections.get(hid) is conn:
            del self.connections[hid]

    def queue_ended(self, queue: TargetQueue) -> None:
        """The host closed the connection, disconnected the queue, or broke the protocol."""
        hid = self.queue_hids.pop(queue, None)
        if hid is None:
            return
        self.channel.send({"op": "closed", "hid": hid})
        for ctrl in list(self.controllers.values()):
            self._maybe_forget_controller(ctrl)

    def _maybe_forget_controller(self, ctrl: RemoteController) -> None:
        if not ctrl.queues and self.controllers.get(ctrl.ctrl_id) is ctrl:
            self._report()   # its last activity and errors still count
            del self.controllers[ctrl.ctrl_id]

    # --- reports to the main process ------------------------------------------------------------

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL)
            self._report()

    def _report(self) -> None:
        active = []
        errors = []
        for ctrl in self.controllers.values():
            if ctrl.active:
                ctrl.active = False
                active.append(ctrl.ctrl_id)
            if ctrl.errors:
                errors.append([ctrl.ctrl_id, ctrl.errors])
                ctrl.errors = []
        stats = {}
        for key, (_subnqn, ns) in self.namespaces.items():
            row = _take_stats(ns)
            if row is not None:
                stats[str(key)] = row
        host_stats = []
        for ctrl in self.controllers.values():
            if ctrl.host_stats.busy():
                host_stats.append([ctrl.ctrl_id, ctrl.host_stats.to_row()])
                ctrl.host_stats = NamespaceStats()
        if active or errors or stats or host_stats:
            self.channel.send({"op": "report", "active": active, "errors": errors, "stats": stats,
                               "host_stats": host_stats})

    def _report_stats_of(self, key: int, ns: Namespace) -> None:
        row = _take_stats(ns)
        if row is not None:
            self.channel.send({"op": "report", "active": [], "errors": [], "stats": {str(key): row}})


def _set_visibility(ns: Namespace, msg: dict[str, Any]) -> None:
    # masking: io.parse and the batch path check it against each RemoteController's hostnqn
    ns.auto_visible = bool(msg.get("auto_visible", True))
    ns.hosts = set(msg.get("hosts", ()))


def _set_qos(ns: Namespace, msg: dict[str, Any]) -> None:
    """This worker's share of the namespace's QoS limits (ARCHITECTURE.md, QoS: each of N workers enforces
    1/N of every rate, as it may serve any of the namespace's queues)."""
    limits, hosts = qos.parse_config(msg.get("qos"))
    if ns.qos is None:
        ns.qos = qos.NamespaceQos(limits, hosts, share=float(msg.get("qos_share", 1.0)))
    else:
        ns.qos.update(limits, hosts)
    if not ns.qos.limited():
        ns.qos = None


def _take_stats(ns: Namespace) -> list[int] | None:
    if not ns.stats.busy():
        return None
    row = ns.stats.to_row()
    ns.stats = NamespaceStats()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m target.worker")
    parser.add_argument("--fd", type=int, required=True, help="this worker's end of the control socket pair")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--h2c-budget", type=int, default=0,
                        help="this worker's share of the global H2C budget in bytes (0: the default)")
    parser.add_argument("--poll-us", type=int, default=defaults.POLL_US,
                        help="batch engine: µs of busy receives after a batch (nvmeof serve --poll-us)")
    args = parser.parse_args(argv)
    # The main process's layout (nvmeof/cli/__init__.py) with the worker named after the level, so whatever reads
    # the shared stderr log for "<date> <time> LEVEL" sees the workers' errors too.
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s worker{args.index} %(name)s: "
                        "%(message)s", stream=sys.stderr)
    sock = socket.socket(fileno=args.fd)

    async def run() -> None:
        worker = Worker(sock, args.index)
        limits = TcpLimits(poll_us=args.poll_us)
        if args.h2c_budget:
            limits.h2c_global_budget = args.h2c_budget
        TcpPort.of(worker.target).configure(limits)
        await worker.run()

    try:
        import uvloop  # same loop as `nvmeof serve` when installed
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())
    return 0

if __name__ == "__main__":
    exit_process(main())   # an RBD image that would not close must not meet exit()'s teardown
