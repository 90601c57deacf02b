"""The host's reservation commands without a target: SQE and data bytes, the notification log record, the
nvme-cli shaped output and the command line's option parsing (errors caught before any connection)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from initiator import commands as c
from initiator.reservations import ReservationNotification, parse_notification, report_size
from nvmeof.cli import cli, render
from nvmeof.spec.reservations import (
    AcquireAction,
    Cptpl,
    NotificationType,
    RegisterAction,
    Registrant,
    ReleaseAction,
    ReservationNotificationLog,
    ReservationReport,
    ReservationType,
    build_report,
    parse_report,
)


def sqe(opcode: int, nsid: int, cdw10: int, cdw11: int = 0) -> bytes:
    """64 bytes laid out by hand: opcode, flags (PSDT 01b: SGL, as every fabrics command), cid, nsid, 32 zero
    bytes (cdw2/3, mptr, dptr), cdw10, cdw11."""
    return (bytes([opcode, 0x40, 0, 0]) + nsid.to_bytes(4, "little") + bytes(32) + cdw10.to_bytes(4, "little")
            + cdw11.to_bytes(4, "little") + bytes(16))


# ---- builders: libnvme nvme_init_resv_* place the same bits ---------------------------------------------

def test_register_sqe_and_data_bytes():
    cmd, data = c.resv_register(1, rrega=RegisterAction.REPLACE, crkey=0x1122334455667788, nrkey=0xAABB,
                                iekey=True, cptpl=Cptpl.SET)
    raw = cmd.to_bytes()
    assert raw == bytes.fromhex("0d400000" "01000000" + "00" * 32 + "0a0000c0" + "00" * 20)
    assert raw == sqe(0x0D, 1, 0xC000000A)
    assert data == bytes.fromhex("8877665544332211" "bbaa000000000000")
    cmd, data = c.resv_register(7, rrega=RegisterAction.REGISTER, nrkey=1)
    assert cmd.to_bytes() == sqe(0x0D, 7, 0) and data == bytes(8) + (1).to_bytes(8, "little")


def test_acquire_sqe_and_data_bytes():
    cmd, data = c.resv_acquire(5, racqa=AcquireAction.PREEMPT, rtype=ReservationType.EXCLUSIVE_ACCESS_ALL_REGS,
                               crkey=0xBEEF, prkey=0xFFFFFFFFFFFFFFFF)
    assert cmd.to_bytes() == bytes.fromhex("11400000" "05000000" + "00" * 32 + "01060000" + "00" * 20)
    assert data == bytes.fromhex("efbe000000000000" "ffffffffffffffff")
    cmd, _ = c.resv_acquire(1, racqa=AcquireAction.ACQUIRE, rtype=1, crkey=1, iekey=True)
    assert cmd.cdw10 == 0x0108


def test_release_sqe_and_data_bytes():
    cmd, data = c.resv_release(2, rrela=ReleaseAction.CLEAR, rtype=3, crkey=0x0102030405060708, iekey=True)
    assert cmd.to_bytes() == bytes.fromhex("15400000" "02000000" + "00" * 32 + "09030000" + "00" * 20)
    assert data == bytes.fromhex("0807060504030201")


def test_report_sqe_numd_and_eds():
    assert c.resv_report(1, 4096).to_bytes() == bytes.fromhex("0e400000" "01000000" + "00" * 32 + "ff030000"
                                                              "01000000" + "00" * 16)
    assert c.resv_report(3, 24, eds=False).to_bytes() == sqe(0x0E, 3, 5, 0)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: c.resv_register(1, rrega=8), "rrega must be 0..7"),
    (lambda: c.resv_register(1, rrega=0, cptpl=4), "cptpl must be 0..3"),
    (lambda: c.resv_register(1, rrega=0, nrkey=1 << 64), "nrkey must be a 64-bit key"),
    (lambda: c.resv_acquire(1, racqa=0, rtype=256, crkey=1), "rtype must be 0..255"),
    (lambda: c.resv_acquire(1, racqa=0, rtype=1, crkey=-1), "crkey must be a 64-bit key"),
    (lambda: c.resv_release(1, rrela=9), "rrela must be 0..7"),
    (lambda: c.resv_report(1, 6), "positive multiple of 4"),
    (lambda: c.resv_report(1, 0), "positive multiple of 4"),
])
def test_builders_name_the_bad_field(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_report_size_follows_the_layouts():
    assert (report_size(0, eds=False), report_size(2, eds=False)) == (24, 72)
    assert (report_size(0, eds=True), report_size(2, eds=True)) == (64, 192)
    regs = [Registrant(1, True, bytes(range(16)), 7), Registrant(2, False, bytes(16), 9)]
    for eds in (False, True):
        raw = build_report(3, 1, False, regs, eds=eds, size=report_size(2, eds=eds))
        assert len(parse_report(raw, eds=eds).registrants) == 2
        # one entry short: REGCTL still counts both, the list holds what fitted
        cut = parse_report(raw[:report_size(1, eds=eds)], eds=eds)
        assert cut.regctl == 2 and [r.cntlid for r in cut.registrants] == [1]


# ---- Reservation Notification log (80h) -----------------------------------------------------------------

def test_notification_log_record():
    page = ReservationNotificationLog.build({"count": 5, "type": 3, "nalp": 2, "nsid": 9})
    assert parse_notification(page) == ReservationNotification(5, NotificationType.RESERVATION_PREEMPTED, 2, 9)
    assert not parse_notification(page).empty
    assert parse_notification(bytes(64)).empty
    odd = parse_notification(ReservationNotificationLog.build({"count": 1, "type": 0x7F, "nsid": 1}))
    assert odd.type == 0x7F and not isinstance(odd.type, NotificationType)
    with pytest.raises(ValueError, match="shorter than 64"):
        parse_notification(bytes(63))


# ---- output: nvme-cli's json_nvme_resv_report and stdout_resv_report ------------------------------------

REPORT = ReservationReport(gen=4, rtype=2, ptpls=False, regctl=2, registrants=(
    Registrant(0xFFFF, True, bytes.fromhex("00112233445566778899aabbccddeeff"), 0xABCD),
    Registrant(0x12, False, bytes.fromhex("0f0e0d0c0b0a09080706050403020100"), 1)))
SHORT_IDS = ReservationReport(gen=1, rtype=0, ptpls=True, regctl=1, registrants=(
    Registrant(3, False, bytes.fromhex("0100000000000080"), 0x10),))


def test_report_json_has_nvme_clis_fields():
    out = render.resv_report_json(REPORT, eds=True)
    assert list(out) == ["gen", "rtype", "regctl", "ptpls", "regctlext"]
    assert (out["gen"], out["rtype"], out["regctl"], out["ptpls"]) == (4, 2, 2, 0)
    assert [list(e) for e in out["regctlext"]] == [["cntlid", "rcsts", "rkey", "hostid"]] * 2
    assert out["regctlext"][0] == {"cntlid": 0xFFFF, "rcsts": 1, "rkey": 0xABCD,
                                   "hostid": "00112233445566778899aabbccddeeff"}
    short = render.resv_report_json(SHORT_IDS, eds=False)
    assert list(short) == ["gen", "rtype", "regctl", "ptpls", "regctls"]
    # json_nvme_resv_report: the 8-byte host ID as the little-endian u64 it reads
    assert short["regctls"] == [{"cntlid": 3, "rcsts": 0, "hostid": 0x8000000000000001, "rkey": 0x10}]
    assert short["ptpls"] == 1
    json.dumps(out)


def test_report_text_is_nvme_clis_block():
    assert render.resv_report_text(REPORT, eds=True) == "\n".join([
        "", "NVME Reservation status:", "", "gen       : 4", "rtype     : 2", "regctl    : 2", "ptpls     : 0",
        "regctlext[0] :", "  cntlid     : ffff", "  rcsts      : 1", "  rkey       : abcd",
        "  hostid     : 00112233445566778899aabbccddeeff",
        "regctlext[1] :", "  cntlid     : 12", "  rcsts      : 0", "  rkey       : 1",
        "  hostid     : 0f0e0d0c0b0a09080706050403020100", ""])
    text = render.resv_report_text(SHORT_IDS, eds=False).splitlines()
    assert text[7:] == ["regctl[0] :", "  cntlid  : 3", "  rcsts   : 0", "  hostid  : 8000000000000001",
                        "  rkey    : 10"]


# ---- command line: parsing is done before any connection is tried ----------------------------------------

def run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize(("args", "message"), [
    (["resv-register", "-n", "nqn.x", "--crkey", "12z"], "'12z' is not a number"),
    (["resv-register", "-n", "nqn.x", "-k", "0x1ffffffffffffffff"], "does not fit 64 bits"),
    (["resv-register", "-n", "nqn.x", "--rrega", "swap"], "neither a number nor one of: register, unregister"),
    (["resv-register", "-n", "nqn.x", "--cptpl", "4"], "cptpl is 0..3"),
    (["resv-acquire", "-n", "nqn.x", "-c", "1"], "Missing option '--rtype'"),
    (["resv-acquire", "-n", "nqn.x", "--rtype", "256"], "rtype is 0..255"),
    (["resv-acquire", "-n", "nqn.x", "--rtype", "1", "--racqa", "8"], "racqa is 0..7"),
    (["resv-release", "-n", "nqn.x", "--rrela", "drop"], "one of: release, clear"),
    (["resv-report", "-n", "nqn.x", "--namespace-id", "0"], "--namespace-id"),
])
def test_bad_options_are_usage_errors(args, message):
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_option_values_convert_as_nvme_cli_takes_them():
    from nvmeof.cli.commands.resv import CPTPL, RACQA, RTYPE, Key

    key = Key()
    assert key.convert("0x10", None, None) == 16 and key.convert("4096", None, None) == 4096
    assert key.convert("0xffffffffffffffff", None, None) == (1 << 64) - 1
    assert RTYPE.convert("write-exclusive-registrants-only", None, None) == 3
    assert RTYPE.convert("exclusive-access-all-regs", None, None) == 6   # the enum's name, too
    assert RTYPE.convert("0x2", None, None) == 2 and RACQA.convert("preempt-and-abort", None, None) == 2
    assert CPTPL.convert("set", None, None) == 3 and CPTPL.convert("1", None, None) == 1   # reserved passes


def test_help_says_which_letters_differ_from_nvme_cli():
    for cmd in ("resv-register", "resv-acquire", "resv-release", "resv-report"):
        res = run(cmd, "--help")
        assert res.exit_code == 0
        assert "--namespace-id" in res.output and "nvme-cli's -n/--namespace-id" in res.output
    assert "--racqa have no short form" in " ".join(run("resv-acquire", "--help").output.split())


def test_shell_completion_offers_the_commands_and_names():
    from click.shell_completion import BashComplete

    def complete(args: list[str], incomplete: str) -> list[str]:
        return [item.value for item in BashComplete(cli, {}, "nvmeof", "_NVMEOF_COMPLETE").get_completions(
            args, incomplete)]

    assert sorted(complete([], "resv-")) == ["resv-acquire", "resv-register", "resv-release", "resv-report"]
    assert complete(["resv-acquire", "--rtype"], "write-exclusive-r") == ["write-exclusive-registrants-only",
                                                                          "write-exclusive-reg-only"]
    assert complete(["resv-release", "--rrela"], "") == ["release", "clear"]
