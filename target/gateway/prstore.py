"""Reservations across a gateway group: the namespace's state lives in the group's store.

A reservation belongs to the namespace, not to the gateway a host came through: a host registered and
holding a reservation through gateway A is enforced on gateway B, and keeps it when A dies. Every change
is a compare-and-swap on the namespace's record in the store (GroupStore.put_reservation), so two
gateways racing never lose an update: the loser re-reads and re-applies the command to the new state
(target/pr.py ``change``). The other members apply each committed version when the store tells them
(watch/notify, or the dir store's poll), post the notifications to their own controllers of the hosts
concerned, let a preempted host's commands on their side finish, and acknowledge the version; the
command that made the change completes once every live member has acknowledged it (or
RESERVATION_ACK_TIMEOUT passed, which is logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from nvmeof import defaults
from target import pr
from target.gateway.store import ConfigConflict, StoreError
from target.pr import PrStale, PrStore, PrStoreError

if TYPE_CHECKING:
    from target.gateway.store import GroupStore
    from target.ports import SubsystemTable

log = logging.getLogger(__name__)

RESERVATION_ACK_TIMEOUT = defaults.GATEWAY_STORE_TIMEOUT * 2   # seconds a change waits for the other members
ACK_POLL = 0.01


class GroupPrStore(PrStore):
    def __init__(self, store: GroupStore, target: SubsystemTable) -> None:
        self.store = store
        self.target = target
        self.applied: dict[str, int] = {}   # what this member enforces, by key: its acknowledgement

    def load(self, key: str) -> tuple[int, dict[str, Any] | None]:
        try:
            version, record = self.store.get_reservation(key)
        except StoreError as exc:
            raise PrStoreError(str(exc)) from exc
        if version:
            self.applied[key] = version
        return version, (record or {}).get("state")

    def commit(self, key: str, state: dict[str, Any], expected: int, change: dict[str, Any]) -> int:
        try:
            version = self.store.put_reservation(key, {"state": state, "change": change}, expected)
        except ConfigConflict:
            # another gateway changed it first: the caller re-runs the command against this state
            version, state = self.load(key)
            raise PrStale(version, state) from None
        except StoreError as exc:
            raise PrStoreError(f"{exc}; the reservation is unchanged") from exc
        self.applied[key] = version
        return version

    def delete(self, key: str) -> None:
        self.applied.pop(key, None)
        try:
            self.store.delete_reservation(key)
        except StoreError as exc:
            raise PrStoreError(str(exc)) from exc

    async def published(self, key: str, version: int) -> None:
        await asyncio.to_thread(self._ack)
        deadline = time.monotonic() + RESERVATION_ACK_TIMEOUT
        while True:
            waiting = await asyncio.to_thread(self._behind, key, version)
            if not waiting:
                return
            if time.monotonic() > deadline:
                log.warning("reservation %s version %d: gateway(s) %s did not acknowledge it within %.0f s; they may "
                            "enforce the previous state until they catch up", key, version, ", ".join(waiting),
                            RESERVATION_ACK_TIMEOUT)
                return
            await asyncio.sleep(ACK_POLL)

    def _behind(self, key: str, version: int) -> list[str]:
        try:
            members = self.store.members()
            acks = self.store.reservation_acks()
        except StoreError as exc:
            log.warning("reservation %s: cannot read the other gateways' acknowledgements: %s", key, exc)
            return []
        return [m.name for m in members if m.alive and m.name != self.store.name
                and acks.get(m.name, {}).get(key, 0) < version]

    def _ack(self) -> None:
        try:
            self.store.ack_reservations(dict(self.applied))
        except StoreError as exc:
            log.warning("cannot acknowledge the applied reservation versions: %s", exc)

    def forget_volatile(self) -> int:
        """The first member of a group to start (none other alive): the whole group was down, which is the
        group's power loss, so states without PTPL end as the spec says; returns how many were cleared."""
        cleared = 0
        for key in self.store.reservation_versions():
            version, record = self.store.get_reservation(key)
            state = (record or {}).get("state") or {}
            if state and not state.get("ptpl"):
                try:
                    self.store.put_reservation(key, {"state": {}, "change": {}}, version)
                    cleared += 1
                except ConfigConflict:
                    continue   # another member started meanwhile and changed it: it is live state
        return cleared

    async def sync(self) -> None:
        """Apply every version another member committed since (the store notified a change)."""
        versions = await asyncio.to_thread(self.store.reservation_versions)
        changed = False
        for sub in list(self.target.subsystems.values()):
            for ns in list(sub.namespaces.values()):
                key = pr.key_of(ns)
                stored = versions.get(key, 0)
                if stored <= ns.pr_version:
                    continue
                version, record = await asyncio.to_thread(self.store.get_reservation, key)
                if version <= ns.pr_version or record is None:
                    continue
                await pr.apply_remote(self.target, sub, ns, version, record.get("state"), record.get("change"))
                self.applied[key] = ns.pr_version
                changed = True
        if changed:
            await asyncio.to_thread(self._ack)
