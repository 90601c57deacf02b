"""Persistent reservations of one namespace: the state and the rules, no I/O.

The NVMe Base spec's "Reservations" section as Linux nvmet (drivers/nvme/target/pr.c) and SPDK
(lib/nvmf/subsystem.c ``nvmf_ns_reservation_*``) implement it: a registrant is a *host*, named by the
128-bit HOSTID of its Connect, so every controller of that host (multipath, several gateways) shares
its registration. Each operation takes a state and returns an :class:`Outcome` holding the next state,
the notifications to post and the hosts whose commands a preempt-and-abort must drain; the caller
(target/pr.py) commits the next state (to the namespace's store) before anyone sees it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nvmeof.spec.nvme import IoOpcode
from nvmeof.spec.reservations import (
    AcquireAction,
    Cptpl,
    NotificationType,
    RegisterAction,
    ReleaseAction,
    ReservationType,
)
from nvmeof.status import Status

GENERATION_MASK = 0xFFFFFFFF

# The spec's command groups for the access table ("Command Behavior in the Presence of a Reservation"):
# Flush, Write, Write Zeroes and Dataset Management modify the medium; Read and Compare read it. nvmet
# (nvmet_is_req_write_cmd_group) puts Flush with the writes too.
WRITE_GROUP = frozenset({IoOpcode.FLUSH, IoOpcode.WRITE, IoOpcode.WRITE_ZEROES, IoOpcode.DATASET_MANAGEMENT})
READ_GROUP = frozenset({IoOpcode.READ, IoOpcode.COMPARE, IoOpcode.VERIFY})


@dataclass(frozen=True, slots=True)
class ReservationState:
    """One namespace's reservation state. Immutable: operations return a new one."""

    generation: int = 0
    registrants: tuple[tuple[bytes, int], ...] = ()   # (hostid, rkey) in registration order
    rtype: int = 0                                    # 0: no reservation
    holder: bytes | None = None                       # types 1-4; None for the all-registrants types
    ptpl: bool = False                                # Persist Through Power Loss

    @property
    def active(self) -> bool:
        """Anything to enforce or keep: a registrant or a reservation."""
        return bool(self.registrants) or bool(self.rtype)

    def key_of(self, hostid: bytes) -> int | None:
        for h, key in self.registrants:
            if h == hostid:
                return key
        return None

    def holds(self, hostid: bytes) -> bool:
        if not self.rtype:
            return False
        if ReservationType(self.rtype).all_registrants:
            return self.key_of(hostid) is not None
        return self.holder == hostid

    def to_dict(self) -> dict[str, Any]:
        """JSON form for the namespace's store (host ids as hex)."""
        return {"generation": self.generation, "rtype": self.rtype, "ptpl": self.ptpl,
                "holder": self.holder.hex() if self.holder is not None else None,
                "registrants": [[h.hex(), key] for h, key in self.registrants]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReservationState:
        try:
            regs = tuple((bytes.fromhex(h), int(key)) for h, key in data.get("registrants", ()))
            holder = data.get("holder")
            state = cls(generation=int(data.get("generation", 0)) & GENERATION_MASK, registrants=regs,
                        rtype=int(data.get("rtype", 0)), holder=bytes.fromhex(holder) if holder else None,
                        ptpl=bool(data.get("ptpl", False)))
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"stored reservation state is malformed: {exc}") from None
        if state.rtype and state.rtype not in ReservationType.__members__.values():
            raise ValueError(f"stored reservation type {state.rtype} is not 1..6")
        return state


EMPTY = ReservationState()


@dataclass(slots=True)
class Outcome:
    """What one reservation command did. ``status`` 0: success and ``state`` is the next state."""

    state: ReservationState
    status: int = 0
    detail: str = ""
    events: list[tuple[bytes, NotificationType]] = field(default_factory=list)
    aborted: set[bytes] = field(default_factory=set)


def allowed(state: ReservationState, hostid: bytes, opcode: int) -> bool:
    """May ``hostid`` run ``opcode`` (an I/O command) on the namespace (nvmet_pr_check_cmd_access)?"""
    if not state.rtype:
        return True
    write = opcode in WRITE_GROUP
    if not write and opcode not in READ_GROUP:
        return True   # reservation commands are checked when they execute
    if state.holds(hostid):
        return True
    rtype = ReservationType(state.rtype)
    if not rtype.registrants_only:
        # Write Exclusive keeps reads open to everyone; Exclusive Access gives the holder alone access
        return not write and not rtype.exclusive_access
    if state.key_of(hostid) is not None:
        return True
    return not write and not rtype.exclusive_access


def _fail(state: ReservationState, status: int, detail: str) -> Outcome:
    return Outcome(state, status, detail)


def _conflict(state: ReservationState, detail: str) -> Outcome:
    return Outcome(state, Status.RESERVATION_CONFLICT, detail)


def _next_gen(state: ReservationState) -> int:
    return (state.generation + 1) & GENERATION_MASK


def _without(state: ReservationState, hostid: bytes) -> tuple[ReservationState, list[tuple[bytes, NotificationType]]]:
    """Remove ``hostid``'s registration and what follows for the reservation (nvmet_pr_unregister_one)."""
    regs = tuple(r for r in state.registrants if r[0] != hostid)
    events: list[tuple[bytes, NotificationType]] = []
    rtype, holder = state.rtype, state.holder
    if rtype and ReservationType(rtype).all_registrants:
        if not regs:
            rtype = 0   # the last holder of an all-registrants reservation left: it ends
    elif rtype and holder == hostid:
        rtype, holder = 0, None
        if ReservationType(state.rtype).registrants_only:
            events = [(h, NotificationType.RESERVATION_RELEASED) for h, _ in regs]
    return dataclasses.replace(state, registrants=regs, rtype=rtype, holder=holder if rtype else None), events


def register(state: ReservationState, hostid: bytes, *, rrega: int, iekey: bool, cptpl: int, crkey: int,
             nrkey: int, ptpl_supported: bool) -> Outcome:
    """Reservation Register (nvmet_execute_pr_register; key 0 rules from SPDK's nvmf_ns_reservation_register)."""
    if rrega not in RegisterAction.__members__.values():
        return _fail(state, Status.INVALID_FIELD, f"Reservation Register action {rrega} (RREGA) is not 0..2")
    if cptpl == 1:
        return _fail(state, Status.INVALID_FIELD, "CPTPL 01b is reserved")
    current = state.key_of(hostid)
    events: list[tuple[bytes, NotificationType]] = []
    if rrega == RegisterAction.REGISTER:
        if nrkey == 0:
            return _fail(state, Status.INVALID_FIELD, "a registration key (NRKEY) of 0 cannot be registered")
        if current is not None and current != nrkey:
            return _conflict(state, "the host is registered with another key; use replace (RREGA 2)")
        nxt = state if current is not None else \
            dataclasses.replace(state, registrants=(*state.registrants, (hostid, nrkey)))
    else:
        if current is None:
            return _conflict(state, "the host is not registered")
        if not iekey and current != crkey:
            return _conflict(state, "CRKEY does not match the host's registration key")
        if rrega == RegisterAction.UNREGISTER or nrkey == 0:
            # Replace with NRKEY 0 unregisters: the Linux host sends the block layer's IOC_PR_REGISTER with
            # new_key 0, which Documentation/block/pr.rst defines as unregister, as a Replace (nvme_pr_register)
            nxt, events = _without(state, hostid)
        else:
            nxt = dataclasses.replace(state, registrants=tuple(
                (h, nrkey if h == hostid else key) for h, key in state.registrants))
    ptpl = nxt.ptpl
    if ptpl_supported and cptpl == Cptpl.SET:
        ptpl = True
    elif ptpl_supported and cptpl == Cptpl.CLEAR:
        ptpl = False
    # Without PTPL support, CPTPL is ignored as nvmet does: the Linux host sets 11b on every register.
    return Outcome(dataclasses.replace(nxt, generation=_next_gen(state), ptpl=ptpl), events=events)


def _check_registrant(state: ReservationState, hostid: bytes, crkey: int) -> Outcome | None:
    key = state.key_of(hostid)
    if key is None:
        return _conflict(state, "the host is not registered on this namespace")
    if key != crkey:
        return _conflict(state, "CRKEY does not match the host's registration key")
    return None


def _rtype_ok(rtype: int) -> bool:
    return rtype in ReservationType.__members__.values()


def acquire(state: ReservationState, hostid: bytes, *, racqa: int, iekey: bool, rtype: int, crkey: int,
            prkey: int) -> Outcome:
    """Reservation Acquire: acquire, preempt, preempt and abort (nvmet_execute_pr_acquire, nvmet_pr_preempt)."""
    if iekey:
        return _fail(state, Status.INVALID_FIELD, "IEKEY is not allowed on Reservation Acquire")
    if racqa not in AcquireAction.__members__.values():
        return _fail(state, Status.INVALID_FIELD, f"Reservation Acquire action {racqa} (RACQA) is not 0..2")
    if not _rtype_ok(rtype):
        return _fail(state, Status.INVALID_FIELD, f"reservation type {rtype} is not 1..6")
    bad = _check_registrant(state, hostid, crkey)
    if bad is not None:
        return bad
    if racqa == AcquireAction.ACQUIRE:
        if state.rtype:
            if state.holds(hostid) and state.rtype == rtype:
                return Outcome(state)
            return _conflict(state, f"the namespace holds a reservation of type {state.rtype}"
                             + (" of another host" if not state.holds(hostid) else "; release it first"))
        holder = None if ReservationType(rtype).all_registrants else hostid
        return Outcome(dataclasses.replace(state, rtype=rtype, holder=holder))
    return _preempt(state, hostid, rtype, prkey, abort=racqa == AcquireAction.PREEMPT_AND_ABORT)


def _remove_by_key(state: ReservationState, prkey: int, sender: bytes, *, others_only: bool,
                   outcome: Outcome, abort: bool) -> ReservationState:
    for h, key in list(state.registrants):
        if key != prkey or (others_only and h == sender):
            continue
        state, events = _without(state, h)
        outcome.events += events
        if h != sender:
            outcome.events.append((h, NotificationType.REGISTRATION_PREEMPTED))
            if abort:
                outcome.aborted.add(h)
    return state


def _preempt(state: ReservationState, hostid: bytes, rtype: int, prkey: int, *, abort: bool) -> Outcome:
    out = Outcome(state)
    matching = any(key == prkey for _, key in state.registrants)
    if not state.rtype or ReservationType(state.rtype).all_registrants:
        if state.rtype and prkey == 0:
            # every other registrant goes; the sender alone holds a reservation of the new type
            nxt = dataclasses.replace(state, rtype=rtype, holder=None if ReservationType(rtype).all_registrants
                                      else hostid)
            for h, _ in state.registrants:
                if h != hostid:
                    nxt = dataclasses.replace(nxt, registrants=tuple(r for r in nxt.registrants if r[0] != h))
                    out.events.append((h, NotificationType.REGISTRATION_PREEMPTED))
                    if abort:
                        out.aborted.add(h)
        else:
            if not matching:
                return _conflict(state, "no registrant has the key PRKEY names"
                                 + (" (PRKEY 0 preempts only an all-registrants reservation)" if not prkey else ""))
            nxt = _remove_by_key(state, prkey, hostid, others_only=False, outcome=out, abort=abort)
    elif state.holder == hostid:
        # the holder preempting itself changes the type (nvmet_pr_preempt, holder == reg)
        nxt = dataclasses.replace(state, rtype=rtype)
        if rtype != state.rtype:
            out.events += [(h, NotificationType.RESERVATION_RELEASED) for h, _ in state.registrants if h != hostid]
        if matching:
            nxt = _remove_by_key(nxt, prkey, hostid, others_only=True, outcome=out, abort=abort)
    elif prkey == state.key_of(state.holder or b""):
        nxt = dataclasses.replace(state, rtype=rtype, holder=None if ReservationType(rtype).all_registrants
                                  else hostid)
        nxt = _remove_by_key(nxt, prkey, hostid, others_only=True, outcome=out, abort=abort)
        if rtype != state.rtype:
            out.events += [(h, NotificationType.RESERVATION_RELEASED) for h, _ in nxt.registrants if h != hostid]
    elif prkey:
        if not matching:
            return _conflict(state, "no registrant has the key PRKEY names")
        nxt = _remove_by_key(state, prkey, hostid, others_only=False, outcome=out, abort=abort)
    else:
        return _fail(state, Status.INVALID_FIELD, "PRKEY 0 preempts only an all-registrants reservation")
    out.state = dataclasses.replace(nxt, generation=_next_gen(state))
    return out


def release(state: ReservationState, hostid: bytes, *, rrela: int, iekey: bool, rtype: int, crkey: int) -> Outcome:
    """Reservation Release: release, clear (nvmet_execute_pr_release)."""
    if iekey:
        return _fail(state, Status.INVALID_FIELD, "IEKEY is not allowed on Reservation Release")
    if rrela not in ReleaseAction.__members__.values():
        return _fail(state, Status.INVALID_FIELD, f"Reservation Release action {rrela} (RRELA) is not 0..1")
    bad = _check_registrant(state, hostid, crkey)
    if bad is not None:
        return bad
    if rrela == ReleaseAction.CLEAR:
        events = [(h, NotificationType.RESERVATION_PREEMPTED) for h, _ in state.registrants if h != hostid]
        return Outcome(ReservationState(generation=_next_gen(state), ptpl=state.ptpl), events=events)
    if not state.holds(hostid):
        return Outcome(state)   # nothing held by this host: success, nothing changes
    if rtype != state.rtype:
        return _fail(state, Status.INVALID_FIELD,
                     f"RTYPE {rtype} differs from the reservation's type {state.rtype}")
    out = Outcome(dataclasses.replace(state, rtype=0, holder=None))
    if ReservationType(state.rtype).registrants_only:
        out.events = [(h, NotificationType.RESERVATION_RELEASED) for h, _ in state.registrants if h != hostid]
    return out
