"""The Linux kernel host against `nvmeof serve --workers 2`: the kernel referees the worker processes.

One guest boot.  The kernel connects with two I/O queues (plain, then with header and data digests);
our target hands each I/O queue to a worker process after its Connect.  The guest writes and reads
back data with dd (sha256) and fio (crc32c verify) while the test checks, from the host, that the
I/O queues really live in the workers: the REST controllers view names a worker PID per I/O queue,
and /proc shows that process holding that queue's TCP socket.  Afterwards: no controller left, no
ERROR in the target's log (main process and workers), a clean exit on SIGTERM and no worker left.

The guest script and the host react as in test_kernel_host.py: `@@CHECK name PASS|FAIL@@` lines,
`@@HOST step@@` lines answered through the HTTP barrier.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.interop import vm
from tests.interop.ourtarget import IcSniffer, OurTarget, serve_target
from tests.interop.test_kernel_host import (
    GUEST_EPILOGUE,
    GUEST_PREAMBLE,
    Barrier,
    Report,
    _poll,
    guest_script_text,
    run_guest,
)
from tests.procs import child_pids

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

WORKERS = 2
TARGET_SIZE = 64 << 20
BLOCK = 512
STEP_TIMEOUT = 180.0  # the longest stretch between two host steps (32 MiB dd + fio under TCG)
SOCKETS_SETTLE = 5.0  # seconds the /proc socket view may take to settle after a hand-off or teardown
MIN_WORKER_CPU = 0.03  # CPU seconds each worker must spend during dd + fio (idle: a few ms; busy: 0.2-0.5 s)

GUEST_SCRIPT = GUEST_PREAMBLE + r"""
T=@HOST_ADDR@; IOP=@IOP@; DIGP=@DIGP@; NQN=@NQN@; GO=http://@HOST_ADDR@:@GOP@/

# ---- plain, two I/O queues (one per worker)
run connect_plain connect $IOP --nr-io-queues 2
run dmesg_plain_2_io_queues check_mapped_queues 2
run host_placement_plain host_step placement-plain
run dd_32mib_sha256 check_dd 32
# One job per CPU: blk-mq maps each CPU to its own hardware queue, so both workers serve I/O.
run fio_randrw_4k_qd16_verify run_fio --rw=randrw --bs=4k --iodepth=16 --size=8M --numjobs=2 \
    --offset_increment=8M --cpus_allowed=0-1 --cpus_allowed_policy=split --time_based --runtime=5
run host_io_plain host_step io-plain
run disconnect_plain check_disconnect
run host_gone_plain host_step gone-plain

# ---- header and data digests, two I/O queues (through the test's ICReq/ICResp sniffer on DIGP)
run connect_digests connect $DIGP --hdr-digest --data-digest --nr-io-queues 2
run dmesg_digests_2_io_queues check_mapped_queues 2
run host_placement_digests host_step placement-digests
run digests_dd_16mib_sha256 check_dd 16
run disconnect_digests check_disconnect
""" + GUEST_EPILOGUE

GUEST_CHECKS = (
    "connect_plain", "dmesg_plain_2_io_queues", "host_placement_plain", "dd_32mib_sha256",
    "fio_randrw_4k_qd16_verify", "host_io_plain", "disconnect_plain", "host_gone_plain",
    "connect_digests", "dmesg_digests_2_io_queues", "host_placement_digests", "digests_dd_16mib_sha256",
    "disconnect_digests",
)  # fmt: skip
HOST_CHECKS = (
    "workers_started",
    "rest_plain_queues_in_workers", "sockets_plain_in_workers", "workers_did_io", "stats_from_workers",
    "no_controller_after_plain",
    "rest_digests_queues_in_workers", "sockets_digests_in_workers", "digests_negotiated",
    "no_leaked_controller", "target_log_clean", "no_handoff_given_up", "target_clean_exit", "no_worker_left",
)  # fmt: skip


def guest_script(*, io_port: int, digest_port: int, go_port: int, subnqn: str) -> str:
    return guest_script_text(GUEST_SCRIPT, subnqn,
                             {"@IOP@": str(io_port), "@DIGP@": str(digest_port), "@GOP@": str(go_port)})


# ------------------------------------------------------------------------------- /proc views


def is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"target.worker" in f.read()
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def established(port: int, pids: list[int]) -> list[tuple[int, list[int]]]:
    """Each established TCP connection to 127.0.0.1:`port`: (the peer's port, the pids among `pids` holding it)."""
    want = f"0100007F:{port:04X}"
    peers: dict[str, int] = {}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == want and fields[3] == "01":  # ESTABLISHED
                peers[fields[9]] = int(fields[2].split(":")[1], 16)
    holders: dict[str, list[int]] = {inode: [] for inode in peers}
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in holders:
                holders[link[8:-1]].append(pid)
    return [(peers[inode], holders[inode]) for inode in peers]


def poll_empty(listing: Callable[[], list[Any]], timeout: float) -> tuple[bool, list[Any]]:
    """Poll `listing` until it is empty; (emptied in time, the last listing)."""
    last: list[Any] = []

    def empty() -> bool:
        last[:] = listing()
        return not last

    return _poll(empty, timeout), last


# ------------------------------------------------------------------------------- host side


class Run:
    """The host's view of the one guest run."""

    def __init__(self, target: OurTarget, barrier: Barrier, sniffer: IcSniffer, report: Report) -> None:
        self.target = target
        self.barrier = barrier
        self.sniffer = sniffer
        self.report = report
        self.workers: list[int] = []
        self.cpu_before: dict[int, float] = {}

    def find_workers(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            pids = [p for p in child_pids(self.target.proc.pid) if is_worker(p)]
            if len(pids) >= WORKERS or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.workers = pids
        started = {int(pid) for pid in re.findall(r"worker \d+ started \(pid (\d+)\)", self.target.log_text())}
        self.report.record("workers_started", len(pids) == WORKERS and started == set(pids),
                           f"worker processes under nvmeof serve: {pids}; the log says started: {sorted(started)}")

    def mine(self) -> list[dict]:
        return [c for c in self.target.controllers()
                if c["subnqn"] == self.target.subnqn and c["hostnqn"] == self.report.info.get("hostnqn")]

    def check_placement(self, phase: str, port: int) -> None:
        mine = self.mine()
        queues = [{q["qid"]: q.get("worker_pid") for q in c["queues"]} for c in mine]
        ok = len(queues) == 1 and sorted(queues[0]) == [0, 1, 2] and queues[0][0] is None
        ok = ok and {queues[0][1], queues[0][2]} == set(self.workers)
        self.report.record(f"rest_{phase}_queues_in_workers", ok,
                           f"REST qid -> worker_pid of the guest's controller(s): {queues}; expected admin "
                           f"queue None and I/O queues 1, 2 on the two workers {self.workers}")
        # Independently of the REST view: who holds each established connection to the listener. A hand-off
        # and a teardown each take a moment to reach /proc (the main process closes its copy of a moved socket
        # after the worker has it; a closed queue's socket leaves ESTABLISHED once both ends have shut it), so
        # the view is polled until it settles; what it showed last is reported.
        want = sorted([self.target.proc.pid, *self.workers])
        seen: list[tuple[int, list[int]]] = []

        def settled() -> bool:
            seen[:] = established(port, [self.target.proc.pid, *self.workers])
            return sorted(pids[0] if len(pids) == 1 else 0 for _, pids in seen) == want

        ok = _poll(settled, SOCKETS_SETTLE)
        upstream = self.sniffer.upstream_ports()
        shown = [f"peer port {peer}{' (the sniffer)' if peer in upstream else ''} held by {pids or 'no listed pid'}"
                 for peer, pids in seen]
        self.report.record(f"sockets_{phase}_in_workers", ok,
                           f"established connections to port {port} after {SOCKETS_SETTLE:.0f} s: {shown}; expected "
                           f"the main process {self.target.proc.pid} (admin queue) and each worker {self.workers} "
                           "once, each connection held by one process")

    def step(self, name: str) -> bool:
        """Do the test's part of one guest step; True after the last one."""
        report = self.report
        if name == "placement-plain":
            self.check_placement("plain", self.target.io_port)
            self.cpu_before = {pid: cpu_seconds(pid) for pid in self.workers if os.path.exists(f"/proc/{pid}")}
        elif name == "io-plain":
            spent = {pid: round(cpu_seconds(pid) - before, 2) for pid, before in self.cpu_before.items()
                     if os.path.exists(f"/proc/{pid}")}
            report.info["worker_cpu_s"] = ",".join(f"{pid}:{s}" for pid, s in spent.items())
            report.record("workers_did_io", len(spent) == WORKERS and min(spent.values()) >= MIN_WORKER_CPU,
                          f"CPU seconds each worker spent during dd + fio: {spent}; expected >= {MIN_WORKER_CPU}")
            stats: dict = {}

            def counted() -> bool:
                stats.update(self.target.api("GET", f"/subsystems/{self.target.subnqn}/namespaces/1/stats"))
                return stats["writes"] > 0 and stats["reads"] > 0 and stats["write_bytes"] >= 32 << 20

            report.record("stats_from_workers", _poll(counted, 5),
                          f"namespace 1 statistics after dd + fio: {stats}; expected reads, writes, >= 32 MiB written")
        elif name == "gone-plain":
            ok, left = poll_empty(self.target.controllers, 10)
            report.record("no_controller_after_plain", ok,
                          f"controllers still listed 10 s after the plain disconnect: {left}")
        elif name == "placement-digests":
            self.check_placement("digests", self.target.io_port)
        elif name == "all-disconnected":
            ok, left = poll_empty(self.target.controllers, 10)
            report.record("no_leaked_controller", ok,
                          f"controllers still listed 10 s after the last disconnect: {left}")
            req, resp = list(self.sniffer.icreq_digests), list(self.sniffer.icresp_digests)
            report.record("digests_negotiated",
                          len(req) == 3 and set(req) == {3} and set(resp) == {3} and len(req) == len(resp),
                          f"ICReq digest bytes {req}, ICResp digest bytes {resp}; expected 3 connections "
                          "(admin + 2 I/O queues) each asking for and granted 3 (HDGST|DDGST)")
            self.barrier.release("done")
            return True
        else:
            raise AssertionError(f"the guest script asked for an unknown host step {name!r}")
        self.barrier.release(name)
        return False


@pytest.fixture(scope="module")
def workers_report(vm_assets: vm.Assets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Report]:
    log_dir = tmp_path_factory.mktemp("kernel-host-workers")
    report = Report(console=log_dir / "guest-console.log", target_log=log_dir / "nvmeof-serve.log")
    began = time.monotonic()
    barrier = Barrier()
    run: Run | None = None
    try:
        with serve_target(log_dir, size=f"{TARGET_SIZE >> 20}M", block_size=BLOCK, check_clean_exit=False,
                          extra_args=("--workers", str(WORKERS))) as target:
            sniffer = IcSniffer(target.io_port)
            run = Run(target, barrier, sniffer, report)
            run.find_workers()
            guest = vm.Guest(vm_assets, fio=True)
            try:
                run_guest(guest, guest_script(io_port=target.io_port, digest_port=sniffer.port, go_port=barrier.port,
                                              subnqn=target.subnqn), report, run.step, step_timeout=STEP_TIMEOUT)
            finally:
                sniffer.close()
    finally:
        barrier.close()
    code = target.proc.returncode
    report.record("target_clean_exit", code == 0, f"nvmeof serve exited with status {code} on SIGTERM")
    workers = run.workers if run is not None else []
    ok, left = poll_empty(lambda: [pid for pid in workers if is_worker(pid)], 10)
    report.record("no_worker_left", bool(workers) and ok,
                  f"worker processes {left} of {workers} still running 10 s after the target exited")
    # Workers log "<date> <time> LEVEL workerN ..." to the same stderr, so log_lines sees their errors too.
    text = target.log_text()
    errors = target.log_errors()
    report.record("target_log_clean", not errors, "target log has errors:\n    " + "\n    ".join(errors[:30]))
    stayed = [line for line in text.splitlines() if "stays in the main process" in line]
    report.record("no_handoff_given_up", not stayed, "I/O queues not handed to a worker:\n    " + "\n    ".join(stayed))
    report.seconds = time.monotonic() - began
    report.print_summary(f"kernel host vs --workers {WORKERS}", GUEST_CHECKS + HOST_CHECKS, f"; info {report.info}")
    yield report


def test_io_queues_are_served_by_workers(workers_report: Report) -> None:
    workers_report.assert_passed("workers_started", "connect_plain", "dmesg_plain_2_io_queues",
                                 "host_placement_plain", "rest_plain_queues_in_workers", "sockets_plain_in_workers",
                                 "no_handoff_given_up")


def test_dd_and_fio_verify_through_workers(workers_report: Report) -> None:
    workers_report.assert_passed("dd_32mib_sha256", "fio_randrw_4k_qd16_verify", "host_io_plain", "workers_did_io",
                                 "stats_from_workers")


def test_header_and_data_digests_through_workers(workers_report: Report) -> None:
    workers_report.assert_passed("connect_digests", "dmesg_digests_2_io_queues", "host_placement_digests",
                                 "rest_digests_queues_in_workers", "sockets_digests_in_workers", "digests_negotiated",
                                 "digests_dd_16mib_sha256", "disconnect_digests")


def test_disconnect_and_shutdown_leave_nothing(workers_report: Report) -> None:
    workers_report.assert_passed("disconnect_plain", "host_gone_plain", "no_controller_after_plain",
                                 "no_leaked_controller", "target_log_clean", "target_clean_exit", "no_worker_left")


def test_every_check_reported(workers_report: Report) -> None:
    expected = set(GUEST_CHECKS + HOST_CHECKS)
    missing = expected - set(workers_report.checks)
    unknown = set(workers_report.checks) - expected
    assert not missing and not unknown, (f"checks not reported: {sorted(missing)}; unexpected: {sorted(unknown)}; "
                                         f"{workers_report.error}")
