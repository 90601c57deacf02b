"""resv_guest.py's fixed facts, without booting a VM: the linux/pr.h ioctl numbers, the access table's shape,
dd's verdicts and the check names the VM test expects."""

from __future__ import annotations

import subprocess

from tests.interop import resv_guest
from tests.interop.test_kernel_reservations import GUEST_CHECKS


def test_pr_ioctl_numbers_are_the_kernels() -> None:
    # the values of IOC_PR_* from <linux/pr.h> on x86-64 (_IOW('p', 200..205, struct ...))
    assert resv_guest.IOC_PR_REGISTER == 0x401870C8
    assert resv_guest.IOC_PR_RESERVE == 0x401070C9
    assert resv_guest.IOC_PR_RELEASE == 0x401070CA
    assert resv_guest.IOC_PR_PREEMPT == 0x401870CB
    assert resv_guest.IOC_PR_CLEAR == 0x401070CD


def test_access_table_holder_always_allowed_and_reads_follow_the_type() -> None:
    for rtype, roles in resv_guest.ACCESS.items():
        assert roles["holder"] == (True, True)
        assert not roles["other"][1], f"type {rtype}: a non-registrant never writes"
        exclusive_access = rtype in (resv_guest.EA, resv_guest.EA_RO, resv_guest.EA_AR)
        assert roles["other"][0] is not exclusive_access
        assert roles["registrant"] == ((not exclusive_access, False) if rtype in (resv_guest.WE, resv_guest.EA)
                                       else (True, True))


def test_dd_verdicts() -> None:
    def done(rc: int, err: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.CompletedProcess([], rc, b"", err.encode())

    assert resv_guest._verdict(done(0, "")) == "ok"
    assert resv_guest._verdict(done(1, "dd: error writing '/dev/nvme1n1': Invalid exchange")) == "conflict"
    assert resv_guest._verdict(done(1, "dd: error reading '/dev/nvme1n1': Input/output error")).startswith("error")


def test_every_scenario_has_its_checks() -> None:
    assert [f"single_t{t}_access" for t in range(1, 7)] == [n for n in GUEST_CHECKS["single"] if n.endswith("_access")
                                                           and n.startswith("single_t")]
    assert "ioctl_clear_access" in GUEST_CHECKS["ioctl"] and "group_holder_and_others_via_b" in GUEST_CHECKS["group"]
    assert GUEST_CHECKS[""] == ["multipath_off"]
