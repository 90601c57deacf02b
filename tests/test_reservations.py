"""The reservation rules of target/reservations.py: the access table and each command's effect on the state."""

from __future__ import annotations

import itertools

import pytest

from nvmeof.spec.nvme import IoOpcode
from nvmeof.spec.reservations import NotificationType as N
from nvmeof.spec.reservations import ReservationType as T
from nvmeof.status import Status
from target import reservations as r

A, B, C = b"A" * 16, b"B" * 16, b"C" * 16
READS = (IoOpcode.READ, IoOpcode.COMPARE)
WRITES = (IoOpcode.WRITE, IoOpcode.WRITE_ZEROES, IoOpcode.DATASET_MANAGEMENT, IoOpcode.FLUSH)

# The spec's "Command Behavior in the Presence of a Reservation": (read allowed, write allowed) for a
# registrant that does not hold the reservation and for a host that is not registered.
TABLE = {
    T.WRITE_EXCLUSIVE: {"registrant": (True, False), "other": (True, False)},
    T.EXCLUSIVE_ACCESS: {"registrant": (False, False), "other": (False, False)},
    T.WRITE_EXCLUSIVE_REG_ONLY: {"registrant": (True, True), "other": (True, False)},
    T.EXCLUSIVE_ACCESS_REG_ONLY: {"registrant": (True, True), "other": (False, False)},
    T.WRITE_EXCLUSIVE_ALL_REGS: {"registrant": (True, True), "other": (True, False)},
    T.EXCLUSIVE_ACCESS_ALL_REGS: {"registrant": (True, True), "other": (False, False)},
}


def ok(out: r.Outcome) -> r.ReservationState:
    assert out.status == 0, out.detail
    return out.state


def reg(state, host, key, **kw):
    args = {"rrega": 0, "iekey": False, "cptpl": 0, "crkey": 0, "nrkey": key, "ptpl_supported": True} | kw
    return r.register(state, host, **args)


def acq(state, host, key, rtype, *, racqa=0, prkey=0, iekey=False):
    return r.acquire(state, host, racqa=racqa, iekey=iekey, rtype=int(rtype), crkey=key, prkey=prkey)


def rel(state, host, key, rtype, *, rrela=0, iekey=False):
    return r.release(state, host, rrela=rrela, iekey=iekey, rtype=int(rtype), crkey=key)


def held(rtype: T) -> r.ReservationState:
    """A holds rtype, B is registered, C is not."""
    s = ok(reg(ok(reg(r.EMPTY, A, 1)), B, 2))
    return ok(acq(s, A, 1, rtype))


@pytest.mark.parametrize(("rtype", "who", "op"), itertools.product(T, ("holder", "registrant", "other"),
                                                                 READS + WRITES))
def test_access_table(rtype, who, op):
    state = held(rtype)
    host = {"holder": A, "registrant": B, "other": C}[who]
    if who == "holder":
        expected = True
    else:
        read_ok, write_ok = TABLE[rtype][who]
        expected = write_ok if op in WRITES else read_ok
    assert r.allowed(state, host, op) is expected


def test_no_reservation_allows_everyone_and_reservation_commands_are_not_gated():
    s = ok(reg(r.EMPTY, A, 1))
    assert all(r.allowed(s, C, op) for op in READS + WRITES)
    ea = held(T.EXCLUSIVE_ACCESS)
    assert r.allowed(ea, C, IoOpcode.RESV_REPORT) and r.allowed(ea, C, IoOpcode.RESV_REGISTER)


def test_all_registrants_every_registrant_holds_and_the_last_one_ends_it():
    s = held(T.EXCLUSIVE_ACCESS_ALL_REGS)
    assert s.holds(A) and s.holds(B) and not s.holds(C)
    s = ok(reg(s, A, 0, rrega=1, crkey=1))             # A unregisters: B still holds it
    assert s.rtype == T.EXCLUSIVE_ACCESS_ALL_REGS and s.holds(B)
    s = ok(reg(s, B, 0, rrega=1, crkey=2))
    assert s.rtype == 0 and not s.registrants


def test_register_rules_and_generation():
    s = ok(reg(r.EMPTY, A, 5))
    assert s.generation == 1 and s.key_of(A) == 5
    assert ok(reg(s, A, 5)).generation == 2                     # same key again: success
    assert reg(s, A, 6).status == Status.RESERVATION_CONFLICT   # another key: conflict
    assert reg(s, B, 0).status == Status.INVALID_FIELD          # key 0 cannot be registered
    assert reg(s, B, 1, rrega=7).status == Status.INVALID_FIELD
    assert reg(s, B, 1, cptpl=1).status == Status.INVALID_FIELD  # CPTPL 01b reserved
    assert reg(s, A, 9, rrega=2, crkey=4).status == Status.RESERVATION_CONFLICT  # wrong CRKEY
    assert ok(reg(s, A, 9, rrega=2, crkey=4, iekey=True)).key_of(A) == 9          # IEKEY ignores it
    assert reg(s, B, 9, rrega=2, crkey=0).status == Status.RESERVATION_CONFLICT  # replace: not registered
    assert reg(s, B, 0, rrega=1).status == Status.RESERVATION_CONFLICT           # unregister: not registered


def test_replace_with_key_zero_unregisters_as_the_block_layer_means_it():
    s = ok(acq(ok(reg(r.EMPTY, A, 5)), A, 5, T.WRITE_EXCLUSIVE))
    s = ok(reg(s, A, 0, rrega=2, crkey=5))
    assert s.key_of(A) is None and s.rtype == 0


def test_cptpl_sets_and_clears_ptpl_only_where_supported():
    s = ok(reg(r.EMPTY, A, 5, cptpl=3))
    assert s.ptpl
    assert not ok(reg(s, A, 5, cptpl=2)).ptpl
    assert not ok(reg(r.EMPTY, A, 5, cptpl=3, ptpl_supported=False)).ptpl


def test_acquire_rules():
    s = ok(reg(ok(reg(r.EMPTY, A, 1)), B, 2))
    assert acq(s, C, 3, T.WRITE_EXCLUSIVE).status == Status.RESERVATION_CONFLICT   # not registered
    assert acq(s, A, 9, T.WRITE_EXCLUSIVE).status == Status.RESERVATION_CONFLICT   # wrong key
    assert acq(s, A, 1, 7).status == Status.INVALID_FIELD
    assert acq(s, A, 1, 0).status == Status.INVALID_FIELD
    assert acq(s, A, 1, T.WRITE_EXCLUSIVE, iekey=True).status == Status.INVALID_FIELD
    assert acq(s, A, 1, T.WRITE_EXCLUSIVE, racqa=3).status == Status.INVALID_FIELD
    we = ok(acq(s, A, 1, T.WRITE_EXCLUSIVE))
    assert we.holder == A and we.generation == s.generation        # acquire does not count
    assert ok(acq(we, A, 1, T.WRITE_EXCLUSIVE)) == we               # again, same type: nothing changes
    assert acq(we, A, 1, T.EXCLUSIVE_ACCESS).status == Status.RESERVATION_CONFLICT
    assert acq(we, B, 2, T.WRITE_EXCLUSIVE).status == Status.RESERVATION_CONFLICT


def test_preempt_takes_over_and_removes_the_preempted():
    s = held(T.WRITE_EXCLUSIVE)
    out = acq(s, B, 2, T.EXCLUSIVE_ACCESS, racqa=1, prkey=1)
    n = ok(out)
    assert n.holder == B and n.rtype == T.EXCLUSIVE_ACCESS and n.key_of(A) is None
    assert n.generation == s.generation + 1
    assert (A, N.REGISTRATION_PREEMPTED) in out.events and not out.aborted
    aborted = acq(s, B, 2, T.WRITE_EXCLUSIVE, racqa=2, prkey=1)
    assert aborted.aborted == {A}


def test_preempt_without_holder_key_removes_registrants_or_conflicts():
    s = held(T.WRITE_EXCLUSIVE)
    s = ok(reg(s, C, 3))
    out = acq(s, A, 1, T.WRITE_EXCLUSIVE, racqa=1, prkey=3)     # the holder removes C, keeps its reservation
    assert ok(out).key_of(C) is None and ok(out).holder == A
    assert acq(s, B, 2, T.WRITE_EXCLUSIVE, racqa=1, prkey=99).status == Status.RESERVATION_CONFLICT
    assert acq(s, B, 2, T.WRITE_EXCLUSIVE, racqa=1, prkey=0).status == Status.INVALID_FIELD


def test_preempt_all_registrants_with_zero_key_leaves_the_sender_alone():
    s = held(T.WRITE_EXCLUSIVE_ALL_REGS)
    out = acq(s, B, 2, T.EXCLUSIVE_ACCESS, racqa=2, prkey=0)
    n = ok(out)
    assert [h for h, _ in n.registrants] == [B] and n.holder == B and n.rtype == T.EXCLUSIVE_ACCESS
    assert out.aborted == {A} and (A, N.REGISTRATION_PREEMPTED) in out.events


def test_holder_preempting_itself_changes_the_type_and_tells_the_others():
    s = held(T.WRITE_EXCLUSIVE_REG_ONLY)
    out = acq(s, A, 1, T.EXCLUSIVE_ACCESS_REG_ONLY, racqa=1, prkey=1)
    assert ok(out).rtype == T.EXCLUSIVE_ACCESS_REG_ONLY and ok(out).holder == A
    assert (B, N.RESERVATION_RELEASED) in out.events


def test_release_rules_and_notifications():
    s = held(T.WRITE_EXCLUSIVE_REG_ONLY)
    assert rel(s, A, 1, T.WRITE_EXCLUSIVE).status == Status.INVALID_FIELD        # type differs
    assert rel(s, A, 9, T.WRITE_EXCLUSIVE_REG_ONLY).status == Status.RESERVATION_CONFLICT
    assert rel(s, A, 1, T.WRITE_EXCLUSIVE_REG_ONLY, iekey=True).status == Status.INVALID_FIELD
    assert rel(s, A, 1, T.WRITE_EXCLUSIVE_REG_ONLY, rrela=2).status == Status.INVALID_FIELD
    assert ok(rel(s, B, 2, T.WRITE_EXCLUSIVE_REG_ONLY)) == s                      # not the holder: nothing
    out = rel(s, A, 1, T.WRITE_EXCLUSIVE_REG_ONLY)
    assert ok(out).rtype == 0 and ok(out).key_of(A) == 1
    assert out.events == [(B, N.RESERVATION_RELEASED)]
    quiet = rel(held(T.WRITE_EXCLUSIVE), A, 1, T.WRITE_EXCLUSIVE)               # types 1 and 2 tell nobody
    assert ok(quiet).rtype == 0 and quiet.events == []


def test_clear_drops_everything_and_tells_the_other_registrants():
    s = held(T.EXCLUSIVE_ACCESS)
    out = rel(s, B, 2, T.EXCLUSIVE_ACCESS, rrela=1)
    assert ok(out).registrants == () and ok(out).rtype == 0 and ok(out).generation == s.generation + 1
    assert out.events == [(A, N.RESERVATION_PREEMPTED)]


def test_state_round_trips_through_its_stored_form_and_rejects_garbage():
    s = ok(reg(held(T.EXCLUSIVE_ACCESS_REG_ONLY), C, 3, cptpl=3))
    assert r.ReservationState.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="type 9"):
        r.ReservationState.from_dict({"rtype": 9})
    with pytest.raises(ValueError, match="malformed"):
        r.ReservationState.from_dict({"registrants": [["zz", 1]]})
