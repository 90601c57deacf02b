"""GatewayGroup: one member of a gateway group (asyncio), driving its TargetService.

Joins the group's store, publishes this member, runs the ownership loop (take, renew, release the ANA group
locks; failover and failback), sets the ANA states of its listeners, keeps the shared configuration in step
with the store (change hook with compare-and-swap, TargetService.reload) and the peers' listeners in the
discovery log. The rules (index, CNTLID range, preferred owner, candidate, failback, states, fencing
deadline): ARCHITECTURE.md, "Gateway group".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import ipaddress
import logging
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

from nvmeof import defaults
from nvmeof.spec.logs import ANA_STATE_NAMES, AnaState
from target.gateway.fencing import TakeoverFence, local_identities
from target.gateway.prstore import GroupPrStore
from target.gateway.store import (
    ConfigConflict,
    GroupStore,
    MemberAlive,
    MemberRecord,
    MemberRemoved,
    MemberUnknown,
    StoreError,
    now,
)
from target.model import Listener
from target.service import ServiceError, TargetService

log = logging.getLogger("nvmeof.gateway")

FAILBACK = ("auto", "manual")
STANDBY = {"non-optimized": AnaState.NON_OPTIMIZED, "inaccessible": AnaState.INACCESSIBLE}
# True in the task applying the store's configuration here: the changes that makes are the store's own, not
# pushed back to it. A context variable, not a flag: a REST change committing meanwhile (another task) is pushed.
_APPLYING: contextvars.ContextVar[bool] = contextvars.ContextVar("gateway_applying", default=False)


def cntlid_range(index: int) -> tuple[int, int]:
    return index * defaults.CNTLID_SPAN + 1, (index + 1) * defaults.CNTLID_SPAN


def preferred_owner(anagrpid: int, members: list[MemberRecord]) -> MemberRecord | None:
    """Member at position (g - 1) % n of all recorded members by index: stable across restarts."""
    ordered = sorted(members, key=lambda m: m.index)
    return ordered[(anagrpid - 1) % len(ordered)] if ordered else None


def candidate(anagrpid: int, members: list[MemberRecord], eligible: Callable[[MemberRecord], bool]) -> str | None:
    """The preferred owner if eligible, else the next eligible member after it in index order."""
    ordered = sorted(members, key=lambda m: m.index)
    if not ordered:
        return None
    start = (anagrpid - 1) % len(ordered)
    for step in range(len(ordered)):
        member = ordered[(start + step) % len(ordered)]
        if eligible(member):
            return member.name
    return None


def shared_part(config: dict[str, Any]) -> dict[str, Any]:
    """What the members of a group share: the subsystems (their namespaces and hosts inside)."""
    return {"subsystems": config.get("subsystems", [])}


def _wildcard(traddr: str) -> bool:
    try:
        return ipaddress.ip_address(traddr).is_unspecified
    except ValueError:
        return False


class GatewayGroup:
    def __init__(self, service: TargetService, store: GroupStore, *, name: str, failback: str = "auto",
                 standby: AnaState = AnaState.NON_OPTIMIZED, tick: float | None = None) -> None:
        if failback not in FAILBACK:
            raise ValueError(f"--failback {failback!r}: use auto or manual")
        if standby not in STANDBY.values():
            raise ValueError("--ana-standby: use non-optimized or inaccessible")
        self.service = service
        self.store = store
        self.name = name
        self.failback = failback
        self.standby = standby
        # a group nobody claims: never inaccessible everywhere (ANA change makes hosts retry for ANATT)
        self.unowned_state = AnaState.NON_OPTIMIZED if standby == AnaState.NON_OPTIMIZED else AnaState.CHANGE
        self.tick = tick if tick is not None else store.lease / 3
        self.index: int | None = None
        self.owned: set[int] = set()
        self.members: list[MemberRecord] = []
        self.config_version = 0
        self._applied_shared: dict[str, Any] | None = None
        self._applied: dict[int, AnaState] = {}
        self._published: dict[str, Any] | None = None
        self._claims: dict[int, str] = {}
        self._unclaimed_since: dict[int, float] = {}
        self._store_ok = True
        self._wake = asyncio.Event()
        self._resv_wake = asyncio.Event()
        self.prstore: GroupPrStore | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False
        self._ready = False
        self.removed: str | None = None  # why this member was dropped from the store (see _removed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="gateway-store")
        self._step_lock = asyncio.Lock()
        self.fence = TakeoverFence(self)  # fencing a dead member's Ceph clients on takeover (fencing.py)

    @property
    def group_name(self) -> str:
        return self.store.group

    # --- store calls off the event loop, bounded ---------------------------------------------------
    async def _run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        loop = asyncio.get_running_loop()
        limit = timeout if timeout is not None else defaults.GATEWAY_STORE_TIMEOUT + 2
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._executor, fn, *args), limit)
        except TimeoutError:
            raise StoreError(f"group store {self.store.where} did not answer within {limit:g} s") from None

    # --- lifecycle --------------------------------------------------------------------------------
    async def join(self) -> int:
        """Register in the store and take this member's CNTLID range (before any listener starts)."""
        self._loop = asyncio.get_running_loop()
        self.index = await self._run(self.store.join, self.name, self._info(), timeout=self.store.lease + 30)
        lo, hi = cntlid_range(self.index)
        self.service.target.set_cntlid_range(lo, hi)
        # Before any listener exists: a group this member holds no lock for is never optimized here, whatever
        # adds it later (a namespace in a new group, a listener from the file, REST or SIGHUP).
        self.service.target.set_ana_default(self.unowned_state)
        self.service.join_gateway(self)
        # reservations live in the group's store from now on, before any namespace is restored here
        self.prstore = GroupPrStore(self.store, self.service.target)
        self.service.target.set_pr_store(self.prstore)
        members = await self._run(self.store.members)
        if not any(m.alive and m.name != self.name for m in members):
            cleared = await self._run(self.prstore.forget_volatile)
            if cleared:
                log.info("gateway %s: the whole group was down; %d reservation state(s) without PTPL cleared",
                         self.name, cleared)
        self.store.watch(self._notified)
        log.info("gateway %s joined group %s (%s) as member %d: controller IDs %d-%d", self.name, self.store.group,
                 self.store.where, self.index, lo, hi)
        return self.index

    async def stored_config(self) -> dict[str, Any] | None:
        version, config = await self._run(self.store.get_config)
        return config if version else None

    async def adopt(self) -> list[str]:
        """Apply the group's configuration here, or (first member) publish ours as version 1."""
        version, config = await self._run(self.store.get_config)
        if version == 0 or config is None:
            shared = shared_part(self.service.live_config())
            try:
                self.config_version = await self._run(self.store.put_config, shared, 0)
                self._applied_shared = shared
                log.info("gateway %s: the group's configuration starts from this gateway's (%d subsystem(s))",
                         self.name, len(shared["subsystems"]))
                return []
            except ConfigConflict:
                version, config = await self._run(self.store.get_config)
        return await self._apply_config(version, config or {"subsystems": []})

    def _warn_shared_keys(self) -> None:
        """DH-HMAC-CHAP keys travel in the shared configuration; in RADOS every client that may read the pool
        reads them (a dir store keeps them 0600 like the daemon's own file)."""
        if self.store.kind != "rados":
            return
        keyed = sorted({sub.get("nqn", "?") for sub in shared_part(self.service.live_config())["subsystems"]
                        for host in sub.get("hosts") or [] if isinstance(host, dict)
                        and (host.get("dhchap_key") or host.get("dhchap_ctrl_key"))})
        if keyed:
            log.warning("gateway %s: the DH-HMAC-CHAP keys of %s are stored in plain text in %s in %s; "
                        "restrict read access to that pool to the gateways' cephx key", self.name, ", ".join(keyed),
                        self.store.config_location, self.store.where)

    async def start(self) -> None:
        """Apply the first states (nothing owned yet) and run the ownership loop."""
        self._warn_shared_keys()
        self._ready = True
        self.service.join_gateway(self)
        self.service.set_change_hook(self._on_change)
        await self._apply_states()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run_loop(), name="gateway-group"),
                       loop.create_task(self._resv_loop(), name="gateway-reservations"),
                       loop.create_task(self._renew_loop(), name="gateway-renew"),
                       loop.create_task(self._fence_loop(), name="gateway-fence")]

    async def stop(self) -> None:
        """A clean exit: standby first (hosts move), then release the locks so a survivor takes over at once."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.service.set_change_hook(None)
        given = sorted(self.owned)
        self.owned.clear()
        if given:
            with contextlib.suppress(ServiceError):
                await self._apply_states()
            for g in given:
                log.info("ANA group %d: %s gives up ownership (shutting down)", g, self.name)
        with contextlib.suppress(StoreError):
            await self._run(self.store.close)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _notified(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)
            loop.call_soon_threadsafe(self._resv_wake.set)

    async def _resv_loop(self) -> None:
        """Apply the reservation versions other members commit, at each store notification (and every tick,
        in case one was missed); a task of its own, so a slow ownership step never delays enforcement."""
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._resv_wake.wait(), self.tick)
            self._resv_wake.clear()
            if self.prstore is None:
                continue
            try:
                await self.prstore.sync()
            except asyncio.CancelledError:
                raise
            except Exception:  # the store out of reach, a bug: log it, go on at the next notification
                log.exception("gateway %s: applying the group's reservation changes failed", self.name)

    # --- what this member publishes ---------------------------------------------------------------
    def _io_listeners(self) -> list[Listener]:
        return [lst for lst in self.service.list_listeners() if not lst.discovery]

    def _listener_entries(self) -> list[dict[str, Any]]:
        out = []
        for lst in self._io_listeners():
            out.append({"trtype": lst.trtype, "adrfam": lst.adrfam, "traddr": lst.traddr,
                        "trsvcid": self.service.target.listening_port(lst), "portid": lst.portid,
                        **({"tls": lst.tls} if lst.tls != "none" else {})})   # discovery's TREQ/SECTYPE
        return out

    def _eligible_me(self) -> bool:
        return self._ready and self._store_ok and self.not_taking_part is None and bool(self._io_listeners())

    def _info(self) -> dict[str, Any]:
        lo, hi = cntlid_range(self.index) if self.index is not None else (0, 0)
        return {
            "ready": self._eligible_me(),
            "listeners": self._listener_entries() if self.index is not None else [],
            "owns": sorted(self.owned),
            "ana": {str(g): ANA_STATE_NAMES[st] for g, st in sorted(self._applied.items())},
            "cntlid_range": [lo, hi],
            "failback": self.failback,
            "standby": ANA_STATE_NAMES[self.standby],
            "config_version": self.config_version,
            "clients": local_identities(self.store, self.service.target),  # its Ceph clients, for fencing
            "not_taking_part": self.not_taking_part,
        }

    async def _publish(self) -> None:
        info = self._info()
        if info != self._published:
            await self._run(self.store.publish, info)
            self._published = info

    # --- the shared configuration -----------------------------------------------------------------
    async def _on_change(self) -> None:
        """The service's change hook: a persisted change, under the service lock, before it is saved."""
        self._wake.set()
        if _APPLYING.get():
            return
        shared = shared_part(self.service.live_config())
        if shared == self._applied_shared:
            return  # a listener or an ANA state: per gateway
        try:
            version = await self._run(self.store.put_config, shared, self.config_version)
        except ConfigConflict:
            raise ServiceError(409, f"another gateway of group {self.store.group} changed the shared configuration "
                               "at the same moment; this gateway applies that change now: retry yours") from None
        except StoreError as exc:
            raise ServiceError(503, f"the gateway group's store is out of reach ({exc}); nothing was changed") from None
        log.info("gateway %s: shared configuration version %d written to %s", self.name, version, self.store.where)
        self.config_version, self._applied_shared = version, shared

    def store_ahead(self) -> None:
        """TargetService: a change this member wrote to the store was undone here (its file could not be
        saved); apply the store's version again at the next step instead of staying behind for good."""
        self.config_version -= 1
        self._applied_shared = None
        self._wake.set()

    async def push_config(self) -> list[str]:
        """Write the running shared configuration to the store (after a SIGHUP reload); [] or why not."""
        try:
            await self._on_change()
        except ServiceError as exc:
            return [exc.message]
        return []

    async def _apply_config(self, version: int, config: dict[str, Any]) -> list[str]:
        shared = shared_part(config)
        stale = False

        def build(live: dict[str, Any]) -> dict[str, Any]:
            # under the service lock: what runs now (listeners, anything a change just committed) plus the
            # store's subsystems; nothing at all when a change made here since is newer than ``version``
            nonlocal stale
            if version <= self.config_version:
                stale = True
                return live
            wanted = dict(live)
            wanted["subsystems"] = shared["subsystems"]
            return wanted

        token = _APPLYING.set(True)
        try:
            errors = await self.service.reload(build)
        finally:
            _APPLYING.reset(token)
        if errors:
            log.error("gateway %s: the group's configuration version %d cannot be applied here, nothing changed: %s",
                      self.name, version, "; ".join(errors))
            return errors
        if stale or version <= self.config_version:
            return []
        self.config_version, self._applied_shared = version, shared_part(self.service.live_config())
        log.info("gateway %s: applied the group's configuration version %d", self.name, version)
        return []

    # --- the loop ----------------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        while not self._stopping:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop failover for good: log it and go on
                log.exception("gateway %s: ownership step failed", self.name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.tick)
            self._wake.clear()

    async def _fence_loop(self) -> None:
        """Step down from every group whose lock could not be renewed by its fencing deadline, whatever
        the store calls in flight are doing (they may hang for as long as the cluster is out of reach) and
        whoever holds the TargetService lock: _step_down changes the listeners' states directly."""
        while not self._stopping:
            delay = self.tick
            try:
                deadlines = {g: self.store.lease_deadline(g) for g in list(self.owned)}
                finite = [d for d in deadlines.values() if d is not None]
                due = [g for g, d in deadlines.items() if d is not None and d <= now()]
                if due:
                    await self._step_down(due, "could not renew its lock within the lease; the store is out of "
                                          "reach")
                    delay = 0.01
                elif finite:
                    delay = min(finite) - now()
            except asyncio.CancelledError:
                raise
            except Exception:  # this task is what fences: it must never end
                log.exception("gateway %s: fencing check failed; retrying", self.name)
            await asyncio.sleep(max(0.01, min(delay, self.tick)))

    async def _renew_loop(self) -> None:
        """Renew every owned group's lock each tick, in a task of its own: a slow configuration change
        applied by the ownership step must not delay a renew (nor the step-down when one fails)."""
        while not self._stopping:
            try:
                await self._renew_all()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("gateway %s: renewing its locks failed; retrying", self.name)
            await asyncio.sleep(self.tick)

    async def _renew_all(self) -> None:
        for g in sorted(self.owned):
            if g not in self.owned:
                continue  # handed over or stepped down meanwhile
            left = self._time_left(g)
            if left <= 0:
                await self._step_down([g], "its lease ran out before a renew succeeded")
                continue
            try:
                renewed = await self._run(self.store.renew, g, timeout=max(0.1, left))
            except StoreError as exc:
                log.warning("ANA group %d: %s could not renew its lock (%s); stepping down at the lease deadline",
                            g, self.name, exc)
                continue
            if not renewed and g in self.owned:
                await self._step_down([g], "its lock was lost")

    async def _step_down(self, groups: list[int], why: str) -> None:
        """Standby at once: no await before the listeners change (no service lock, no store call)."""
        for g in groups:
            if g in self.owned:
                self.owned.discard(g)
                try:
                    self.store.forget(g)
                except Exception:  # the state change below matters more than the bookkeeping
                    log.exception("ANA group %d: %s could not drop its lock handle", g, self.name)
                log.warning("ANA group %d: %s steps down (%s)", g, self.name, why)
        await self._apply_states()

    async def step(self) -> None:
        async with self._step_lock:
            await self._step()

    async def _step(self) -> None:
        if self.fence.reason is not None:
            await self.fence.recheck()  # may reconnect the store: before the store calls below
        try:
            await self._run(self.store.heartbeat)
            members = await self._run(self.store.members)
            version, config = await self._run(self.store.get_config)
        except StoreError as exc:
            if self._store_ok:
                log.warning("gateway %s lost its group store: %s", self.name, exc)
            self._store_ok = False
            await self.fence.store_failed(exc)  # blocklisted by another member: step down at once
            lifelong = [g for g in self.owned if self.store.lease_deadline(g) is None]
            if lifelong:  # a lock without a lease cannot be fenced by time: give it up now
                await self._step_down(lifelong, f"lost the group store: {exc}")
            await self._apply_states()  # groups added meanwhile get their (standby) state too
            return
        if not self._store_ok:
            log.info("gateway %s reaches its group store again", self.name)
            self._store_ok = True
        self.members = members
        if version > self.config_version and config is not None:
            await self._apply_config(version, config)
        self._update_peers(members)
        await self._decide(members)
        await self._apply_states()
        try:
            await self._publish()
        except MemberRemoved:
            self._removed()

    def _eligible(self, member: MemberRecord) -> bool:
        if member.name == self.name:
            return self._eligible_me()
        return member.alive and bool(member.info.get("ready")) and bool(member.info.get("listeners"))

    def _groups(self) -> set[int]:
        used = {ns.anagrpid for sub in self.service.list_subsystems() for ns in sub.namespaces.values()}
        return used | self.owned

    async def _decide(self, members: list[MemberRecord]) -> None:
        claims = {}
        for m in members:
            if m.alive and m.name != self.name:
                for g in m.info.get("owns") or []:
                    claims[int(g)] = m.name
        before, self._claims = self._claims, claims
        if not any(m.name == self.name for m in members):
            # not recorded (removed while cut off, a store wiped under us): our locks are not the ones the others see
            self._removed()
            if self.owned:
                await self._step_down(sorted(self.owned), "this gateway is no longer recorded in the store")
            return
        for g in sorted(self._groups()):
            preferred = preferred_owner(g, members)
            pref = preferred.name if preferred else None
            cand = candidate(g, members, self._eligible)
            if g in self.owned:
                await self._keep_or_hand_over(g, pref, cand)
                continue
            claimed = claims.get(g)
            if claimed is None:
                self._unclaimed_since.setdefault(g, now())
            else:
                self._unclaimed_since.pop(g, None)
            if not self._eligible_me():
                continue
            waited = now() - self._unclaimed_since.get(g, now())
            long_unclaimed = claimed is None and waited > self.store.lease + self.tick
            if cand == self.name or long_unclaimed:
                if await self._run(self.store.try_acquire, g) and await self.fence.before_takeover(g, members):
                    self.owned.add(g)
                    self._unclaimed_since.pop(g, None)
                    log.info("ANA group %d: %s takes ownership (%s)", g, self.name,
                             self._why_take(g, pref, before, members, long_unclaimed))
                    await self._apply_states()

    def _why_take(self, g: int, pref: str | None, before: dict[int, str], members: list[MemberRecord],
                  fallback: bool) -> str:
        old = before.get(g)
        alive = {m.name for m in members if m.alive}
        if old is not None and old not in alive:
            return f"owner {old} is gone: its lock is free"
        if old is not None:
            return f"owner {old} handed it over"
        if fallback:
            return "no gateway claimed it for longer than the lease"
        if pref == self.name:
            return "its preferred owner"
        return f"preferred owner {pref} is not available"

    async def _keep_or_hand_over(self, g: int, pref: str | None, cand: str | None) -> None:
        if not self._eligible_me():
            why = "it has no I/O listener left" if not self._io_listeners() else "it is not ready"
            await self._hand_over(g, cand, why)
            return
        if self.failback == "auto" and pref != self.name and cand == pref and cand is not None:
            await self._hand_over(g, cand, f"failback: preferred owner {pref} is available again")
            return
        if self._time_left(g) <= 0:  # renewals run in _renew_loop; this is the fence's backstop
            await self._step_down([g], "its lease ran out before a renew succeeded")

    def _time_left(self, g: int) -> float:
        deadline = self.store.lease_deadline(g)
        return defaults.GATEWAY_STORE_TIMEOUT + 2 if deadline is None else deadline - now()

    async def _hand_over(self, g: int, to: str | None, why: str) -> None:
        """Standby first (so no host keeps an optimized path here), then release; ``to`` takes it next."""
        self.owned.discard(g)
        await self._apply_states(handing={g})
        try:
            await self._run(self.store.release, g)
        except StoreError as exc:
            log.warning("ANA group %d: %s could not release its lock (%s); it expires by itself", g, self.name, exc)
        log.info("ANA group %d: %s hands ownership over to %s (%s)", g, self.name, to or "the next gateway", why)
        with contextlib.suppress(StoreError):
            await self._publish()

    # --- ANA states ------------------------------------------------------------------------------
    def desired_states(self, handing: AbstractSet[int] = frozenset()) -> dict[int, AnaState]:
        out = {}
        for g in sorted(self._groups() | set(self._applied)):
            if g in self.owned:
                out[g] = AnaState.OPTIMIZED
            elif g in handing or g not in self._claims:
                out[g] = self.unowned_state
            else:
                out[g] = self.standby
        return out

    async def _apply_states(self, handing: AbstractSet[int] = frozenset()) -> None:
        """Make every I/O listener serve desired_states(), compared with what each really serves (a listener
        added since starts in the target's default, the standby state). Computed and applied with no await
        in between and without the service lock (TargetService.ana_states_now), so the fence and a step
        never wait for a mutation in progress; then worker processes catch up (settle)."""
        wanted = self.desired_states(handing)
        self._applied = wanted
        if self.service.ana_states_now(wanted):
            try:
                await self.service.target.settle()
            except Exception:  # the main process serves the new states already; workers resync at the next one
                log.exception("gateway %s: worker processes did not confirm the new ANA states", self.name)

    @property
    def not_taking_part(self) -> str | None:
        """Why this member may own no ANA group now (removed from the store, fenced), for gateway list; None: it may."""
        return self.removed or self.fence.reason

    def _removed(self) -> None:
        if self.removed is None:
            self.removed = (f"no longer recorded in group {self.store.group} ({self.store.where}): removed "
                                    "with `nvmeof gateway remove` while it was not alive; restart it to join as a "
                                    "new member")
            log.error("gateway %s is %s", self.name, self.removed)

    async def remove_member(self, name: str) -> None:
        """`nvmeof gateway remove NAME`: forget a member that is gone for good (refused while it is alive)."""
        if name == self.name:
            raise ServiceError(409, f"gateway {name} is this gateway, which is alive; remove it from another member "
                               "after stopping it")
        try:
            await self._run(self.store.remove_member, name)
        except MemberUnknown as exc:
            raise ServiceError(404, str(exc)) from None
        except MemberAlive as exc:
            raise ServiceError(409, str(exc)) from None
        except StoreError as exc:
            raise ServiceError(503, f"the gateway group's store is out of reach ({exc}); nothing was removed") from None
        log.info("gateway %s removed member %s from group %s: its index and controller ID range are free; the "
                 "ANA groups' preferred owners are counted over the remaining members", self.name, name,
                 self.store.group)
        self._wake.set()

    # --- discovery ---------------------------------------------------------------------------------
    def _update_peers(self, members: list[MemberRecord]) -> None:
        peers = []
        for m in members:
            if m.name == self.name or not m.alive:
                continue
            for entry in m.info.get("listeners") or []:
                if _wildcard(str(entry.get("traddr"))):
                    continue  # an address only that machine can resolve
                try:
                    peers.append(Listener(trtype=entry["trtype"], adrfam=entry["adrfam"], traddr=entry["traddr"],
                                          trsvcid=int(entry["trsvcid"]), portid=int(entry["portid"]),
                                          tls=tls if (tls := entry.get("tls")) in defaults.TLS_MODES else "none"))
                except (KeyError, TypeError, ValueError):
                    continue
        self.service.target.set_peer_listeners(peers)

    # --- report (gateway list, REST) ---------------------------------------------------------------
    async def report(self) -> dict[str, Any]:
        try:
            members = await self._run(self.store.members)
            owners = {g: await self._run(self.store.owner, g) for g in sorted(self._groups())}
            reachable = True
        except StoreError:
            members, owners, reachable = self.members, {g: None for g in sorted(self._groups())}, False
        me = self._info()
        rows = []
        for m in members:
            info = me if m.name == self.name else m.info
            rows.append({
                "name": m.name,
                "index": m.index,
                "alive": m.alive,
                "ready": bool(info.get("ready")) and m.alive,
                "listeners": info.get("listeners") or [],
                "cntlid_range": info.get("cntlid_range") or list(cntlid_range(m.index)),
                "owns": info.get("owns") or [],
                "clients": info.get("clients") or [],
                "not_taking_part": info.get("not_taking_part") if m.alive else None,
            })
        groups = []
        for g, owner in owners.items():
            pref = preferred_owner(g, members)
            states = {}
            for m in members:
                info = me if m.name == self.name else m.info
                if m.alive:
                    states[m.name] = (info.get("ana") or {}).get(str(g))
            groups.append({"anagrpid": g, "owner": owner, "preferred": pref.name if pref else None, "states": states,
                           "fenced": self.fence.fenced.get(g)})
        return {
            "group": self.store.group,
            "name": self.name,
            "index": self.index,
            "store": self.store.where,
            "store_reachable": reachable,
            "lease": self.store.lease,
            "failback": self.failback,
            "standby": ANA_STATE_NAMES[self.standby],
            "config_version": self.config_version,
            "not_taking_part": self.not_taking_part,
            "members": rows,
            "ana_groups": groups,
        }
