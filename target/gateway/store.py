"""GroupStore: what a gateway group needs from the store its members share.

Membership with liveness, a stable index per member, the shared configuration read and written
with compare-and-swap, change notification, and one ownership lock per ANA group. Two
implementations: DirStore (a local directory, flock locks the kernel drops when a process dies) and
RadosStore (a RADOS object: omap, watch/notify, cls_lock leases). Every method blocks: the group
calls them from a thread. Ownership safety rests only on the store's locks; nothing here votes.
"""

from __future__ import annotations

import abc
import dataclasses
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from nvmeof import defaults

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class StoreError(Exception):
    """The store cannot be reached or refused a request; the message says which and what to do."""


class ConfigConflict(StoreError):
    """put_config lost a compare-and-swap: someone wrote version ``current`` since."""

    def __init__(self, current: int) -> None:
        super().__init__(f"the shared configuration is at version {current} now; read it again")
        self.current = current


class MemberUnknown(StoreError):
    """remove_member: no member of that name is recorded."""


class MemberAlive(StoreError):
    """remove_member: the member is alive (it holds its membership lock); stop it first."""


class MemberRemoved(StoreError):
    """publish: this member's record was removed (`nvmeof gateway remove`) while it was not alive."""


@dataclasses.dataclass(frozen=True)
class MemberRecord:
    name: str
    index: int
    alive: bool
    info: dict[str, Any]  # what the member publishes: listeners, ready, owned groups, CNTLID range


def check_name(value: str, what: str, option: str) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise StoreError(f"{what} {value!r} must be 1-64 letters, digits, '.', '_' or '-' (starting with a letter "
                         f"or digit); give another with {option}")
    return value


def free_index(taken: set[int], name: str) -> int:
    for index in range(defaults.GATEWAY_MAX):
        if index not in taken:
            return index
    raise StoreError(f"gateway group is full: {defaults.GATEWAY_MAX} members are recorded; gateway {name} cannot "
                     "join (remove a member that is gone for good from the store first)")


class GroupStore(abc.ABC):
    """One member's handle on the group's store. ``lease`` (seconds) bounds how long an ownership
    lock outlives its holder; ``lease_deadline(g)`` says until when (store.now()) this member may still
    act as the owner of group g without a successful renew (None: for as long as the process lives)."""

    kind = "?"
    # the librados handle a RADOS store talks through (fencing sends its blocklist commands with it); None
    # for a store that has none
    cluster: Any = None

    def __init__(self, group: str, lease: float) -> None:
        self.group = check_name(group, "gateway group name", "--gateway-group")
        self.lease = lease
        self.name: str | None = None
        self.index: int | None = None
        self._watchers: list[Callable[[], None]] = []
        self._deadlines: dict[int, float | None] = {}
        self._mutex = threading.Lock()

    @property
    def where(self) -> str:
        """The store as `--group-store` spells it."""
        return "?"

    @property
    def config_location(self) -> str:
        """Where in the store the shared configuration is kept, as a message names it."""
        return "the group's configuration"

    # membership ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def join(self, name: str, info: dict[str, Any]) -> int:
        """Register as member ``name`` (its index is assigned at the first join and kept for good),
        start being alive, publish ``info``; returns the index. StoreError if ``name`` runs already."""

    @abc.abstractmethod
    def publish(self, info: dict[str, Any]) -> None:
        """Replace this member's published info (others see it in members()); MemberRemoved when its record
        was removed meanwhile (it is never written back: its index may be another member's now)."""

    @abc.abstractmethod
    def members(self) -> list[MemberRecord]:
        """Every member ever recorded, by index, each with whether it is alive now."""

    @abc.abstractmethod
    def remove_member(self, name: str) -> None:
        """Forget member ``name`` for good: its record (so its index and CNTLID range are free for the next
        new member, and it no longer counts in n) and its reservation acknowledgements. MemberAlive while it
        holds its membership lock, MemberUnknown when it is not recorded. Atomic against a join of ``name``."""

    @abc.abstractmethod
    def heartbeat(self) -> None:
        """Keep this member alive (RADOS: renew its membership lease); StoreError if the store is lost."""

    @abc.abstractmethod
    def leave(self) -> None:
        """Stop being alive (a clean exit); ownership locks still held are released."""

    # shared configuration ------------------------------------------------------------------------
    @abc.abstractmethod
    def get_config(self) -> tuple[int, dict[str, Any] | None]:
        """(version, configuration); (0, None) before anyone wrote one."""

    @abc.abstractmethod
    def put_config(self, config: dict[str, Any], expected: int) -> int:
        """Write ``config`` if the stored version is still ``expected``; returns the new version.
        ConfigConflict otherwise. Every member is notified."""

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from any thread) when the configuration or the membership may have changed."""
        self._watchers.append(callback)

    def _fire(self) -> None:
        for callback in list(self._watchers):
            callback()

    # reservations (target/gateway/prstore.py) -----------------------------------------------------
    # One record per namespace (key: its UUID): {"state": ..., "change": ...} at a version that only a
    # compare-and-swap moves, plus per member the version it has applied (its acknowledgement).
    @abc.abstractmethod
    def get_reservation(self, key: str) -> tuple[int, dict[str, Any] | None]:
        """(version, record); (0, None) when none was written."""

    @abc.abstractmethod
    def put_reservation(self, key: str, record: dict[str, Any], expected: int) -> int:
        """Write ``record`` if the version is still ``expected``; the new version, else ConfigConflict(current).
        Every member is notified."""

    @abc.abstractmethod
    def delete_reservation(self, key: str) -> None:
        """Forget ``key`` (its namespace was removed from the group)."""

    @abc.abstractmethod
    def reservation_versions(self) -> dict[str, int]:
        """Every record's version, by key."""

    @abc.abstractmethod
    def ack_reservations(self, applied: dict[str, int]) -> None:
        """Record the versions this member has applied (and enforces), by key."""

    @abc.abstractmethod
    def reservation_acks(self) -> dict[str, dict[str, int]]:
        """What each member acknowledged: member name -> key -> version."""

    # ANA group ownership -------------------------------------------------------------------------
    @abc.abstractmethod
    def try_acquire(self, anagrpid: int) -> bool:
        """Take group ``anagrpid``'s lock if nobody holds it; True when this member holds it now."""

    @abc.abstractmethod
    def renew(self, anagrpid: int) -> bool:
        """Extend the lock this member holds; False when it is lost (someone else may hold it)."""

    @abc.abstractmethod
    def release(self, anagrpid: int) -> None:
        """Give the lock up (no error if it is not held)."""

    @abc.abstractmethod
    def owner(self, anagrpid: int) -> str | None:
        """The member name holding the lock now, or None."""

    def held(self) -> list[int]:
        with self._mutex:
            return sorted(self._deadlines)

    def lease_deadline(self, anagrpid: int) -> float | None:
        """Time (now()) by which this member must have stepped down as owner of ``anagrpid`` unless
        a renew succeeds first; None for a lock that lives as long as the process (flock)."""
        with self._mutex:
            return self._deadlines.get(anagrpid)

    def _held_until(self, anagrpid: int, deadline: float | None) -> None:
        with self._mutex:
            self._deadlines[anagrpid] = deadline

    def _forget(self, anagrpid: int) -> None:
        with self._mutex:
            self._deadlines.pop(anagrpid, None)

    # A store that reaches its data through a client (RADOS) that another member can fence: reconnect() then
    # goes on through a new one (target/gateway/fencing.py). A directory has none.
    has_client: bool = False

    def reconnect(self) -> None:
        """Go on through a new client (only where ``has_client``)."""
        raise StoreError(f"{type(self).__name__} has no client to replace")

    def forget(self, anagrpid: int) -> None:
        """Stop counting ``anagrpid`` as held without asking the store (it could not be reached)."""
        self._forget(anagrpid)

    def close(self) -> None:
        """Release everything and stop background work (leave() included)."""
        self.leave()


def fence_deadline(sent_at: float, lease: float) -> float:
    """The step-down time for a lock whose (re)acquire request was sent at ``sent_at``: the OSD starts
    the lease when it processes the request, never before we sent it, so stepping down by
    sent_at + lease - margin is always before anyone else can be granted the lock."""
    return sent_at + lease - fence_margin(lease)


def fence_margin(lease: float) -> float:
    return max(defaults.GATEWAY_FENCE_MARGIN, lease / 5)


def now() -> float:
    """The clock of every lease deadline: CLOCK_BOOTTIME, which (unlike CLOCK_MONOTONIC) keeps counting while
    the machine is suspended, as the OSD's lease does; a resumed owner sees its deadline passed."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def parse_store(text: str) -> tuple[str, str]:
    """``dir:PATH`` or ``rados:POOL`` as (kind, where); StoreError naming the forms otherwise."""
    kind, sep, where = text.partition(":")
    if not sep or kind not in ("dir", "rados") or not where:
        raise StoreError(f"--group-store {text!r}: give dir:PATH (one machine: a local directory with file locks) "
                         "or rados:POOL (a RADOS pool every gateway reaches)")
    return kind, where
