"""MultipathController: one subsystem reached through several controllers (paths), routed by ANA.

The rules mirror the Linux host's native multipath (drivers/nvme/host/multipath.c):

- every path is a :class:`HostController` of the same subsystem, with the same host NQN and host ID;
  a second controller with a CNTLID already in use is refused (``nvme_validate_cntlid``: "Duplicate
  cntlid"), and so is a subsystem without CMIC multi-controller;
- an I/O goes to a path where the namespace's ANA group is OPTIMIZED, else NON_OPTIMIZED
  (``__nvme_find_path``; iopolicy "numa" keeps the current path while it stays optimized, "round-robin"
  moves on each time, ``nvme_round_robin_path``);
- a path-related status without DNR (ANA inaccessible, persistent loss, transition: SCT 3h) marks the
  namespace pending on that path, re-reads that path's ANA log and retries on another path
  (``nvme_failover_req``), and so does a transport failure (connection lost, command timeout);
- with no usable path while some path is live or reconnecting (``nvme_available_path``) the I/O waits
  for an ANA change or a reconnect, up to ``no_path_timeout`` (default twice ANATT, the slack the kernel
  gives its ANATT timer in ``nvme_read_ana_log``), then fails;
- a dead path reconnects in the background with :func:`initiator.reconnect.connect_with_backoff`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from initiator import commands as c
from initiator.controller import AsyncEvent, HostController, default_host_identity
from initiator.nvm import Buffer, NamespaceGeometry
from initiator.queue import DEFAULT_TIMEOUT
from initiator.reconnect import StandInController, connect_with_backoff
from nvmeof import defaults
from nvmeof.spec.identify import CMIC_MULTI_CTRL
from nvmeof.spec.logs import ANA_STATE_NAMES, AnaState
from nvmeof.spec.nvme import Command, Completion
from nvmeof.spec.reservations import AcquireAction, Cptpl, RegisterAction, ReleaseAction, ReservationReport
from nvmeof.status import NvmeError, StatusCodeType

log = logging.getLogger(__name__)

T = TypeVar("T")

IOPOLICIES = ("numa", "round-robin")
POLL_INTERVAL = 1.0     # seconds between ANA log re-reads while an I/O waits (in case an AEN is lost)
_USABLE = (AnaState.OPTIMIZED, AnaState.NON_OPTIMIZED)   # nvme_state_is_live
# What a broken path raises: TransportError and CommandTimeout are ConnectionError / TimeoutError.
_PATH_FAILURES = (ConnectionError, TimeoutError)
_CONNECT_FAILURES = (OSError, TimeoutError)   # what connect_with_backoff retries


class MultipathError(RuntimeError):
    """The paths given are not one subsystem's controllers (or a reconnected one no longer is)."""


class NoPathError(ConnectionError):
    """No path could carry the I/O: none is usable, or none became usable within ``no_path_timeout``."""


def is_path_error(err: NvmeError) -> bool:
    """A status another path may succeed with: path-related (SCT 3h) and DNR clear
    (nvme_decide_disposition -> FAILOVER; nvme_is_path_error)."""
    return err.sct == StatusCodeType.PATH and not err.dnr


@dataclasses.dataclass(frozen=True)
class PathInfo:
    """One path as :meth:`MultipathController.paths` reports it."""

    traddr: str
    trsvcid: int
    cntlid: int | None          # None while the path is not connected
    live: bool
    # {nsid: "optimized" | "non-optimized" | ... | "pending"} from the path's last ANA log (empty for a
    # controller without ANA reporting: every namespace is optimized there)
    ana_states: dict[int, str]
    reconnects: int
    ios: int                    # namespace I/O requests completed through this path
    error: str | None           # why the path is (or last was) down

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Path:
    def __init__(self, index: int, traddr: str, trsvcid: int) -> None:
        self.index = index
        self.traddr = traddr
        self.trsvcid = trsvcid
        self.ctrl: HostController | None = None
        self.pending: set[int] = set()      # NVME_NS_ANA_PENDING: an ANA error came back, log re-read due
        self.reread: asyncio.Task[None] | None = None
        self.reconnect: asyncio.Task[None] | None = None
        self.reconnects = 0
        self.ios = 0                        # namespace commands completed through this path
        self.error: str | None = None
        self.last_cntlid: int | None = None

    @property
    def where(self) -> str:
        return f"path {self.index} ({self.traddr}:{self.trsvcid})"

    @property
    def connecting(self) -> bool:
        return self.reconnect is not None and not self.reconnect.done()

    def state(self, nsid: int) -> AnaState | int | None:
        if self.ctrl is None or nsid in self.pending:
            return None
        return self.ctrl.ana_state(nsid)


class MultipathController(StandInController):
    """The namespace I/O methods of :class:`HostController` over every path; see the module docstring."""

    def __init__(self, paths: Sequence[tuple[str, int | str]], subnqn: str, *, iopolicy: str = "numa",
                 no_path_timeout: float | None = None, initial_delay: float = 0.1, max_reconnect_delay: float = 5.0,
                 hostnqn: str | None = None, hostid: str | uuid.UUID | bytes | None = None,
                 event_callback: Callable[[AsyncEvent], Any] | None = None, **kwargs: Any) -> None:
        if not paths:
            raise ValueError("connect_multipath needs at least one (traddr, trsvcid) path")
        if iopolicy not in IOPOLICIES:
            raise ValueError(f"iopolicy {iopolicy!r} is not one of: {', '.join(IOPOLICIES)}")
        if no_path_timeout is not None and no_path_timeout < 0:
            raise ValueError(f"no_path_timeout must be >= 0 seconds (or None for twice ANATT), got {no_path_timeout}")
        if initial_delay <= 0 or max_reconnect_delay < initial_delay:
            raise ValueError(f"need 0 < initial_delay <= max_reconnect_delay, got {initial_delay} and "
                             f"{max_reconnect_delay}")
        seen: set[tuple[str, int]] = set()
        self._paths: list[_Path] = []
        for index, (traddr, trsvcid) in enumerate(paths):
            key = (str(traddr), int(trsvcid))
            if key in seen:
                raise ValueError(f"path {traddr}:{trsvcid} is given twice; each path is a distinct address")
            seen.add(key)
            self._paths.append(_Path(index, *key))
        self.subnqn = subnqn
        self.iopolicy = iopolicy
        self.no_path_timeout = no_path_timeout
        self.initial_delay = initial_delay
        self.max_reconnect_delay = max_reconnect_delay
        # one host identity for every path, as the kernel's nvmf_host is shared by a subsystem's controllers
        default_nqn, default_id = default_host_identity()
        self.hostnqn = hostnqn or default_nqn
        self.hostid = hostid if hostid is not None else default_id
        self.event_callback = event_callback
        self._kwargs = kwargs
        self._current: dict[int, _Path] = {}     # head->current_path, per nsid
        self._changed = asyncio.Event()
        self._closed = False

    # ---- connecting ----------------------------------------------------------------------------

    async def open(self) -> MultipathController:
        """Connect every path; paths that cannot be reached now are retried in the background, but at
        least one must connect, and a refusal (NVMe status, duplicate CNTLID) fails the whole call."""
        results = await asyncio.gather(*(self._connect(p) for p in self._paths), return_exceptions=True)
        refusal = next((r for r in results if isinstance(r, BaseException)
                        and not isinstance(r, _CONNECT_FAILURES)), None)
        if refusal is None and all(isinstance(r, BaseException) for r in results):
            refusal = NoPathError(f"connect_multipath: no path to {self.subnqn} could connect: "
                                  + "; ".join(f"{p.where}: {r}" for p, r in zip(self._paths, results, strict=True)))
        if refusal is not None:
            await self.close()
            raise refusal
        for path, result in zip(self._paths, results, strict=True):
            if isinstance(result, BaseException):
                path.error = str(result)
                log.warning("%s of %s is down (%s); reconnecting in the background", path.where, self.subnqn, result)
                self._start_reconnect(path)
        return self

    async def _connect(self, path: _Path) -> None:
        ctrl = HostController(path.traddr, path.trsvcid, self.subnqn, hostnqn=self.hostnqn, hostid=self.hostid,
                              event_callback=functools.partial(self._on_event, path), **self._kwargs)
        await ctrl.open()
        try:
            if self._closed:
                raise MultipathError(f"{path.where}: the multipath controller was closed while connecting")
            self._admit(path, ctrl)
        except BaseException:
            await ctrl.close()
            raise
        ctrl.on_transport_error = functools.partial(self._on_broken, path, ctrl)
        path.ctrl = ctrl
        path.pending.clear()
        path.error = None
        path.last_cntlid = ctrl.cntlid
        self._notify()

    def _admit(self, path: _Path, ctrl: HostController) -> None:
        """nvme_init_subsystem / nvme_validate_cntlid: the same subsystem, a CNTLID no other path has."""
        ident = ctrl.identity
        assert ident is not None
        if ident.subnqn and ident.subnqn != self.subnqn:
            raise MultipathError(f"{path.where}: Identify Controller reports subsystem {ident.subnqn!r}, not "
                                 f"{self.subnqn!r}; every path must lead to the same subsystem")
        for other in self._paths:
            octrl = other.ctrl
            if other is path or octrl is None:
                continue
            if octrl.cntlid == ctrl.cntlid:
                raise MultipathError(
                    f"{path.where}: duplicate cntlid {ctrl.cntlid} with {other.where}, subsystem {self.subnqn}, "
                    "rejecting (as the Linux host's nvme_validate_cntlid does): the targets behind these paths "
                    "must hand out disjoint controller IDs (nvmeof serve --cntlid-range, or a gateway group)")
            if not ident.cmic & CMIC_MULTI_CTRL:
                raise MultipathError(f"{path.where}: subsystem {self.subnqn} does not support multiple "
                                     "controllers (Identify CMIC bit 1 is clear), so it cannot have a second path")

    def _on_broken(self, path: _Path, ctrl: HostController, err: BaseException) -> None:
        """A queue of the path's controller broke (HostController.on_transport_error), or an I/O on it
        failed with a transport error: drop the controller and reconnect (nvme_mpath_clear_ctrl_paths)."""
        if path.ctrl is not ctrl:
            return
        path.ctrl = None
        path.error = str(err)
        self._forget(path)
        log.warning("%s of %s lost (%s); failing over and reconnecting", path.where, self.subnqn, err)
        task = asyncio.get_running_loop().create_task(ctrl.close())
        task.add_done_callback(_log_task_error)
        if not self._closed:
            self._start_reconnect(path)
        self._notify()

    def _start_reconnect(self, path: _Path) -> None:
        if path.connecting or self._closed:
            return
        path.reconnect = asyncio.get_running_loop().create_task(self._reconnect(path))

    async def _reconnect(self, path: _Path) -> None:
        try:
            _, attempts = await connect_with_backoff(
                functools.partial(self._connect, path), f"{path.where} of {self.subnqn}",
                initial_delay=self.initial_delay, max_delay=self.max_reconnect_delay)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a refusal: the target answered, or is now another subsystem's
            path.error = f"reconnect refused: {err}"
            log.error("%s of %s stays down: %s", path.where, self.subnqn, err)
            self._notify()
            return
        path.reconnects += 1
        log.info("%s of %s is back after %d attempt(s) (cntlid %d)", path.where, self.subnqn, attempts,
                 path.last_cntlid)

    # ---- ANA ---------------------------------------------------------------------------------

    def _on_event(self, path: _Path, ev: AsyncEvent) -> Any:
        if ev.ana_log is not None and path.ctrl is not None:
            # the controller re-read its log: the pending marks are answered, the current paths stale
            path.pending.clear()
            self._current.clear()
            log.info("%s of %s: ANA change: %s", path.where, self.subnqn, _describe_groups(path.ctrl))
            self._notify()
        if self.event_callback is not None:
            return self.event_callback(ev)
        return None

    def _ana_error(self, path: _Path, nsid: int) -> None:
        """nvme_failover_req with an ANA status: the namespace is pending on that path until its log is
        re-read (nvme_ana_work)."""
        path.pending.add(nsid)
        self._forget(path)
        self._reread(path)

    def _reread(self, path: _Path) -> None:
        if path.ctrl is None or (path.reread is not None and not path.reread.done()):
            return
        path.reread = asyncio.get_running_loop().create_task(self._read_ana_log(path, path.ctrl))

    async def _read_ana_log(self, path: _Path, ctrl: HostController) -> None:
        try:
            if ctrl.ana_supported:
                await ctrl.get_ana_log()
        except _PATH_FAILURES:
            return  # the controller's broken-queue hook takes the path down
        except (NvmeError, ValueError) as err:
            log.warning("%s of %s: re-reading the ANA log failed: %s", path.where, self.subnqn, err)
            return
        if path.ctrl is ctrl:
            path.pending.clear()
            self._current.clear()
            self._notify()

    def _notify(self) -> None:
        """Wake every I/O waiting for a usable path (the kernel kicks its requeue lists)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _forget(self, path: _Path) -> None:
        for nsid, current in list(self._current.items()):
            if current is path:
                del self._current[nsid]

    # ---- path selection ------------------------------------------------------------------------

    def _find_path(self, nsid: int) -> _Path | None:
        old = self._current.get(nsid)
        if self.iopolicy == "round-robin" and old is not None:
            found = self._round_robin(nsid, old)
        elif old is not None and old.state(nsid) == AnaState.OPTIMIZED:
            return old  # nvme_numa_path keeps an optimized current path
        else:
            found = self._first_usable(nsid)
        if found is not None:
            self._current[nsid] = found
        return found

    def _first_usable(self, nsid: int) -> _Path | None:
        """__nvme_find_path: the first optimized path, else the first non-optimized one."""
        fallback = None
        unlisted = None
        known = False
        for path in self._paths:
            state = path.state(nsid)
            if state == AnaState.OPTIMIZED:
                return path
            if state == AnaState.NON_OPTIMIZED and fallback is None:
                fallback = path
            if state is None and path.ctrl is not None and nsid not in path.pending:
                unlisted = unlisted or path
            known = known or state is not None
        if fallback is None and not known:
            # no path's log lists the namespace (not active, or just added): let a target answer for it
            return unlisted
        return fallback

    def _round_robin(self, nsid: int, old: _Path) -> _Path | None:
        """nvme_round_robin_path: the next optimized path after the current one, else a non-optimized
        one; the current path again only when nothing better was found."""
        n = len(self._paths)
        found = None
        for step in range(1, n):
            path = self._paths[(old.index + step) % n]
            state = path.state(nsid)
            if state == AnaState.OPTIMIZED:
                return path
            if state == AnaState.NON_OPTIMIZED and found is None:
                found = path
        state = old.state(nsid)
        if state == AnaState.OPTIMIZED or (found is None and state == AnaState.NON_OPTIMIZED):
            return old
        return found or self._first_usable(nsid)

    def _available(self) -> bool:
        """nvme_available_path: some path is live or reconnecting, so waiting can help."""
        return any(p.ctrl is not None or p.connecting for p in self._paths)

    def _wait_limit(self) -> float:
        if self.no_path_timeout is not None:
            return self.no_path_timeout
        anatt = max((p.ctrl.anatt for p in self._paths if p.ctrl is not None), default=0)
        return 2.0 * (anatt or defaults.ANATT)

    async def _route(self, nsid: int, what: str, call: Callable[[HostController], Awaitable[T]]) -> T:
        """Run ``call`` on a usable path for ``nsid``, failing over until it succeeds or the wait is over."""
        if self._closed:
            raise RuntimeError(f"multipath controller of {self.subnqn} is closed")
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        last: BaseException | None = None
        while True:
            path = self._find_path(nsid)
            if path is not None and path.ctrl is not None:
                ctrl = path.ctrl
                try:
                    result = await call(ctrl)
                    path.ios += 1
                    return result
                except NvmeError as err:
                    if not is_path_error(err):
                        raise
                    last = err
                    log.info("%s of %s: %s nsid %d: %s; trying another path", path.where, self.subnqn, what,
                             nsid, err)
                    self._ana_error(path, nsid)
                except _PATH_FAILURES as err:
                    last = err
                    self._on_broken(path, ctrl, err)
                if deadline is None:
                    deadline = loop.time() + self._wait_limit()
                if loop.time() < deadline and self._find_path(nsid) is not None:
                    continue  # another path is usable right now
            if self._closed:
                raise RuntimeError(f"multipath controller of {self.subnqn} is closed")
            if not self._available():
                raise NoPathError(f"{what} nsid {nsid} on {self.subnqn}: no available path (every path is "
                                  f"down and none reconnects): {self._down_reasons()}") from last
            if deadline is None:
                deadline = loop.time() + self._wait_limit()
            left = deadline - loop.time()
            if left <= 0:
                raise NoPathError(f"{what} nsid {nsid} on {self.subnqn}: no usable path within "
                                  f"{self._wait_limit():g} s (no_path_timeout): {self._down_reasons(nsid)}") from last
            await self._wait_change(min(left, POLL_INTERVAL))

    async def _wait_change(self, timeout: float) -> None:
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            # no AEN came: look again ourselves, as the kernel's ANATT timer would eventually make it
            for path in self._paths:
                self._reread(path)

    def _down_reasons(self, nsid: int | None = None) -> str:
        parts = []
        for p in self._paths:
            if p.ctrl is None:
                parts.append(f"{p.where}: down ({p.error or 'connecting'})")
            elif nsid is not None:
                parts.append(f"{p.where}: {_state_name(p.state(nsid))}")
        return "; ".join(parts)

    # ---- namespace I/O (HostController's NVM methods, same signatures) ----------------------------

    async def read(self, nsid: int, slba: int, nlb: int, *,
                   buf: bytearray | memoryview | None = None) -> bytes | None:
        return await self._route(nsid, "Read", lambda ctrl: ctrl.read(nsid, slba, nlb, buf=buf))

    async def write(self, nsid: int, slba: int, data: Buffer, *, fua: bool = False) -> None:
        await self._route(nsid, "Write", lambda ctrl: ctrl.write(nsid, slba, data, fua=fua))

    async def compare(self, nsid: int, slba: int, data: Buffer) -> None:
        await self._route(nsid, "Compare", lambda ctrl: ctrl.compare(nsid, slba, data))

    async def write_zeroes(self, nsid: int, slba: int, nlb: int, deallocate: bool = False) -> None:
        await self._route(nsid, "Write Zeroes",
                          lambda ctrl: ctrl.write_zeroes(nsid, slba, nlb, deallocate=deallocate))

    async def deallocate(self, nsid: int, ranges: Iterable[tuple[int, int]]) -> None:
        items = list(ranges)
        await self._route(nsid, "Dataset Management", lambda ctrl: ctrl.deallocate(nsid, items))

    async def io_command(self, cmd: Command, *, data_out: Buffer | None = None,
                         data_in: bytearray | memoryview | None = None,
                         timeout: Any = DEFAULT_TIMEOUT) -> Completion:
        """Any I/O command (passthrough), routed by its NSID."""
        return await self._route(cmd.nsid, f"opcode {cmd.opcode:#04x}",
                                 lambda ctrl: ctrl.io_command(cmd, data_out=data_out, data_in=data_in,
                                                              timeout=timeout))

    async def flush(self, nsid: int = c.NSID_ALL) -> None:
        """Flush one namespace through its path; NSID FFFFFFFFh flushes through every live path, since
        each controller may front its own cache of the shared storage."""
        if nsid != c.NSID_ALL:
            await self._route(nsid, "Flush", lambda ctrl: ctrl.flush(nsid))
            return
        ctrls = [p.ctrl for p in self._paths if p.ctrl is not None]
        results = await asyncio.gather(*(ctrl.flush(nsid) for ctrl in ctrls), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for r in failures:
            path_trouble = isinstance(r, _PATH_FAILURES) or (isinstance(r, NvmeError) and is_path_error(r))
            if not path_trouble:
                raise r
        if not ctrls or len(failures) == len(ctrls):
            raise NoPathError(f"Flush on {self.subnqn}: no live path took it: {self._down_reasons()}")

    # ---- reservations: the host's, whichever controller carries them -----------------------------
    # Every path connects with the same host NQN and host ID, and a target knows a registrant by its host
    # ID (NVMe Base 2.0, "Reservations"), so any usable path may carry the command, failing over as an I/O
    # does. A command retried after a lost path may have taken effect already: Register with the same key,
    # Acquire of the type held and Release succeed again, while a retried Unregister, Replace or Preempt
    # answers Reservation Conflict (its key is gone). (The kernel's nvme_send_ns_head_pr_command picks one
    # path with nvme_find_path and does not retry on another.)

    async def resv_register(self, nsid: int, *, nrkey: int = 0, crkey: int = 0,
                            rrega: RegisterAction | int = RegisterAction.REGISTER, iekey: bool = False,
                            cptpl: Cptpl | int = Cptpl.NO_CHANGE) -> None:
        await self._route(nsid, "Reservation Register", lambda ctrl: ctrl.resv_register(
            nsid, nrkey=nrkey, crkey=crkey, rrega=rrega, iekey=iekey, cptpl=cptpl))

    async def resv_acquire(self, nsid: int, *, crkey: int, rtype: int, prkey: int = 0,
                           racqa: AcquireAction | int = AcquireAction.ACQUIRE, iekey: bool = False) -> None:
        await self._route(nsid, "Reservation Acquire", lambda ctrl: ctrl.resv_acquire(
            nsid, crkey=crkey, rtype=rtype, prkey=prkey, racqa=racqa, iekey=iekey))

    async def resv_release(self, nsid: int, *, crkey: int, rtype: int = 0,
                           rrela: ReleaseAction | int = ReleaseAction.RELEASE, iekey: bool = False) -> None:
        await self._route(nsid, "Reservation Release", lambda ctrl: ctrl.resv_release(
            nsid, crkey=crkey, rtype=rtype, rrela=rrela, iekey=iekey))

    async def resv_report(self, nsid: int, *, eds: bool = True, size: int | None = 4096) -> ReservationReport:
        return await self._route(nsid, "Reservation Report",
                                 lambda ctrl: ctrl.resv_report(nsid, eds=eds, size=size))

    # ---- admin look-ups through any live path ----------------------------------------------------

    async def _any(self, what: str, call: Callable[[HostController], Awaitable[T]]) -> T:
        last: BaseException | None = None
        for path in self._paths:
            ctrl = path.ctrl
            if ctrl is None:
                continue
            try:
                return await call(ctrl)
            except _PATH_FAILURES as err:
                last = err
                self._on_broken(path, ctrl, err)
        raise NoPathError(f"{what} on {self.subnqn}: no live path: {self._down_reasons()}") from last

    async def namespace_geometry(self, nsid: int) -> NamespaceGeometry:
        return await self._any("Identify Namespace", lambda ctrl: ctrl.namespace_geometry(nsid))

    async def namespaces(self) -> list[int]:
        return await self._any("Identify active namespace list", lambda ctrl: ctrl.namespaces())

    async def identify_namespace(self, nsid: int) -> Any:
        return await self._any("Identify Namespace", lambda ctrl: ctrl.identify_namespace(nsid))

    # ---- state -------------------------------------------------------------------------------

    @property
    def controllers(self) -> list[HostController]:
        """The live paths' controllers, in path order."""
        return [p.ctrl for p in self._paths if p.ctrl is not None]

    def paths(self) -> list[PathInfo]:
        """Each path: address, CNTLID, live or not, and its namespaces' ANA states (nvme list-subsys)."""
        out = []
        for p in self._paths:
            ctrl = p.ctrl
            states: dict[int, str] = {}
            if ctrl is not None and ctrl.ana_log is not None:
                states = {nsid: _state_name(g.state) for g in ctrl.ana_log.groups for nsid in g.nsids}
                for nsid in p.pending:
                    states[nsid] = "pending"
            out.append(PathInfo(p.traddr, p.trsvcid, ctrl.cntlid if ctrl is not None else None, ctrl is not None,
                                dict(sorted(states.items())), p.reconnects, p.ios, p.error))
        return out

    async def wait_paths(self, live: int | None = None, timeout: float = 30.0) -> None:
        """Wait until ``live`` paths (default: all) are connected; TimeoutError after ``timeout``."""
        want = len(self._paths) if live is None else live
        async with asyncio.timeout(timeout):
            while sum(p.ctrl is not None for p in self._paths) < want:
                await self._changed.wait()

    # ---- closing -------------------------------------------------------------------------------

    async def _finish(self, how: str) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for p in self._paths for t in (p.reconnect, p.reread) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        ctrls = [p.ctrl for p in self._paths if p.ctrl is not None]
        for p in self._paths:
            p.ctrl = None
        await asyncio.gather(*(getattr(ctrl, how)() for ctrl in ctrls), return_exceptions=True)
        self._notify()



def _state_name(state: AnaState | int | None) -> str:
    if state is None:
        return "unknown"
    if isinstance(state, AnaState):
        return ANA_STATE_NAMES[state]
    return f"reserved state {state:#x}"


def _describe_groups(ctrl: HostController) -> str:
    ana = ctrl.ana_log
    if ana is None:
        return "no log"
    return ", ".join(f"group {g.anagrpid} {_state_name(g.state)}" for g in ana.groups) or "no groups"


def _log_task_error(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("closing a lost path failed: %s", task.exception())
