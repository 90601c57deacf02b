"""Reservation wire structures: sizes and offsets as include/linux/nvme.h lays them out."""

from __future__ import annotations

import pytest

from nvmeof.spec import reservations as r


@pytest.mark.parametrize(("struct", "size"), [
    (r.RegisterData, 16), (r.AcquireData, 16), (r.ReleaseData, 8),
    (r.ReservationStatusHeader, 24), (r.ReservationStatusExtHeader, 64),
    (r.RegisteredController, 24), (r.RegisteredControllerExt, 64), (r.ReservationNotificationLog, 64),
])
def test_sizes_and_compiled_parsers(struct, size):
    assert struct.sizeof() == size
    blob = struct.build({})
    assert len(blob) == size
    assert struct.compile().parse(blob) == struct.parse(blob)


def test_extended_entry_offsets():
    blob = r.RegisteredControllerExt.build({"cntlid": 0x1234, "rcsts": 1, "rkey": 0xAABB, "hostid": bytes(range(16))})
    assert blob[0:2] == b"\x34\x12" and blob[2] == 1
    assert int.from_bytes(blob[8:16], "little") == 0xAABB      # RKEY at byte 8 in the extended entry
    assert blob[16:32] == bytes(range(16))                      # HOSTID at byte 16


def test_regular_entry_offsets():
    blob = r.RegisteredController.build({"cntlid": 1, "hostid": b"ABCDEFGH", "rkey": 7})
    assert blob[8:16] == b"ABCDEFGH" and int.from_bytes(blob[16:24], "little") == 7


def test_notification_log_offsets():
    blob = r.ReservationNotificationLog.build({"count": 9, "type": 2, "nalp": 3, "nsid": 5})
    assert int.from_bytes(blob[0:8], "little") == 9 and blob[8] == 2 and blob[9] == 3
    assert int.from_bytes(blob[12:16], "little") == 5


@pytest.mark.parametrize("eds", [False, True])
def test_report_round_trip_and_truncation(eds):
    regs = [r.Registrant(r.CNTLID_DYNAMIC, i == 0, bytes([i]) * 16, 100 + i) for i in range(3)]
    hsize, esize = (r.EXT_HEADER_SIZE, r.EXT_ENTRY_SIZE) if eds else (r.HEADER_SIZE, r.ENTRY_SIZE)
    full = r.build_report(7, 3, True, regs, eds=eds, size=hsize + 3 * esize)
    rep = r.parse_report(full, eds=eds)
    assert (rep.gen, rep.rtype, rep.ptpls, rep.regctl) == (7, 3, True, 3)
    assert [x.rkey for x in rep.registrants] == [100, 101, 102]
    assert rep.registrants[0].holds and not rep.registrants[1].holds
    assert rep.registrants[2].hostid == (bytes([2]) * 16 if eds else bytes([2]) * 8)
    cut = r.parse_report(r.build_report(7, 3, True, regs, eds=eds, size=hsize + esize), eds=eds)
    assert cut.regctl == 3 and len(cut.registrants) == 1          # REGCTL still counts them all


def test_rescap_lists_every_type_ptpl_and_iekey():
    assert r.RESCAP_ALL == 0xFF
    assert [t for t in r.ReservationType if t.all_registrants] == [5, 6]
    assert [t for t in r.ReservationType if t.exclusive_access] == [2, 4, 6]
