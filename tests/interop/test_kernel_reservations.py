"""NVMe persistent reservations (issue 22) and per-host namespace visibility (masking, issue 25) of our target
refereed by the Linux kernel host.

One Debian guest boot per kernel (6.1, 6.12) runs tests/interop/resv_guest.py with native multipath off
(``nvme_core.multipath=N``), so each `nvme connect --hostnqn --hostid` is a host identity with its own block
device: A (the holder), B (a second registrant), C (never registered). Four scenarios share the boot:

- ``single``: one `nvmeof serve` (RAM namespace). nvme-cli registers A and B, then for every reservation type
  1..6: A acquires it, `resv-report --eds -o json` shows the type, the keys and the holders, and O_DIRECT dd
  reads and writes from A, B and C succeed or fail with EBADE (the block layer's Reservation Conflict) as the
  spec's table says, refused writes leaving their blocks untouched; A releases and everyone has access
  again. Then refused acquires (B while A holds, A with a wrong key), B preempting A with A's key into
  Exclusive Access, A registered again but still refused, the target's REST view, and B's clear.
- ``ioctl``: the block layer's persistent reservation ioctls (IOC_PR_REGISTER incl. replace, RESERVE,
  PREEMPT, RELEASE, CLEAR of linux/pr.h, what cluster managers call) on the same controllers, each effect
  read back with resv-report and enforced on dd.
- ``mask``: a second subsystem of the single target, allowing A and B, with NSID 1 for both and NSID 2 for A
  only: `nvme list-ns` and sysfs differ per identity, Identify Namespace of NSID 2 through B is all zeros; the
  test shows NSID 2 to B and hides it from A over REST, and each connected controller follows by itself.
- ``group``: two gateways of a gateway group (``--group-store dir:PATH``, one file namespace). A registers
  and acquires Exclusive Access through gateway a, B and C are refused through gateway b at once; gateway a
  is killed with SIGKILL; once b owns the ANA group, the reservation still holds there (report, REST, dd):
  B and C are refused, A's identity connected again through b is still the holder, reads what it wrote
  through a, and writes.

The guest prints the check table (`@@CHECK name PASS|FAIL@@`, as test_kernel_host.py), the test does its
part at `@@HOST step@@` lines; each test below asserts a group of checks and names every failed one.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.interop import rootfs, vm
from tests.interop.ourtarget import SUBNQN, OurTarget, start_serve, stop_serve
from tests.interop.test_kernel_host import Barrier, Report, _poll, run_guest
from tests.interop.test_kernel_multipath import ANAGRPID, Gateway, _file_namespace, _replace_namespace_1
from tests.interop.test_rdma_guest import debian_rootfs  # noqa: F401  (fixture)

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(900)]

GUEST_SCRIPT = Path(__file__).with_name("resv_guest.py")
KERNEL_ARGS = "nvme_core.multipath=N"  # one block device per controller: each host identity its own
SINGLE_NQN = f"{SUBNQN}-resv"
MASK_NQN = f"{SUBNQN}-mask"
GROUP_NQN = f"{SUBNQN}-resv-group"
FILE_SIZE = 32 << 20
BLOCK = 512
STEP_TIMEOUT = 300.0  # the longest stretch between two host steps: the whole single + ioctl matrix under TCG
TYPES = range(1, 7)


def _guest_checks() -> dict[str, list[str]]:
    """The guest's check names by scenario, read from the script's run(...) calls."""
    text = GUEST_SCRIPT.read_text()
    names: dict[str, list[str]] = {"single": [], "ioctl": [], "mask": [], "group": [], "": []}
    for m in re.finditer(r'run\(f?"([a-z0-9_{}]+)"', text):
        name = m.group(1)
        expanded = ([name.replace("{who}", w) for w in "abc"] if "{who}" in name else
                    [name.replace("{t}", f"single_t{t}") for t in TYPES] if "{t}" in name else [name])
        scenario = name.split("_", 1)[0] if name.split("_", 1)[0] in names else ""
        if "{t}" in name:
            scenario = "single"
        names[scenario] += [n for n in expanded if n not in names[scenario]]
    return names


GUEST_CHECKS = _guest_checks()
HOST_CHECKS = {
    "single": ["single_target_started", "single_rest_matches", "single_no_controller_left",
               "single_log_clean", "single_clean_exit"],
    "group": ["group_setup_done", "group_rest_failover", "group_rest_matches_after_failover",
              "group_log_clean", "group_clean_exit"],
}


def _identities() -> dict[str, dict[str, str]]:
    ids = {}
    for who in "abc":
        u = uuid.uuid4()
        ids[who] = {"hostnqn": f"nqn.2014-08.org.nvmexpress:uuid:{u}", "hostid": str(u)}
    return ids


class ResvRun:
    """The host's side of the one guest run: the single target, the gateway pair, the REST checks."""

    def __init__(self, log_dir: Path, barrier: Barrier, report: Report, ids: dict[str, dict[str, str]]) -> None:
        self.log_dir = log_dir
        self.barrier = barrier
        self.report = report
        self.ids = ids
        self.single: OurTarget | None = None
        self.single_exit: int | None = None
        self.gateways: list[Gateway] = []
        self.group = f"resv-{uuid.uuid4().hex[:8]}"

    # -- set-up before the boot

    def start_single(self, ports: list[int]) -> None:
        try:
            self.single = start_serve(self.log_dir / "single.log", subnqn=SINGLE_NQN, size="64M", block_size=BLOCK,
                                      ports=ports)
            self.report.record("single_target_started", True)
        except AssertionError as exc:
            self.report.record("single_target_started", False, str(exc).splitlines()[0])

    def start_group(self, ports: list[int]) -> bool:
        gdir = self.log_dir / "group"
        gdir.mkdir(parents=True, exist_ok=True)
        backing = gdir / "shared.img"
        with open(backing, "wb") as f:
            f.truncate(FILE_SIZE)
        store = f"dir:{gdir / 'store'}"
        for i, role in enumerate("ab"):
            args = ["--gateway-group", self.group, "--gateway-name", f"gw-{role}", "--group-store", store,
                    "--backing-dir", str(gdir)]
            self.gateways.append(Gateway(f"gw-{role}", gdir / f"gw-{role}", GROUP_NQN, args,
                                         tuple(ports[3 * i: 3 * i + 3])))  # type: ignore[arg-type]
        a, b = self.gateways
        try:
            a.start()
            _replace_namespace_1(a, _file_namespace(backing, GROUP_NQN))
            b.start()
            ok = _poll(lambda: b.try_api("GET", f"/subsystems/{GROUP_NQN}/namespaces/1") is not None
                       and a.ana_state(ANAGRPID) == "optimized" and b.ana_state(ANAGRPID) == "non-optimized", 30)
            self.report.record("group_setup_done", ok, f"30 s after both started: a {a.ana_state(ANAGRPID)}, "
                               f"b {b.ana_state(ANAGRPID)} (expected optimized / non-optimized)")
            return ok
        except Exception as exc:
            self.report.record("group_setup_done", False, f"{type(exc).__name__}: {str(exc)[:500]}")
            return False

    # -- host steps

    def step(self, name: str) -> bool:
        try:
            if name == "single-rest":
                self.check_rest("single_rest_matches", self.single, SINGLE_NQN, rtype=2, holder="b", keys="ab")
            elif name.startswith("mask-"):
                self.mask_step(name)
            elif name == "single-teardown":
                self.stop_single()
            elif name == "group-kill":
                self.kill_gateway_a()
            elif name == "group-rest":
                self.check_rest("group_rest_matches_after_failover", self.gateways[1].target, GROUP_NQN,
                                rtype=2, holder="a", keys="ab")
            elif name == "group-teardown":
                self.stop_group()
            elif name == "all-done":
                self.barrier.release("done")
                return True
            else:
                raise AssertionError(f"the guest asked for an unknown host step {name!r}")
        except Exception as exc:  # the guest goes on; the table names the failed step
            self.report.record(f"host_step_{name.replace('-', '_')}", False, f"{type(exc).__name__}: {exc}")
        self.barrier.release(name)
        return False

    def mask_step(self, name: str) -> None:
        """Masking over REST on the single target: the guest checks what each host identity sees."""
        target = self.single
        assert target is not None, "the single target is not running"
        a, b = self.ids["a"]["hostnqn"], self.ids["b"]["hostnqn"]
        namespaces = f"/subsystems/{MASK_NQN}/namespaces"
        if name == "mask-setup":
            target.api("POST", "/subsystems", json={"nqn": MASK_NQN, "hosts": [a, b]})
            target.api("POST", namespaces, json={"backend": "ram", "size": 16 << 20, "nsid": 1})
            made = target.api("POST", namespaces, json={"backend": "ram", "size": 16 << 20, "nsid": 2,
                                                        "auto_visible": False, "hosts": [a]})
            assert made["hosts"] == [a], made
        elif name == "mask-add-b":
            assert target.api("POST", f"{namespaces}/2/hosts", json={"hostnqn": b})["hosts"] == sorted([a, b])
        elif name == "mask-remove-a":
            assert target.api("DELETE", f"{namespaces}/2/hosts/{a}")["hosts"] == [b]
        else:
            raise AssertionError(f"the guest asked for an unknown host step {name!r}")

    def check_rest(self, check: str, target: OurTarget | None, nqn: str, *, rtype: int, holder: str,
                   keys: str) -> None:
        """GET .../namespaces/1/reservations agrees with what the kernel host was told."""
        if target is None:
            self.report.record(check, False, "the target is not running")
            return
        view = target.api("GET", f"/subsystems/{nqn}/namespaces/1/reservations")
        want_ids = {uuid.UUID(self.ids[w]["hostid"]).hex: w for w in keys}
        regs = {r["hostid"].replace("-", "").lower(): r for r in view.get("registrants", [])}
        problems = []
        if view.get("rtype") != rtype:
            problems.append(f"rtype {view.get('rtype')}, expected {rtype}")
        if set(regs) != set(want_ids):
            problems.append(f"registrants {sorted(regs)}, expected {sorted(want_ids)} ({keys})")
        held = sorted(want_ids.get(h, h) for h, r in regs.items() if r.get("holds"))
        if held != [holder]:
            problems.append(f"holders {held}, expected [{holder}]")
        if (view.get("holder") or "").replace("-", "").lower() != uuid.UUID(self.ids[holder]["hostid"]).hex:
            problems.append(f"holder {view.get('holder')}, expected {holder}'s hostid")
        if any(not re.fullmatch(r"\**|redacted|<redacted>|", str(r.get("rkey", ""))) for r in regs.values()):
            problems.append(f"a registrant's key is shown: {[r.get('rkey') for r in regs.values()]}")
        self.report.record(check, not problems, "; ".join(problems) + f"; REST view {json.dumps(view)[:600]}")

    def stop_single(self) -> None:
        if self.single is None:
            return
        left: list[Any] = []

        def none_left() -> bool:
            left[:] = [c for c in self.single.controllers() if c["subnqn"] == SINGLE_NQN]  # type: ignore[union-attr]
            return not left

        self.report.record("single_no_controller_left", _poll(none_left, 10),
                           f"controllers listed 10 s after the guest disconnected: {left}")
        errors = self.single.log_errors()
        self.single_exit = stop_serve(self.single)
        self.single = None
        self.report.record("single_clean_exit", self.single_exit == 0, f"exit status {self.single_exit} on SIGTERM")
        self.report.record("single_log_clean", not errors, "target log errors:\n    " + "\n    ".join(errors[:20]))

    def kill_gateway_a(self) -> None:
        a, b = self.gateways
        began = time.monotonic()
        a.kill()
        ok = _poll(lambda: b.ana_state(ANAGRPID) == "optimized", 60)
        took = time.monotonic() - began
        self.report.info["group_rest_failover_s"] = f"{took:.2f}"
        self.report.record("group_rest_failover", ok, f"b's REST shows ANA group {ANAGRPID} "
                           f"{b.ana_state(ANAGRPID)} {took:.1f} s after a was killed")

    def stop_group(self) -> None:
        for gw in self.gateways:
            gw.stop()
        b = self.gateways[1]
        self.report.record("group_clean_exit", bool(b.exit_codes) and all(c == 0 for c in b.exit_codes),
                           f"gateway b's exit statuses on SIGTERM: {b.exit_codes}")
        bad = {gw.name: gw.log_errors()[:10] for gw in self.gateways if gw.log_errors()}
        self.report.record("group_log_clean", not bad, f"ERROR lines in the gateways' logs: {bad}")

    def close(self) -> None:
        if self.single is not None:
            with contextlib.suppress(Exception):
                stop_serve(self.single)
        for gw in self.gateways:
            with contextlib.suppress(Exception):
                gw.stop()


@pytest.fixture(scope="module")
def resv_report(vm_assets: vm.Assets, debian_rootfs: rootfs.RootfsAssets,  # noqa: F811
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Report]:
    log_dir = tmp_path_factory.mktemp("kernel-resv")
    report = Report(console=log_dir / "guest-console.log", target_log=log_dir)
    began = time.monotonic()
    barrier = Barrier()
    ids = _identities()
    run = ResvRun(log_dir, barrier, report, ids)
    ports = vm.free_ports(9)
    scenarios = []
    guest = None
    try:
        run.start_single(ports[0:3])
        if run.single is not None:
            scenarios += ["single", "ioctl", "mask"]
        if run.start_group(ports[3:9]):
            scenarios.append("group")
        report.info["setup_s"] = f"{time.monotonic() - began:.1f}"
        env = {
            "RESV_T": vm.HOST_ADDR, "RESV_GO": f"http://{vm.HOST_ADDR}:{barrier.port}/",
            "RESV_SCENARIOS": ",".join(scenarios), "RESV_IDS": json.dumps(ids),
            "RESV_SINGLE": json.dumps({"nqn": SINGLE_NQN, "port": ports[0]}),
            "RESV_MASK": json.dumps({"nqn": MASK_NQN, "port": ports[0]}),
            "RESV_GROUP": json.dumps({"nqn": GROUP_NQN, "port_a": ports[3], "port_b": ports[6]}),
        }  # fmt: skip
        guest = rootfs.rootfs_guest(debian_rootfs, files={"script.py": GUEST_SCRIPT.read_bytes()},
                                    kernel_args=KERNEL_ARGS)
        run_guest(guest, rootfs.python_run_script(env=env), report, run.step, step_timeout=STEP_TIMEOUT)
    finally:
        barrier.close()
        run.close()
    report.seconds = time.monotonic() - began
    report.info["scenarios_run"] = ",".join(scenarios)
    _print_report(report, scenarios)
    yield report


def _print_report(report: Report, scenarios: list[str]) -> None:
    print(f"\nkernel reservations: {report.seconds:.1f} s total, boot {report.boot_seconds or 0:.1f} s, scenarios "
          f"{scenarios}; console {report.console}; target logs under {report.target_log}")
    timing = {k: v for k, v in report.info.items() if k.endswith("_seconds") or k.endswith("_s")}
    print(f"  times: {timing}")
    print(f"  kernel: {report.info.get('kernel')} multipath={report.info.get('nvme_core_multipath')} "
          f"{report.info.get('nvme_cli')}; ioctl conflict rc {report.info.get('ioctl_reserve_conflict_rc')}; "
          f"report without EDS: {report.info.get('single_report_without_eds')}")
    report.print_checks(_expected(scenarios))


def _expected(scenarios: list[str]) -> list[str]:
    names = list(GUEST_CHECKS[""])
    if "single" in scenarios:
        names += GUEST_CHECKS["single"] + GUEST_CHECKS["ioctl"] + HOST_CHECKS["single"]
    if "mask" in scenarios:
        names += GUEST_CHECKS["mask"]
    if "group" in scenarios:
        names += GUEST_CHECKS["group"] + HOST_CHECKS["group"]
    return names


def _single_ran(report: Report) -> None:
    report.assert_passed("single_target_started")


def _group_ran(report: Report) -> None:
    result = report.checks.get("group_setup_done")
    if result is not None and not result.ok:
        pytest.fail(f"the gateway group did not start, so its scenario did not run: {result.reason}")


# ------------------------------------------------------------------------------- the tests


def test_two_host_identities_without_multipath(resv_report: Report) -> None:
    _single_ran(resv_report)
    resv_report.assert_passed("multipath_off", "single_connect_a", "single_connect_b", "single_connect_c",
                              "single_distinct_cntlids", "single_report_empty", "single_register_a_b",
                              "single_report_without_eds_refused")


@pytest.mark.parametrize("rtype", TYPES, ids=lambda t: f"rtype{t}")
def test_reservation_type_enforced(resv_report: Report, rtype: int) -> None:
    _single_ran(resv_report)
    resv_report.assert_passed(*(f"single_t{rtype}_{c}" for c in ("acquire", "access", "release", "restored")))


def test_refusals_preempt_and_clear(resv_report: Report) -> None:
    _single_ran(resv_report)
    resv_report.assert_passed("single_acquire_refusals", "single_preempt", "single_preempted_access",
                              "single_reregister_still_refused", "single_rest_view", "single_rest_matches",
                              "single_reregistered_access", "single_clear", "single_cleared_access")


def test_block_layer_pr_ioctls(resv_report: Report) -> None:
    _single_ran(resv_report)
    resv_report.assert_passed(*GUEST_CHECKS["ioctl"])


def test_single_target_disconnect_and_clean_exit(resv_report: Report) -> None:
    _single_ran(resv_report)
    resv_report.assert_passed("single_disconnect_a", "single_disconnect_b", "single_disconnect_c",
                              "single_teardown", "single_no_controller_left", "single_log_clean", "single_clean_exit")


def test_masking_per_host_identity(resv_report: Report) -> None:
    """Two host identities see different namespace lists; a visibility change reaches a connected host live."""
    _single_ran(resv_report)
    resv_report.assert_passed(*GUEST_CHECKS["mask"])


def test_group_reservation_is_group_wide(resv_report: Report) -> None:
    _group_ran(resv_report)
    resv_report.assert_passed("group_setup_done", "group_connect_a_via_a", "group_connect_b_via_b",
                              "group_connect_c_via_b", "group_register", "group_acquire_ea",
                              "group_holder_writes_via_a", "group_conflicts_via_b")


def test_group_reservation_survives_kill9_failover(resv_report: Report) -> None:
    _group_ran(resv_report)
    resv_report.assert_passed("group_kill_a", "group_rest_failover", "group_report_after_failover", "group_rest_view",
                              "group_rest_matches_after_failover", "group_conflicts_after_failover",
                              "group_disconnect_dead_path", "group_reconnect_a_via_b", "group_holder_reads_via_b",
                              "group_holder_and_others_via_b", "group_clear", "group_cleared_access")


def test_group_teardown(resv_report: Report) -> None:
    _group_ran(resv_report)
    resv_report.assert_passed("group_disconnect_a2", "group_disconnect_b", "group_disconnect_c", "group_teardown",
                              "group_log_clean", "group_clean_exit")


def test_every_check_reported(resv_report: Report) -> None:
    scenarios = resv_report.info.get("scenarios_run", "").split(",")
    expected = set(_expected(scenarios)) | {"single_target_started", "group_setup_done"}
    missing = expected - set(resv_report.checks)
    unknown = set(resv_report.checks) - expected
    assert not missing and not unknown, (f"checks not reported: {sorted(missing)}; unexpected: {sorted(unknown)}; "
                                         f"{resv_report.error}")
