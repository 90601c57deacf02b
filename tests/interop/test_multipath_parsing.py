"""test_kernel_multipath.py's readers of guest output, without booting a VM: `nvme list-subsys -o json`
(nvme-cli 2.3, as Debian bookworm's guest prints it), fio's summary lines, the scenario selection,
and that every check a test asserts is one the guest script or the host reports."""

from __future__ import annotations

import pytest

from tests.interop import test_kernel_multipath as mp

# What nvme-cli 2.3 printed in the guest right after the owner of the ANA group was killed.
LIST_SUBSYS_FAILOVER = {
    "HostNQN": "nqn.2014-08.org.nvmexpress:uuid:80e268ff-d95d-4453-b86d-744621aea0da",
    "Subsystems": [{
        "Name": "nvme-subsys0", "NQN": "nqn.2026-11.io.nvmeof-toolkit:interop-mp-dir",
        "Paths": [
            {"Name": "nvme0", "Transport": "tcp", "Address": "traddr=10.0.2.2,trsvcid=53621", "State": "connecting",
             "ANAState": "optimized"},
            {"Name": "nvme1", "Transport": "tcp", "Address": "traddr=10.0.2.2,trsvcid=44663,src_addr=10.0.2.15",
             "State": "live", "ANAState": "optimized"},
        ]}],
}  # fmt: skip

FIO_PASS = """\
@@FIOLINE dir dir: (groupid=0, jobs=1): err= 0: pid=314: Wed Dec  2 01:57:43 2026@@
@@FIOLINE dir   read: IOPS=35.0k, BW=137MiB/s (143MB/s)(4096KiB/117msec)@@
@@FIOLINE dir     clat (usec): min=1936, max=132965, avg=29076.48, stdev=17319.23@@
@@FIOLINE dir   write: IOPS=243, BW=976KiB/s (999kB/s)(4096KiB/16794msec); 0 zone resets@@
@@FIOLINE dir     clat (msec): min=1, max=25503, avg=32.97, stdev=16.43@@
@@FIOLINE dir    READ: bw=137MiB/s (143MB/s), 137MiB/s-137MiB/s io=4096KiB (4194kB), run=117-117msec@@
@@FIOLINE dir   WRITE: bw=976KiB/s (999kB/s), 976KiB/s-976KiB/s io=4.00MiB (4194kB), run=16794-16794msec@@
"""


def test_list_subsys_paths_and_states() -> None:
    paths = mp.paths_from_list_subsys([LIST_SUBSYS_FAILOVER])
    assert paths == [{"trsvcid": "53621", "state": "connecting", "ana": "optimized"},
                     {"trsvcid": "44663", "state": "live", "ana": "optimized"}]
    seen = {"a": ("connecting", "optimized"), "b": ("live", "optimized")}
    assert mp.subsys_states_match(seen, {"a": ("connecting", None), "b": ("live", "optimized")})
    down = frozenset({"resetting", "connecting"})
    assert mp.subsys_states_match(seen, {"a": (down, None), "b": ("live", "optimized")})
    assert not mp.subsys_states_match(seen, {"a": (frozenset({"live"}), None), "b": ("live", "optimized")})
    assert not mp.subsys_states_match(seen, {"a": ("live", "optimized"), "b": ("live", "non-optimized")})
    assert not mp.subsys_states_match({"b": ("live", "optimized")}, {"a": (None, None), "b": (None, None)})


def test_fio_figures_add_up_the_passes() -> None:
    out = mp.fio_figures(FIO_PASS + FIO_PASS.replace("err= 0", "err= 5"), "dir")
    assert out == {"passes": 2, "written_mib": 8.0, "read_mib": 8.0, "errors": 5, "clat_max_ms": 25503.0}
    assert mp.fio_figures(FIO_PASS, "rbd")["passes"] == 0  # another scenario's lines do not count


def test_scenario_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mp.SCENARIOS_ENV, raising=False)
    assert mp.selected_scenarios() == ["ana", "dir", "rbd"]
    monkeypatch.setenv(mp.SCENARIOS_ENV, "rbd, ana")
    assert mp.selected_scenarios() == ["ana", "rbd"]
    monkeypatch.setenv(mp.SCENARIOS_ENV, "ana,nope")
    with pytest.raises(ValueError, match=r"unknown scenario.*nope"):
        mp.selected_scenarios()


class _Recorder(mp.Report):
    """A report where every known check passed; remembers what the tests asserted."""

    def __init__(self, known: set[str]) -> None:
        super().__init__()
        for name in known:
            self.record(name, True)
        self.asserted: set[str] = set()

    def assert_passed(self, *names: str) -> None:
        self.asserted.update(names)


def test_every_asserted_check_is_reported_by_someone() -> None:
    """A check a test asserts but neither the guest script nor the host reports could only fail."""
    known = {c for n in mp.SCENARIOS for c in mp.guest_checks(n) + mp.host_checks(n)} | {"multipath_enabled"}
    report = _Recorder(known)
    tests = [getattr(mp, name) for name in dir(mp) if name.startswith("test_") and name != "test_every_check_reported"]
    for test in tests:
        test(report)
    assert report.asserted, "no test asserted anything"
    assert report.asserted <= known, f"asserted but never reported: {sorted(report.asserted - known)}"
    # and every reported check is asserted by some test (test_every_check_reported aside)
    assert known <= report.asserted, f"reported but asserted by no test: {sorted(known - report.asserted)}"
