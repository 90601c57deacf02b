"""What every part of TargetService stands on: its state, the reads, and the one way a change ends.

ServiceBase keeps the Target hooks, the lock, the items a replay could not restore, the saved ANA
states and the gateway group membership. A change ends in ``_commit(persist, undo)``: alone it is a
transaction of one step, saved now (``_save``); inside ``_steps()`` (a replay, a reload) it joins that
transaction's one undo log (target/transaction.py), saved once at its end. The resource modules beside
this one are mixins on ServiceBase; target/service/__init__.py composes them into TargetService.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from nvmeof.spec.logs import AnaState
from target import config as configmod
from target import hostauth
from target.backends import StoragePolicy
from target.model import Listener, Namespace, Referral, Subsystem
from target.service.checks import ServiceError, _endpoint_key, _nothing
from target.transaction import Transaction, Undo

if TYPE_CHECKING:
    from target.controller import Controller
    from target.pr import PrStore

log = logging.getLogger(__name__)

# (where, item) pairs for subsystems/listeners/referrals; (subnqn, where, item) for namespaces.
Placed = list[tuple[str, Any]]
PlacedNs = list[tuple[str, str, Any]]


@dataclasses.dataclass
class Unrestored:
    """A configuration item a replay could not apply; kept so that it is not lost from the file."""

    kind: str  # "subsystem" | "namespace" | "listener" | "referral"
    where: str  # its place in the configuration it came from, e.g. "subsystems[1].namespaces[0]"
    error: str
    item: dict[str, Any]  # the entry exactly as given; snapshot() writes it back
    subnqn: str | None = None  # the subsystem a namespace belongs to

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "where": self.where,
            "subsystem": self.subnqn,
            "error": self.error,
            "item": copy.deepcopy(self.item),
        }


class TargetHooks(Protocol):
    """What TargetService needs from target.core.Target."""

    subsystems: dict[str, Subsystem]
    listeners: dict[str, Listener]
    referrals: list[Referral]
    controllers: dict[int, Controller]
    # reservations (target/pr.py): where states are kept (None: RAM only) and whether they are served
    pr_store: PrStore | None
    reservations_supported: bool

    def namespace_changed(self, subnqn: str, nsid: int, concerns: Callable[[str], bool] | None = None) -> None: ...
    def discovery_changed(self) -> None: ...
    async def settle(self) -> None: ...
    async def start_workers(self) -> None: ...
    async def start_listener(self, listener: Listener) -> None: ...
    async def stop_listener(self, listener: Listener) -> None: ...
    def disconnect_subsystem(self, subnqn: str) -> int: ...
    def disconnect_disallowed(self, subnqn: str) -> int: ...
    def disconnect_listener(self, listener: Listener) -> int: ...
    def controllers_info(self) -> list[dict[str, Any]]: ...
    def disconnect_controller(self, cntlid: int) -> bool: ...
    # for a gateway group member (target/gateway/group.py), which drives the target through its service
    def listening_port(self, listener: Listener) -> int: ...
    def set_pr_store(self, store: PrStore | None) -> None: ...
    def set_cntlid_range(self, lo: int, hi: int) -> None: ...
    def set_ana_default(self, state: AnaState) -> None: ...
    def set_peer_listeners(self, peers: list[Listener]) -> None: ...
    # ANA states (on listeners) or a group's namespaces (in subnqn) changed: bump the ANA change counts
    # and send the ANA change AEN to the controllers concerned (target.core.Target.ana_changed).
    def ana_changed(self, *, subnqn: str | None = None, listeners: Iterable[Listener] | None = None,
                    groups: Iterable[int] = (), concerns: Callable[[str], bool] | None = None) -> int: ...


class GatewayMember(Protocol):
    """What TargetService asks of the gateway group member it belongs to (target/gateway/group.py)."""

    @property
    def group_name(self) -> str: ...
    # The group's store took a change that was then undone here: apply the store's version again.
    def store_ahead(self) -> None: ...
    async def report(self) -> dict[str, Any]: ...   # what GET /api/v1/gateway returns
    # A member gone for good leaves the group (refused while it is alive): DELETE /api/v1/gateway/members/NAME
    async def remove_member(self, name: str) -> None: ...


T = TypeVar("T")


def locked(step: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """The public door of a step that a replay or a reload also applies (``_add_subsystem`` -> ``add_subsystem``):
    the step's own parameters and docstring (functools.wraps: inspect.signature shows them), run under the
    service lock as a transaction of its own. The step alone, called by a replay that holds the lock inside
    ``_steps``, joins that change's one undo log instead; it takes no ``persist``, since ``_commit`` knows
    which of the two it is."""

    @functools.wraps(step)
    async def door(self: ServiceBase, *args: Any, **kwargs: Any) -> T:
        async with self._lock:
            return await step(self, *args, **kwargs)

    door.__name__ = step.__name__.removeprefix("_")
    door.__qualname__ = step.__qualname__.removesuffix(step.__name__) + door.__name__
    return door


class ServiceBase:
    def __init__(
        self,
        target: TargetHooks,
        *,
        config_path: str | os.PathLike[str] | None = None,
        **policy_settings: Any,
    ) -> None:
        """``policy_settings`` are the operator's fences for the backends that have one (StoragePolicy:
        ``backing_dirs``, default the state directory's disks/, and ``block_devices`` where file
        namespaces may live; ``ceph_confs``... for RBD; `nvmeof serve --backing-dir`, ...), for every
        caller alike. A configuration file replayed at start-up may add its own (it is the operator's
        file too); nothing that comes through the API can widen them. BackingError (a BackendError)
        if one of them is unusable, TypeError for a setting no backend takes."""
        self.target = target
        self.config_path = os.fspath(config_path) if config_path is not None else None
        self.backing = StoragePolicy.from_settings(**policy_settings)
        self._flag_backing = self.backing
        # the configuration file's own policy keys, written back by snapshot() as they were read
        self._config_backing: dict[str, list[str]] = {}
        self._lock = asyncio.Lock()
        self._unrestored: list[Unrestored] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        # ANA states per listener as configured (persisted); Listener.ana_states is what is served,
        # which a gateway group also sets at run time (set_ana_states(persist=False)), unsaved.
        self._ana_saved: dict[str, dict[int, AnaState]] = {}
        # The gateway group this target is a member of (join_gateway), and its hook that every persisted
        # change calls before it is saved (set_change_hook).
        self._gateway: GatewayMember | None = None
        self._on_change: Callable[[], Awaitable[None]] | None = None
        # The transaction of the change of many steps in progress under the lock (_steps: a replay, a reload),
        # whose one undo log every step's _commit joins; None between them.
        self._txn: Transaction | None = None

    # --- the gateway group ------------------------------------------------------------------------

    @property
    def gateway(self) -> GatewayMember | None:
        """The gateway group member this target belongs to (it decides the ANA states), or None."""
        return self._gateway

    def join_gateway(self, member: GatewayMember) -> None:
        self._gateway = member

    def set_change_hook(self, hook: Callable[[], Awaitable[None]] | None) -> None:
        """``hook`` is awaited by every persisted change before it is saved; a ServiceError from it undoes the
        change (a gateway group writes the shared configuration to its store there). None: no hook."""
        self._on_change = hook

    # --- reads ---------------------------------------------------------------------------------

    def list_subsystems(self) -> list[Subsystem]:
        return [s for s in self.target.subsystems.values() if s.subtype == "nvm"]

    def get_subsystem(self, nqn: str) -> Subsystem:
        sub = self.target.subsystems.get(nqn)
        if sub is None or sub.subtype != "nvm":
            raise ServiceError(404, f"no subsystem {nqn!r}; list them to see the NQNs")
        return sub

    def list_namespaces(self, subnqn: str) -> list[Namespace]:
        sub = self.get_subsystem(subnqn)
        return [sub.namespaces[nsid] for nsid in sorted(sub.namespaces)]

    def get_namespace(self, subnqn: str, nsid: int) -> Namespace:
        sub = self.get_subsystem(subnqn)
        ns = sub.namespaces.get(nsid)
        if ns is None:
            have = ", ".join(str(n) for n in sorted(sub.namespaces)) or "none"
            raise ServiceError(404, f"subsystem {subnqn} has no namespace {nsid} (it has: {have})")
        return ns

    def list_listeners(self) -> list[Listener]:
        return list(self.target.listeners.values())

    def get_listener(self, listener_id: str) -> Listener:
        listener = self.target.listeners.get(listener_id)
        if listener is None:
            have = ", ".join(self.target.listeners) or "none"
            raise ServiceError(404, f"no listener {listener_id!r} (listeners: {have})")
        return listener

    def list_referrals(self) -> list[Referral]:
        return list(self.target.referrals)

    def controllers(self) -> list[dict[str, Any]]:
        return self.target.controllers_info()

    def _all_namespaces(self) -> Iterable[tuple[Subsystem, Namespace]]:
        for sub in self.target.subsystems.values():
            for ns in sub.namespaces.values():
                yield sub, ns

    # --- the end of every change: one transaction, one undo log -----------------------------------

    async def _commit(self, persist: bool, undo: Undo) -> None:
        """The end of every change: ``undo`` takes back what it applied. In a replay or a reload (``_steps``)
        it joins that transaction's log, saved once at its end; otherwise, with ``persist``, the change is
        a transaction of its own, saved now and undone if that save refuses."""
        if self._txn is not None:
            self._txn.undo(undo)
            return
        if persist:
            txn = Transaction()
            txn.undo(undo)
            await self._save(txn)

    async def _save(self, txn: Transaction, what: str = "the change") -> None:
        """Commit ``txn``: save the whole configuration once, or undo every step it logged. A gateway
        group writes the shared configuration to its store first (target/gateway/group.py): refused there
        (another gateway changed it at the same moment, the store is out of reach), the change is undone
        here too; then the config file."""

        async def save() -> None:
            if self._on_change is not None:
                await self._on_change()
            if self.config_path is None:
                return
            try:
                await asyncio.to_thread(configmod.save_config, self.config_path, self.snapshot())
            except configmod.ConfigError as exc:
                self._store_ahead()
                raise ServiceError(500, f"{exc}; {what} was undone") from exc

        await txn.commit(save)

    @contextlib.asynccontextmanager
    async def _steps(self) -> AsyncIterator[Transaction]:
        """A change of many steps, under the lock (a replay, a reload): one transaction whose log takes
        every step's undo; an exception out of it undoes them all. Its first entry puts back what the
        service keeps beside the Target (unrestored items, saved ANA states, the backing policy, the
        referrals) and tells discovery controllers, so it runs last."""
        assert self._txn is None, "changes of many steps do not nest"
        txn = Transaction()
        kept = (list(self._unrestored), copy.deepcopy(self._ana_saved), self.backing, self._config_backing,
                list(self.target.referrals))

        def put_back() -> None:
            unrestored, ana_saved, self.backing, self._config_backing, referrals = kept
            self._unrestored = list(unrestored)
            self._ana_saved.clear()
            self._ana_saved.update(ana_saved)
            self.target.referrals[:] = referrals
            self.target.discovery_changed()

        txn.undo_sync(put_back)
        self._txn = txn
        try:
            yield txn
        except BaseException:
            await txn.roll_back()
            raise
        finally:
            self._txn = None

    def _store_ahead(self) -> None:
        """A gateway group's store took a change that was then undone here (the local save failed): the
        member applies the store's version again, so it does not stay behind the group for good."""
        if self._on_change is not None and self._gateway is not None:
            self._gateway.store_ahead()

    async def _settle(self) -> None:
        """With worker processes (`serve --workers`), wait until they have applied a namespace change,
        so I/O the host sends after this call returns sees it."""
        await self.target.settle()

    async def save(self) -> None:
        """Write the running configuration to the config file now (under the lock, like a mutation)."""
        async with self._lock:
            await self._commit(True, _nothing)

    # --- notices shared by several resources -----------------------------------------------------

    def _ana_changed(self, *, subnqn: str | None = None, listeners: Iterable[Listener] | None = None,
                     groups: Iterable[int] = (), concerns: Callable[[str], bool] | None = None) -> None:
        self.target.ana_changed(subnqn=subnqn, listeners=listeners, groups=groups, concerns=concerns)

    async def _revoke(self, subnqn: str) -> int:
        """After the allow-list of ``subnqn`` shrank: the hosts it no longer admits lose their controllers,
        in worker processes too (``_settle``), before the management call returns."""
        disconnected = self.target.disconnect_disallowed(subnqn)
        if disconnected:
            await self._settle()
        return disconnected

    # --- what a replay could not restore -------------------------------------------------------

    def unrestored(self) -> list[dict[str, Any]]:
        """Configuration items kept from a replay that failed, with the reason, oldest first; host
        secrets show as presence flags (this goes to the API)."""
        out = [u.as_dict() for u in self._unrestored]
        for entry in out:
            entry["item"] = hostauth.redact_item(entry["item"])
        return out

    def _pending(self, kind: str) -> list[Unrestored]:
        return [u for u in self._unrestored if u.kind == kind]

    def _pending_conflict(self, what: str, entry: Unrestored) -> ServiceError:
        return ServiceError(
            409,
            f"{what} is in the configuration but was not restored ({entry.where}: {entry.error}); "
            "retry it (POST /api/v1/config/unrestored/retry) or discard it "
            "(DELETE /api/v1/config/unrestored) first",
        )

    def _pending_nsids(self, subnqn: str) -> set[int]:
        return {
            u.item["nsid"]
            for u in self._pending("namespace")
            if u.subnqn == subnqn and isinstance(u.item.get("nsid"), int)
        }

    def _drop_pending_endpoint(self, kind: str, eid: str) -> None:
        """A live add of the same listener/referral supersedes the one that failed to restore."""
        for u in self._pending(kind):
            if _endpoint_key(u.item) == eid:
                log.info("%s %s is live now; dropping the copy from %s that was not restored", kind, eid, u.where)
                self._unrestored.remove(u)
