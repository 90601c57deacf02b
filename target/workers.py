"""`nvmeof serve --workers N`, the main process's side: I/O queues served by N worker processes.

``WorkerPool`` starts the workers (target/worker.py), hands each accepted I/O queue (socket and queue state)
to the one with the fewest queues over its control channel (target/worker_channel.py), mirrors namespaces and
controller state to them and takes their reports back; ``PooledTarget`` is the Target that does so. What
travels, when, and what happens when a worker dies: ARCHITECTURE.md, "Worker processes".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nvmeof.tcp import HandoffRefused, HandoffState, State
from target.backends import rbd as rbd_backend
from target.backends.base import BackendError
from target.controller import ErrorRecord
from target.core import Target
from target.transports.tcp import TargetConnection, TcpPort
from target.transports.tcp_batch import BatchMixin, BatchTcpListener
from target.worker_channel import Channel, socket_pair

if TYPE_CHECKING:
    from target.controller import Controller
    from target.model import Listener, Namespace
    from target.request import TargetQueue

log = logging.getLogger(__name__)

START_TIMEOUT = 20.0        # seconds for a new worker to say it is ready
SETTLE_TIMEOUT = 5.0        # seconds a management call waits for workers to apply a namespace change
STOP_TIMEOUT = 5.0          # seconds workers get to exit before they are killed
HANDOFF_DRAIN_TIMEOUT = 5.0  # seconds the Connect response may take to leave before the socket moves
RESTART_BACKOFF = 1.0       # seconds before restarting a worker that died within RESTART_BACKOFF of its start


class WorkerHandle:
    """One worker process as the main process sees it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.channel: Channel | None = None
        self.pid = 0
        self.ready: asyncio.Future[None] | None = None
        self.alive = False
        self.started = 0.0
        self.sent: dict[int, tuple[Any, ...]] = {}   # namespace key -> state last sent
        self.hids: set[int] = set()
        self.acked = 0       # highest namespace-change seq it has applied
        self.last_sent = 0   # highest namespace-change seq sent to it
        self.monitor: asyncio.Task[None] | None = None
        self.ceph_clients: list[dict[str, Any]] = []   # its librados clients' identities (op "clients")


class _Placed:
    """A queue living in a worker: which one, and the main process's objects for it."""

    __slots__ = ("ctrl", "queue", "release", "worker")

    def __init__(self, worker: WorkerHandle, ctrl: Controller, queue: TargetQueue) -> None:
        self.worker = worker
        self.ctrl = ctrl
        self.queue = queue
        # Ends the queue's count against the listener's and the port's connection caps (TcpListener.release):
        # the main process accepts every connection, and one in a worker still holds an fd and a slot.
        self.release: Any = None

    def forget(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()


class WorkerPool:
    def __init__(self, target: Target, count: int, *, log_level: str | None = None) -> None:
        if count < 1:
            raise ValueError(f"a worker pool needs at least 1 worker, got {count}")
        self.target = target
        self.count = count
        self.log_level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.workers = [WorkerHandle(i) for i in range(count)]
        self.placed: dict[int, _Placed] = {}          # hid -> where
        self._next_hid = 1
        self._ctrl_ids: dict[Controller, int] = {}
        self._ctrl_enabled: dict[int, bool] = {}
        self._next_ctrl_id = 1
        self._ns_keys: dict[Namespace, int] = {}
        self._ns_by_key: dict[int, Namespace] = {}
        self._next_ns_key = 1
        self._seq = 0
        self._rr = 0
        self._stopping = False
        self._settle_waiters: list[tuple[dict[int, int], asyncio.Future[None]]] = []

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn(w) for w in self.workers))

    async def _spawn(self, w: WorkerHandle) -> None:
        parent, child = socket_pair()
        try:
            w.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "target.worker", "--fd", str(child.fileno()), "--index", str(w.index),
                "--log-level", str(self.log_level), "--h2c-budget", str(self.h2c_share()),
                "--poll-us", str(TcpPort.of(self.target).limits.poll_us),
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        w.pid = w.proc.pid
        w.started = time.monotonic()
        w.ceph_clients = []
        w.sent = {}
        w.hids = set()
        w.acked = w.last_sent = self._seq
        w.ready = asyncio.get_running_loop().create_future()
        w.channel = Channel(parent, lambda msg, fds, w=w: self._on_message(w, msg, fds),
                            lambda w=w: self._on_channel_lost(w))
        w.channel.start()
        w.monitor = asyncio.get_running_loop().create_task(self._monitor(w, w.proc))
        try:
            await asyncio.wait_for(asyncio.shield(w.ready), START_TIMEOUT)
        except TimeoutError:
            log.error("worker %d (pid %d) did not start within %.0f s; killing it", w.index, w.pid, START_TIMEOUT)
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
            return
        w.alive = True
        log.info("worker %d started (pid %d)", w.index, w.pid)
        self.sync()

    async def _monitor(self, w: WorkerHandle, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if w.proc is not proc:
            return
        w.alive = False
        if w.channel is not None:
            w.channel.close()
        if w.ready is not None and not w.ready.done():
            w.ready.cancel()
        lost = [hid for hid in w.hids if hid in self.placed]
        if self._stopping:
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        log.error("worker %d (pid %d) %s; failing its %d I/O queue(s) and starting a new worker",
                  w.index, w.pid, how, len(lost))
        for hid in lost:
            self._queue_gone(hid)
        self._settle_check()
        if time.monotonic() - w.started < RESTART_BACKOFF:
            await asyncio.sleep(RESTART_BACKOFF)
        if not self._stopping:
            await self._spawn(w)

    def _on_channel_lost(self, w: WorkerHandle) -> None:
        # The worker cannot be told anything any more: make sure it goes; _monitor cleans up.
        if w.proc is not None and w.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()

    async def stop(self) -> None:
        self._stopping = True
        for w in self.workers:
            if w.channel is not None and w.alive:
                w.channel.send({"op": "exit"})
        for w in self.workers:
            proc = w.proc
            if proc is None:
                continue
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT)
            except TimeoutError:
                log.warning("worker %d (pid %d) did not exit within %.0f s; killing it", w.index, w.pid,
                            STOP_TIMEOUT)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            if w.monitor is not None:
                w.monitor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await w.monitor
            if w.channel is not None:
                w.channel.close()
            w.alive = False
        for _seq, fut in self._settle_waiters:
            if not fut.done():
                fut.set_result(None)
        self._settle_waiters.clear()

    def h2c_share(self) -> int:
        """Each worker's part of --h2c-budget: the global budget lives per process, so it is split."""
        return max(TcpPort.of(self.target).limits.h2c_global_budget // self.count, 1)

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.alive]

    def ceph_clients(self) -> list[dict[str, Any]]:
        """The librados clients of the live workers ({"entity", "addrs", "worker"}), for fencing."""
        return [c for w in self.workers if w.alive for c in w.ceph_clients]

    def placement(self) -> dict[tuple[int, int], int]:
        """(cntlid, qid) -> pid of the worker serving that I/O queue (a debugging aid)."""
        return {(p.ctrl.cntlid, p.queue.qid): p.worker.pid for p in self.placed.values()}

    # --- messages from workers --------------------------------------------------------------------

    def _on_message(self, w: WorkerHandle, msg: dict[str, Any], fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)   # workers send no descriptors
        op = msg.get("op")
        if op == "report":
            self._on_report(msg)
        elif op == "ack":
            w.acked = max(w.acked, msg["seq"])
            self._settle_check()
        elif op == "closed":
            hid = msg.get("hid")
            if isinstance(hid, int) and hid in w.hids:
                self._queue_gone(hid)
        elif op == "ready":
            if w.ready is not None and not w.ready.done():
                w.ready.set_result(None)
        elif op == "clients":
            w.ceph_clients = [dict(c, worker=w.index) for c in msg.get("clients", ()) if isinstance(c, dict)]
            rbd_backend.clients_changed()   # a gateway group publishes them (fencing)
        elif op == "blocklisted":
            rbd_backend.report_blocklisted(str(msg.get("what")))   # a gateway group steps down
        elif op == "ns_error":
            ns = self._ns_by_key.get(msg["key"])
            where = f"namespace {ns.nsid}" if ns is not None else "a namespace"
            log.error("worker %d (pid %d) cannot open %s: %s; I/O queues on that worker see it as inactive",
                      w.index, w.pid, where, msg.get("error"))
        else:
            log.error("worker %d sent an unknown message %r", w.index, op)

    def _on_report(self, msg: dict[str, Any]) -> None:
        by_id = {cid: ctrl for ctrl, cid in self._ctrl_ids.items()}
        for ctrl_id in msg.get("active", ()):
            ctrl = by_id.get(ctrl_id)
            if ctrl is not None and not ctrl.closed:
                ctrl.keep_alive()
        for ctrl_id, rows in msg.get("errors", ()):
            ctrl = by_id.get(ctrl_id)
            if ctrl is None:
                continue
            for qid, cid, status, dnr, lba, nsid, opcode in rows:
                ctrl.error_count += 1
                ctrl.errors.appendleft(ErrorRecord(ctrl.error_count, qid, cid, status, bool(dnr), lba, nsid, opcode))
        for key, row in msg.get("stats", {}).items():
            ns = self._ns_by_key.get(int(key))
            if ns is None:
                continue
            ns.stats.add_row(row)
        for ctrl_id, row in msg.get("host_stats", ()):
            ctrl = by_id.get(ctrl_id)
            if ctrl is not None:
                ctrl.host_stats.add_row(row)

    # --- queues -------------------------------------------------------------------------------------

    def _pick(self) -> WorkerHandle | None:
        live = [w for w in self.workers if w.alive and w.channel is not None and not w.channel.closed]
        if not live:
            return None
        self._rr = (self._rr + 1) % len(live)
        best = live[self._rr]
        for w in live:
            if len(w.hids) < len(best.hids):
                best = w
        return best

    def _ctrl_id(self, ctrl: Controller) -> int:
        cid = self._ctrl_ids.get(ctrl)
        if cid is None:
            cid = self._ctrl_ids[ctrl] = self._next_ctrl_id
            self._next_ctrl_id += 1
            self._ctrl_enabled[cid] = ctrl.enabled
        return cid

    def hand_off(self, conn: TargetConnection, fd: int, state: HandoffState) -> int | None:
        """Send an accepted I/O queue, its NVMe/TCP connection exported as ``state``, to a worker; the
        pool owns ``fd`` from here. None: no worker."""
        w = self._pick()
        queue = conn.queue
        ctrl = queue.ctrl
        if w is None or ctrl is None or w.channel is None:
            os.close(fd)
            return None
        hid = self._next_hid
        self._next_hid += 1
        msg = {
            "op": "queue", "hid": hid, "ctrl_id": self._ctrl_id(ctrl), "cntlid": ctrl.cntlid,
            "hostnqn": ctrl.hostnqn, "subnqn": ctrl.subsystem.nqn, "enabled": ctrl.enabled,
            "qid": queue.qid, "sqsize": queue.sqsize, "sqhd": queue.sqhd, "sqflow_disabled": queue.sqflow_disabled,
            "connected_at": queue.connected_at, "peer": queue.peer, "local_addr": queue.local_addr,
            "tcp": state.to_dict(), "io_incapsule": queue.io_incapsule, "ana_blocked": sorted(ctrl.ana_blocked.items()),
        }
        w.channel.send(msg, [fd], close_fds=True)
        w.hids.add(hid)
        self.placed[hid] = _Placed(w, ctrl, queue)
        return hid

    def drop_queue(self, hid: int) -> None:
        """The main process closed a queue living in a worker (its controller went away)."""
        placed = self.placed.pop(hid, None)
        if placed is None:
            return
        placed.forget()
        w = placed.worker
        w.hids.discard(hid)
        if w.channel is not None:
            # Numbered like a namespace change, so settle() waits until the worker has closed the
            # queue: a host whose access was revoked gets no I/O served after the API call returns.
            self._seq += 1
            w.last_sent = self._seq
            w.channel.send({"op": "drop", "hid": hid, "seq": self._seq})
        self._forget_ctrl_if_idle(placed.ctrl)

    def _queue_gone(self, hid: int) -> None:
        """A queue ended in its worker (host closed it, Disconnect, worker died): forget it here too."""
        placed = self.placed.pop(hid, None)
        if placed is None:
            return
        placed.forget()
        placed.worker.hids.discard(hid)
        queue = placed.queue
        if queue.ctrl is placed.ctrl:
            self.target.queue_closed(queue)
        self._forget_ctrl_if_idle(placed.ctrl)

    def _forget_ctrl_if_idle(self, ctrl: Controller) -> None:
        if any(p.ctrl is ctrl for p in self.placed.values()):
            return
        cid = self._ctrl_ids.pop(ctrl, None)
        if cid is not None:
            self._ctrl_enabled.pop(cid, None)

    def controller_state(self, ctrl: Controller) -> None:
        """After an admin command batch: tell the workers if CC.EN/CSTS.RDY changed."""
        cid = self._ctrl_ids.get(ctrl)
        if cid is None:
            return
        enabled = ctrl.enabled
        if self._ctrl_enabled.get(cid) == enabled:
            return
        self._ctrl_enabled[cid] = enabled
        for w in {p.worker for p in self.placed.values() if p.ctrl is ctrl}:
            if w.channel is not None:
                w.channel.send({"op": "ctrl", "ctrl_id": cid, "enabled": enabled})

    def ana_sync(self) -> None:
        """After an ANA state change: send each worker serving a controller's I/O queues that controller's
        blocked groups (what target/io.py checks), acknowledged like namespace changes (settle)."""
        for w in self.workers:
            if not w.alive or w.channel is None:
                continue
            for ctrl in {p.ctrl for p in self.placed.values() if p.worker is w}:
                cid = self._ctrl_ids.get(ctrl)
                if cid is None:
                    continue
                self._seq += 1
                w.last_sent = self._seq
                w.channel.send({"op": "ana", "ctrl_id": cid, "blocked": sorted(ctrl.ana_blocked.items()),
                                "seq": self._seq})

    # --- namespaces ---------------------------------------------------------------------------------

    def _ns_key(self, ns: Namespace) -> int:
        key = self._ns_keys.get(ns)
        if key is None:
            key = self._ns_keys[ns] = self._next_ns_key
            self._ns_by_key[key] = ns
            self._next_ns_key += 1
        return key

    def _share(self, ns: Namespace) -> None:
        """The first time workers need it, a backend becomes one they can share (a RAM disk moves to a memfd)."""
        backend = ns.backend
        shared = backend.for_workers()
        if shared is not backend:
            ns.backend = shared
            backend.close()

    def sync(self) -> None:
        """Send every live worker what changed in the namespaces since it was last told."""
        current: dict[int, tuple[str, Namespace]] = {}
        for sub in self.target.subsystems.values():
            if sub.subtype != "nvm":
                continue
            for ns in sub.namespaces.values():
                self._share(ns)
                current[self._ns_key(ns)] = (sub.nqn, ns)
        for ns in [n for n, key in self._ns_keys.items() if key not in current]:
            key = self._ns_keys.pop(ns)
            # Statistics still on their way from workers land in a namespace nobody sees: fine.
            self._ns_by_key.pop(key, None)
        for w in self.workers:
            if w.alive and w.channel is not None:
                self._sync_worker(w, current)

    def _sync_worker(self, w: WorkerHandle, current: dict[int, tuple[str, Namespace]]) -> None:
        assert w.channel is not None
        for key in [k for k in w.sent if k not in current]:
            del w.sent[key]
            self._seq += 1
            w.last_sent = self._seq
            w.channel.send({"op": "ns_del", "key": key, "seq": self._seq})
        for key, (subnqn, ns) in current.items():
            backend = ns.backend
            qos = ns.qos.config() if ns.qos is not None else None
            state = (backend.size, ns.enabled, ns.read_only, backend.read_only, ns.anagrpid, ns.visibility(), repr(qos))
            if w.sent.get(key) == state:
                continue
            try:
                description, fds = backend.describe_for_worker()
            except BackendError as exc:
                log.error("namespace %d of %s: %s; its I/O fails on their queues", ns.nsid, subnqn, exc)
                continue
            msg: dict[str, Any] = {
                "op": "ns", "key": key, "subnqn": subnqn, "nsid": ns.nsid, "backend": description,
                "size": backend.size, "block_size": ns.block_size, "enabled": ns.enabled, "read_only": ns.read_only,
                "anagrpid": ns.anagrpid, "auto_visible": ns.auto_visible, "hosts": sorted(ns.hosts),
                "qos": qos, "qos_share": 1 / len(self.workers),
            }
            if key in w.sent:
                fds = []   # the worker has attached it already; this is a change of state
            self._seq += 1
            w.last_sent = msg["seq"] = self._seq
            w.sent[key] = state
            # The descriptors stay ours: the kernel gives the worker its own copies.
            w.channel.send(msg, fds)

    async def settle(self) -> None:
        """Wait until every live worker has applied the namespace changes sent so far."""
        wanted = {w.index: w.last_sent for w in self.workers}
        if self._settled(wanted):
            return
        fut = asyncio.get_running_loop().create_future()
        self._settle_waiters.append((wanted, fut))
        try:
            await asyncio.wait_for(fut, SETTLE_TIMEOUT)
        except TimeoutError:
            slow = [f"{w.index} (pid {w.pid})" for w in self.workers if w.alive and w.acked < wanted[w.index]]
            log.warning("worker(s) %s did not apply a namespace change within %.0f s", ", ".join(slow),
                        SETTLE_TIMEOUT)

    def _settled(self, wanted: dict[int, int]) -> bool:
        return all(not w.alive or w.acked >= wanted[w.index] for w in self.workers)

    def _settle_check(self) -> None:
        if not self._settle_waiters:
            return
        done = [(wanted, fut) for wanted, fut in self._settle_waiters if self._settled(wanted)]
        for item in done:
            self._settle_waiters.remove(item)
            if not item[1].done():
                item[1].set_result(None)


class PoolConnection(TargetConnection):
    """The main process's end of a new connection: admin queues stay, I/O queues move to a worker."""

    def __init__(self, target: PooledTarget, listener: Listener | None, *, on_lost: Any = None) -> None:
        super().__init__(target, listener, on_lost=on_lost)
        self.pool = target.pool
        self._handoff = False      # an I/O queue Connect succeeded: the socket is about to move
        self._handed_off = False
        self._handoff_deadline = 0.0
        self._handoff_stay = False  # the hand-off was given up: this queue is served here

    def _send_cqe(self, cqe: bytes) -> None:
        super()._send_cqe(cqe)
        queue = self.queue
        if queue.qid and not self._handoff and queue.ctrl is not None and not self._closed:
            # The Connect response is on its way; nothing more is read here.
            self._handoff = True
            if self._tls is not None:
                # The TLS session (keys, sequence numbers) lives in this process's OpenSSL state.
                self._give_up_handoff("it runs over TLS")
                return
            if queue.auth is not None:
                # Its authentication and any re-authentication need the host's keys, which only this
                # process holds (target/auth.py): the queue is served here.
                self._give_up_handoff("its host authenticates with DH-HMAC-CHAP")
                return
            self._handoff_deadline = time.monotonic() + HANDOFF_DRAIN_TIMEOUT
            self._set_paused(True)
            asyncio.get_running_loop().call_soon(self._try_handoff)

    def data_received(self, data: bytes | memoryview) -> None:  # type: ignore[override]
        super().data_received(data)
        queue = self.queue
        if queue.qid == 0 and queue.ctrl is not None:
            self.pool.controller_state(queue.ctrl)

    def _set_paused(self, paused: bool) -> None:
        transport = self.transport
        if transport is None:
            return
        self._read_paused = paused
        with contextlib.suppress(RuntimeError, AttributeError):
            if paused:
                transport.pause_reading()
            else:
                transport.resume_reading()

    def _update_reading(self) -> None:
        if self._handoff and not self._handoff_stay:
            return   # paused for the hand-off; _try_handoff decides
        super()._update_reading()

    def _give_up_handoff(self, why: str) -> None:
        log.info("I/O queue %d of controller %s stays in the main process: %s", self.queue.qid,
                 self.queue.ctrl.cntlid if self.queue.ctrl else "?", why)
        self._handoff_stay = True
        self._set_paused(False)

    def _try_handoff(self) -> None:
        transport = self.transport
        if self._closed or self._handed_off or transport is None or self.queue.ctrl is None:
            return
        if self._handoff_stay:
            return
        if self._tasks or self._h2c or self.conn.state is not State.READY:
            # The host sent more behind its Connect and some of it is still running here.
            self._give_up_handoff("commands sent right behind the Connect are still in flight")
            return
        if transport.get_write_buffer_size():
            if time.monotonic() > self._handoff_deadline:
                self._give_up_handoff("the Connect response did not leave in time")
                return
            asyncio.get_running_loop().call_later(0.001, self._try_handoff)
            return
        try:
            state = self.conn.export_state()
        except HandoffRefused as exc:
            self._give_up_handoff(str(exc))
            return
        sock = transport.get_extra_info("socket")
        if sock is None:
            self._give_up_handoff("the transport has no socket")
            return
        fd = os.dup(sock.fileno())
        hid = self.pool.hand_off(self, fd, state)
        if hid is None:
            self._give_up_handoff("no worker process is running")
            return
        self._handed_off = True
        self.pool.placed[hid].release = self.detach_slot()   # the worker's fd counts against the caps now
        self.queue.close = lambda hid=hid: self.pool.drop_queue(hid)
        # Our descriptor goes; the worker's copy keeps the connection open (close sends no FIN).
        transport.close()

    def _cleanup(self) -> None:
        if self._handed_off:
            return   # the queue lives on in a worker
        super()._cleanup()


class BatchPoolConnection(BatchMixin, PoolConnection):
    """PoolConnection on the batch engine (an I/O queue whose hand-off was given up is served here)."""

    def __init__(self, target: PooledTarget, listener: Listener | None, *, on_lost: Any = None) -> None:
        super().__init__(target, listener, on_lost=on_lost)
        self._batch_init()

    def _fast_ready(self) -> bool:
        # While the socket is about to move, whatever the host sent behind its Connect stays with the
        # sans-IO connection (export_state carries a half-received PDU; the batch engine's carry would not).
        if self._handoff and not self._handoff_stay:
            return False
        return super()._fast_ready()


class BatchPooledTcpListener(BatchTcpListener):
    """The main process's NVMe/TCP listener of a PooledTarget: the batch engine, handing I/O queues over."""

    connection_class = BatchPoolConnection   # type: ignore[assignment]


class PooledTarget(Target):
    """A Target whose TCP I/O queues are served by a WorkerPool."""

    def __init__(self, workers: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # TCP listeners hand their I/O queues to the workers; every other trtype is served as injected.
        self.transports = self.transports.with_entries({"tcp": BatchPooledTcpListener})
        self.pool = WorkerPool(self, workers)
        # I/O queues run in the workers, which keep no reservation state: Identify clears ONCS bit 5 and the
        # reservation commands answer Invalid Opcode rather than enforce nothing
        self.reservations_supported = False

    async def start_workers(self) -> None:
        await self.pool.start()

    def namespace_changed(self, subsystem_nqn: str, nsid: int, concerns: Callable[[str], bool] | None = None) -> None:
        # Workers first, so the change (a size, a masking change) is on its way before any host hears of it.
        self.pool.sync()
        super().namespace_changed(subsystem_nqn, nsid, concerns)

    def discovery_changed(self) -> None:
        self.pool.sync()   # subsystem removal takes its namespaces along
        super().discovery_changed()

    def ana_changed(self, **kwargs: Any) -> int:
        # Workers first (a namespace's group, the blocked groups), as for namespace changes.
        self.pool.sync()
        self.pool.ana_sync()
        return super().ana_changed(**kwargs)

    async def settle(self) -> None:
        await self.pool.settle()

    def ceph_clients(self) -> list[dict[str, Any]]:
        return self.pool.ceph_clients()

    def controllers_info(self) -> list[dict[str, Any]]:
        # Which process serves each queue, so an operator (or a test) can see the hand-off happened;
        # None: this process serves it (the admin queue, or a hand-off that was given up).
        where = self.pool.placement()
        infos = super().controllers_info()
        for info in infos:
            for queue in info["queues"]:
                queue["worker_pid"] = where.get((info["cntlid"], queue["qid"]))
        return infos

    async def close(self) -> None:
        await super().close()
        await self.pool.stop()
