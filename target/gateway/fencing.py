"""Fencing a dead gateway's Ceph clients before its ANA groups are served OPTIMIZED elsewhere.

``TakeoverFence``: before a takeover while some member is not alive, blocklist that member's published
librados client addresses (rados_blocklist_add, GATEWAY_BLOCKLIST_EXPIRE) and break the exclusive lock of each
of the group's RBD images those clients own (never a live member's or ours), in a thread bounded by the store
timeout; a failure is a WARNING and the takeover goes on. The other side: a member fenced by another
(ESHUTDOWN) steps down and takes no part until ``recheck()`` finds none of its addresses on the OSD blocklist.
Why (the store's lease does not stop a dead member's librbd) and the details: ARCHITECTURE.md, "Gateway group",
fencing.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from nvmeof import defaults
from target.backends import rbd as rbd_backend
from target.gateway.store import GroupStore, MemberRecord, StoreError

if TYPE_CHECKING:
    import asyncio

    from target.service import TargetService

log = logging.getLogger("nvmeof.gateway")

BLOCKLIST_NOTE = ("writes to its RBD images may stall until the OSD drops the dead client's watch "
                  "(osd_client_watch_timeout, ~30 s), and a gateway that is cut off rather than dead could still "
                  "write to them when it comes back")


class FencedGroup(Protocol):
    """What a fence asks of the gateway group member it serves (target/gateway/group.py GatewayGroup), so
    this module does not import the one that imports it. The underscored members are the group's internals
    shared inside this package: its event loop, its bounded store calls, its wake-up and its step-down."""

    name: str
    owned: set[int]
    store: GroupStore
    service: TargetService
    _loop: asyncio.AbstractEventLoop | None
    _published: dict[str, Any] | None   # what this member last published of itself (its clients among it)
    _wake: asyncio.Event                 # wakes the member's step loop

    def _run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Awaitable[Any]: ...
    def _notified(self) -> None: ...
    def _step_down(self, groups: list[int], why: str) -> Awaitable[None]: ...


def split_addrs(text: str) -> list[str]:
    """Rados.get_addrs() as a list of addresses ``ip:port/nonce``: one address, or an address vector
    ``[v2:ip:port/nonce,v1:ip:port/nonce]`` (its entries are one client: the same nonce twice)."""
    out: list[str] = []
    for part in text.strip().strip("[]").split(","):
        part = part.strip()
        for prefix in ("v2:", "v1:", "any:"):
            part = part.removeprefix(prefix)
        if part and part not in out:
            out.append(part)
    return out


def identity(cluster: Any) -> dict[str, Any] | None:
    """{"entity": "client.N", "addrs": [...]} of a connected librados handle, None if it has none (closed)."""
    try:
        return {"entity": f"client.{cluster.get_instance_id()}", "addrs": split_addrs(str(cluster.get_addrs()))}
    except Exception:  # a handle shut down meanwhile: it is no client of ours any more
        return None


def local_clusters(store: Any = None) -> list[Any]:
    """Every librados handle this process uses: the group store's (if it is a RADOS one) and the RBD backend's."""
    out = []
    own = store.cluster if store is not None else None
    if own is not None:
        out.append(own)
    out.extend(c for c in rbd_backend.client_clusters() if c is not own)
    return out


def local_identities(store: Any = None, target: Any = None) -> list[dict[str, Any]]:
    """This gateway's clients: this process's, then (``target`` given) those of its --workers processes, which
    open every RBD namespace with librados clients of their own (target/worker.py reports them)."""
    out = []
    for cluster in local_clusters(store):
        ident = identity(cluster)
        if ident is not None and ident not in out:
            out.append(ident)
    out.extend(worker_identities(target))
    return out


def worker_identities(target: Any) -> list[dict[str, Any]]:
    """The librados clients of the other processes serving ``target``'s queues (Target.ceph_clients)."""
    return list(target.ceph_clients()) if target is not None else []


def any_cluster(store: Any = None) -> Any:
    """A librados handle to send the blocklist command with (the store's first), or None."""
    clusters = local_clusters(store)
    return clusters[0] if clusters else None


def blocklisted_addrs(cluster: Any) -> dict[str, str]:
    """The addresses on the OSD blocklist now (`ceph osd blocklist ls`: [{"addr", "until"}]), as split_addrs
    spells them, each with until when. Blocks; StoreError when the monitor refuses or does not answer."""
    if cluster is None:
        raise StoreError("this gateway has no Ceph client left to ask the monitor with")
    try:
        ret, out, errs = cluster.mon_command(json.dumps({"prefix": "osd blocklist ls", "format": "json"}), b"")
    except Exception as exc:
        raise StoreError(f"osd blocklist ls failed: {exc}") from exc
    if ret != 0:
        raise StoreError(f"osd blocklist ls failed: {errs or 'error'} ({ret})")
    # the monitor may answer several JSON values one after the other (16.2.15 here: json.loads stopped with
    # "Extra data" after the first array), so every array is read
    text, entries, pos = (out or b"").decode(errors="replace"), [], 0
    decoder = json.JSONDecoder()
    try:
        while text[pos:].strip():
            pos += len(text[pos:]) - len(text[pos:].lstrip())
            value, pos = decoder.raw_decode(text, pos)
            entries.extend(value if isinstance(value, list) else [])
    except ValueError as exc:
        raise StoreError(f"osd blocklist ls answered what is not JSON: {exc}") from exc
    listed: dict[str, str] = {}
    for entry in entries:
        if isinstance(entry, dict) and entry.get("addr"):
            for addr in split_addrs(str(entry["addr"])):
                listed[addr] = str(entry.get("until") or "?")
    return listed


def member_addrs(members: Iterable[MemberRecord]) -> set[str]:
    out: set[str] = set()
    for m in members:
        for client in m.info.get("clients") or []:
            if isinstance(client, dict):
                out.update(str(a) for a in client.get("addrs") or [])
    return out


@dataclasses.dataclass
class FenceResult:
    member: str
    blocklisted: list[str] = dataclasses.field(default_factory=list)
    broken: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def fenced(self) -> bool:
        return not self.errors


def fence_member(dead: MemberRecord, live: Iterable[MemberRecord], backends: Iterable[Any], *, cluster: Any,
                 expire: int = defaults.GATEWAY_BLOCKLIST_EXPIRE, done: set[str] | None = None,
                 own: Iterable[str] = ()) -> FenceResult:
    """Blocklist ``dead``'s client addresses (those in ``done`` already are skipped, and added there) and break
    each of ``backends``' exclusive locks held by one of them. An address a live member or this process
    (``own``) publishes is never blocklisted and its lock never broken, whatever the dead record says. Blocks."""
    result = FenceResult(dead.name)
    protected = member_addrs(live) | set(own) | {a for i in local_identities() for a in i["addrs"]}
    targets = member_addrs([dead]) - protected
    done = done if done is not None else set()
    for addr in sorted(targets - done):
        if cluster is None:
            result.errors.append(f"blocklisting {addr}: this gateway has no connection to the cluster")
            continue
        try:
            cluster.blocklist_add(addr, int(expire))
        except Exception as exc:  # EPERM without mon caps "osd blocklist", ETIMEDOUT without a monitor
            result.errors.append(f"blocklisting {addr} failed: {exc}")
            continue
        done.add(addr)
        result.blocklisted.append(addr)
    for backend in backends:
        try:
            owners = backend.exclusive_lock_owners()
        except Exception as exc:
            result.errors.append(f"reading the exclusive lock of {backend.describe().get('image')}: {exc}")
            continue
        for owner in owners:
            addr = str(owner.get("owner"))
            if addr not in targets:
                continue  # a live member's, ours, or a client nobody publishes: not ours to break
            try:
                backend.break_exclusive_lock(int(owner.get("mode", 0)), addr)
                result.broken.append(addr)
            except Exception as exc:
                if getattr(exc, "errno", None) == errno.ENOENT:
                    continue  # released meanwhile (the OSD dropped the blocklisted client's watch)
                result.errors.append(f"breaking the exclusive lock of {backend.describe().get('image')} "
                                     f"held by {addr} failed: {exc}")
    return result


def group_backends(group: FencedGroup, anagrpid: int) -> list[Any]:
    """The backends of ANA group ``anagrpid``'s namespaces here that can hold an exclusive lock (RBD)."""
    return [ns.backend for sub in group.service.list_subsystems() for ns in sub.namespaces.values()
            if ns.anagrpid == anagrpid and ns.backend.has_exclusive_lock]


_fences: weakref.WeakSet[TakeoverFence] = weakref.WeakSet()


def _register(fence: TakeoverFence) -> None:
    """One pair of RBD registry callbacks for the process, reaching every live group's fence (a group that is
    gone is dropped with its fence)."""
    if not _fences:
        rbd_backend.on_new_connection(_each_new_connection)
        rbd_backend.on_blocklisted(_each_blocklisted)
    _fences.add(fence)


def _each_new_connection() -> None:
    for fence in list(_fences):
        fence.group._notified()  # a new client: the next step publishes it


def _each_blocklisted(what: str) -> None:
    for fence in list(_fences):
        fence._blocklisted(what)


class TakeoverFence:
    """A GatewayGroup's fencing: before_takeover() for each group it takes, and its reaction to being fenced."""

    def __init__(self, group: FencedGroup, *, expire: int = defaults.GATEWAY_BLOCKLIST_EXPIRE) -> None:
        self.group = group
        self.expire = expire
        self.fenced: dict[int, bool | None] = {}   # per ANA group: the last takeover fenced (True/False), or None
        self._done: set[str] = set()               # addresses blocklisted already
        self._fenced_at = 0.0
        # fenced here: why this gateway takes no part (None: it does), its addresses when that happened, those
        # seen on the blocklist since, whether the group store's client was among them, and what failed first
        self.reason: str | None = None
        self.fenced_addrs: set[str] = set()
        self._listed_seen: set[str] = set()
        self._store_fenced = False
        self._what = ""
        _register(self)

    async def before_takeover(self, anagrpid: int, members: list[MemberRecord]) -> bool:
        """Fence every member that is not alive and published clients, for group ``anagrpid``; then make sure
        the group's lock is still ours (fencing took time). False: it is not, do not take the group."""
        me = self.group.name
        dead = [m for m in members if not m.alive and m.name != me and member_addrs([m])]
        if not dead:
            self.fenced[anagrpid] = None
            return True
        live = [m for m in members if m.alive and m.name != me]
        backends = group_backends(self.group, anagrpid)
        cluster = any_cluster(self.group.store)
        own = {a for c in worker_identities(self.group.service.target) for a in c.get("addrs") or []}

        def fence_all() -> list[FenceResult]:
            return [fence_member(m, live, backends, cluster=cluster, expire=self.expire, done=self._done, own=own)
                    for m in dead]

        started = time.monotonic()
        try:
            results = await self.group._run(fence_all, timeout=defaults.GATEWAY_STORE_TIMEOUT)
        except StoreError as exc:
            results = [FenceResult(m.name, errors=[f"fencing did not finish within "
                                                   f"{defaults.GATEWAY_STORE_TIMEOUT:g} s ({exc})"]) for m in dead]
        took = time.monotonic() - started
        for r in results:
            if r.fenced:
                if r.blocklisted or r.broken:
                    log.info("ANA group %d: %s fenced gateway %s before taking over in %.2f s (blocklisted: %s; "
                             "broke the exclusive lock held by: %s)", anagrpid, me, r.member, took,
                             ", ".join(r.blocklisted) or "none new", ", ".join(r.broken) or "none")
            else:
                log.warning("ANA group %d: %s could not fence gateway %s (%s); taking over anyway: %s", anagrpid,
                            me, r.member, "; ".join(r.errors), BLOCKLIST_NOTE)
        self.fenced[anagrpid] = all(r.fenced for r in results)
        try:
            if await self.group._run(self.group.store.renew, anagrpid):
                return True
        except StoreError as exc:
            log.warning("ANA group %d: %s could not renew its lock after fencing (%s)", anagrpid, me, exc)
        # Not ours any more: stop counting it as held, so it is neither renewed nor left locked for nobody.
        self.group.store.forget(anagrpid)
        log.warning("ANA group %d: %s lost its lock while fencing; not taking it", anagrpid, me)
        return False

    def _blocklisted(self, what: str) -> None:
        """rbd.on_blocklisted (any thread): step down on the event loop."""
        loop = self.group._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(lambda: loop.create_task(self.fenced_here(what)))

    async def fenced_here(self, what: str) -> None:
        """This gateway's Ceph client was blocklisted: another member took its groups over and fenced it."""
        group = self.group
        if not self.fenced_addrs:  # the published clients too: the registry dropped the blocklisted one already
            published = (group._published or {}).get("clients") or []
            now_used = local_identities(group.store, group.service.target)
            self.fenced_addrs = {str(a) for c in [*published, *now_used] for a in c.get("addrs") or []}
            self._what = what
            self.reason = (f"its Ceph client was blocklisted ({what} failed with ESHUTDOWN/EBLOCKLISTED): another "
                           "gateway fenced it; it checks the OSD blocklist at each step to rejoin")
        if time.monotonic() - self._fenced_at < group.store.lease and not group.owned:
            return  # said already; nothing left to give up
        self._fenced_at = time.monotonic()
        log.error("gateway %s: its Ceph client is blocklisted (%s failed with ESHUTDOWN/EBLOCKLISTED): another "
                  "gateway fenced it after taking over; stepping down for ANA group(s) %s; it takes part again once "
                  "its addresses are off the OSD blocklist", group.name, what,
                  ", ".join(str(g) for g in sorted(group.owned)) or "none")
        if group.owned:
            await group._step_down(sorted(group.owned), "its Ceph client was blocklisted by another gateway")

    async def store_failed(self, exc: BaseException) -> None:
        """The group store failed with ``exc``: if that is our client being blocklisted, step down at once
        (the lease would do it too, later)."""
        text = str(exc)
        if "108" in text or "blocklist" in text.lower() or "shutdown" in text.lower():
            self._store_fenced = True
            await self.fenced_here(f"the group store {group_where(self.group)}")

    async def recheck(self) -> None:
        """While fenced (each step): read the OSD blocklist; once none of this gateway's addresses is on it,
        reconnect the group store through a new client (if its client was fenced) and take part again, or say
        exactly why not (self.reason: the log and `gateway list`)."""
        group = self.group
        store = group.store
        try:
            listed = await group._run(blocklisted_addrs, any_cluster(store))
        except StoreError as exc:
            self._say(f"its Ceph client was blocklisted ({self._what}); whether it still is cannot be read: {exc}")
            return
        still = sorted(self.fenced_addrs & set(listed))
        self._listed_seen |= set(still)
        if still:
            until = ", ".join(f"{addr} until {listed[addr]}" for addr in still)
            self._say(f"its Ceph client address(es) {until} are on the OSD blocklist (another gateway "
                      f"fenced it after {self._what} failed); it takes part again once they are off it (ceph osd "
                      "blocklist rm ADDR, or when the entry expires)")
            return
        stale = stale_namespaces(group, self._listed_seen)
        if stale:
            self._say(f"its addresses are off the OSD blocklist, but RBD namespace(s) {', '.join(stale)} were opened "
                      "through a blocklisted client, and images are not re-opened while the gateway runs: restart "
                      "this gateway to serve them through a new client")
            return
        own = {a for c in local_identities(store) for a in c["addrs"]}
        if store.has_client and (self._store_fenced or own & self._listed_seen):
            try:
                await group._run(store.reconnect, timeout=store.lease + defaults.GATEWAY_STORE_TIMEOUT + 10)
            except StoreError as exc:
                self._say(f"its addresses are off the OSD blocklist, but reconnecting to the group store failed: "
                          f"{exc}")
                return
        log.info("gateway %s: its Ceph clients are off the OSD blocklist; it takes part in the group again%s",
                 group.name, " through a new group store client " + ", ".join(
                     i["entity"] for i in local_identities(store)[:1]) if self._store_fenced else "")
        self.reason, self.fenced_addrs, self._listed_seen, self._store_fenced = None, set(), set(), False
        group._wake.set()

    def _say(self, reason: str) -> None:
        if reason != self.reason:
            log.error("gateway %s takes no part in the group: %s", self.group.name, reason)
        self.reason = reason


def stale_namespaces(group: FencedGroup, listed: set[str]) -> list[str]:
    """RBD namespaces served through a client that was blocklisted: in this process (its connection left the RBD
    registry), or every RBD namespace when a worker's client was listed (workers open every namespace)."""
    workers = any(a in listed for c in worker_identities(group.service.target) for a in c.get("addrs") or [])
    out = []
    for sub in group.service.list_subsystems():
        for ns in sub.namespaces.values():
            backend = ns.backend
            if backend.client_blocklisted or (workers and backend.has_exclusive_lock):
                info = backend.describe()
                out.append(f"{sub.nqn} nsid {ns.nsid} ({info.get('pool')}/{info.get('image')})")
    return out


def group_where(group: FencedGroup) -> str:
    return group.store.where
