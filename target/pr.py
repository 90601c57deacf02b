"""Reservation commands on the I/O queues, their notifications, and where the state is kept.

Mirrors Linux nvmet pr.c (parse, execute, notifications, preempt-and-abort waiting for the preempted
host's commands) over the rules of target/reservations.py. Every change is committed to the target's
``PrStore`` before anyone sees it (ARCHITECTURE.md, "Reservations"): ``LocalPrStore`` keeps a namespace's
state in a file while PTPL is on (so it survives kill -9 and restarts, and without PTPL a restart clears
it, as the spec says); in a gateway group target/gateway/prstore.py keeps it in the group's store with
compare-and-swap, and the other members apply each committed version before the command completes.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nvmeof.spec.nvme import Direction, IoOpcode
from nvmeof.spec.reservations import (
    ACQUIRE_DATA_SIZE,
    ACTION_MASK,
    CNTLID_DYNAMIC,
    CPTPL_SHIFT,
    EXT_HEADER_SIZE,
    IEKEY,
    REGISTER_DATA_SIZE,
    RELEASE_DATA_SIZE,
    REPORT_EDS,
    RTYPE_NAMES,
    RTYPE_SHIFT,
    NotificationType,
    Registrant,
    ReservationType,
    build_report,
)
from nvmeof.status import NvmeError, Status
from target import config as configmod
from target import reservations as rules
from target.reservations import EMPTY, Outcome, ReservationState

if TYPE_CHECKING:
    from target.model import Namespace, Subsystem
    from target.ports import ReservationHost
    from target.request import Request

log = logging.getLogger(__name__)

RESV_OPCODES = frozenset({IoOpcode.RESV_REGISTER, IoOpcode.RESV_REPORT, IoOpcode.RESV_ACQUIRE,
                          IoOpcode.RESV_RELEASE})
COMMIT_RETRIES = 8          # compare-and-swap rounds a command tries before it reports the store busy
ABORT_DRAIN_TIMEOUT = 30.0  # seconds preempt-and-abort waits for the preempted hosts' commands
RESV_DATA_MAX = 4096        # the most data a Register/Acquire/Release may carry (only the first 8-16 bytes count)
REPORT_MAX = 64 * 1024      # the most a Reservation Report returns (NUMD beyond: cut, as REGCTL still counts all)


class PrStale(Exception):
    """A commit lost its compare-and-swap: the store holds ``version`` / ``state`` now."""

    def __init__(self, version: int, state: dict[str, Any] | None) -> None:
        super().__init__(f"reservation state is at version {version} now")
        self.version = version
        self.state = state


class PrStoreError(Exception):
    """The store could not be read or written; the message says what to do."""


class PrStore(abc.ABC):
    """Where namespaces' reservation states live, by key (the namespace UUID). Blocking calls."""

    @abc.abstractmethod
    def load(self, key: str) -> tuple[int, dict[str, Any] | None]:
        """(version, state) as stored; (0, None) when nothing is kept."""

    @abc.abstractmethod
    def commit(self, key: str, state: dict[str, Any], expected: int, change: dict[str, Any]) -> int:
        """Store ``state`` if the version is still ``expected``; returns the new version, PrStale if not.
        ``change`` (notifications, aborted hosts) travels with it to the other members of a group."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Forget ``key`` (its namespace was removed)."""

    async def published(self, key: str, version: int) -> None:  # noqa: B027 (a no-op for one target)
        """Return once every member that serves the namespace applied ``version`` (gateway groups)."""


class LocalPrStore(PrStore):
    """One JSON file per namespace under ``directory``, written only while PTPL is on (atomic rename +
    fsync); turning PTPL off deletes it, so the next start begins with no reservation."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self._versions: dict[str, int] = {}

    def _path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise PrStoreError(f"reservation key {key!r} is not a namespace UUID")
        return self.directory / f"{key}.json"

    def load(self, key: str) -> tuple[int, dict[str, Any] | None]:
        try:
            data = json.loads(self._path(key).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return self._versions.get(key, 0), None
        except (OSError, ValueError) as exc:
            raise PrStoreError(f"cannot read the reservation state {self._path(key)}: {exc}; fix or remove the "
                               "file (removing it drops the namespace's registrations)") from exc
        version = int(data.get("version", 0))
        self._versions[key] = max(self._versions.get(key, 0), version)
        return version, data.get("state")

    def commit(self, key: str, state: dict[str, Any], expected: int, change: dict[str, Any]) -> int:
        current = self._versions.get(key, 0)
        if current != expected:
            raise PrStale(current, None)
        path = self._path(key)
        version = current + 1
        if state.get("ptpl"):
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                configmod.save_config(path, {"version": version, "state": state})   # atomic, fsync'd, 0600
            except (OSError, configmod.ConfigError) as exc:
                raise PrStoreError(f"cannot save the reservation state in {self.directory}: {exc}") from None
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._versions[key] = version
        return version

    def delete(self, key: str) -> None:
        self._versions.pop(key, None)
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()


def key_of(ns: Namespace) -> str:
    return str(ns.uuid)


# --- parse ---------------------------------------------------------------------------------------

def parse(req: Request, ns: Namespace, target: ReservationHost) -> None:
    """The four reservation commands (nvmet_parse_pr_cmd)."""
    if not target.reservations_supported:
        raise NvmeError(Status.INVALID_OPCODE, "reservations are not served by this target "
                        "(serve --workers keeps no reservation state in its worker processes)")
    op = req.cmd.opcode
    if op == IoOpcode.RESV_REGISTER:
        req.expect(Direction.H2C, _data_len(req, REGISTER_DATA_SIZE), _register)
    elif op == IoOpcode.RESV_ACQUIRE:
        req.expect(Direction.H2C, _data_len(req, ACQUIRE_DATA_SIZE), _acquire)
    elif op == IoOpcode.RESV_RELEASE:
        req.expect(Direction.H2C, _data_len(req, RELEASE_DATA_SIZE), _release)
    else:
        size = 4 * ((req.cmd.cdw10 & 0xFFFFFFFF) + 1)
        if size > REPORT_MAX:
            raise NvmeError(Status.INVALID_FIELD, f"Reservation Report NUMD asks {size} bytes; at most {REPORT_MAX}")
        req.expect(Direction.C2H, size, _report)


def _data_len(req: Request, needed: int) -> int:
    """What the host sends may be longer than the command's data: the Linux host sends Reservation Release with
    its 16-byte buffer (nvme_send_pr_command), and nvmet reads only the first bytes (nvmet_copy_from_sgl)."""
    length = req.cmd.sgl().length
    if length < needed:
        raise NvmeError(Status.SGL_INVALID_DATA, f"opcode {req.cmd.opcode:#04x} carries {needed} bytes of data; the "
                        f"SGL describes {length}")
    if length > RESV_DATA_MAX:
        raise NvmeError(Status.SGL_INVALID_DATA, f"opcode {req.cmd.opcode:#04x} with {length} bytes of data "
                        f"(at most {RESV_DATA_MAX})")
    return length


def conflict(ns: Namespace, ctrl_hostid: bytes, op: int) -> NvmeError:
    state = ns.pr
    return NvmeError(Status.RESERVATION_CONFLICT,
                     f"namespace {ns.nsid} holds a {RTYPE_NAMES[ReservationType(state.rtype)]} reservation "
                     f"({'registered' if state.key_of(ctrl_hostid) is not None else 'not registered'} host, "
                     f"opcode {op:#04x})", dnr=True, logged=True)


def tracked(execute: Callable[[Request], Awaitable[None]]) -> Callable[[Request], Awaitable[None]]:
    """Count ``execute`` in flight per host while the namespace has registrants, so that a preempt and
    abort can wait for the preempted host's commands (nvmet_pr_set_ctrl_to_abort + nvmet_pr_do_abort)."""
    async def run(req: Request) -> None:
        ns = req.ns
        ctrl = req.queue.ctrl
        assert ns is not None and ctrl is not None
        inflight = ns.pr_inflight
        hostid = ctrl.hostid
        inflight[hostid] = inflight.get(hostid, 0) + 1
        try:
            await execute(req)
        finally:
            left = inflight.get(hostid, 1) - 1
            if left > 0:
                inflight[hostid] = left
            else:
                inflight.pop(hostid, None)
    return run


# --- execute -------------------------------------------------------------------------------------

def _u64(data: memoryview | bytes, offset: int) -> int:
    return int.from_bytes(data[offset:offset + 8], "little")


def _ctx(req: Request) -> tuple[Namespace, bytes, ReservationHost, Subsystem]:
    ns = req.ns
    ctrl = req.queue.ctrl
    assert ns is not None and ctrl is not None
    return ns, ctrl.hostid, ctrl.target, ctrl.subsystem


async def _register(req: Request) -> None:
    ns, hostid, target, sub = _ctx(req)
    assert req.data is not None
    cdw10 = req.cmd.cdw10
    crkey, nrkey = _u64(req.data, 0), _u64(req.data, 8)
    ptpl = target.pr_store is not None
    await change(target, sub, ns, lambda s: rules.register(
        s, hostid, rrega=cdw10 & ACTION_MASK, iekey=bool(cdw10 & IEKEY), cptpl=(cdw10 >> CPTPL_SHIFT) & 3,
        crkey=crkey, nrkey=nrkey, ptpl_supported=ptpl), req=req)


async def _acquire(req: Request) -> None:
    ns, hostid, target, sub = _ctx(req)
    assert req.data is not None
    cdw10 = req.cmd.cdw10
    crkey, prkey = _u64(req.data, 0), _u64(req.data, 8)
    await change(target, sub, ns, lambda s: rules.acquire(
        s, hostid, racqa=cdw10 & ACTION_MASK, iekey=bool(cdw10 & IEKEY), rtype=(cdw10 >> RTYPE_SHIFT) & 0xFF,
        crkey=crkey, prkey=prkey), req=req)


async def _release(req: Request) -> None:
    ns, hostid, target, sub = _ctx(req)
    assert req.data is not None
    cdw10 = req.cmd.cdw10
    crkey = _u64(req.data, 0)
    await change(target, sub, ns, lambda s: rules.release(
        s, hostid, rrela=cdw10 & ACTION_MASK, iekey=bool(cdw10 & IEKEY), rtype=(cdw10 >> RTYPE_SHIFT) & 0xFF,
        crkey=crkey), req=req)


async def _report(req: Request) -> None:
    ns, _, _, _ = _ctx(req)
    eds = bool(req.cmd.cdw11 & REPORT_EDS)
    if not eds:
        # Connect carries a 128-bit host identifier (Identify CTRATT bit 0), which only the extended data
        # structure can report (nvmet_execute_pr_report answers the same)
        raise NvmeError(Status.HOST_ID_INCONSIST, "Reservation Report without EDS (CDW11 bit 0): host "
                        "identifiers here are 128-bit; ask for the extended data structure (nvme resv-report --eds)")
    if req.data_len < EXT_HEADER_SIZE:
        raise NvmeError(Status.INVALID_FIELD,
                        f"Reservation Report of {req.data_len} bytes cannot hold the {EXT_HEADER_SIZE}-byte header")
    state = ns.pr
    req.reply = build_report(state.generation, state.rtype, state.ptpl, registrants(state), eds=True,
                             size=req.data_len)


def registrants(state: ReservationState) -> list[Registrant]:
    return [Registrant(CNTLID_DYNAMIC, state.holds(h), h, key) for h, key in state.registrants]


# --- change: compute, commit, publish, notify ---------------------------------------------------

async def change(target: ReservationHost, sub: Subsystem, ns: Namespace, op: Callable[[ReservationState], Outcome], *,
                 req: Request | None = None) -> Outcome:
    """Run one reservation operation on ``ns`` atomically: under the namespace's lock, against the state
    its store holds (re-read after a lost compare-and-swap), then publish it, notify, and drain."""
    async with _lock(ns):
        store = target.pr_store
        key = key_of(ns)
        for _ in range(COMMIT_RETRIES):
            before = ns.pr
            out = op(before)
            if out.status:
                raise NvmeError(out.status, out.detail, dnr=True)
            if out.state == before:
                return out
            if store is None:
                ns.pr = out.state
                break
            record = {"events": [[h.hex(), int(t)] for h, t in out.events],
                      "aborted": sorted(h.hex() for h in out.aborted)}
            try:
                version = await asyncio.to_thread(store.commit, key, out.state.to_dict(), ns.pr_version, record)
            except PrStale as stale:
                await refresh(target, ns, stale.version, stale.state)
                continue
            except PrStoreError as exc:
                raise NvmeError(Status.INTERNAL, f"reservation state not saved: {exc}") from None
            ns.pr, ns.pr_version = out.state, version
            break
        else:
            raise NvmeError(Status.NS_NOT_READY, "reservation state kept changing on other gateways; retry",
                            dnr=False)
        deliver(target, sub, ns, out.events)
        if out.aborted:
            await drain(ns, out.aborted)
        if store is not None:
            await store.published(key, ns.pr_version)
        log.info("namespace %d of %s: reservation generation %d, type %s, %d registrant(s)%s", ns.nsid, sub.nqn,
                 out.state.generation, RTYPE_NAMES.get(out.state.rtype, "none"), len(out.state.registrants),
                 f" ({len(out.aborted)} host(s) preempted and aborted)" if out.aborted else "")
        return out


def _lock(ns: Namespace) -> asyncio.Lock:
    """The namespace's reservation lock, made at first use (a Namespace is built outside any event loop)."""
    if ns.pr_lock is None:
        ns.pr_lock = asyncio.Lock()
    return ns.pr_lock


async def refresh(target: ReservationHost, ns: Namespace, version: int | None = None,
                  state: dict[str, Any] | None = None) -> None:
    """Take the stored state (after a lost CAS, or at start); nothing is notified."""
    store = target.pr_store
    if store is None:
        return
    if version is None or state is None:
        version, state = await asyncio.to_thread(store.load, key_of(ns))
    ns.pr = ReservationState.from_dict(state) if state else EMPTY
    ns.pr_version = version


async def apply_remote(target: ReservationHost, sub: Subsystem, ns: Namespace, version: int,
                       state: dict[str, Any] | None, change_record: dict[str, Any] | None) -> None:
    """Another gateway committed ``version``: enforce it here, notify this gateway's controllers of the hosts
    concerned, and let the preempted hosts' commands here finish before that gateway's command completes."""
    async with _lock(ns):
        if version <= ns.pr_version:
            return
        fresh = version == ns.pr_version + 1
        ns.pr = ReservationState.from_dict(state) if state else EMPTY
        ns.pr_version = version
    if change_record and fresh:
        events = [(bytes.fromhex(h), NotificationType(t)) for h, t in change_record.get("events", ())]
        deliver(target, sub, ns, events)
        aborted = {bytes.fromhex(h) for h in change_record.get("aborted", ())}
        if aborted:
            await drain(ns, aborted)


def deliver(target: ReservationHost, sub: Subsystem, ns: Namespace,
            events: Iterable[tuple[bytes, NotificationType]]) -> None:
    """Post each notification to every controller of that host on this subsystem (nvmet_pr_send_event_to_host)."""
    by_host: dict[bytes, list[NotificationType]] = {}
    for hostid, kind in events:
        by_host.setdefault(hostid, []).append(kind)
    if not by_host:
        return
    for ctrl in list(target.controllers.values()):
        if ctrl.subsystem is sub and not ctrl.closed and ctrl.hostid in by_host and ns.visible_to(ctrl.hostnqn):
            for kind in by_host[ctrl.hostid]:
                ctrl.reservation_notice(kind, ns.nsid)


async def drain(ns: Namespace, hosts: set[bytes], timeout: float = ABORT_DRAIN_TIMEOUT) -> None:
    """Wait until no command of ``hosts`` runs on ``ns`` (new ones already see the new state)."""
    deadline = time.monotonic() + timeout
    while any(h in ns.pr_inflight for h in hosts):
        if time.monotonic() > deadline:
            log.warning("namespace %d: preempted hosts still have commands running after %.0f s", ns.nsid, timeout)
            return
        await asyncio.sleep(0.002)


async def clear_on_start(target: ReservationHost, ns: Namespace) -> None:
    """A namespace appears (start, restore, add): its state as its store keeps it (PTPL), else none."""
    try:
        await refresh(target, ns)
    except (PrStoreError, ValueError) as exc:
        log.error("namespace %d: reservation state not restored: %s", ns.nsid, exc)


async def forget(target: ReservationHost, ns: Namespace) -> None:
    """The namespace was removed: its registrations go with it."""
    store = target.pr_store
    if store is None:
        return
    try:
        await asyncio.to_thread(store.delete, key_of(ns))
    except (PrStoreError, OSError) as exc:
        log.warning("namespace %d: its reservation state could not be removed: %s", ns.nsid, exc)


def report(ns: Namespace, hostnqns: dict[bytes, list[str]]) -> dict[str, Any]:
    """The operator's view (REST, CLI, dashboard): keys are never shown, only whether one is set."""
    state = ns.pr
    holder = None
    if state.rtype and not ReservationType(state.rtype).all_registrants and state.holder is not None:
        holder = state.holder.hex()
    return {
        "generation": state.generation,
        "rtype": state.rtype,
        "type": RTYPE_NAMES.get(state.rtype, "none") if state.rtype else "none",
        "ptpl": state.ptpl,
        "holder": holder,
        "all_registrants_hold": bool(state.rtype) and ReservationType(state.rtype).all_registrants,
        "registrants": [{"hostid": h.hex(), "hostnqns": sorted(hostnqns.get(h, ())), "holds": state.holds(h),
                         "rkey": "<redacted>"} for h, _ in state.registrants],
    }
